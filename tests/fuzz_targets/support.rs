//! What several checks share: a seeded schedule, feeding a stream protocol in chunks, a JSON
//! validity test, and client and server sides of the wire formats.

use bytes::BytesMut;
use powerhub::plugin::{Inbound, ProtocolError, ProtocolOutput, StreamProtocol};

/// A small deterministic generator (SplitMix64): the schedule of a run (chunk sizes, how much
/// a socket takes, clock steps) comes from one input byte, so an input replays identically.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    /// The next 64 random bits.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// The size of the next receive: mostly small, sometimes large.
    pub(crate) fn chunk(&mut self) -> usize {
        match self.below(8) {
            0 => 1 + self.below(512),
            1 => 1,
            _ => 1 + self.below(24),
        }
    }

    /// The size of a socket receive for the push connection: mostly a few lines' worth (the
    /// codec checks split their input far finer).
    pub(crate) fn receive(&mut self) -> usize {
        match self.below(8) {
            0 => 1 + self.below(8),
            1 | 2 => 1 + self.below(1024),
            _ => 1 + self.below(128),
        }
    }
}

/// What feeding a stream protocol produced.
#[derive(Debug)]
pub(crate) struct Fed {
    pub(crate) events: Vec<Inbound>,
    pub(crate) urgent: Vec<u8>,
    /// The first error, after which nothing more was fed.
    pub(crate) result: Result<(), ProtocolError>,
    /// The input left undecoded.
    pub(crate) rest: Vec<u8>,
}

/// Feeds `data` to `proto` as the runtime does (appending each receive to one buffer and
/// decoding), in receives of the sizes `sizes` yields (the rest at once when it ends), and
/// stops at the first error.
pub(crate) fn feed<P: StreamProtocol + ?Sized>(
    proto: &mut P,
    data: &[u8],
    mut sizes: impl FnMut() -> Option<usize>,
    mut after_each: impl FnMut(&P),
) -> Fed {
    let mut input = BytesMut::new();
    let mut out = ProtocolOutput::default();
    let mut fed = Fed {
        events: Vec::new(),
        urgent: Vec::new(),
        result: Ok(()),
        rest: Vec::new(),
    };
    let mut at = 0;
    while at < data.len() {
        let n = sizes().unwrap_or(usize::MAX).clamp(1, data.len() - at);
        input.extend_from_slice(&data[at..at + n]);
        at += n;
        out.clear();
        let result = proto.decode(&mut input, &mut out);
        fed.events.append(&mut out.events);
        fed.urgent.extend_from_slice(&out.urgent);
        after_each(proto);
        if result.is_err() {
            fed.result = result;
            break;
        }
    }
    fed.rest = input.to_vec();
    fed
}

/// Ends the stream after `fed` (fed to `proto`): what was left is read or refused, an error is
/// said in the protocol's urgent bytes (unless an earlier one was), and nothing stays buffered.
pub(crate) fn assert_ends_cleanly<P: StreamProtocol + ?Sized>(proto: &mut P, fed: &Fed) {
    let mut input = BytesMut::from(&fed.rest[..]);
    let mut out = ProtocolOutput::default();
    let result = proto.decode_end(&mut input, &mut out);
    assert!(input.is_empty(), "input left after the end of stream");
    match result {
        Ok(()) => assert!(
            out.urgent.is_empty(),
            "answered at the end of stream without an error"
        ),
        Err(e) => assert!(
            !out.urgent.is_empty() || fed.result.is_err(),
            "the end of stream's error was not said: {e}"
        ),
    }
}

/// Feeds `data` in one receive.
pub(crate) fn feed_whole(proto: &mut dyn StreamProtocol, data: &[u8]) -> Fed {
    feed(proto, data, || None, |_| {})
}

/// Inputs longer than this are not also fed one byte per receive (the chunked feeding still
/// has 1-byte receives): it keeps long inputs from slowing the fuzzer down.
pub(crate) const BYTEWISE_MAX: usize = 1024;

/// Feeds `data` one byte per receive.
pub(crate) fn feed_bytewise(proto: &mut dyn StreamProtocol, data: &[u8]) -> Fed {
    feed(proto, data, || Some(1), |_| {})
}

/// Feeds `data` in receives of sizes drawn from `rng`.
pub(crate) fn feed_chunked(proto: &mut dyn StreamProtocol, data: &[u8], rng: &mut Rng) -> Fed {
    feed(proto, data, || Some(rng.chunk()), |_| {})
}

/// Asserts that two feedings of the same bytes saw the same events, urgent bytes and outcome
/// (and, when both succeeded, left the same partial input).
pub(crate) fn assert_same(a: &Fed, b: &Fed, what: &str) {
    assert_eq!(a.result, b.result, "{what}: outcome");
    assert_eq!(a.events, b.events, "{what}: events");
    assert_eq!(a.urgent, b.urgent, "{what}: urgent bytes");
    if a.result.is_ok() {
        assert_eq!(a.rest, b.rest, "{what}: undecoded input");
    }
}

/// Whether `bytes` is one JSON text. A text nested deeper than serde_json's recursion limit
/// (128) counts as valid: the parsers under test accept deeper nesting, and this check is not
/// about depth.
pub(crate) fn is_json(bytes: &[u8]) -> bool {
    match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
        Ok(_) => true,
        Err(e) => e.to_string().starts_with("recursion limit exceeded"),
    }
}

/// Whether `bytes` is one JSON object (depth as in [`is_json`]).
pub(crate) fn is_json_object(bytes: &[u8]) -> bool {
    is_json(bytes) && bytes.trim_ascii_start().first() == Some(&b'{')
}

/// A valid opening handshake for the path `/`.
pub(crate) const HANDSHAKE: &[u8] = b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n\
Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";

/// Appends one client frame (masked with `key`, as RFC 6455 requires of clients).
pub(crate) fn client_frame(out: &mut Vec<u8>, fin: bool, opcode: u8, payload: &[u8], key: [u8; 4]) {
    out.push(if fin { 0x80 } else { 0 } | opcode);
    match payload.len() {
        n if n < 126 => out.push(0x80 | n as u8),
        n if n <= 0xffff => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(&key);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
}

/// One frame a server wrote.
#[derive(Debug)]
pub(crate) struct ServerFrame {
    pub(crate) fin: bool,
    pub(crate) opcode: u8,
    pub(crate) payload: Vec<u8>,
}

/// Parses server frames (unmasked, minimal length encoding, no reserved bits) and panics at
/// anything else; returns the frames and the length of a trailing partial frame.
pub(crate) fn server_frames(mut wire: &[u8]) -> (Vec<ServerFrame>, usize) {
    let mut frames = Vec::new();
    loop {
        let [b0, b1, ..] = *wire else {
            return (frames, wire.len());
        };
        assert_eq!(b0 & 0x70, 0, "reserved bits in a server frame");
        assert_eq!(b1 & 0x80, 0, "a server frame is masked");
        let (len, ext) = match b1 & 0x7f {
            126 => match wire.get(2..4) {
                Some(b) => {
                    let len = u16::from_be_bytes([b[0], b[1]]) as usize;
                    assert!(len >= 126, "server frame length not minimal");
                    (len, 2)
                }
                None => return (frames, wire.len()),
            },
            127 => match wire.get(2..10) {
                Some(b) => {
                    let mut be = [0u8; 8];
                    be.copy_from_slice(b);
                    let len = u64::from_be_bytes(be);
                    assert!(len > 0xffff, "server frame length not minimal");
                    (usize::try_from(len).expect("a length that fits"), 8)
                }
                None => return (frames, wire.len()),
            },
            n => (usize::from(n), 0),
        };
        let Some(payload) = wire.get(2 + ext..2 + ext + len) else {
            return (frames, wire.len());
        };
        frames.push(ServerFrame {
            fin: b0 & 0x80 != 0,
            opcode: b0 & 0x0f,
            payload: payload.to_vec(),
        });
        wire = &wire[2 + ext + len..];
    }
}

/// Checks one HTTP response the WebSocket plugin wrote (a refusal or the page): a status line,
/// headers ending in an empty line, and a body as long as its `Content-Length` (the page's
/// `HEAD` response has no body). Returns the status code.
pub(crate) fn check_http_response(response: &[u8]) -> u16 {
    let text = std::str::from_utf8(response).expect("an HTTP response is UTF-8");
    let (head, body) = text
        .split_once("\r\n\r\n")
        .expect("an HTTP response head ends in an empty line");
    let mut lines = head.split("\r\n");
    let status = lines.next().expect("a status line");
    let code = status
        .strip_prefix("HTTP/1.1 ")
        .and_then(|s| s.get(..3))
        .and_then(|s| s.parse::<u16>().ok())
        .unwrap_or_else(|| panic!("bad status line {status:?}"));
    let length = lines
        .filter_map(|l| l.strip_prefix("Content-Length: "))
        .map(|n| n.parse::<usize>().expect("a numeric Content-Length"))
        .next();
    match length {
        Some(n) => assert!(
            body.len() == n || (body.is_empty() && code == 200),
            "Content-Length {n}, body of {} bytes",
            body.len()
        ),
        None => assert_eq!(code, 101, "only the upgrade has no Content-Length"),
    }
    code
}
