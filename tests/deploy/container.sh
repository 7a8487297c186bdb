#!/usr/bin/env bash
# The container image as the test command checks it.
#
#   1. Can podman build and run an image here? A probe image holding a tiny static executable
#      (rustc, the static flags of the image's build) answers in seconds. Where podman cannot,
#      the test says why in one line and passes without building anything else: the static
#      build below is a whole second compile of keel, worth making only for an image.
#   2. Builds keel with deploy/container/rootfs.sh (the Containerfile's build step, same script,
#      same flags) into a root filesystem, and checks with `file` and `ldd` that the binary is
#      statically linked.
#   3. Runs that binary: `keel --version`; `keel serve` in front of a simulated model server
#      addressed by name (`keel sim`): GET /keel/ready 200, a chat completion, SIGTERM ends it
#      cleanly (exit 0).
#   4. Builds the Containerfile's final stage (FROM scratch) with podman, taking the build
#      stage's output from step 2 (`--build-context build=...`: no base image is pulled, so
#      this works offline), runs the image read-only with every capability dropped: on the
#      Kubernetes ConfigMap's keel.toml it runs as the non-root user, answers /keel/ready and
#      stops cleanly on SIGTERM; and a chat completion goes through it to the simulated server.
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
sim_pid=""
container=""
image="localhost/keel-test:$$"
cleanup() {
  if [ -n "$serve_pid" ]; then kill "$serve_pid" 2>/dev/null || true; fi
  if [ -n "$sim_pid" ]; then kill "$sim_pid" 2>/dev/null || true; fi
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

# GET /keel/ready on PORT until it answers 200 (up to 30 s): readiness needs no key, the
# ConfigMap's config has keys.
wait_health() {
  local port=$1 i
  for i in $(seq 1 300); do
    if curl -fsS -o "$tmp/health.json" "http://127.0.0.1:$port/keel/ready" 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  return 1
}

echo "-- 1. can podman build and run an image here?"
skip() {
  echo "   NOT RUN: $*; so neither the static build nor the image is made (a second compile of keel, for an image that cannot be built here)"
  exit 0
}
command -v podman > /dev/null 2>&1 || skip "podman is not installed (Debian: apt-get install podman runc)"

# A probe image holding only a tiny static executable, linked as rootfs.sh links keel.
mkdir -p "$tmp/probe"
host="$(rustc -vV | sed -n 's/^host: //p')"
printf 'fn main() { println!("probe ok"); }\n' > "$tmp/probe/probe.rs"
rustc -C target-feature=+crt-static --target "$host" -o "$tmp/probe/probe" "$tmp/probe/probe.rs" \
  > "$tmp/probe-rustc.log" 2>&1 \
  || { cat "$tmp/probe-rustc.log" >&2; fail "cannot link a static executable (Debian: libc6-dev), as the image's build must"; }
printf 'FROM scratch\nCOPY probe /probe\nENTRYPOINT ["/probe"]\n' > "$tmp/probe/Containerfile"
podman build -q -t "$image-probe" "$tmp/probe" > "$tmp/probe-build.log" 2>&1 \
  || skip "podman cannot build an image here: $(tail -n 3 "$tmp/probe-build.log" | tr '\n' ' ')"
# Which settings run a container here: podman's own, or, in a VM whose limits and cgroups its
# default runtime cannot set, runc with open files no more than this shell's and a process limit
# well below it (keel needs a thread per core and a few more). Whichever works is one line below;
# what the default said is kept in the log only when nothing works.
run_flags=()
fallback=(--ulimit "nofile=$(ulimit -Sn):$(ulimit -Sn)" --ulimit nproc=4096:4096)
if command -v runc > /dev/null 2>&1; then fallback=(--runtime runc "${fallback[@]}"); fi
if podman run --rm "$image-probe" > "$tmp/probe-run.log" 2>&1; then
  echo "   podman runs containers here with its default settings"
elif podman run --rm "${fallback[@]}" "$image-probe" > "$tmp/probe-run-fallback.log" 2>&1; then
  run_flags=("${fallback[@]}")
  echo "   podman runs containers here with ${run_flags[*]} (its default runtime settings cannot)"
else
  skip "podman cannot run a container here: '$(tail -n 1 "$tmp/probe-run.log")'; with ${fallback[*]}: '$(tail -n 1 "$tmp/probe-run-fallback.log")'"
fi

echo "-- 2. static build (deploy/container/rootfs.sh, the Containerfile's build step; $profile profile)"
started=$(date +%s)
# Where the Containerfile's build stage leaves it: /rootfs (the stage's filesystem is $tmp/stage).
deploy/container/rootfs.sh "$tmp/stage/rootfs" "$profile"
echo "   built in $(( $(date +%s) - started )) s"
bin="$tmp/stage/rootfs/usr/local/bin/keel"
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
  [ -s "$tmp/stage/rootfs/$f" ] || fail "the root filesystem has no $f"
done

echo "-- 3. the static binary runs and serves"
"$bin" --version
# The Kubernetes ConfigMap's config (and the Secret's example values as environment), for the
# image below; and a small config in front of a simulated model server (keel's own `keel sim`)
# reached by a host *name*, so that a request exercises name resolution in the static binary.
"$python" tests/deploy/k8s_check.py deploy/k8s "$tmp" > /dev/null
# The example's keys are published in the repository, and keel refuses them (tests/deploy/k8s.sh
# checks that): fresh ones in their place, as an operator deploying it makes.
for old in $(grep -o 'sha256:[0-9a-f]\{64\}' "$tmp/keel.toml"); do
  new=$("$bin" keys new --id fresh | grep -o 'sha256:[0-9a-f]\{64\}')
  sed -i "s/$old/$new/" "$tmp/keel.toml"
done
sim_port="$(free_port)"
printf '[[servers]]\nname = "sim"\nport = %s\nttft_ms = 5\ngap_ms = 1\n' "$sim_port" > "$tmp/sim.toml"
"$bin" sim --config "$tmp/sim.toml" > "$tmp/sim.log" 2>&1 &
sim_pid=$!
for _ in $(seq 1 300); do
  if (echo > "/dev/tcp/127.0.0.1/$sim_port") 2>/dev/null; then break; fi
  sleep 0.1
done
traffic_config() {  # listen address → a keel.toml whose one variant is the simulated server
  printf 'listen = "%s"\ndrain_ms = 2000\n[[pools]]\nname = "chat"\n[[pools.variants]]\n' "$1"
  printf 'name = "sim"\nurl = "http://localhost:%s/v1"\nprotocol = "openai"\nupstream_model = "m"\n' "$sim_port"
}
port="$(free_port)"
traffic_config "127.0.0.1:$port" > "$tmp/traffic.toml"
chmod 0644 "$tmp/traffic.toml" "$tmp/keel.toml"

# One chat completion through keel on PORT; its answer must be a completion with text.
chat() {
  curl -fsS "http://127.0.0.1:$1/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"chat","max_tokens":8,"messages":[{"role":"user","content":"hello"}]}' \
    > "$tmp/chat.json" || return 1
  grep -q '"content":"[^"]' "$tmp/chat.json"
}

"$bin" serve --config "$tmp/traffic.toml" > "$tmp/serve.log" 2>&1 &
serve_pid=$!
wait_health "$port" || { cat "$tmp/serve.log" >&2; fail "keel serve (static) did not answer /keel/ready"; }
echo "   keel serve answered GET /keel/ready: $(head -c 100 "$tmp/health.json")"
chat "$port" || { cat "$tmp/serve.log" "$tmp/chat.json" >&2; fail "no completion through the static keel"; }
echo "   a chat completion through it (upstream http://localhost:$sim_port): $(head -c 100 "$tmp/chat.json")"
kill -TERM "$serve_pid"
status=0
wait "$serve_pid" || status=$?
serve_pid=""
[ "$status" = 0 ] || { cat "$tmp/serve.log" >&2; fail "keel serve exited $status after SIGTERM"; }
echo "   SIGTERM: exited 0"

echo "-- 4. the image (podman)"
# podman works here (step 1): any failure is the image's.
mkdir -p "$tmp/context"
podman build -q --build-context "build=$tmp/stage" -f Containerfile -t "$image" "$tmp/context" \
  > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log" >&2; fail "podman build of the Containerfile's final stage"; }
user="$(podman image inspect --format '{{.Config.User}}' "$image")"
[ "$user" = "10001:10001" ] || fail "the image runs as '$user', not the non-root 10001:10001"
size="$(podman image inspect --format '{{.Size}}' "$image")"
echo "   built $image from Containerfile (final stage): user $user, $(( size / 1024 / 1024 )) MiB"

# (a) The ConfigMap's config, as in Kubernetes: read-only root, no capabilities, port published.
port="$(free_port)"
container="keel-test-$$"
podman run -d --name "$container" "${run_flags[@]}" --read-only --cap-drop=ALL \
  --security-opt=no-new-privileges -p "127.0.0.1:$port:8080" \
  -v "$tmp/keel.toml:/etc/keel/keel.toml:ro" --env-file "$tmp/env" "$image" > /dev/null \
  || fail "podman run of the image"
wait_health "$port" || { podman logs "$container" >&2; fail "the container did not answer /keel/ready"; }
echo "   the container (ConfigMap config) answered GET /keel/ready: $(head -c 100 "$tmp/health.json")"
# The process's real uid, read from the host (`podman top` would need ps inside the image).
pid="$(podman inspect --format '{{.State.Pid}}' "$container")"
uid="$(awk '/^Uid:/ { print $2 }' "/proc/$pid/status")"
[ "$uid" = 10001 ] || fail "keel runs as uid '$uid' in the container, not 10001"
echo "   keel runs as uid $uid"
podman stop -t 40 "$container" > /dev/null
code="$(podman inspect --format '{{.State.ExitCode}}' "$container")"
[ "$code" = 0 ] || { podman logs "$container" >&2; fail "the container exited $code after SIGTERM"; }
echo "   SIGTERM: exited 0"
podman rm -f "$container" > /dev/null

# (b) Traffic: on the host's network, a completion from the simulated server named
# `localhost`: name resolution and proxying work in an image that has no libc but keel's own.
port="$(free_port)"
traffic_config "127.0.0.1:$port" > "$tmp/traffic.toml"
podman run -d --name "$container" "${run_flags[@]}" --read-only --cap-drop=ALL --network host \
  -v "$tmp/traffic.toml:/etc/keel/keel.toml:ro" "$image" > /dev/null \
  || fail "podman run of the image on the host's network"
wait_health "$port" || { podman logs "$container" >&2; fail "the container (host network) did not answer /keel/ready"; }
chat "$port" || { podman logs "$container" >&2; cat "$tmp/chat.json" >&2; fail "no completion through the container"; }
echo "   a chat completion through the container: $(head -c 100 "$tmp/chat.json")"
podman stop -t 40 "$container" > /dev/null
