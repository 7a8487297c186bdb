"""Resident memory an idle keep-alive client connection costs keel.

Opens N connections to a running keel, sends GET /keel/health on each, reads the answer and
leaves the connection open; prints keel's VmRSS before and 2 s after (run it twice: the second
run starts with the allocator warm).

    keel serve --config keel.toml &
    python3 bench/idle_connections.py PORT 2000 $(pgrep -f "keel serve")
"""

import socket, sys, time
port, n, pid = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def rss():
    for l in open(f"/proc/{pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1])
req = b"GET /keel/health HTTP/1.1\r\nhost: keel\r\n\r\n"
time.sleep(1); before = rss()
socks = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port)); s.sendall(req)
    buf = b""
    while b"\r\n\r\n" not in buf: buf += s.recv(65536)
    head, _, body = buf.partition(b"\r\n\r\n")
    ln = int([l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0])
    while len(body) < ln: body += s.recv(65536)
    socks.append(s)
time.sleep(2); after = rss()
print(f"{n} idle keep-alive connections: RSS {before} -> {after} KiB, {(after-before)/n:.1f} KiB each")
