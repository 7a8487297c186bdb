#!/usr/bin/env python3
"""Three keel replicas behind a round-robin nginx, one variant killed: what the clients see and
how many requests the replicas still send to the dead variant, with and without shared signals
(`[redis] share_signals`).

    /work/main/.venv/bin/python bench/shared_signals.py --keel target/release/keel [--mode kill]

Per run: redis-server, three `keel sim` processes (variants v0, v1, v2), three `keel serve`
replicas sharing Redis, and nginx in front of them (plain round robin, no retries: an error a
replica returns reaches the client). An open-loop client sends `--rate` requests/s for
`--duration` s; at `--kill-at` s variant v2 dies:

- `kill`: its process is killed (connections refused from then on);
- `error`: it answers every request with HTTP 500 (a crashed backend behind a live port).

Counted after the run, from each replica's /metrics (`keel_attempts_total`, variant v2, after
the kill): client-request attempts (kinds first, fallback, hedge, continuation) and keel's own
(probe, warmup); and from the client: non-200 answers and transport errors. Each mode runs with
sharing off, then on, `--rounds` times each, alternating. Prints a JSON summary and a Markdown
table to paste into bench/RESULTS.md.
"""

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

CLIENT_KINDS = {"first", "fallback", "hedge", "continuation"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port, what, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise SystemExit(f"{what} did not listen on {port}")


class Fleet:
    """Every process of one run; `close` ends them all."""

    def __init__(self, keel, workdir):
        self.keel = keel
        self.dir = workdir
        self.procs = []

    def spawn(self, args, port, what):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "KEEL_LOG": "warn"})
        self.procs.append(p)
        wait_listening(port, what)
        return p

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def sim(self, port):
        cfg = self.write(f"sim-{port}.toml", f"""[[servers]]
name = "s{port}"
ttft_ms = 20
ttft_sigma = 0.2
gap_ms = 2
gap_sigma = 0
prefill_us_per_token = 0
capacity = 256
""")
        return self.spawn([self.keel, "sim", "--config", cfg, "--base-port", str(port)], port, "keel sim")

    def replica(self, port, sims, redis_port, share):
        variants = "".join(
            f'[[pools.variants]]\nname = "v{i}"\nurl = "http://127.0.0.1:{p}/v1"\n'
            f'protocol = "openai"\nupstream_model = "sim"\n'
            for i, p in enumerate(sims))
        cfg = self.write(f"keel-{port}.toml", f"""listen = "127.0.0.1:{port}"
[redis]
url = "redis://127.0.0.1:{redis_port}"
share_signals = {str(share).lower()}
[[pools]]
name = "p"
{variants}""")
        return self.spawn([self.keel, "serve", "--config", cfg], port, "keel serve")

    def redis(self, port):
        return self.spawn(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                           "--appendonly", "no"], port, "redis-server")

    def nginx(self, port, replicas):
        servers = "".join(f"    server 127.0.0.1:{p} max_fails=0;\n" for p in replicas)
        os.makedirs(os.path.join(self.dir, "logs"), exist_ok=True)
        cfg = self.write("nginx.conf", f"""worker_processes 1;
daemon off;
pid {self.dir}/nginx.pid;
error_log {self.dir}/logs/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  upstream replicas {{
{servers}    keepalive 64;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_next_upstream off;
      proxy_read_timeout 30s;
    }}
  }}
}}
""")
        return self.spawn(["nginx", "-c", cfg, "-p", self.dir], port, "nginx")

    def close(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.kill()
                p.wait()


def dead_attempts(metrics_text, variant):
    """(client-request attempts, keel's own) to `variant` in one replica's /metrics."""
    client = own = 0
    for line in metrics_text.splitlines():
        if not line.startswith("keel_attempts_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        if labels.get("variant") != variant:
            continue
        n = int(float(line.rsplit(" ", 1)[1]))
        if labels.get("kind") in CLIENT_KINDS:
            client += n
        else:
            own += n
    return client, own


def signal_counts(metrics_text):
    out = {}
    for line in metrics_text.splitlines():
        m = re.match(r'keel_signals_(published|applied)_total\{kind="(\w+)"\} (\S+)', line)
        if m:
            out[f"{m[1]}_{m[2]}"] = int(float(m[3]))
    return out


async def load(url, rate, duration, kill_at, kill):
    """Open-loop requests at `rate`/s; calls `kill` at `kill_at` s. Returns (statuses, errors)."""
    body = {"model": "p", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
    statuses, errors = {}, {}
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        async def one():
            try:
                r = await client.post(url, json=body)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            except httpx.HTTPError as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1

        tasks, started, killed, i = [], time.monotonic(), False, 0
        while True:
            now = time.monotonic() - started
            if now >= duration:
                break
            if not killed and now >= kill_at:
                kill()
                killed = True
            due = started + i / rate
            if due > time.monotonic():
                await asyncio.sleep(due - time.monotonic())
            tasks.append(asyncio.create_task(one()))
            i += 1
        await asyncio.gather(*tasks)
    return statuses, errors


def run_once(args, mode, share):
    workdir = tempfile.mkdtemp(prefix="keel-signals-")
    fleet = Fleet(args.keel, workdir)
    try:
        redis_port = free_port()
        fleet.redis(redis_port)
        sims = [free_port() for _ in range(3)]
        sim_procs = [fleet.sim(p) for p in sims]
        replicas = [free_port() for _ in range(3)]
        for p in replicas:
            fleet.replica(p, sims, redis_port, share)
        front = free_port()
        fleet.nginx(front, replicas)
        time.sleep(1.0)  # warm-ups done

        def before():
            return [httpx.get(f"http://127.0.0.1:{p}/metrics").text for p in replicas]

        baseline = []

        def kill():
            baseline.extend(dead_attempts(t, "v2") for t in before())
            if mode == "kill":
                sim_procs[2].kill()
            else:
                httpx.post(f"http://127.0.0.1:{sims[2]}/sim/faults",
                           json={"kind": "error", "status": 500}).raise_for_status()

        statuses, errors = asyncio.run(load(f"http://127.0.0.1:{front}/v1/chat/completions",
                                            args.rate, args.duration, args.kill_at, kill))
        after = before()
        hits = [dead_attempts(t, "v2") for t in after]
        client = sum(h[0] - b[0] for h, b in zip(hits, baseline))
        own = sum(h[1] - b[1] for h, b in zip(hits, baseline))
        per_replica = [h[0] - b[0] for h, b in zip(hits, baseline)]
        sig = {}
        for t in after:
            for k, v in signal_counts(t).items():
                sig[k] = sig.get(k, 0) + v
        total = sum(statuses.values()) + sum(errors.values())
        return {
            "mode": mode, "share_signals": share, "requests": total,
            "client_errors": total - statuses.get(200, 0), "statuses": statuses,
            "transport_errors": errors, "dead_client_attempts": client,
            "dead_client_attempts_per_replica": per_replica, "dead_keel_own_attempts": own,
            "signals": sig,
        }
    finally:
        fleet.close()
        shutil.rmtree(workdir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keel", required=True, help="the keel binary")
    ap.add_argument("--mode", choices=["kill", "error", "both"], default="both")
    ap.add_argument("--rate", type=float, default=60.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds of load")
    ap.add_argument("--kill-at", type=float, default=3.0, help="seconds into the load")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each setting")
    args = ap.parse_args()
    for tool in ("redis-server", "nginx"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed (apt-get install -y redis-server nginx)")
    modes = ["kill", "error"] if args.mode == "both" else [args.mode]
    results = []
    for mode in modes:
        for _ in range(args.rounds):
            for share in (False, True):
                r = run_once(args, mode, share)
                print(json.dumps(r), file=sys.stderr, flush=True)
                results.append(r)
    print(json.dumps(results, indent=1))
    print("\n| v2 | sharing | requests | client errors | client attempts to v2 (per replica) | keel's own probes/warm-ups to v2 |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {'on' if r['share_signals'] else 'off'} | {r['requests']} | {r['client_errors']} "
              f"| {r['dead_client_attempts']} ({', '.join(map(str, r['dead_client_attempts_per_replica']))}) "
              f"| {r['dead_keel_own_attempts']} |")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
