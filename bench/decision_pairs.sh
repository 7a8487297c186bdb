#!/usr/bin/env bash
# Two keel binaries' routing decisions (`keel bench decision`) measured at the same time, one on
# each core, swapping cores every round; prints each round and the medians.
#
# Why at the same time: this machine's two vCPUs each alternate between a fast and a slow spell
# (the same decision takes 1.6x as long in a slow one), so rounds run one after the other
# compare spells as much as binaries. Run side by side, both binaries meet the same moment; the
# swap cancels a difference between the cores. Rounds where the two ran in different spells
# still show, which is why the per-round ratio is summarised by its median.
#
# usage: bench/decision_pairs.sh BIN_A BIN_B ROUNDS VARIANTS ITERATIONS [OUT]
#   e.g. bench/decision_pairs.sh /tmp/keel-before target/release/keel 12 256 60000
set -euo pipefail
a=$1 b=$2 rounds=$3 variants=$4 iterations=$5 out=${6:-/dev/null}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) = 0 ]; then ca=0 cb=1; else ca=1 cb=0; fi
    taskset -c $ca "$a" bench decision --variants "$variants" --iterations "$iterations" | tail -1 >"$tmp/a.$r" &
    taskset -c $cb "$b" bench decision --variants "$variants" --iterations "$iterations" | tail -1 >"$tmp/b.$r" &
    wait
done
python3 - "$tmp" "$rounds" <<'PY' | tee "$out"
import re, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
def figures(path):
    # "p50 X µs   p99 Y µs   p99.9 Z µs   mean W µs"
    v = [float(x) for x in re.findall(r"([\d.]+) µs", open(path).read())]
    return v[0], v[1], v[3]
a = [figures(f"{tmp}/a.{r}") for r in range(1, rounds + 1)]
b = [figures(f"{tmp}/b.{r}") for r in range(1, rounds + 1)]
for r, (x, y) in enumerate(zip(a, b), 1):
    print(f"round {r:2}: A p50 {x[0]:.2f} p99 {x[1]:.2f} mean {x[2]:.2f} µs | "
          f"B p50 {y[0]:.2f} p99 {y[1]:.2f} mean {y[2]:.2f} µs")
for k, name in enumerate(["p50", "p99", "mean"]):
    xs, ys = [x[k] for x in a], [y[k] for y in b]
    ratio = statistics.median(y / x for x, y in zip(xs, ys))
    print(f"{name}: A median {statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f}) µs, "
          f"B median {statistics.median(ys):.2f} ({min(ys):.2f}-{max(ys):.2f}) µs, "
          f"per-round B/A median {ratio:.3f}")
PY
