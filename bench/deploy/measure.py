#!/usr/bin/env python3
"""Figures behind deploy/SCALING.md, measured on this machine with real processes.

  redis-throughput  redis-server's throughput here (redis-benchmark) and its CPU per operation.
  redis-ops      Redis commands per request: keel serve with [redis] and keys with limits,
                 N requests through it, redis-server's INFO commandstats before and after.
  stream-memory  keel's resident memory per live stream: a simulated fleet whose streams last
                 tens of seconds, then 0, S1, S2, ... streams held open at once; RSS at each step.

Usage (KEEL: a keel binary, release build for figures worth quoting):
  python bench/deploy/measure.py redis-ops --keel target/release/keel --requests 2000
  python bench/deploy/measure.py redis-throughput
  python bench/deploy/measure.py stream-memory --keel target/release/keel --steps 1000,2000

Needs httpx (the repo's .venv has it) and redis-server on the PATH (redis-ops only).
"""

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

# Example virtual keys for the measurement only (keel stores their SHA-256).
OPEN_KEY = "sk-keel-measure-no-limits-at-all-000000000000000"
RATE_KEY = "sk-keel-measure-rate-limits-only-0000000000000000"
FULL_KEY = "sk-keel-measure-every-limit-and-budget-000000000"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    sys.exit(f"{what} did not start listening on port {port}")


@contextlib.contextmanager
def process(args, what, port):
    """Starts a child process, waits until it listens on `port`, and ends it afterwards."""
    # Its output goes to a log file (named after it, in the temp directory), for post-mortems.
    log = open(os.path.join(tempfile.gettempdir(), f"measure-{what.replace(' ', '-')}.log"), "w")
    child = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, what)
        yield child
    finally:
        child.terminate()
        try:
            child.wait(timeout=40)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        log.close()


def sha256(key):
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def fleet_toml(port, gap_ms, reply_tokens):
    """One simulated OpenAI-protocol server with room for every stream we open."""
    return f"""
[generation]
min_reply_tokens = {reply_tokens}
mean_reply_tokens = {reply_tokens + 1}

[[servers]]
name = "sim"
port = {port}
ttft_ms = 20
gap_ms = {gap_ms}
gap_sigma = 0
capacity = 100000
load_stretch = 0
"""


def keel_toml(listen, sim_port, extra=""):
    return f"""
listen = "127.0.0.1:{listen}"
drain_ms = 1000

[[pools]]
name = "chat"

[[pools.variants]]
name = "sim"
url = "http://127.0.0.1:{sim_port}/v1"
protocol = "openai"
upstream_model = "sim-model"
price_input_per_mtok = 0.15
price_output_per_mtok = 0.60
{extra}
"""


def write(dir_, name, text):
    path = os.path.join(dir_, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def commandstats(port, field="calls"):
    """{command: calls} (or another field: usec, the time spent executing) from INFO
    commandstats."""
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "info", "commandstats"],
        capture_output=True, text=True, check=True,
    ).stdout
    calls = {}
    for line in out.splitlines():
        if line.startswith("cmdstat_"):
            name, fields = line[len("cmdstat_"):].split(":", 1)
            stats = dict(kv.split("=") for kv in fields.split(","))
            calls[name] = int(stats[field])
    return calls


def redis_cpu_s(port):
    """redis-server's CPU seconds so far (user + system, from INFO cpu)."""
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "info", "cpu"], capture_output=True, text=True, check=True,
    ).stdout
    stats = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return float(stats["used_cpu_user"]) + float(stats["used_cpu_sys"])


def delta(before, after):
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0) > 0}


async def send(url, key, n, stream, concurrency=8):
    """n chat requests with `key`; returns how many answered 200."""
    sem = asyncio.Semaphore(concurrency)
    ok = 0
    body = {"model": "chat", "max_tokens": 16, "stream": stream,
            "messages": [{"role": "user", "content": "hello"}]}

    async with httpx.AsyncClient(timeout=60) as client:
        async def one():
            nonlocal ok
            async with sem:
                r = await client.post(url, json=body, headers={"authorization": f"Bearer {key}"})
                ok += r.status_code == 200

        await asyncio.gather(*(one() for _ in range(n)))
    return ok


def redis_ops(args):
    redis_port, sim_port, keel_port = free_port(), free_port(), free_port()
    keys = f"""
[redis]
url = "redis://127.0.0.1:{redis_port}"

[[keys]]
id = "open"
hash = "{sha256(OPEN_KEY)}"

[[keys]]
id = "rate"
hash = "{sha256(RATE_KEY)}"
rpm = 1000000
tpm = 100000000
max_concurrency = 1000

[[keys]]
id = "full"
hash = "{sha256(FULL_KEY)}"
rpm = 1000000
tpm = 100000000
max_concurrency = 1000
daily_tokens = 1000000000
monthly_tokens = 10000000000
daily_spend_usd = 100000.0
monthly_spend_usd = 1000000.0
"""
    with tempfile.TemporaryDirectory() as d:
        fleet = write(d, "sim.toml", fleet_toml(sim_port, 2, 16))
        cfg = write(d, "keel.toml", keel_toml(keel_port, sim_port, keys))
        redis = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no"]
        with process(redis, "redis-server", redis_port), \
                process([args.keel, "sim", "--config", fleet], "keel sim", sim_port), \
                process([args.keel, "serve", "--config", cfg], "keel serve", keel_port):
            url = f"http://127.0.0.1:{keel_port}/v1/chat/completions"
            asyncio.run(send(url, RATE_KEY, 20, False))  # warm-up: scripts loaded, pools warm
            # redis-server's own background work (its timers, keel's idle traffic), subtracted
            # from each row's CPU so that what remains is the requests' share.
            cpu0 = redis_cpu_s(redis_port)
            time.sleep(args.idle_seconds)
            idle_cpu_per_s = (redis_cpu_s(redis_port) - cpu0) / args.idle_seconds
            rows = []
            for key_id, key in (("open", OPEN_KEY), ("rate", RATE_KEY), ("full", FULL_KEY)):
                for stream in (False, True):
                    before, cpu0 = commandstats(redis_port), redis_cpu_s(redis_port)
                    usec0 = commandstats(redis_port, "usec")
                    t0 = time.monotonic()
                    ok = asyncio.run(send(url, key, args.requests, stream, args.concurrency))
                    seconds = time.monotonic() - t0
                    cpu = redis_cpu_s(redis_port) - cpu0 - idle_cpu_per_s * seconds
                    got = delta(before, commandstats(redis_port))
                    got.pop("info", None)
                    # Time Redis spent executing keel's scripts (their commands included), without
                    # reading and writing the connection.
                    usec = delta(usec0, commandstats(redis_port, "usec")).get("evalsha", 0)
                    rows.append({"key": key_id, "stream": stream, "requests": args.requests,
                                 "ok": ok, "seconds": round(seconds, 2), "calls": got,
                                 "redis_cpu_us_per_request": round(cpu * 1e6 / args.requests, 1),
                                 "script_exec_us_per_request": round(usec / args.requests, 1)})
            # What one idle replica sends by itself (slot renewals and the like).
            before = commandstats(redis_port)
            time.sleep(args.idle_seconds)
            idle = delta(before, commandstats(redis_port))
            idle.pop("info", None)
    print(f"{args.concurrency} requests in flight at once")
    print("key   stream requests ok   seconds  redis CPU µs/request  script execution µs/request  redis calls per request (top-level scripts | every command)")
    for r in rows:
        scripts = sum(v for k, v in r["calls"].items() if k in ("evalsha", "eval", "fcall"))
        every = sum(r["calls"].values())
        detail = ", ".join(f"{k} {v / r['requests']:.2f}" for k, v in sorted(r["calls"].items()))
        if not r["calls"]:
            print(f"{r['key']:5} {str(r['stream']):6} {r['requests']:8} {r['ok']:4} {r['seconds']:8}  no Redis call")
            continue
        print(f"{r['key']:5} {str(r['stream']):6} {r['requests']:8} {r['ok']:4} {r['seconds']:8}"
              f"  {r['redis_cpu_us_per_request']:20}  {r['script_exec_us_per_request']:27}  {scripts / r['requests']:.2f} | {every / r['requests']:.2f}  ({detail})")
    print(f"idle replica, {args.idle_seconds} s: {idle or 'no calls'}; "
          f"redis-server idle CPU {idle_cpu_per_s * 1e3:.1f} ms/s (subtracted above)")
    print(json.dumps({"rows": rows, "idle": idle, "idle_seconds": args.idle_seconds,
                      "idle_cpu_ms_per_s": round(idle_cpu_per_s * 1e3, 2)}))


# A script shaped like keel's quota scripts (read the clock, read a key, write it with an expiry).
SCRIPT = ("local t = redis.call('TIME') local v = redis.call('GET', KEYS[1]) "
          "redis.call('SET', KEYS[1], t[1], 'PX', 60000) return v")


def redis_throughput(args):
    """redis-server's throughput here with redis-benchmark: plain commands and a small script,
    50 clients, without and with pipelining; and redis-server's CPU per operation."""
    port = free_port()
    redis = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    cases = [("SET", ["-t", "set"]), ("GET", ["-t", "get"]),
             ("EVAL (TIME, GET, SET)", ["eval", SCRIPT, "1", "key:__rand_int__"])]
    print("operation               pipeline  ops/s (redis-benchmark)  redis-server CPU µs/op")
    with process(redis, "redis-server", port):
        for name, cmd in cases:
            for pipeline in (1, 16):
                cpu0 = redis_cpu_s(port)
                out = subprocess.run(
                    ["redis-benchmark", "-p", str(port), "-n", str(args.ops), "-c", "50", "-r", "100000",
                     "-P", str(pipeline), "--csv"] + cmd,
                    capture_output=True, text=True, check=True,
                ).stdout
                cpu = redis_cpu_s(port) - cpu0
                # --csv: a header line, then "name","rps",...
                rps = float(out.strip().splitlines()[-1].split('","')[1])
                print(f"{name:24}{pipeline:8}  {rps:23,.0f}  {cpu * 1e6 / args.ops:22.2f}")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def hold_streams(url, n, opened, stop):
    """Opens n streams and reads them slowly to their end; `opened` counts those past their
    first chunk (live in keel)."""
    body = {"model": "chat", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "hello"}]}
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def one():
            async with client.stream("POST", url, json=body) as r:
                first = True
                async for _ in r.aiter_raw():
                    if first:
                        opened[0] += 1
                        first = False
                    if stop.is_set():
                        break

        await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)


async def memory_steps(url, pid, steps, settle):
    results = [{"streams": 0, "rss_kib": rss_kib(pid)}]
    for n in steps:
        opened, stop = [0], asyncio.Event()
        task = asyncio.create_task(hold_streams(url, n, opened, stop))
        deadline = time.monotonic() + 60
        while opened[0] < n and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(settle)
        live = rss_kib(pid)
        stop.set()
        await task
        await asyncio.sleep(2)
        # Memory kept once the streams are gone: the allocator's free lists, decision records.
        results.append({"streams": opened[0], "rss_kib": live, "after_kib": rss_kib(pid)})
    return results


def stream_memory(args):
    steps = [int(s) for s in args.steps.split(",")]
    sim_port, keel_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as d:
        # One token a second for 60 tokens: every stream stays open for the whole step.
        fleet = write(d, "sim.toml", fleet_toml(sim_port, 1000, 60))
        cfg = write(d, "keel.toml", keel_toml(keel_port, sim_port))
        with process([args.keel, "sim", "--config", fleet], "keel sim", sim_port), \
                process([args.keel, "serve", "--config", cfg], "keel serve", keel_port) as keel:
            url = f"http://127.0.0.1:{keel_port}/v1/chat/completions"
            asyncio.run(send(url, "none", 20, True))  # warm-up
            time.sleep(1)
            results = asyncio.run(memory_steps(url, keel.pid, steps, args.settle))
    base = results[0]["rss_kib"]
    print("live streams  keel RSS (MiB)  per 1,000 streams over idle (MiB)  RSS after they ended (MiB)")
    for r in results:
        per = (r["rss_kib"] - base) / 1024 / r["streams"] * 1000 if r["streams"] else 0
        after = r.get("after_kib", r["rss_kib"]) / 1024
        print(f"{r['streams']:12}  {r['rss_kib'] / 1024:14.1f}  {per:33.1f}  {after:.1f}")
    print(json.dumps(results))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("redis-ops")
    r.add_argument("--keel", required=True)
    r.add_argument("--requests", type=int, default=1000)
    r.add_argument("--idle-seconds", type=int, default=10)
    r.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    b = sub.add_parser("redis-throughput")
    b.add_argument("--ops", type=int, default=200000)
    m = sub.add_parser("stream-memory")
    m.add_argument("--keel", required=True)
    m.add_argument("--steps", default="1000,2000")
    m.add_argument("--settle", type=float, default=3.0)
    args = p.parse_args()
    {"redis-ops": redis_ops, "redis-throughput": redis_throughput, "stream-memory": stream_memory}[args.what](args)


if __name__ == "__main__":
    main()
