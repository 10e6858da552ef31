//! RFC 6455 section 5 framing: opcodes, headers, masking, close codes.

use bytes::{BufMut, BytesMut};

pub(crate) const OP_CONTINUATION: u8 = 0x0;
pub(crate) const OP_TEXT: u8 = 0x1;
pub(crate) const OP_BINARY: u8 = 0x2;
pub(crate) const OP_CLOSE: u8 = 0x8;
pub(crate) const OP_PING: u8 = 0x9;
pub(crate) const OP_PONG: u8 = 0xA;

/// Largest payload of a control frame (RFC 6455 section 5.5).
pub(crate) const MAX_CONTROL_PAYLOAD: usize = 125;

/// Close status codes this crate sends (RFC 6455 section 7.4.1).
pub mod close_code {
    /// Normal closure.
    pub const NORMAL: u16 = 1000;
    /// The endpoint is going away (server shutdown).
    pub const GOING_AWAY: u16 = 1001;
    /// The peer broke the protocol.
    pub const PROTOCOL_ERROR: u16 = 1002;
    /// No status code was present in the peer's close frame (never sent on the wire).
    pub const NO_STATUS: u16 = 1005;
    /// A text message was not valid UTF-8.
    pub const INVALID_PAYLOAD: u16 = 1007;
    /// The endpoint closes for a policy reason (e.g. a slow consumer).
    pub const POLICY: u16 = 1008;
    /// A frame or message exceeded a size limit.
    pub const TOO_BIG: u16 = 1009;
    /// The server hit an unexpected condition.
    pub const INTERNAL_ERROR: u16 = 1011;
}

/// Whether `code` may appear in a close frame on the wire (RFC 6455 section 7.4 and the IANA
/// registry): 1000–1003, 1007–1014 and 3000–4999.
///
/// ```
/// use powerhub_websocket::is_valid_close_code;
/// assert!(is_valid_close_code(1000));
/// assert!(!is_valid_close_code(1005));
/// assert!(is_valid_close_code(4000));
/// ```
pub fn is_valid_close_code(code: u16) -> bool {
    matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999)
}

/// The header of one unmasked server frame, for a write path that sends the header and a shared
/// payload with one vectored write instead of copying the payload.
///
/// ```
/// use powerhub_websocket::ServerFrameHeader;
///
/// let header = ServerFrameHeader::binary(300);
/// assert_eq!(header.as_bytes(), &[0x82, 126, 0x01, 0x2c]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerFrameHeader {
    bytes: [u8; 10],
    len: u8,
}

impl ServerFrameHeader {
    fn new(opcode: u8, payload_len: usize) -> Self {
        let mut bytes = [0u8; 10];
        bytes[0] = 0x80 | opcode;
        let len = if payload_len < 126 {
            bytes[1] = payload_len as u8;
            2
        } else if let Ok(short) = u16::try_from(payload_len) {
            bytes[1] = 126;
            bytes[2..4].copy_from_slice(&short.to_be_bytes());
            4
        } else {
            bytes[1] = 127;
            bytes[2..10].copy_from_slice(&(payload_len as u64).to_be_bytes());
            10
        };
        ServerFrameHeader { bytes, len }
    }

    /// The header of a final text frame carrying `payload_len` bytes.
    pub fn text(payload_len: usize) -> Self {
        Self::new(OP_TEXT, payload_len)
    }

    /// The header of a final binary frame carrying `payload_len` bytes.
    pub fn binary(payload_len: usize) -> Self {
        Self::new(OP_BINARY, payload_len)
    }

    /// The encoded header: 2, 4 or 10 bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

/// Appends one final, unmasked frame.
pub(crate) fn put_frame(opcode: u8, payload: &[u8], out: &mut BytesMut) {
    let header = ServerFrameHeader::new(opcode, payload.len());
    out.reserve(header.as_bytes().len() + payload.len());
    out.put_slice(header.as_bytes());
    out.put_slice(payload);
}

/// Appends a close frame with `code` and `reason` (cut at a character boundary to fit the
/// control-frame limit); a code that may not be sent gives a close frame without a body.
pub(crate) fn put_close(code: u16, reason: &str, out: &mut BytesMut) {
    if !is_valid_close_code(code) {
        put_frame(OP_CLOSE, &[], out);
        return;
    }
    let mut end = reason.len().min(MAX_CONTROL_PAYLOAD - 2);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut payload = [0u8; MAX_CONTROL_PAYLOAD];
    payload[..2].copy_from_slice(&code.to_be_bytes());
    payload[2..2 + end].copy_from_slice(&reason.as_bytes()[..end]);
    put_frame(OP_CLOSE, &payload[..2 + end], out);
}

/// XORs `buf` with the masking key, `offset` being the position of `buf[0]` in the payload.
pub(crate) fn unmask(buf: &mut [u8], key: [u8; 4], offset: usize) {
    let mut key = key;
    key.rotate_left(offset % 4);
    let wide = u64::from_ne_bytes([
        key[0], key[1], key[2], key[3], key[0], key[1], key[2], key[3],
    ]);
    let mut chunks = buf.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let word = u64::from_ne_bytes([
            chunk[0], chunk[1], chunk[2], chunk[3], chunk[4], chunk[5], chunk[6], chunk[7],
        ]) ^ wide;
        chunk.copy_from_slice(&word.to_ne_bytes());
    }
    // Whole chunks are 8 bytes long, so the key phase at the remainder is the same as at 0.
    for (i, byte) in chunks.into_remainder().iter_mut().enumerate() {
        *byte ^= key[i % 4];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_uses_minimal_length_encoding() {
        assert_eq!(ServerFrameHeader::text(125).as_bytes(), &[0x81, 125]);
        assert_eq!(
            ServerFrameHeader::text(126).as_bytes(),
            &[0x81, 126, 0, 126]
        );
        assert_eq!(
            ServerFrameHeader::text(65535).as_bytes(),
            &[0x81, 126, 0xff, 0xff]
        );
        assert_eq!(
            ServerFrameHeader::binary(65536).as_bytes(),
            &[0x82, 127, 0, 0, 0, 0, 0, 1, 0, 0]
        );
    }

    #[test]
    fn unmask_matches_bytewise_xor_at_every_offset() {
        let key = [0x12, 0x34, 0x56, 0x78];
        let data: Vec<u8> = (0..37u8).collect();
        for offset in 0..8 {
            let mut fast = data.clone();
            unmask(&mut fast, key, offset);
            let slow: Vec<u8> = data
                .iter()
                .enumerate()
                .map(|(i, b)| b ^ key[(i + offset) % 4])
                .collect();
            assert_eq!(fast, slow, "offset {offset}");
        }
    }

    #[test]
    fn close_reason_is_cut_at_a_char_boundary() {
        let mut out = BytesMut::new();
        let reason = "é".repeat(100);
        put_close(1000, &reason, &mut out);
        assert_eq!(out[1] as usize, out.len() - 2);
        assert!(out.len() - 2 <= MAX_CONTROL_PAYLOAD);
        assert!(std::str::from_utf8(&out[4..]).is_ok());
    }

    #[test]
    fn close_with_unsendable_code_has_no_body() {
        let mut out = BytesMut::new();
        put_close(1006, "abnormal", &mut out);
        assert_eq!(&out[..], &[0x88, 0]);
    }
}
