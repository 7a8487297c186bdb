#!/bin/bash
# heaptrack of keel (glibc build) holding ~1,000 slow streams
set -u
K=${K:-/work/main/target/heap/release/keel}
cd /tmp/heap
cat > keel.toml <<TOML
worker_threads = 1
listen = "127.0.0.1:19400"
[log]
access = "off"
[[pools]]
name = "bench"
[[pools.variants]]
name = "slow"
url = "http://127.0.0.1:19401/v1"
protocol = "openai"
upstream_model = "sim"
TOML
cat > sim.toml <<'TOML'
[[servers]]
name = "slow"
port = 19401
ttft_ms = 0.0
ttft_sigma = 0.0
prefill_us_per_token = 0.0
gap_ms = 100.0
gap_sigma = 0.0
capacity = 100000
TOML
taskset -c 0 $K sim --config sim.toml > sim.log 2>&1 & SP=$!
rm -f heaptrack.*.zst
taskset -c 1 heaptrack -o /tmp/heap/heaptrack.keel $K serve --config keel.toml > gw.log 2>&1 & HP=$!
for _ in $(seq 1 100); do curl -s -o /dev/null -m 1 http://127.0.0.1:19400/ && break; sleep 0.2; done
taskset -c 0 $K sim load --url http://127.0.0.1:19400/v1 --model bench --stream --max-tokens 100 --rps 100 --duration 12 2>&1 | head -6
sleep 1
pkill -INT -f "heaptrack.*serve --config keel.toml" ; pkill -INT -f "release/keel serve --config keel.toml"
wait $HP
kill $SP
ls -la /tmp/heap
