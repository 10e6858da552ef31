"""Publishes N messages of SIZE bytes over NDJSON to a powerhub server at 127.0.0.1:PORT, 64 per
write, to NSUBS subscribers of the same stream that read everything, and waits until each has
received all of them. The payload has the perf tool's shape (numbers padded to a width).

    python3 perf/callgrind_load.py PORT N SIZE [NSUBS]
"""
import socket
import sys
import threading
import time


def connect(port):
    for _ in range(600):
        try:
            return socket.create_connection(("127.0.0.1", port))
        except OSError:
            time.sleep(0.1)
    raise SystemExit("no server on port %d" % port)


def main():
    port, n, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    nsubs = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    subs = []
    for _ in range(nsubs):
        s = connect(port)
        s.sendall(b'{"type":"subscribe","id":1,"stream":"b"}\n')
        buf = b""
        while b"subscribed" not in buf:
            buf += s.recv(4096)
        subs.append(s)
    pad = "x" * max(0, size - 62)
    msg = '{"s":       42,"t":   123456789,"stream":"b","type":"t","p":"%s"}' % pad
    line = ('{"type":"publish","message":%s}\n' % msg).encode()
    counts = [0] * nsubs

    def read(i, s):
        got = 0
        while got < n:
            data = s.recv(1 << 16)
            if not data:
                break
            got += data.count(b'"stream":"b"')
        counts[i] = got

    readers = [threading.Thread(target=read, args=(i, s)) for i, s in enumerate(subs)]
    for t in readers:
        t.start()
    publisher = connect(port)
    batch = line * 64
    for _ in range(0, n, 64):
        publisher.sendall(batch)
    for t in readers:
        t.join()
    print("delivered", counts)


main()
