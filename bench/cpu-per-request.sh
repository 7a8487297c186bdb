#!/bin/bash
# keel's CPU and context switches per request, and the client's latency, for one keel binary:
# keel (one worker thread, pinned to core 0) over a zero-latency keel-sim server (core 1, with the
# load generator), 16-token answers, three 5-s rounds each of: streams at 300 and 1,000 req/s,
# whole responses at 300 req/s (a control for changes to the streaming path).
#
#   bench/cpu-per-request.sh <keel binary> <label> [workdir]
#
# Compare binaries by alternating them in one run (the machine is shared; see bench/history/).
set -u
K=$1; L=$2; W=${3:-/tmp/keel-cpu-per-request}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$W"; cd "$W"
source "$here/scripts/zero-latency.sh"
zero_latency_configs
taskset -c 1 "$K" sim --config sim.toml > sim.log 2>&1 & SP=$!
taskset -c 0 "$K" serve --config keel.toml > keel.log 2>&1 & KP=$!
sleep 1.5
ctx() { cat /proc/$KP/task/*/status | awk '/ctxt_switches/ {s+=$2} END {print s}'; }
load() { taskset -c 1 "$K" sim load --url http://127.0.0.1:19400/v1 --model bench --max-tokens 16 "$@" 2>&1; }
load --rps 200 --duration 2 --stream > /dev/null
for spec in "stream 300" "stream 1000" "whole 300"; do
  set -- $spec; mode=$1; rps=$2; flag=""; [ "$mode" = stream ] && flag="--stream"
  for round in 1 2 3; do
    t0=$(awk '{print $14+$15}' /proc/$KP/stat); c0=$(ctx)
    out=$(load --rps "$rps" --duration 5 $flag)
    t1=$(awk '{print $14+$15}' /proc/$KP/stat); c1=$(ctx)
    ok=$(echo "$out" | head -1 | awk '{print $4}')
    total=$(echo "$out" | grep "^total")
    # /proc ticks are 10 ms: (ticks * 10,000 µs) / requests.
    echo "$L $mode rps=$rps round$round: ok=$ok cpu_us_per_req=$(( (t1-t0)*10000/ok )) ctx_per_req=$(echo "scale=2; ($c1-$c0)/$ok" | bc) total_p50_ms=$(echo "$total" | awk '{print $3}') total_p99_ms=$(echo "$total" | awk '{print $6}')"
  done
done
kill $KP $SP; wait $KP $SP 2>/dev/null
