#!/bin/bash
# CPU per streamed request when the client asks for stream_options.include_usage (every chunk then
# carries "usage":null): two keel binaries, alternating rounds, keel on CPU 1 with one worker
# thread, wrk (4 connections, 64-token streams) and a zero-latency keel-sim on CPU 0.
# usage: bench/scripts/include-usage-cpu.sh KEEL_BEFORE KEEL_AFTER   (needs wrk)
set -u
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
cd "$work"
source "$here/zero-latency.sh"
zero_latency_configs
pkill -f "sim --config $work/sim.toml"; taskset -c 0 $1 sim --config $work/sim.toml > sim.log 2>&1 &
sleep 0.5
for r in 1 2 3; do for K in $1 $2; do
  taskset -c 1 $K serve --config $work/keel.toml > keel.log 2>&1 & sleep 1.2
  KP=$(pgrep -f "serve --config $work/keel.toml")
  taskset -c 0 wrk -t1 -c4 -d2s -s $here/include-usage.lua http://127.0.0.1:19400/v1/chat/completions >/dev/null 2>&1
  a=$(awk '{print $14+$15}' /proc/$KP/stat)
  out=$(taskset -c 0 wrk -t1 -c4 -d6s -s $here/include-usage.lua http://127.0.0.1:19400/v1/chat/completions 2>&1)
  b=$(awk '{print $14+$15}' /proc/$KP/stat)
  n=$(echo "$out" | awk '/requests in/{print $1}')
  echo "$K round $r: requests=$n cpu_us_per_req=$(( (b-a)*10000/n )) $(echo "$out" | awk '/Requests\/sec/{print "rps="$2}')"
  kill $KP; sleep 0.5
done; done
pkill -f "sim --config $work/sim.toml"
