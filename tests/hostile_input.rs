//! Input meant to break the server, sent over real sockets on both backends and every protocol
//! (NDJSON, the binary frame protocol, WebSocket): the server answers with a named error, the
//! connection stays usable, and every other client is unaffected.
//!
//! The nesting case is the one that once aborted the whole process: about 13 000 levels of
//! brackets overflowed a shard thread's stack.

mod engine_support;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};

use engine_support::{config, on_both_backends, serve, Client, Servers, WAIT};
use powerhub::runtime::BackendChoice;
use powerhub_plugin::frame;
use serde_json::Value;

/// Lines that once crashed, aliased or were wrongly refused, each with the error code the server
/// must answer with (`None`: it must be accepted, answered by a `pong`).
fn cases() -> Vec<(String, Option<&'static str>)> {
    let nest = |n: usize| {
        format!(
            r#"{{"type":"ping","id":1,"x":{}{}}}"#,
            "[".repeat(n),
            "]".repeat(n)
        )
    };
    vec![
        (nest(13_084), Some("limit_exceeded")),
        (nest(100_000), Some("limit_exceeded")),
        (nest(127), None),
        (
            r#"{"type":"subscribe","id":1,"stream":"\ud800"}"#.to_owned(),
            Some("lone_surrogate"),
        ),
        (
            r#"{"type":"ping","id":1,"id":2}"#.to_owned(),
            Some("duplicate_field"),
        ),
        (
            r#"{"type":"publish","id":1,"message":{"type":"t","stream":"a","stream":"b"}}"#
                .to_owned(),
            Some("duplicate_field"),
        ),
        (
            r#"{"type":"ping","id":18446744073709551616}"#.to_owned(),
            None,
        ),
        (r#"{"type":"ping","id":1,"n":1e999999}"#.to_owned(), None),
    ]
}

fn start(backend: BackendChoice) -> Servers {
    let mut c = config(backend);
    c.limits.max_message_bytes = 4 << 20;
    serve(c)
}

/// Checks the server's answer to one case: the named error with the case's id, or a pong.
fn check(reply: &Value, expected: Option<&str>, line: &str) {
    let shown = &line[..line.len().min(80)];
    match expected {
        Some(code) => {
            assert_eq!(reply["type"], "error", "{shown}: {reply}");
            assert_eq!(reply["code"], code, "{shown}: {reply}");
            if code == "limit_exceeded" {
                assert_eq!(reply["limit"], "max_json_depth", "{reply}");
                assert_eq!(reply["requestId"], 1, "{reply}");
            }
        }
        None => assert_eq!(reply["type"], "pong", "{shown}: {reply}"),
    }
}

fn over_ndjson(addr: SocketAddr) {
    let mut c = Client::connect(addr);
    for (line, expected) in cases() {
        c.send(&line);
        check(&c.json(), expected, &line);
    }
    c.send(r#"{"type":"ping","id":"after"}"#);
    assert_eq!(
        c.json()["requestId"],
        "after",
        "the connection stays usable"
    );
}

/// One hub frame's messages, parsed.
fn read_frame(s: &mut TcpStream) -> Vec<Value> {
    engine_support::frame_messages(s)
        .iter()
        .map(|m| serde_json::from_slice(m).unwrap())
        .collect()
}

fn over_frames(addr: SocketAddr) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    for (line, expected) in cases() {
        let f = frame::encode_json_batch([line.as_bytes()]).unwrap();
        s.write_all(&f).unwrap();
        let replies = read_frame(&mut s);
        check(&replies[0], expected, &line);
    }
    let f = frame::encode_json_batch([&br#"{"type":"ping","id":"after"}"#[..]]).unwrap();
    s.write_all(&f).unwrap();
    assert_eq!(read_frame(&mut s)[0]["requestId"], "after");
}

fn over_websocket(addr: SocketAddr) {
    let mut ws = engine_support::ws_connect(&format!("ws://{addr}/"), addr);
    let next = |ws: &mut tungstenite::WebSocket<TcpStream>| loop {
        let message = match ws.read() {
            // A signal delivered to this thread (the test process runs servers) interrupts the
            // blocking read; the socket is intact: read again.
            Err(tungstenite::Error::Io(e)) if e.kind() == std::io::ErrorKind::Interrupted => {
                continue
            }
            other => other.expect("a reply"),
        };
        match message {
            tungstenite::Message::Text(t) => break serde_json::from_str::<Value>(&t).unwrap(),
            tungstenite::Message::Ping(_) | tungstenite::Message::Pong(_) => continue,
            other => panic!("unexpected {other:?}"),
        }
    };
    for (line, expected) in cases() {
        ws.send(tungstenite::Message::text(line.clone())).unwrap();
        check(&next(&mut ws), expected, &line);
    }
    ws.send(tungstenite::Message::text(
        r#"{"type":"ping","id":"after"}"#,
    ))
    .unwrap();
    assert_eq!(next(&mut ws)["requestId"], "after");
}

#[test]
fn hostile_lines_get_named_errors_on_every_protocol_and_the_server_lives() {
    on_both_backends(|backend| {
        let s = start(backend);
        // A bystander, connected throughout.
        let mut bystander = Client::connect(s.ndjson);
        over_ndjson(s.ndjson);
        over_frames(s.frame);
        over_websocket(s.websocket);
        bystander.send(r#"{"type":"ping","id":"still here"}"#);
        assert_eq!(bystander.json()["requestId"], "still here");
    });
}
