//! NDJSON push transport for powerhub: one JSON message per line, over TCP or Unix sockets.
//!
//! The plugin is sans-IO: [`NdjsonProtocol`] splits inbound bytes into lines and frames outbound
//! JSON messages by appending `\n`; the runtime owns the socket. A line is one JSON message;
//! `\r\n` endings are accepted, empty lines are ignored, and a last line the peer ends its stream
//! on without a newline is read as a line. A line longer than
//! [`ProtocolLimits::max_message_bytes`] (counting the bytes seen so far, so an endless line is
//! refused without buffering it) is a [`ProtocolError::TooLarge`]: the protocol puts a final
//! `error` line naming the limit into [`ProtocolOutput::urgent`] and the runtime closes.
//!
//! # Examples
//!
//! ```
//! use powerhub_ndjson::NdjsonFactory;
//! use powerhub_plugin::{BytesMut, Inbound, ProtocolFactory, ProtocolLimits, ProtocolOutput};
//!
//! let mut proto = NdjsonFactory.new_connection(&ProtocolLimits::default());
//! let mut input = BytesMut::from(&b"{\"type\":\"ping\"}\r\n\n{\"type\":\"po"[..]);
//! let mut out = ProtocolOutput::default();
//! proto.decode(&mut input, &mut out).unwrap();
//! assert_eq!(out.events, vec![Inbound::Text(r#"{"type":"ping"}"#.into())]);
//! assert_eq!(&input[..], b"{\"type\":\"po"); // the partial line stays
//!
//! let mut wire = BytesMut::new();
//! proto.encode_text(br#"{"type":"pong"}"#, &mut wire);
//! assert_eq!(&wire[..], b"{\"type\":\"pong\"}\n");
//! ```

use powerhub_plugin::codes;
use powerhub_plugin::{
    Bytes, BytesMut, Inbound, ProtocolError, ProtocolFactory, ProtocolLimits, ProtocolOutput,
    StreamProtocol,
};

/// The name the protocol is registered under: `ndjson`.
pub const NAME: &str = "ndjson";

/// Builds an [`NdjsonProtocol`] per connection.
#[derive(Debug, Default, Clone, Copy)]
pub struct NdjsonFactory;

impl ProtocolFactory for NdjsonFactory {
    fn name(&self) -> &str {
        NAME
    }

    fn new_connection(&self, limits: &ProtocolLimits) -> Box<dyn StreamProtocol> {
        Box::new(NdjsonProtocol::new(limits.max_message_bytes))
    }
}

/// The NDJSON framing state of one connection.
#[derive(Debug, Clone)]
pub struct NdjsonProtocol {
    max_line: usize,
    /// Bytes at the front of the input already scanned for a newline (none found).
    scanned: usize,
}

impl NdjsonProtocol {
    /// A protocol that refuses lines longer than `max_line` bytes (newline excluded).
    pub fn new(max_line: usize) -> Self {
        NdjsonProtocol {
            max_line,
            scanned: 0,
        }
    }
}

impl NdjsonProtocol {
    /// Adds one line (without its `\n`) as a message: a `\r` before the newline is dropped, a
    /// blank line is skipped, a line over the limit is the error.
    fn push_line(&self, mut line: Bytes, out: &mut ProtocolOutput) -> Result<(), ProtocolError> {
        if line.last() == Some(&b'\r') {
            line.truncate(line.len() - 1);
        }
        if line.len() > self.max_line {
            return Err(self.too_large(line.len(), out));
        }
        if !line.iter().all(u8::is_ascii_whitespace) {
            out.events.push(Inbound::Text(line));
        }
        Ok(())
    }

    /// [`StreamProtocol::decode`], and with `runs` [`StreamProtocol::decode_runs`].
    fn decode_lines(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
        runs: bool,
    ) -> Result<(), ProtocolError> {
        // A caller that handed a shorter buffer than last time restarts the scan.
        self.scanned = self.scanned.min(input.len());
        let last = memchr::memrchr(b'\n', &input[self.scanned..]).map(|p| p + self.scanned);
        if let Some(last) = last {
            self.scanned = 0;
            let lines = input.split_to(last + 1).freeze();
            // One byte of slack for a `\r` before a newline: no line of a run this short is
            // over the limit, so the run is one event, read line by line by the caller.
            if runs && lines.len() <= self.max_line + 1 {
                if !lines.iter().all(u8::is_ascii_whitespace) {
                    out.events.push(Inbound::Lines(lines));
                }
            } else {
                // Every complete line at once: split off the input once and sliced (a
                // reference count each, not a split each), their events reserved at once (the
                // list is not grown step by step for a receive of a thousand lines): as many
                // as lines of the first one's length would make, and no more than one per 16
                // bytes.
                let first = memchr::memchr(b'\n', &lines).map_or(lines.len(), |p| p + 1);
                out.events
                    .reserve((lines.len() / first).min(lines.len() / 16));
                let mut start = 0;
                for end in memchr::memchr_iter(b'\n', &lines) {
                    self.push_line(lines.slice(start..end), out)?;
                    start = end + 1;
                }
            }
        }
        // What is left is a partial line.
        self.scanned = input.len();
        if input.len() > self.max_line + 1 {
            return Err(self.too_large(input.len(), out));
        }
        Ok(())
    }

    /// A line of at least `size` bytes is over the limit: the error, its final line queued.
    fn too_large(&self, size: usize, out: &mut ProtocolOutput) -> ProtocolError {
        let err = ProtocolError::TooLarge {
            what: "line",
            limit_name: "max_message_bytes",
            size,
            limit: self.max_line,
        };
        final_error(&err, &mut out.urgent);
        err
    }
}

impl StreamProtocol for NdjsonProtocol {
    fn decode(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError> {
        self.decode_lines(input, out, false)
    }

    /// Every complete line as one [`Inbound::Lines`] when no line in it can be over the limit.
    fn decode_runs(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError> {
        self.decode_lines(input, out, true)
    }

    /// A last line without its newline is a line: a client that writes its last command and
    /// ends its stream (`printf '…' | nc`) is answered as if the newline had come.
    fn decode_end(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError> {
        self.scanned = 0;
        if input.is_empty() {
            return Ok(());
        }
        let line = input.split().freeze();
        self.push_line(line, out)
    }

    fn encode_text(&mut self, json: &[u8], out: &mut BytesMut) {
        out.reserve(json.len() + 1);
        out.extend_from_slice(json);
        out.extend_from_slice(b"\n");
    }

    fn name(&self) -> &str {
        NAME
    }
}

/// Appends the final `error` line sent before closing: the push protocol's `error` message, with
/// a `limit` field naming the limit when one was exceeded.
fn final_error(err: &ProtocolError, out: &mut BytesMut) {
    let message = json_string(&err.to_string());
    let line = match err {
        ProtocolError::TooLarge { limit_name, .. } => format!(
            "{{\"type\":\"error\",\"requestId\":null,\"code\":\"{code}\",\"message\":{message},\"limit\":\"{limit_name}\"}}\n",
            code = codes::LIMIT_EXCEEDED
        ),
        _ => format!(
            "{{\"type\":\"error\",\"requestId\":null,\"code\":\"{code}\",\"message\":{message}}}\n",
            code = codes::FATAL
        ),
    };
    out.extend_from_slice(line.as_bytes());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(
        p: &mut NdjsonProtocol,
        chunks: &[&[u8]],
    ) -> (Vec<Inbound>, Result<(), ProtocolError>) {
        let mut input = BytesMut::new();
        let mut out = ProtocolOutput::default();
        for c in chunks {
            input.extend_from_slice(c);
            if let Err(e) = p.decode(&mut input, &mut out) {
                return (out.events, Err(e));
            }
        }
        (out.events, Ok(()))
    }

    #[test]
    fn lines_split_across_reads_are_reassembled() {
        let mut p = NdjsonProtocol::new(100);
        let (events, r) = decode_all(&mut p, &[b"{\"a\"", b":1}\n{\"b\":2", b"}\n"]);
        r.unwrap();
        assert_eq!(
            events,
            vec![
                Inbound::Text("{\"a\":1}".into()),
                Inbound::Text("{\"b\":2}".into())
            ]
        );
    }

    #[test]
    fn line_over_max_message_bytes_is_too_large_with_final_error() {
        let mut p = NdjsonProtocol::new(8);
        let mut input = BytesMut::from(&b"0123456789"[..]);
        let mut out = ProtocolOutput::default();
        let err = p.decode(&mut input, &mut out).unwrap_err();
        assert!(matches!(
            err,
            ProtocolError::TooLarge {
                limit_name: "max_message_bytes",
                limit: 8,
                ..
            }
        ));
        let line = std::str::from_utf8(&out.urgent).unwrap();
        assert!(line.contains(r#""limit":"max_message_bytes""#), "{line}");
        assert!(line.ends_with("}\n"), "{line}");
        // A complete but long line too.
        let mut p = NdjsonProtocol::new(4);
        let (_, r) = decode_all(&mut p, &[b"123456\n"]);
        assert!(r.is_err());
    }

    /// For the runtime, the complete lines of a receive are one run when none of them can be
    /// over the limit; a run of only blank lines is nothing; past the limit each line is an
    /// event of its own, and the long one the error after the lines before it.
    #[test]
    fn complete_lines_within_the_limit_are_one_run_and_a_long_one_its_error_after_those_before() {
        let mut p = NdjsonProtocol::new(12);
        let mut out = ProtocolOutput::default();
        let mut input = BytesMut::from(&b"{\"a\":1}\r\n\n{\"b\""[..]);
        p.decode_runs(&mut input, &mut out).unwrap();
        assert_eq!(out.events, vec![Inbound::Lines("{\"a\":1}\r\n\n".into())]);
        assert_eq!(&input[..], b"{\"b\"");

        out.events.clear();
        p.decode_runs(&mut BytesMut::from(&b" \r\n\n"[..]), &mut out)
            .unwrap();
        assert!(out.events.is_empty(), "{:?}", out.events);

        let mut input = BytesMut::from(&b"{\"a\":1}\n0123456789abcdef\n{\"c\":3}\n"[..]);
        let err = p.decode_runs(&mut input, &mut out).unwrap_err();
        assert!(
            matches!(err, ProtocolError::TooLarge { limit: 12, .. }),
            "{err}"
        );
        assert_eq!(out.events, vec![Inbound::Text("{\"a\":1}".into())]);
    }

    #[test]
    fn a_last_line_without_its_newline_is_a_line_at_the_end_of_stream() {
        let mut p = NdjsonProtocol::new(8);
        let mut out = ProtocolOutput::default();
        for (left, event) in [
            (&b"{\"a\":1}\r"[..], Some("{\"a\":1}")),
            (b"  \t", None),
            (b"", None),
        ] {
            let mut input = BytesMut::from(left);
            p.decode(&mut input, &mut out).unwrap();
            p.decode_end(&mut input, &mut out).unwrap();
            assert!(input.is_empty());
            let want: Vec<Inbound> = event.map(|e| Inbound::Text(e.into())).into_iter().collect();
            assert_eq!(out.events, want);
            out.clear();
        }
        // Over the limit at the end too (the limit's slack is for a `\r`).
        let mut input = BytesMut::from(&b"123456789"[..]);
        p.decode(&mut input, &mut out).unwrap();
        let err = p.decode_end(&mut input, &mut out).unwrap_err();
        assert!(
            matches!(err, ProtocolError::TooLarge { limit: 8, .. }),
            "{err}"
        );
        assert!(out.urgent.ends_with(b"}\n"));
    }

    #[test]
    fn line_of_exactly_the_limit_is_accepted() {
        let mut p = NdjsonProtocol::new(4);
        let (events, r) = decode_all(&mut p, &[b"1234", b"\n"]);
        r.unwrap();
        assert_eq!(events, vec![Inbound::Text("1234".into())]);
    }

    #[test]
    fn one_receive_of_many_lines_gives_each_in_order_and_keeps_the_partial_one() {
        let mut p = NdjsonProtocol::new(100);
        let mut input = BytesMut::new();
        for n in 0..1000 {
            input.extend_from_slice(format!("{{\"n\":{n}}}\n").as_bytes());
            if n % 7 == 0 {
                // Blank lines and a CRLF end.
                input.extend_from_slice(b" \r\n\n{\"crlf\":1}\r\n");
            }
        }
        input.extend_from_slice(b"{\"part");
        let mut out = ProtocolOutput::default();
        p.decode(&mut input, &mut out).unwrap();
        let mut want = Vec::new();
        for n in 0..1000 {
            want.push(Inbound::Text(format!("{{\"n\":{n}}}").into()));
            if n % 7 == 0 {
                want.push(Inbound::Text("{\"crlf\":1}".into()));
            }
        }
        assert_eq!(out.events, want);
        assert_eq!(&input[..], b"{\"part");
        input.extend_from_slice(b"\":1}\n");
        out.clear();
        p.decode(&mut input, &mut out).unwrap();
        assert_eq!(out.events, vec![Inbound::Text("{\"part\":1}".into())]);
        assert!(input.is_empty());
    }

    #[test]
    fn a_long_line_among_short_ones_is_too_large_after_the_lines_before_it() {
        let mut p = NdjsonProtocol::new(8);
        let mut input = BytesMut::from(&b"{\"a\":1}\n0123456789\n{\"b\":2}\n"[..]);
        let mut out = ProtocolOutput::default();
        let err = p.decode(&mut input, &mut out).unwrap_err();
        assert!(
            matches!(
                err,
                ProtocolError::TooLarge {
                    size: 10,
                    limit: 8,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(out.events, vec![Inbound::Text("{\"a\":1}".into())]);
    }
}
