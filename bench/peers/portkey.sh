#!/usr/bin/env bash
# Portkey's open-source AI gateway over a simulated fleet: bench/peers/portkey.sh DIR PORT BASE_URL...
# Installs @portkey-ai/gateway from npm into bench/.peers/portkey (once) and starts it headless
# (pid in DIR/portkey.pid). Portkey takes its routing per request, in the x-portkey-config
# header: written to DIR/headers.json, which the bench client sends with every request —
# fallback over two load-balanced groups of every variant, with retries on 429/5xx.
# Known (2026-11): with @portkey-ai/gateway 1.15.2 (and 1.9.8) on Node, every *streamed* request
# fails inside the gateway ("TypeError: immutable" from undici's Headers.append in
# updateHeaders; upstream issues Portkey-AI/gateway#1389 and #1550). Node 22 and an npm override
# of @hono/node-server to 1.14.2 (the workaround in #1389) did not help here. Non-streaming
# requests work, so `keel bench overhead` measures Portkey on whole responses.
set -euo pipefail
mkdir -p "$1"
dir=$(cd "$1" && pwd)
port=$2
shift 2
prefix=${PORTKEY_PREFIX:-bench/.peers/portkey}
if [ ! -f "$prefix/node_modules/@portkey-ai/gateway/build/start-server.js" ]; then
  mkdir -p "$prefix"
  (cd "$prefix" && npm install --silent --no-audit --no-fund @portkey-ai/gateway >&2) || { echo "Portkey gateway could not be installed from npm" >&2; exit 1; }
fi
targets=""
for u in "$@"; do
  targets="$targets${targets:+,}{\"provider\":\"openai\",\"custom_host\":\"$u\",\"api_key\":\"unused\",\"weight\":1}"
done
group="{\"strategy\":{\"mode\":\"loadbalance\"},\"targets\":[$targets]}"
config="{\"strategy\":{\"mode\":\"fallback\",\"on_status_codes\":[429,500,502,503,504]},\"retry\":{\"attempts\":2,\"on_status_codes\":[429,500,502,503,504]},\"request_timeout\":60000,\"targets\":[$group,$group]}"
python3 -c 'import json,sys; print(json.dumps({"x-portkey-config": sys.argv[1]}))' "$config" > "$dir/headers.json"
nohup node "$prefix/node_modules/@portkey-ai/gateway/build/start-server.js" --port="$port" --headless > "$dir/portkey.log" 2>&1 &
echo $! > "$dir/portkey.pid"
