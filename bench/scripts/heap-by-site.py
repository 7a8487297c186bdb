"""Groups a heaptrack peak flamegraph (`heaptrack_print --print-flamegraph FILE
--flamegraph-cost-type peak`) by the innermost frame that is not the allocator or a collection's
growth: which code asked for the bytes live at the peak. Inlined hyper code is charged to the
keel frame that called it. Usage: heap-by-site.py fg.txt"""
import collections
import re
import sys

# Frames that only pass an allocation through (the allocator, Vec/Box/BytesMut growth).
PASS_THROUGH = re.compile(
    r"(alloc[0-9a-z_]*::|_5alloc|5alloc|__rust|_rdl_|malloc|realloc|calloc|RawVec|raw_vec"
    r"|finish_grow|grow_one|grow_amortized|do_reserve|exchange_malloc|heaptrack|^0x|^\?\?"
    r"|bytes\.\.bytes_mut|bytes::bytes_mut|5bytes9bytes_mut|box_new|Box\$LT|with_capacity"
    r"|9vec_deque|core::ptr)"
)


def crate(frame):
    """The crate a (v0- or legacy-mangled) frame belongs to."""
    m = re.search(r"_R[NIMXs_0-9a-zA-Z]*?C[si][0-9a-zA-Z_]+?_(\d+)([a-z_0-9]+)", frame)
    if m:
        return m.group(2)[: int(m.group(1))]
    m = re.match(r"(?:_\$LT\$)?([a-z_0-9]+)::", frame)
    return m.group(1) if m else frame[:30]


by_crate, by_site = collections.Counter(), collections.Counter()
for line in open(sys.argv[1]):
    stack, _, cost = line.rstrip().rpartition(" ")
    if not stack:
        continue
    frames = [f.strip() for f in stack.split(";") if f.strip()]
    inner = next((f for f in reversed(frames) if not PASS_THROUGH.search(f)), frames[-1])
    c = crate(inner)
    by_crate[c] += int(cost)
    by_site[c + " | " + re.sub(r" \(.*", "", inner)[-110:]] += int(cost)
print(sum(by_crate.values()))
for k, v in by_crate.most_common(15):
    print(f"{v / 1e6:8.2f} MB {k}")
print()
for k, v in by_site.most_common(45):
    print(f"{v / 1e3:9.1f} KB {k}")
