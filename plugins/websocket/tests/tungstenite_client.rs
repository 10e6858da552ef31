//! Cross-check against a client written by others: `tungstenite` talks over loopback TCP to the
//! sans-IO codec driven by a small echo loop (the test's stand-in for the runtime's shard).
//!
//! The loop (`util::EchoServer`) echoes text and binary messages; `ping-me` makes it send a
//! ping and report the pong as the text `got pong`; `close-me` makes it start the close
//! handshake with 1001.

mod util;

use util::EchoServer;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use powerhub_plugin::{Inbound, ProtocolError};
use powerhub_websocket::WebSocketConfig;
use tungstenite::protocol::frame::coding::{CloseCode, Data, OpCode};
use tungstenite::protocol::frame::Frame;
use tungstenite::protocol::CloseFrame;
use tungstenite::{Message, WebSocket};

const TIMEOUT: Duration = Duration::from_secs(10);

fn connect(port: u16) -> WebSocket<TcpStream> {
    let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    stream.set_nodelay(true).unwrap();
    let (ws, response) = tungstenite::client(format!("ws://127.0.0.1:{port}/"), stream).unwrap();
    assert_eq!(response.status(), 101);
    ws
}

/// Reads the next data message, answering control frames as the client does.
fn next(ws: &mut WebSocket<TcpStream>) -> Message {
    loop {
        match ws.read().unwrap() {
            Message::Ping(_) | Message::Pong(_) => continue,
            other => return other,
        }
    }
}

/// Reads until the server's close frame and returns its code.
fn close_code(ws: &mut WebSocket<TcpStream>) -> Option<CloseCode> {
    loop {
        match ws.read() {
            Ok(Message::Close(frame)) => return frame.map(|f| f.code),
            Ok(_) => continue,
            Err(e) => panic!("expected a close frame, got {e}"),
        }
    }
}

#[test]
fn tungstenite_handshake_text_and_binary_round_trip() {
    let server = EchoServer::start(WebSocketConfig::default(), 4096);
    let port = server.port;
    let mut ws = connect(port);
    ws.send(Message::text(r#"{"type":"subscribe","topic":"t"}"#))
        .unwrap();
    assert_eq!(
        next(&mut ws),
        Message::text(r#"{"type":"subscribe","topic":"t"}"#)
    );
    let big: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
    ws.send(Message::binary(big.clone())).unwrap();
    assert_eq!(next(&mut ws), Message::binary(big));
    ws.send(Message::text("é€😀")).unwrap();
    assert_eq!(next(&mut ws), Message::text("é€😀"));
    ws.close(None).unwrap();
    let _ = close_code(&mut ws);
    drop(ws);
    let log = server.next_log();
    assert_eq!(log.error, None);
    assert_eq!(log.events.len(), 4);
}

#[test]
fn tungstenite_input_read_in_tiny_pieces_and_fragmented_messages() {
    let server = EchoServer::start(WebSocketConfig::default(), 3);
    let port = server.port;
    let mut ws = connect(port);
    let text = OpCode::Data(Data::Text);
    let cont = OpCode::Data(Data::Continue);
    ws.send(Message::Frame(Frame::message("{\"a\":", text, false)))
        .unwrap();
    ws.send(Message::Ping("mid".into())).unwrap();
    ws.send(Message::Frame(Frame::message(
        "€".as_bytes()[..1].to_vec(),
        cont,
        false,
    )))
    .unwrap();
    ws.send(Message::Frame(Frame::message(
        "€".as_bytes()[1..].to_vec(),
        cont,
        false,
    )))
    .unwrap();
    ws.send(Message::Frame(Frame::message("}", cont, true)))
        .unwrap();
    // The pong for the ping comes first: it did not wait behind the message.
    assert_eq!(ws.read().unwrap(), Message::Pong("mid".into()));
    assert_eq!(next(&mut ws), Message::text("{\"a\":€}"));
    ws.close(None).unwrap();
    let _ = close_code(&mut ws);
    drop(ws);
    assert_eq!(server.next_log().error, None);
}

#[test]
fn tungstenite_ping_pong_both_ways() {
    let server = EchoServer::start(WebSocketConfig::default(), 4096);
    let port = server.port;
    let mut ws = connect(port);
    ws.send(Message::Ping("hello".into())).unwrap();
    assert_eq!(ws.read().unwrap(), Message::Pong("hello".into()));
    // The server pings; tungstenite answers by itself, and the server reports the pong.
    ws.send(Message::text("ping-me")).unwrap();
    assert!(matches!(ws.read().unwrap(), Message::Ping(_)));
    ws.flush().unwrap();
    assert_eq!(next(&mut ws), Message::text("got pong"));
    ws.close(None).unwrap();
    let _ = close_code(&mut ws);
    drop(ws);
    let log = server.next_log();
    assert!(log.events.contains(&Inbound::Pong));
}

#[test]
fn tungstenite_client_close_is_echoed_with_its_code() {
    let server = EchoServer::start(WebSocketConfig::default(), 4096);
    let port = server.port;
    let mut ws = connect(port);
    ws.close(Some(CloseFrame {
        code: CloseCode::Away,
        reason: "leaving".into(),
    }))
    .unwrap();
    assert_eq!(close_code(&mut ws), Some(CloseCode::Away));
    drop(ws);
    let log = server.next_log();
    assert_eq!(
        log.events,
        vec![Inbound::Close {
            code: 1001,
            reason: "leaving".into()
        }]
    );
}

#[test]
fn tungstenite_server_close_is_answered_by_the_client() {
    let server = EchoServer::start(WebSocketConfig::default(), 4096);
    let port = server.port;
    let mut ws = connect(port);
    ws.send(Message::text("close-me")).unwrap();
    assert_eq!(close_code(&mut ws), Some(CloseCode::Away));
    // tungstenite queued its reply; writing it completes the handshake.
    let _ = ws.flush();
    drop(ws);
    let log = server.next_log();
    assert_eq!(log.error, None);
    assert!(
        matches!(log.events.last(), Some(Inbound::Close { code: 1001, .. })),
        "{log:?}"
    );
}

#[test]
fn tungstenite_sees_1002_for_an_unmasked_frame() {
    let server = EchoServer::start(WebSocketConfig::default(), 4096);
    let port = server.port;
    let mut ws = connect(port);
    ws.get_mut().write_all(&[0x81, 0x02, b'h', b'i']).unwrap();
    assert_eq!(close_code(&mut ws), Some(CloseCode::Protocol));
    drop(ws);
    assert!(matches!(
        server.next_log().error,
        Some(ProtocolError::Violation(_))
    ));
}

#[test]
fn tungstenite_sees_1007_for_invalid_utf8() {
    let server = EchoServer::start(WebSocketConfig::default(), 4096);
    let port = server.port;
    let mut ws = connect(port);
    ws.get_mut()
        .write_all(&util::data(0x1, b"\xff\xfe"))
        .unwrap();
    assert_eq!(close_code(&mut ws), Some(CloseCode::Invalid));
    drop(ws);
    assert!(server.next_log().error.is_some());
}

#[test]
fn tungstenite_sees_1009_for_a_message_over_the_limit() {
    let server = EchoServer::start(
        WebSocketConfig::default().with_max_message_bytes(1000),
        4096,
    );
    let port = server.port;
    let mut ws = connect(port);
    ws.send(Message::binary(vec![0u8; 1001])).unwrap();
    assert_eq!(close_code(&mut ws), Some(CloseCode::Size));
    drop(ws);
    assert!(matches!(
        server.next_log().error,
        Some(ProtocolError::TooLarge { .. })
    ));
}

#[test]
fn tungstenite_handshake_refused_for_a_foreign_origin() {
    let config = WebSocketConfig::default().with_allowed_origins(["http://good.test"]);
    let server = EchoServer::start(config, 4096);
    let port = server.port;
    let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    let request =
        tungstenite::ClientRequestBuilder::new(format!("ws://127.0.0.1:{port}/").parse().unwrap())
            .with_header("Origin", "http://evil.test");
    match tungstenite::client(request, stream) {
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(response))) => {
            assert_eq!(response.status(), 403);
        }
        other => panic!("expected a 403, got {other:?}"),
    }
    assert!(matches!(
        server.next_log().error,
        Some(ProtocolError::Handshake(_))
    ));
}
