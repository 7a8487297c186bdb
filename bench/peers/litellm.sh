#!/usr/bin/env bash
# LiteLLM's proxy router over a simulated fleet: bench/peers/litellm.sh DIR PORT BASE_URL...
# Installs `litellm[proxy]` from PyPI into bench/.peers/litellm (once), writes DIR/config.yaml
# (one model group `bench` with a deployment per variant, latency-based routing, retries,
# cooldowns, timeouts; local model cost map, no telemetry) and starts it in the background
# (pid in DIR/litellm.pid).
set -euo pipefail
mkdir -p "$1"
dir=$(cd "$1" && pwd)
port=$2
shift 2
venv=${LITELLM_VENV:-bench/.peers/litellm}
if [ ! -x "$venv/bin/litellm" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check 'litellm[proxy]' >&2 || { echo "LiteLLM could not be installed from PyPI" >&2; exit 1; }
fi
{
  echo "model_list:"
  for u in "$@"; do
    echo "  - model_name: bench"
    echo "    litellm_params:"
    echo "      model: openai/sim"
    echo "      api_base: $u"
    echo "      api_key: unused"
    echo "      timeout: 60"
    echo "      stream_timeout: 15"
  done
  echo "router_settings:"
  echo "  routing_strategy: latency-based-routing"
  echo "  num_retries: 2"
  echo "  allowed_fails: 3"
  echo "  cooldown_time: 5"
  echo "  timeout: 60"
  echo "litellm_settings:"
  echo "  telemetry: false"
  echo "  request_timeout: 60"
} > "$dir/config.yaml"
export LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS=True LITELLM_LOCAL_AUTOROUTER_PRESETS=True \
  LITELLM_LOCAL_BLOG_POSTS=True LITELLM_LOCAL_POLICY_TEMPLATES=True LITELLM_TELEMETRY=False \
  LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY=true
nohup "$venv/bin/litellm" --config "$dir/config.yaml" --host 127.0.0.1 --port "$port" --num_workers 1 > "$dir/litellm.log" 2>&1 &
echo $! > "$dir/litellm.pid"
