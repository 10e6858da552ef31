//! How a [`PushConnection`] ends when its protocol stops carrying data first (a WebSocket that
//! fails on a client's message, or answers the client's close): what it encoded while open is
//! written ahead of the protocol's last words, what was still queued is dropped, and the
//! connection ends written in full (so the shard shuts the socket down at once, not at the
//! closing deadline).

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use powerhub::outbox::{OutboxConfig, PayloadFactory};
use powerhub::plugin::{ProtocolFactory, ProtocolLimits};
use powerhub::protocol::{Session, SessionConfig};
use powerhub::push::{PushConfig, PushConnection, PushLimits, PushState, Request};
use powerhub_websocket::{WebSocketConfig, WebSocketFactory};

const HANDSHAKE: &[u8] = b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n\
Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";

/// One masked client frame (payloads under 64 KiB).
fn client_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let key = [1u8, 2, 3, 4];
    let mut out = vec![0x80 | opcode];
    if payload.len() < 126 {
        out.push(0x80 | payload.len() as u8);
    } else {
        out.push(0x80 | 126);
        out.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    }
    out.extend_from_slice(&key);
    out.extend(payload.iter().zip(key.iter().cycle()).map(|(b, k)| b ^ k));
    out
}

/// The server frames in `wire` (after the handshake response): (opcode, payload).
fn server_frames(wire: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let end = wire
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a handshake response")
        + 4;
    let mut rest = &wire[end..];
    let mut frames = Vec::new();
    while let [b0, b1, ..] = *rest {
        let (len, at) = match b1 & 0x7f {
            126 => (usize::from(u16::from_be_bytes([rest[2], rest[3]])), 4),
            127 => panic!("no frame here is that long"),
            n => (usize::from(n), 2),
        };
        frames.push((b0 & 0x0f, rest[at..at + len].to_vec()));
        rest = &rest[at + len..];
    }
    frames
}

/// A push connection over WebSocket (else NDJSON) whose protocol reads messages of up to
/// `max_message` bytes, with a session of `session`.
fn connection(
    websocket: bool,
    max_message: usize,
    session: SessionConfig,
    now: Instant,
) -> PushConnection {
    let limits = ProtocolLimits::default().with_max_message_bytes(max_message);
    let proto = if websocket {
        WebSocketFactory::new(WebSocketConfig::default())
            .expect("a valid config")
            .new_connection(&limits)
    } else {
        powerhub_ndjson::NdjsonFactory.new_connection(&limits)
    };
    let config = PushConfig::new(
        PushLimits::default(),
        OutboxConfig::default(),
        Arc::new(PayloadFactory),
    )
    .expect("a valid config");
    PushConnection::new(proto, Session::new(1, session), &Arc::new(config), now)
        .expect("a valid config")
}

/// Hands `input` to the connection and answers its requests (every subscribe succeeds);
/// the last subscription's id.
fn feed(conn: &mut PushConnection, input: &[u8], now: Instant) -> Option<Arc<str>> {
    conn.handle_input(input, now);
    let mut sub = None;
    while let Some(request) = conn.poll(now, SystemTime::now()) {
        match request {
            Request::Subscribe {
                subscription_id, ..
            } => {
                sub = Some(subscription_id);
                conn.subscribe_done(Ok(()), now);
            }
            Request::FanOut => {}
            other => panic!("unexpected request {other:?}"),
        }
    }
    sub
}

/// A WebSocket push connection past its handshake, subscribed to `s`, with its subscription id.
fn subscribed(now: Instant) -> (PushConnection, Arc<str>, Vec<u8>) {
    let session = SessionConfig {
        max_line_bytes: 256,
        ..SessionConfig::default()
    };
    let mut conn = connection(true, 256, session, now);
    let mut input = HANDSHAKE.to_vec();
    input.extend(client_frame(
        1,
        br#"{"type":"subscribe","id":1,"stream":"s"}"#,
    ));
    let sub = feed(&mut conn, &input, now);
    let mut wire = Vec::new();
    write(&mut conn, &mut wire, usize::MAX, now);
    (conn, sub.expect("a subscribe request"), wire)
}

/// One write: the socket takes at most `cap` bytes of the offer.
fn write(conn: &mut PushConnection, wire: &mut Vec<u8>, cap: usize, now: Instant) -> usize {
    let mut chunks = Vec::new();
    let Some(transmit) = conn.poll_transmit(&mut chunks, 64, now) else {
        return 0;
    };
    let taken = cap.min(transmit.len());
    let mut left = taken;
    for c in &chunks {
        let n = left.min(c.len());
        wire.extend_from_slice(&c[..n]);
        left -= n;
    }
    conn.on_written(transmit, taken, now);
    taken
}

/// Writes until nothing moves.
fn drain(conn: &mut PushConnection, wire: &mut Vec<u8>, now: Instant) {
    conn.on_writable(now);
    while write(conn, wire, usize::MAX, now) > 0 {}
}

/// A lossless `log` line on stream `s` padded with `pad` bytes, as a delivery.
fn log_line(pad: usize) -> Bytes {
    Bytes::from(format!(
        "{{\"type\":\"log\",\"stream\":\"s\",\"pad\":\"{}\"}}\n",
        "x".repeat(pad)
    ))
}

/// A delivery of one line on `stream`.
fn line(n: u32) -> Bytes {
    Bytes::from(format!(
        "{{\"type\":\"tick\",\"stream\":\"s\",\"n\":{n}}}\n"
    ))
}

/// The connection fed `input` while message 1 is encoded and unsent (its socket took none of
/// it) and message 2 queued behind it.
fn stalled_then(input: &[u8]) -> (PushConnection, Vec<u8>) {
    let now = Instant::now();
    let (mut conn, sub, mut wire) = subscribed(now);
    conn.deliver_lines(&sub, line(1), now);
    assert_eq!(
        write(&mut conn, &mut wire, 0, now),
        0,
        "the socket took none"
    );
    conn.deliver_lines(&sub, line(2), now);
    conn.handle_input(input, now);
    while let Some(request) = conn.poll(now, SystemTime::now()) {
        assert_eq!(
            request,
            Request::FanOut,
            "nothing but the fan-out before the input"
        );
    }
    assert_eq!(conn.state(), PushState::Closing);
    drain(&mut conn, &mut wire, now);
    (conn, wire)
}

fn texts(frames: &[(u8, Vec<u8>)]) -> Vec<String> {
    frames
        .iter()
        .filter(|(op, _)| *op == 1)
        .map(|(_, p)| String::from_utf8(p.clone()).expect("UTF-8"))
        .collect()
}

#[test]
fn a_message_over_the_limit_is_refused_after_what_was_encoded_and_nothing_follows_the_close() {
    let oversized = format!(r#"{{"type":"ping","pad":"{}"}}"#, "x".repeat(300));
    let (conn, wire) = stalled_then(&client_frame(1, oversized.as_bytes()));
    let frames = server_frames(&wire);
    let texts = texts(&frames);
    assert_eq!(texts.len(), 3, "{texts:?}");
    assert!(texts[0].contains(r#""type":"subscribed""#), "{texts:?}");
    assert!(texts[1].contains(r#""n":1"#), "{texts:?}");
    assert!(texts[2].contains("max_message_bytes"), "{texts:?}");
    let (last_op, last) = frames.last().expect("frames");
    assert_eq!(*last_op, 8, "the close frame is last: {frames:?}");
    assert_eq!(u16::from_be_bytes([last[0], last[1]]), 1009);
    assert!(conn.is_written(), "the connection ends written in full");
    assert_eq!(conn.stats().queued, 0, "message 2 could never be framed");
}

#[test]
fn the_answer_to_a_peers_close_follows_what_was_encoded_before_it() {
    let (conn, wire) = stalled_then(&client_frame(8, &1000u16.to_be_bytes()));
    let frames = server_frames(&wire);
    let texts = texts(&frames);
    assert_eq!(texts.len(), 2, "{texts:?}");
    assert!(texts[1].contains(r#""n":1"#), "{texts:?}");
    let (last_op, last) = frames.last().expect("frames");
    assert_eq!(*last_op, 8, "the close reply is last: {frames:?}");
    assert_eq!(u16::from_be_bytes([last[0], last[1]]), 1000);
    assert!(conn.is_written(), "the connection ends written in full");
    assert_eq!(conn.stats().queued, 0);
}

/// An NDJSON push connection subscribed to `s` (lines over 256 bytes cannot be framed).
fn ndjson_subscribed(now: Instant) -> (PushConnection, Arc<str>, Vec<u8>) {
    let mut conn = connection(false, 256, SessionConfig::default(), now);
    let sub = feed(
        &mut conn,
        b"{\"type\":\"subscribe\",\"id\":1,\"stream\":\"s\"}\n",
        now,
    );
    let mut wire = Vec::new();
    write(&mut conn, &mut wire, usize::MAX, now);
    (conn, sub.expect("a subscribe request"), wire)
}

/// The final error of a line too long to frame goes after everything queued before it (the
/// deliveries, the replies to the commands read before the line): a lossless message is never
/// dropped silently, and the peer gets what it would have had if the line came in a later
/// receive. Nothing follows the error.
#[test]
fn a_line_too_long_to_frame_gets_the_final_error_after_everything_queued_and_nothing_after_it() {
    let now = Instant::now();
    let (mut conn, sub, mut wire) = ndjson_subscribed(now);
    conn.deliver_lines(&sub, line(1), now);
    assert_eq!(
        write(&mut conn, &mut wire, 0, now),
        0,
        "the socket took none"
    );
    conn.deliver_lines(&sub, line(2), now);
    // A command, then the long line, in one receive.
    let mut input = br#"{"type":"ping","id":"p"}"#.to_vec();
    input.push(b'\n');
    input.extend_from_slice(br#"{"type":"ping","pad":""#);
    input.extend(std::iter::repeat_n(b'x', 400));
    input.extend_from_slice(b"\"}\n");
    conn.handle_input(&input, now);
    while conn.poll(now, SystemTime::now()).is_some() {}
    assert_eq!(conn.state(), PushState::Closing);
    conn.deliver_lines(&sub, line(3), now);
    drain(&mut conn, &mut wire, now);
    let text = String::from_utf8(wire).expect("UTF-8");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 5, "{text}");
    assert!(lines[0].contains(r#""type":"subscribed""#), "{text}");
    assert!(lines[1].contains(r#""n":1"#), "{text}");
    assert!(lines[2].contains(r#""n":2"#), "{text}");
    assert!(lines[3].contains(r#""type":"pong""#), "{text}");
    assert!(
        lines[4].contains(r#""code":"limit_exceeded""#) && lines[4].contains("max_message_bytes"),
        "the final error is last: {text}"
    );
    assert!(conn.is_written());
    assert_eq!(conn.stats().queued, 0);
}

#[test]
fn the_upgrade_response_still_goes_first_when_the_next_message_is_refused() {
    let now = Instant::now();
    let mut conn = connection(true, 256, SessionConfig::default(), now);
    let mut input = HANDSHAKE.to_vec();
    input.extend(client_frame(1, br#"{"type":"ping","id":1}"#));
    feed(&mut conn, &input, now);
    // The upgrade response and the pong are offered; the socket takes none of them.
    let mut wire = Vec::new();
    assert_eq!(write(&mut conn, &mut wire, 0, now), 0);
    let oversized = format!(r#"{{"type":"ping","pad":"{}"}}"#, "x".repeat(300));
    conn.handle_input(&client_frame(1, oversized.as_bytes()), now);
    while conn.poll(now, SystemTime::now()).is_some() {}
    drain(&mut conn, &mut wire, now);
    assert!(wire.starts_with(b"HTTP/1.1 101 "), "the upgrade first");
    let frames = server_frames(&wire);
    let texts = texts(&frames);
    assert_eq!(texts.len(), 2, "{texts:?}");
    assert!(texts[0].contains(r#""type":"pong""#), "{texts:?}");
    assert!(texts[1].contains("max_message_bytes"), "{texts:?}");
    assert_eq!(frames.last().map(|f| f.0), Some(8), "the close frame last");
    assert!(conn.is_written());
}

#[test]
fn the_answer_to_a_peers_close_is_written_when_an_earlier_command_of_the_same_read_closes() {
    let now = Instant::now();
    let session = SessionConfig {
        max_subscriptions: 1,
        ..SessionConfig::default()
    };
    let mut conn = connection(
        true,
        ProtocolLimits::default().max_message_bytes,
        session,
        now,
    );
    let mut input = HANDSHAKE.to_vec();
    input.extend(client_frame(
        1,
        br#"{"type":"subscribe","id":1,"stream":"a"}"#,
    ));
    input.extend(client_frame(
        1,
        br#"{"type":"subscribe","id":2,"stream":"b"}"#,
    ));
    input.extend(client_frame(8, &1000u16.to_be_bytes()));
    feed(&mut conn, &input, now);
    assert_eq!(conn.state(), PushState::Closing);
    let mut wire = Vec::new();
    drain(&mut conn, &mut wire, now);
    let frames = server_frames(&wire);
    let (last_op, last) = frames.last().expect("frames");
    assert_eq!(*last_op, 8, "a close frame ends the stream: {frames:?}");
    assert_eq!(u16::from_be_bytes([last[0], last[1]]), 1000);
    assert!(conn.is_written());
}

/// A decode error ends the input: an end of stream handled before the error was polled reads
/// nothing more (the bytes after a line over the limit are no command, and its final error is
/// said once).
#[test]
fn the_end_of_stream_after_a_decode_error_reads_nothing_more() {
    let now = Instant::now();
    let mut conn = connection(false, 16, SessionConfig::default(), now);
    conn.handle_input(b"0123456789012345678901234567890123456789", now);
    conn.handle_input(br#"{"type":"ping","id":9}"#, now);
    conn.handle_end_of_stream(now);
    assert_eq!(conn.poll(now, SystemTime::now()), None);
    let mut wire = Vec::new();
    for _ in 0..4 {
        write(&mut conn, &mut wire, usize::MAX, now);
    }
    let text = String::from_utf8(wire).unwrap();
    assert_eq!(text.lines().count(), 1, "one final error: {text}");
    assert!(text.contains("max_message_bytes"), "{text}");
    assert!(!text.contains("pong"), "{text}");
}

/// An NDJSON push connection under `limits`.
fn ndjson_with(limits: PushLimits, now: Instant) -> PushConnection {
    let config = PushConfig::new(limits, OutboxConfig::default(), Arc::new(PayloadFactory))
        .expect("a valid config");
    let proto = powerhub_ndjson::NdjsonFactory.new_connection(&ProtocolLimits::default());
    PushConnection::new(
        proto,
        Session::new(1, SessionConfig::default()),
        &Arc::new(config),
        now,
    )
    .expect("a valid config")
}

/// An NDJSON push connection under `limits`, subscribed to stream `s` (every subscribe
/// succeeds), its `subscribed` reply written: the subscription's id, and the wire.
fn ndjson_subscribed_with(limits: PushLimits, now: Instant) -> (PushConnection, Arc<str>, Vec<u8>) {
    let mut conn = ndjson_with(limits, now);
    let sub = feed(
        &mut conn,
        b"{\"type\":\"subscribe\",\"id\":1,\"stream\":\"s\"}\n",
        now,
    )
    .expect("a subscribe request");
    let mut wire = Vec::new();
    drain(&mut conn, &mut wire, now);
    (conn, sub, wire)
}

/// Under `disconnect`, a reader already behind (its socket refused part of a write) that one
/// burst takes past both `backpressure_bytes` and `max_outbox_bytes` at once is closed as a slow
/// consumer, the bound the policy names, not by the outbox's limit; a reader whose socket took
/// everything so far is written to first, and closed as a slow consumer once its socket refuses
/// part of the burst.
#[test]
fn a_burst_past_both_bounds_closes_a_subscriber_as_a_slow_consumer() {
    let now = Instant::now();
    for behind in [true, false] {
        let limits = PushLimits::default()
            .with_max_outbox_bytes(65536)
            .with_disconnect_backlog_bytes(Some(1024));
        let (mut conn, sub, mut wire) = ndjson_subscribed_with(limits, now);
        conn.deliver_lines(&sub, line(0), now);
        write(
            &mut conn,
            &mut wire,
            if behind { 3 } else { usize::MAX },
            now,
        );
        let burst: String = (1..4000)
            .map(|n| format!("{{\"type\":\"tick\",\"stream\":\"s\",\"n\":{n}}}\n"))
            .collect();
        assert!(burst.len() > 65536);
        conn.deliver_lines(&sub, Bytes::from(burst), now);
        if !behind {
            // Its socket refused nothing yet: written to first, then judged.
            assert!(!conn.check_limits(now));
            assert_eq!(conn.close_reason(), None);
            write(&mut conn, &mut wire, 4096, now);
        }
        assert!(conn.check_limits(now), "behind: {behind}");
        assert_eq!(
            conn.close_reason(),
            Some("slow_consumer"),
            "behind: {behind}"
        );
    }
}

/// Input waits while the output is over half of `max_outbox_bytes` and the peer reads some of
/// it; a peer that reads none of it for `INPUT_WAIT` has its input handled again, and is closed
/// at the limit (virtual time: `now` is passed in).
#[test]
fn held_input_waits_for_a_reader_and_a_peer_that_reads_nothing_is_closed_at_the_limit() {
    use powerhub::push::INPUT_WAIT;
    use std::time::Duration;
    let start = Instant::now();
    let mut conn = ndjson_with(PushLimits::default().with_max_outbox_bytes(65536), start);
    // 4000 bad lines: an error reply each, far past the limit if all were answered at once.
    conn.handle_input(&b"x\n".repeat(4000), start);
    assert_eq!(conn.poll(start, SystemTime::now()), None);
    assert!(conn.input_held(start), "the output passed the mark");
    // A reader: each write taken in part keeps the input held, then handled as it drains.
    let mut wire = Vec::new();
    let mut t = start;
    while conn.input_waiting() {
        t += Duration::from_millis(10);
        write(&mut conn, &mut wire, 8192, t);
        if !conn.input_held(t) {
            assert_eq!(conn.poll(t, SystemTime::now()), None);
        }
    }
    assert_eq!(
        conn.state(),
        PushState::Open,
        "a reader is not closed: {:?}",
        conn.close_reason()
    );
    drain(&mut conn, &mut wire, t);
    let replies = wire
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .count();
    assert_eq!(replies, 4000, "every line answered");
    // A peer that reads nothing: held until INPUT_WAIT has passed without progress.
    conn.handle_input(&b"x\n".repeat(4000), t);
    assert_eq!(conn.poll(t, SystemTime::now()), None);
    assert!(conn.input_held(t));
    let later = t + INPUT_WAIT - Duration::from_millis(1);
    assert!(conn.input_held(later));
    assert!(conn.poll_timeout().is_some_and(|at| at <= t + INPUT_WAIT));
    let after = t + INPUT_WAIT;
    assert!(!conn.input_held(after));
    assert_eq!(conn.poll(after, SystemTime::now()), None);
    assert_eq!(conn.close_reason(), Some("max_outbox_bytes"));
}

/// A peer that reads nothing waits `INPUT_WAIT` once, not once per receive: the hold starts when
/// the output first passes the mark and lasts until it is found under it again, so input that
/// arrives after the wait is handled at once and the limit is reached.
#[test]
fn a_peer_that_reads_nothing_waits_once_not_once_per_receive() {
    use powerhub::push::INPUT_WAIT;
    let start = Instant::now();
    let mut conn = ndjson_with(PushLimits::default().with_max_outbox_bytes(1 << 20), start);
    // Enough to pass the mark (a quarter of the limit), not the limit.
    conn.handle_input(&b"x\n".repeat(2500), start);
    assert_eq!(conn.poll(start, SystemTime::now()), None);
    assert!(conn.input_held(start));
    let t = start + INPUT_WAIT;
    assert_eq!(conn.poll(t, SystemTime::now()), None);
    assert!(!conn.input_waiting(), "handled after the wait");
    assert_eq!(conn.state(), PushState::Open, "{:?}", conn.close_reason());
    // The next receive, still unread output over the mark: handled at once, to the limit.
    conn.handle_input(&b"x\n".repeat(20000), t);
    assert_eq!(conn.poll(t, SystemTime::now()), None);
    assert_eq!(conn.close_reason(), Some("max_outbox_bytes"));
}

/// `idle_timeout_ms` closes a connection that sends nothing, not one whose input the server
/// holds back (see `input_waiting`): a peer that keeps sending while it reads slowly is not
/// closed as idle when its input has been held longer than the idle timeout, and one that reads
/// nothing is closed at `max_outbox_bytes`, the limit it broke, even where the idle deadline
/// falls at the same instant as the end of the hold (virtual time).
#[test]
fn a_peer_whose_input_the_server_holds_is_not_closed_as_idle() {
    use powerhub::push::INPUT_WAIT;
    use std::time::Duration;
    let limits = PushLimits::default()
        .with_max_outbox_bytes(65536)
        .with_idle_timeout_ms(1000);
    // A slow reader: 1 KiB taken every 400 ms keeps the input held past the idle timeout.
    let start = Instant::now();
    let mut conn = ndjson_with(limits.clone(), start);
    conn.handle_input(&b"x\n".repeat(4000), start);
    assert_eq!(conn.poll(start, SystemTime::now()), None);
    let mut wire = Vec::new();
    let mut t = start;
    while t < start + Duration::from_secs(3) {
        t += Duration::from_millis(400);
        conn.on_writable(t);
        write(&mut conn, &mut wire, 1024, t);
        if conn.poll_timeout().is_some_and(|at| at <= t) {
            conn.handle_timeout(t, SystemTime::now());
        }
        assert_ne!(
            conn.close_reason(),
            Some("idle_timeout_ms"),
            "at {:?}",
            t - start
        );
        if !conn.input_held(t) {
            let _ = conn.poll(t, SystemTime::now());
        }
    }
    assert!(conn.input_waiting(), "the input was held throughout");
    assert_eq!(conn.close_reason(), None, "{:?}", conn.state());
    // A peer that reads nothing: the hold ends with the idle deadline; the limit closes it.
    let mut conn = ndjson_with(limits, start);
    conn.handle_input(&b"x\n".repeat(4000), start);
    assert_eq!(conn.poll(start, SystemTime::now()), None);
    let at = start + INPUT_WAIT;
    assert!(conn.poll_timeout().is_some_and(|d| d <= at));
    conn.handle_timeout(at, SystemTime::now());
    let _ = conn.poll(at, SystemTime::now());
    assert_eq!(conn.close_reason(), Some("max_outbox_bytes"));
}

/// `max_outbox_bytes` judges a reader that falls behind: one message (or one fan-out's batch)
/// larger than the limit, queued for a subscriber whose socket refused nothing, is written to it
/// first; once its socket refuses part of a write, the next delivery past the limit closes it,
/// naming the limit.
#[test]
fn a_subscriber_that_keeps_up_is_written_to_before_max_outbox_bytes_is_judged() {
    let now = Instant::now();
    let limits = PushLimits::default().with_max_outbox_bytes(65536);
    let (mut conn, sub, mut wire) = ndjson_subscribed_with(limits, now);
    let big = log_line(70_000);
    for _ in 0..3 {
        wire.clear();
        conn.deliver_lines(&sub, big.clone(), now);
        assert!(!conn.check_limits(now));
        assert_eq!(conn.poll(now, SystemTime::now()), None);
        assert_eq!(conn.close_reason(), None);
        drain(&mut conn, &mut wire, now);
        assert_eq!(wire, big, "delivered whole");
    }
    // Behind: the socket took part of the last write.
    conn.deliver_lines(&sub, big.clone(), now);
    assert!(write(&mut conn, &mut wire, 1000, now) == 1000);
    conn.deliver_lines(&sub, big, now);
    assert!(!conn.check_limits(now));
    assert_eq!(conn.close_reason(), Some("max_outbox_bytes"));
}

/// `SessionConfig::max_line_bytes` under the framing's limit: a longer line (a publish read on
/// the fast path, any other command, on NDJSON and in a WebSocket message) gets a
/// `limit_exceeded` error naming `max_message_bytes` with its id, is not carried out, and the
/// connection stays; only a line over the framing's limit closes it.
#[test]
fn a_line_over_the_sessions_max_line_bytes_is_refused_and_the_connection_stays() {
    let now = Instant::now();
    let pad = "x".repeat(200);
    let lines = [
        format!(r#"{{"type":"ping","id":1,"pad":"{pad}"}}"#),
        format!(
            r#"{{"type":"publish","id":2,"message":{{"type":"t","stream":"s","pad":"{pad}"}}}}"#
        ),
        format!(r#"{{"type":"subscribe","id":3,"stream":"s","pad":"{pad}"}}"#),
    ];
    for websocket in [false, true] {
        let session = SessionConfig {
            max_line_bytes: 100,
            ..SessionConfig::default()
        };
        let mut conn = connection(websocket, 1 << 20, session, now);
        let mut input = if websocket {
            HANDSHAKE.to_vec()
        } else {
            Vec::new()
        };
        for line in &lines {
            if websocket {
                input.extend(client_frame(1, line.as_bytes()));
            } else {
                input.extend_from_slice(line.as_bytes());
                input.push(b'\n');
            }
        }
        // Nothing is asked of the driver: no publish, no subscribe.
        assert_eq!(feed(&mut conn, &input, now), None, "websocket: {websocket}");
        let ping = br#"{"type":"ping","id":4}"#;
        assert_eq!(
            feed(
                &mut conn,
                &if websocket {
                    client_frame(1, ping)
                } else {
                    [&ping[..], b"\n"].concat()
                },
                now
            ),
            None
        );
        let mut wire = Vec::new();
        drain(&mut conn, &mut wire, now);
        let texts: Vec<String> = if websocket {
            server_frames(&wire)
                .into_iter()
                .filter(|(op, _)| *op == 1)
                .map(|(_, p)| String::from_utf8(p).unwrap())
                .collect()
        } else {
            String::from_utf8(wire)
                .unwrap()
                .lines()
                .map(str::to_owned)
                .collect()
        };
        let replies: Vec<serde_json::Value> = texts
            .iter()
            .map(|t| serde_json::from_str(t).unwrap())
            .collect();
        assert_eq!(replies.len(), 4, "websocket {websocket}: {texts:?}");
        for (i, r) in replies[..3].iter().enumerate() {
            assert_eq!(r["code"], "limit_exceeded", "{r}");
            assert_eq!(r["limit"], "max_message_bytes", "{r}");
            assert_eq!(r["requestId"], i + 1, "{r}");
        }
        assert_eq!(replies[3]["type"], "pong");
        assert_eq!(conn.state(), PushState::Open);
    }
}

/// A client that pipelines commands without end while it reads the replies slowly (but never
/// stops reading) is held back by its input, not closed at `max_outbox_bytes`, though the
/// socket's readiness comes seconds apart (a readiness event waits until much of a large send
/// buffer is free): at the hold's deadline the driver is asked to try a write
/// (`probe_writable`), whose progress extends the hold. One that reads nothing is closed at the
/// limit (virtual time: 60 KB/s read, readiness `INPUT_WAIT` + 2 s apart, for three times
/// `INPUT_WAIT`).
#[test]
fn a_pipelining_client_that_keeps_reading_slowly_is_never_closed_at_the_limit() {
    use powerhub::push::INPUT_WAIT;
    use std::time::Duration;
    for reads in [true, false] {
        let start = Instant::now();
        let limits = PushLimits::default().with_max_outbox_bytes(1_000_000);
        let mut conn = ndjson_with(limits, start);
        let mut next_id = 0u64;
        let mut wire = Vec::new();
        let mut t = start;
        // What the peer's reading has freed in the socket since the last write.
        let mut room = 0usize;
        let mut ready_at = start;
        // Long enough for a peer that reads nothing to be judged.
        let end = start + INPUT_WAIT * 3;
        while t < end && conn.state() == PushState::Open {
            t += Duration::from_millis(10);
            if reads {
                room += 600;
            }
            if !conn.input_waiting() {
                // The driver reads more: a receive of 100 pings.
                let input: String = (0..100)
                    .map(|i| format!("{{\"type\":\"ping\",\"id\":{}}}\n", next_id + i))
                    .collect();
                next_id += 100;
                conn.handle_input(input.as_bytes(), t);
            }
            if conn.poll_timeout().is_some_and(|at| at <= t) {
                conn.handle_timeout(t, SystemTime::now());
                if conn.probe_writable(t) {
                    conn.on_writable(t);
                }
            }
            // Readiness further apart than the hold's wait: only the tried write shows the
            // reading in time.
            if conn.outbox().wants_writable() && t >= ready_at + INPUT_WAIT + Duration::from_secs(2)
            {
                ready_at = t;
                conn.on_writable(t);
            }
            if !conn.input_held(t) {
                while conn.poll(t, SystemTime::now()).is_some() {}
            }
            if !conn.outbox().wants_writable() {
                let taken = write(&mut conn, &mut wire, room, t);
                room -= taken.min(room);
            }
        }
        if !reads {
            assert_eq!(conn.close_reason(), Some("max_outbox_bytes"));
            continue;
        }
        let read = wire.len();
        assert_eq!(
            conn.state(),
            PushState::Open,
            "closed at {:?} after {read} bytes read: {:?}",
            t - start,
            conn.close_reason()
        );
        assert!(read > 500_000, "{read} bytes read");
    }
}

/// A line's `\r` before its newline is not part of it for `max_line_bytes`, on the fast publish
/// path as on the others: a CRLF publish exactly at the limit is published.
#[test]
fn a_crlf_line_at_the_sessions_max_line_bytes_is_accepted() {
    let now = Instant::now();
    let prefix = r#"{"type":"publish","message":{"type":"t","stream":"s","pad":""#;
    let pad = "x".repeat(100 - prefix.len() - 3);
    let line = format!("{prefix}{pad}\"}}}}");
    assert_eq!(line.len(), 100);
    let session = SessionConfig {
        max_line_bytes: 100,
        ..SessionConfig::default()
    };
    let mut conn = connection(false, 1 << 20, session, now);
    conn.handle_input(format!("{line}\r\n").as_bytes(), now);
    assert!(
        matches!(
            conn.poll(now, SystemTime::now()),
            Some(Request::Publish { .. })
        ),
        "published"
    );
}

/// The grace a subscriber not behind gets past `max_outbox_bytes` lasts while its socket takes
/// bytes: judged again with nothing taken since (a send refused whole, or still waiting for room
/// in the socket), it is closed at the limit.
#[test]
fn a_subscriber_past_max_outbox_bytes_whose_socket_takes_nothing_is_closed() {
    let now = Instant::now();
    let limits = PushLimits::default().with_max_outbox_bytes(65536);
    let (mut conn, sub, mut wire) = ndjson_subscribed_with(limits, now);
    let big = log_line(70_000);
    conn.deliver_lines(&sub, big.clone(), now);
    assert!(!conn.check_limits(now));
    assert_eq!(conn.close_reason(), None, "written to first");
    // Its write is in flight (taken nothing yet) when the next delivery is judged.
    let mut chunks = Vec::new();
    let transmit = conn.poll_transmit(&mut chunks, 64, now).expect("a write");
    conn.deliver_lines(&sub, big.clone(), now);
    assert!(!conn.check_limits(now));
    assert_eq!(conn.close_reason(), Some("max_outbox_bytes"));
    conn.on_written(transmit, 0, now);
    // Another, whose socket takes part of each write between deliveries, is let through.
    let (mut conn, sub, _) = ndjson_subscribed_with(limits_of(65536), now);
    for _ in 0..3 {
        conn.deliver_lines(&sub, big.clone(), now);
        assert!(!conn.check_limits(now));
        assert_eq!(conn.close_reason(), None);
        assert!(write(&mut conn, &mut wire, usize::MAX, now) > 0);
    }
}

/// How a virtual reader takes a backlog in `a_subscriber_past_max_outbox_bytes_sent_nothing_more_*`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Reader {
    /// Reads nothing; the driver tries a write at the stall's deadline.
    Never,
    /// Reads nothing; the driver never tries a write (a write in flight all along).
    NeverUntried,
    /// Takes 40 KB at each write the driver tries at a deadline, nothing otherwise.
    AtEachTry,
    /// Takes 8 KB every 50 ms (160 KB/s), each write reported as it happens.
    AllAlong,
    /// Takes 64 KB every 3 s, as a loopback socket's buffer frees for a reader of about
    /// 20 KB/s with a large receive buffer (acknowledged a 64 KiB segment at a time), and
    /// nothing at the tries between.
    InSteps,
}

/// A subscriber past `max_outbox_bytes` whose socket refused part of its last write, and that
/// is sent nothing more, is closed at the limit once it has taken nothing for `STALL_WAIT` and
/// a write tried then took nothing either (`probe_writable`, or the write in flight where none
/// can be tried), not at the liveness timeout 45 s on. The second is timed from the write
/// its socket began refusing at, not from an earlier sign of life: a subscriber idle for
/// seconds before the message is not judged at once. One whose socket takes some at each try,
/// or all along, is written to until it has it all (virtual time).
#[test]
fn a_subscriber_past_max_outbox_bytes_sent_nothing_more_is_closed_once_it_takes_nothing() {
    use powerhub::push::{PROBE_WAIT, STALL_WAIT};
    use std::time::Duration;
    for reader in [
        Reader::Never,
        Reader::NeverUntried,
        Reader::AtEachTry,
        Reader::AllAlong,
        Reader::InSteps,
    ] {
        let start = Instant::now();
        let (mut conn, sub, mut wire) = ndjson_subscribed_with(limits_of(65536), start);
        let before = wire.len();
        // Idle for 3 s first: no pong, no output.
        let sent = start + Duration::from_secs(3);
        let big = log_line(300_000);
        conn.deliver_lines(&sub, big.clone(), sent);
        assert!(!conn.check_limits(sent));
        // The socket takes part of the first write: behind and past the limit, and nothing
        // more is delivered.
        assert!(write(&mut conn, &mut wire, 50_000, sent) > 0);
        assert!(!conn.check_limits(sent));
        assert_eq!(
            conn.close_reason(),
            None,
            "{reader:?}: not judged at a write"
        );
        let mut t = sent;
        while t < sent + Duration::from_secs(30)
            && conn.state() == PushState::Open
            && wire.len() - before < big.len()
        {
            t += Duration::from_millis(50);
            if reader == Reader::AllAlong {
                conn.on_writable(t);
                write(&mut conn, &mut wire, 8_000, t);
            }
            if reader == Reader::InSteps && (t - sent).as_millis() % 3000 == 0 {
                conn.on_writable(t);
                write(&mut conn, &mut wire, 64_000, t);
            }
            if conn.poll_timeout().is_some_and(|at| at <= t) {
                // The driver's order: the try first, then the deadlines.
                if reader != Reader::NeverUntried && conn.probe_writable(t) {
                    conn.on_writable(t);
                    let room = match reader {
                        Reader::AtEachTry => 40_000,
                        _ => 0,
                    };
                    write(&mut conn, &mut wire, room, t);
                }
                conn.handle_timeout(t, SystemTime::now());
            }
        }
        match reader {
            Reader::Never | Reader::NeverUntried => {
                assert_eq!(conn.close_reason(), Some("max_outbox_bytes"), "{reader:?}");
                let after = t - sent;
                assert!(
                    after >= STALL_WAIT + PROBE_WAIT && after < STALL_WAIT + 4 * PROBE_WAIT,
                    "{reader:?}: closed {after:?} after the message"
                );
            }
            Reader::AtEachTry | Reader::AllAlong | Reader::InSteps => {
                assert_eq!(
                    conn.state(),
                    PushState::Open,
                    "{reader:?}: {:?} {:?} after the message, {} bytes read",
                    conn.close_reason(),
                    t - sent,
                    wire.len() - before
                );
                drain(&mut conn, &mut wire, t);
                assert!(
                    wire[before..].starts_with(&big),
                    "{reader:?}: the message whole"
                );
            }
        }
    }
}

fn limits_of(max_outbox: usize) -> PushLimits {
    PushLimits::default().with_max_outbox_bytes(max_outbox)
}

/// A message several times `max_outbox_bytes` to a subscriber that reads it: its socket
/// refuses part of each write, yet it is judged only when more output comes while it is behind,
/// not at each write of that one message.
#[test]
fn a_message_far_larger_than_max_outbox_bytes_reaches_a_reader_that_takes_it() {
    let now = Instant::now();
    let (mut conn, sub, _) = ndjson_subscribed_with(limits_of(65536), now);
    let huge = log_line(800_000);
    conn.deliver_lines(&sub, huge.clone(), now);
    let mut wire = Vec::new();
    assert!(!conn.check_limits(now));
    while wire.len() < huge.len() {
        // Each write taken in part, a check after each (the shard's, on writability).
        conn.on_writable(now);
        write(&mut conn, &mut wire, 300_000, now);
        assert!(!conn.check_limits(now));
        assert_eq!(conn.close_reason(), None, "after {} bytes", wire.len());
    }
    assert_eq!(wire, huge);
    // Behind again (part of a write refused) with more than the limit, when more comes: closed.
    conn.deliver_lines(&sub, huge.clone(), now);
    assert!(!conn.check_limits(now));
    write(&mut conn, &mut wire, 1000, now);
    conn.deliver_lines(&sub, line(1), now);
    assert!(!conn.check_limits(now));
    assert_eq!(conn.close_reason(), Some("max_outbox_bytes"));
}

/// `limits.input_hold_timeout_ms` is how long held input waits for a peer that reads none of
/// its output, shorter and longer than the default (virtual time).
#[test]
fn a_configured_input_hold_timeout_is_the_wait_before_held_input_is_handled_again() {
    use std::time::Duration;
    for wait_ms in [3_000u64, 20_000] {
        let wait = Duration::from_millis(wait_ms);
        let t = Instant::now();
        let limits = PushLimits::default()
            .with_max_outbox_bytes(65536)
            .with_input_hold_timeout_ms(wait_ms);
        let mut conn = ndjson_with(limits, t);
        // 4000 bad lines: an error reply each, far past the limit if all were answered at once.
        conn.handle_input(&b"x\n".repeat(4000), t);
        assert_eq!(conn.poll(t, SystemTime::now()), None);
        assert!(conn.input_held(t), "{wait_ms}: the output passed the mark");
        assert!(
            conn.input_held(t + wait - Duration::from_millis(1)),
            "{wait_ms}"
        );
        if wait < Duration::from_secs(5) {
            // Sooner than every other deadline (first message 5 s, keepalive 15 s): the hold's.
            assert_eq!(conn.poll_timeout(), Some(t + wait));
        }
        assert!(!conn.input_held(t + wait), "{wait_ms}");
        assert_eq!(conn.poll(t + wait, SystemTime::now()), None);
        assert_eq!(conn.close_reason(), Some("max_outbox_bytes"), "{wait_ms}");
    }
}

/// `limits.stall_timeout_ms` is how long a subscriber past `max_outbox_bytes`, behind its socket
/// and sent nothing more, may take nothing before it is closed, shorter and longer than the
/// default (virtual time).
#[test]
fn a_configured_stall_timeout_is_the_wait_before_a_stalled_subscriber_is_closed() {
    use powerhub::push::PROBE_WAIT;
    use std::time::Duration;
    for wait_ms in [2_000u64, 8_000] {
        let wait = Duration::from_millis(wait_ms);
        let start = Instant::now();
        let limits = limits_of(65536).with_stall_timeout_ms(wait_ms);
        let (mut conn, sub, mut wire) = ndjson_subscribed_with(limits, start);
        let sent = start + Duration::from_secs(3);
        conn.deliver_lines(&sub, log_line(300_000), sent);
        assert!(!conn.check_limits(sent));
        assert!(write(&mut conn, &mut wire, 50_000, sent) > 0);
        let mut t = sent;
        while t < sent + Duration::from_secs(30) && conn.state() == PushState::Open {
            t += Duration::from_millis(50);
            if conn.poll_timeout().is_some_and(|at| at <= t) {
                // The driver's order: the try first (the peer takes nothing), then the deadlines.
                if conn.probe_writable(t) {
                    conn.on_writable(t);
                    write(&mut conn, &mut wire, 0, t);
                }
                conn.handle_timeout(t, SystemTime::now());
            }
        }
        assert_eq!(conn.close_reason(), Some("max_outbox_bytes"), "{wait_ms}");
        let after = t - sent;
        assert!(
            after >= wait + PROBE_WAIT && after < wait + 4 * PROBE_WAIT,
            "{wait_ms}: closed {after:?} after the message"
        );
    }
}
