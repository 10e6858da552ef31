#!/usr/bin/env python3
"""End-to-end client for `powerhub serve` with authentication and TLS (docs/security.md).

Real clients: Python's `ssl` module for NDJSON over TLS, the `websockets` library over `wss://`
with the test CA, and plain sockets for the rest. Tokens: the config's static tokens, and HS256
JWTs made here with `hmac` (the server's `[auth.jwt]` secret is SECRET below).

Usage: e2e_secure_client.py CONFIG CA_PEM PLAIN_NDJSON TLS_NDJSON TLS_WEBSOCKET SERVER_PID
(addresses as HOST:PORT). CONFIG is the server's config file: the client rewrites its token for
the SIGHUP check. Exit status 0 when every check passes; on failure a message and status 1.
"""

import asyncio
import base64
import hashlib
import hmac
import json
import os
import signal
import socket
import ssl
import sys
import time

import websockets.asyncio.client
import websockets.exceptions

TIMEOUT = 20.0  # a bound on every blocking read, not a timing assertion
SECRET = b"a shared secret of at least thirty-two bytes"


def b64(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(claims, secret=SECRET, header=None):
    head = b64(json.dumps(header or {"alg": "HS256", "typ": "JWT"}).encode())
    body = b64(json.dumps(claims).encode())
    sig = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(sig)}"


def signed(header, payload, secret=SECRET):
    """A JWT of raw header and payload bytes (which need not be JSON), validly signed."""
    head, body = b64(header), b64(payload)
    sig = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(sig)}"


async def wss_checks(ctx, uri):
    """The `wss://` checks, with the library's asyncio client: it drives its TLS socket from one
    thread (its threaded client reads and writes one `ssl` socket from two threads at once,
    which OpenSSL does not allow: a TLS 1.3 session ticket read by its reader thread while the
    other writes the upgrade request can fail the connection with `internal error`)."""
    async def recv(ws):
        return json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))

    async with websockets.asyncio.client.connect(
            uri, ssl=ctx, additional_headers={"Authorization": "Bearer reader-token"},
            open_timeout=TIMEOUT) as ws:
        m = await recv(ws)
        check(m == {"type": "authenticated", "user": "reader", "expiresAt": None}, f"wss: {m}")
        await ws.send(json.dumps({"type": "subscribe", "id": 1, "stream": "obs"}))
        m = await recv(ws)
        check(m.get("type") == "subscribed", f"wss subscribed: {m}")
    try:
        async with websockets.asyncio.client.connect(uri, ssl=ctx, origin="https://evil.example",
                                                     open_timeout=TIMEOUT):
            pass
        check(False, "a foreign origin is refused")
    except websockets.exceptions.InvalidStatus as e:
        check(e.response.status_code == 403, f"403 for a foreign origin: {e}")
    async with websockets.asyncio.client.connect(uri + "?token=reader-token", ssl=ctx,
                                                 origin="https://app.example",
                                                 open_timeout=TIMEOUT) as ws:
        m = await recv(ws)
        check(m.get("user") == "reader", f"a listed origin, the token in the query: {m}")


def addr(text):
    host, port = text.rsplit(":", 1)
    return host, int(port)


class Lines:
    """A newline-delimited JSON connection over a (TLS or plain) socket."""

    def __init__(self, sock):
        sock.settimeout(TIMEOUT)
        self.sock = sock
        self.buf = b""

    def send(self, obj):
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def line(self):
        while b"\n" not in self.buf:
            try:
                chunk = self.sock.recv(65536)
            except (ConnectionResetError, ssl.SSLError):
                chunk = b""
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def msg(self):
        while True:
            line = self.line()
            if line is None:
                return None
            m = json.loads(line)
            if m.get("type") != "ping":
                return m

    def closed(self):
        """Whether the server closes the connection next (keepalive pings aside)."""
        return self.msg() is None


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def tls_context(ca, maximum=None):
    ctx = ssl.create_default_context(cafile=ca)
    if maximum is not None:
        ctx.maximum_version = maximum
    return ctx


def tls_lines(ca, where, maximum=None):
    ctx = tls_context(ca, maximum)
    raw = socket.create_connection(where, timeout=TIMEOUT)
    return Lines(ctx.wrap_socket(raw, server_hostname="localhost")), ctx


def plain_lines(where):
    return Lines(socket.create_connection(where, timeout=TIMEOUT))


def authed(c, token):
    c.send({"type": "auth", "id": "a", "token": token})
    m = c.msg()
    check(m and m.get("type") == "authenticated", f"authenticated with a good token: {m}")
    return m


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    config, ca, plain, tls_ndjson, tls_ws, pid, mtls = sys.argv[1:8]
    plain, tls_ndjson, tls_ws, pid = addr(plain), addr(tls_ndjson), addr(tls_ws), int(pid)
    mtls = addr(mtls)
    now = int(time.time())

    # NDJSON over TLS 1.3 and 1.2 (Python's ssl, verifying the server against the test CA).
    for maximum, version in [(None, "TLSv1.3"), (ssl.TLSVersion.TLSv1_2, "TLSv1.2")]:
        sub, _ = tls_lines(ca, tls_ndjson, maximum)
        check(sub.sock.version() == version, f"negotiated {version}: {sub.sock.version()}")
        authed(sub, "reader-token")
        # One device per round: what an earlier round's connections hold does not count.
        sub.send({"type": "subscribe", "id": 1, "stream": "obs", "deviceId": version})
        check(sub.msg().get("type") == "subscribed", "subscribed over TLS")
        pub, _ = tls_lines(ca, tls_ndjson, maximum)
        authed(pub, jwt({"sub": "ingest", "aud": "powerhub", "exp": now + 600,
                         "permissions": {"publish": {"allow": ["obs", "obs/>"]}}}))
        for seq in range(100):
            pub.send({"type": "publish", "message": {"type": "tick", "stream": "obs",
                                                     "deviceId": version, "seq": seq,
                                                     "pad": "x" * 3000}})
        pub.send({"type": "publish", "id": "last", "message": {"type": "tick", "stream": "obs",
                                                               "deviceId": version, "seq": 100}})
        m = pub.msg()
        check(m == {"type": "published", "requestId": "last", "delivered": 1}, f"published: {m}")
        for seq in range(101):
            m = sub.msg()
            check(m and m.get("seq") == seq, f"{version}: message {seq} in order: {m}")
        # A denied publish is named; the connection stays.
        pub.send({"type": "publish", "id": 2, "message": {"type": "t", "stream": "secret"}})
        m = pub.msg()
        check(m.get("code") == "permission_denied" and "secret" in m.get("message", ""),
              f"permission_denied naming the stream: {m}")
        sub.sock.close()
        pub.sock.close()

    # Every refused token is named, and the connection closes after it.
    good = {"sub": "alice", "aud": "powerhub", "exp": now + 600}
    cases = [
        (jwt(good, b"the wrong secret, also thirty-two bytes long"), "bad_signature"),
        (jwt({**good, "exp": now - 60}), "token_expired"),
        (jwt({**good, "nbf": now + 600}), "token_not_yet_valid"),
        (jwt({**good, "aud": "elsewhere"}), "wrong_audience"),
        ("a.b!.c", "malformed_token"),
        (signed(b'{"alg":"HS256","typ":"JWT"}', b"not json"), "malformed_token"),
        (b64(b'{"alg":"none","typ":"JWT"}') + "." + b64(json.dumps(good).encode()) + ".",
         "alg_none"),
        ("no-such-token", "unknown_token"),
    ]
    for token, code in cases:
        c, _ = tls_lines(ca, tls_ndjson)
        c.send({"type": "auth", "id": 9, "token": token})
        m = c.msg()
        check(m and m.get("code") == code and m.get("requestId") == 9, f"{code}: {m}")
        check(token not in m.get("message", ""), f"the error never repeats the token: {m}")
        check(c.closed(), f"closed after {code}")

    # wss:// with the `websockets` library: the token in the handshake, and origins.
    asyncio.run(wss_checks(tls_context(ca), f"wss://localhost:{tls_ws[1]}/"))

    # Mutual TLS: the client certificate (CN=alice) is listed in [[auth.certificates]], so the
    # connection is alice's with no token, and her permissions apply.
    ctx = tls_context(ca)
    ctx.load_cert_chain(os.path.join(os.path.dirname(ca), "client.pem"),
                        os.path.join(os.path.dirname(ca), "client.key"))
    c = Lines(ctx.wrap_socket(socket.create_connection(mtls, timeout=TIMEOUT),
                              server_hostname="localhost"))
    m = c.msg()
    check(m == {"type": "authenticated", "user": "alice", "expiresAt": None},
          f"mutual TLS: the certificate's subject is the user: {m}")
    c.send({"type": "subscribe", "id": 1, "stream": "obs", "deviceId": "cert"})
    check(c.msg().get("type") == "subscribed", "mutual TLS: subscribed as alice")
    c.send({"type": "subscribe", "id": 2, "stream": "$stats"})
    m = c.msg()
    check(m.get("code") == "permission_denied", f"mutual TLS: alice may not read $stats: {m}")
    c.sock.close()
    # Without a certificate the mutual-TLS listener refuses the handshake.
    raw = socket.create_connection(mtls, timeout=TIMEOUT)
    try:
        s = tls_context(ca).wrap_socket(raw, server_hostname="localhost")
        s.sendall(b'{"type":"ping","id":1}\n')
        data = s.recv(64)
        check(not data, f"mutual TLS without a certificate is refused: {data!r}")
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        pass

    # Plaintext to the TLS port: answered with an alert and closed, at once.
    raw = socket.create_connection(tls_ndjson, timeout=TIMEOUT)
    raw.sendall(b'{"type":"ping","id":1}\n')
    data = raw.recv(64)
    check(data[:1] == b"\x15", f"a TLS alert for plaintext on the TLS port: {data!r}")

    # 10 000 failed authentications on the plaintext listener: nothing left behind.
    before = rss_kib(pid)
    for i in range(10_000):
        c = plain_lines(plain)
        c.send({"type": "auth", "id": i, "token": "wrong-token-%d" % i})
        m = c.msg()
        if m is None or m.get("code") != "unknown_token":
            check(False, f"failed authentication {i}: {m}")
        c.sock.close()
    after = rss_kib(pid)
    check(after < before + 16 * 1024,
          f"RSS after 10 000 failed authentications: {before} KiB before, {after} KiB after")
    print(f"rss: {before} KiB before 10 000 failed authentications, {after} KiB after")

    # SIGHUP: the rotated token works for new connections, the old one no longer does.
    with open(config) as f:
        text = f.read()
    with open(config, "w") as f:
        f.write(text.replace('token = "reader-token"', 'token = "rotated-token"'))
    os.kill(pid, signal.SIGHUP)
    deadline = time.time() + TIMEOUT
    while True:
        c = plain_lines(plain)
        c.send({"type": "auth", "id": 1, "token": "rotated-token"})
        m = c.msg()
        if m and m.get("type") == "authenticated":
            break
        check(time.time() < deadline, f"the rotated token is accepted after SIGHUP: {m}")
        time.sleep(0.05)
    c = plain_lines(plain)
    c.send({"type": "auth", "id": 1, "token": "reader-token"})
    check(c.msg().get("code") == "unknown_token", "the old token is refused after SIGHUP")
    print("ok")


if __name__ == "__main__":
    main()
