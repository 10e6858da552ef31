#!/usr/bin/env python3
"""Server memory after a burst: does RSS come back once never-reading clients are closed?

Starts `powerhub serve` (the binary given), measures its RSS idle, then opens N connections
that send `ping` commands and never read, so that each one's unsent replies grow until the server
closes it at `limits.max_outbox_bytes`. Once every connection is closed it samples the server's
RSS for a few seconds and prints the baseline, the peak and each sample.

    python3 perf/burst_rss.py target/release/powerhub [--conns 8] [--backend io_uring|epoll]
        [--warm] [-- more `powerhub serve` arguments, e.g. --config FILE]

Two baselines are printed: cold (the server after one ping) and warm (after a short burst of
publishes to a subscriber that reads: each shard's pool of receive buffers, 64 x 128 KiB, is
then resident, as it stays on any server that has served traffic; on io_uring the kernel
cycles through the whole pool). Exit status 1 when RSS is not back within 2x the baseline
(the warm one with --warm, else the cold one) by the end of the sampling window.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def start(binary, backend, extra):
    proc = subprocess.Popen(
        [binary, "serve", "--shards", "2", "--backend", backend,
         "--listen", "ndjson=127.0.0.1:0", *extra],
        stdout=subprocess.PIPE, text=True)
    addr = None
    for line in proc.stdout:
        words = line.split()
        if words[:2] == ["listening", "ndjson"]:
            host, port = words[2].rsplit(":", 1)
            addr = (host, int(port))
        if words == ["ready"]:
            break
    if addr is None:
        raise SystemExit("powerhub did not report its ndjson listener")
    # Keep draining stdout so the server never blocks on it.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, addr


def flood(addr, done):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(addr)
    chunk = b'{"type":"ping","id":1}\n' * 2800
    try:
        while True:
            s.sendall(chunk)
    except OSError:
        pass
    finally:
        done.append(1)
        s.close()


def warm_up(addr, messages=20000):
    """Publishes `messages` 1 KiB messages to a subscriber that reads them all."""
    sub = socket.create_connection(addr)
    sub.sendall(b'{"type":"subscribe","id":1,"stream":"warm"}\n')
    f = sub.makefile("rb")
    f.readline()
    pad = "x" * 1000
    line = ('{"type":"publish","message":{"type":"t","stream":"warm","p":"%s"}}\n' % pad).encode()
    with socket.create_connection(addr) as pub:
        got = 0
        for _ in range(messages // 500):
            pub.sendall(line * 500)
            for _ in range(500):
                f.readline()
                got += 1
    sub.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--backend", default="io_uring")
    ap.add_argument("--seconds", type=float, default=5.0, help="sampling window after the burst")
    ap.add_argument("--warm", action="store_true", help="take the baseline after a warm-up")
    ap.add_argument("--timeout", type=float, default=120.0, help="bound on the burst itself")
    args, extra = ap.parse_known_args()
    proc, addr = start(args.binary, args.backend, extra)
    try:
        # A warm baseline: one connection that says something, then closes.
        with socket.create_connection(addr) as s:
            s.sendall(b'{"type":"ping","id":0}\n')
            s.recv(100)
        time.sleep(0.5)
        cold = rss_kib(proc.pid)
        if args.warm:
            warm_up(addr)
            time.sleep(0.5)
        base = rss_kib(proc.pid)
        done = []
        threads = [threading.Thread(target=flood, args=(addr, done), daemon=True)
                   for _ in range(args.conns)]
        for t in threads:
            t.start()
        peak, deadline = base, time.time() + args.timeout
        while len(done) < args.conns and time.time() < deadline:
            peak = max(peak, rss_kib(proc.pid))
            time.sleep(0.05)
        if len(done) < args.conns:
            raise SystemExit(f"only {len(done)} of {args.conns} connections were closed")
        samples = []
        end = time.time() + args.seconds
        while time.time() < end:
            samples.append(rss_kib(proc.pid))
            time.sleep(0.25)
        final = samples[-1]
        print(f"cold baseline {cold / 1024:.1f} MiB, warm baseline "
              f"{base / 1024 if args.warm else float('nan'):.1f} MiB")
        print(f"baseline {base / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB, "
              f"after {args.seconds:.0f} s {final / 1024:.1f} MiB "
              f"({final / base:.2f}x the baseline)")
        print("samples (MiB, every 0.25 s):", " ".join(f"{s / 1024:.1f}" for s in samples))
        ok = final <= 2 * base + 4096
        print("within 2x of the baseline" if ok else "NOT within 2x of the baseline")
        return 0 if ok else 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
