#!/bin/bash
# user/sys CPU per request for a gateway pid at given load; usage: split.sh LABEL PID URL
K=/work/main/target/release/keel
L=$1; P=$2; URL=$3
tk=$(getconf CLK_TCK)
pidsum() { local u=0 s=0; for t in /proc/$P/task/*/stat; do read -r -a a < $t; u=$((u+a[13])); s=$((s+a[14])); done; echo "$u $s"; }
ctx() { cat /proc/$P/task/*/status | awk '/ctxt_switches/ {s+=$2} END {print s}'; }
taskset -c 0 $K sim load --url $URL --model bench --max-tokens 16 --rps 200 --duration 2 --stream >/dev/null 2>&1
for mode in ${MODES:-stream whole}; do
  rps=1000; flag=""; [ "$mode" = stream ] && flag="--stream"
  for round in 1 2 3; do
    read u0 s0 < <(pidsum); c0=$(ctx)
    out=$(taskset -c 0 $K sim load --url $URL --model bench --max-tokens ${TOK:-16} --rps $rps --duration 6 $flag 2>&1)
    read u1 s1 < <(pidsum); c1=$(ctx)
    ok=$(echo "$out" | head -1 | awk '{print $4}')
    echo "$L tok=${TOK:-16} $mode r$round ok=$ok user_us=$(( (u1-u0)*1000000/tk/ok )) sys_us=$(( (s1-s0)*1000000/tk/ok )) ctx=$(echo "scale=2; ($c1-$c0)/$ok" | bc)"
  done
done
