#!/bin/bash
# User-space instructions a request, counted exactly (valgrind's callgrind), for keel, the floor
# (`keel bench plain-proxy`: a plain proxy on keel's HTTP stack) and nginx, one after the other,
# each in front of one zero-latency keel-sim server. Each gateway runs under callgrind on CPU 1
# (one worker thread, access log off), the load generator and the simulator on CPU 0. After a
# warm-up the counters are zeroed, N requests are sent at 40 req/s, and the counters dumped;
# streamed answers first, then whole ones.
#
# CPU time on a shared machine swings by ±20% between rounds; an instruction count does not, so
# a change's gain can be told from nothing. Caveats: it counts user space only (no system
# calls, no kernel), and a `rep movsb` copy counts one instruction a byte, so large memcpys
# weigh more here than on the CPU.
#
#   [PROTOCOL=anthropic] [CLIENT=openai] [PROMPT_WORDS=n [PROMPTS=n]] [KEEL_VARIANT=lines] bench/instructions-per-request.sh <keel binary> <out dir> [N=400] [tokens=16] [who="keel hyper nginx"]
#
# PROTOCOL=anthropic: clients and the upstream speak Anthropic's Messages API instead of OpenAI's.
# CLIENT=openai|anthropic: the clients' protocol, when it differs from the upstream's (keel
# translates; only keel can run that).
# PROMPT_WORDS=n: prompts of n words (`keel sim load --prompt-words`) instead of one short line:
# what a gateway's work on the prompt (parsing, normalizing, counting, re-encoding) costs.
# PROMPTS=n: how many such prompts take turns (16; one per request makes each prompt new to keel,
# which keeps the token counts of the prompts it has seen).
# KEEL_VARIANT=lines: more lines for keel's variant, e.g. 'tokenizer = "o200k"' (the prompt
# counted by OpenAI's tokenizer, as for a pool of OpenAI's models).
#
# Prints "<gateway> <stream|whole> <instructions a request>"; the callgrind files stay in <out
# dir> for `callgrind_annotate` (per function, with --inclusive=yes or --tree=caller).
set -u
K=$(realpath "$1"); O=$(mkdir -p "$2" && cd "$2" && pwd); N=${3:-400}; T=${4:-16}; WHO=${5:-keel hyper nginx}
command -v valgrind > /dev/null || { echo "valgrind not installed (apt-get install -y valgrind)" >&2; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
cd "$O"
source "$here/scripts/zero-latency.sh"
zero_latency_configs
taskset -c 0 "$K" sim --config sim.toml > sim.log 2>&1 & SP=$!
trap 'kill $SP 2>/dev/null' EXIT
sleep 1
api=(--url "http://127.0.0.1:PORT/v1"); upstream=http://127.0.0.1:19401/v1
[ "${PROTOCOL:-openai}" = anthropic ] && upstream=http://127.0.0.1:19401
[ "${CLIENT:-${PROTOCOL:-openai}}" = anthropic ] && api=(--url "http://127.0.0.1:PORT" --endpoint messages)
words=(); [ -n "${PROMPT_WORDS:-}" ] && words=(--prompt-words "$PROMPT_WORDS" --prompts "${PROMPTS:-16}")
# Each run of the load generator sends prompts of its own seeds (1,000,000 apart: `runs` counts
# the runs, bumped by the caller as `load` may run in a subshell), so that with PROMPTS above 16
# the measured runs meet no prompt of the warm-up or of each other.
runs=0
load() {
  local seed=(); [ -n "${PROMPT_WORDS:-}" ] && seed=(--prompt-seed $((runs * 1000000)))
  taskset -c 0 "$K" sim load "${api[@]/PORT/$1}" --model bench --max-tokens "$T" --rps "$2" --duration "$3" "${words[@]}" "${seed[@]}" $4 2>&1 | head -1
}
measure() { # name port command...
  local name=$1 port=$2; shift 2
  rm -f "cg.$name".*
  taskset -c 1 valgrind --tool=callgrind --callgrind-out-file="$O/cg.$name.%p" "$@" > "$name.log" 2>&1 &
  local vp=$!
  for _ in $(seq 1 200); do curl -s -o /dev/null -m 1 "http://127.0.0.1:$port/" && break; sleep 0.3; done
  load "$port" 20 3 --stream > /dev/null; runs=$((runs + 1))
  load "$port" 20 2 "" > /dev/null; runs=$((runs + 1))
  for mode in stream whole; do
    local flag=""; [ "$mode" = stream ] && flag=--stream
    callgrind_control --zero > /dev/null 2>&1
    local sent; sent=$(load "$port" 40 $((N / 40)) "$flag"); runs=$((runs + 1))
    callgrind_control --dump="$name-$mode" > /dev/null 2>&1
    local ok; ok=$(echo "$sent" | awk '{print $4}')
    local ir; ir=$(grep -h -A0 '^summary:' $(grep -l "dump $name-$mode\$" "cg.$name".*.[0-9]*) | awk '{print $2}')
    echo "$name $mode $((ir / ok)) ($ok answers: $sent)"
  done
  kill "$vp" 2>/dev/null; wait "$vp" 2>/dev/null
}
for who in $WHO; do
  case $who in
    keel) measure keel 19400 "$K" serve --config keel.toml ;;
    hyper) measure hyper 19403 "$K" bench plain-proxy --port 19403 --threads 1 "$upstream" ;;
    nginx)
      bash "$here/peers/nginx.sh" "$O/nginx" 19404 "$upstream" && kill "$(cat "$O/nginx/nginx.pid")"
      sleep 1
      measure nginx 19404 nginx -c "$O/nginx/nginx.conf" -p "$O/nginx" -g "daemon off; master_process off;" ;;
  esac
done
