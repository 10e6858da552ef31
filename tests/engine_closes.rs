//! Every close the server decides is said in the connection's protocol, on real loopback sockets
//! and both backends: NDJSON and the frame protocol get a final `error` naming the reason,
//! WebSocket gets that error and then a close frame with its code (1001 going away, 1008 policy
//! and limits), and a WebSocket connection whose upgrade has not completed gets an HTTP status
//! (503 over `max_connections` or at shutdown, 408 past the first-message deadline). Every
//! connection must complete its handshake and send a complete message within
//! `limits.first_message_timeout_ms`. Errors have one shape on every protocol:
//! `{"type":"error","requestId":..,"code":..,"message":..}` plus `limit` for a limit.

mod engine_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use engine_support::*;
use powerhub::plugin::frame;
use serde_json::Value;

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s
}

/// The next frame-protocol frame's JSON messages; `None` at end of stream.
fn read_frame(s: &mut TcpStream) -> Option<Vec<Value>> {
    let mut head = [0u8; frame::HEADER_LEN];
    match s.read_exact(&mut head) {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            return None
        }
        Err(e) => panic!("read failed: {e}"),
    }
    let header = frame::Header::parse(&head).unwrap();
    let mut whole = head.to_vec();
    whole.resize(frame::HEADER_LEN + header.length as usize, 0);
    s.read_exact(&mut whole[frame::HEADER_LEN..]).unwrap();
    let decoded = frame::decode(&whole).unwrap();
    Some(
        decoded
            .json_messages()
            .unwrap()
            .into_iter()
            .map(|m| serde_json::from_slice(m).unwrap())
            .collect(),
    )
}

fn send_frame(s: &mut TcpStream, json: &str) {
    s.write_all(&frame::encode_json_batch([json.as_bytes()]).unwrap())
        .unwrap();
}

/// The next frame-protocol message that is not a keepalive ping.
fn frame_msg(s: &mut TcpStream) -> Option<Value> {
    loop {
        for m in read_frame(s)? {
            if m["type"] != "ping" {
                return Some(m);
            }
        }
    }
}

/// Whether the server closed `s` (end of stream or reset) with nothing more to read.
fn closed(s: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => rest.is_empty(),
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

/// A minimal WebSocket client: masked frames out, the server's frames in.
struct Ws {
    s: TcpStream,
}

const OP_TEXT: u8 = 0x1;
const OP_CLOSE: u8 = 0x8;
const OP_PING: u8 = 0x9;

const UPGRADE: &str = "GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n\
     Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
     Sec-WebSocket-Version: 13\r\n\r\n";

/// Reads an HTTP response head (up to the empty line).
fn http_head(s: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut b) {
            Ok(1) => head.push(b[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

impl Ws {
    fn upgrade(addr: SocketAddr) -> Ws {
        let mut s = connect(addr);
        s.write_all(UPGRADE.as_bytes()).unwrap();
        let head = http_head(&mut s);
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        Ws { s }
    }

    fn send_text(&mut self, text: &str) {
        let key = [1u8, 2, 3, 4];
        let mut f = vec![0x80 | OP_TEXT];
        let n = text.len();
        if n < 126 {
            f.push(0x80 | n as u8);
        } else {
            f.push(0x80 | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        f.extend_from_slice(&key);
        f.extend(text.bytes().enumerate().map(|(i, b)| b ^ key[i % 4]));
        self.s.write_all(&f).unwrap();
    }

    /// The next frame: opcode and payload; `None` at end of stream.
    fn frame(&mut self) -> Option<(u8, Vec<u8>)> {
        let mut h = [0u8; 2];
        if self.s.read_exact(&mut h).is_err() {
            return None;
        }
        let len = match h[1] & 0x7f {
            126 => {
                let mut l = [0u8; 2];
                self.s.read_exact(&mut l).unwrap();
                u16::from_be_bytes(l) as usize
            }
            127 => {
                let mut l = [0u8; 8];
                self.s.read_exact(&mut l).unwrap();
                u64::from_be_bytes(l) as usize
            }
            n => n as usize,
        };
        let mut payload = vec![0u8; len];
        self.s.read_exact(&mut payload).unwrap();
        Some((h[0] & 0x0f, payload))
    }

    /// The text messages up to the server's close frame (pings skipped, not answered), and the
    /// close frame's code and reason.
    fn until_close(&mut self) -> (Vec<Value>, u16, String) {
        let mut texts = Vec::new();
        loop {
            let (op, payload) = self
                .frame()
                .unwrap_or_else(|| panic!("end of stream without a close frame after {texts:?}"));
            match op {
                OP_TEXT => texts.push(serde_json::from_slice(&payload).unwrap()),
                OP_PING => {}
                OP_CLOSE => {
                    assert!(payload.len() >= 2, "a close frame with a code");
                    let code = u16::from_be_bytes([payload[0], payload[1]]);
                    let reason = String::from_utf8(payload[2..].to_vec()).unwrap();
                    return (texts, code, reason);
                }
                other => panic!("unexpected opcode {other:#x}"),
            }
        }
    }

    /// Sends `command` and returns the next text message that is not a ping.
    fn request(&mut self, command: &str) -> Value {
        self.send_text(command);
        loop {
            let (op, payload) = self.frame().expect("a reply");
            if op == OP_TEXT {
                let v: Value = serde_json::from_slice(&payload).unwrap();
                if v["type"] != "ping" {
                    return v;
                }
            }
        }
    }
}

/// `error` is the one error shape: type, code, message and requestId, plus `limit` = `limit`.
fn assert_limit_error(error: &Value, limit: &str) {
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(error["code"], "limit_exceeded", "{error}");
    assert_eq!(error["limit"], limit, "{error}");
    assert!(
        error["message"].as_str().is_some_and(|m| m.contains(limit)),
        "{error}"
    );
    assert!(error.get("requestId").is_some(), "{error}");
}

#[test]
fn an_idle_timeout_close_is_said_with_an_error_naming_idle_timeout_ms() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.limits.idle_timeout_ms = 200;
        let server = serve(c);
        let mut ndjson = Client::connect(server.ndjson);
        let mut fr = connect(server.frame);
        let mut ws = Ws::upgrade(server.websocket);

        assert_limit_error(&ndjson.msg(), "idle_timeout_ms");
        assert!(ndjson.line().is_none(), "closed after the error");

        assert_limit_error(&frame_msg(&mut fr).unwrap(), "idle_timeout_ms");
        assert!(closed(&mut fr));

        let (texts, code, reason) = ws.until_close();
        assert_limit_error(&texts[0], "idle_timeout_ms");
        assert_eq!(code, 1008, "policy: {reason}");
        assert!(reason.contains("idle_timeout_ms"), "{reason}");
    });
}

#[test]
fn a_liveness_close_is_said_with_an_error_naming_liveness_timeout_ms() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.outbox.keepalive_interval_ms = 50;
        c.outbox.liveness_timeout_ms = 300;
        let server = serve(c);
        // Each reads everything but never answers a ping.
        let mut ndjson = Client::connect(server.ndjson);
        let mut fr = connect(server.frame);
        let mut ws = Ws::upgrade(server.websocket);

        assert_limit_error(&ndjson.msg(), "liveness_timeout_ms");
        assert!(ndjson.line().is_none(), "closed after the error");

        assert_limit_error(&frame_msg(&mut fr).unwrap(), "liveness_timeout_ms");
        assert!(closed(&mut fr));

        let (texts, code, reason) = ws.until_close();
        assert_limit_error(&texts[0], "liveness_timeout_ms");
        assert_eq!(code, 1008, "{reason}");
        assert!(reason.contains("liveness_timeout_ms"), "{reason}");
    });
}

#[test]
fn a_subscription_limit_close_on_websocket_is_the_error_then_close_1008() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.limits.max_subscriptions_per_connection = 1;
        let server = serve(c);
        let mut ws = Ws::upgrade(server.websocket);
        let ok = ws.request(r#"{"type":"subscribe","id":"a","stream":"s1"}"#);
        assert_eq!(ok["type"], "subscribed", "{ok}");
        ws.send_text(r#"{"type":"subscribe","id":"b","stream":"s2"}"#);
        let (texts, code, reason) = ws.until_close();
        assert_limit_error(&texts[0], "max_subscriptions_per_connection");
        assert_eq!(texts[0]["requestId"], "b", "{}", texts[0]);
        assert_eq!(code, 1008, "{reason}");
        assert!(
            reason.contains("max_subscriptions_per_connection"),
            "{reason}"
        );
    });
}

#[test]
fn a_shutdown_close_is_said_with_an_error_naming_shutdown_and_websocket_1001() {
    on_both_backends(|backend| {
        let server = serve(config(backend));
        let mut ndjson = Client::connect(server.ndjson);
        ndjson.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(ndjson.msg()["type"], "pong");
        let mut fr = connect(server.frame);
        send_frame(&mut fr, r#"{"type":"ping","id":1}"#);
        assert_eq!(frame_msg(&mut fr).unwrap()["type"], "pong");
        let mut ws = Ws::upgrade(server.websocket);
        assert_eq!(ws.request(r#"{"type":"ping","id":1}"#)["type"], "pong");
        // An upgrade under way when the server stops.
        let mut upgrading = connect(server.websocket);
        upgrading
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .unwrap();

        let engine = server.engine;
        let stopper = std::thread::spawn(move || engine.shutdown().unwrap());

        let e = ndjson.msg();
        assert_eq!(
            (&e["type"], &e["code"]),
            (&"error".into(), &"shutdown".into()),
            "{e}"
        );
        assert!(e["requestId"].is_null(), "{e}");
        assert!(ndjson.line().is_none(), "closed after the error");

        let e = frame_msg(&mut fr).unwrap();
        assert_eq!(e["code"], "shutdown", "{e}");
        assert!(closed(&mut fr));

        let (texts, code, reason) = ws.until_close();
        assert_eq!(texts[0]["code"], "shutdown", "{texts:?}");
        assert_eq!(code, 1001, "going away: {reason}");

        let head = http_head(&mut upgrading);
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
        stopper.join().unwrap();
    });
}

#[test]
fn a_websocket_upgrade_over_max_connections_gets_http_503() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.limits.max_connections = 1;
        let server = serve(c);
        let mut holder = Client::connect(server.ndjson);
        holder.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(holder.msg()["type"], "pong");
        let mut s = connect(server.websocket);
        s.write_all(UPGRADE.as_bytes()).unwrap();
        let mut response = Vec::new();
        let _ = s.read_to_end(&mut response);
        let response = String::from_utf8_lossy(&response);
        assert!(response.starts_with("HTTP/1.1 503 "), "{response}");
        assert!(response.contains("max_connections"), "{response}");
        // The frame listener says it with an error frame.
        let mut fr = connect(server.frame);
        assert_limit_error(&frame_msg(&mut fr).unwrap(), "max_connections");
        assert!(closed(&mut fr));
    });
}

#[test]
fn an_ndjson_connection_without_a_complete_message_is_closed_at_the_first_message_deadline() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.limits.first_message_timeout_ms = 200;
        let server = serve(c);
        let mut silent = Client::connect(server.ndjson);
        let mut partial = Client::connect(server.ndjson);
        partial.send_raw(br#"{"type":"pi"#);
        let mut polite = Client::connect(server.ndjson);
        polite.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(polite.msg()["type"], "pong");

        for c in [&mut silent, &mut partial] {
            assert_limit_error(&c.msg(), "first_message_timeout_ms");
            assert!(c.line().is_none(), "closed after the error");
        }
        // A connection that sent its first message is not held to the deadline.
        std::thread::sleep(Duration::from_millis(300));
        polite.send(r#"{"type":"ping","id":2}"#);
        assert_eq!(polite.msg()["requestId"], 2);
    });
}

#[test]
fn a_frame_connection_with_a_truncated_header_is_closed_at_the_first_message_deadline() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.limits.first_message_timeout_ms = 200;
        let server = serve(c);
        let mut fr = connect(server.frame);
        let whole = frame::encode_json_batch([&br#"{"type":"ping"}"#[..]]).unwrap();
        fr.write_all(&whole[..5]).unwrap();
        assert_limit_error(&frame_msg(&mut fr).unwrap(), "first_message_timeout_ms");
        assert!(closed(&mut fr));
    });
}

#[test]
fn a_websocket_upgrade_that_never_completes_gets_http_408() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.limits.first_message_timeout_ms = 200;
        let server = serve(c);
        let mut s = connect(server.websocket);
        s.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n")
            .unwrap();
        let mut response = Vec::new();
        let _ = s.read_to_end(&mut response);
        let response = String::from_utf8_lossy(&response);
        assert!(response.starts_with("HTTP/1.1 408 "), "{response}");
        assert!(response.contains("first_message_timeout_ms"), "{response}");
    });
}

#[test]
fn an_upgraded_websocket_that_sends_no_message_is_closed_with_1008_at_the_first_message_deadline() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.limits.first_message_timeout_ms = 200;
        let server = serve(c);
        let mut ws = Ws::upgrade(server.websocket);
        let (texts, code, reason) = ws.until_close();
        assert_limit_error(&texts[0], "first_message_timeout_ms");
        assert_eq!(code, 1008, "{reason}");
        assert!(reason.contains("first_message_timeout_ms"), "{reason}");
    });
}

#[test]
fn frame_protocol_errors_carry_code_and_request_id_like_ndjson() {
    on_both_backends(|backend| {
        let server = serve(config(backend));
        let mut fr = connect(server.frame);
        fr.write_all(b"XX\x01\x01\0\0\0\0\0\0\0\0").unwrap();
        let e = frame_msg(&mut fr).unwrap();
        assert_eq!(e["type"], "error", "{e}");
        assert_eq!(e["code"], "bad_frame", "{e}");
        assert!(e["requestId"].is_null(), "{e}");
        assert!(e["message"].is_string(), "{e}");
        assert!(
            e.get("error").is_none(),
            "the code is `code`, as on NDJSON: {e}"
        );
        assert!(closed(&mut fr));
    });
}

#[test]
fn the_limit_error_for_a_subscribe_over_max_subscriptions_carries_its_request_id() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.limits.max_subscriptions_per_connection = 2;
        let server = serve(c);
        let mut ndjson = Client::connect(server.ndjson);
        ndjson.subscribe("a");
        ndjson.subscribe("b");
        ndjson.send(r#"{"type":"subscribe","id":"third","stream":"c"}"#);
        let e = ndjson.msg();
        assert_limit_error(&e, "max_subscriptions_per_connection");
        assert_eq!(e["requestId"], "third", "{e}");
        assert!(ndjson.line().is_none());

        let mut fr = connect(server.frame);
        for (id, stream) in [(1, "a"), (2, "b")] {
            send_frame(
                &mut fr,
                &format!(r#"{{"type":"subscribe","id":{id},"stream":"{stream}"}}"#),
            );
            assert_eq!(frame_msg(&mut fr).unwrap()["type"], "subscribed");
        }
        send_frame(&mut fr, r#"{"type":"subscribe","id":3,"stream":"c"}"#);
        let e = frame_msg(&mut fr).unwrap();
        assert_limit_error(&e, "max_subscriptions_per_connection");
        assert_eq!(e["requestId"], 3, "{e}");
        assert!(closed(&mut fr));
    });
}

impl Ws {
    /// Sends an unsolicited pong frame (a keepalive answer, not a message).
    fn send_pong(&mut self) {
        self.s.write_all(&[0x8A, 0x80, 1, 2, 3, 4]).unwrap();
    }
}

/// A keepalive pong is not a message: a WebSocket that sends only pongs is still closed at
/// the first-message deadline.
#[test]
fn pongs_alone_do_not_meet_the_first_message_deadline() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.limits.first_message_timeout_ms = 300;
        let server = serve(c);
        let mut ws = Ws::upgrade(server.websocket);
        ws.send_pong();
        let mut sender = ws.s.try_clone().unwrap();
        let pongs = std::thread::spawn(move || {
            for _ in 0..40 {
                std::thread::sleep(Duration::from_millis(25));
                if sender.write_all(&[0x8A, 0x80, 1, 2, 3, 4]).is_err() {
                    break;
                }
            }
        });
        let (texts, code, _) = ws.until_close();
        assert_limit_error(&texts[0], "first_message_timeout_ms");
        assert_eq!(code, 1008);
        let _ = pongs.join();
    });
}

/// One frame of many commands cannot queue replies past max_outbox_bytes: once its output
/// passes half the limit the rest of the frame waits for the output to drain, so a client that
/// reads its replies gets every one of them, in order, and no limit error.
#[test]
fn one_frame_of_many_commands_is_answered_in_full_within_max_outbox_bytes() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.limits.backpressure_bytes = 256 << 10;
        c.limits.max_outbox_bytes = 1 << 20;
        c.outbox.high_water_bytes = 256 << 10;
        let server = serve(c);
        let mut fr = connect(server.frame);
        // 200 000 commands that are not JSON objects, each answered by an error: about 20 MB
        // of replies, 20 times the limit.
        let elements = vec![&b"0"[..]; 200_000];
        fr.write_all(&frame::encode_json_batch(elements).unwrap())
            .unwrap();
        for n in 0..200_000 {
            let m = frame_msg(&mut fr).expect("a reply");
            assert_eq!(m["code"], "invalid_json", "reply {n}: {m}");
        }
        assert_eq!(server.engine.stats().limit_errors, 0);
    });
}

#[test]
fn a_final_error_for_a_line_too_long_comes_after_the_backlog_and_nothing_follows_it() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.engine.shards = 1;
        config.limits.max_message_bytes = 4096;
        let server = start(config);
        let mut c = Client::connect(server.addr);
        c.subscribe("feed");
        // A backlog the socket cannot take at once: about 12 MB to a client that does not read.
        const MESSAGES: u64 = 3000;
        for seq in 0..MESSAGES {
            publish(&server.engine, "feed", seq, 4096);
        }
        eventually("the shard fanned the backlog out", || {
            server.engine.hub().stats().delivered >= MESSAGES
        });
        let mut long = br#"{"type":"ping","pad":""#.to_vec();
        long.extend(std::iter::repeat_n(b'x', 5000));
        long.extend_from_slice(b"\"}\n");
        c.send_raw(&long);
        let rest = c.rest();
        let text = String::from_utf8(rest).expect("UTF-8");
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("JSON lines"))
            .filter(|v: &Value| v["type"] != "ping")
            .collect();
        let (last, ticks) = lines.split_last().expect("the final error");
        assert_limit_error(last, "max_message_bytes");
        // Before it, a prefix of the backlog, in order, and nothing else.
        for (i, t) in ticks.iter().enumerate() {
            assert_eq!(
                t["type"], "tick",
                "only deliveries before the final error: {t}"
            );
            assert_eq!(t["seq"], i as u64, "in order, none missing");
        }
    });
}

#[test]
fn the_answer_to_a_websocket_clients_close_follows_the_backlog_and_no_data_frame_follows_it() {
    on_both_backends(|backend| {
        let mut c = config(backend);
        c.engine.shards = 1;
        let server = serve(c);
        let mut ws = Ws::upgrade(server.websocket);
        let ok = ws.request(r#"{"type":"subscribe","id":"a","stream":"feed"}"#);
        assert_eq!(ok["type"], "subscribed", "{ok}");
        // A backlog the socket cannot take at once, then the client's close frame (code 1000).
        const MESSAGES: u64 = 3000;
        for seq in 0..MESSAGES {
            publish(&server.engine, "feed", seq, 4096);
        }
        eventually("the shard fanned the backlog out", || {
            server.engine.hub().stats().delivered >= MESSAGES
        });
        let key = [9u8, 8, 7, 6];
        let mut close = vec![0x80 | OP_CLOSE, 0x82];
        close.extend_from_slice(&key);
        close.extend(1000u16.to_be_bytes().iter().zip(key).map(|(b, k)| b ^ k));
        ws.s.write_all(&close).unwrap();
        let (texts, code, _) = ws.until_close();
        assert_eq!(code, 1000, "the client's code echoed");
        // Before it, a prefix of the backlog in order; after it, the end of the stream.
        for (i, t) in texts.iter().enumerate() {
            assert_eq!(t["type"], "tick", "{t}");
            assert_eq!(t["seq"], i as u64, "in order, none missing");
        }
        assert!(ws.frame().is_none(), "no frame after the close reply");
    });
}

/// Ends `c`'s sending side and reads what the server sends until it closes: the text, and its
/// lines as JSON.
fn end_and_read(c: &mut Client) -> (String, Vec<Value>) {
    c.writer.shutdown(std::net::Shutdown::Write).unwrap();
    let text = String::from_utf8(c.rest()).unwrap();
    let lines = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (text, lines)
}

/// The peer's end of stream ends its input, not its last message: an NDJSON line without its
/// newline is read and answered (a publish reaches its subscribers), a line cut inside its JSON
/// gets the parse error, and the replies come before the close.
#[test]
fn a_last_ndjson_line_without_its_newline_is_read_at_the_end_of_stream() {
    on_both_backends(|backend| {
        let server = serve(config(backend));
        let mut sub = Client::connect(server.ndjson);
        sub.subscribe("s");
        let mut publisher = Client::connect(server.ndjson);
        publisher.send_raw(
            br#"{"type":"publish","id":"p","message":{"type":"tick","stream":"s","n":1}}"#,
        );
        let (text, replies) = end_and_read(&mut publisher);
        assert_eq!(replies.len(), 1, "{text}");
        assert_eq!(replies[0]["type"], "published", "{text}");
        assert_eq!(replies[0]["requestId"], "p", "{text}");
        let m = sub.msg();
        assert_eq!(m["n"], 1, "{m}");

        // The connection's own subscription gets its last publish before the close.
        let mut own = Client::connect(server.ndjson);
        own.subscribe("o");
        own.send_raw(br#"{"type":"publish","message":{"type":"tick","stream":"o","n":2}}"#);
        let (text, _) = end_and_read(&mut own);
        assert!(text.contains(r#""n":2"#), "{text}");

        let mut cut = Client::connect(server.ndjson);
        cut.send_raw(br#"{"type":"ping","id":1}"#);
        cut.send_raw(b"\n");
        cut.send_raw(br#"{"type":"ping","id":2"#);
        let (text, replies) = end_and_read(&mut cut);
        assert_eq!(replies.len(), 2, "{text}");
        assert_eq!(replies[0]["type"], "pong", "{text}");
        assert_eq!(replies[1]["type"], "error", "{text}");
        assert_eq!(replies[1]["code"], "invalid_json", "{text}");
        assert_eq!(replies[1]["requestId"], 2, "the id was read whole: {text}");
        eventually("the three connections released", || {
            server.engine.stats().open_connections == 1
        });
    });
}

/// A frame the peer's end of stream cuts short is refused in the frame protocol (`bad_frame`,
/// saying how much of it arrived), after the replies to the frames before it.
#[test]
fn a_frame_cut_short_by_the_end_of_stream_gets_a_bad_frame_error() {
    on_both_backends(|backend| {
        let server = serve(config(backend));
        let whole = frame::encode_json_batch([&br#"{"type":"ping","id":1}"#[..]]).unwrap();
        for (cut, what) in [
            (whole.len() - 3, "a frame ("),
            (5, "a frame header (5 of its 12"),
        ] {
            let mut fr = connect(server.frame);
            fr.write_all(&whole).unwrap();
            fr.write_all(&whole[..cut]).unwrap();
            fr.shutdown(std::net::Shutdown::Write).unwrap();
            assert_eq!(frame_msg(&mut fr).unwrap()["type"], "pong");
            let e = frame_msg(&mut fr).expect("an error about the cut frame");
            assert_eq!(e["code"], "bad_frame", "{e}");
            let message = e["message"].as_str().unwrap();
            assert!(message.contains("the stream ended inside"), "{e}");
            assert!(message.contains(what), "{e}");
            assert!(closed(&mut fr));
        }
    });
}

/// On WebSocket, a frame the end of stream cuts short gets a close frame (1002) that says so,
/// and a handshake cut short gets HTTP 400.
#[test]
fn a_websocket_frame_or_handshake_cut_short_by_the_end_of_stream_is_said() {
    on_both_backends(|backend| {
        let server = serve(config(backend));
        let mut ws = Ws::upgrade(server.websocket);
        assert_eq!(ws.request(r#"{"type":"ping","id":1}"#)["type"], "pong");
        // A masked text frame header announcing 10 bytes, then 3 of them.
        ws.s.write_all(&[0x81, 0x80 | 10, 1, 2, 3, 4, b'{', b'"', b't'])
            .unwrap();
        ws.s.shutdown(std::net::Shutdown::Write).unwrap();
        let (texts, code, reason) = ws.until_close();
        assert!(texts.is_empty(), "{texts:?}");
        assert_eq!(code, 1002, "{reason}");
        assert!(
            reason.contains("the stream ended inside a frame"),
            "{reason}"
        );

        let mut s = connect(server.websocket);
        s.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n")
            .unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut response = Vec::new();
        let _ = s.read_to_end(&mut response);
        let response = String::from_utf8_lossy(&response);
        assert!(response.starts_with("HTTP/1.1 400 "), "{response}");
        assert!(
            response.contains("the stream ended inside the opening handshake"),
            "{response}"
        );
    });
}

/// A TLS handshake on a plaintext WebSocket listener is the client's mistake: `400 Bad Request`
/// naming it (not 503, which says the server is unavailable and invites a retry).
#[test]
fn a_tls_handshake_on_a_plaintext_websocket_listener_gets_http_400() {
    on_both_backends(|backend| {
        let server = serve(config(backend));
        let mut s = connect(server.websocket);
        s.write_all(&[0x16, 0x03, 0x01, 0x00, 0x05, 1, 0, 0, 1, 0])
            .unwrap();
        let mut response = Vec::new();
        let _ = s.read_to_end(&mut response);
        let response = String::from_utf8_lossy(&response);
        assert!(
            response.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{response}"
        );
        assert!(response.contains("does not speak TLS"), "{response}");
    });
}

/// A client that pipelines commands faster than it reads their replies is held back by TCP,
/// not cut at `max_outbox_bytes`: once its output passes half the limit the server reads no
/// more of its input until the output drains. Every command is answered in order, then the
/// client's end of stream closes the connection after the last reply.
#[test]
fn a_client_pipelining_faster_than_it_reads_its_replies_is_held_back_not_closed() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.max_outbox_bytes = 65536;
        let server = start(config);
        let mut c = Client::connect(server.addr);
        // Each bad line is 2 bytes and gets an error reply of about 100: 40 000 of them are
        // about 60 times the limit.
        const LINES: usize = 40_000;
        let mut writer = c.writer.try_clone().unwrap();
        let sender = std::thread::spawn(move || {
            let mut input = b"x\n".repeat(LINES);
            input.extend_from_slice(b"{\"type\":\"ping\",\"id\":\"end\"}\n");
            writer.write_all(&input).unwrap();
            writer.shutdown(std::net::Shutdown::Write).unwrap();
        });
        for n in 0..LINES {
            let v = c.json();
            assert_eq!(v["type"], "error", "line {n}: {v}");
            assert_eq!(v["code"], "invalid_json", "line {n}: {v}");
        }
        let v = c.msg();
        assert_eq!(
            (&v["type"], &v["requestId"]),
            (&"pong".into(), &"end".into()),
            "{v}"
        );
        assert_eq!(c.line(), None, "the end of stream follows the last reply");
        sender.join().unwrap();
        assert_eq!(server.engine.stats().limit_errors, 0);
    });
}
