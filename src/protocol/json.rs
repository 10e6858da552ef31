//! The JSON reader of the full command parser: one iterative pass over a line that validates
//! it and records where the members the server reads are.
//!
//! It is the one place where the rules for client JSON are written (docs/protocol.md, "What the
//! server accepts as JSON"):
//!
//! - **Nesting** deeper than the configured `max_json_depth` is refused before it is followed;
//!   the reader keeps an explicit stack bounded by that limit, so no input can recurse.
//! - **Strings** are valid JSON strings of Unicode scalar values: an escaped lone surrogate
//!   (`"\ud800"`, `"\udfff"`) is refused by name, as is a raw control character.
//! - **Keys** are compared as the strings they decode to (`"str\u0065am"` is `stream`); a
//!   member the server reads, given twice at a level it reads, is refused by name.
//! - **Numbers** are checked against the JSON grammar only: any length, any exponent. Where the
//!   server reads one (a request id), it keeps the text as written.
//!
//! The reader never panics: every index is bounds-checked.

use std::borrow::Cow;

/// The top-level members the server reads, in [`Doc::top`]'s order.
pub(crate) const TOP: [&str; 8] = [
    "type",
    "id",
    "requestId",
    "stream",
    "deviceId",
    "subscriptionId",
    "message",
    "token",
];
/// Index of `message` in [`TOP`].
pub(crate) const MESSAGE: usize = 6;
/// Index of `token` in [`TOP`].
pub(crate) const TOKEN: usize = 7;
/// The members of `message` the server reads, in [`Doc::head`]'s order.
/// (`id` and `requestId` mark a message the outbox never coalesces.)
pub(crate) const HEAD: [&str; 6] = [
    "type",
    "stream",
    "deviceId",
    "deviceSessionUuid",
    "id",
    "requestId",
];
/// The names of [`HEAD`]'s members as errors give them.
const HEAD_FIELDS: [&str; 6] = [
    "message.type",
    "message.stream",
    "message.deviceId",
    "message.deviceSessionUuid",
    "message.id",
    "message.requestId",
];

/// What a value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A string; `escaped` when it holds at least one escape.
    String {
        escaped: bool,
    },
    /// A number without fraction or exponent.
    Integer,
    /// Any other number.
    Number,
    Object,
    Array,
    Bool,
    Null,
}

/// One value's byte span in the line and what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Token {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) kind: Kind,
}

impl Token {
    /// The JSON type's name as errors give it.
    pub(crate) fn type_name(self) -> &'static str {
        match self.kind {
            Kind::String { .. } => "a string",
            Kind::Integer | Kind::Number => "a number",
            Kind::Object => "an object",
            Kind::Array => "an array",
            Kind::Bool => "a boolean",
            Kind::Null => "null",
        }
    }

    /// The decoded string, if the token is one (escapes resolved; the reader validated them).
    pub(crate) fn string(self, line: &[u8]) -> Option<Cow<'_, str>> {
        let Kind::String { escaped } = self.kind else {
            return None;
        };
        let inner = line.get(self.start + 1..self.end - 1)?;
        if escaped {
            decode(inner).map(Cow::Owned)
        } else {
            std::str::from_utf8(inner).ok().map(Cow::Borrowed)
        }
    }

    /// The value's text as written.
    pub(crate) fn text(self, line: &[u8]) -> &str {
        line.get(self.start..self.end)
            .and_then(|b| std::str::from_utf8(b).ok())
            .unwrap_or("")
    }
}

/// Where the members the server reads are: the first complete value of each (a repeat is an
/// error, noted while the line is read on to its end; the repeat's value is not kept).
#[derive(Debug, Default, Clone)]
pub(crate) struct Doc {
    /// The members of the command object, in [`TOP`]'s order.
    pub(crate) top: [Option<Token>; 8],
    /// The members of `message`, when it is an object, in [`HEAD`]'s order.
    pub(crate) head: [Option<Token>; 6],
    /// The first member of `message` of interest given twice (its name): an error of a
    /// `publish` only, the one command that reads them.
    pub(crate) head_repeated: Option<&'static str>,
}

/// Why a line is not a command the reader accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum JsonError {
    /// Not JSON, or not a JSON object: `what` was expected at byte `at`.
    Syntax { at: usize, what: &'static str },
    /// A container opens at byte `at` at nesting depth `limit + 1`.
    TooDeep { at: usize, limit: usize },
    /// An escape at byte `at` names half of a surrogate pair without the other half.
    LoneSurrogate { at: usize },
    /// A member the server reads is given twice at one level; the field's name.
    Duplicate { field: &'static str },
}

/// Which member of interest a value is, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Top(usize),
    Head(usize),
}

/// An open container: what it is, where it starts, and which member of interest it is.
#[derive(Debug, Clone, Copy)]
struct Open {
    object: bool,
    start: usize,
    slot: Option<Slot>,
}

/// Reads `line` as one JSON object nested at most `max_depth` deep (the object itself is depth
/// 1). Returns what it found, also when it fails (the members read before the error).
pub(crate) fn read(line: &[u8], max_depth: usize) -> (Doc, Result<(), JsonError>) {
    let mut r = Reader {
        b: line,
        i: 0,
        stack: Vec::new(),
        doc: Doc::default(),
        seen: [false; 8],
        seen_head: [false; 6],
        max_depth: max_depth.max(1),
        duplicate: None,
    };
    // A repeated member is still JSON: the line is read to its end (a later id is read, and a
    // later syntax error is the one reported), and the repeat is the error if there is no other.
    let result = r
        .run()
        .and_then(|()| r.duplicate.take().map_or(Ok(()), Err));
    (r.doc, result)
}

struct Reader<'a> {
    b: &'a [u8],
    i: usize,
    stack: Vec<Open>,
    doc: Doc,
    seen: [bool; 8],
    seen_head: [bool; 6],
    max_depth: usize,
    /// The first repeat of a member of interest (its first value is the one kept).
    duplicate: Option<JsonError>,
}

impl Reader<'_> {
    fn run(&mut self) -> Result<(), JsonError> {
        self.ws();
        if self.peek() != Some(b'{') {
            return Err(self.expected("a JSON object"));
        }
        // The member whose value is at the cursor, if it is one of interest.
        let mut slot = None;
        loop {
            // A value starts at the cursor.
            let start = self.i;
            let kind = match self.peek() {
                Some(open @ (b'{' | b'[')) => {
                    if self.stack.len() >= self.max_depth {
                        return Err(JsonError::TooDeep {
                            at: start,
                            limit: self.max_depth,
                        });
                    }
                    let object = open == b'{';
                    self.i += 1;
                    self.ws();
                    let close = if object { b'}' } else { b']' };
                    if self.peek() == Some(close) {
                        self.i += 1;
                        if object {
                            Kind::Object
                        } else {
                            Kind::Array
                        }
                    } else {
                        self.stack.push(Open {
                            object,
                            start,
                            slot,
                        });
                        if object {
                            slot = self.key()?;
                        } else {
                            slot = None;
                        }
                        continue;
                    }
                }
                Some(b'"') => self.string()?,
                Some(b't') => self.literal(b"true", Kind::Bool)?,
                Some(b'f') => self.literal(b"false", Kind::Bool)?,
                Some(b'n') => self.literal(b"null", Kind::Null)?,
                Some(b'-' | b'0'..=b'9') => self.number()?,
                _ => return Err(self.expected("a value")),
            };
            self.record(slot, start, kind);
            // After a complete value: close what it completes, then find the next value.
            loop {
                self.ws();
                let Some(open) = self.stack.last().copied() else {
                    if self.i != self.b.len() {
                        return Err(self.expected(
                            "the end of the command after the object (one object per line or message)",
                        ));
                    }
                    return Ok(());
                };
                let close = if open.object { b'}' } else { b']' };
                match self.peek() {
                    Some(b',') => {
                        self.i += 1;
                        self.ws();
                        slot = if open.object { self.key()? } else { None };
                        break;
                    }
                    Some(c) if c == close => {
                        self.i += 1;
                        self.stack.pop();
                        let kind = if open.object {
                            Kind::Object
                        } else {
                            Kind::Array
                        };
                        self.record(open.slot, open.start, kind);
                    }
                    _ if open.object => return Err(self.expected("`,` or `}`")),
                    _ => return Err(self.expected("`,` or `]`")),
                }
            }
        }
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn expected(&self, what: &'static str) -> JsonError {
        JsonError::Syntax { at: self.i, what }
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    fn record(&mut self, slot: Option<Slot>, start: usize, kind: Kind) {
        let token = Some(Token {
            start,
            end: self.i,
            kind,
        });
        match slot {
            Some(Slot::Top(k)) => self.doc.top[k] = token,
            Some(Slot::Head(k)) => self.doc.head[k] = token,
            None => {}
        }
    }

    /// Reads a member's key and its `:` (the cursor at the key), and says which member of
    /// interest it is; a repeat of one is noted as the error (see [`Reader::repeated`]).
    fn key(&mut self) -> Result<Option<Slot>, JsonError> {
        if self.peek() != Some(b'"') {
            return Err(self.expected("a string key"));
        }
        let start = self.i;
        let kind = self.string()?;
        let end = self.i;
        self.ws();
        if self.peek() != Some(b':') {
            return Err(self.expected("`:` after an object key"));
        }
        self.i += 1;
        self.ws();
        let level = self.stack.len();
        let in_message =
            level == 2 && self.stack[1].object && self.stack[1].slot == Some(Slot::Top(MESSAGE));
        if level != 1 && !in_message {
            return Ok(None);
        }
        let token = Token { start, end, kind };
        let Some(name) = token.string(self.b) else {
            return Ok(None);
        };
        if level == 1 {
            let Some(k) = TOP.iter().position(|&n| n == name) else {
                return Ok(None);
            };
            if std::mem::replace(&mut self.seen[k], true) {
                return Ok(self.repeated(TOP[k]));
            }
            Ok(Some(Slot::Top(k)))
        } else {
            let Some(k) = HEAD.iter().position(|&n| n == name) else {
                return Ok(None);
            };
            if std::mem::replace(&mut self.seen_head[k], true) {
                // Read as a member of no interest (its first value stays); the parser judges it.
                self.doc.head_repeated.get_or_insert(HEAD_FIELDS[k]);
                return Ok(None);
            }
            Ok(Some(Slot::Head(k)))
        }
    }

    /// A member of interest given again: noted (the first repeat is the error) and read as a
    /// member of no interest, so that its first value stays.
    fn repeated(&mut self, field: &'static str) -> Option<Slot> {
        self.duplicate.get_or_insert(JsonError::Duplicate { field });
        None
    }

    fn literal(&mut self, word: &[u8], kind: Kind) -> Result<Kind, JsonError> {
        if self.b.get(self.i..self.i + word.len()) != Some(word) {
            return Err(self.expected("a value"));
        }
        self.i += word.len();
        Ok(kind)
    }

    /// A string at the cursor: no raw control character, valid escapes, no lone surrogate.
    /// Long runs without a quote or backslash are skipped with `memchr` (a base64 image is one
    /// long string), their bytes checked for control characters in one vectorisable pass.
    fn string(&mut self) -> Result<Kind, JsonError> {
        let b = self.b;
        let mut j = self.i + 1;
        let mut escaped = false;
        while let Some(rest) = b.get(j..) {
            let Some(k) = memchr::memchr2(b'"', b'\\', rest) else {
                break;
            };
            if let Some(at) = rest[..k].iter().position(|&x| x < 0x20) {
                self.i = j + at;
                return Err(self.expected("an escape instead of a control character"));
            }
            j += k;
            if b[j] == b'"' {
                self.i = j + 1;
                return Ok(Kind::String { escaped });
            }
            escaped = true;
            j = self.escape(j)?;
        }
        // No closing quote; a control character before the end is the clearer error.
        let rest = b.get(j..).unwrap_or_default();
        self.i = j + rest.iter().position(|&x| x < 0x20).unwrap_or(rest.len());
        Err(self.expected("`\"` closing the string"))
    }

    /// The escape at `b[j] == b'\\'`; returns the index after it.
    fn escape(&mut self, j: usize) -> Result<usize, JsonError> {
        match self.b.get(j + 1) {
            Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Ok(j + 2),
            Some(b'u') => {
                let unit = self.hex4(j)?;
                match unit {
                    0xD800..=0xDBFF => {
                        let low = (self.b.get(j + 6) == Some(&b'\\')
                            && self.b.get(j + 7) == Some(&b'u'))
                        .then(|| self.hex4(j + 6))
                        .transpose()?;
                        match low {
                            Some(0xDC00..=0xDFFF) => Ok(j + 12),
                            _ => Err(JsonError::LoneSurrogate { at: j }),
                        }
                    }
                    0xDC00..=0xDFFF => Err(JsonError::LoneSurrogate { at: j }),
                    _ => Ok(j + 6),
                }
            }
            _ => {
                self.i = j;
                Err(self.expected("a valid escape (\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)"))
            }
        }
    }

    /// The four hex digits of the `\u` escape at `b[j]`.
    fn hex4(&mut self, j: usize) -> Result<u32, JsonError> {
        let digits = self
            .b
            .get(j + 2..j + 6)
            .and_then(|d| std::str::from_utf8(d).ok())
            .filter(|d| d.bytes().all(|c| c.is_ascii_hexdigit()))
            .and_then(|d| u32::from_str_radix(d, 16).ok());
        digits.ok_or_else(|| {
            self.i = j;
            self.expected("four hex digits after \\u")
        })
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, of any length.
    fn number(&mut self) -> Result<Kind, JsonError> {
        let b = self.b;
        let digits = |mut i: usize| {
            while b.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            i
        };
        let mut i = self.i;
        i += usize::from(b.get(i) == Some(&b'-'));
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => i = digits(i),
            _ => {
                self.i = i;
                return Err(self.expected("a digit"));
            }
        }
        let mut kind = Kind::Integer;
        if b.get(i) == Some(&b'.') {
            let end = digits(i + 1);
            if end == i + 1 {
                self.i = end;
                return Err(self.expected("a digit after `.`"));
            }
            i = end;
            kind = Kind::Number;
        }
        if let Some(b'e' | b'E') = b.get(i) {
            i += 1;
            if let Some(b'+' | b'-') = b.get(i) {
                i += 1;
            }
            let end = digits(i);
            if end == i {
                self.i = end;
                return Err(self.expected("a digit in the exponent"));
            }
            i = end;
            kind = Kind::Number;
        }
        self.i = i;
        Ok(kind)
    }
}

/// Decodes the inside of a string the reader validated (escapes resolved, surrogate pairs
/// joined).
fn decode(inner: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(inner).ok()?;
    let mut out = String::with_capacity(text.len());
    let mut chars = text.char_indices();
    while let Some((at, c)) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        let (_, e) = chars.next()?;
        out.push(match e {
            '"' => '"',
            '\\' => '\\',
            '/' => '/',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'u' => {
                let unit = |k: usize| u32::from_str_radix(text.get(k..k + 4)?, 16).ok();
                let high = unit(at + 2)?;
                for _ in 0..4 {
                    chars.next();
                }
                if (0xD800..0xDC00).contains(&high) {
                    let low = unit(at + 8)?;
                    for _ in 0..6 {
                        chars.next();
                    }
                    char::from_u32(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))?
                } else {
                    char::from_u32(high)?
                }
            }
            _ => return None,
        });
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(line: &str) -> Doc {
        let (doc, r) = read(line.as_bytes(), 128);
        assert_eq!(r, Ok(()), "{line}");
        doc
    }

    fn err(line: &str) -> JsonError {
        read(line.as_bytes(), 128).1.unwrap_err()
    }

    #[test]
    fn nesting_past_the_limit_is_refused_before_it_is_followed() {
        let nested = |n: usize| format!(r#"{{"x":{}1{}}}"#, "[".repeat(n), "]".repeat(n));
        ok(&nested(127));
        assert_eq!(
            err(&nested(128)),
            JsonError::TooDeep {
                at: 132,
                limit: 128
            }
        );
        // Deep enough to overflow any stack if it were followed recursively.
        let deep = nested(1_000_000);
        assert!(matches!(
            read(deep.as_bytes(), 128).1,
            Err(JsonError::TooDeep { limit: 128, .. })
        ));
        assert!(matches!(read(deep.as_bytes(), 2_000_000).1, Ok(())));
    }

    #[test]
    fn lone_surrogates_are_refused_and_pairs_decode() {
        assert_eq!(err(r#"{"s":"\ud800"}"#), JsonError::LoneSurrogate { at: 6 });
        assert_eq!(err(r#"{"s":"\udfff"}"#), JsonError::LoneSurrogate { at: 6 });
        assert_eq!(
            err(r#"{"s":"\ud800\u0041"}"#),
            JsonError::LoneSurrogate { at: 6 }
        );
        assert_eq!(
            err(r#"{"s":"\udc00\ud800"}"#),
            JsonError::LoneSurrogate { at: 6 }
        );
        let doc = ok(r#"{"stream":"\ud83d\ude00 \u00e9\n"}"#);
        let line = r#"{"stream":"\ud83d\ude00 \u00e9\n"}"#.as_bytes();
        assert_eq!(doc.top[3].unwrap().string(line).unwrap(), "😀 é\n");
    }

    #[test]
    fn keys_compare_as_decoded_strings_and_repeats_are_refused_where_read() {
        let line = r#"{"str\u0065am":"a"}"#;
        let doc = ok(line);
        assert_eq!(doc.top[3].unwrap().string(line.as_bytes()).unwrap(), "a");
        assert_eq!(
            err(r#"{"stream":"a","str\u0065am":"b"}"#),
            JsonError::Duplicate { field: "stream" }
        );
        // A repeat in the message is noted for the command to judge (only `publish` reads it).
        let doc = ok(r#"{"message":{"stream":"a","deviceId":"x","stream":"b"}}"#);
        assert_eq!(doc.head_repeated, Some("message.stream"));
        // Repeats the server does not read, or at levels it does not read, are JSON.
        ok(r#"{"x":1,"x":2,"message":{"y":[{"stream":1,"stream":2}],"y":0}}"#);
    }

    #[test]
    fn a_repeat_is_read_past_to_the_end_of_the_line() {
        // The members after it are read (the first value of the repeated one stays); a later
        // syntax error is the one reported, as the line is not JSON.
        let line = r#"{"stream":"a","stream":"b","id":"late"}"#;
        let (doc, result) = read(line.as_bytes(), 128);
        assert_eq!(result, Err(JsonError::Duplicate { field: "stream" }));
        assert_eq!(doc.top[1].unwrap().string(line.as_bytes()).unwrap(), "late");
        assert_eq!(doc.top[3].unwrap().string(line.as_bytes()).unwrap(), "a");
        let line = r#"{"message":{"stream":"a","stream":"b","type":"t"},"type":"publish"}"#;
        let (doc, result) = read(line.as_bytes(), 128);
        assert_eq!(result, Ok(()));
        assert_eq!(doc.head_repeated, Some("message.stream"));
        assert!(doc.top[0].is_some() && doc.head.iter().flatten().count() == 2);
        assert!(matches!(
            err(r#"{"stream":"a","stream":"b","id":}"#),
            JsonError::Syntax { .. }
        ));
    }

    #[test]
    fn every_valid_number_is_accepted() {
        let huge = format!(r#"{{"n":{}}}"#, "9".repeat(100_000));
        ok(&huge);
        for n in [
            "18446744073709551616",
            "1e999999",
            "-0",
            "0.5e-999",
            "1E+2",
            "123456789012345678901234567890",
        ] {
            ok(&format!(r#"{{"id":{n}}}"#));
        }
        for n in ["01", "1.", ".5", "-", "1e", "+1", "0x1", "1e+"] {
            assert!(
                matches!(err(&format!(r#"{{"id":{n}}}"#)), JsonError::Syntax { .. }),
                "{n}"
            );
        }
    }

    #[test]
    fn syntax_errors_say_what_was_expected_where() {
        assert_eq!(
            err(r#"{"a" 1}"#),
            JsonError::Syntax {
                at: 5,
                what: "`:` after an object key"
            }
        );
        assert_eq!(
            err("[1]"),
            JsonError::Syntax {
                at: 0,
                what: "a JSON object"
            }
        );
        assert!(matches!(
            err("{\"a\":\"x\u{1}\"}"),
            JsonError::Syntax { at: 7, .. }
        ));
        assert!(matches!(
            err(r#"{"a":1} x"#),
            JsonError::Syntax { at: 8, .. }
        ));
        assert!(matches!(
            err(r#"{"a":"\x"}"#),
            JsonError::Syntax { at: 6, .. }
        ));
        assert!(matches!(err(r#"{"a":[1,]}"#), JsonError::Syntax { .. }));
        assert!(matches!(err(r#"{"a":"#), JsonError::Syntax { .. }));
    }

    #[test]
    fn the_members_read_before_an_error_are_kept() {
        let (doc, r) = read(br#"{"id":7,"type":"publish","message":{"stream":"s","#, 128);
        assert!(r.is_err());
        assert_eq!(doc.top[1].unwrap().text(br#"{"id":7"#), "7");
        assert!(doc.top[MESSAGE].is_none());
    }
}
