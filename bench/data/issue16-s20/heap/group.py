import re,sys,collections
tot=collections.Counter(); site=collections.Counter()
skip=re.compile(r'(alloc[0-9a-z_]*::|_5alloc|5alloc|__rust|_rdl_|malloc|realloc|calloc|RawVec|raw_vec|finish_grow|grow_one|grow_amortized|do_reserve|exchange_malloc|heaptrack|^0x|^\?\?|bytes\.\.bytes_mut|bytes::bytes_mut|5bytes9bytes_mut|box_new|Box\$LT|with_capacity|9vec_deque|core::ptr)')
def crate(f):
    m=re.search(r'_R[NIMXs_0-9a-zA-Z]*?C[si][0-9a-zA-Z_]+?_(\d+)([a-z_0-9]+)',f)
    if m:
        n=int(m.group(1)); return m.group(2)[:n]
    m=re.match(r'(?:_\$LT\$)?([a-z_0-9]+)::',f)
    return m.group(1) if m else f[:30]
for line in open('fg.txt'):
    line=line.rstrip()
    if not line: continue
    stack,_,cost=line.rpartition(' ')
    cost=int(cost)
    frames=[f.strip() for f in stack.split(';') if f.strip()]
    inner=None
    for f in reversed(frames):
        if not skip.search(f):
            inner=f;break
    inner=inner or frames[-1]
    c=crate(inner)
    tot[c]+=cost
    site[c+' | '+re.sub(r' \(.*','',inner)[-110:]]+=cost
print(sum(tot.values()))
for k,v in tot.most_common(15): print(f"{v/1e6:8.2f} MB {k}")
print()
for k,v in site.most_common(45): print(f"{v/1e3:9.1f} KB {k}")
