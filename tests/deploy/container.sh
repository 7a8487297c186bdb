#!/usr/bin/env bash
# The container image as the test command checks it.
#
# Always (needs only Rust and glibc's static libraries, Debian's libc6-dev):
#   1. builds keel with deploy/container/rootfs.sh — the Containerfile's build step, same script,
#      same flags — into a root filesystem, and checks with `file` and `ldd` that the binary is
#      statically linked;
#   2. runs that binary: `keel --version`, then `keel serve` on the Kubernetes ConfigMap's
#      keel.toml, GET /keel/health answers 200, SIGTERM ends it cleanly (exit 0).
# Then, where podman can build and run containers here:
#   3. builds the Containerfile's final stage (FROM scratch) with podman, taking the build
#      stage's output from step 1 (`--build-context build=...`: no base image is pulled, so
#      this works offline), runs the image read-only with every capability dropped, checks that
#      it runs as the non-root user, answers /keel/health and stops cleanly on SIGTERM.
#   Where podman cannot, the test says precisely why (podman's own error) and passes on steps 1–2.
#
# usage: tests/deploy/container.sh PYTHON [release|dev]
#   PYTHON: a venv with PyYAML (reads the ConfigMap); dev: a faster, unoptimised static build
#   (what CI uses; the Containerfile builds release).
set -euo pipefail
cd "$(dirname "$0")/../.."

python="${1:?usage: $0 PYTHON [release|dev]}"
profile="${2:-release}"
tmp="$(mktemp -d)"
serve_pid=""
container=""
image="localhost/keel-test:$$"
cleanup() {
  if [ -n "$serve_pid" ]; then kill "$serve_pid" 2>/dev/null || true; fi
  if [ -n "$container" ]; then podman rm -f "$container" >/dev/null 2>&1 || true; fi
  if command -v podman >/dev/null 2>&1; then
    podman rmi -f "$image" "$image-probe" >/dev/null 2>&1 || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }

free_port() {
  "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# GET /keel/health on PORT until it answers 200 (up to 30 s).
wait_health() {
  local port=$1 i
  for i in $(seq 1 300); do
    if curl -fsS -o "$tmp/health.json" "http://127.0.0.1:$port/keel/health" 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  return 1
}

echo "-- 1. static build (deploy/container/rootfs.sh, the Containerfile's build step; $profile profile)"
started=$(date +%s)
deploy/container/rootfs.sh "$tmp/rootfs" "$profile"
echo "   built in $(( $(date +%s) - started )) s"
bin="$tmp/rootfs/usr/local/bin/keel"
file_says="$(file -b "$bin")"
echo "   file: $file_says"
case "$file_says" in
  *"statically linked"* | *"static-pie linked"*) ;;
  *) fail "file does not call $bin statically linked" ;;
esac
ldd_says="$(ldd "$bin" 2>&1 || true)"
echo "   ldd: $ldd_says"
case "$ldd_says" in
  *"not a dynamic executable"* | *"statically linked"*) ;;
  *) fail "ldd lists shared libraries for $bin" ;;
esac
for f in etc/ssl/certs/ca-certificates.crt etc/passwd etc/group; do
  [ -s "$tmp/rootfs/$f" ] || fail "the root filesystem has no $f"
done

echo "-- 2. the static binary runs"
"$bin" --version
# The Kubernetes ConfigMap's config, with the Secret's example values as environment.
"$python" tests/deploy/k8s_check.py deploy/k8s "$tmp" > /dev/null
env_args=()
while IFS= read -r line; do env_args+=("$line"); done < "$tmp/env"
port="$(free_port)"
env "${env_args[@]}" "$bin" serve --config "$tmp/keel.toml" --listen "127.0.0.1:$port" \
  > "$tmp/serve.log" 2>&1 &
serve_pid=$!
wait_health "$port" || { cat "$tmp/serve.log" >&2; fail "keel serve (static) did not answer /keel/health"; }
echo "   keel serve answered GET /keel/health: $(head -c 120 "$tmp/health.json")"
kill -TERM "$serve_pid"
status=0
wait "$serve_pid" || status=$?
serve_pid=""
[ "$status" = 0 ] || { cat "$tmp/serve.log" >&2; fail "keel serve exited $status after SIGTERM"; }
echo "   SIGTERM: exited 0"

echo "-- 3. the image (podman)"
skip() {
  echo "   NOT RUN: $*"
  echo "   (steps 1-2 above exercised the image's build step and binary; the image itself was not built)"
  exit 0
}
command -v podman > /dev/null 2>&1 || skip "podman is not installed (Debian: apt-get install podman runc)"

# Can podman build and run anything here? A probe image holding only the static binary. When the
# plain run fails, retry with what lets it run in a VM whose limits and cgroups podman's default
# runtime cannot set (runc instead of crun; resource limits no higher than this shell's).
mkdir -p "$tmp/probe"
cp "$bin" "$tmp/probe/keel"
printf 'FROM scratch\nCOPY keel /keel\nENTRYPOINT ["/keel", "--version"]\n' > "$tmp/probe/Containerfile"
podman build -q -t "$image-probe" "$tmp/probe" > "$tmp/probe-build.log" 2>&1 \
  || skip "podman cannot build an image here: $(tail -n 3 "$tmp/probe-build.log" | tr '\n' ' ')"
run_flags=()
if ! podman run --rm "$image-probe" > "$tmp/probe-run.log" 2>&1; then
  first="$(tail -n 1 "$tmp/probe-run.log")"
  run_flags=(--ulimit "nofile=$(ulimit -Sn):$(ulimit -Sn)" --ulimit "nproc=$(ulimit -Su):$(ulimit -Su)")
  if command -v runc > /dev/null 2>&1; then run_flags=(--runtime runc "${run_flags[@]}"); fi
  podman run --rm "${run_flags[@]}" "$image-probe" > "$tmp/probe-run.log" 2>&1 \
    || skip "podman cannot run a container here: '$first'; with ${run_flags[*]}: '$(tail -n 1 "$tmp/probe-run.log")'"
  echo "   podman's plain run fails here ('$first'); running with: ${run_flags[*]}"
fi

# From here on podman works: any failure is the image's.
mkdir -p "$tmp/context"
podman build -q --build-context "build=$tmp/rootfs" -f Containerfile -t "$image" "$tmp/context" \
  > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log" >&2; fail "podman build of the Containerfile's final stage"; }
user="$(podman image inspect --format '{{.Config.User}}' "$image")"
[ "$user" = "10001:10001" ] || fail "the image runs as '$user', not the non-root 10001:10001"
size="$(podman image inspect --format '{{.Size}}' "$image")"
echo "   built $image from Containerfile (final stage): user $user, $(( size / 1024 / 1024 )) MiB"

port="$(free_port)"
chmod 0644 "$tmp/keel.toml"
container="keel-test-$$"
podman run -d --name "$container" "${run_flags[@]}" --read-only --cap-drop=ALL \
  --security-opt=no-new-privileges -p "127.0.0.1:$port:8080" \
  -v "$tmp/keel.toml:/etc/keel/keel.toml:ro" --env-file "$tmp/env" "$image" > /dev/null \
  || fail "podman run of the image"
wait_health "$port" || { podman logs "$container" >&2; fail "the container did not answer /keel/health"; }
echo "   the container answered GET /keel/health: $(head -c 120 "$tmp/health.json")"
uid="$(podman top "$container" uid | tail -n 1 | tr -d ' ')"
[ "$uid" = 10001 ] || fail "keel runs as uid '$uid' in the container, not 10001"
echo "   keel runs as uid $uid"
podman stop -t 40 "$container" > /dev/null
code="$(podman inspect --format '{{.State.ExitCode}}' "$container")"
[ "$code" = 0 ] || { podman logs "$container" >&2; fail "the container exited $code after SIGTERM"; }
echo "   SIGTERM: exited 0"
