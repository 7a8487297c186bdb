"""The seam of a mid-stream migration on real llama.cpp servers, `prefill` vs `instruction`
resume: N migrations per mode, each a stream on server `a` stopped (SIGSTOP) after k tokens and
continued by keel on server `b`. The reference is `b`'s own uninterrupted greedy answer, so
any word lost or extra (duplicated, glued) is the seam's doing. A measurement, not a test:

    KEEL_BIN=target/debug/keel .venv/bin/python tests/real/seam_figures.py [N]

Per mode: how many streams migrated and ended cleanly; at the seam itself, words duplicated
(the end of the delivered text repeated at the start of the continuation) and seams whose first
word differs from the uninterrupted answer's next word; over the whole answer, words lost and
extra against the uninterrupted answer (a continuation that takes another path after the seam
counts every later word). Prints one line per mode (also as JSON) for bench/RESULTS.md.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_llamacpp import KEEL, SYSTEM, LlamaServer, free_port, wait_http  # noqa: E402


def word_diff(want: str, got: str):
    """Words of `want` missing from `got`, and words of `got` not in `want` (by LCS)."""
    w, g = want.split(), got.split()
    prev = [0] * (len(g) + 1)
    for i in range(1, len(w) + 1):
        cur = [0] * (len(g) + 1)
        for j in range(1, len(g) + 1):
            cur[j] = prev[j - 1] + 1 if w[i - 1] == g[j - 1] else max(prev[j], cur[j - 1])
        prev = cur
    common = prev[len(g)]
    return len(w) - common, len(g) - common


def duplicated(before: str, after: str) -> int:
    """Words at the end of `before` repeated at the start of `after` (longest overlap, ≤ 8)."""
    b, a = before.split(), after.split()
    return max((k for k in range(1, min(8, len(b), len(a)) + 1) if b[-k:] == a[:k]), default=0)


def next_word_differs(want: str, before: str, after: str) -> bool:
    """Whether the continuation's first word differs from the uninterrupted answer's word there."""
    if not want.startswith(before):
        return True
    expected = (before + want[len(before):]).split()[len(before.split()) - (0 if before.endswith((" ", "\n")) or not before else 1):]
    got = (before + after).split()[len(before.split()) - (0 if before.endswith((" ", "\n")) or not before else 1):]
    return expected[:1] != got[:1]


def start_keel(servers, mode):
    port = free_port()
    variants = "".join(
        f'\n[[pools.variants]]\nname = "{s.name}"\nurl = "http://127.0.0.1:{s.port}/v1"\nprotocol = "openai"\n'
        f'upstream_model = "gemma"\nresume = "{mode}"\n'
        for s in servers
    )
    config = (
        f'listen = "127.0.0.1:{port}"\nallow_force_variant = true\n[[pools]]\nname = "gemma"\nhedge = "off"\n'
        f"stall_ms = 400\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{variants}"
    )
    cfg = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    cfg.write(config)
    cfg.close()
    proc = subprocess.Popen([KEEL, "serve", "--config", cfg.name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/keel/health")
    return proc, base, cfg.name


def body(i, stream):
    return {"model": "gemma", "max_tokens": 48, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Tell me about the sea, part {i}."}]}


def one(base, servers, i):
    a, b = servers
    ref = httpx.post(f"http://127.0.0.1:{b.port}/v1/chat/completions", json=body(i, False), timeout=120).json()
    want = ref["choices"][0]["message"]["content"]
    stop_after = 3 + i % 15
    before, after, migrated, done, deltas, stopped = "", "", False, False, 0, False
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body(i, True),
                          headers={"x-keel-force-variant": "a"}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith(": keel migrated"):
                    migrated = True
                elif line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    for c in json.loads(line[6:]).get("choices", []):
                        t = (c.get("delta") or {}).get("content") or ""
                        if migrated:
                            after += t
                        else:
                            before += t
                        deltas += bool(t)
                        if deltas == stop_after and not stopped:
                            a.signal(signal.SIGSTOP)
                            stopped = True
    finally:
        a.signal(signal.SIGCONT)
    lost, extra = word_diff(want, before + after)
    return {"lost": lost, "extra": extra, "intact": want == before + after, "migrated": migrated, "done": done,
            "duplicated": duplicated(before, after), "next_word_differs": next_word_differs(want, before, after)}


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    servers = [LlamaServer(name, free_port()) for name in ("a", "b")]
    for s in servers:
        s.start()
    results = {}
    try:
        for mode in ("prefill", "instruction"):
            proc, base, cfg = start_keel(servers, mode)
            rows = []
            try:
                for i in range(n):
                    rows.append(one(base, servers, i))
                    time.sleep(0.1)
            finally:
                proc.terminate()
                proc.wait(timeout=40)
                os.unlink(cfg)
            m = [r for r in rows if r["migrated"]]
            results[mode] = {
                "requests": n,
                "migrated": len(m),
                "ended_cleanly": sum(r["done"] for r in rows),
                "intact": sum(r["intact"] for r in m),
                "words_lost": sum(r["lost"] for r in m),
                "words_extra": sum(r["extra"] for r in m),
                "answers_differing": sum(1 for r in m if r["lost"] or r["extra"]),
                "seams_duplicating": sum(1 for r in m if r["duplicated"]),
                "words_duplicated_at_seam": sum(r["duplicated"] for r in m),
                "seams_next_word_differs": sum(r["next_word_differs"] for r in m),
            }
            r = results[mode]
            print(f"{mode:12} migrated {r['migrated']}/{n}, clean ends {r['ended_cleanly']}, identical answers {r['intact']}; "
                  f"at the seam: {r['seams_duplicating']} duplicating ({r['words_duplicated_at_seam']} words), "
                  f"{r['seams_next_word_differs']} with another next word; whole answers: {r['words_lost']} words lost, "
                  f"{r['words_extra']} extra", flush=True)
    finally:
        for s in servers:
            s.stop()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
