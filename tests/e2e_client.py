#!/usr/bin/env python3
"""End-to-end client for `powerhub serve`, written with Python's standard library only.

It speaks the documented push protocol (docs/protocol.md) over the server's NDJSON TCP listener,
its binary-frame listener and its NDJSON Unix-socket listener, and finally asks the server to shut
down (SIGTERM) and checks that everything published before the signal is delivered, then the
connection closes.

Usage: e2e_client.py NDJSON_HOST:PORT FRAME_HOST:PORT UNIX_PATH SERVER_PID
Exit status 0 when every check passes; on failure a message on stderr and status 1.
"""

import json
import os
import signal
import socket
import struct
import sys

TIMEOUT = 20.0  # a bound on every blocking read, not a timing assertion


class Lines:
    """A newline-delimited JSON connection."""

    def __init__(self, sock):
        sock.settimeout(TIMEOUT)
        self.sock = sock
        self.buf = b""

    def send(self, obj_or_text):
        text = obj_or_text if isinstance(obj_or_text, (str, bytes)) else json.dumps(obj_or_text)
        data = text.encode() if isinstance(text, str) else text
        self.sock.sendall(data + b"\n")

    def line(self):
        """The next raw line (bytes, without newline), or None at end of stream."""
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def msg(self):
        """The next message that is not a keepalive ping (which is answered)."""
        while True:
            line = self.line()
            if line is None:
                raise AssertionError("connection closed while a message was expected")
            obj = json.loads(line)
            if obj.get("type") == "ping":
                self.send({"type": "pong"})
                continue
            return obj


def tcp(addr):
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=TIMEOUT)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def ndjson_pubsub(addr):
    sub = Lines(tcp(addr))
    pub = Lines(tcp(addr))
    sub.send({"type": "subscribe", "id": "s1", "stream": "e2e"})
    reply = sub.msg()
    check(reply.get("type") == "subscribed" and reply.get("requestId") == "s1", f"subscribe reply: {reply}")
    sent = []
    for i in range(200):
        text = json.dumps({"type": "tick", "stream": "e2e", "seq": i, "text": "h\u00e9llo \"q\""})
        sent.append(text.encode())
        pub.send('{"type":"publish","id":%d,"message":%s}' % (i, text))
    for i in range(200):
        r = pub.msg()
        check(r.get("type") == "published" and r.get("requestId") == i, f"publish reply {i}: {r}")
        check(r.get("delivered") == 1, f"delivered count: {r}")
    for i in range(200):
        line = sub.line()
        while line is not None and json.loads(line).get("type") == "ping":
            sub.send({"type": "pong"})
            line = sub.line()
        check(line == sent[i], f"delivery {i} is the published bytes: {line!r} != {sent[i]!r}")
    # Malformed input: an error naming the problem, and the connection survives.
    sub.send("{this is not json")
    err = sub.msg()
    check(err.get("type") == "error" and err.get("code") == "invalid_json", f"error reply: {err}")
    sub.send({"type": "subscirbe", "id": "x"})
    err = sub.msg()
    check(err.get("code") == "unknown_command" and err.get("requestId") == "x", f"unknown command: {err}")
    sub.send({"type": "ping", "id": 9})
    pong = sub.msg()
    check(pong == {"type": "pong", "requestId": 9}, f"pong after errors: {pong}")
    sub.send({"type": "unsubscribe", "id": "u", "subscriptionId": reply["subscriptionId"]})
    ack = sub.msg()
    check(ack.get("type") == "unsubscribed", f"unsubscribe reply: {ack}")
    sub.sock.close()
    pub.sock.close()


def large_screenshot_then_frames_dropped(addr):
    """The embedded default admits a screenshot past the 8 MiB high-water mark unchanged (the
    push-stream spec: "an individual screenshot may exceed it, and the first frame is admitted
    unchanged"); while more than 8 MiB of it are unsent to a reader that stalls, the next
    screenshot of its slot is replaced by one frames_dropped notification."""
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    host, port = addr.rsplit(":", 1)
    raw.connect((host, int(port)))
    sub = Lines(raw)
    pub = Lines(tcp(addr))
    sub.send({"type": "subscribe", "id": "big", "stream": "screens", "deviceId": "d1"})
    reply = sub.msg()
    check(reply.get("type") == "subscribed", f"subscribe reply: {reply}")
    size = 15 << 20
    big = '{"type":"screenshot_update","stream":"screens","deviceId":"d1","deviceSessionUuid":"s1","image":"%s"}' % ("A" * size)
    pub.send('{"type":"publish","id":1,"message":%s}' % big)
    r = pub.msg()
    check(r.get("type") == "published" and r.get("delivered") == 1, f"publish of {size} bytes: {r}")
    # The screenshot's first bytes arrive: its write is under way, most of it unsent. Then the
    # reader stalls while the next screenshot of the slot is published.
    head = b""
    while len(head) < 1024:
        head += raw.recv(1024 - len(head))
    check(head.startswith(b'{"type":"screenshot_update"'), f"the screenshot comes first: {head[:60]!r}")
    pub.send('{"type":"publish","id":2,"message":{"type":"screenshot_update","stream":"screens","deviceId":"d1","deviceSessionUuid":"s1","image":"B"}}')
    r = pub.msg()
    check(r.get("type") == "published" and r.get("requestId") == 2, f"second publish: {r}")
    sub.buf = head
    first = sub.line()
    check(first == big.encode(), f"the first screenshot arrives unchanged ({len(first or b'')} bytes)")
    dropped = sub.msg()
    check(dropped == {"type": "frames_dropped", "subscriptionId": reply["subscriptionId"], "deviceId": "d1",
                      "deviceSessionUuid": "s1", "droppedType": "screenshot_update", "reason": "backpressure"},
          f"the next screenshot is replaced by the notification: {dropped}")
    sub.send({"type": "ping", "id": "after"})
    pong = sub.msg()
    check(pong == {"type": "pong", "requestId": "after"}, f"nothing else was queued: {pong}")
    sub.sock.close()
    pub.sock.close()


def frame(messages):
    payload = b"[" + b",".join(messages) + b"]"
    return b"PH" + bytes([1, 1]) + struct.pack("<II", len(messages), len(payload)) + payload


def read_frame(sock):
    def exact(n):
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise AssertionError("frame connection closed")
            data += chunk
        return data

    head = exact(12)
    check(head[:2] == b"PH" and head[2] == 1, f"frame header: {head!r}")
    count, length = struct.unpack("<II", head[4:])
    payload = exact(length)
    if head[3] == 1:
        items = json.loads(payload)
        check(len(items) == count, "frame count matches its array")
        return items
    return [payload]


def frame_pubsub(addr):
    sock = tcp(addr)
    sock.sendall(frame([b'{"type":"subscribe","id":"f1","stream":"framed"}']))
    (reply,) = read_frame(sock)
    check(reply.get("type") == "subscribed", f"frame subscribe reply: {reply}")
    msgs = [json.dumps({"type": "tick", "stream": "framed", "seq": i}).encode() for i in range(5)]
    sock.sendall(frame([b'{"type":"publish","id":%d,"message":%s}' % (i, m) for i, m in enumerate(msgs)]))
    got = []
    published = 0
    while len(got) < 5 or published < 5:
        for item in read_frame(sock):
            if item.get("type") == "published":
                published += 1
            elif item.get("type") == "tick":
                got.append(item["seq"])
    check(got == list(range(5)), f"framed deliveries in order: {got}")
    sock.close()


def unix_ping(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(TIMEOUT)
    s.connect(path)
    c = Lines(s)
    c.send({"type": "ping", "id": "u1"})
    check(c.msg() == {"type": "pong", "requestId": "u1"}, "pong over the Unix socket")
    s.close()


def graceful_shutdown(addr, server_pid):
    sub = Lines(tcp(addr))
    pub = Lines(tcp(addr))
    sub.send({"type": "subscribe", "id": "g", "stream": "last"})
    check(sub.msg().get("type") == "subscribed", "subscribed before shutdown")
    # Fewer than the default subscriptions.max_queue (256): a burst beyond it may be trimmed by
    # the drop-oldest policy before the hub drains, which is not what this checks.
    n = 200
    for i in range(n):
        pub.send('{"type":"publish","id":%d,"message":{"type":"tick","stream":"last","seq":%d}}' % (i, i))
    for i in range(n):
        check(pub.msg().get("type") == "published", "published before shutdown")
    os.kill(server_pid, signal.SIGTERM)
    for i in range(n):
        m = sub.msg()
        check(m.get("seq") == i, f"message {i} published before the signal is delivered: {m}")
    while True:
        line = sub.line()
        if line is None:
            break
        m = json.loads(line)
        check(m.get("type") == "ping" or m.get("code") == "shutdown",
              f"nothing but keepalive (and the shutdown error) after the last message: {line!r}")


def main():
    ndjson, framed, unix_path, pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    ndjson_pubsub(ndjson)
    large_screenshot_then_frames_dropped(ndjson)
    frame_pubsub(framed)
    unix_ping(unix_path)
    graceful_shutdown(ndjson, pid)
    print("e2e ok")


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # report any failure as a non-zero exit with the reason
        print(f"e2e failed: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
