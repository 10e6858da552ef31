//! Client commands: the typed form and the parser (simd-json, after the publish fast path).

use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use super::scan::{member_span, members};
use crate::outbox::Field;

/// The correlation id a client puts in a command's `id` (or `requestId`): a string or an
/// integer. Replies carry it back as `requestId`, unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RequestId {
    /// A string id.
    Str(String),
    /// An integer id.
    Int(i64),
}

impl RequestId {
    /// Appends the id as a JSON value.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        match self {
            RequestId::Str(s) => crate::outbox::write_json_str(out, s),
            RequestId::Int(n) => out.extend_from_slice(n.to_string().as_bytes()),
        }
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestId::Str(s) => write!(f, "{s:?}"),
            RequestId::Int(n) => write!(f, "{n}"),
        }
    }
}

/// What a `publish` command's message says about itself (read from the message, which is
/// forwarded byte for byte).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishMeta {
    /// `message.stream`: the stream the message belongs to.
    pub stream: String,
    /// `message.type`.
    pub kind: String,
    /// `message.deviceId`: absent, `null` or a string.
    pub device_id: Field,
    /// `message.deviceSessionUuid`: absent, `null` or a string.
    pub device_session_uuid: Field,
}

/// One client command, parsed from one NDJSON line.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Command {
    /// `{"type":"subscribe","id":..,"stream":"S"[,"deviceId":"D"][,"subscriptionId":"X"]}`:
    /// subscribe to one device of a stream, or to all devices when `deviceId` is absent.
    Subscribe {
        /// The correlation id.
        id: Option<RequestId>,
        /// The stream.
        stream: String,
        /// The device, or `None` for every device of the stream.
        device_id: Option<String>,
        /// The subscription id the client chose, or `None` to let the server choose.
        subscription_id: Option<String>,
    },
    /// `{"type":"unsubscribe","id":..,"subscriptionId":"X"}`.
    Unsubscribe {
        /// The correlation id.
        id: Option<RequestId>,
        /// The subscription to end.
        subscription_id: String,
    },
    /// `{"type":"publish","id":..,"message":{"type":..,"stream":"S",..}}`.
    Publish {
        /// The correlation id.
        id: Option<RequestId>,
        /// The message exactly as the client wrote it (its bytes are what subscribers read),
        /// except that line breaks in its whitespace become spaces (it arrived over WebSocket,
        /// say, and is delivered over NDJSON too).
        message: Bytes,
        /// What the message says about itself.
        meta: PublishMeta,
    },
    /// `{"type":"ping"[,"id":..]}`: the server answers `pong`.
    Ping {
        /// The correlation id.
        id: Option<RequestId>,
    },
    /// `{"type":"pong"}`: the answer to a server `ping`; refreshes liveness.
    Pong {
        /// The correlation id.
        id: Option<RequestId>,
    },
}

impl Command {
    /// The command's correlation id.
    pub fn request_id(&self) -> Option<&RequestId> {
        match self {
            Command::Subscribe { id, .. }
            | Command::Unsubscribe { id, .. }
            | Command::Publish { id, .. }
            | Command::Ping { id }
            | Command::Pong { id } => id.as_ref(),
        }
    }
}

/// What was wrong with a command (or with the connection's use of one).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The line is not UTF-8.
    #[error("invalid UTF-8 at byte {offset}")]
    InvalidUtf8 {
        /// Offset of the first invalid byte.
        offset: usize,
    },
    /// The line is not a JSON object.
    #[error("invalid JSON: {0}")]
    InvalidJson(String),
    /// A required field is missing.
    #[error("missing field `{0}`")]
    MissingField(&'static str),
    /// A field has the wrong JSON type.
    #[error("field `{field}` must be {expected}, got {got}")]
    WrongType {
        /// The field, e.g. `stream` or `message.deviceId`.
        field: &'static str,
        /// What it must be.
        expected: &'static str,
        /// What it was.
        got: &'static str,
    },
    /// A field has a value the protocol does not accept.
    #[error("invalid `{field}`: {reason}")]
    InvalidValue {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// `type` names no command.
    #[error("unknown command `{0}`")]
    UnknownCommand(String),
    /// The line is longer than the configured maximum (the connection stays usable).
    #[error("line of {size} bytes exceeds the limit max_line_bytes = {limit}")]
    LineTooLong {
        /// The line's length.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// `subscriptionId` names no subscription of this connection.
    #[error("unknown subscription `{0}`")]
    UnknownSubscription(String),
    /// `subscriptionId` is already used on this connection.
    #[error("duplicate subscription `{0}`")]
    DuplicateSubscription(String),
    /// The connection has as many subscriptions as allowed.
    #[error("too many subscriptions: the limit max_subscriptions = {limit} is reached")]
    TooManySubscriptions {
        /// The limit.
        limit: usize,
    },
    /// A line could not even be framed (longer than the framing limit): the connection closes.
    #[error("{0}; closing the connection")]
    Fatal(String),
}

impl ErrorKind {
    /// The stable machine-readable code of the error reply's `code` field.
    pub fn code(&self) -> &'static str {
        match self {
            ErrorKind::InvalidUtf8 { .. } => "invalid_utf8",
            ErrorKind::InvalidJson(_) => "invalid_json",
            ErrorKind::MissingField(_) => "missing_field",
            ErrorKind::WrongType { .. } => "wrong_type",
            ErrorKind::InvalidValue { .. } => "invalid_value",
            ErrorKind::UnknownCommand(_) => "unknown_command",
            ErrorKind::LineTooLong { .. } => "line_too_long",
            ErrorKind::UnknownSubscription(_) => "unknown_subscription",
            ErrorKind::DuplicateSubscription(_) => "duplicate_subscription",
            ErrorKind::TooManySubscriptions { .. } => "too_many_subscriptions",
            ErrorKind::Fatal(_) => "fatal",
        }
    }
}

/// A rejected command: what was wrong and the request id, when one could be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind} (request id: {})", request_id.as_ref().map_or_else(|| "none".to_owned(), ToString::to_string))]
pub struct CommandError {
    /// The command's `id` / `requestId`, if it could be read.
    pub request_id: Option<RequestId>,
    /// What was wrong.
    pub kind: ErrorKind,
}

impl CommandError {
    /// An error for the command with `request_id`.
    pub fn new(request_id: Option<RequestId>, kind: ErrorKind) -> Self {
        CommandError { request_id, kind }
    }

    /// The error reply: `{"type":"error","requestId":..,"code":..,"message":..}`.
    pub fn to_reply(&self) -> Bytes {
        super::reply::error(
            self.request_id.as_ref(),
            self.kind.code(),
            &self.kind.to_string(),
        )
    }
}

/// Parses one NDJSON line (without its newline) into a [`Command`].
///
/// A `publish` of the usual shape is read in one validating pass over the line (no escapes in
/// the fields the server reads, no `\u` escape anywhere, no repeated key); every other line is
/// parsed in place by simd-json (which may overwrite it). Both give the same result where both
/// apply. Unknown fields are ignored. A `publish` message is located by a byte scan and copied
/// out verbatim, so subscribers read exactly the bytes the publisher wrote. Errors name the
/// problem and carry the request id when it could be read (also from a line that is not valid
/// JSON, best effort).
///
/// ```
/// use powerhub::protocol::{parse_command, Command, ErrorKind, RequestId};
///
/// let mut line = br#"{"type":"subscribe","id":"r1","stream":"observation","deviceId":"emulator-5554"}"#.to_vec();
/// let cmd = parse_command(&mut line).unwrap();
/// assert!(matches!(cmd, Command::Subscribe { ref stream, .. } if stream == "observation"));
///
/// let mut line = br#"{"type":"subscribe","id":"r2","stream":7}"#.to_vec();
/// let err = parse_command(&mut line).unwrap_err();
/// assert_eq!(err.request_id, Some(RequestId::Str("r2".into())));
/// assert_eq!(err.kind.to_string(), "field `stream` must be a string, got a number");
/// ```
pub fn parse_command(line: &mut [u8]) -> Result<Command, CommandError> {
    CommandParser::default().parse(line)
}

/// A [`parse_command`] that keeps simd-json's buffers between lines (the server keeps one per
/// thread). Boxed, and allocated at the first line that needs the full parser: a parser that
/// only ever sees usual publishes (the fast path) carries one pointer.
#[derive(Default)]
pub struct CommandParser {
    buffers: Option<Box<simd_json::Buffers>>,
}

impl fmt::Debug for CommandParser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommandParser").finish_non_exhaustive()
    }
}

impl CommandParser {
    /// Parses one line, as [`parse_command`] does.
    pub fn parse(&mut self, line: &mut [u8]) -> Result<Command, CommandError> {
        parse_with(line, self.buffers())
    }

    /// Parses a line that may share its bytes with other lines (a slice of one receive): the
    /// publish fast path reads it where it is, and only a line that needs the full parser is
    /// copied (simd-json parses in place), unless it is the sole owner of its bytes.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use powerhub::protocol::{Command, CommandParser};
    ///
    /// let received = Bytes::from_static(b"{\"type\":\"ping\",\"id\":1}\n{\"type\":\"publish\",\"message\":{\"type\":\"t\",\"stream\":\"s\"}}\n");
    /// let mut parser = CommandParser::default();
    /// let nl = received.iter().position(|&b| b == b'\n').unwrap();
    /// let ping = parser.parse_shared(received.slice(..nl))?;
    /// assert!(matches!(ping, Command::Ping { .. }));
    /// let publish = parser.parse_shared(received.slice(nl + 1..received.len() - 1))?;
    /// assert!(matches!(publish, Command::Publish { ref message, .. } if &message[..] == b"{\"type\":\"t\",\"stream\":\"s\"}"));
    /// # Ok::<(), powerhub::protocol::CommandError>(())
    /// ```
    pub fn parse_shared(&mut self, line: Bytes) -> Result<Command, CommandError> {
        check_utf8(&line)?;
        if let Some(cmd) = super::fast::publish(&line) {
            return Ok(cmd);
        }
        let mut buf = line
            .try_into_mut()
            .unwrap_or_else(|shared| bytes::BytesMut::from(&shared[..]));
        parse_json(&mut buf, self.buffers())
    }

    fn buffers(&mut self) -> &mut simd_json::Buffers {
        self.buffers
            .get_or_insert_with(|| Box::new(simd_json::Buffers::new(512)))
    }
}

fn parse_with(line: &mut [u8], buffers: &mut simd_json::Buffers) -> Result<Command, CommandError> {
    check_utf8(line)?;
    // Nearly every publish: one pass, no simd-json (see `fast`); anything else, the full parser.
    if let Some(cmd) = super::fast::publish(line) {
        return Ok(cmd);
    }
    parse_json(line, buffers)
}

/// The full parser alone: every command, every error. [`parse_with`] tries the publish fast
/// path first; the fast path's tests compare the two.
#[cfg(test)]
pub(super) fn parse_full(
    line: &mut [u8],
    buffers: &mut simd_json::Buffers,
) -> Result<Command, CommandError> {
    check_utf8(line)?;
    parse_json(line, buffers)
}

/// The full parser alone with fresh buffers (for [`super::fuzzing`]).
pub(super) fn parse_full_default(line: &mut [u8]) -> Result<Command, CommandError> {
    check_utf8(line)?;
    parse_json(line, &mut simd_json::Buffers::new(512))
}

/// An invalid-UTF-8 error naming the offset (and the request id, when it can be read before it).
fn check_utf8(line: &[u8]) -> Result<(), CommandError> {
    match std::str::from_utf8(line) {
        Ok(_) => Ok(()),
        Err(e) => Err(CommandError::new(
            best_effort_id(&line[..e.valid_up_to()]),
            ErrorKind::InvalidUtf8 {
                offset: e.valid_up_to(),
            },
        )),
    }
}

/// The full parser, for a line known to be UTF-8: simd-json in place, after the member scan.
fn parse_json(line: &mut [u8], buffers: &mut simd_json::Buffers) -> Result<Command, CommandError> {
    if line.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        let what = "a command must be a JSON object";
        return Err(CommandError::new(
            None,
            ErrorKind::InvalidJson(what.to_owned()),
        ));
    }
    // Scan before simd-json rewrites the buffer in place; keep a copy of the line only to read
    // the request id back if it turns out not to be JSON.
    let ([message, id_span, rid_span], _) = members(line, ["message", "id", "requestId"]);
    let id_copy = id_span.or(rid_span).map(|r| line[r].to_vec());
    if let Some(r) = &message {
        // simd-json lets raw control bytes through inside strings; JSON does not, and the
        // message is forwarded as it is, so it must be JSON a strict reader accepts.
        if let Some(at) = control_byte_in_json(&line[r.clone()]) {
            return Err(CommandError::new(
                id_copy.as_deref().and_then(read_id),
                ErrorKind::InvalidJson(format!(
                    "message: unescaped control character at byte {at} of the message"
                )),
            ));
        }
    }
    let message_bytes = message.map(|r| one_line(&line[r]));
    let env: Envelope<'_> = match simd_json::serde::from_slice_with_buffers(line, buffers) {
        Ok(env) => env,
        Err(e) => {
            let id = id_copy.as_deref().and_then(read_id);
            return Err(CommandError::new(
                id,
                ErrorKind::InvalidJson(json_error(&e)),
            ));
        }
    };
    let id = match request_id(&env.id, "id")? {
        Some(id) => Some(id),
        None => request_id(&env.request_id, "requestId")?,
    };
    let fail = |kind| Err(CommandError::new(id.clone(), kind));
    let kind = match &env.kind {
        Loose::Str(s) => s.as_ref(),
        Loose::Absent => return fail(ErrorKind::MissingField("type")),
        other => return fail(wrong("type", "a string", other)),
    };
    match kind {
        "subscribe" => {
            let stream = match required_str(&env.stream, "stream") {
                Ok(s) => s,
                Err(k) => return fail(k),
            };
            if let Err(k) = validate_stream(&stream, "stream") {
                return fail(k);
            }
            let device_id = match &env.device_id {
                Loose::Absent | Loose::Null => None,
                Loose::Str(s) if s.is_empty() => {
                    return fail(ErrorKind::InvalidValue {
                        field: "deviceId",
                        reason: "must not be empty".into(),
                    })
                }
                Loose::Str(s) => Some(s.to_string()),
                other => return fail(wrong("deviceId", "a string", other)),
            };
            let subscription_id = match &env.subscription_id {
                Loose::Absent | Loose::Null => None,
                Loose::Str(s) if s.is_empty() => {
                    return fail(ErrorKind::InvalidValue {
                        field: "subscriptionId",
                        reason: "must not be empty".into(),
                    })
                }
                Loose::Str(s) => Some(s.to_string()),
                other => return fail(wrong("subscriptionId", "a string", other)),
            };
            Ok(Command::Subscribe {
                id,
                stream,
                device_id,
                subscription_id,
            })
        }
        "unsubscribe" => match required_str(&env.subscription_id, "subscriptionId") {
            Ok(subscription_id) => Ok(Command::Unsubscribe {
                id,
                subscription_id,
            }),
            Err(k) => fail(k),
        },
        "publish" => {
            let head = match env.message {
                MessageHead {
                    object: false,
                    got: "",
                    ..
                } => return fail(ErrorKind::MissingField("message")),
                MessageHead {
                    object: false, got, ..
                } => {
                    return fail(ErrorKind::WrongType {
                        field: "message",
                        expected: "an object",
                        got,
                    })
                }
                head => head,
            };
            let meta = match publish_meta(&head) {
                Ok(meta) => meta,
                Err(k) => return fail(k),
            };
            let Some(message) = message_bytes else {
                return fail(ErrorKind::InvalidJson(
                    "the message member could not be located".into(),
                ));
            };
            Ok(Command::Publish { id, message, meta })
        }
        "ping" => Ok(Command::Ping { id }),
        "pong" => Ok(Command::Pong { id }),
        other => fail(ErrorKind::UnknownCommand(other.to_owned())),
    }
}

/// A copy of a published message that is one line whatever framing it arrived in: a raw `\n` or
/// `\r` can only be whitespace in valid JSON (strings escape them), so it becomes a space, and an
/// NDJSON subscriber still reads one message per line.
pub(super) fn one_line(message: &[u8]) -> Bytes {
    let mut copy = message.to_vec();
    powerhub_plugin::frame::flatten_line_breaks(&mut copy);
    copy.into()
}

/// The offset of the first control byte (below 0x20) JSON forbids in `json`: any inside a
/// string, and any but tab, line feed and carriage return (whitespace) outside one. One pass
/// over bytes that are usually free of them; the string state is tracked only when one is found.
fn control_byte_in_json(json: &[u8]) -> Option<usize> {
    if !json.iter().any(|&b| b < 0x20) {
        return None;
    }
    let (mut in_string, mut escaped) = (false, false);
    for (i, &b) in json.iter().enumerate() {
        if b < 0x20 && (in_string || !matches!(b, b'\t' | b'\n' | b'\r')) {
            return Some(i);
        }
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
        } else if b == b'"' {
            in_string = true;
        }
    }
    None
}

fn publish_meta(head: &MessageHead<'_>) -> Result<PublishMeta, ErrorKind> {
    let stream = required_str(&head.stream, "message.stream")?;
    validate_stream(&stream, "message.stream")?;
    let kind = required_str(&head.kind, "message.type")?;
    let device_id = field(&head.device_id, "message.deviceId")?;
    if device_id.as_str() == Some("") {
        return Err(ErrorKind::InvalidValue {
            field: "message.deviceId",
            reason: "must not be empty".into(),
        });
    }
    let device_session_uuid = field(&head.device_session_uuid, "message.deviceSessionUuid")?;
    Ok(PublishMeta {
        stream,
        kind,
        device_id,
        device_session_uuid,
    })
}

/// Stream names are topic prefixes: non-empty, at most 256 bytes, without `/` (the separator of
/// the per-device topic).
fn validate_stream(stream: &str, field: &'static str) -> Result<(), ErrorKind> {
    let reason = if stream.is_empty() {
        "must not be empty"
    } else if stream.len() > 256 {
        "must be at most 256 bytes"
    } else if stream.contains('/') {
        "must not contain `/`"
    } else {
        return Ok(());
    };
    Err(ErrorKind::InvalidValue {
        field,
        reason: reason.into(),
    })
}

fn field(v: &Loose<'_>, name: &'static str) -> Result<Field, ErrorKind> {
    match v {
        Loose::Absent => Ok(Field::Absent),
        Loose::Null => Ok(Field::Null),
        Loose::Str(s) => Ok(Field::str(s.as_ref())),
        other => Err(wrong(name, "a string or null", other)),
    }
}

fn required_str(v: &Loose<'_>, name: &'static str) -> Result<String, ErrorKind> {
    match v {
        Loose::Str(s) => Ok(s.to_string()),
        Loose::Absent => Err(ErrorKind::MissingField(name)),
        other => Err(wrong(name, "a string", other)),
    }
}

fn request_id(v: &Loose<'_>, name: &'static str) -> Result<Option<RequestId>, CommandError> {
    match v {
        Loose::Absent | Loose::Null => Ok(None),
        Loose::Str(s) => Ok(Some(RequestId::Str(s.to_string()))),
        Loose::Int(n) => Ok(Some(RequestId::Int(*n))),
        other => Err(CommandError::new(
            None,
            wrong(name, "a string or an integer", other),
        )),
    }
}

fn wrong(field: &'static str, expected: &'static str, got: &Loose<'_>) -> ErrorKind {
    ErrorKind::WrongType {
        field,
        expected,
        got: got.type_name(),
    }
}

/// The request id of a line that failed to parse, when the top-level `id` / `requestId` member
/// can still be read.
pub(crate) fn best_effort_id(line: &[u8]) -> Option<RequestId> {
    member_span(line, "id")
        .and_then(|span| read_id(&line[span]))
        .or_else(|| member_span(line, "requestId").and_then(|span| read_id(&line[span])))
}

fn read_id(json: &[u8]) -> Option<RequestId> {
    match serde_json::from_slice::<serde_json::Value>(json).ok()? {
        serde_json::Value::String(s) => Some(RequestId::Str(s)),
        serde_json::Value::Number(n) => n.as_i64().map(RequestId::Int),
        _ => None,
    }
}

fn json_error(e: &simd_json::Error) -> String {
    let text = e.to_string();
    if text.is_empty() {
        "malformed JSON".to_owned()
    } else {
        text
    }
}

/// The command object, typed loosely so that a wrongly typed field is reported by name.
#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Loose<'a>,
    #[serde(default, borrow)]
    id: Loose<'a>,
    #[serde(rename = "requestId", default, borrow)]
    request_id: Loose<'a>,
    #[serde(default, borrow)]
    stream: Loose<'a>,
    #[serde(rename = "deviceId", default, borrow)]
    device_id: Loose<'a>,
    #[serde(rename = "subscriptionId", default, borrow)]
    subscription_id: Loose<'a>,
    #[serde(default, borrow)]
    message: MessageHead<'a>,
}

/// A JSON value of which only strings and integers are kept.
#[derive(Default)]
enum Loose<'a> {
    #[default]
    Absent,
    Null,
    Str(Cow<'a, str>),
    Int(i64),
    Other(&'static str),
}

impl Loose<'_> {
    fn type_name(&self) -> &'static str {
        match self {
            Loose::Absent => "nothing",
            Loose::Null => "null",
            Loose::Str(_) => "a string",
            Loose::Int(_) => "a number",
            Loose::Other(t) => t,
        }
    }
}

struct LooseVisitor;

impl<'de> Visitor<'de> for LooseVisitor {
    type Value = Loose<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Loose::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Loose::Str(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Loose::Str(Cow::Owned(v)))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Loose::Int(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(i64::try_from(v).map_or(Loose::Other("a number"), Loose::Int))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Loose::Other("a number"))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Loose::Other("a boolean"))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Loose::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Loose::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Loose::Other("an array"))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Loose::Other("an object"))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Loose<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(LooseVisitor)
    }
}

/// The fields of a published message the server reads; the rest is skipped.
#[derive(Default)]
struct MessageHead<'a> {
    object: bool,
    got: &'static str,
    kind: Loose<'a>,
    stream: Loose<'a>,
    device_id: Loose<'a>,
    device_session_uuid: Loose<'a>,
}

impl<'de> MessageHead<'de> {
    fn not_object(got: &'static str) -> Self {
        MessageHead {
            object: false,
            got,
            ..MessageHead::default()
        }
    }
}

struct HeadVisitor;

impl<'de> Visitor<'de> for HeadVisitor {
    type Value = MessageHead<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut head = MessageHead {
            object: true,
            got: "an object",
            ..MessageHead::default()
        };
        while let Some(key) = map.next_key::<Loose<'de>>()? {
            let slot = match &key {
                Loose::Str(k) => match k.as_ref() {
                    "type" => &mut head.kind,
                    "stream" => &mut head.stream,
                    "deviceId" => &mut head.device_id,
                    "deviceSessionUuid" => &mut head.device_session_uuid,
                    _ => {
                        map.next_value::<IgnoredAny>()?;
                        continue;
                    }
                },
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            *slot = map.next_value::<Loose<'de>>()?;
        }
        Ok(head)
    }
    fn visit_borrowed_str<E: de::Error>(self, _: &'de str) -> Result<Self::Value, E> {
        Ok(MessageHead::not_object("a string"))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(MessageHead::not_object("a string"))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(MessageHead::not_object("a number"))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(MessageHead::not_object("a number"))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(MessageHead::not_object("a number"))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(MessageHead::not_object("a boolean"))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(MessageHead::not_object("null"))
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(MessageHead::not_object("null"))
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(MessageHead::not_object("an array"))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for MessageHead<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(HeadVisitor)
    }
}
