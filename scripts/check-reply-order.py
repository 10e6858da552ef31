#!/usr/bin/env python3
"""Black-box check of one push-stream rule against `powerhub serve`: a reply (here the pong to a
ping) never overtakes a delivery published before its command.

A subscriber with a 4 KiB receive buffer reads slowly; a publisher on another connection sends
rounds of telemetry (with a screenshot every fifth message), the last with an id, and waits for
its `published` reply; only then does the subscriber ping, and it reads until its pong. Every
telemetry message of the round (and the round's last screenshot, or its replacement) must arrive
before the pong. Usage:

    python3 scripts/check-reply-order.py [HIGH_WATER_BYTES [SEED [SHARDS]]]

`POWERHUB_BIN` names the server binary (default `target/release/powerhub`). Exits 1 when a pong
overtook a delivery. The subscriber and the publisher land on different shards when SHARDS is
2 or more (connections are assigned round-robin), so this checks the rule across shards, where
`tests/push_backlog.rs` checks it on one connection's shard. Keepalive pings come every second,
so that the check also reads past them on both connections.
"""

import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

BIN = os.environ.get("POWERHUB_BIN", "target/release/powerhub")


def start_server(config, shards):
    path = os.path.join(tempfile.mkdtemp(), "server.toml")
    with open(path, "w") as f:
        f.write(config)
    p = subprocess.Popen(
        [BIN, "serve", "--config", path, "--shards", str(shards), "--listen", "ndjson=127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    port = None
    t0 = time.time()
    while time.time() - t0 < 10:
        line = p.stdout.readline()
        if not line:
            break
        m = re.search(r"listening ndjson \S*:(\d+)", line)
        if m:
            port = int(m.group(1))
        if line.strip() == "ready":
            break
    assert port, "the server printed no ndjson port"
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
    return p, port


class Conn:
    def __init__(self, port, rcvbuf=None):
        self.s = socket.socket()
        if rcvbuf:
            self.s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.s.connect(("127.0.0.1", port))
        self.buf = b""

    def send(self, obj):
        text = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        self.s.sendall(text.encode() + b"\n")

    def recv_line(self, timeout=10):
        self.s.settimeout(timeout)
        while b"\n" not in self.buf:
            d = self.s.recv(65536)
            if not d:
                raise EOFError
            self.buf += d
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def recv_some(self, n, timeout=10):
        """One read of at most `n` bytes; the complete lines so far."""
        self.s.settimeout(timeout)
        d = self.s.recv(n)
        if not d:
            raise EOFError
        self.buf += d
        *lines, self.buf = self.buf.split(b"\n")
        return lines


def main():
    high_water = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    random.seed(int(sys.argv[2]) if len(sys.argv) > 2 else 4)
    shards = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    p, port = start_server(f"[outbox]\nhigh_water_bytes = {high_water}\nkeepalive_interval_ms = 1000\n", shards)
    try:
        sub = Conn(port, 4096)
        sub.send({"type": "subscribe", "id": "s", "stream": "obs"})
        sub.recv_line()
        pub = Conn(port)
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
            # The reply to the round's last publish (the server's keepalive pings, every
            # `keepalive_interval_ms`, come on this connection too).
            while json.loads(pub.recv_line(30)).get("requestId") != "x":
                pass
            sub.send({"type": "ping", "id": it})
            max_n, max_cs, pong = -1, -1, None
            while pong is None:
                lines = pending[:] if pending else sub.recv_some(4096, 30)
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
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()


if __name__ == "__main__":
    sys.exit(main())
