//! The WebSocket frame codec after the handshake: arbitrary client bytes are decoded the same
//! however they are split, within the limits, with the RFC's close codes; and well-formed
//! client messages, fragmented and interleaved with control frames, come out whole.
//!
//! Input: byte 0 chooses the limits (bit 0), the mode (bit 1: raw bytes, or messages that the
//! check frames itself) and the receive schedule; the rest is the raw stream that follows the
//! handshake, or the messages (see [`messages`]).

use bytes::BytesMut;
use powerhub::plugin::{Inbound, ProtocolError, ProtocolLimits, StreamProtocol};
use powerhub_websocket::{close_code, WebSocket, WebSocketConfig, WebSocketFactory};

use super::support::{
    assert_ends_cleanly, assert_same, check_http_response, client_frame, feed, server_frames, Fed,
    Rng, BYTEWISE_MAX, HANDSHAKE,
};

const OP_CONTINUATION: u8 = 0;
const OP_TEXT: u8 = 1;
const OP_BINARY: u8 = 2;
const OP_CLOSE: u8 = 8;
const OP_PING: u8 = 9;
const OP_PONG: u8 = 10;

fn connection(small: bool) -> WebSocket {
    let config = if small {
        WebSocketConfig::default()
            .with_max_frame_bytes(16)
            .with_max_message_bytes(40)
    } else {
        WebSocketConfig::default()
    };
    let factory = WebSocketFactory::new(config).expect("a valid config");
    factory.connection(&ProtocolLimits::default())
}

/// The check.
pub(crate) fn check(data: &[u8]) {
    let Some((&mode, body)) = data.split_first() else {
        return;
    };
    let small = mode & 1 != 0;
    let mut rng = Rng::new(u64::from(mode >> 2));
    let mut stream = HANDSHAKE.to_vec();
    let expected = if mode & 2 != 0 {
        Some(messages(body, &mut rng, &mut stream))
    } else {
        stream.extend_from_slice(body);
        None
    };

    let mut conn = connection(small);
    let limit = conn.max_message_bytes() + 125;
    let bounded = |c: &WebSocket| assert!(c.buffered_bytes() <= limit, "buffered past the limit");
    let whole = feed(&mut conn, &stream, || None, bounded);
    if stream.len() <= BYTEWISE_MAX {
        let bytewise = feed(&mut connection(small), &stream, || Some(1), bounded);
        assert_same(&whole, &bytewise, "websocket: whole and byte by byte");
    }
    let chunked = feed(
        &mut connection(small),
        &stream,
        || Some(rng.chunk()),
        bounded,
    );
    assert_same(&whole, &chunked, "websocket: whole and in chunks");

    well_formed(&whole, &conn);
    after_the_end(&whole, &mut conn);
    assert_ends_cleanly(&mut conn, &whole);
    // Within the default limits, every message sent comes out whole.
    if let (Some((events, pongs)), false) = (expected, small) {
        assert_eq!(whole.result, Ok(()), "well-formed messages refused");
        assert_eq!(whole.events, events, "messages not decoded as sent");
        let (frames, partial) = server_frames(after_head(&whole.urgent));
        assert_eq!(partial, 0);
        let got: Vec<Vec<u8>> = frames.into_iter().map(|f| f.payload).collect();
        assert_eq!(got, pongs, "pings not answered in order");
    }
}

/// Builds client frames from `body` into `stream`; returns the events they must decode to and
/// the payloads of the pongs that must answer their pings.
///
/// `body` is a list of items separated by `0xff`; an item's first byte says what it is (bits
/// 0-1: text, binary, ping, pong; bits 2-3: in how many fragments a message is sent; bit 4: a
/// ping between its fragments) and the rest is the payload. A text that is not UTF-8 is sent
/// as binary; a control payload is cut at 125 bytes.
fn messages(body: &[u8], rng: &mut Rng, stream: &mut Vec<u8>) -> (Vec<Inbound>, Vec<Vec<u8>>) {
    let mut events = Vec::new();
    let mut pongs = Vec::new();
    for item in body.split(|&b| b == 0xff) {
        let Some((&kind, payload)) = item.split_first() else {
            continue;
        };
        let key = (rng.next() as u32).to_be_bytes();
        match kind & 3 {
            op @ (0 | 1) => {
                let text = op == 0 && std::str::from_utf8(payload).is_ok();
                let opcode = if text { OP_TEXT } else { OP_BINARY };
                let parts = 1 + usize::from((kind >> 2) & 3);
                let cut = payload.len().div_ceil(parts).max(1);
                let mut pieces: Vec<&[u8]> = payload.chunks(cut).collect();
                if pieces.is_empty() {
                    pieces.push(&[]);
                }
                let last = pieces.len() - 1;
                for (i, piece) in pieces.iter().enumerate() {
                    let op = if i == 0 { opcode } else { OP_CONTINUATION };
                    client_frame(stream, i == last, op, piece, key);
                    if i < last && kind & 16 != 0 {
                        client_frame(stream, true, OP_PING, &piece[..piece.len().min(4)], key);
                        pongs.push(piece[..piece.len().min(4)].to_vec());
                    }
                }
                let data = bytes::Bytes::copy_from_slice(payload);
                events.push(if text {
                    Inbound::Text(data)
                } else {
                    Inbound::Binary(data)
                });
            }
            2 => {
                let payload = &payload[..payload.len().min(125)];
                client_frame(stream, true, OP_PING, payload, key);
                pongs.push(payload.to_vec());
            }
            _ => {
                client_frame(
                    stream,
                    true,
                    OP_PONG,
                    &payload[..payload.len().min(125)],
                    key,
                );
                events.push(Inbound::Pong);
            }
        }
    }
    (events, pongs)
}

/// The bytes after the `101` response head.
fn after_head(urgent: &[u8]) -> &[u8] {
    let end = urgent
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a 101 response")
        + 4;
    assert_eq!(check_http_response(&urgent[..end]), 101);
    &urgent[end..]
}

/// Events within the limits, a close only last, and server frames that answer what came in.
fn well_formed(fed: &Fed, conn: &WebSocket) {
    let max = conn.max_message_bytes();
    for (i, event) in fed.events.iter().enumerate() {
        match event {
            Inbound::Text(t) => {
                assert!(t.len() <= max);
                assert!(
                    std::str::from_utf8(t).is_ok(),
                    "a text message is not UTF-8"
                );
            }
            Inbound::Binary(b) => assert!(b.len() <= max),
            Inbound::Pong => {}
            Inbound::Close { code, reason } => {
                assert_eq!(i, fed.events.len() - 1, "events after a close");
                assert!(
                    *code == close_code::NO_STATUS
                        || powerhub_websocket::is_valid_close_code(*code)
                );
                assert!(reason.len() <= 123);
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    let (frames, partial) = server_frames(after_head(&fed.urgent));
    assert_eq!(partial, 0, "a partial server frame");
    let closes = frames.iter().filter(|f| f.opcode == OP_CLOSE).count();
    assert!(closes <= 1, "more than one close frame");
    for (i, f) in frames.iter().enumerate() {
        assert!(f.fin, "a fragmented server frame");
        match f.opcode {
            // Over a limit, the push protocol's error (one text message) precedes the close.
            0x1 => {
                assert!(
                    matches!(fed.result, Err(ProtocolError::TooLarge { .. })),
                    "a text message in urgent without a limit error"
                );
                assert_eq!(i + 2, frames.len(), "the error is right before the close");
                let error: serde_json::Value =
                    serde_json::from_slice(&f.payload).expect("the error is JSON");
                assert_eq!(error["code"], "limit_exceeded");
                continue;
            }
            _ => assert!(f.payload.len() <= 125, "a control frame over 125 bytes"),
        }
        match f.opcode {
            OP_PONG => {}
            OP_CLOSE => {
                assert_eq!(i, frames.len() - 1, "frames after the close");
                if let [hi, lo, ref reason @ ..] = f.payload[..] {
                    let code = u16::from_be_bytes([hi, lo]);
                    assert!(powerhub_websocket::is_valid_close_code(code));
                    assert!(std::str::from_utf8(reason).is_ok());
                    if let Err(e) = &fed.result {
                        let want = match e {
                            ProtocolError::TooLarge { .. } => close_code::TOO_BIG,
                            ProtocolError::Violation(m) if m.ends_with("is not valid UTF-8") => {
                                close_code::INVALID_PAYLOAD
                            }
                            _ => close_code::PROTOCOL_ERROR,
                        };
                        assert_eq!(code, want, "{e}");
                    }
                } else {
                    assert!(f.payload.is_empty(), "a close payload of one byte");
                }
            }
            other => panic!("the server wrote opcode {other:#x} to urgent"),
        }
    }
    // An error on an open connection always closes it with a code.
    let closed_by_peer = matches!(fed.events.last(), Some(Inbound::Close { .. }));
    if fed.result.is_err() && !closed_by_peer {
        assert_eq!(closes, 1, "an error without a close frame");
    }
}

/// After a close or an error nothing more is decoded or framed; while open, a text message is
/// framed as one unmasked text frame.
fn after_the_end(fed: &Fed, conn: &mut WebSocket) {
    let ended = fed.result.is_err() || matches!(fed.events.last(), Some(Inbound::Close { .. }));
    let mut out = BytesMut::new();
    conn.encode_text(br#"{"type":"ping"}"#, &mut out);
    if ended {
        assert!(out.is_empty(), "a data frame after the end");
        let mut input = BytesMut::from(HANDSHAKE);
        let mut events = powerhub::plugin::ProtocolOutput::default();
        let again = conn.decode(&mut input, &mut events);
        assert_eq!(again, fed.result, "a later call reports another outcome");
        assert!(input.is_empty() && events.events.is_empty() && events.urgent.is_empty());
    } else {
        let (frames, partial) = server_frames(&out);
        assert_eq!(partial, 0);
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].opcode, OP_TEXT);
        assert_eq!(frames[0].payload, br#"{"type":"ping"}"#);
    }
}
