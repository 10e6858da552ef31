//! The per-connection state machine: handshake, then RFC 6455 frames in both directions.

use std::fmt;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use powerhub_plugin::codes;
use powerhub_plugin::{Inbound, ProtocolError, ProtocolLimits, ProtocolOutput, StreamProtocol};

use crate::config::WebSocketConfig;
use crate::frame::{
    close_code, is_valid_close_code, put_close, put_frame, unmask, MAX_CONTROL_PAYLOAD, OP_BINARY,
    OP_CLOSE, OP_CONTINUATION, OP_PING, OP_PONG, OP_TEXT,
};
use crate::handshake::{self, Outcome, Rejection};

/// Where the connection is in its life.
#[derive(Debug)]
enum State {
    /// Reading the opening handshake; `scanned` bytes were searched for its end.
    Handshake { scanned: usize },
    /// Upgraded: frames flow both ways.
    Open,
    /// The server sent its close frame and waits for the peer's.
    CloseSent,
    /// The close handshake is over, or the page was served: inbound bytes are discarded.
    Closed,
    /// The peer broke the protocol; every later call reports the same error.
    Failed(ProtocolError),
}

/// The frame being read.
#[derive(Debug, Clone, Copy)]
enum FrameState {
    /// Waiting for a complete frame header.
    Header,
    /// Reading a payload of which `remaining` bytes are still to come.
    Payload(Payload),
}

#[derive(Debug, Clone, Copy)]
struct Payload {
    opcode: u8,
    fin: bool,
    key: [u8; 4],
    /// Payload bytes already read (the masking key's phase).
    offset: usize,
    remaining: usize,
}

/// A failure and the close code it is reported with.
struct Fault {
    code: u16,
    error: ProtocolError,
}

impl Fault {
    fn violation(rule: impl Into<String>) -> Self {
        Fault {
            code: close_code::PROTOCOL_ERROR,
            error: ProtocolError::Violation(rule.into()),
        }
    }

    fn invalid_utf8(what: &str) -> Self {
        Fault {
            code: close_code::INVALID_PAYLOAD,
            error: ProtocolError::Violation(format!("{what} is not valid UTF-8")),
        }
    }

    fn too_large(what: &'static str, limit_name: &'static str, size: usize, limit: usize) -> Self {
        Fault {
            code: close_code::TOO_BIG,
            error: ProtocolError::TooLarge {
                what,
                limit_name,
                size,
                limit,
            },
        }
    }
}

/// The server side of one WebSocket connection, sans-IO: built by
/// [`WebSocketFactory`](crate::WebSocketFactory), driven by the runtime through
/// [`StreamProtocol`].
///
/// Inbound, it answers the opening handshake (or serves the page), then decodes client frames
/// into [`Inbound`] events: text and binary messages (reassembled from fragments), pongs, and
/// the peer's close. Pings are answered and close frames replied to in
/// [`ProtocolOutput::urgent`]. A violation writes a close frame with the RFC's status code to
/// `urgent` and returns the error:
///
/// | rule broken | close code | error |
/// | --- | --- | --- |
/// | unmasked client frame, reserved bits, unknown opcode, control frame over 125 bytes or fragmented, continuation without a message, data frame inside a fragmented message, invalid close code, non-minimal or 64-bit-overflowing length | 1002 | [`ProtocolError::Violation`] |
/// | text message or close reason not valid UTF-8 | 1007 | [`ProtocolError::Violation`] |
/// | frame over `max_frame_bytes`, message over `max_message_bytes` | 1009 | [`ProtocolError::TooLarge`] |
///
/// Decoding is incremental: bytes are consumed as they arrive (payloads are unmasked into the
/// message being assembled), so the runtime's input buffer never holds more than a partial
/// header, and any split of the input gives the same events.
///
/// Outbound, it writes unmasked final frames: text for JSON messages, binary for hub frames,
/// ping and close. After the connection sent or received a close frame, data is no longer
/// framed (RFC 6455 section 5.5.1).
pub struct WebSocket {
    config: Arc<WebSocketConfig>,
    max_handshake: usize,
    max_frame: usize,
    max_message: usize,
    state: State,
    frame: FrameState,
    /// The opcode of the message being assembled in `message`, if any.
    message_opcode: Option<u8>,
    message: BytesMut,
    /// How much of `message` is known to be valid UTF-8 (text messages).
    utf8_checked: usize,
    /// The payload of the control frame being read.
    control: Vec<u8>,
}

impl fmt::Debug for WebSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebSocket")
            .field("state", &self.state)
            .field("frame", &self.frame)
            .field("message_opcode", &self.message_opcode)
            .field("message_len", &self.message.len())
            .finish_non_exhaustive()
    }
}

impl WebSocket {
    pub(crate) fn new(config: Arc<WebSocketConfig>, limits: &ProtocolLimits) -> Self {
        WebSocket {
            max_handshake: config.max_handshake_bytes.min(limits.max_handshake_bytes),
            max_frame: config.max_frame_bytes,
            max_message: config.max_message_bytes.min(limits.max_message_bytes),
            config,
            state: State::Handshake { scanned: 0 },
            frame: FrameState::Header,
            message_opcode: None,
            message: BytesMut::new(),
            utf8_checked: 0,
            control: Vec::new(),
        }
    }

    /// Bytes the connection holds between calls: the message being assembled and the control
    /// frame being read. Never more than the message limit plus 125.
    ///
    /// ```
    /// use powerhub_plugin::ProtocolLimits;
    /// use powerhub_websocket::{WebSocketConfig, WebSocketFactory};
    ///
    /// let factory = WebSocketFactory::new(WebSocketConfig::default())?;
    /// let conn = factory.connection(&ProtocolLimits::default());
    /// assert_eq!(conn.buffered_bytes(), 0);
    /// assert_eq!(conn.max_message_bytes(), 1 << 20);
    /// # Ok::<(), powerhub_websocket::ConfigError>(())
    /// ```
    pub fn buffered_bytes(&self) -> usize {
        self.message.len() + self.control.len()
    }

    /// The largest inbound message this connection accepts: the tighter of the configured and
    /// the runtime's limit.
    pub fn max_message_bytes(&self) -> usize {
        self.max_message
    }

    /// Whether a close frame was sent or received, so no data frame may follow.
    fn closing(&self) -> bool {
        !matches!(self.state, State::Handshake { .. } | State::Open)
    }

    /// Reads the handshake; returns whether frames may follow in `input`.
    fn decode_handshake(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<bool, ProtocolError> {
        let State::Handshake { scanned } = &mut self.state else {
            return Ok(true);
        };
        match handshake::process(
            input,
            scanned,
            &self.config,
            self.max_handshake,
            &mut out.urgent,
        ) {
            Outcome::NeedMore => Ok(false),
            Outcome::Upgraded {
                consumed,
                credential,
            } => {
                input.advance(consumed);
                self.state = State::Open;
                if let Some(token) = credential {
                    out.events.push(Inbound::Credential(token));
                }
                Ok(true)
            }
            Outcome::PageServed => {
                input.clear();
                self.state = State::Closed;
                out.events.push(Inbound::Close {
                    code: close_code::NORMAL,
                    reason: "page served".to_owned(),
                });
                Ok(false)
            }
            Outcome::Rejected(rejection) => {
                input.clear();
                let error = match rejection {
                    Rejection::TooLarge { size } => ProtocolError::TooLarge {
                        what: "handshake",
                        limit_name: "max_handshake_bytes",
                        size,
                        limit: self.max_handshake,
                    },
                    Rejection::Invalid(reason) => ProtocolError::Handshake(reason),
                };
                self.state = State::Failed(error.clone());
                Err(error)
            }
        }
    }

    /// Decodes frames until `input` is used up or the connection stops reading.
    fn decode_frames(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), Fault> {
        while matches!(self.state, State::Open | State::CloseSent) {
            match self.frame {
                FrameState::Header => match self.parse_header(input)? {
                    Some((header_len, payload)) => {
                        input.advance(header_len);
                        if payload.opcode & 0x8 == 0 && payload.opcode != OP_CONTINUATION {
                            self.message_opcode = Some(payload.opcode);
                        }
                        self.frame = FrameState::Payload(payload);
                    }
                    None => return Ok(()),
                },
                FrameState::Payload(payload) if payload.opcode & 0x8 != 0 => {
                    if !self.read_control(payload, input) {
                        return Ok(());
                    }
                    self.frame = FrameState::Header;
                    self.on_control(payload.opcode, out)?;
                }
                FrameState::Payload(payload) => {
                    if !self.read_data(payload, input, out)? {
                        return Ok(());
                    }
                    self.frame = FrameState::Header;
                }
            }
        }
        // Closed: whatever follows the peer's close frame is not read.
        input.clear();
        Ok(())
    }

    /// Parses the frame header at the front of `input`: its length and the payload to read, or
    /// `None` while incomplete. Every check uses only the bytes it needs, in a fixed order, so
    /// the error found does not depend on how the input was split.
    fn parse_header(&self, input: &[u8]) -> Result<Option<(usize, Payload)>, Fault> {
        let [b0, b1, ..] = *input else {
            return Ok(None);
        };
        let fin = b0 & 0x80 != 0;
        if b0 & 0x70 != 0 {
            return Err(Fault::violation(
                "reserved bits set in a frame without a negotiated extension",
            ));
        }
        let opcode = b0 & 0x0f;
        if !matches!(
            opcode,
            OP_CONTINUATION | OP_TEXT | OP_BINARY | OP_CLOSE | OP_PING | OP_PONG
        ) {
            return Err(Fault::violation(format!("unknown opcode {opcode:#x}")));
        }
        if b1 & 0x80 == 0 {
            return Err(Fault::violation("client frame is not masked"));
        }
        let control = opcode & 0x8 != 0;
        let len7 = b1 & 0x7f;
        if control {
            if !fin {
                return Err(Fault::violation("fragmented control frame"));
            }
            if usize::from(len7) > MAX_CONTROL_PAYLOAD {
                // 126 and 127 announce an extended length, whatever it then says.
                return Err(Fault::violation(
                    "control frame with an extended payload length (a control frame's \
                     payload is at most 125 bytes, in the 7-bit length)",
                ));
            }
        } else {
            match (opcode, self.message_opcode) {
                (OP_CONTINUATION, None) => {
                    return Err(Fault::violation(
                        "continuation frame without a message to continue",
                    ));
                }
                (OP_TEXT | OP_BINARY, Some(_)) => {
                    return Err(Fault::violation(
                        "new data frame inside a fragmented message",
                    ));
                }
                _ => {}
            }
        }
        let (len, ext) = match len7 {
            126 => {
                let Some(&[hi, lo]) = input.get(2..4) else {
                    return Ok(None);
                };
                let len = u16::from_be_bytes([hi, lo]);
                if len < 126 {
                    return Err(Fault::violation(
                        "payload length not in its shortest encoding",
                    ));
                }
                (u64::from(len), 2)
            }
            127 => {
                let Some(bytes) = input.get(2..10) else {
                    return Ok(None);
                };
                let mut be = [0u8; 8];
                be.copy_from_slice(bytes);
                let len = u64::from_be_bytes(be);
                if len >> 63 != 0 {
                    return Err(Fault::violation(
                        "64-bit payload length with its top bit set",
                    ));
                }
                if len <= u64::from(u16::MAX) {
                    return Err(Fault::violation(
                        "payload length not in its shortest encoding",
                    ));
                }
                (len, 8)
            }
            short => (u64::from(short), 0),
        };
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        // The message's limit first: a frame too large for any message names the limit an
        // operator sets (`limits.max_message_bytes`), not the frame's.
        if !control {
            let size = self.message.len().saturating_add(len);
            if size > self.max_message {
                return Err(Fault::too_large(
                    "message",
                    "max_message_bytes",
                    size,
                    self.max_message,
                ));
            }
        }
        if len > self.max_frame {
            return Err(Fault::too_large(
                "frame",
                "max_frame_bytes",
                len,
                self.max_frame,
            ));
        }
        let header_len = 2 + ext + 4;
        let Some(&[k0, k1, k2, k3]) = input.get(2 + ext..header_len) else {
            return Ok(None);
        };
        let payload = Payload {
            opcode,
            fin,
            key: [k0, k1, k2, k3],
            offset: 0,
            remaining: len,
        };
        Ok(Some((header_len, payload)))
    }

    /// Reads control payload bytes; returns whether the frame is complete.
    fn read_control(&mut self, mut payload: Payload, input: &mut BytesMut) -> bool {
        let n = payload.remaining.min(input.len());
        self.control.extend_from_slice(&input[..n]);
        input.advance(n);
        payload.remaining -= n;
        if payload.remaining > 0 {
            self.frame = FrameState::Payload(payload);
            return false;
        }
        unmask(&mut self.control, payload.key, 0);
        true
    }

    fn on_control(&mut self, opcode: u8, out: &mut ProtocolOutput) -> Result<(), Fault> {
        let payload = std::mem::take(&mut self.control);
        match opcode {
            OP_PING => {
                if matches!(self.state, State::Open) {
                    put_frame(OP_PONG, &payload, &mut out.urgent);
                }
            }
            OP_PONG => out.events.push(Inbound::Pong),
            _ => {
                let (code, reason) = match *payload.as_slice() {
                    [] => (None, ""),
                    [_] => return Err(Fault::violation("close frame with a 1-byte payload")),
                    [hi, lo, ref reason @ ..] => {
                        let code = u16::from_be_bytes([hi, lo]);
                        if !is_valid_close_code(code) {
                            return Err(Fault::violation(format!("invalid close code {code}")));
                        }
                        let reason = std::str::from_utf8(reason)
                            .map_err(|_| Fault::invalid_utf8("the close reason"))?;
                        (Some(code), reason)
                    }
                };
                if matches!(self.state, State::Open) {
                    // Echo the peer's code (RFC 6455 section 5.5.1).
                    match code {
                        Some(code) => put_close(code, "", &mut out.urgent),
                        None => put_frame(OP_CLOSE, &[], &mut out.urgent),
                    }
                }
                out.events.push(Inbound::Close {
                    code: code.unwrap_or(close_code::NO_STATUS),
                    reason: reason.to_owned(),
                });
                self.state = State::Closed;
                self.release_message();
                return Ok(());
            }
        }
        // Keep the (small) allocation for the next control frame.
        self.control = payload;
        self.control.clear();
        Ok(())
    }

    /// Reads data payload bytes; returns whether the frame is complete.
    fn read_data(
        &mut self,
        mut payload: Payload,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<bool, Fault> {
        let text = self.message_opcode == Some(OP_TEXT);
        // Fast path: a whole unfragmented message is in `input`: unmask it in place, no copy.
        if payload.fin
            && payload.offset == 0
            && self.message.is_empty()
            && input.len() >= payload.remaining
        {
            let mut data = input.split_to(payload.remaining);
            unmask(&mut data, payload.key, 0);
            if text && std::str::from_utf8(&data).is_err() {
                return Err(Fault::invalid_utf8("a text message"));
            }
            self.message_opcode = None;
            let data = data.freeze();
            out.events.push(if text {
                Inbound::Text(data)
            } else {
                Inbound::Binary(data)
            });
            return Ok(true);
        }
        let n = payload.remaining.min(input.len());
        let start = self.message.len();
        self.message.extend_from_slice(&input[..n]);
        input.advance(n);
        unmask(&mut self.message[start..], payload.key, payload.offset);
        payload.offset += n;
        payload.remaining -= n;
        let complete = payload.remaining == 0;
        if text {
            self.check_utf8(complete && payload.fin)?;
        }
        if !complete {
            self.frame = FrameState::Payload(payload);
            return Ok(false);
        }
        if payload.fin {
            let data = self.message.split().freeze();
            out.events.push(if text {
                Inbound::Text(data)
            } else {
                Inbound::Binary(data)
            });
            self.message_opcode = None;
            self.utf8_checked = 0;
        }
        Ok(true)
    }

    /// Validates the text message's new bytes; an incomplete sequence at the end is an error
    /// only once the message is `complete`.
    fn check_utf8(&mut self, complete: bool) -> Result<(), Fault> {
        match std::str::from_utf8(&self.message[self.utf8_checked..]) {
            Ok(_) => self.utf8_checked = self.message.len(),
            Err(e) if e.error_len().is_none() && !complete => self.utf8_checked += e.valid_up_to(),
            Err(_) => return Err(Fault::invalid_utf8("a text message")),
        }
        Ok(())
    }

    fn release_message(&mut self) {
        self.message = BytesMut::new();
        self.message_opcode = None;
        self.utf8_checked = 0;
        self.control = Vec::new();
    }

    /// Reports `fault`: a close frame with its code (unless one was sent), then the error.
    fn fail(&mut self, fault: Fault, out: &mut ProtocolOutput) -> ProtocolError {
        if matches!(self.state, State::Open) {
            if let ProtocolError::TooLarge { limit_name, .. } = &fault.error {
                // Over a limit: the push protocol's error first, as on every transport, then
                // the close (1009).
                // The message is the error's text: sizes and option names, no quote or
                // backslash to escape.
                let error = format!(
                    "{{\"type\":\"error\",\"requestId\":null,\"code\":\"{}\",\"message\":\"{}\",\"limit\":\"{limit_name}\"}}",
                    codes::LIMIT_EXCEEDED,
                    fault.error.to_string().replace(['"', '\\'], "'"),
                );
                put_frame(OP_TEXT, error.as_bytes(), &mut out.urgent);
            }
            put_close(fault.code, &fault.error.to_string(), &mut out.urgent);
        }
        self.release_message();
        self.state = State::Failed(fault.error.clone());
        fault.error
    }
}

impl StreamProtocol for WebSocket {
    fn decode(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError> {
        match &self.state {
            State::Failed(error) => {
                input.clear();
                return Err(error.clone());
            }
            State::Closed => {
                input.clear();
                return Ok(());
            }
            State::Handshake { .. } => {
                if !self.decode_handshake(input, out)? {
                    return Ok(());
                }
            }
            State::Open | State::CloseSent => {}
        }
        self.decode_frames(input, out).map_err(|fault| {
            input.clear();
            self.fail(fault, out)
        })
    }

    /// A handshake cut short by the end of the stream is answered `400 Bad Request`; a frame or
    /// a fragmented message cut short is a violation, said with a close frame (1002), as
    /// for a broken frame.
    fn decode_end(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError> {
        let held = input.len();
        input.clear();
        match &self.state {
            State::Handshake { .. } if held > 0 => {
                let reason = format!(
                    "the stream ended inside the opening handshake ({held} of its bytes arrived)"
                );
                handshake::write_response(&mut out.urgent, 400, "Bad Request", "", &reason);
                let error = ProtocolError::Handshake(reason);
                self.state = State::Failed(error.clone());
                Err(error)
            }
            State::Open | State::CloseSent => {
                // (A payload's bytes are consumed as they arrive: nothing is held then.)
                let what = if let FrameState::Payload(payload) = self.frame {
                    format!(
                        "a frame ({} of its payload's bytes missing)",
                        payload.remaining
                    )
                } else if held > 0 {
                    format!("a frame header ({held} of its bytes arrived)")
                } else if self.message_opcode.is_some() {
                    format!(
                        "a fragmented message ({} of its bytes arrived, not its final frame)",
                        self.message.len()
                    )
                } else {
                    return Ok(());
                };
                let fault = Fault::violation(format!("the stream ended inside {what}"));
                Err(self.fail(fault, out))
            }
            _ => Ok(()),
        }
    }

    fn pending_message_bytes(&self) -> usize {
        self.message.len()
    }

    fn encode_text(&mut self, json: &[u8], out: &mut BytesMut) {
        if !self.closing() {
            put_frame(OP_TEXT, json, out);
        }
    }

    fn encode_binary(&mut self, frame: &[u8], out: &mut BytesMut) -> Result<(), ProtocolError> {
        if self.closing() {
            return Err(ProtocolError::Violation(
                "the websocket connection is closing: no data frame may follow a close frame"
                    .to_owned(),
            ));
        }
        put_frame(OP_BINARY, frame, out);
        Ok(())
    }

    fn encode_ping(&mut self, out: &mut BytesMut) -> bool {
        if matches!(self.state, State::Open) {
            put_frame(OP_PING, &[], out);
        }
        true
    }

    fn encode_close(&mut self, code: u16, reason: &str, out: &mut BytesMut) {
        if matches!(self.state, State::Open) {
            put_close(code, reason, out);
            self.state = State::CloseSent;
        }
    }

    /// Before the upgrade: an HTTP error response with `status` and `message` as its body (the
    /// connection closes after it); once upgraded there is nothing to refuse (the runtime sends
    /// a close frame instead).
    fn encode_refusal(&mut self, status: u16, message: &str, out: &mut BytesMut) -> bool {
        if !matches!(self.state, State::Handshake { .. }) {
            return false;
        }
        let text = handshake::refusal_text(status);
        handshake::write_response(out, status, text, "", message);
        self.state = State::Closed;
        true
    }

    fn is_ready(&self) -> bool {
        matches!(self.state, State::Open)
    }

    fn name(&self) -> &str {
        crate::NAME
    }
}
