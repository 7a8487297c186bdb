cd /tmp/w; K=/tmp/w/keel-after
sed 's/19400/19402/' keel.toml > keel-b.toml
taskset -c 0 $K sim --config sim.toml > sim.log 2>&1 & SP=$!
sleep 1
taskset -c 1 /tmp/w/keel-before serve --config keel.toml > /dev/null 2>&1 & BP=$!
taskset -c 1 /tmp/w/keel-s16c serve --config keel-b.toml > /dev/null 2>&1 & AP=$!
sleep 1.5
tk=$(getconf CLK_TCK)
pidsum() { local u=0 s=0; for t in /proc/$1/task/*/stat; do read -r -a a < $t; u=$((u+a[13])); s=$((s+a[14])); done; echo "$u $s"; }
for pair in "before $BP 19400" "after $AP 19402"; do set -- $pair; taskset -c 0 $K sim load --url http://127.0.0.1:$3/v1 --model bench --max-tokens 16 --rps 300 --duration 2 --stream > /dev/null 2>&1; done
for r in $(seq 1 ${ROUNDS:-6}); do for mode in ${MODES:-stream whole}; do flag=""; [ $mode = stream ] && flag=--stream
 for pair in "before $BP 19400" "after $AP 19402"; do set -- $pair
  read u0 s0 < <(pidsum $2)
  out=$(taskset -c 0 $K sim load --url http://127.0.0.1:$3/v1 --model bench --max-tokens ${TOK:-16} --rps 1000 --duration 6 $flag 2>&1)
  read u1 s1 < <(pidsum $2)
  ok=$(echo "$out" | head -1 | awk '{print $4}')
  echo "$1 $mode r$r ok=$ok user_us=$(( (u1-u0)*1000000/tk/ok )) sys_us=$(( (s1-s0)*1000000/tk/ok )) total_us=$(( (u1-u0+s1-s0)*1000000/tk/ok ))"
 done; done; done
kill $BP $AP $SP
