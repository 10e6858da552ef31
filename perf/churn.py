#!/usr/bin/env python3
"""Connection churn: the server's CPU time per connection opened, subscribed and closed.

    python3 perf/churn.py target/release/powerhub [connections] [port]

Starts `BINARY serve` on one shard pinned to CPU 1 (POWERHUB_BACKEND=epoll selects the epoll
backend), pins itself to CPU 0, and runs `connections` rounds of: connect, subscribe, read the
confirmation, close (the client closes first). It prints the rounds per second (this client is
the bottleneck) and the server's user + system CPU per round, read from /proc (clock-tick
resolution: about 1 µs per round at 10 000 rounds). Run two binaries in turn, several times,
to compare them.
"""
import os
import socket
import subprocess
import sys
import tempfile
import time


def main():
    binary = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 27_400
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(f'[engine]\nshards = 1\n[[listener]]\nprotocol = "ndjson"\n'
                f'address = "127.0.0.1:{port}"\n')
        cfg = f.name
    srv = subprocess.Popen(["taskset", "-c", "1", binary, "serve", "--config", cfg],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        os.sched_setaffinity(0, {0})
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            sys.exit(f"{binary} did not listen on 127.0.0.1:{port}")

        def cpu():
            with open(f"/proc/{srv.pid}/stat") as stat:
                f = stat.read().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

        def once():
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b'{"type":"subscribe","id":1,"stream":"churn"}\n')
            buf = b""
            while b'"subscribed"' not in buf:
                chunk = s.recv(4096)
                if not chunk:
                    sys.exit(f"the server closed before confirming: {buf!r}")
                buf += chunk
            s.close()

        for _ in range(n // 5):  # warm-up
            once()
        c0, t0 = cpu(), time.time()
        for _ in range(n):
            once()
        time.sleep(0.3)  # the last closes
        c1, t1 = cpu(), time.time()
        print(f"{binary}: {n} connections, {n / (t1 - t0):.0f}/s, "
              f"server CPU {1e6 * (c1 - c0) / n:.1f} µs per connection")
    finally:
        srv.terminate()
        srv.wait()
        os.unlink(cfg)


if __name__ == "__main__":
    main()
