"""A client pool's race with a server that closes idle keep-alive connections.

Opens a connection to a running keel, sends GET /keel/health, waits about `idle_s` (±3 ms),
sends it again on the same connection, and counts the second requests that got no response:
what a pooled client sees when keel closes the connection as the request is written. With
keel's default `idle_timeout_ms` (300 s) nothing is closed at the header-read timeout; before
it, hyper's header-read timer closed an idle connection at `header_read_timeout_ms`.

    keel serve --config keel.toml   # header_read_timeout_ms = 100, any pool
    python3 bench/keepalive_race.py PORT 100 0.1
"""

import random
import socket
import sys
import time

REQUEST = b"GET /keel/health HTTP/1.1\r\nhost: keel\r\n\r\n"


def response(sock):
    """The status line of one answer with a content-length body; None if the connection ends first."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(l.split(b":")[1]) for l in lines if l.lower().startswith(b"content-length"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        body += chunk
    return lines[0]


def main():
    port, rounds, idle_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    rng = random.Random(1)
    answered = lost = 0
    for _ in range(rounds):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(REQUEST)
        assert response(sock), "the first request was not answered"
        time.sleep(idle_s + rng.uniform(-0.003, 0.003))
        try:
            sock.sendall(REQUEST)
            if response(sock) is None:
                lost += 1
            else:
                answered += 1
        except OSError:
            lost += 1
        sock.close()
    print(f"second request after ~{idle_s * 1000:.0f} ms idle: answered {answered}, lost without a response {lost}")


if __name__ == "__main__":
    main()
