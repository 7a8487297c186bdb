#!/usr/bin/env bash
# OAuth tokens keel fetches for a Vertex AI service account, per 1,000 requests after warm-up
# (goal: 0). One keel-sim server plays Vertex AI and its token endpoint (it checks the JWT
# grant's claims and counts the tokens it issues); keel serves 1,000 requests (50 req/s for
# 20 s, half streamed) through a pool of a Vertex Claude and a Vertex Gemini variant that
# authenticate with a service-account key file.
#   bench/vertex-tokens.sh [path/to/keel]   (default: target/release/keel)
set -euo pipefail
KEEL=${1:-target/release/keel}
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; [ -n "${KEEP:-}" ] || rm -rf "$dir"' EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
sim=$(port); gw=$(port)
"$KEEL" sim --servers 1 --base-port "$sim" > "$dir/sim.log" 2>&1 &
python3 - "$sim" "$dir/sa.json" <<'PY'
import json, sys
fixture = json.load(open("crates/keel-gateway/tests/fixtures/service-account.json"))
fixture["token_uri"] = f"http://127.0.0.1:{sys.argv[1]}/token"
json.dump(fixture, open(sys.argv[2], "w"))
PY
cat > "$dir/keel.toml" <<TOML
listen = "127.0.0.1:$gw"
[[pools]]
name = "vertex"
[[pools.variants]]
name = "vertex-claude"
protocol = "vertex"
url = "http://127.0.0.1:$sim"
project = "bench"
location = "us-east5"
upstream_model = "claude-sim@1"
credentials_file = "$dir/sa.json"
[[pools.variants]]
name = "vertex-gemini"
protocol = "vertex"
url = "http://127.0.0.1:$sim"
project = "bench"
location = "us-east5"
upstream_model = "gemini-sim"
credentials_file = "$dir/sa.json"
TOML
"$KEEL" serve --config "$dir/keel.toml" > "$dir/keel.log" 2>&1 &
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$gw/keel/ready" >/dev/null && break; sleep 0.1; done
fetches() { curl -s "http://127.0.0.1:$gw/metrics" | awk '/^keel_upstream_token_fetches_total/ {s += $2} END {print s + 0}'; }
warm=$(fetches)
"$KEEL" sim load --url "http://127.0.0.1:$gw/v1" --model vertex --rps 25 --duration 20 --json "$dir/whole.json" > /dev/null
"$KEEL" sim load --url "http://127.0.0.1:$gw/v1" --model vertex --rps 25 --duration 20 --stream --json "$dir/stream.json" > /dev/null
after=$(fetches)
issued=$(curl -s "http://127.0.0.1:$sim/sim/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_issued"])')
python3 - "$dir/whole.json" "$dir/stream.json" "$warm" "$after" "$issued" <<'PY'
import json, sys
reqs = errs = 0
for f in sys.argv[1:3]:
    r = json.load(open(f))
    reqs += r["sent"]; errs += r["errors"]
warm, after, issued = (float(x) for x in sys.argv[3:6])
print(f"requests {reqs}, errors {errs}; token fetches at warm-up {warm:.0f}, after {after:.0f}; "
      f"fetched per 1,000 requests after warm-up: {(after - warm) * 1000 / max(reqs, 1):.2f}; "
      f"tokens the endpoint issued: {issued:.0f}")
PY
