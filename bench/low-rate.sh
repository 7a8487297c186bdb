#!/bin/bash
# keel at a low rate: CPU per request, minor page faults per request and client latency at
# <rps> req/s with mimalloc's purge delay 0 (keel's setting) and 1,000 ms, alternating twice;
# then the idle gateway's own CPU over 30 s. keel (one worker) on core 0; a zero-latency keel-sim
# and the load generator on core 1.
#
#   bench/low-rate.sh <keel binary> [rps=10] [seconds=30] [workdir]
set -u
K=$1; RPS=${2:-10}; DUR=${3:-30}; W=${4:-/tmp/keel-low-rate}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$W"; cd "$W"
source "$here/scripts/zero-latency.sh"
zero_latency_configs
taskset -c 1 "$K" sim --config sim.toml > sim.log 2>&1 & SP=$!
sleep 0.5
load() { taskset -c 1 "$K" sim load --url http://127.0.0.1:19400/v1 --model bench --max-tokens 16 "$@" 2>&1; }
ticks() { awk '{print $14+$15}' /proc/$KP/stat; }
start_keel() {
  MIMALLOC_PURGE_DELAY=$1 taskset -c 0 "$K" serve --config keel.toml > keel.log 2>&1 & KP=$!
  sleep 1.5
  load --rps 200 --duration 2 --stream > /dev/null
  sleep 1
}
for round in 1 2; do
  for pd in 0 1000; do
    start_keel $pd
    for mode in stream whole; do
      flag=""; [ "$mode" = stream ] && flag="--stream"
      t0=$(ticks); f0=$(awk '{print $10}' /proc/$KP/stat)
      out=$(load --rps "$RPS" --duration "$DUR" $flag)
      t1=$(ticks); f1=$(awk '{print $10}' /proc/$KP/stat)
      ok=$(echo "$out" | head -1 | awk '{print $4}')
      total=$(echo "$out" | grep "^total" | awk '{print $3" / "$6}')
      # /proc ticks are 10 ms: (ticks * 10,000 µs) / requests.
      echo "purge_delay=$pd round$round $mode rps=$RPS ok=$ok cpu_us_per_req=$(( (t1-t0)*10000/ok )) minflt_per_req=$(( (f1-f0)/ok )) total_p50/p99_ms=$total"
    done
    kill $KP; wait $KP 2>/dev/null
  done
done
start_keel 0
c() { cat /proc/$KP/task/*/status | awk '/^voluntary_ctxt_switches/ {s+=$2} END {print s}'; }
t0=$(ticks); c0=$(c); sleep 30; t1=$(ticks); c1=$(c)
echo "idle 30 s: cpu_ms=$(( (t1-t0)*10 )) wakeups=$((c1-c0))"
kill $KP $SP; wait $KP $SP 2>/dev/null
