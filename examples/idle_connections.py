#!/usr/bin/env python3
"""Measures the server's user-space memory per idle connection (Python standard library only).

Starts `powerhub serve` on loopback, opens N idle connections (subscribed to one stream each
with --subscribe), and reports the growth of the server's resident set size per connection.

Usage: examples/idle_connections.py PATH_TO_POWERHUB N BACKEND [--subscribe] [-- SERVE_ARGS...]
e.g.   cargo build --release --bin powerhub &&
       python3 examples/idle_connections.py target/release/powerhub 8000 io_uring --subscribe
"""

import socket
import subprocess
import sys
import time


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def main():
    binary, n, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rest = sys.argv[4:]
    subscribe = "--subscribe" in rest
    extra = rest[rest.index("--") + 1:] if "--" in rest else []
    server = subprocess.Popen(
        [binary, "serve", "--shards", "2", "--backend", backend, "--max-connections", str(n + 16),
         "--listen", "ndjson=127.0.0.1:0", "--listen", "frame=127.0.0.1:0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        addr = None
        for line in server.stdout:
            if line.startswith("listening ndjson"):
                addr = line.split()[2]
            if line.strip() == "ready":
                break
        host, port = addr.rsplit(":", 1)
        before = rss_kib(server.pid)
        socks = []
        for _ in range(n):
            s = socket.create_connection((host, int(port)))
            if subscribe:
                s.sendall(b'{"type":"subscribe","stream":"idle"}\n')
            socks.append(s)
        if subscribe:
            for s in socks:
                s.settimeout(10)
                assert b"subscribed" in s.recv(4096)
        time.sleep(0.5)
        after = rss_kib(server.pid)
        kind = "subscribed" if subscribe else "unsubscribed"
        print(f"{backend}: {n} {kind} idle connections: server RSS {before} KiB -> {after} KiB, "
              f"{(after - before) * 1024 / n:.0f} bytes per connection")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
