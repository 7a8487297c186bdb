#!/bin/bash
# A cold burst: a fresh load generator sends RPS whole answers a second for 2 s to a gateway
# that has just started (no client connection open yet), as the first step of a ramp does.
# The gateway runs on CPU 1, one zero-latency keel-sim server and the load generator on CPU 0.
# Prints the load generator's summary, the gateway's share of its core over the burst, the
# client and upstream connections it held (sampled every 0.5 s), and the kernel's listen-queue
# overflows over the burst (TcpExtListenOverflows: a SYN dropped because an accept queue was
# full; the client retries it after 1 s, then 3 s, 7 s).
#
#   bench/cold-burst.sh <keel binary> <work dir> [RPS=16000] [gateway=keel|keel-passthrough|keel-capped|nginx]
#
# keel-passthrough: the pool with `assemble_non_streaming = false` (whole answers passed
# through instead of streamed upstream and assembled). keel-capped: the variant with
# `max_connections = ${CAP:-256}` and `max_pending = ${PENDING:-0}` (the rest waits in the pool's
# line, `queue_ms = 10000`, `queue_max = 100000`).
set -u
K=$(realpath "$1"); W=$2; RPS=${3:-16000}; WHO=${4:-keel}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$W"; cd "$W"
source "$here/scripts/zero-latency.sh"
zero_latency_configs
command -v nstat > /dev/null || { echo "nstat not installed (apt-get install -y iproute2)" >&2; exit 1; }
taskset -c 0 "$K" sim --config sim.toml > sim.log 2>&1 & SP=$!
GP=""
trap 'kill $SP $GP 2>/dev/null' EXIT
case $WHO in
  keel) port=19400; taskset -c 1 "$K" serve --config keel.toml > gw.log 2>&1 & GP=$! ;;
  keel-passthrough)
    port=19400
    sed 's/^name = "bench"$/name = "bench"\nassemble_non_streaming = false/' keel.toml > keel-pt.toml
    taskset -c 1 "$K" serve --config keel-pt.toml > gw.log 2>&1 & GP=$! ;;
  keel-capped)
    port=19400
    sed -e 's/^name = "bench"$/name = "bench"\nqueue_ms = 10000\nqueue_max = 100000/' \
        -e "s/^upstream_model = \"sim\"$/upstream_model = \"sim\"\nmax_connections = ${CAP:-256}\nmax_pending = ${PENDING:-0}/" keel.toml > keel-cap.toml
    taskset -c 1 "$K" serve --config keel-cap.toml > gw.log 2>&1 & GP=$! ;;
  nginx)
    port=19404
    bash "$here/peers/nginx.sh" "$W/nginx" 19404 http://127.0.0.1:19401/v1 > /dev/null 2>&1
    kill "$(cat "$W/nginx/nginx.pid")" 2>/dev/null; sleep 0.5
    taskset -c 1 nginx -c "$W/nginx/nginx.conf" -p "$W/nginx" -g "daemon off; master_process off;" > gw.log 2>&1 & GP=$! ;;
  *) echo "unknown gateway $WHO" >&2; exit 2 ;;
esac
for _ in $(seq 1 50); do curl -s -o /dev/null -m 1 "http://127.0.0.1:$port/" && break; sleep 0.1; done
echo "$WHO: listen backlog $(ss -lnt "( sport = :$port )" | tail -1 | awk '{print $3}'), upstream's $(ss -lnt '( sport = :19401 )' | tail -1 | awk '{print $3}')"
cpu() { awk '{print $14 + $15}' "/proc/$GP/stat"; }
c0=$(cpu); t0=$(date +%s.%N)
nstat -n
( for i in 1 2 3 4; do
    sleep 0.5
    echo "  t=${i}×0.5 s: client connections $(ss -tn state established "( sport = :$port )" | tail -n +2 | wc -l), upstream connections $(ss -tn state established '( dport = :19401 )' | tail -n +2 | wc -l)"
  done ) & SAMPLER=$!
taskset -c 0 "$K" sim load --url "http://127.0.0.1:$port/v1" --model bench --max-tokens 16 --rps "$RPS" --duration 2 --json "$W/load.json" 2>&1 | head -3
echo "  errors by kind: $(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('error_kinds', '?'))" "$W/load.json" 2>/dev/null)"
wait "$SAMPLER"
c1=$(cpu); t1=$(date +%s.%N)
o=$(nstat | awk '/TcpExtListenOverflows/ {print $2}' | head -1); echo "  listen-queue overflows: ${o:-0}"
echo "  gateway CPU: $(echo "($c1 - $c0) / 100 / ($t1 - $t0)" | bc -l | cut -c1-4) of a core"
