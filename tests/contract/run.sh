#!/usr/bin/env bash
# Contract test: keel in front of a fault-free keel-sim fleet, fuzzed by schemathesis against the
# OpenAPI document keel serves (/keel/openapi.json). Fails on any 5xx, and on any response whose
# status, content type, headers or body the document does not declare.
#
# Usage: tests/contract/run.sh KEEL_BINARY [SCHEMATHESIS]
# Environment: CONTRACT_BASE_PORT (first of the ports used, default 18401), CONTRACT_MAX_EXAMPLES
# (per operation, default 100), CONTRACT_PHASES (default examples,coverage,fuzzing) and
# CONTRACT_EXTRA (more schemathesis options, e.g. `--include-path /v1/messages`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
keel="$1"
schemathesis="${2:-schemathesis}"
# The run happens in a scratch directory: make paths given relative to here absolute.
case "$keel" in /*) ;; */*) keel="$PWD/$keel" ;; esac
case "$schemathesis" in /*) ;; */*) schemathesis="$PWD/$schemathesis" ;; esac
base="${CONTRACT_BASE_PORT:-18401}"
sim0=$base
sim1=$((base + 1))
gateway="127.0.0.1:$((base + 10))"
work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# Three pools: OpenAI-protocol variants, Anthropic-protocol variants, and one of each (keel
# translates for whichever it picks). Every sim server speaks both protocols.
variant() { # name url protocol
  printf '[[pools.variants]]\nname = "%s"\nurl = "%s"\nprotocol = "%s"\nupstream_model = "sim"\n\n' "$1" "$2" "$3"
}
{
  printf 'listen = "%s"\n\n' "$gateway"
  printf '[[pools]]\nname = "contract-gpt"\naliases = ["gpt-4o-mini", "text-embedding-3-small"]\n\n'
  variant gpt-0 "http://127.0.0.1:$sim0/v1" openai
  variant gpt-1 "http://127.0.0.1:$sim1/v1" openai
  printf '[[pools]]\nname = "contract-claude"\naliases = ["claude-sonnet-4-5"]\n\n'
  variant claude-0 "http://127.0.0.1:$sim0" anthropic
  variant claude-1 "http://127.0.0.1:$sim1" anthropic
  printf '[[pools]]\nname = "contract-mixed"\n\n'
  variant mixed-openai "http://127.0.0.1:$sim0/v1" openai
  variant mixed-anthropic "http://127.0.0.1:$sim1" anthropic
} > "$work/keel.toml"

KEEL_LOG=warn "$keel" sim --config "$here/sim.toml" --base-port "$sim0" > "$work/sim.log" 2>&1 &
pids+=($!)
KEEL_LOG=warn "$keel" serve --config "$work/keel.toml" > "$work/keel.log" 2>&1 &
pids+=($!)

started=$(date +%s)
status=0
# A fixed seed and a bounded number of examples per operation keep the run reproducible and
# short. The checks: no 5xx, and status codes, content types, headers and bodies as declared.
# One worker: requests in a reproducible order (and two workers trip a CPython 3.11 bug in
# Hypothesis's strategy descriptions, "AST constructor recursion depth mismatch").
# /keel/events is an endless event stream (the dashboard's feed), which no response check can
# read to its end: its own tests cover it (crates/keel-gateway/tests/it/events.rs).
(cd "$work" && "$schemathesis" --config-file "$here/schemathesis.toml" --no-color \
  run "http://$gateway/keel/openapi.json" --wait-for-schema 30 \
  --exclude-path /keel/events \
  --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance \
  --phases "${CONTRACT_PHASES:-examples,coverage,fuzzing}" ${CONTRACT_EXTRA:-} \
  --max-examples "${CONTRACT_MAX_EXAMPLES:-100}" \
  --seed 13 \
  --workers 1 \
  --request-timeout 30 \
  --generation-database none) || status=$?
echo "contract: schemathesis took $(( $(date +%s) - started )) s"
# What the generated requests came to, by keel's own count (how many reached a model server).
command -v curl > /dev/null && curl -sf "http://$gateway/metrics" | awk '/^keel_requests_total/ {
    match($0, /outcome="[a-z_]+"/); o = substr($0, RSTART + 9, RLENGTH - 10); n[o] += $NF }
  END { printf "contract: generation requests by outcome:"; for (o in n) printf " %s=%d", o, n[o]; print "" }' || true
if [ "$status" -ne 0 ]; then
  echo "--- keel log (tail)"; tail -n 40 "$work/keel.log"
fi
exit "$status"
