"""`keel demo` (simulated fleet + gateway) as a process the SDK tests start and drive.

`start_demo()` finds free ports, starts the demo and waits until the gateway answers. The
returned `Demo` knows which simulated server backs each variant (read from the demo's own
config), so a test can inject a fault into the server behind a variant and look up keel's
decision record for a request.
"""
import json
import os
import random
import socket
import subprocess
import tempfile
import time
import tomllib
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEEL = os.environ.get("KEEL_BIN", os.path.join(ROOT, "target", "debug", "keel"))
SIM_SERVERS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports_free(first: int, n: int) -> bool:
    for port in range(first, first + n):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _http(method: str, url: str, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.load(r)


class Demo:
    def __init__(self, proc: subprocess.Popen, port: int, sim_base: int):
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        config = subprocess.run(
            [KEEL, "demo", "--print-config", "--sim-base-port", str(sim_base)],
            capture_output=True, text=True, check=True,
        ).stdout
        # Variant name -> its simulated server's base URL (scheme, host and port).
        self.servers = {
            v["name"]: v["url"].removesuffix("/v1")
            for pool in tomllib.loads(config)["pools"]
            for v in pool["variants"]
        }

    def add_fault(self, variant: str, **spec) -> None:
        """Injects a fault into the simulated server behind `variant` (see keel-sim's faults)."""
        _http("POST", self.servers[variant] + "/sim/faults", spec)

    def clear_faults(self) -> None:
        for server in set(self.servers.values()):
            _http("DELETE", server + "/sim/faults")

    def safe_mode(self, mode: str) -> None:
        """Forces every pool's safe mode `on` or `off`, or hands it back (`auto`)."""
        _http("POST", self.url + "/keel/admin/safe-mode", {"pool": None, "mode": mode})

    def decision(self, request_id: str) -> dict:
        """keel's decision record for one request: the plan and every attempt made."""
        for d in _http("GET", self.url + "/keel/decisions"):
            if d["request_id"] == request_id:
                return d
        raise AssertionError(f"no decision record for request {request_id}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _wait_until_up(proc: subprocess.Popen, url: str) -> bool:
    deadline = time.time() + 30
    while proc.poll() is None and time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/keel/ready", timeout=1) as r:
                json.load(r)
            return True
        except Exception:
            time.sleep(0.1)
    return False


def start_demo(sim_range=(10000, 20000), tries: int = 5) -> Demo:
    """Starts `keel demo` on a free gateway port and a block of free ports for the fleet
    (another run may take a port between the probe and the start: then it tries again).
    The blocks lie below the kernel's ephemeral ports (32768-60999 by default): on a busy
    machine outgoing connections, and their TIME_WAIT, hold thousands of those."""
    output = ""
    for _ in range(tries):
        port = free_port()
        sim_base = random.randrange(sim_range[0], sim_range[1] - SIM_SERVERS)
        if not _ports_free(sim_base, SIM_SERVERS):
            continue
        # A file, not a pipe: nobody reads the demo's output while it serves, and a full pipe
        # would block it.
        log = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(
            # --faults: the server behind gpt-flaky and embed-flaky fails on purpose, so that every
            # test also shows the SDK never sees a failure keel can fail over.
            [KEEL, "demo", "--faults", "--listen", f"127.0.0.1:{port}", "--sim-base-port", str(sim_base)],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if _wait_until_up(proc, f"http://127.0.0.1:{port}"):
            return Demo(proc, port, sim_base)
        proc.kill()
        proc.wait()
        log.seek(0)
        output = log.read()
    raise RuntimeError(f"keel demo did not start:\n{output}")
