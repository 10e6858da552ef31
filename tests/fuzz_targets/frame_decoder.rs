//! The binary hub frame: the decoder never panics, what it accepts encodes back to itself, and
//! the `frame` transport decodes a byte stream the same way however it is split.
//!
//! Input: byte 0 chooses the payload limit and the receive schedule; the rest is a byte stream
//! of frames.

use bytes::BytesMut;
use powerhub::plugin::frame::{self, FrameCodec, FrameError, Header, HEADER_LEN};
use powerhub::plugin::{Inbound, ProtocolError, StreamProtocol};
use powerhub_frame::FrameProtocol;

use super::support::{
    assert_ends_cleanly, assert_same, feed_bytewise, feed_chunked, feed_whole, is_json, Rng,
    BYTEWISE_MAX,
};

/// The check.
pub(crate) fn check(data: &[u8]) {
    let Some((&mode, stream)) = data.split_first() else {
        return;
    };
    let max_payload = if mode & 1 == 0 { 64 } else { 1 << 20 };

    one_frame(stream);
    split_frames(stream, max_payload, &mut Rng::new(u64::from(mode)));
    transport(stream, max_payload, mode);
}

/// `decode` on a buffer that should hold one frame, and the frame's messages.
fn one_frame(bytes: &[u8]) {
    let header = Header::parse(bytes);
    let prefix = frame::decode_prefix(bytes);
    match (&header, &prefix) {
        (Ok(h), Ok((f, used))) => {
            assert_eq!(f.header(), *h);
            assert_eq!(*used, h.frame_len());
            assert_eq!(f.payload(), &bytes[HEADER_LEN..*used]);
        }
        (Ok(h), Err(FrameError::Truncated { needed, available })) => {
            assert_eq!((*needed, *available), (h.frame_len(), bytes.len()));
        }
        (Err(a), Err(b)) => assert_eq!(a, b),
        other => panic!("Header::parse and decode_prefix disagree: {other:?}"),
    }
    let Ok(decoded) = frame::decode(bytes) else {
        return;
    };
    match decoded.codec() {
        FrameCodec::Raw => {
            assert_eq!(decoded.count(), 1);
            let again = frame::encode_raw(decoded.payload()).expect("a small payload encodes");
            assert_eq!(&again[..], bytes, "a raw frame re-encodes to itself");
        }
        FrameCodec::Json => {
            let Ok(messages) = decoded.json_messages() else {
                return;
            };
            assert_eq!(messages.len(), decoded.count() as usize);
            // Elements are split, not validated (the command parser judges each one); a
            // payload that is JSON splits into elements that are each JSON.
            if is_json(decoded.payload()) {
                for m in &messages {
                    assert!(is_json(m), "a frame element is not JSON: {m:?}");
                }
            }
            // The elements encode into a frame whose elements are the same bytes.
            let again = frame::encode_json_batch(messages.iter().copied()).expect("encodes");
            let back = frame::decode(&again).expect("an encoded frame decodes");
            assert_eq!(back.json_messages().expect("its payload is JSON"), messages);
        }
    }
}

/// The frames `split_frame` cuts off a buffer that `stream` arrives in (in receives of the
/// sizes `sizes` yields), and its error, if any.
type Split = (Vec<Vec<u8>>, Result<(), FrameError>);

fn split_all(stream: &[u8], max_payload: usize, mut sizes: impl FnMut() -> usize) -> Split {
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    let mut at = 0;
    loop {
        match frame::split_frame(&mut buf, max_payload) {
            Ok(Some(f)) => {
                let header = Header::parse(&f).expect("a split frame has a header");
                assert!(header.length as usize <= max_payload);
                assert_eq!(f.len(), header.frame_len());
                frames.push(f.to_vec());
            }
            Ok(None) if at == stream.len() => return (frames, Ok(())),
            Ok(None) => {
                let n = sizes().clamp(1, stream.len() - at);
                buf.extend_from_slice(&stream[at..at + n]);
                at += n;
            }
            Err(e) => return (frames, Err(e)),
        }
    }
}

/// `split_frame` on a growing buffer finds the same frames and the same error for any split.
fn split_frames(stream: &[u8], max_payload: usize, rng: &mut Rng) {
    let whole = split_all(stream, max_payload, || usize::MAX);
    if stream.len() <= BYTEWISE_MAX {
        let bytewise = split_all(stream, max_payload, || 1);
        assert_eq!(whole, bytewise, "split_frame: whole and byte by byte");
    }
    let chunked = split_all(stream, max_payload, || rng.chunk());
    assert_eq!(whole, chunked, "split_frame: whole and in chunks");
}

/// The `frame` transport: split-independent, every text event is one array element, and a refusal
/// leaves a final error frame.
fn transport(stream: &[u8], max_payload: usize, mode: u8) {
    let mut proto = FrameProtocol::new(max_payload);
    let whole = feed_whole(&mut proto, stream);
    assert_ends_cleanly(&mut proto, &whole);
    for event in &whole.events {
        match event {
            // An element of a json frame, split but not validated: the command parser answers
            // one that is not a command with a named error (tests/hostile_input.rs).
            Inbound::Text(t) => assert!(!t.is_empty(), "an empty text event"),
            Inbound::Binary(b) => assert!(b.len() <= max_payload),
            other => panic!("the frame transport decoded {other:?}"),
        }
    }
    match &whole.result {
        Ok(()) => assert!(whole.urgent.is_empty()),
        Err(e) => {
            let reply = frame::decode(&whole.urgent).expect("the final error is one frame");
            let messages = reply.json_messages().expect("a json frame");
            assert_eq!(messages.len(), 1);
            assert!(super::support::is_json_object(messages[0]));
            if let ProtocolError::TooLarge { limit, .. } = e {
                assert_eq!(*limit, max_payload);
            }
        }
    }
    if stream.len() <= BYTEWISE_MAX {
        let bytewise = feed_bytewise(&mut FrameProtocol::new(max_payload), stream);
        assert_same(&whole, &bytewise, "frame transport: whole and byte by byte");
    }
    let mut rng = Rng::new(u64::from(mode) << 8);
    let chunked = feed_chunked(&mut FrameProtocol::new(max_payload), stream, &mut rng);
    assert_same(&whole, &chunked, "frame transport: whole and in chunks");

    // Outbound: a JSON text message is framed so that it decodes back to itself. (An element is
    // split, not validated, and `encode_text` passes a complete hub frame through as it is: the
    // server hands it JSON messages or hub frames only, so an element of other bytes, one that
    // starts with a frame's magic for one, is no outbound case.)
    if let Some(Inbound::Text(t)) = whole
        .events
        .first()
        .filter(|e| matches!(e, Inbound::Text(t) if serde_json::from_slice::<serde::de::IgnoredAny>(t).is_ok()))
    {
        let mut out = BytesMut::new();
        FrameProtocol::new(max_payload).encode_text(t, &mut out);
        let back = frame::decode(&out).expect("an encoded text decodes");
        assert_eq!(back.json_messages().expect("json"), vec![&t[..]]);
    }
}
