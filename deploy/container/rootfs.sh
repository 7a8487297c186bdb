#!/usr/bin/env bash
# Builds keel as one statically linked executable and lays out the container image's whole root
# filesystem in OUT_DIR:
#
#   usr/local/bin/keel                  the binary (glibc, linked statically: no loader, no .so)
#   etc/ssl/certs/ca-certificates.crt   the build system's CA bundle (keel's TLS to upstreams
#                                       and Redis verifies against it)
#   etc/passwd, etc/group               the non-root user `keel` (uid/gid 10001)
#   etc/keel/                           where the config is mounted (keel.toml)
#   tmp/                                writable scratch space
#
# The Containerfile's build stage runs this script, and so does tests/deploy/container.sh on the
# host, so the test exercises exactly the image's build steps and flags.
#
# usage: deploy/container/rootfs.sh OUT_DIR [release|dev]
set -euo pipefail
cd "$(dirname "$0")/../.."

out="${1:?usage: $0 OUT_DIR [release|dev]}"
profile="${2:-release}"
case "$profile" in
  release) profile_dir=release ;;
  dev) profile_dir=debug ;;
  *) echo "rootfs.sh: profile must be release or dev, not '$profile'" >&2; exit 2 ;;
esac

# Static glibc: `+crt-static` on the gnu target links libc.a (Debian's libc6-dev) into the
# binary. An explicit --target keeps the flag off build scripts and proc macros, which must stay
# dynamic libraries for the compiler to load them.
host="$(rustc -vV | sed -n 's/^host: //p')"
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
  cargo build --locked --profile "$profile" -p keel --target "$host"

target_dir="$(cargo metadata --format-version 1 --no-deps \
  | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
bin="$target_dir/$host/$profile_dir/keel"

# A static executable has no program interpreter and needs no shared library.
if readelf -lW "$bin" | grep -q 'INTERP' || readelf -dW "$bin" | grep -q '(NEEDED)'; then
  echo "rootfs.sh: $bin is not statically linked:" >&2
  readelf -dW "$bin" | grep '(NEEDED)' >&2 || true
  exit 1
fi

ca=/etc/ssl/certs/ca-certificates.crt
if [ ! -s "$ca" ]; then
  echo "rootfs.sh: no CA bundle at $ca (install Debian's ca-certificates)" >&2
  exit 1
fi

rm -rf "$out"
mkdir -p "$out/usr/local/bin" "$out/etc/ssl/certs" "$out/etc/keel" "$out/tmp"
chmod 1777 "$out/tmp"
install -m 0755 "$bin" "$out/usr/local/bin/keel"
install -m 0644 "$ca" "$out/etc/ssl/certs/ca-certificates.crt"
echo 'keel:x:10001:10001:keel:/nonexistent:/sbin/nologin' > "$out/etc/passwd"
echo 'keel:x:10001:' > "$out/etc/group"
echo "rootfs.sh: $out ready ($profile build of $host, $(du -sh "$out/usr/local/bin/keel" | cut -f1) binary)"
