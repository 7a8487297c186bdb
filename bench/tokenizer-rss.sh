#!/bin/bash
# Resident memory of a `keel serve` by the tokenizer its pool counts with: one variant in front
# of a zero-latency keel-sim server, started fresh for each tokenizer and each step, and
# measured (VmRSS, and its anonymous and file-backed parts, from /proc) after
#   idle      nothing but the readiness check;
#   ascii     one request whose prompt is ASCII;
#   unicode   one request whose prompt is not (o200k compiles its pattern for such text);
#   prompts   500 requests of 2,000-word prompts never seen before (every page of a byte-pair
#             table that counting them touches).
#
#   [TOKENIZERS="approx o200k cl100k"] bench/tokenizer-rss.sh <keel binary> <work dir>
#
# Prints "<tokenizer> <step> rss_kib=<n> anon_kib=<n> file_kib=<n>".
set -u
K=$(realpath "$1"); W=$(mkdir -p "$2" && cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
source "$here/scripts/zero-latency.sh"
cd "$W"
ask() { # prompt text
  curl -s -o /dev/null http://127.0.0.1:19400/v1/chat/completions -H 'content-type: application/json' \
    -d "{\"model\":\"bench\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\",\"content\":\"$1\"}]}"
}
for tokenizer in ${TOKENIZERS:-approx o200k cl100k}; do
  for step in idle ascii unicode prompts; do
    KEEL_VARIANT="tokenizer = \"$tokenizer\"" zero_latency_configs
    "$K" sim --config sim.toml > sim.log 2>&1 & sp=$!
    "$K" serve --config keel.toml > keel.log 2>&1 & kp=$!
    for _ in $(seq 1 100); do curl -sf -o /dev/null -m 1 http://127.0.0.1:19400/keel/ready && break; sleep 0.2; done
    case $step in
      ascii) ask "hello world, this is a short question" ;;
      unicode) ask "héllo wörld, ceci n'est qu'une question" ;;
      prompts) "$K" sim load --url http://127.0.0.1:19400/v1 --model bench --max-tokens 16 --rps 100 \
        --duration 5 --prompt-words 2000 --prompts 500 > /dev/null 2>&1 ;;
    esac
    sleep 2
    awk -v t="$tokenizer" -v s="$step" '/^VmRSS/{r=$2} /^RssAnon/{a=$2} /^RssFile/{f=$2}
      END{print t, s, "rss_kib=" r, "anon_kib=" a, "file_kib=" f}' "/proc/$kp/status"
    kill "$kp" "$sp"; wait "$kp" "$sp" 2>/dev/null
  done
done
