#!/usr/bin/env bash
# Runs one fuzz target (nightly, no sanitizer: keel is safe Rust, `forbid(unsafe_code)`; debug
# assertions and overflow checks stay on, as cargo-fuzz builds by default).
# Usage: fuzz/run.sh TARGET SECONDS [WORKDIR]
# New inputs go to WORKDIR (default /tmp/keel-fuzz/TARGET); fold them into corpus/TARGET with
# fuzz/cmin.sh TARGET WORKDIR.
set -euo pipefail
cd "$(dirname "$0")"
t=$1
secs=$2
work=${3:-/tmp/keel-fuzz/$t}
dict=stream.dict
feat=()
case $t in
request_parse) dict=request.dict ;;
config_parse)
    dict=config.dict
    feat=(--features gateway)
    ;;
upstream_response)
    dict=http.dict
    feat=(--features gateway)
    ;;
esac
mkdir -p "$work"
exec nice -n 15 cargo +nightly fuzz run --sanitizer none "${feat[@]}" "$t" "$work" "corpus/$t" -- \
    -dict="dict/$dict" -max_total_time="$secs" -print_final_stats=1 -timeout=10 \
    -rss_limit_mb=2048 -malloc_limit_mb=1024
