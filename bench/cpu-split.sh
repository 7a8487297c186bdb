#!/bin/bash
# User and system CPU time a request, for several gateways side by side: each started once on
# CPU 1 (keel with one worker thread and its access log off), one zero-latency keel-sim server
# and the load generator on CPU 0, then rounds in which every gateway in turn takes the same
# load (so all of them meet the machine's fast and slow spells alike). Ticks are summed over
# every thread of the gateway (/proc/PID/task/*/stat).
#
#   [TOK=16] [ROUNDS=3] [MODES="stream whole"] [RPS=1000] [PROTOCOL=anthropic] bench/cpu-split.sh <workdir> <gateway>...
#
# A gateway is `keel:<keel binary>` (label it with `keel@label:<binary>` to compare two builds),
# `hyper:<keel binary>` (the floor, `keel bench plain-proxy`) or `nginx`. Prints, a line a round:
# "<label> tok=<n> <mode> r<round> ok=<answers> user_us=<µs> sys_us=<µs> total_us=<µs>".
# Compare two keel builds:   bench/cpu-split.sh /tmp/split keel@before:/tmp/keel-a keel@after:target/release/keel
# Against the floor, nginx:  bench/cpu-split.sh /tmp/split keel:target/release/keel hyper:target/release/keel nginx
set -u
W=$1; shift
here=$(cd "$(dirname "$0")" && pwd)
# Binaries as absolute paths before leaving for the work directory.
gateways=()
for g in "$@"; do
  case $g in *:*) gateways+=("${g%%:*}:$(realpath "${g#*:}")") ;; *) gateways+=("$g") ;; esac
done
set -- "${gateways[@]}"
mkdir -p "$W"; cd "$W"
source "$here/scripts/zero-latency.sh"
zero_latency_configs
TOK=${TOK:-16}; ROUNDS=${ROUNDS:-3}; MODES=${MODES:-stream whole}; RPS=${RPS:-1000}
# PROTOCOL=anthropic: clients and the upstream speak Anthropic's Messages API.
api=(--url "http://127.0.0.1:PORT/v1"); upstream=http://127.0.0.1:19401/v1
[ "${PROTOCOL:-openai}" = anthropic ] && api=(--url "http://127.0.0.1:PORT" --endpoint messages) && upstream=http://127.0.0.1:19401
# The load generator and the simulator: the first keel binary named.
for g in "$@"; do case $g in keel*:*|hyper:*) K=${g#*:}; break ;; esac; done
: "${K:?name at least one keel or hyper gateway (its binary runs the load generator)}"
taskset -c 0 "$K" sim --config sim.toml > sim.log 2>&1 & pids=($!)
sleep 1
labels=(); gpids=(); ports=(); port=19410
for g in "$@"; do
  port=$((port + 1))
  case $g in
    keel*:*)
      label=${g%%:*}; label=${label#keel@}; bin=${g#*:}
      sed "s/127.0.0.1:19400/127.0.0.1:$port/" keel.toml > "keel-$port.toml"
      taskset -c 1 "$bin" serve --config "keel-$port.toml" > "keel-$port.log" 2>&1 & gp=$! ;;
    hyper:*)
      label=hyper
      taskset -c 1 "${g#*:}" bench plain-proxy --port "$port" --threads 1 \
        "$upstream" > "hyper-$port.log" 2>&1 & gp=$! ;;
    nginx)
      label=nginx
      bash "$here/peers/nginx.sh" "$W/nginx" "$port" "$upstream"
      sleep 1
      gp=$(pgrep -P "$(cat "$W/nginx/nginx.pid")" | head -1)
      taskset -pc 1 "$gp" > /dev/null
      pids+=("$(cat "$W/nginx/nginx.pid")") ;;
    *) echo "unknown gateway $g" >&2; exit 2 ;;
  esac
  labels+=("$label"); gpids+=("$gp"); ports+=("$port"); pids+=("$gp")
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
sleep 1.5
tk=$(getconf CLK_TCK)
ticks() { local u=0 s=0 a; for t in /proc/$1/task/*/stat; do read -r -a a < "$t"; u=$((u + a[13])); s=$((s + a[14])); done; echo "$u $s"; }
load() { taskset -c 0 "$K" sim load "${api[@]/PORT/$1}" --model bench --max-tokens "$TOK" --rps "$2" --duration "$3" $4 2>&1; }
for i in "${!ports[@]}"; do load "${ports[$i]}" 200 2 --stream > /dev/null; done
for r in $(seq 1 "$ROUNDS"); do
  for mode in $MODES; do
    flag=""; [ "$mode" = stream ] && flag=--stream
    for i in "${!ports[@]}"; do
      read -r u0 s0 < <(ticks "${gpids[$i]}")
      out=$(load "${ports[$i]}" "$RPS" 6 "$flag")
      read -r u1 s1 < <(ticks "${gpids[$i]}")
      ok=$(echo "$out" | head -1 | awk '{print $4}')
      echo "${labels[$i]} tok=$TOK $mode r$r ok=$ok user_us=$(( (u1 - u0) * 1000000 / tk / ok )) sys_us=$(( (s1 - s0) * 1000000 / tk / ok )) total_us=$(( (u1 - u0 + s1 - s0) * 1000000 / tk / ok ))"
    done
  done
done
