#!/usr/bin/env python3
"""Black-box check of one push-stream rule against `powerhub serve`: a reply (here the pong to a
ping) never overtakes a delivery published before its command.

A subscriber with a 4 KiB receive buffer reads slowly; a publisher on another connection sends
rounds of telemetry (with a screenshot every fifth message), the last with an id, and waits for
its `published` reply; only then does the subscriber ping, and it reads until its pong. Every
telemetry message of the round (and the round's last screenshot, or its replacement) must arrive
before the pong. Usage:

    python3 scripts/check-reply-order.py [HIGH_WATER_BYTES [SEED [BACKEND]]]

`POWERHUB_BIN` names the server binary (default `target/release/powerhub`). Exits 1 when a pong
overtook a delivery. The server runs two shards, and connections are assigned round-robin: the
subscriber and the publisher are on different shards, so this checks the rule across shards, where
`tests/push_backlog.rs` checks it on one connection's shard. Keepalive pings come every second,
so that the check also reads past them on both connections.
"""

import json
import os
import random
import socket
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "perf")]
from burst_rss import start  # noqa: E402  (the server on loopback, two shards)
from e2e_client import Lines  # noqa: E402  (an NDJSON connection; `msg` skips keepalive pings)

BIN = os.environ.get("POWERHUB_BIN", "target/release/powerhub")


def read_some(conn, n):
    """One read of at most `n` bytes (a slow reader); the complete lines so far."""
    data = conn.sock.recv(n)
    if not data:
        raise EOFError
    conn.buf += data
    *lines, conn.buf = conn.buf.split(b"\n")
    return lines


def main():
    high_water = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    random.seed(int(sys.argv[2]) if len(sys.argv) > 2 else 4)
    backend = sys.argv[3] if len(sys.argv) > 3 else "io_uring"
    config = os.path.join(tempfile.mkdtemp(), "server.toml")
    with open(config, "w") as f:
        f.write(f"[outbox]\nhigh_water_bytes = {high_water}\nkeepalive_interval_ms = 1000\n")
    p, addr = start(BIN, backend, ["--config", config])
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(addr)
        sub = Lines(sock)
        sub.send({"type": "subscribe", "id": "s", "stream": "obs"})
        sub.msg()
        pub = Lines(socket.create_connection(addr))
        pending, n, cs, fails = [], 0, 0, 0
        for it in range(30):
            k = random.choice([50, 500, 3000])
            for j in range(k):
                pad = "x" * random.randint(50, 2000)
                pub.send('{"type":"publish","message":{"type":"telemetry","stream":"obs","n":%d,"pad":"%s"}}' % (n, pad))
                n += 1
                if j % 5 == 0:
                    cs += 1
                    shot = '{"type":"screenshot_update","stream":"obs","deviceId":"d1","deviceSessionUuid":"u1","captureSequence":%d,"png":"%s"}' % (cs, "P" * 3000)
                    pub.send('{"type":"publish","message":%s}' % shot)
            pub.send('{"type":"publish","id":"x","message":{"type":"telemetry","stream":"obs","n":%d}}' % n)
            n += 1
            # The reply to the round's last publish (past the server's keepalive pings).
            while pub.msg().get("requestId") != "x":
                pass
            sub.send({"type": "ping", "id": it})
            max_n, max_cs, pong = -1, -1, None
            while pong is None:
                lines = pending[:] if pending else read_some(sub, 4096)
                pending.clear()
                for i, line in enumerate(lines):
                    o = json.loads(line)
                    if o["type"] == "pong":
                        pong = o
                        pending.extend(lines[i + 1 :])
                        break
                    if o["type"] == "telemetry":
                        max_n = max(max_n, o["n"])
                    if o["type"] == "screenshot_update":
                        max_cs = max(max_cs, o["captureSequence"])
                if pong is None and random.random() < 0.2:
                    time.sleep(0.005)
            if pong.get("requestId") != it or max_n != n - 1 or max_cs != cs:
                fails += 1
                print(f"round {it}: pong {pong} after telemetry {max_n} of {n - 1}, screenshot {max_cs} of {cs}")
        print(f"rounds 30, pongs that overtook a delivery: {fails}")
        return 1 if fails else 0
    finally:
        p.terminate()
        p.wait()


if __name__ == "__main__":
    sys.exit(main())
