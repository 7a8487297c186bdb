#!/usr/bin/env bash
# Folds the inputs a run found (WORKDIR) into corpus/TARGET and minimizes it (cargo fuzz cmin)
# by edge coverage alone (-use_counters=0: hit-count buckets would keep thousands of files),
# keeping the hand-written seed-* and regression-* files whatever their coverage.
# Usage: fuzz/cmin.sh TARGET [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")"
t=$1
work=${2:-/tmp/keel-fuzz/$t}
feat=()
case $t in config_parse | upstream_response) feat=(--features gateway) ;; esac
keep=$(mktemp -d)
cp corpus/"$t"/seed-* corpus/"$t"/regression-* "$keep"/ 2>/dev/null || true
cp "$work"/* corpus/"$t"/ 2>/dev/null || true
nice -n 15 cargo +nightly fuzz cmin --sanitizer none "${feat[@]}" "$t" "corpus/$t" -- -timeout=10 -use_counters=0
cp "$keep"/* corpus/"$t"/
rm -rf "$keep"
echo "$t: $(ls corpus/"$t" | wc -l) files, $(du -sk corpus/"$t" | cut -f1) KiB"
