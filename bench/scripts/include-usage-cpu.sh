#!/bin/bash
# CPU per streamed request when the client asks for stream_options.include_usage (every chunk then
# carries "usage":null): two keel binaries, alternating rounds, keel on CPU 1 with one worker
# thread, wrk (4 connections, 64-token streams) and a zero-latency keel-sim on CPU 0.
# usage: bench/scripts/include-usage-cpu.sh KEEL_BEFORE KEEL_AFTER   (needs wrk)
set -u
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
cat > "$work/sim.toml" <<T
[[servers]]
name = "fast"
port = 19301
ttft_ms = 0.0
ttft_sigma = 0.0
prefill_us_per_token = 0.0
gap_ms = 0.0
gap_sigma = 0.0
capacity = 100000
T
cat > "$work/keel.toml" <<T
worker_threads = 1
listen = "127.0.0.1:19300"
[log]
access = "off"
[[pools]]
name = "bench"
[[pools.variants]]
name = "fast"
url = "http://127.0.0.1:19301/v1"
protocol = "openai"
upstream_model = "sim"
T
cd "$work"
pkill -f "sim --config $work/sim.toml"; taskset -c 0 $1 sim --config $work/sim.toml > sim.log 2>&1 &
sleep 0.5
for r in 1 2 3; do for K in $1 $2; do
  taskset -c 1 $K serve --config $work/keel.toml > keel.log 2>&1 & sleep 1.2
  KP=$(pgrep -f "serve --config $work/keel.toml")
  taskset -c 0 wrk -t1 -c4 -d2s -s $here/include-usage.lua http://127.0.0.1:19300/v1/chat/completions >/dev/null 2>&1
  a=$(awk '{print $14+$15}' /proc/$KP/stat)
  out=$(taskset -c 0 wrk -t1 -c4 -d6s -s $here/include-usage.lua http://127.0.0.1:19300/v1/chat/completions 2>&1)
  b=$(awk '{print $14+$15}' /proc/$KP/stat)
  n=$(echo "$out" | awk '/requests in/{print $1}')
  echo "$K round $r: requests=$n cpu_us_per_req=$(( (b-a)*10000/n )) $(echo "$out" | awk '/Requests\/sec/{print "rps="$2}')"
  kill $KP; sleep 0.5
done; done
pkill -f "sim --config $work/sim.toml"
