//! The binary hub frame: a small fixed header, then the payload.
//!
//! One frame carries one subscriber batch. Under the `json` codec the payload is a JSON array
//! with one element per message; under `raw` it is the bytes of exactly one message. The header
//! says how long the payload is, so a receiver reading a byte stream knows where every frame
//! ends, and how many messages it holds, so it knows where every message ends.
//!
//! # Layout
//!
//! All integers are little-endian. The header is [`HEADER_LEN`] = 12 bytes.
//!
//! ```text
//!  byte  0       1       2         3         4               8               12
//!       +-------+-------+---------+---------+---------------+---------------+--------------
//!       |  'P'  |  'H'  | version |  codec  | count (u32)   | length (u32)  | payload ...
//!       +-------+-------+---------+---------+---------------+---------------+--------------
//!        magic            = 1       1: json   messages in     payload bytes
//!                                   2: raw    the payload     after the header
//! ```
//!
//! - `magic` is `PH` (`0x50 0x48`); anything else is [`FrameError::BadMagic`].
//! - `version` is [`VERSION`]; a receiver rejects versions it does not know.
//! - `count` is the number of messages: the length of the JSON array, or exactly 1 for `raw`.
//! - `length` is the number of payload bytes that follow the header.
//!
//! Decoding never panics: a truncated or corrupt frame is a typed [`FrameError`].
//!
//! # Examples
//!
//! ```
//! use powerhub_plugin::frame::{self, FrameCodec};
//!
//! let frame = frame::encode_json_batch([&b"{\"a\":1}"[..], b"2"]).unwrap();
//! let decoded = frame::decode(&frame).unwrap();
//! assert_eq!(decoded.codec(), FrameCodec::Json);
//! assert_eq!(decoded.count(), 2);
//! let messages = decoded.json_messages().unwrap();
//! assert_eq!(messages, vec![&b"{\"a\":1}"[..], b"2"]);
//! ```

use bytes::{BufMut, Bytes, BytesMut};

/// The two magic bytes every frame starts with: `PH`.
pub const MAGIC: [u8; 2] = *b"PH";
/// The frame format version this crate writes and reads.
pub const VERSION: u8 = 1;
/// Length of the fixed header in bytes.
pub const HEADER_LEN: usize = 12;
/// Largest payload a frame can describe (the `length` field is a `u32`).
pub const MAX_PAYLOAD: usize = u32::MAX as usize;

/// How the payload of a frame is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameCodec {
    /// A JSON array, one element per message.
    Json,
    /// The bytes of exactly one message.
    Raw,
}

impl FrameCodec {
    /// The codec byte written in the header.
    pub fn to_byte(self) -> u8 {
        match self {
            FrameCodec::Json => 1,
            FrameCodec::Raw => 2,
        }
    }

    /// The codec for a header byte, if it is a known one.
    pub fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            1 => Some(FrameCodec::Json),
            2 => Some(FrameCodec::Raw),
            _ => None,
        }
    }
}

/// Why a frame could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Fewer bytes than the header or the header's `length` announce.
    #[error("truncated frame: {needed} bytes needed, {available} available")]
    Truncated {
        /// Bytes the frame needs in total (header, or header and payload).
        needed: usize,
        /// Bytes available.
        available: usize,
    },
    /// The frame does not start with `PH`.
    #[error("bad frame magic {:#04x} {:#04x}, expected \"PH\" (0x50 0x48)", .0[0], .0[1])]
    BadMagic([u8; 2]),
    /// The header's version is not [`VERSION`].
    #[error("unsupported frame version {0}, expected {VERSION}")]
    UnsupportedVersion(u8),
    /// The header's codec byte is neither json (1) nor raw (2).
    #[error("unknown frame codec byte {0}")]
    UnknownCodec(u8),
    /// A `raw` frame whose `count` is not 1.
    #[error("a raw frame carries exactly one message, the header says {0}")]
    RawCount(u32),
    /// A `json` payload that is not a JSON array.
    #[error("json frame payload is not a JSON array: {0}")]
    InvalidJson(String),
    /// The JSON array's length differs from the header's `count`.
    #[error("message count {header} in the frame header, {found} in the payload")]
    CountMismatch {
        /// The header's `count`.
        header: u32,
        /// Elements in the payload.
        found: usize,
    },
    /// Bytes follow the frame in a buffer that should hold exactly one frame.
    #[error("{0} bytes follow the frame")]
    TrailingBytes(usize),
    /// A payload, message count or frame exceeds what the format or a configured limit allows.
    #[error("frame {what} of {size} exceeds the limit {limit}")]
    TooLarge {
        /// What was too large: `payload` or `count`.
        what: &'static str,
        /// The size seen.
        size: usize,
        /// The limit.
        limit: usize,
    },
}

/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The payload codec.
    pub codec: FrameCodec,
    /// Messages in the payload.
    pub count: u32,
    /// Payload bytes after the header.
    pub length: u32,
}

impl Header {
    /// Parses the header at the front of `bytes` (which may hold more than the header).
    pub fn parse(bytes: &[u8]) -> Result<Header, FrameError> {
        let Some(head) = bytes.get(..HEADER_LEN) else {
            return Err(FrameError::Truncated {
                needed: HEADER_LEN,
                available: bytes.len(),
            });
        };
        if head[..2] != MAGIC {
            return Err(FrameError::BadMagic([head[0], head[1]]));
        }
        if head[2] != VERSION {
            return Err(FrameError::UnsupportedVersion(head[2]));
        }
        let codec = FrameCodec::from_byte(head[3]).ok_or(FrameError::UnknownCodec(head[3]))?;
        let count = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        let length = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if codec == FrameCodec::Raw && count != 1 {
            return Err(FrameError::RawCount(count));
        }
        Ok(Header {
            codec,
            count,
            length,
        })
    }

    /// Total frame length: header plus payload.
    pub fn frame_len(&self) -> usize {
        // A u32 length fits a usize on the 64-bit targets the engine runs on; saturating keeps a
        // 32-bit build from wrapping (such a frame then never completes and hits the size limit).
        HEADER_LEN.saturating_add(usize::try_from(self.length).unwrap_or(usize::MAX))
    }

    fn write(&self, out: &mut BytesMut) {
        out.put_slice(&MAGIC);
        out.put_u8(VERSION);
        out.put_u8(self.codec.to_byte());
        out.put_u32_le(self.count);
        out.put_u32_le(self.length);
    }
}

/// A decoded frame borrowing its payload from the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRef<'a> {
    header: Header,
    payload: &'a [u8],
}

impl<'a> FrameRef<'a> {
    /// The payload codec.
    pub fn codec(&self) -> FrameCodec {
        self.header.codec
    }

    /// Messages in the frame, as the header says.
    pub fn count(&self) -> u32 {
        self.header.count
    }

    /// The header.
    pub fn header(&self) -> Header {
        self.header
    }

    /// The payload bytes (the JSON array, or the raw message).
    pub fn payload(&self) -> &'a [u8] {
        self.payload
    }

    /// The messages of a `json` frame as slices of their JSON text, in order; a `raw` frame
    /// yields its one message. Checks that the element count matches the header.
    ///
    /// The array is split, not parsed: each element's extent is found by one iterative scan
    /// (strings skipped, open brackets kept on a stack), whatever its nesting, and each element
    /// is left to the reader of the messages to validate (the push protocol's command parser
    /// answers a bad one with a named error and the connection stays usable).
    pub fn json_messages(&self) -> Result<Vec<&'a [u8]>, FrameError> {
        if self.header.codec == FrameCodec::Raw {
            return Ok(vec![self.payload]);
        }
        let elements = split_json_array(self.payload).map_err(FrameError::InvalidJson)?;
        if elements.len() != self.header.count as usize {
            return Err(FrameError::CountMismatch {
                header: self.header.count,
                found: elements.len(),
            });
        }
        Ok(elements)
    }
}

/// The elements of the JSON array `json` as slices (surrounding whitespace trimmed), found by
/// one scan that keeps a stack of the open brackets and skips strings: no recursion, so any
/// nesting is split safely. An element's own validity is not checked; the array's punctuation is.
fn split_json_array(json: &[u8]) -> Result<Vec<&[u8]>, String> {
    let ws = |i: &mut usize| {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = json.get(*i) {
            *i += 1;
        }
    };
    let mut i = 0;
    ws(&mut i);
    if json.get(i) != Some(&b'[') {
        return Err(format!("expected `[` at byte {i}"));
    }
    i += 1;
    ws(&mut i);
    let mut elements = Vec::new();
    // The closers the current element's open brackets wait for, innermost last.
    let mut open = Vec::new();
    if json.get(i) == Some(&b']') {
        i += 1;
    } else {
        loop {
            let start = i;
            // The element runs to the `,` or `]` at depth 0 that follows it.
            loop {
                match json.get(i) {
                    None => return Err("unterminated array".to_owned()),
                    Some(b'"') => {
                        i += 1;
                        loop {
                            let rest = json.get(i..).unwrap_or_default();
                            let Some(k) = memchr::memchr2(b'"', b'\\', rest) else {
                                return Err(format!("unterminated string at byte {i}"));
                            };
                            i += k;
                            if json[i] == b'"' {
                                i += 1;
                                break;
                            }
                            i += 2;
                        }
                    }
                    Some(&c @ (b'[' | b'{')) => {
                        open.push(if c == b'[' { b']' } else { b'}' });
                        i += 1;
                    }
                    Some(&c @ (b']' | b'}')) if !open.is_empty() => {
                        let expected = open.pop().unwrap_or(c);
                        if c != expected {
                            return Err(format!(
                                "`{}` at byte {i} closes a bracket that `{}` should close",
                                c as char, expected as char
                            ));
                        }
                        i += 1;
                    }
                    Some(b',' | b']') if open.is_empty() => break,
                    Some(b'}') => return Err(format!("unexpected `}}` at byte {i}")),
                    Some(_) => i += 1,
                }
            }
            let mut end = i;
            while end > start && matches!(json[end - 1], b' ' | b'\t' | b'\n' | b'\r') {
                end -= 1;
            }
            if end == start {
                return Err(format!("expected an element at byte {start}"));
            }
            elements.push(&json[start..end]);
            let sep = json[i];
            i += 1;
            if sep == b']' {
                break;
            }
            ws(&mut i);
        }
    }
    ws(&mut i);
    if i != json.len() {
        return Err(format!("unexpected bytes after the array at byte {i}"));
    }
    Ok(elements)
}

/// Decodes the frame at the front of `bytes`, returning it and the number of bytes it spans.
/// Bytes after the frame are left alone (a byte-stream receiver decodes the next frame there).
pub fn decode_prefix(bytes: &[u8]) -> Result<(FrameRef<'_>, usize), FrameError> {
    let header = Header::parse(bytes)?;
    let total = header.frame_len();
    let Some(payload) = bytes.get(HEADER_LEN..total) else {
        return Err(FrameError::Truncated {
            needed: total,
            available: bytes.len(),
        });
    };
    Ok((FrameRef { header, payload }, total))
}

/// Decodes a buffer that holds exactly one frame.
pub fn decode(bytes: &[u8]) -> Result<FrameRef<'_>, FrameError> {
    let (frame, used) = decode_prefix(bytes)?;
    if used != bytes.len() {
        return Err(FrameError::TrailingBytes(bytes.len() - used));
    }
    Ok(frame)
}

/// Splits complete frames off the front of a growing byte-stream buffer.
///
/// Returns `Ok(None)` while the buffer holds only part of a frame; a frame whose announced
/// payload exceeds `max_payload` is rejected as soon as its header is read, so a corrupt or
/// hostile length never makes the receiver buffer without bound.
///
/// ```
/// use powerhub_plugin::frame;
/// use powerhub_plugin::BytesMut;
///
/// let one = frame::encode_raw(b"hello").unwrap();
/// let mut buf = BytesMut::from(&one[..5]);
/// assert!(frame::split_frame(&mut buf, 1024).unwrap().is_none());
/// buf.extend_from_slice(&one[5..]);
/// let whole = frame::split_frame(&mut buf, 1024).unwrap().unwrap();
/// assert_eq!(frame::decode(&whole).unwrap().payload(), b"hello");
/// assert!(buf.is_empty());
/// ```
pub fn split_frame(buf: &mut BytesMut, max_payload: usize) -> Result<Option<Bytes>, FrameError> {
    let header = match Header::parse(buf) {
        Ok(header) => header,
        Err(FrameError::Truncated { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    if header.length as usize > max_payload {
        return Err(FrameError::TooLarge {
            what: "payload",
            size: header.length as usize,
            limit: max_payload,
        });
    }
    if buf.len() < header.frame_len() {
        return Ok(None);
    }
    Ok(Some(buf.split_to(header.frame_len()).freeze()))
}

fn checked_header(codec: FrameCodec, count: usize, length: usize) -> Result<Header, FrameError> {
    let count = u32::try_from(count).map_err(|_| FrameError::TooLarge {
        what: "count",
        size: count,
        limit: u32::MAX as usize,
    })?;
    let length = u32::try_from(length).map_err(|_| FrameError::TooLarge {
        what: "payload",
        size: length,
        limit: MAX_PAYLOAD,
    })?;
    Ok(Header {
        codec,
        count,
        length,
    })
}

/// Encodes a `json` frame from messages that are each one valid JSON text.
///
/// The messages are not re-validated (the caller built them as JSON); the payload is
/// `[m1,m2,...]`.
pub fn encode_json_batch<'m, I>(messages: I) -> Result<Bytes, FrameError>
where
    I: IntoIterator<Item = &'m [u8]>,
    I::IntoIter: Clone,
{
    let iter = messages.into_iter();
    let (count, body) = iter
        .clone()
        .fold((0usize, 0usize), |(n, len), m| (n + 1, len + m.len()));
    // `[` + `]` + one comma between each pair.
    let length = body + 2 + count.saturating_sub(1);
    let header = checked_header(FrameCodec::Json, count, length)?;
    let mut out = BytesMut::with_capacity(HEADER_LEN + length);
    header.write(&mut out);
    out.put_u8(b'[');
    for (i, m) in iter.enumerate() {
        if i > 0 {
            out.put_u8(b',');
        }
        out.put_slice(m);
    }
    out.put_u8(b']');
    Ok(out.freeze())
}

/// Encodes a `raw` frame carrying exactly one message.
pub fn encode_raw(message: &[u8]) -> Result<Bytes, FrameError> {
    let header = checked_header(FrameCodec::Raw, 1, message.len())?;
    let mut out = BytesMut::with_capacity(HEADER_LEN + message.len());
    header.write(&mut out);
    out.put_slice(message);
    Ok(out.freeze())
}

/// Writes every `\n` and `\r` in `json` as a space, so the JSON text fits on one line.
///
/// In valid JSON a raw line break can only be whitespace (strings escape them), so this never
/// changes the text's meaning. Messages almost never hold one: the search is memchr's vectorised
/// scan, not a byte-by-byte rewrite.
///
/// ```
/// let mut json = *b"{\"a\":\r\n1}";
/// powerhub_plugin::frame::flatten_line_breaks(&mut json);
/// assert_eq!(&json, b"{\"a\":  1}");
/// ```
pub fn flatten_line_breaks(json: &mut [u8]) {
    let mut at = 0;
    while let Some(i) = memchr::memchr2(b'\n', b'\r', &json[at..]) {
        json[at + i] = b' ';
        at += i + 1;
    }
}

/// Encodes JSON messages as newline-delimited JSON: each message followed by `\n`, no header.
///
/// This is the push server's wire form. A JSON text can only hold a raw line break as
/// whitespace (inside strings it must be escaped), so line breaks in a message are written as
/// spaces, which keeps each message on its own line without changing its meaning.
///
/// ```
/// let out = powerhub_plugin::frame::encode_ndjson_batch([&b"{\"a\":\n1}"[..], b"2"]);
/// assert_eq!(&out[..], b"{\"a\": 1}\n2\n");
/// ```
pub fn encode_ndjson_batch<'m, I>(messages: I) -> Bytes
where
    I: IntoIterator<Item = &'m [u8]>,
    I::IntoIter: Clone,
{
    encode_ndjson(messages, true)
}

/// [`encode_ndjson_batch`] for messages known to be one line each (no raw line break, as the
/// push server's publish path leaves them): copied as they are, without the search for line
/// breaks. A message that does hold one breaks the stream's framing: use
/// [`encode_ndjson_batch`] for messages of unknown form.
///
/// ```
/// let out = powerhub_plugin::frame::encode_ndjson_lines([&b"{\"a\":1}"[..], b"2"]);
/// assert_eq!(&out[..], b"{\"a\":1}\n2\n");
/// ```
pub fn encode_ndjson_lines<'m, I>(messages: I) -> Bytes
where
    I: IntoIterator<Item = &'m [u8]>,
    I::IntoIter: Clone,
{
    encode_ndjson(messages, false)
}

fn encode_ndjson<'m, I>(messages: I, flatten: bool) -> Bytes
where
    I: IntoIterator<Item = &'m [u8]>,
    I::IntoIter: Clone,
{
    let iter = messages.into_iter();
    let length: usize = iter.clone().map(|m| m.len() + 1).sum();
    let mut out = BytesMut::with_capacity(length);
    for m in iter {
        let start = out.len();
        out.extend_from_slice(m);
        if flatten {
            flatten_line_breaks(&mut out[start..]);
        }
        out.extend_from_slice(b"\n");
    }
    out.freeze()
}

#[cfg(test)]
mod tests {
    /// A json frame's elements are split by one scan, not parsed: any nesting splits safely,
    /// and an element's own validity is the reader's to judge.
    #[test]
    fn json_elements_are_split_without_recursion_whatever_their_nesting() {
        let deep = format!(
            r#"{{"type":"ping","x":{}{}}}"#,
            "[".repeat(200_000),
            "]".repeat(200_000)
        );
        let payload = format!(r#" [ {deep} , "a,]\"}}" ,{{"b":[1,{{}}]}}, 7 ] "#);
        let elements = split_json_array(payload.as_bytes()).unwrap();
        assert_eq!(
            elements,
            vec![deep.as_bytes(), br#""a,]\"}""#, br#"{"b":[1,{}]}"#, b"7"]
        );
        assert_eq!(split_json_array(b"[]").unwrap(), Vec::<&[u8]>::new());
        assert_eq!(split_json_array(b" [ ] ").unwrap(), Vec::<&[u8]>::new());
        for bad in [
            &b"{}"[..],
            b"[1,]",
            b"[,1]",
            b"[1",
            b"[\"a",
            b"[1]x",
            b"[}]",
            b"[1 2]x",
            b"[[}]",
            br#"[{"x":]"#,
        ] {
            assert!(
                split_json_array(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // A bracket closed by the other kind is named where it is.
        assert_eq!(
            split_json_array(br#"[{"type":"ping","id":1},{"x":]"#).unwrap_err(),
            "`]` at byte 29 closes a bracket that `}` should close"
        );
    }

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ndjson_batch_writes_every_line_break_in_a_message_as_a_space() {
        let out = encode_ndjson_batch([&b"{\r\n\"a\":\n\n1}"[..], b"\n[2]\r"]);
        assert_eq!(&out[..], b"{  \"a\":  1}\n [2] \n");
    }

    #[test]
    fn json_round_trip_keeps_message_boundaries() {
        let msgs: [&[u8]; 3] = [b"{\"a\":[1,2]}", b"\"x,y\"", b"null"];
        let f = encode_json_batch(msgs).unwrap();
        let d = decode(&f).unwrap();
        assert_eq!(d.count(), 3);
        assert_eq!(d.json_messages().unwrap(), msgs.to_vec());
    }

    #[test]
    fn empty_json_batch_is_an_empty_array() {
        let f = encode_json_batch(std::iter::empty::<&[u8]>()).unwrap();
        assert_eq!(decode(&f).unwrap().payload(), b"[]");
    }

    #[test]
    fn raw_round_trip() {
        let f = encode_raw(&[0, 1, 2, 255]).unwrap();
        let d = decode(&f).unwrap();
        assert_eq!(d.codec(), FrameCodec::Raw);
        assert_eq!(d.payload(), &[0, 1, 2, 255]);
        assert_eq!(d.json_messages().unwrap(), vec![&[0u8, 1, 2, 255][..]]);
    }

    #[test]
    fn truncated_frame_is_an_error() {
        let f = encode_raw(b"hello").unwrap();
        for cut in 0..f.len() {
            assert!(
                matches!(decode(&f[..cut]), Err(FrameError::Truncated { .. })),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn corrupt_headers_are_typed_errors() {
        let f = encode_raw(b"x").unwrap();
        let mut bad = f.to_vec();
        bad[0] = b'X';
        assert!(matches!(decode(&bad), Err(FrameError::BadMagic(_))));
        let mut bad = f.to_vec();
        bad[2] = 9;
        assert_eq!(decode(&bad), Err(FrameError::UnsupportedVersion(9)));
        let mut bad = f.to_vec();
        bad[3] = 7;
        assert_eq!(decode(&bad), Err(FrameError::UnknownCodec(7)));
        let mut bad = f.to_vec();
        bad[4] = 2;
        assert_eq!(decode(&bad), Err(FrameError::RawCount(2)));
        let mut long = f.to_vec();
        long.push(0);
        assert_eq!(decode(&long), Err(FrameError::TrailingBytes(1)));
    }

    #[test]
    fn count_mismatch_is_detected() {
        let mut f = encode_json_batch([&b"1"[..], b"2"]).unwrap().to_vec();
        f[4] = 3;
        assert_eq!(
            decode(&f).unwrap().json_messages(),
            Err(FrameError::CountMismatch {
                header: 3,
                found: 2
            })
        );
    }

    #[test]
    fn bad_magic_is_named_in_hex() {
        let mut f = encode_raw(b"x").unwrap().to_vec();
        f[0] = b'X';
        f[1] = b'X';
        let err = decode(&f).unwrap_err();
        assert_eq!(err, FrameError::BadMagic(*b"XX"));
        assert_eq!(
            err.to_string(),
            r#"bad frame magic 0x58 0x58, expected "PH" (0x50 0x48)"#
        );
    }

    #[test]
    fn split_frame_rejects_oversized_length_early() {
        let f = encode_raw(&[7; 100]).unwrap();
        let mut buf = BytesMut::from(&f[..HEADER_LEN]);
        assert!(matches!(
            split_frame(&mut buf, 10),
            Err(FrameError::TooLarge { .. })
        ));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(frame) = decode(&bytes) {
                let _ = frame.json_messages();
            }
            let mut buf = BytesMut::from(&bytes[..]);
            let _ = split_frame(&mut buf, 1 << 16);
        }

        #[test]
        fn mutated_frames_never_panic(
            msgs in proptest::collection::vec(0u32..1000, 0..8),
            flips in proptest::collection::vec((0usize..256, any::<u8>()), 0..4),
            cut in 0usize..256,
        ) {
            let texts: Vec<String> = msgs.iter().map(|n| format!("{{\"n\":{n}}}")).collect();
            let f = encode_json_batch(texts.iter().map(|t| t.as_bytes())).unwrap();
            let decoded = decode(&f).unwrap().json_messages().unwrap();
            prop_assert_eq!(decoded.len(), texts.len());
            let mut bytes = f.to_vec();
            for (at, x) in flips {
                let i = at % bytes.len();
                bytes[i] ^= x;
            }
            bytes.truncate(cut.min(bytes.len()));
            if let Ok(frame) = decode(&bytes) {
                let _ = frame.json_messages();
            }
        }
    }
}
