cd /tmp/w; K=/work/main/target/release/keel
taskset -c 0 $K sim --config sim.toml > sim.log 2>&1 & SP=$!
sleep 1
taskset -c 1 $K serve --config keel.toml > /dev/null 2>&1 & KP=$!
taskset -c 1 $K bench plain-proxy --port 19403 --threads 1 http://127.0.0.1:19401/v1 > /dev/null 2>&1 & HP=$!
bash /work/main/bench/peers/nginx.sh /tmp/w/ng 19404 http://127.0.0.1:19401/v1; sleep 1; NP=$(pgrep -f "nginx: worker"); taskset -pc 1 $NP >/dev/null
sleep 1
for tok in $TOKS; do for pair in "keel $KP 19400" "hyper $HP 19403" "nginx $NP 19404"; do set -- $pair; TOK=$tok ./split.sh $1 $2 http://127.0.0.1:$3/v1; done; done
kill $KP $HP $SP; kill $(cat /tmp/w/ng/nginx.pid)
