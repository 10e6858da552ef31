#!/usr/bin/env python3
"""Checks a powerhub WebSocket endpoint with a client written by others: Python `websockets`.

Usage: websocket_client.py --mode echo|push ws://127.0.0.1:PORT/

Both modes check the framing rules: handshake (and a refused one), ping/pong both ways, the
close handshake from either side, and bad frames closed with the RFC's code (unmasked 1002,
reserved bits 1002, invalid UTF-8 1007, oversized 1009). `echo` talks to the codec's test loop
(which echoes messages, pings on `ping-me`, closes on `close-me`); `push` talks to
`powerhub serve` with the push protocol of docs/protocol.md: subscribe, publish from another
client, fragmented commands, and a subscriber that stops reading while others keep receiving.

Prints one line per check and `N passed, N failed`; exits non-zero when a check failed.
"""

import argparse
import asyncio
import base64
import json
import os
import socket
import struct
import sys
import time
import urllib.parse

import websockets
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

TIMEOUT = 10.0
CHECKS = []


def check(modes):
    def register(fn):
        CHECKS.append((fn.__name__, modes, fn))
        return fn

    return register


def connect(url, **kwargs):
    kwargs.setdefault("proxy", None)
    kwargs.setdefault("open_timeout", TIMEOUT)
    kwargs.setdefault("close_timeout", TIMEOUT)
    kwargs.setdefault("ping_interval", None)
    return ws_connect(url, **kwargs)


async def recv_json(ws, want_type=None):
    """The next JSON message (skipping others than `want_type` when given)."""
    while True:
        text = await asyncio.wait_for(ws.recv(), TIMEOUT)
        assert isinstance(text, str), f"expected a text message, got {text!r}"
        msg = json.loads(text)
        if want_type is None or msg.get("type") == want_type:
            return msg


# ---- raw sockets: what a library client refuses to send ----


def raw_open(url, extra=b""):
    parts = urllib.parse.urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT)
    key = base64.b64encode(os.urandom(16))
    sock.sendall(
        b"GET " + (parts.path or "/").encode() + b" HTTP/1.1\r\nHost: " + parts.netloc.encode()
        + b"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: " + key
        + b"\r\nSec-WebSocket-Version: 13\r\n" + extra + b"\r\n"
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed during the handshake: {head!r}"
        head += chunk
    head, rest = head.split(b"\r\n\r\n", 1)
    return sock, head.decode("latin-1"), rest


def raw_frame(opcode, payload, fin=True, mask=True, rsv=0):
    first = (0x80 if fin else 0) | rsv | opcode
    n = len(payload)
    if n < 126:
        header = struct.pack("!BB", first, (0x80 if mask else 0) | n)
    elif n < 65536:
        header = struct.pack("!BBH", first, (0x80 if mask else 0) | 126, n)
    else:
        header = struct.pack("!BBQ", first, (0x80 if mask else 0) | 127, n)
    if not mask:
        return header + payload
    key = os.urandom(4)
    return header + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def raw_read_frame(sock, buf, deadline):
    """Reads one server frame: returns (opcode, payload, rest of the buffer)."""
    while True:
        if len(buf) >= 2:
            opcode, n = buf[0] & 0x0F, buf[1] & 0x7F
            assert buf[1] & 0x80 == 0, "server frames must not be masked"
            off = {126: 4, 127: 10}.get(n, 2)
            if len(buf) >= off:
                if n == 126:
                    (n,) = struct.unpack("!H", buf[2:4])
                elif n == 127:
                    (n,) = struct.unpack("!Q", buf[2:10])
                if len(buf) >= off + n:
                    return opcode, buf[off : off + n], buf[off + n :]
        assert time.monotonic() < deadline, "no frame in time"
        chunk = sock.recv(65536)
        assert chunk, "the connection closed"
        buf += chunk


def raw_read_close(sock, rest=b""):
    """Reads server frames until a close frame; returns its code (1005 when it has none)."""
    deadline = time.monotonic() + TIMEOUT
    buf = rest
    while True:
        opcode, payload, buf = raw_read_frame(sock, buf, deadline)
        if opcode == 0x8:
            return struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005


def expect_close_code(url, data, code):
    sock, head, rest = raw_open(url)
    try:
        assert head.startswith("HTTP/1.1 101"), head
        sock.sendall(data)
        got = raw_read_close(sock, rest)
        assert got == code, f"expected close code {code}, got {got}"
    finally:
        sock.close()


# ---- checks for every mode ----


@check({"echo", "push"})
async def handshake_is_accepted(url, mode):
    async with connect(url) as ws:
        assert ws.response.status_code == 101
        assert ws.response.headers["Upgrade"].lower() == "websocket"


@check({"echo", "push"})
async def handshake_with_wrong_version_is_refused_with_426(url, mode):
    parts = urllib.parse.urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT)
    try:
        sock.sendall(
            b"GET " + (parts.path or "/").encode() + b" HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 8\r\n\r\n"
        )
        response = sock.recv(4096).decode("latin-1")
        assert response.startswith("HTTP/1.1 426"), response
        assert "Sec-WebSocket-Version: 13" in response, response
    finally:
        sock.close()


@check({"echo", "push"})
async def client_ping_gets_a_pong(url, mode):
    async with connect(url) as ws:
        latency = await asyncio.wait_for(await ws.ping(b"are you there"), TIMEOUT)
        assert latency >= 0


@check({"echo", "push"})
async def client_close_is_echoed_with_its_code(url, mode):
    async with connect(url) as ws:
        await ws.close(1001, "going away")
        assert ws.close_code == 1001, ws.close_code


@check({"echo", "push"})
async def unmasked_frame_is_closed_with_1002(url, mode):
    expect_close_code(url, raw_frame(0x1, b"{}", mask=False), 1002)


@check({"echo", "push"})
async def reserved_bits_are_closed_with_1002(url, mode):
    expect_close_code(url, raw_frame(0x1, b"{}", rsv=0x40), 1002)


@check({"echo", "push"})
async def continuation_without_start_is_closed_with_1002(url, mode):
    expect_close_code(url, raw_frame(0x0, b"x"), 1002)


@check({"echo", "push"})
async def invalid_utf8_is_closed_with_1007(url, mode):
    expect_close_code(url, raw_frame(0x1, b'{"a":"\xff"}'), 1007)


@check({"echo", "push"})
async def oversized_frame_is_closed_with_1009(url, mode):
    # A header announcing 64 MiB: refused before the payload is sent.
    header = struct.pack("!BBQ", 0x82, 0x80 | 127, 64 << 20) + os.urandom(4)
    expect_close_code(url, header, 1009)


# ---- echo mode: the codec's test loop ----


@check({"echo"})
async def text_and_binary_messages_round_trip(url, mode):
    async with connect(url) as ws:
        await ws.send('{"type":"hello","n":1}')
        assert await asyncio.wait_for(ws.recv(), TIMEOUT) == '{"type":"hello","n":1}'
        blob = os.urandom(100_000)
        await ws.send(blob)
        assert await asyncio.wait_for(ws.recv(), TIMEOUT) == blob


@check({"echo"})
async def fragmented_message_is_reassembled(url, mode):
    async with connect(url) as ws:
        await ws.send(['{"a":', '"€"', "}"])
        assert await asyncio.wait_for(ws.recv(), TIMEOUT) == '{"a":"€"}'


@check({"echo"})
async def server_ping_is_answered_by_the_client(url, mode):
    async with connect(url) as ws:
        await ws.send("ping-me")
        assert await asyncio.wait_for(ws.recv(), TIMEOUT) == "got pong"


@check({"echo"})
async def server_close_is_completed_by_the_client(url, mode):
    async with connect(url) as ws:
        await ws.send("close-me")
        try:
            await asyncio.wait_for(ws.recv(), TIMEOUT)
            raise AssertionError("expected the connection to close")
        except ConnectionClosed:
            pass
        assert ws.close_code == 1001, ws.close_code


# ---- push mode: powerhub serve ----


async def subscribe(ws, stream, rid="s1"):
    await ws.send(json.dumps({"type": "subscribe", "id": rid, "stream": stream}))
    reply = await recv_json(ws)
    assert reply.get("type") == "subscribed" and reply.get("requestId") == rid, reply
    return reply["subscriptionId"]


@check({"push"})
async def published_message_reaches_a_websocket_subscriber_byte_for_byte(url, mode):
    async with connect(url) as sub, connect(url) as pub:
        await subscribe(sub, "ws-test")
        message = '{"type":"note", "stream":"ws-test","n":1,"text":"héllo"}'
        await pub.send('{"type":"publish","id":"p1","message":' + message + "}")
        reply = await recv_json(pub)
        assert reply == {"type": "published", "requestId": "p1", "delivered": 1}, reply
        got = await asyncio.wait_for(sub.recv(), TIMEOUT)
        assert got == message, got


@check({"push"})
async def fragmented_command_is_reassembled(url, mode):
    async with connect(url) as ws:
        await ws.send(['{"type":"ping",', '"id":"f€1"}'])
        reply = await recv_json(ws)
        assert reply == {"type": "pong", "requestId": "f€1"}, reply


@check({"push"})
async def json_ping_command_gets_its_pong(url, mode):
    async with connect(url) as ws:
        await ws.send('{"type":"ping","id":7}')
        assert await recv_json(ws) == {"type": "pong", "requestId": 7}


@check({"push"})
async def keepalive_is_a_ping_frame_and_pongs_keep_the_connection(url, mode):
    # The test's engine pings every 300 ms and reaps after 4 s without a pong; answer every
    # ping for 6 s: the connection must stay open. (It says one message first: a connection
    # that sends no message at all is closed at limits.first_message_timeout_ms, and a pong
    # is a control frame, not a message.)
    sock, head, buf = raw_open(url)
    try:
        assert head.startswith("HTTP/1.1 101"), head
        sock.sendall(raw_frame(0x1, b'{"type":"ping","id":"hello"}'))
        end = time.monotonic() + 6.0
        pings = 0
        while time.monotonic() < end:
            opcode, payload, buf = raw_read_frame(sock, buf, time.monotonic() + TIMEOUT)
            assert opcode != 0x8, "closed while answering pings"
            if opcode == 0x9:
                pings += 1
                sock.sendall(raw_frame(0xA, payload))
        assert pings >= 6, f"only {pings} pings in 6 s"
    finally:
        sock.close()


@check({"push"})
async def subscriber_that_stops_reading_does_not_stall_the_others(url, mode):
    stream = "ws-slow"
    async with connect(url, max_queue=1) as slow, connect(url) as healthy, connect(url) as pub:
        await subscribe(slow, stream, "a")
        await subscribe(healthy, stream, "b")
        # `slow` never reads again (and so never answers a ping: the server may reap it).
        # Publish 64 MiB; the healthy subscriber must get every message.
        blob = "x" * (256 << 10)
        count = 256
        received = 0

        async def read_healthy():
            nonlocal received
            while received < count:
                msg = json.loads(await asyncio.wait_for(healthy.recv(), 30))
                if msg.get("stream") == stream:
                    received += 1

        async def read_replies():
            replies = 0
            while replies < count:
                await recv_json(pub, "published")
                replies += 1

        # Both readers run while publishing, so that they keep answering keepalive pings. The
        # publisher stays within 16 MiB of the healthy reader: the three clients share one event
        # loop, where sends that never wait would starve the reader (and a reader 32 MiB behind
        # is closed at max_outbox_bytes, as the spec says).
        reader = asyncio.create_task(read_healthy())
        replies = asyncio.create_task(read_replies())
        for i in range(count):
            while i - received > 64 and not reader.done():
                await asyncio.sleep(0.001)
            await pub.send(json.dumps({"type": "publish", "id": i, "message": {"type": "bulk", "stream": stream, "i": i, "blob": blob}}))
        await asyncio.wait_for(replies, 60)
        await asyncio.wait_for(reader, 60)
        assert received == count, received


async def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["echo", "push"], required=True)
    parser.add_argument("url")
    args = parser.parse_args()
    passed = failed = 0
    for name, modes, fn in CHECKS:
        if args.mode not in modes:
            continue
        try:
            await asyncio.wait_for(fn(args.url, args.mode), 120)
            print(f"ok     {name}", flush=True)
            passed += 1
        except Exception as e:  # noqa: BLE001 - report every failure and go on
            print(f"FAILED {name}: {type(e).__name__}: {e}", flush=True)
            failed += 1
    print(f"websockets {websockets.__version__}")
    print(f"python-websockets: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
