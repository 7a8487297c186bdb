#!/bin/bash
# The cost of TLS in: the latency keel adds to small whole answers when clients reach it over
# HTTPS (`[tls]`), against the same keel over plain HTTP, and beside nginx terminating TLS in
# front of the same upstream, in one run. One zero-latency keel-sim upstream; keel (one
# worker) and nginx (one worker) on core 0, keel-sim and the load generator on core 1
# (without taskset or with one core: unpinned). Certificates from a CA made here with openssl
# (ECDSA P-256, the server's for 127.0.0.1); the load generator trusts that CA, nothing skips
# verification. Clients speak HTTP/1.1 to every target (`keel sim load --http1`, where ALPN
# would pick HTTP/2 for keel) over kept-alive connections, so the figures are the steady cost
# of encrypting requests and answers, not handshakes; `keel-tls-h2` adds keel over TLS with
# HTTP/2 chosen by ALPN.
#
# Each round runs direct (the upstream called straight), then every target, at RPS for SECONDS;
# "added" is a target's percentile minus direct's in the same round, and the figure is the
# median over ROUNDS rounds.
#
#   bench/tls-overhead.sh <keel binary> [rps=500] [seconds=10] [rounds=5] [workdir]
set -eu
K=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
RPS=${2:-500}; DUR=${3:-10}; ROUNDS=${4:-5}; W=${5:-/tmp/keel-tls-overhead}
here=$(cd "$(dirname "$0")" && pwd)
command -v nginx >/dev/null || { echo "nginx not installed (apt-get install -y nginx)" >&2; exit 1; }
command -v openssl >/dev/null || { echo "openssl not installed (apt-get install -y openssl)" >&2; exit 1; }
mkdir -p "$W"; cd "$W"; W=$(pwd)
source "$here/scripts/zero-latency.sh"
zero_latency_configs

# Command prefixes (arrays, not functions: a function run in the background is a subshell
# whose pid is not the server's).
if command -v taskset >/dev/null && [ "$(nproc)" -ge 2 ]; then
  GW=(taskset -c 0); BENCH=(taskset -c 1); pinning="gateways on CPU 0, keel-sim and load on CPU 1"
else
  GW=(); BENCH=(); pinning="unpinned"
fi

# A test CA and a server certificate for 127.0.0.1 it signed.
openssl ecparam -name prime256v1 -genkey -noout -out ca.key 2>/dev/null
openssl req -x509 -new -key ca.key -subj "/CN=keel bench CA" -days 2 -out ca.pem 2>/dev/null
openssl ecparam -name prime256v1 -genkey -noout -out server-sec1.key 2>/dev/null
openssl pkcs8 -topk8 -nocrypt -in server-sec1.key -out server.key
openssl req -new -key server.key -subj "/CN=127.0.0.1" -out server.csr 2>/dev/null
printf "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n" > server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
  -extfile server.ext -out server.pem 2>/dev/null

# keel over plain HTTP on 19400 (zero-latency.sh's keel.toml) and over TLS on 19402.
sed 's/^listen = .*/listen = "127.0.0.1:19402"/' keel.toml > keel-tls.toml
printf '[tls]\ncert_file = "%s/server.pem"\nkey_file = "%s/server.key"\n' "$W" "$W" >> keel-tls.toml
# nginx terminating TLS on 19403 in front of the same upstream (one worker, kept-alive
# upstream connections, no buffering: as bench/peers/nginx.sh, with ssl).
mkdir -p nginx/logs
cat > nginx/nginx.conf <<NGINX
user root;
worker_processes 1;
pid $W/nginx/nginx.pid;
error_log $W/nginx/logs/error.log warn;
events { worker_connections 16384; }
http {
  access_log off;
  upstream fleet { server 127.0.0.1:19401 max_fails=0; keepalive 64; }
  server {
    listen 127.0.0.1:19403 ssl;
    ssl_certificate $W/server.pem;
    ssl_certificate_key $W/server.key;
    location / {
      proxy_pass http://fleet;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }
  }
}
NGINX

SP=; KP=; TP=
cleanup() {
  set +e
  for p in $SP $KP $TP; do kill "$p" 2>/dev/null; done
  [ -f "$W/nginx/nginx.pid" ] && kill "$(cat "$W/nginx/nginx.pid")" 2>/dev/null
  wait 2>/dev/null
}
trap cleanup EXIT
for port in 19400 19401 19402 19403; do
  if (echo > "/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "port $port is taken: another run still going?" >&2; exit 1
  fi
done
"${BENCH[@]}" "$K" sim --config sim.toml > sim.log 2>&1 & SP=$!
"${GW[@]}" "$K" serve --config keel.toml > keel.log 2>&1 & KP=$!
"${GW[@]}" "$K" serve --config keel-tls.toml > keel-tls.log 2>&1 & TP=$!
"${GW[@]}" nginx -c "$W/nginx/nginx.conf" -p "$W/nginx"
sleep 2
for p in $SP $KP $TP; do
  kill -0 "$p" 2>/dev/null || { echo "a server exited at start: see $W/*.log" >&2; exit 1; }
done

# target name, base URL, extra load flags
targets=(
  "direct http://127.0.0.1:19401/v1 --http1"
  "keel-http http://127.0.0.1:19400/v1 --model bench --http1"
  "keel-tls https://127.0.0.1:19402/v1 --model bench --http1 --ca-file $W/ca.pem"
  "nginx-tls https://127.0.0.1:19403/v1 --http1 --ca-file $W/ca.pem"
  "keel-tls-h2 https://127.0.0.1:19402/v1 --model bench --ca-file $W/ca.pem"
)
run() { # name url flags... -> runs/<round>-<name>.json
  local name=$1 url=$2; shift 2
  local model=sim
  [ "${1:-}" = --model ] && { model=$2; shift 2; }
  "${BENCH[@]}" "$K" sim load --url "$url" --model "$model" --max-tokens 16 --rps "$RPS" \
    --duration "$DUR" --json "runs/$round-$name.json" "$@" > "runs/$round-$name.txt" 2>&1
}
mkdir -p runs
for t in "${targets[@]}"; do round=warm; run $t; done
for round in $(seq 1 "$ROUNDS"); do
  for t in "${targets[@]}"; do run $t; done
  echo "round $round done" >&2
done

python3 - "$ROUNDS" "$RPS" "$DUR" "$pinning" <<'PY'
import json, statistics, sys
rounds, rps, dur, pinning = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
names = ["direct", "keel-http", "keel-tls", "nginx-tls", "keel-tls-h2"]
def report(r, name):
    return json.load(open(f"runs/{r}-{name}.json"))
def pct(r, name, q):
    return report(r, name)["total"][f"{q}_ms"]
def errors(r, name):
    return report(r, name)["errors"]
print(f"TLS in: small whole answers (16 tokens), {rps} req/s for {dur} s, median of {rounds} rounds; {pinning}")
print(f"{'target':<12} {'P50 ms':>8} {'P99 ms':>8} {'added P50':>10} {'added P99':>10} {'errors':>7}")
for n in names:
    p50 = statistics.median(pct(r, n, "p50") for r in range(1, rounds + 1))
    p99 = statistics.median(pct(r, n, "p99") for r in range(1, rounds + 1))
    a50 = statistics.median(pct(r, n, "p50") - pct(r, "direct", "p50") for r in range(1, rounds + 1))
    a99 = statistics.median(pct(r, n, "p99") - pct(r, "direct", "p99") for r in range(1, rounds + 1))
    errs = sum(errors(r, n) for r in range(1, rounds + 1))
    print(f"{n:<12} {p50:>8.3f} {p99:>8.3f} {a50:>10.3f} {a99:>10.3f} {errs:>7}")
def paired(a, b, q):
    return statistics.median(pct(r, a, q) - pct(r, b, q) for r in range(1, rounds + 1))
print("round by round (median of the differences):")
for a, b in [("keel-tls", "keel-http"), ("keel-tls-h2", "keel-http"), ("keel-tls", "nginx-tls")]:
    print(f"  {a} - {b}: P50 {paired(a, b, 'p50'):+.3f} ms, P99 {paired(a, b, 'p99'):+.3f} ms")
PY
