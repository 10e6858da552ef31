//! The publish fast path: one pass over a line that validates it as JSON and reads the few
//! fields a `publish` needs, for the shape nearly every publish has.
//!
//! Anything else returns `None` and the full parser (simd-json plus the member scanner) takes
//! the line: another command, an escape in a key or in a field the server reads, a `\u` escape
//! anywhere, a repeated key the server reads, a number with more than 18 mantissa or 2 exponent
//! digits, nesting deeper than [`MAX_DEPTH`] (or the configured limit), and every error. So
//! errors and rare shapes have one implementation, and what this path accepts is a subset of
//! what the full parser accepts, with the same result: this module's property tests check that
//! against the full parser on generated and byte-mutated lines, and `tests/protocol_fuzz.rs`
//! checks the whole parser against serde_json.
//!
//! A line that starts as nearly every publish does, `{"type":"publish","message":`, is read from
//! its message on, those two members known without reading their names.
//!
//! The line need not be known to be UTF-8: the path takes only ASCII outside strings and checks
//! a string holding a byte above ASCII as UTF-8, so a line it accepts is UTF-8 (and one that is
//! not goes to the full parser, which names the offset). A short string ends at the next special
//! byte of the 64-byte block it starts in, found in the block's masks (32 bytes compared at a
//! time where the CPU has AVX2, else 16; once per block); a longer one is skipped a word at a
//! time, then 32 bytes a step in one pass where the CPU has AVX2 (a quote, backslash or control
//! character stops it; a byte above ASCII is noted), its last bytes with `memchr`, the skipped
//! bytes checked for control characters in one vectorisable pass.

use bytes::Bytes;

use super::command::{one_line, Command, PublishMeta, RequestId};
use crate::outbox::Field;

/// Nesting depth past which the fast path gives the line to the full parser (which refuses it
/// past the configured limit): the fast path recurses, at most this deep.
const MAX_DEPTH: usize = 64;

/// A `publish` command read in one pass, or `None` to use the full parser. `max_depth` is the
/// configured nesting limit: a line that nests deeper goes to the full parser, which refuses it.
pub(crate) fn publish(line: &[u8], max_depth: usize) -> Option<Command> {
    publish_ref(line, max_depth).map(|p| p.into_command())
}

/// A `publish` the fast path read, borrowed from its line: what the session checks and the
/// shard publishes, read with no allocation (a string request id aside). [`publish`] makes the
/// owned [`Command`] of it; the push connection uses it as it is.
#[derive(Debug)]
pub(crate) struct Publish<'a> {
    /// The command's correlation id.
    pub(crate) id: Option<RequestId>,
    /// The message's text, as written.
    message: &'a [u8],
    /// A raw line break was read as whitespace in the line: the message's copy flattens them.
    breaks: bool,
    /// `message.stream`.
    pub(crate) stream: &'a str,
    /// `message.type`.
    pub(crate) kind: &'a str,
    /// `message.deviceId`.
    device_id: FieldRef<'a>,
    /// `message.deviceSessionUuid`.
    session: FieldRef<'a>,
}

/// An optional string field, borrowed: absent, `null` or a string without escapes.
#[derive(Debug, Clone, Copy)]
enum FieldRef<'a> {
    Absent,
    Null,
    Str(&'a str),
}

impl FieldRef<'_> {
    fn to_field(self) -> Field {
        match self {
            FieldRef::Absent => Field::Absent,
            FieldRef::Null => Field::Null,
            FieldRef::Str(s) => Field::str(s),
        }
    }
}

impl Publish<'_> {
    /// `message.deviceId` when it is a string.
    pub(crate) fn device_id(&self) -> Option<&str> {
        match self.device_id {
            FieldRef::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The message's length in bytes (what rate limits count).
    pub(crate) fn message_len(&self) -> usize {
        self.message.len()
    }

    /// The message, as [`message_bytes`](Self::message_bytes), sliced from `owner` (the
    /// `Bytes` the line lies in) where no copy is needed: a [`Message`] made of the slice, not a
    /// copy of it. `owner` holds the line this was read from.
    ///
    /// [`Message`]: crate::hub::Message
    pub(crate) fn message_in(&self, owner: &Bytes) -> crate::hub::Message {
        if self.breaks {
            // Its line breaks are flattened in a copy.
            crate::hub::Message::json_validated(self.message_bytes())
        } else {
            crate::hub::Message::json_line_of_receive(owner.slice_ref(self.message))
        }
    }

    /// A copy of the message, one line whatever framing it arrived in (see [`one_line`]).
    pub(crate) fn message_bytes(&self) -> Bytes {
        // A string holds no raw line break: without one read as whitespace, a copy will do.
        if self.breaks {
            one_line(self.message)
        } else {
            Bytes::copy_from_slice(self.message)
        }
    }

    /// The owned command.
    pub(crate) fn into_command(self) -> Command {
        let message = self.message_bytes();
        Command::Publish {
            id: self.id,
            message,
            meta: PublishMeta {
                stream: self.stream.to_owned(),
                kind: self.kind.to_owned(),
                device_id: self.device_id.to_field(),
                device_session_uuid: self.session.to_field(),
            },
        }
    }
}

/// [`publish`], borrowed from the line.
pub(crate) fn publish_ref(line: &[u8], max_depth: usize) -> Option<Publish<'_>> {
    read(line, max_depth, None).map(|(publish, _)| publish)
}

/// A `publish` at the start of `lines` (an NDJSON run from a line's start) whose line ends
/// right after its object (with `\n` or `\r\n`): the publish, as [`publish_ref`] reads it from
/// that line, and where the line's newline is. The line's end is found by the read, not by a
/// search for the newline first.
///
/// Any other line is an error: `true` when [`publish_ref`] of the line alone (cut at its
/// newline) may still read it (whitespace after the object, or a line break read as
/// whitespace: the parse never goes on past a line's newline), `false` when it cannot (the
/// line is not a usual publish: the full parser's).
#[inline(always)]
pub(crate) fn publish_line(lines: &[u8], max_depth: usize) -> Result<(Publish<'_>, usize), bool> {
    let mut reread = false;
    read(lines, max_depth, Some(&mut reread)).ok_or(reread)
}

/// [`publish_ref`] of `line`, or with `in_run` [`publish_line`]'s (which it tells where the
/// line may be read alone): the publish and where the input it was read from ends (`line`'s
/// length, or the newline).
#[inline(always)]
fn read<'a>(
    line: &'a [u8],
    max_depth: usize,
    in_run: Option<&mut bool>,
) -> Option<(Publish<'a>, usize)> {
    // Offsets are kept in 32 bits (a smaller envelope to clear and move): a longer line, which
    // no limit lets through by default, is the full parser's.
    if u32::try_from(line.len()).is_err() {
        return None;
    }
    let mut p = Parser {
        b: line,
        i: 0,
        max_depth: MAX_DEPTH.min(max_depth),
        breaks: false,
        block: Block::NONE,
    };
    p.ws();
    let mut env = Envelope::default();
    let usual = line.get(p.i..p.i + USUAL_START.len()) == Some(USUAL_START);
    if usual {
        // The shape nearly every client writes: the type first, then the message. Read as the
        // loop below would read them, without comparing the names.
        env.members[TYPE] = Some(Token {
            start: (p.i + USUAL_TYPE.start) as u32,
            end: (p.i + USUAL_TYPE.end) as u32,
            kind: Kind::PlainString,
        });
        p.i += USUAL_START.len();
        p.ws();
        envelope_member(&mut p, MESSAGE, &mut env)?;
        if p.member_end()? {
            p.members(true, |p, key| envelope_key(p, key, &mut env))?;
        }
    } else {
        p.object(true, |p, key| envelope_key(p, key, &mut env))?;
    }
    let end = if let Some(reread) = in_run {
        // The line must end here; a line break read as whitespace means the read crossed into
        // another line.
        let newline = p.i + usize::from(line.get(p.i) == Some(&b'\r'));
        if p.breaks || line.get(newline) != Some(&b'\n') {
            *reread = true;
            return None;
        }
        newline
    } else {
        p.ws();
        if p.i != line.len() {
            return None;
        }
        p.i
    };
    let [kind, message, id, request_id, ..] = env.members;
    // The usual start's type is `publish` already.
    if !usual && kind?.plain_str(line)? != "publish" {
        return None;
    }
    let id = match (id, request_id) {
        // Most publishes carry no id.
        (None, None) => None,
        // Both names of the id: the full parser refuses it.
        (Some(_), Some(_)) => return None,
        (Some(t), None) | (None, Some(t)) => self::request_id(line, t)?,
    };
    let message = message?;
    let [head_kind, head_stream, head_device_id, head_session, ..] = env.head;
    let stream = head_stream?.plain_str(line)?;
    if stream.is_empty()
        || stream.len() > super::command::MAX_NAME_BYTES
        || stream.as_bytes().contains(&b'/')
    {
        return None;
    }
    let device_id = field(line, head_device_id)?;
    if let FieldRef::Str(d) = device_id {
        if d.is_empty() || d.len() > super::command::MAX_NAME_BYTES {
            return None;
        }
    }
    let publish = Publish {
        id,
        message: message.of(line),
        breaks: p.breaks,
        stream,
        kind: head_kind?.plain_str(line)?,
        device_id,
        session: field(line, head_session)?,
    };
    Some((publish, end))
}

/// An optional string field: absent, `null` or a string without escapes.
fn field(json: &[u8], token: Option<Token>) -> Option<FieldRef<'_>> {
    match token {
        None => Some(FieldRef::Absent),
        Some(t) if t.kind == Kind::Null => Some(FieldRef::Null),
        Some(t) => t.plain_str(json).map(FieldRef::Str),
    }
}

/// A request id: `null`, a string without escapes, or an integer that fits an `i64`.
/// `Some(None)` is "no id"; `None` sends the line to the full parser.
fn request_id(line: &[u8], t: Token) -> Option<Option<RequestId>> {
    match t.kind {
        Kind::Null => Some(None),
        Kind::PlainString => t
            .plain_str(line)
            .map(|s| Some(RequestId::Str(s.to_owned()))),
        Kind::Integer => {
            let text = std::str::from_utf8(t.of(line)).ok()?;
            // `-0` is an integer to some parsers and a float to others: leave it to the full one.
            if text == "-0" {
                return None;
            }
            text.parse::<i64>().ok().map(|n| Some(RequestId::Int(n)))
        }
        _ => None,
    }
}

/// The envelope's members the fast path reads, then those other commands read, where only a
/// repeat matters here (the full parser refuses it): the names of [`Envelope::members`].
const ENVELOPE: [&[u8]; 8] = [
    b"type",
    b"message",
    b"id",
    b"requestId",
    b"stream",
    b"deviceId",
    b"subscriptionId",
    b"token",
];
/// [`ENVELOPE`]'s index of the type.
const TYPE: usize = 0;
/// [`ENVELOPE`]'s index of the message.
const MESSAGE: usize = 1;
/// How nearly every publish line starts: its type, then its message's value.
const USUAL_START: &[u8] = br#"{"type":"publish","message":"#;
/// Where the type's value (with its quotes) is in [`USUAL_START`].
const USUAL_TYPE: std::ops::Range<usize> = 8..17;

/// Reads the envelope's member named `key`, its value at the cursor, into `env`.
#[inline(always)]
fn envelope_key<'a>(p: &mut Parser<'a>, key: &[u8], env: &mut Envelope) -> Option<()> {
    match named(key, &ENVELOPE) {
        Some(k) => envelope_member(p, k, env),
        None => p.value(1).map(drop),
    }
}

/// Reads the envelope's member `k` of [`ENVELOPE`], its value at the cursor, into `env`; a
/// member read before gives `None`.
#[inline(always)]
fn envelope_member(p: &mut Parser<'_>, k: usize, env: &mut Envelope) -> Option<()> {
    let slot = &mut env.members[k];
    if k == MESSAGE {
        // The message is read once: validated, and its head taken on the way.
        let head = &mut env.head;
        p.record(slot, |p| {
            p.head(head)?;
            Some(Kind::Object)
        })
    } else {
        p.record(slot, |p| p.value(1))
    }
}
/// The members of the message's own top level the server reads, then the ids the outbox reads
/// (a correlated message is never coalesced): the names of [`Envelope::head`].
const HEAD: [&[u8]; 6] = [
    b"type",
    b"stream",
    b"deviceId",
    b"deviceSessionUuid",
    b"id",
    b"requestId",
];

/// The members of a publish line the fast path reads or must see at most once.
#[derive(Default)]
struct Envelope {
    /// Named by [`ENVELOPE`].
    members: [Option<Token>; ENVELOPE.len()],
    /// Named by [`HEAD`].
    head: [Option<Token>; HEAD.len()],
}

/// Where `key` is in `names`. A key of one byte (no name read here is that short) is sent on
/// after one test; the others are compared in turn, the usual first (callgrind: fewer
/// instructions per publish than a `match` on the key).
#[inline(always)]
fn named(key: &[u8], names: &[&[u8]]) -> Option<usize> {
    if key.len() < 2 {
        return None;
    }
    names.iter().position(|name| *name == key)
}

/// One value's span and what it is (offsets fit 32 bits: [`publish`] checks the line's length).
#[derive(Debug, Clone, Copy)]
struct Token {
    start: u32,
    end: u32,
    kind: Kind,
}

impl Token {
    /// The value's text.
    fn of(self, json: &[u8]) -> &[u8] {
        &json[self.start as usize..self.end as usize]
    }

    /// The contents of a string without escapes.
    fn plain_str(self, json: &[u8]) -> Option<&str> {
        if self.kind != Kind::PlainString {
            return None;
        }
        let text = &json[self.start as usize + 1..self.end as usize - 1];
        debug_assert!(std::str::from_utf8(text).is_ok());
        // SAFETY: a string token's contents are UTF-8: `Parser::string` takes a string whose
        // bytes are all ASCII and `Parser::string_rest` checks one holding a byte above ASCII
        // with `str::from_utf8` before it returns the token (`json` is the line it read).
        Some(unsafe { std::str::from_utf8_unchecked(text) })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A string with no escape.
    PlainString,
    /// A string with at least one (simple) escape.
    String,
    /// A number without fraction or exponent.
    Integer,
    Number,
    Object,
    Array,
    Bool,
    Null,
}

#[derive(Clone, Copy)]
struct Parser<'a> {
    b: &'a [u8],
    i: usize,
    /// A container opening at `value(depth)` with `depth >= max_depth` gives up.
    max_depth: usize,
    /// A raw line break (`\n` or `\r`; a WebSocket text message may hold either, an NDJSON
    /// line only `\r`) was read as whitespace: only then does the message need its line breaks
    /// flattened.
    breaks: bool,
    /// The masks of the 64-byte block the last string started in.
    block: Block,
}

/// Where the quotes, backslashes, control characters and bytes above ASCII of one 64-byte block
/// of the line are (bit `k` for the block's byte `k`): one pass over the block finds where each
/// string in it ends, instead of a search per string that waits on the one before.
#[derive(Debug, Clone, Copy)]
struct Block {
    /// The block's first offset in the line (`usize::MAX`: none read yet).
    start: usize,
    /// Quotes, backslashes, control characters and bytes above ASCII: where a plain ASCII
    /// string stops.
    stop: u64,
    /// Quotes.
    quote: u64,
}

impl Block {
    const NONE: Block = Block {
        start: usize::MAX,
        stop: 0,
        quote: 0,
    };

    /// No bit set, where the mask functions start (`start` 0: set by [`Block::read`]).
    const MASKS: Block = Block {
        start: 0,
        stop: 0,
        quote: 0,
    };

    /// The masks of the block of `line` that starts at `start` (past the line's end, no bit is
    /// set).
    #[inline(never)]
    fn read(line: &[u8], start: usize) -> Block {
        let mut block = if let Some(bytes) = line.get(start..start + 64) {
            masks(bytes.try_into().expect("64 bytes"))
        } else if let Some(from) = line.len().checked_sub(64) {
            // The line's last 64 bytes, moved down to the block's start (`from < start`).
            let b = masks(line[from..].try_into().expect("64 bytes"));
            let shift = (start - from) as u32;
            let down = |m: u64| m.checked_shr(shift).unwrap_or(0);
            Block {
                start: 0,
                stop: down(b.stop),
                quote: down(b.quote),
            }
        } else {
            // A line shorter than a block: copied into one, padded with spaces.
            let mut padded = [b' '; 64];
            padded[..line.len()].copy_from_slice(line);
            masks(&padded)
        };
        block.start = start;
        block
    }
}

/// The masks of a block (its `start` left 0): 32 bytes compared at a time where the CPU has
/// AVX2, else 16.
#[cfg(target_arch = "x86_64")]
#[inline]
fn masks(block: &[u8; 64]) -> Block {
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { masks_avx2(block) };
    }
    masks_sse2(block)
}

/// [`masks`] on AVX2.
///
/// # Safety
///
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(unused_unsafe)]
unsafe fn masks_avx2(block: &[u8; 64]) -> Block {
    use std::arch::x86_64::{
        _mm256_cmpeq_epi8, _mm256_loadu_si256, _mm256_movemask_epi8, _mm256_or_si256,
        _mm256_set1_epi8,
    };
    let mut out = Block::MASKS;
    for (k, chunk) in block.chunks_exact(32).enumerate() {
        // SAFETY: AVX2 is enabled here and the CPU has it (this function's contract), and
        // `chunk` is 32 readable bytes (the load has no alignment requirement).
        let (stop, q) = unsafe {
            let x = _mm256_loadu_si256(chunk.as_ptr().cast());
            let quote = _mm256_cmpeq_epi8(x, _mm256_set1_epi8(b'"' as i8));
            // A byte above ASCII has its sign bit set: it stops a plain string too.
            (
                _mm256_movemask_epi8(_mm256_or_si256(plain_stops_avx2(x), x)),
                _mm256_movemask_epi8(quote),
            )
        };
        // The sign bits of the 32 lanes.
        out.stop |= u64::from(stop as u32) << (32 * k);
        out.quote |= u64::from(q as u32) << (32 * k);
    }
    out
}

/// [`masks`] on SSE2 (part of every x86_64 target).
#[cfg(target_arch = "x86_64")]
#[inline]
fn masks_sse2(block: &[u8; 64]) -> Block {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_loadu_si128, _mm_max_epu8, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8,
    };
    let mut out = Block::MASKS;
    for (k, chunk) in block.chunks_exact(16).enumerate() {
        // SAFETY: SSE2 is part of every x86_64 target, and `chunk` is 16 readable bytes (the
        // load has no alignment requirement).
        let (stop, q) = unsafe {
            let x = _mm_loadu_si128(chunk.as_ptr().cast());
            let quote = _mm_cmpeq_epi8(x, _mm_set1_epi8(b'"' as i8));
            let backslash = _mm_cmpeq_epi8(x, _mm_set1_epi8(b'\\' as i8));
            // Below 0x20 exactly when the unsigned maximum with 0x1f is 0x1f.
            let low = _mm_set1_epi8(0x1f);
            let control = _mm_cmpeq_epi8(_mm_max_epu8(x, low), low);
            // A byte above ASCII has its sign bit set: it stops a plain string too.
            let special = _mm_or_si128(_mm_or_si128(quote, backslash), control);
            (
                _mm_movemask_epi8(_mm_or_si128(special, x)),
                _mm_movemask_epi8(quote),
            )
        };
        // The sign bits of the 16 lanes: each mask fits 16 bits.
        out.stop |= u64::from(stop as u16) << (16 * k);
        out.quote |= u64::from(q as u16) << (16 * k);
    }
    out
}

/// The masks of a block (its `start` left 0).
#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn masks(block: &[u8; 64]) -> Block {
    let mut out = Block::MASKS;
    for (k, &c) in block.iter().enumerate() {
        out.stop |= u64::from(c == b'"' || c == b'\\' || c < 0x20 || c >= 0x80) << k;
        out.quote |= u64::from(c == b'"') << k;
    }
    out
}

impl<'a> Parser<'a> {
    /// Skips whitespace: nearly always none (one comparison), else [`ws_run`].
    #[inline]
    fn ws(&mut self) {
        if self.b.get(self.i).is_some_and(|&c| c <= b' ') {
            let (i, breaks) = ws_run(self.b, self.i);
            self.i = i;
            self.breaks |= breaks;
        }
    }

    #[inline(always)]
    fn eat(&mut self, byte: u8) -> Option<()> {
        self.eat_if(byte).then_some(())
    }

    #[inline(always)]
    fn eat_if(&mut self, byte: u8) -> bool {
        let hit = self.b.get(self.i) == Some(&byte);
        self.i += usize::from(hit);
        hit
    }

    /// Reads the object at the cursor: `each(self, key)` for every member, with the cursor at
    /// the member's value, which `each` must consume. With `plain_keys`, a key holding an escape
    /// gives `None` (the caller compares keys); otherwise simple escapes are allowed in keys.
    #[inline(always)]
    fn object(
        &mut self,
        plain_keys: bool,
        each: impl FnMut(&mut Self, &'a [u8]) -> Option<()>,
    ) -> Option<()> {
        self.eat(b'{')?;
        self.ws();
        if self.eat_if(b'}') {
            return Some(());
        }
        self.members(plain_keys, each)
    }

    /// Reads an object's members from the cursor, at a key, through its closing brace, as
    /// [`Self::object`] does.
    #[inline(always)]
    fn members(
        &mut self,
        plain_keys: bool,
        mut each: impl FnMut(&mut Self, &'a [u8]) -> Option<()>,
    ) -> Option<()> {
        loop {
            let start = self.i;
            if self.string()? != Kind::PlainString && plain_keys {
                return None;
            }
            let key = &self.b[start + 1..self.i - 1];
            self.ws();
            self.eat(b':')?;
            self.ws();
            each(self, key)?;
            if !self.member_end()? {
                return Some(());
            }
        }
    }

    /// Past a member's value: a comma (`true`: another member follows, the cursor at its key)
    /// or the object's closing brace (`false`).
    #[inline(always)]
    fn member_end(&mut self) -> Option<bool> {
        self.ws();
        match self.b.get(self.i)? {
            b',' => {
                self.i += 1;
                self.ws();
                Some(true)
            }
            b'}' => {
                self.i += 1;
                Some(false)
            }
            _ => None,
        }
    }

    /// The message object (depth 2), validated, with the members the server reads. `None` if it
    /// is not an object, repeats one of those members, or is not valid.
    #[inline(always)]
    fn head(&mut self, head: &mut [Option<Token>; HEAD.len()]) -> Option<()> {
        self.object(true, |p, key| {
            let Some(k) = named(key, &HEAD) else {
                // Depth 1 is the envelope's members, 2 the message: its members are at 3.
                return p.value(3).map(drop);
            };
            let slot = &mut head[k];
            p.record(slot, |p| p.value(3))
        })
    }

    /// Records the member value at the cursor in `slot`, read by `read`; a member already
    /// recorded (a repeated key) gives `None`.
    #[inline(always)]
    fn record(
        &mut self,
        slot: &mut Option<Token>,
        read: impl FnOnce(&mut Self) -> Option<Kind>,
    ) -> Option<()> {
        if slot.is_some() {
            return None;
        }
        // Both fit: `publish` refused a line longer than `u32::MAX`.
        let start = self.i as u32;
        let kind = read(self)?;
        *slot = Some(Token {
            start,
            end: self.i as u32,
            kind,
        });
        Some(())
    }

    /// Consumes one value at nesting `depth` (1: a member of the top-level object). A scalar
    /// (nearly every value) is read here; an object or an array goes out of line to
    /// [`Self::container`], which keeps this function small.
    #[inline(always)]
    fn value(&mut self, depth: usize) -> Option<Kind> {
        // Strings and numbers first, each behind a branch of its own: one table jump for every
        // value would be one indirect branch to predict across every kind of value.
        let c = *self.b.get(self.i)?;
        if c == b'"' {
            return self.string();
        }
        if c.is_ascii_digit() || c == b'-' {
            return self.number();
        }
        match c {
            b'{' | b'[' => {
                let (kind, p) = Parser::container(*self, depth);
                *self = p;
                kind
            }
            b't' => self.literal(b"true", Kind::Bool),
            b'f' => self.literal(b"false", Kind::Bool),
            b'n' => self.literal(b"null", Kind::Null),
            _ => None,
        }
    }

    /// The object or array at the cursor, at nesting `depth`.
    ///
    /// Takes and gives back the parser by value, so that its callers' parsers stay in registers.
    #[inline(never)]
    fn container(mut self, depth: usize) -> (Option<Kind>, Self) {
        let kind = self.container_in(depth);
        (kind, self)
    }

    /// [`Self::container`]'s reading, on the parser it took.
    fn container_in(&mut self, depth: usize) -> Option<Kind> {
        if depth >= self.max_depth {
            return None;
        }
        if self.b[self.i] == b'{' {
            // A nested key may hold simple escapes; a `\u` falls back in `string`.
            self.object(false, |p, _| p.value(depth + 1).map(drop))?;
            return Some(Kind::Object);
        }
        self.i += 1;
        self.ws();
        if self.eat_if(b']') {
            return Some(Kind::Array);
        }
        loop {
            self.value(depth + 1)?;
            self.ws();
            match self.b.get(self.i)? {
                b',' => {
                    self.i += 1;
                    self.ws();
                }
                b']' => {
                    self.i += 1;
                    return Some(Kind::Array);
                }
                _ => return None,
            }
        }
    }

    #[inline(always)]
    fn literal(&mut self, word: &[u8], kind: Kind) -> Option<Kind> {
        if self.b.get(self.i..self.i + word.len())? != word {
            return None;
        }
        self.i += word.len();
        Some(kind)
    }

    /// A string with no control character and no `\u` escape, whose bytes are UTF-8.
    ///
    /// A plain ASCII string that ends in the 64-byte block it starts in (nearly every key and
    /// every field the server reads) ends at the block's next special byte ([`Block`]: the
    /// block's bytes compared once for all its strings). Otherwise [`string_rest`] reads
    /// it from the block's end where the block holds no special byte past the quote, else
    /// from the quote: plain bytes eight at a time (a word tested for a quote, a backslash or
    /// a control character at once); past 32 bytes, up to 128 bytes a step where the CPU has
    /// AVX2 ([`skip_plain`]), and the last bytes found with `memchr`, the skipped bytes checked for
    /// control characters in one vectorisable pass (a base64 image is one long string). A
    /// string holding a byte above ASCII is checked as UTF-8 once it ends: outside
    /// strings the parser takes only ASCII, so a line whose strings are all UTF-8 is UTF-8.
    #[inline(always)]
    fn string(&mut self) -> Option<Kind> {
        let b = self.b;
        if b.get(self.i) != Some(&b'"') {
            return None;
        }
        // Most strings end in the block they start in: found in its masks, read once for all
        // the strings of the block; the rest out of line.
        let first = self.i + 1;
        let start = first & !63;
        if self.block.start != start {
            self.block = Block::read(b, start);
        }
        let shift = first - start;
        // The first special or above-ASCII byte: a quote ends a plain ASCII string.
        let stop = self.block.stop >> shift;
        if (self.block.quote >> shift) & stop & stop.wrapping_neg() != 0 {
            self.i = first + stop.trailing_zeros() as usize + 1;
            return Some(Kind::PlainString);
        }
        // No special byte in the rest of the block: the string is plain ASCII up to the block's
        // end (or the line's, where the line ends in the block), where the reading goes on.
        let from = if stop == 0 {
            (start + 64).min(b.len())
        } else {
            first
        };
        let (end, kind) = string_rest(b, self.i, from)?;
        self.i = end;
        Some(kind)
    }
}

/// [`Parser::string`] for a string that does not end, plain, in the block it starts in: the
/// string whose opening quote is at `open`, its end (past the closing quote) and kind. Its bytes
/// before `from` are known to be plain ASCII.
#[inline(never)]
fn string_rest(b: &[u8], open: usize, from: usize) -> Option<(usize, Kind)> {
    let first = open + 1;
    let mut j = from;
    let mut kind = Kind::PlainString;
    // The bytes seen, or-ed together: bit 7 set when one was above ASCII.
    let mut seen = 0u64;
    loop {
        if j - first < 32 {
            while let Some(word) = b.get(j..j + 8) {
                let x = u64::from_le_bytes(word.try_into().ok()?);
                let (n, plain) = first_special(x);
                if n < 8 {
                    seen |= plain;
                    j += n;
                    break;
                }
                seen |= x;
                j += 8;
                if j - first >= 32 {
                    break;
                }
            }
        } else {
            // A long string (a base64 image is one): 32 bytes a step in one pass where the CPU
            // has AVX2, up to its next special byte or the line's last 32 bytes.
            let skipped = skip_plain(b, j);
            if let Some((to, high)) = skipped {
                seen |= u64::from(high) << 7;
                j = to;
            }
            if skipped.is_none() || b.len() - j < 32 {
                // The rest found with `memchr`, and the bytes skipped checked in two folds the
                // compiler vectorises: the least byte and every bit seen.
                let rest = b.get(j..)?;
                let k = memchr::memchr2(b'"', b'\\', rest)?;
                let skipped = &rest[..k];
                if skipped.iter().fold(u8::MAX, |m, &x| m.min(x)) < 0x20 {
                    return None;
                }
                seen |= u64::from(skipped.iter().fold(0u8, |h, &x| h | x));
                j += k;
            }
        }
        match *b.get(j)? {
            b'"' => {
                if seen & HIGH != 0 {
                    std::str::from_utf8(&b[first..j]).ok()?;
                }
                return Some((j + 1, kind));
            }
            b'\\' => match b.get(j + 1)? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                    kind = Kind::String;
                    j += 2;
                }
                _ => return None,
            },
            0..=0x1f => return None,
            x => {
                seen |= u64::from(x);
                j += 1;
            }
        }
    }
}

impl Parser<'_> {
    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, with at most 18 mantissa and 2
    /// exponent digits (so that every parser reads the same value).
    #[inline(always)]
    fn number(&mut self) -> Option<Kind> {
        let b = self.b;
        let mut i = self.i;
        i += usize::from(b.get(i) == Some(&b'-'));
        let int_start = i;
        match b.get(i)? {
            b'0' => i += 1,
            b'1'..=b'9' => {
                while b.get(i).is_some_and(u8::is_ascii_digit) {
                    i += 1;
                }
            }
            _ => return None,
        }
        let mut digits = i - int_start;
        let mut kind = Kind::Integer;
        if b.get(i) == Some(&b'.') {
            i += 1;
            let frac_start = i;
            while b.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            if i == frac_start {
                return None;
            }
            digits += i - frac_start;
            kind = Kind::Number;
        }
        if let Some(b'e' | b'E') = b.get(i) {
            i += 1;
            if let Some(b'+' | b'-') = b.get(i) {
                i += 1;
            }
            let exp_start = i;
            while b.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            if i == exp_start || i - exp_start > 2 {
                return None;
            }
            kind = Kind::Number;
        }
        if digits > 18 {
            return None;
        }
        self.i = i;
        Some(kind)
    }
}

/// Skips the run of whitespace of `b` at `i`: spaces eight at a time (numbers padded to a width,
/// indented JSON), the rest a byte at a time. Returns where the run ends and whether it held a
/// raw line break. (The out-of-line steps of the parser take and return values: a parser whose
/// address no call takes stays in registers.)
#[inline(never)]
fn ws_run(b: &[u8], mut i: usize) -> (usize, bool) {
    const SPACES: u64 = 0x2020_2020_2020_2020;
    let mut breaks = false;
    loop {
        if let Some(word) = b.get(i..i + 8) {
            let x = u64::from_le_bytes(word.try_into().expect("8 bytes")) ^ SPACES;
            // The spaces before the first other byte (all eight when `x` is zero).
            i += x.trailing_zeros() as usize / 8;
            if x == 0 {
                continue;
            }
        }
        match b.get(i) {
            Some(b' ' | b'\t') => i += 1,
            Some(b'\n' | b'\r') => {
                breaks = true;
                i += 1;
            }
            _ => return (i, breaks),
        }
    }
}

/// From `j`, the first quote, backslash or control character of `b` while at least 32 bytes
/// remain (else where 32 remain), and whether a byte above ASCII came before it; `None` where
/// the CPU lacks AVX2.
#[inline]
fn skip_plain(b: &[u8], j: usize) -> Option<(usize, bool)> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return Some(unsafe { skip_plain_avx2(b, j) });
    }
    let _ = (b, j);
    None
}

/// [`skip_plain`] on AVX2: 128 bytes a step while every byte is plain ASCII, then 64 while
/// nothing stops the string (bytes above ASCII included), then 32.
///
/// # Safety
///
/// The CPU must have AVX2.
// An `unsafe fn` with the intrinsics in `unsafe` blocks: they are `unsafe` to call before Rust
// 1.87 (the workspace's `rust-version` is older), safe since under the enabled feature, where
// the blocks are unused.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(unused_unsafe)]
unsafe fn skip_plain_avx2(b: &[u8], mut j: usize) -> (usize, bool) {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_movemask_epi8, _mm256_or_si256, _mm256_set1_epi8,
        _mm256_setzero_si256,
    };
    // The blocks below: AVX2 is enabled here and the CPU has it (this function's contract);
    // each load reads 32 bytes of a slice that holds them (no alignment needed).
    // 128 bytes a step while all are plain ASCII (a base64 image, padding, most text): one
    // signed comparison finds both the control characters and the bytes above ASCII, and no
    // bytes above ASCII are or-ed up. The step that finds one says where: a stop ends the
    // search; a byte above ASCII is where the steps below go on, with it seen.
    let mut high_seen = false;
    while let Some(chunk) = b.get(j..j + 128) {
        // SAFETY: as said above the first block.
        let (a, b1, c, d) = unsafe {
            let p = chunk.as_ptr().cast::<__m256i>();
            (
                plain_ascii_stops_avx2(_mm256_loadu_si256(p)),
                plain_ascii_stops_avx2(_mm256_loadu_si256(p.add(1))),
                plain_ascii_stops_avx2(_mm256_loadu_si256(p.add(2))),
                plain_ascii_stops_avx2(_mm256_loadu_si256(p.add(3))),
            )
        };
        // SAFETY: as said above the first block.
        let any = unsafe {
            _mm256_movemask_epi8(_mm256_or_si256(
                _mm256_or_si256(a, b1),
                _mm256_or_si256(c, d),
            ))
        };
        if any != 0 {
            // SAFETY: as said above the first block.
            let (low, upper) = unsafe {
                let m = |v| u64::from(_mm256_movemask_epi8(v) as u32);
                (m(a) | m(b1) << 32, m(c) | m(d) << 32)
            };
            let n = if low != 0 {
                low.trailing_zeros() as usize
            } else {
                64 + upper.trailing_zeros() as usize
            };
            j += n;
            if chunk[n] < 0x80 {
                return (j, false);
            }
            high_seen = true;
            break;
        }
        j += 128;
    }
    // SAFETY: as said above.
    let mut high = unsafe {
        if high_seen {
            _mm256_set1_epi8(-1)
        } else {
            _mm256_setzero_si256()
        }
    };
    // 64 bytes a step while none stops the string; the 32-byte steps find where one does.
    while let Some(chunk) = b.get(j..j + 64) {
        // SAFETY: as said above the first block.
        let (x, y) = unsafe {
            (
                _mm256_loadu_si256(chunk.as_ptr().cast()),
                _mm256_loadu_si256(chunk[32..].as_ptr().cast()),
            )
        };
        // SAFETY: as said above the first block.
        let stops = unsafe {
            _mm256_movemask_epi8(_mm256_or_si256(plain_stops_avx2(x), plain_stops_avx2(y)))
        };
        if stops != 0 {
            break;
        }
        // SAFETY: as said above the first block.
        high = unsafe { _mm256_or_si256(high, _mm256_or_si256(x, y)) };
        j += 64;
    }
    while let Some(chunk) = b.get(j..j + 32) {
        // SAFETY: as said above the first block.
        let (x, stop, highs) = unsafe {
            let x = _mm256_loadu_si256(chunk.as_ptr().cast());
            (
                x,
                _mm256_movemask_epi8(plain_stops_avx2(x)) as u32,
                _mm256_movemask_epi8(high) != 0,
            )
        };
        if stop != 0 {
            // The bytes above ASCII before the stop (a high bit set in lanes past it too would
            // only ask for a UTF-8 check that passes).
            let n = stop.trailing_zeros();
            // SAFETY: as said above the first block.
            let before = unsafe { _mm256_movemask_epi8(x) } as u32 & ((1u32 << n) - 1);
            return (j + n as usize, before != 0 || highs);
        }
        // SAFETY: as said above the first block.
        high = unsafe { _mm256_or_si256(high, x) };
        j += 32;
    }
    // SAFETY: as said above the first block.
    (j, unsafe { _mm256_movemask_epi8(high) } != 0)
}

/// The lanes of `x` that stop a plain string: a quote, a backslash or a control character.
///
/// # Safety
///
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
#[allow(unused_unsafe)]
unsafe fn plain_stops_avx2(x: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::{
        _mm256_cmpeq_epi8, _mm256_max_epu8, _mm256_or_si256, _mm256_set1_epi8,
    };
    // SAFETY: AVX2 is enabled here and the CPU has it (this function's contract).
    unsafe {
        let low = _mm256_set1_epi8(0x1f);
        _mm256_or_si256(
            quote_or_backslash_avx2(x),
            // Below 0x20 exactly when the unsigned maximum with 0x1f is 0x1f.
            _mm256_cmpeq_epi8(_mm256_max_epu8(x, low), low),
        )
    }
}

/// The lanes of `x` that hold a quote or a backslash.
///
/// # Safety
///
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
#[allow(unused_unsafe)]
unsafe fn quote_or_backslash_avx2(x: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::{_mm256_cmpeq_epi8, _mm256_or_si256, _mm256_set1_epi8};
    // SAFETY: AVX2 is enabled here and the CPU has it (this function's contract).
    unsafe {
        _mm256_or_si256(
            _mm256_cmpeq_epi8(x, _mm256_set1_epi8(b'"' as i8)),
            _mm256_cmpeq_epi8(x, _mm256_set1_epi8(b'\\' as i8)),
        )
    }
}

/// The lanes of `x` that stop a plain string or hold a byte above ASCII: a quote, a backslash,
/// or a byte below 0x20 taken as signed (a control character, or one above 0x7f).
///
/// # Safety
///
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
#[allow(unused_unsafe)]
unsafe fn plain_ascii_stops_avx2(x: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::{_mm256_cmpgt_epi8, _mm256_or_si256, _mm256_set1_epi8};
    // SAFETY: AVX2 is enabled here and the CPU has it (this function's contract).
    unsafe {
        _mm256_or_si256(
            quote_or_backslash_avx2(x),
            _mm256_cmpgt_epi8(_mm256_set1_epi8(0x20), x),
        )
    }
}

/// Bit 7 of every byte of a word.
const HIGH: u64 = 0x8080_8080_8080_8080;

/// Where the first quote, backslash or control character of the word `x` (read little-endian)
/// is, as a byte index (8 when there is none), and the word's bytes before it (the rest zeroed).
fn first_special(x: u64) -> (usize, u64) {
    const ONES: u64 = 0x0101_0101_0101_0101;
    // A byte is zero in `v` exactly when (v - 1) borrows into its bit 7 while bit 7 was clear.
    let zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    let quote = zero(x ^ (ONES * u64::from(b'"')));
    let backslash = zero(x ^ (ONES * u64::from(b'\\')));
    // Below 0x20: subtracting 0x20 borrows into bit 7 of a byte whose bit 7 was clear.
    let control = x.wrapping_sub(ONES * 0x20) & !x & HIGH;
    // Bit 7 of each special byte; above the first one a borrow may set more, so only the lowest
    // set bit is exact. Below that bit's byte are the plain bytes (all of them when there is no
    // special byte: the subtraction wraps).
    let special = quote | backslash | control;
    let plain = ((special & special.wrapping_neg()) >> 7).wrapping_sub(1);
    (special.trailing_zeros() as usize / 8, x & plain)
}

/// The byte-mutation helpers the integration tests use too.
#[cfg(test)]
#[path = "../../tests/mutate/mod.rs"]
mod mutate;

#[cfg(test)]
mod tests {
    use super::publish;
    use crate::protocol::command::parse_full_default;
    use crate::protocol::Command;
    use proptest::prelude::*;

    use super::mutate;
    use serde_json::{json, Map, Value};

    /// The fast path's answer, checked against the full parser whenever it gives one.
    fn both(line: &str) -> Option<Command> {
        both_bytes(line.as_bytes())
    }

    /// [`both`] for any bytes: a line the fast path takes must be UTF-8.
    fn both_bytes(line: &[u8]) -> Option<Command> {
        let fast = publish(line, 128);
        if let Some(cmd) = &fast {
            let text = String::from_utf8_lossy(line);
            assert!(std::str::from_utf8(line).is_ok(), "not UTF-8: {text}");
            let full = parse_full_default(line);
            assert_eq!(full.as_ref(), Ok(cmd), "{text}");
        }
        fast
    }

    #[test]
    fn a_line_that_is_not_utf8_goes_to_the_full_parser() {
        let line = |s: &[u8]| {
            let mut l = br#"{"type":"publish","message":{"type":"t","stream":"s","x":""#.to_vec();
            l.extend_from_slice(s);
            l.extend_from_slice(br#""}}"#);
            l
        };
        // Short and long strings (word by word, then memchr), the bad byte anywhere in them.
        for pad in [0, 3, 7, 8, 15, 31, 32, 33, 40, 100] {
            let a = "a".repeat(pad);
            // A lone byte above ASCII, a cut sequence, a surrogate's encoding.
            for bad in [&b"\xff"[..], b"\xc3", b"\xe2\x82", b"\xed\xa0\x80"] {
                for at in [0, pad / 2, pad] {
                    let mut s = a.clone().into_bytes();
                    s.splice(at..at, bad.iter().copied());
                    assert!(
                        publish(&line(&s), 128).is_none(),
                        "pad {pad} at {at}: {bad:?}"
                    );
                }
            }
            // UTF-8 in the same places is taken.
            for at in [0, pad / 2, pad] {
                let mut s = a.clone().into_bytes();
                s.splice(at..at, "é€😀".bytes());
                assert!(both_bytes(&line(&s)).is_some(), "pad {pad} at {at}");
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn a_block_has_the_same_masks_on_avx2_as_on_sse2() {
        if !std::is_x86_feature_detected!("avx2") {
            return;
        }
        // Each special byte, a byte above ASCII and a plain one at every position of a block.
        for byte in [b'"', b'\\', 0x00, 0x1f, 0x20, 0x7f, 0x80, 0xff, b'a'] {
            for at in 0..64 {
                let mut block = [b'x'; 64];
                block[at] = byte;
                block[63 - at] = b'"';
                // SAFETY: the CPU has AVX2 (checked above).
                let (avx2, sse2) = (
                    unsafe { super::masks_avx2(&block) },
                    super::masks_sse2(&block),
                );
                assert_eq!(
                    (avx2.stop, avx2.quote),
                    (sse2.stop, sse2.quote),
                    "{byte:#x} at {at}"
                );
            }
        }
    }

    #[test]
    fn a_special_byte_is_found_anywhere_in_a_word() {
        // A quote, a backslash or a control character at each position of the words read.
        for pad in 0..40 {
            let a = "a".repeat(pad);
            let ok = format!(
                r#"{{"type":"publish","message":{{"type":"t","stream":"s","x":"{a}\"b"}}}}"#
            );
            assert!(both(&ok).is_some(), "{ok}");
            let ctrl = format!("{{\"type\":\"publish\",\"message\":{{\"type\":\"t\",\"stream\":\"s\",\"x\":\"{a}\u{1}b\"}}}}");
            assert!(publish(ctrl.as_bytes(), 128).is_none(), "{ctrl:?}");
            let short =
                format!(r#"{{"type":"publish","message":{{"type":"t","stream":"s","x":"{a}"}}}}"#);
            assert!(both(&short).is_some(), "{short}");
        }
    }

    #[test]
    fn a_string_reads_alike_wherever_it_falls_across_the_blocks() {
        // Every string of the line at every offset from a 64-byte block's start, lines shorter
        // than a block included (a filler member shifts the rest by one byte a time).
        for lead in 0..140 {
            let filler = match lead {
                0 => String::new(),
                n => format!(r#""f":"{}","#, "a".repeat(n - 1)),
            };
            for x in ["", "ab", r#"a\"b"#, r"a\\", "é€", &"y".repeat(70)] {
                let line = format!(
                    r#"{{{filler}"type":"publish","message":{{"type":"t","stream":"s","x":"{x}"}}}}"#
                );
                let Some(Command::Publish { message, meta, .. }) = both(&line) else {
                    panic!("not taken: {line}");
                };
                assert!(message.ends_with(format!(r#""x":"{x}"}}"#).as_bytes()));
                assert_eq!((&*meta.stream, &*meta.kind), ("s", "t"));
            }
            let ctrl = format!(
                "{{{filler}\"type\":\"publish\",\"message\":{{\"type\":\"t\",\"stream\":\"s\",\"x\":\"a\u{1f}\"}}}}"
            );
            assert!(publish(ctrl.as_bytes(), 128).is_none(), "{ctrl:?}");
        }
    }

    #[test]
    fn a_long_string_reads_alike_whatever_byte_stops_it_and_wherever() {
        // Strings long enough for the 32-, 64- and 128-byte steps, with an escape, a byte above
        // ASCII, a control character or a byte that is no UTF-8 at every offset, and lines that
        // end right after them (the steps stop 32 bytes before the line's end).
        for len in [
            31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 400, 1000,
        ] {
            for at in 0..len {
                for (special, valid) in [
                    (&br#"\""#[..], true),
                    (br"\n", true),
                    ("é".as_bytes(), true),
                    ("€".as_bytes(), true),
                    (b"\x01", false),
                    (b"\x1f", false),
                    (b"\xff", false),
                ] {
                    let mut x = vec![b'y'; at];
                    x.extend_from_slice(special);
                    x.resize(len + special.len() - 1, b'z');
                    let mut line =
                        br#"{"type":"publish","message":{"type":"t","stream":"s","x":""#.to_vec();
                    line.extend_from_slice(&x);
                    line.extend_from_slice(br#""}}"#);
                    let text = String::from_utf8_lossy(&line).into_owned();
                    let alone = both_bytes(&line);
                    assert_eq!(alone.is_some(), valid, "{text}");
                    // Read from a run, where the steps go past the line into the next one.
                    let mut run = line.clone();
                    run.push(b'\n');
                    run.extend_from_slice(&line);
                    run.push(b'\n');
                    match super::publish_line(&run, 128) {
                        Ok((read, at)) => {
                            assert_eq!(at, line.len(), "{text}");
                            assert_eq!(Some(read.into_command()), alone, "{text}");
                        }
                        Err(reread) => assert!(reread || alone.is_none(), "{text}"),
                    }
                }
            }
        }
    }

    /// Every prefix of a line (a receive cut anywhere, a client's truncated line) reads as the
    /// full parser reads it, alone or as a run's last line, without a panic: the steps never
    /// read or count past the end of what they were given.
    #[test]
    fn every_prefix_of_a_line_reads_as_the_full_parser_reads_it() {
        let long = "x".repeat(1000);
        let lines = [
            r#"{"type":"publish","message":{"type":"t","stream":"s","n":1}}"#.to_owned(),
            format!(r#"{{"type":"publish","message":{{"type":"t","stream":"s","p":"{long}"}}}}"#),
            format!(r#"{{"type":"publish","message":{{"type":"t","stream":"s","p":"é{long}"}}}}"#),
            format!(r#"{{"message":{{"p":"{long}","type":"t","stream":"s"}},"type":"publish"}}"#),
        ];
        for line in &lines {
            let bytes = line.as_bytes();
            for k in 0..=bytes.len() {
                let prefix = &bytes[..k];
                let alone = both_bytes(prefix);
                assert_eq!(alone.is_some(), k == bytes.len(), "{k}");
                if let Ok((read, at)) = super::publish_line(prefix, 128) {
                    panic!(
                        "a run's line read without its newline: {at} {:?}",
                        read.stream
                    );
                }
            }
        }
    }

    #[test]
    fn the_usual_publish_takes_the_fast_path() {
        assert!(both(r#"{"type":"publish","message":{"type":"t","stream":"b","s":42}}"#).is_some());
        assert!(both(r#" {"type":"publish","id":7,"message":{"type":"screenshot_update","stream":"obs","deviceId":"d","deviceSessionUuid":null,"png":"aGk=","n":[1,2.5,-3e2,true,null,{}]}} "#).is_some());
        assert!(both(r#"{"message":{"stream":"s","type":"x","text":"a \"quoted\" \\ word\n"},"requestId":"r","type":"publish"}"#).is_some());
        // Raw line breaks as whitespace (a WebSocket text message may hold them): flattened,
        // as the full parser does.
        let Some(Command::Publish { message, .. }) =
            both("{\"type\":\"publish\",\"message\":{\"type\":\"t\",\r\n\"stream\":\"s\"\n}}")
        else {
            panic!("not taken");
        };
        assert_eq!(&message[..], b"{\"type\":\"t\",  \"stream\":\"s\" }");
    }

    #[test]
    fn a_line_of_the_usual_start_reads_as_any_other_order_does() {
        // The type, then the message, named in the usual start without comparing the names:
        // what follows it is read as in any other order, a repeated member refused.
        for line in [
            r#"{"type":"publish","message": {"type":"t","stream":"s"} ,"id":3}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s"},"requestId":"r","x":[1]}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s","deviceId":"d"}}"#,
        ] {
            assert!(both(line).is_some(), "{line}");
        }
        for line in [
            r#"{"type":"publish","message":{"type":"t","stream":"s"},"type":"publish"}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s"},"message":{"type":"t","stream":"s"}}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s"},}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s"}"#,
            r#"{"type":"publish","message":5}"#,
            r#"{"type":"publish","message":"#,
        ] {
            assert!(publish(line.as_bytes(), 128).is_none(), "{line}");
        }
    }

    #[test]
    fn whitespace_runs_of_any_length_and_kind_are_skipped_alike() {
        // Numbers padded to a width, indented members: runs of spaces read eight at a time,
        // with tabs and line breaks anywhere in them, up to the line's end.
        for n in 0..20 {
            for ws in [
                " ".repeat(n),
                format!("{}\t ", " ".repeat(n)),
                format!("\r{}\n", " ".repeat(n)),
            ] {
                let line = format!(
                    "{ws}{{{ws}\"type\":{ws}\"publish\"{ws},\"message\":{{\"s\":{ws}42{ws},\"type\":\"t\",\"stream\":\"b\"}}{ws}}}{ws}"
                );
                let Some(Command::Publish { message, .. }) = both(&line) else {
                    panic!("not taken: {line:?}");
                };
                assert!(
                    !message.contains(&b'\n') && !message.contains(&b'\r'),
                    "{line:?}"
                );
            }
        }
        assert!(publish(
            b"{\"type\":\"publish\",\"message\":{\"type\":\"t\",\"stream\":\"b\"}}  \x0b",
            128
        )
        .is_none());
    }

    #[test]
    fn everything_else_goes_to_the_full_parser() {
        for line in [
            r#"{"type":"subscribe","stream":"s"}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"a/b"}}"#,
            r#"{"type":"publish","message":{"type":"t","stream":""}}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s","deviceId":""}}"#,
            r#"{"type":"publish","message":{"type":"t"}}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s","stream":"s"}}"#,
            r#"{"type":"publish","type":"publish","message":{"type":"t","stream":"s"}}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s","x":"\u00e9"}}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s\n"}}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s","n":1e400}}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s","n":12345678901234567890}}"#,
            r#"{"type":"publish","id":-0,"message":{"type":"t","stream":"s"}}"#,
            r#"{"type":"publish","id":1.5,"message":{"type":"t","stream":"s"}}"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s"}} x"#,
            r#"{"type":"publish","message":{"type":"t","stream":"s",}}"#,
            "{\"type\":\"publish\",\"message\":{\"type\":\"t\",\"stream\":\"s\",\"x\":\"a\tb\"}}",
            r#"{"type":"publish","message":[1]}"#,
        ] {
            assert!(publish(line.as_bytes(), 128).is_none(), "{line}");
        }
    }

    #[test]
    fn deep_nesting_goes_to_the_full_parser() {
        let nested = |n: usize| {
            format!(
                r#"{{"type":"publish","message":{{"type":"t","stream":"s","x":{}1{}}}}}"#,
                "[".repeat(n),
                "]".repeat(n)
            )
        };
        assert!(publish(nested(70).as_bytes(), 128).is_none());
        // Under a lower configured limit the fast path gives up sooner.
        assert!(publish(nested(20).as_bytes(), 8).is_none());
        assert!(both(&nested(20)).is_some());
    }

    /// Any JSON value: strings with quotes, backslashes, line breaks, control characters and
    /// non-ASCII; integers of every size; floats.
    fn any_value() -> BoxedStrategy<Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            "[a-z\"\\\n\u{1}é/ ]{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                prop::collection::btree_map("[a-zA-Z]{1,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
        .boxed()
    }

    /// A plain value: what the fast path must take.
    fn plain_value() -> BoxedStrategy<Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i32>().prop_map(Value::from),
            "[a-z0-9 ]{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                prop::collection::btree_map("[a-z]{1,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
        .boxed()
    }

    /// A publish line: the envelope's members in any order, the message's fields, extra members.
    fn publish_line(
        value: BoxedStrategy<Value>,
        id: impl Strategy<Value = Option<Value>>,
        text: impl Strategy<Value = String> + Clone,
    ) -> impl Strategy<Value = String> {
        (
            id,
            text.clone(),
            text.clone(),
            prop::option::of(text),
            prop::collection::vec(("[a-zA-Z]{1,8}", value.clone()), 0..4),
            prop::collection::vec(("[a-z]{1,8}", value), 0..3),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(id, kind, stream, device, extra, top, id_first, spaced)| {
                let mut message = Map::new();
                message.insert("type".into(), Value::from(kind));
                message.insert("stream".into(), Value::from(stream));
                if let Some(d) = device {
                    message.insert("deviceId".into(), Value::from(d));
                }
                for (k, v) in extra {
                    message.entry(k).or_insert(v);
                }
                let mut members = vec![
                    r#""type":"publish""#.to_owned(),
                    format!(r#""message":{}"#, Value::Object(message)),
                ];
                for (k, v) in top {
                    if !matches!(k.as_str(), "type" | "message" | "id" | "stream") {
                        members.push(format!(r#""{k}":{v}"#));
                    }
                }
                if let Some(id) = id {
                    let m = format!(r#""id":{id}"#);
                    if id_first {
                        members.insert(0, m);
                    } else {
                        members.push(m);
                    }
                }
                let sep = if spaced { " ,\n " } else { "," };
                format!("{{{}}}", members.join(sep))
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

        /// Whatever the fast path accepts, the full parser accepts with the same command.
        #[test]
        fn the_fast_path_agrees_with_the_full_parser(
            line in publish_line(
                any_value(),
                prop::option::of(any_value()),
                "[a-z\"\\/\n\u{7f}é]{0,6}",
            ),
        ) {
            both(&line);
        }

        /// The same, on lines mutated byte by byte (most of them invalid, some not UTF-8): a
        /// line the fast path takes is UTF-8 and the full parser reads it alike.
        #[test]
        fn the_fast_path_agrees_with_the_full_parser_on_mutated_lines(
            line in publish_line(plain_value(), Just(Some(json!(7))), "[a-zé]{1,40}"),
            edits in mutate::edits(1..4),
        ) {
            let mut bytes = line.into_bytes();
            mutate::apply(&mut bytes, &edits);
            both_bytes(&bytes);
        }

        /// A publish read at the start of a run of lines (its end found by the read) is the
        /// publish its line reads as on its own, and that line ends at the run's first newline;
        /// a line the run's read refuses outright, the line alone is refused too.
        #[test]
        fn a_publish_read_from_its_run_reads_as_its_line_alone(
            line in publish_line(plain_value(), prop::option::of(Just(json!(7))), "[a-zé]{1,40}"),
            edits in mutate::edits(0..3),
            ending in prop_oneof![Just("\n"), Just("\r\n"), Just(" \n"), Just("\r \n")],
            next in publish_line(plain_value(), Just(None), "[a-z]{1,8}"),
        ) {
            let mut run = line.into_bytes();
            mutate::apply(&mut run, &edits);
            run.extend_from_slice(ending.as_bytes());
            run.extend_from_slice(next.as_bytes());
            run.push(b'\n');
            let newline = memchr::memchr(b'\n', &run).expect("a newline");
            let end = newline - usize::from(newline > 0 && run[newline - 1] == b'\r');
            let alone = publish(&run[..end], 128);
            match super::publish_line(&run, 128) {
                Ok((read, at)) => {
                    prop_assert_eq!(at, newline);
                    prop_assert_eq!(Some(read.into_command()), alone);
                }
                Err(false) => prop_assert!(alone.is_none()),
                Err(true) => {}
            }
        }

        /// And the fast path is not a rarity: a publish of plain values always takes it.
        #[test]
        fn a_publish_of_plain_values_takes_the_fast_path(
            line in publish_line(
                plain_value(),
                prop::option::of(prop_oneof![Just(Value::Null), any::<i32>().prop_map(Value::from), "[a-z]{0,5}".prop_map(Value::from)]),
                "[a-z0-9]{1,6}",
            ),
        ) {
            prop_assert!(both(&line).is_some(), "{}", line);
        }
    }
}
