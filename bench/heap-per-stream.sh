#!/bin/bash
# Where a live stream's heap goes: heaptrack of keel holding a few hundred slow streams, and the
# peak bytes grouped by the innermost frame that is not the allocator.
#
#   bench/heap-per-stream.sh <keel binary> <work dir> [RPS=100] [SECONDS=12]
#
# Build the binary with glibc's allocator and line tables so heaptrack sees every allocation:
#   CARGO_PROFILE_RELEASE_DEBUG=1 cargo build --release -p keel --features system-allocator \
#     --config 'profile.release.lto=false' --target-dir target/heap
# keel (one worker) runs on CPU 1 under heaptrack; one keel-sim server writing a token every
# 100 ms and the load generator (streams of up to 100 tokens) on CPU 0. Writes
# peak-by-site.txt into the work dir; divide by the streams open at the peak (RPS × a stream's
# length in seconds, from the load generator's `total` line).
set -u
K=$(realpath "$1"); W=$2; RPS=${3:-100}; SECS=${4:-12}
here=$(cd "$(dirname "$0")" && pwd)
command -v heaptrack > /dev/null || { echo "heaptrack not installed (apt-get install -y heaptrack)" >&2; exit 1; }
mkdir -p "$W"; cd "$W"
source "$here/scripts/zero-latency.sh"
GAP_MS=100.0 zero_latency_configs
taskset -c 0 "$K" sim --config sim.toml > sim.log 2>&1 & SP=$!
trap 'kill $SP 2>/dev/null' EXIT
rm -f heaptrack.keel.zst
taskset -c 1 heaptrack -o "$W/heaptrack.keel" "$K" serve --config keel.toml > gw.log 2>&1 & HP=$!
for _ in $(seq 1 100); do curl -s -o /dev/null -m 1 http://127.0.0.1:19400/ && break; sleep 0.2; done
taskset -c 0 "$K" sim load --url http://127.0.0.1:19400/v1 --model bench --stream --max-tokens 100 \
  --rps "$RPS" --duration "$SECS" 2>&1 | head -6
sleep 1
pkill -INT -f "$K serve --config keel.toml"
wait $HP
heaptrack_print -f heaptrack.keel.zst --print-flamegraph fg.txt --flamegraph-cost-type peak > summary.txt 2>&1
{ grep -i "peak heap\|peak RSS" summary.txt; python3 "$here/scripts/heap-by-site.py" fg.txt; } > peak-by-site.txt
cat peak-by-site.txt | head -30
