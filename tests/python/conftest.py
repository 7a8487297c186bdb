"""Starts `keel demo` (simulated fleet + gateway) once for the SDK tests."""
import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEEL = os.environ.get("KEEL_BIN", os.path.join(ROOT, "target", "debug", "keel"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def keel_demo():
    port = free_port()
    # Six consecutive free ports for the simulated fleet: probe a block.
    base = 20000 + (os.getpid() % 2000) * 6
    proc = subprocess.Popen(
        [KEEL, "demo", "--listen", f"127.0.0.1:{port}", "--sim-base-port", str(base)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            with urllib.request.urlopen(url + "/keel/health", timeout=1) as r:
                json.load(r)
            break
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                out = proc.stdout.read() if proc.stdout else ""
                proc.kill()
                raise RuntimeError(f"keel demo did not start:\n{out}")
            time.sleep(0.1)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
