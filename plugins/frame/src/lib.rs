//! powerhub's binary frame transport over TCP.
//!
//! Both directions carry the hub's binary frames ([`powerhub_plugin::frame`]: a 12-byte header
//! with magic `PH`, version, codec, message count and payload length, then the payload). The
//! plugin is sans-IO: [`FrameProtocol`] splits inbound bytes into frames and frames outbound
//! messages; the runtime owns the socket.
//!
//! - Inbound: a `json` frame carries one or more push-protocol commands (its JSON array's
//!   elements), each decoded to an [`Inbound::Text`]; a `raw` frame is an [`Inbound::Binary`].
//!   A frame whose payload exceeds [`ProtocolLimits::max_message_bytes`] is refused as soon as its
//!   header arrives ([`ProtocolError::TooLarge`]); a corrupt header or payload is a
//!   [`ProtocolError::Violation`] naming the fault. Either way a final error frame is put in
//!   [`ProtocolOutput::urgent`] and the runtime closes the connection: the push protocol's
//!   `{"type":"error","requestId":null,"code":..,"message":..}`, with `code` `limit_exceeded`
//!   (and `"limit":"max_message_bytes"`) or `bad_frame`. A frame the peer's end of stream cuts
//!   short is a `bad_frame` violation too, saying how many of its bytes arrived.
//! - Outbound: [`StreamProtocol::encode_text`] writes a one-message `json` frame, or, given a
//!   complete hub frame (no JSON text starts with its magic `P`), that frame as it is: a
//!   subscriber's batch encoded once by the hub reaches the wire as the same frame;
//!   [`StreamProtocol::encode_binary`] writes a hub frame as it is (it must be a complete,
//!   valid frame).
//!
//! # Examples
//!
//! ```
//! use powerhub_frame::FrameFactory;
//! use powerhub_plugin::frame;
//! use powerhub_plugin::{BytesMut, Inbound, ProtocolFactory, ProtocolLimits, ProtocolOutput};
//!
//! let mut proto = FrameFactory.new_connection(&ProtocolLimits::default());
//! let wire = frame::encode_json_batch([&br#"{"type":"ping"}"#[..], br#"{"type":"pong"}"#]).unwrap();
//! let mut input = BytesMut::from(&wire[..]);
//! let mut out = ProtocolOutput::default();
//! proto.decode(&mut input, &mut out).unwrap();
//! assert_eq!(out.events, vec![Inbound::Text(r#"{"type":"ping"}"#.into()), Inbound::Text(r#"{"type":"pong"}"#.into())]);
//!
//! let mut reply = BytesMut::new();
//! proto.encode_text(br#"{"type":"pong"}"#, &mut reply);
//! let decoded = frame::decode(&reply).unwrap();
//! assert_eq!(decoded.json_messages().unwrap(), vec![&br#"{"type":"pong"}"#[..]]);
//! ```

use powerhub_plugin::codes;
use powerhub_plugin::frame::{self, FrameCodec, FrameError};
use powerhub_plugin::{
    BytesMut, Inbound, ProtocolError, ProtocolFactory, ProtocolLimits, ProtocolOutput,
    StreamProtocol,
};

/// The name the protocol is registered under: `frame`.
pub const NAME: &str = "frame";

/// Builds a [`FrameProtocol`] per connection.
#[derive(Debug, Default, Clone, Copy)]
pub struct FrameFactory;

impl ProtocolFactory for FrameFactory {
    fn name(&self) -> &str {
        NAME
    }

    fn new_connection(&self, limits: &ProtocolLimits) -> Box<dyn StreamProtocol> {
        Box::new(FrameProtocol::new(limits.max_message_bytes))
    }
}

/// The binary-frame state of one connection.
#[derive(Debug, Clone)]
pub struct FrameProtocol {
    max_payload: usize,
}

impl FrameProtocol {
    /// A protocol refusing frames whose payload exceeds `max_payload` bytes.
    pub fn new(max_payload: usize) -> Self {
        FrameProtocol { max_payload }
    }

    fn fail(&mut self, err: ProtocolError, out: &mut ProtocolOutput) -> ProtocolError {
        let (code, limit) = match &err {
            ProtocolError::TooLarge { limit_name, .. } => {
                (codes::LIMIT_EXCEEDED, Some(*limit_name))
            }
            _ => (codes::BAD_FRAME, None),
        };
        // The push protocol's error shape, as on every transport.
        let mut json = format!(
            "{{\"type\":\"error\",\"requestId\":null,\"code\":\"{code}\",\"message\":{}",
            json_string(&err.to_string())
        );
        if let Some(limit) = limit {
            json.push_str(&format!(",\"limit\":\"{limit}\""));
        }
        json.push('}');
        self.encode_text(json.as_bytes(), &mut out.urgent);
        err
    }
}

/// Whether `bytes` is exactly one complete hub frame.
fn is_one_frame(bytes: &[u8]) -> bool {
    bytes.starts_with(&frame::MAGIC)
        && frame::decode_prefix(bytes).is_ok_and(|(_, used)| used == bytes.len())
}

/// A JSON string literal of `s`.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl StreamProtocol for FrameProtocol {
    fn decode(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError> {
        loop {
            let whole = match frame::split_frame(input, self.max_payload) {
                Ok(Some(f)) => f,
                Ok(None) => return Ok(()),
                Err(FrameError::TooLarge { size, limit, .. }) => {
                    let err = ProtocolError::TooLarge {
                        what: "frame",
                        limit_name: "max_message_bytes",
                        size,
                        limit,
                    };
                    return Err(self.fail(err, out));
                }
                Err(e) => {
                    return Err(self.fail(
                        ProtocolError::Violation(format!("bad frame header: {e}")),
                        out,
                    ))
                }
            };
            let decoded = match frame::decode(&whole) {
                Ok(d) => d,
                Err(e) => {
                    return Err(self.fail(ProtocolError::Violation(format!("bad frame: {e}")), out))
                }
            };
            match decoded.codec() {
                FrameCodec::Raw => out
                    .events
                    .push(Inbound::Binary(whole.slice_ref(decoded.payload()))),
                FrameCodec::Json => match decoded.json_messages() {
                    Ok(messages) => {
                        for m in messages {
                            out.events.push(Inbound::Text(whole.slice_ref(m)));
                        }
                    }
                    Err(e) => {
                        return Err(self.fail(
                            ProtocolError::Violation(format!("bad frame payload: {e}")),
                            out,
                        ))
                    }
                },
            }
        }
    }

    /// A frame cut short by the end of the stream is a [`ProtocolError::Violation`] that says
    /// how much of it arrived, with the final error frame (`bad_frame`).
    fn decode_end(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError> {
        if input.is_empty() {
            return Ok(());
        }
        let what = match frame::Header::parse(input) {
            Ok(header) => format!(
                "a frame ({} of its {} bytes arrived)",
                input.len(),
                header.frame_len()
            ),
            Err(_) => format!(
                "a frame header ({} of its {} bytes arrived)",
                input.len(),
                frame::HEADER_LEN
            ),
        };
        input.clear();
        let err = ProtocolError::Violation(format!("the stream ended inside {what}"));
        Err(self.fail(err, out))
    }

    fn encode_text(&mut self, json: &[u8], out: &mut BytesMut) {
        // A complete hub frame (a subscriber's batch, encoded once by the hub) is already framed
        // for this protocol and goes as it is. No JSON text starts with `P`, so the two cases
        // cannot be confused.
        if is_one_frame(json) {
            out.extend_from_slice(json);
            return;
        }
        // One message never overflows the u32 length field in practice; a message that would
        // (over 4 GiB) is dropped rather than framed wrongly.
        if let Ok(f) = frame::encode_json_batch([json]) {
            out.extend_from_slice(&f);
        }
    }

    fn encode_binary(
        &mut self,
        frame_bytes: &[u8],
        out: &mut BytesMut,
    ) -> Result<(), ProtocolError> {
        if !is_one_frame(frame_bytes) {
            let msg = "encode_binary takes one complete hub frame";
            return Err(ProtocolError::Violation(msg.into()));
        }
        out.extend_from_slice(frame_bytes);
        Ok(())
    }

    fn name(&self) -> &str {
        NAME
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_cut_short_by_the_end_of_stream_is_a_bad_frame_error() {
        let wire = frame::encode_json_batch([&b"{\"a\":1}"[..]]).unwrap();
        let mut out = ProtocolOutput::default();
        let mut p = FrameProtocol::new(1024);
        assert_eq!(p.decode_end(&mut BytesMut::new(), &mut out), Ok(()));
        for cut in 1..wire.len() {
            let mut input = BytesMut::from(&wire[..cut]);
            p.decode(&mut input, &mut out).unwrap();
            let err = p.decode_end(&mut input, &mut out).unwrap_err();
            assert!(input.is_empty());
            let said = format!("{cut} of its");
            assert!(err.to_string().contains(&said), "{err}");
            let error = frame::decode(&out.urgent).unwrap().json_messages().unwrap()[0].to_vec();
            let error = String::from_utf8(error).unwrap();
            let code = format!("\"code\":\"{}\"", codes::BAD_FRAME);
            assert!(error.contains(&code), "{error}");
            out.clear();
        }
    }

    #[test]
    fn frames_split_across_reads_are_reassembled() {
        let mut p = FrameProtocol::new(1024);
        let wire = frame::encode_json_batch([&b"{\"a\":1}"[..]]).unwrap();
        let mut input = BytesMut::new();
        let mut out = ProtocolOutput::default();
        for b in wire.iter() {
            input.extend_from_slice(&[*b]);
            p.decode(&mut input, &mut out).unwrap();
        }
        assert_eq!(out.events, vec![Inbound::Text("{\"a\":1}".into())]);
        assert!(input.is_empty());
    }

    #[test]
    fn frame_over_max_message_bytes_is_too_large_with_final_error_frame() {
        let mut p = FrameProtocol::new(16);
        let wire = frame::encode_raw(&[0u8; 100]).unwrap();
        let mut input = BytesMut::from(&wire[..12]);
        let mut out = ProtocolOutput::default();
        let err = p.decode(&mut input, &mut out).unwrap_err();
        assert!(matches!(
            err,
            ProtocolError::TooLarge {
                limit_name: "max_message_bytes",
                limit: 16,
                ..
            }
        ));
        let reply = frame::decode(&out.urgent).unwrap();
        let msg = String::from_utf8(reply.json_messages().unwrap()[0].to_vec()).unwrap();
        assert!(msg.contains("max_message_bytes"), "{msg}");
    }

    #[test]
    fn corrupt_header_is_a_violation() {
        let mut p = FrameProtocol::new(1024);
        let mut input = BytesMut::from(&b"XX\x01\x01\0\0\0\0\0\0\0\0"[..]);
        let mut out = ProtocolOutput::default();
        assert!(matches!(
            p.decode(&mut input, &mut out),
            Err(ProtocolError::Violation(_))
        ));
        assert!(!out.urgent.is_empty());
    }

    #[test]
    fn encode_text_passes_a_hub_frame_through_and_frames_json() {
        let mut p = FrameProtocol::new(1024);
        let batch = frame::encode_json_batch([&b"1"[..], b"2"]).unwrap();
        let mut out = BytesMut::new();
        p.encode_text(&batch, &mut out);
        assert_eq!(&out[..], &batch[..]);
        out.clear();
        p.encode_text(b"{\"a\":1}", &mut out);
        let decoded = frame::decode(&out).unwrap();
        assert_eq!(decoded.json_messages().unwrap(), vec![&b"{\"a\":1}"[..]]);
    }

    #[test]
    fn encode_binary_passes_a_hub_frame_through_unchanged() {
        let mut p = FrameProtocol::new(1024);
        let f = frame::encode_raw(b"x").unwrap();
        let mut out = BytesMut::new();
        p.encode_binary(&f, &mut out).unwrap();
        assert_eq!(&out[..], &f[..]);
        assert!(p.encode_binary(b"garbage", &mut out).is_err());
    }
}
