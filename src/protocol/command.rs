//! Client commands: the typed form and the parser (the publish fast path, then the full reader).

use std::borrow::Cow;
use std::fmt;

use powerhub_plugin::codes;

use super::json::{self, JsonError, Kind, Token};
use crate::outbox::Field;
use crate::security::auth::AuthError;
use crate::security::permissions::PermissionDenied;
use bytes::Bytes;

/// The correlation id a client puts in a command's `id` (or `requestId`): a string or a number.
/// Replies carry it back as `requestId`, exactly as it was sent.
///
/// ```
/// use powerhub::protocol::RequestId;
///
/// assert_eq!(RequestId::number("42"), RequestId::Int(42));
/// // Any JSON number is an id; one that is not an `i64` integer is kept as written.
/// let big = RequestId::number("18446744073709551616");
/// let mut out = Vec::new();
/// big.write_json(&mut out);
/// assert_eq!(out, b"18446744073709551616");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RequestId {
    /// A string id.
    Str(String),
    /// An integer id that fits an `i64`, written as Rust writes it.
    Int(i64),
    /// Any other JSON number (`-0`, `1.5`, `1e3`, an integer past `i64`), as the client wrote it.
    Number(String),
}

impl RequestId {
    /// The id of a JSON number written as `text`: [`RequestId::Int`] when that is how the
    /// integer is written anyway, [`RequestId::Number`] otherwise, so the echo is exact.
    pub fn number(text: &str) -> Self {
        match text.parse::<i64>() {
            Ok(n) if n.to_string() == text => RequestId::Int(n),
            _ => RequestId::Number(text.to_owned()),
        }
    }

    /// Appends the id as a JSON value.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        match self {
            RequestId::Str(s) => crate::outbox::write_json_str(out, s),
            RequestId::Int(n) => out.extend_from_slice(n.to_string().as_bytes()),
            RequestId::Number(text) => out.extend_from_slice(text.as_bytes()),
        }
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestId::Str(s) => write!(f, "{s:?}"),
            RequestId::Int(n) => write!(f, "{n}"),
            RequestId::Number(text) => f.write_str(text),
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
    /// `{"type":"auth","id":..,"token":"…"}`: authenticate the connection (or refresh its
    /// token) with a static token or a JWT.
    Auth {
        /// The correlation id.
        id: Option<RequestId>,
        /// The token as presented. `Debug` shows its length only.
        token: Credential,
    },
}

/// A presented credential: a string whose `Debug` never shows it (commands are logged).
#[derive(Clone, PartialEq, Eq)]
pub struct Credential(pub String);

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credential({} bytes)", self.0.len())
    }
}

impl Command {
    /// The command's correlation id.
    pub fn request_id(&self) -> Option<&RequestId> {
        match self {
            Command::Subscribe { id, .. }
            | Command::Unsubscribe { id, .. }
            | Command::Publish { id, .. }
            | Command::Ping { id }
            | Command::Pong { id }
            | Command::Auth { id, .. } => id.as_ref(),
        }
    }
}

/// The `code` of every error about a limit; its `limit` field names the config key.
pub const LIMIT_EXCEEDED: &str = codes::LIMIT_EXCEEDED;

/// Every `code` an error reply of the server can carry, as docs/protocol.md lists them
/// ([`powerhub_plugin::codes`]).
pub const ERROR_CODES: &[&str] = codes::ALL;

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
    #[error("line of {size} bytes exceeds the limit max_message_bytes = {limit}")]
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
    #[error(
        "too many subscriptions: the limit max_subscriptions_per_connection = {limit} is reached"
    )]
    TooManySubscriptions {
        /// The limit.
        limit: usize,
    },
    /// The line nests arrays and objects deeper than the limit (the connection stays usable).
    #[error("JSON nested deeper than the limit max_json_depth = {limit}")]
    TooDeep {
        /// The limit.
        limit: usize,
    },
    /// A string escapes half of a UTF-16 surrogate pair without the other half.
    #[error("lone surrogate escape at byte {offset}: a `\\u` escape of U+D800 to U+DFFF must be one half of a pair")]
    LoneSurrogate {
        /// Offset of the escape's backslash.
        offset: usize,
    },
    /// A field the server reads is given twice.
    #[error("duplicate field `{0}`")]
    DuplicateField(&'static str),
    /// A line could not even be framed (longer than the framing limit): the connection closes.
    #[error("{0}; closing the connection")]
    Fatal(String),
    /// Authentication is on and the connection has not authenticated yet.
    #[error("authenticate first: send {{\"type\":\"auth\",\"token\":\"…\"}} (only auth, ping and pong are accepted until then)")]
    AuthRequired,
    /// The token was refused.
    #[error("{0}")]
    Auth(#[from] AuthError),
    /// A fresh token on an authenticated connection names another user.
    #[error("the token is for user `{presented}`, the connection is authenticated as `{current}`; a connection keeps its user")]
    UserMismatch {
        /// The connection's user.
        current: String,
        /// The fresh token's user.
        presented: String,
    },
    /// The user may not publish or subscribe there.
    #[error("{0}")]
    PermissionDenied(#[from] PermissionDenied),
    /// A publish over one of the connection's rate limits (the connection stays).
    #[error("publish refused: over {limit} = {rate}")]
    RateLimited {
        /// The config key.
        limit: &'static str,
        /// Its value.
        rate: u64,
    },
    /// A published message has the `type` of one of the server's own messages.
    #[error("`message.type` {0:?} is the type of a server message (refused so that no publisher can pass for the server; see [auth] allow_reply_types)")]
    ReservedType(&'static str),
}

impl ErrorKind {
    /// The stable machine-readable code of the error reply's `code` field.
    pub fn code(&self) -> &'static str {
        match self {
            ErrorKind::InvalidUtf8 { .. } => codes::INVALID_UTF8,
            ErrorKind::InvalidJson(_) => codes::INVALID_JSON,
            ErrorKind::MissingField(_) => codes::MISSING_FIELD,
            ErrorKind::WrongType { .. } => codes::WRONG_TYPE,
            ErrorKind::InvalidValue { .. } => codes::INVALID_VALUE,
            ErrorKind::UnknownCommand(_) => codes::UNKNOWN_COMMAND,
            // Every limit has one code; the reply's `limit` names which.
            ErrorKind::LineTooLong { .. }
            | ErrorKind::TooManySubscriptions { .. }
            | ErrorKind::TooDeep { .. }
            | ErrorKind::RateLimited { .. } => LIMIT_EXCEEDED,
            ErrorKind::UnknownSubscription(_) => codes::UNKNOWN_SUBSCRIPTION,
            ErrorKind::DuplicateSubscription(_) => codes::DUPLICATE_SUBSCRIPTION,
            ErrorKind::LoneSurrogate { .. } => codes::LONE_SURROGATE,
            ErrorKind::DuplicateField(_) => codes::DUPLICATE_FIELD,
            ErrorKind::Fatal(_) => codes::FATAL,
            ErrorKind::AuthRequired => codes::AUTH_REQUIRED,
            ErrorKind::Auth(e) => e.code(),
            ErrorKind::UserMismatch { .. } => codes::USER_MISMATCH,
            ErrorKind::PermissionDenied(_) => codes::PERMISSION_DENIED,
            ErrorKind::ReservedType(_) => codes::RESERVED_TYPE,
        }
    }

    /// The config key of the limit the error is about, for the error reply's `limit` field.
    pub fn limit(&self) -> Option<&'static str> {
        match self {
            // The server's config key (it sets `SessionConfig::max_line_bytes` from it).
            ErrorKind::LineTooLong { .. } => Some("max_message_bytes"),
            ErrorKind::TooManySubscriptions { .. } => Some("max_subscriptions_per_connection"),
            ErrorKind::TooDeep { .. } => Some("max_json_depth"),
            ErrorKind::RateLimited { limit, .. } => Some(limit),
            _ => None,
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
        super::reply::error_with_limit(
            self.request_id.as_ref(),
            self.kind.code(),
            &self.kind.to_string(),
            self.kind.limit(),
        )
    }
}

/// Parses one NDJSON line (without its newline) into a [`Command`].
///
/// A `publish` of the usual shape is read in one validating pass over the line (no escapes in
/// the fields the server reads, no `\u` escape anywhere, no repeated key); every other line is
/// read by the full parser, one iterative pass that no nesting can overflow. Both give the same
/// result where both apply. Unknown fields are ignored. A `publish` message is copied out
/// verbatim, so subscribers read exactly the bytes the publisher wrote. Errors name the problem
/// and carry the request id when it could be read (also from a line that is not valid JSON, when
/// the id came before the error). The rules for strings, keys, numbers and nesting are in
/// docs/protocol.md.
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

/// The default for [`CommandParser::max_depth`]: as serde_json's recursion limit.
pub const DEFAULT_MAX_JSON_DEPTH: usize = 128;

/// A [`parse_command`] with its limits: how deep a line may nest.
///
/// ```
/// use powerhub::protocol::{CommandParser, ErrorKind};
///
/// let mut parser = CommandParser::default().max_depth(4);
/// let mut line = br#"{"type":"ping","id":1,"x":[[[[1]]]]}"#.to_vec();
/// let err = parser.parse(&mut line).unwrap_err();
/// assert_eq!(err.kind, ErrorKind::TooDeep { limit: 4 });
/// assert_eq!(err.request_id, Some(powerhub::protocol::RequestId::Int(1)));
/// ```
#[derive(Debug, Clone, Copy)]
pub struct CommandParser {
    max_depth: usize,
}

impl Default for CommandParser {
    fn default() -> Self {
        CommandParser {
            max_depth: DEFAULT_MAX_JSON_DEPTH,
        }
    }
}

impl CommandParser {
    /// The parser refusing lines nested deeper than `depth` (the command object is depth 1;
    /// at least 2 is used, so that a message can be an object).
    #[must_use]
    pub fn max_depth(mut self, depth: usize) -> Self {
        self.max_depth = depth.max(2);
        self
    }

    /// Parses one line, as [`parse_command`] does.
    pub fn parse(&mut self, line: &mut [u8]) -> Result<Command, CommandError> {
        self.parse_bytes(line)
    }

    /// Parses a line that may share its bytes with other lines (a slice of one receive), where
    /// it lies: nothing is copied but a publish's message.
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
        self.parse_bytes(&line)
    }

    pub(super) fn parse_bytes(&self, line: &[u8]) -> Result<Command, CommandError> {
        // Nearly every publish: one pass that checks the UTF-8 too (see `fast`); anything else,
        // and every error, the full parser.
        if let Some(cmd) = super::fast::publish(line, self.max_depth) {
            return Ok(cmd);
        }
        check_utf8(line)?;
        parse_json(line, self.max_depth)
    }
}

/// The full parser alone with the default limits: every command, every error (for the fast
/// path's tests and [`super::fuzzing`]).
pub(super) fn parse_full_default(line: &[u8]) -> Result<Command, CommandError> {
    check_utf8(line)?;
    parse_json(line, DEFAULT_MAX_JSON_DEPTH)
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

/// A member's value as the command reads it.
enum Value<'a> {
    Absent,
    Null,
    Str(Cow<'a, str>),
    Other(&'static str),
}

impl Value<'_> {
    fn type_name(&self) -> &'static str {
        match self {
            Value::Absent => "nothing",
            Value::Null => "null",
            Value::Str(_) => "a string",
            Value::Other(t) => t,
        }
    }
}

fn value(line: &[u8], token: Option<Token>) -> Value<'_> {
    match token {
        None => Value::Absent,
        Some(t) if t.kind == Kind::Null => Value::Null,
        Some(t) => t
            .string(line)
            .map_or(Value::Other(t.type_name()), Value::Str),
    }
}

/// The full parser, for a line known to be UTF-8: the JSON reader, then the command's fields.
fn parse_json(line: &[u8], max_depth: usize) -> Result<Command, CommandError> {
    let (doc, read) = json::read(line, max_depth);
    // The id, when it was read before any error, and the token it was read from.
    let (id, id_token) = match request_id(line, doc.top[1], "id") {
        Ok(Some(id)) => (Ok(Some(id)), doc.top[1]),
        Ok(None) => (request_id(line, doc.top[2], "requestId"), doc.top[2]),
        Err(e) => (Err(e), doc.top[1]),
    };
    if let Err(e) = read {
        // An id read before the error is echoed only if the reader got past it: in `"id":01`
        // and `"id":12abc` the reader stops inside the token, and `0` or `12` is not what the
        // client sent. A string ends at its closing quote, and a number where the line ends or
        // JSON's punctuation or whitespace follows, so an error just there leaves the id whole
        // (`{"type":"ping","id":"x"` cut short, `"id":7]`).
        let error_at = match e {
            JsonError::Syntax { at, .. }
            | JsonError::TooDeep { at, .. }
            | JsonError::LoneSurrogate { at } => at,
            JsonError::Duplicate { .. } => usize::MAX,
        };
        let whole = |t: Token| {
            error_at > t.end
                || (error_at == t.end
                    && (matches!(t.kind, Kind::String { .. })
                        || line
                            .get(t.end)
                            .is_none_or(|b| b" \t\r\n,:[]{}\"".contains(b))))
        };
        let id = if id_token.is_none_or(whole) {
            id
        } else {
            Ok(None)
        };
        let kind = match e {
            JsonError::Syntax { at, what } => {
                ErrorKind::InvalidJson(format!("expected {what} at byte {at}"))
            }
            JsonError::TooDeep { limit, .. } => ErrorKind::TooDeep { limit },
            JsonError::LoneSurrogate { at } => ErrorKind::LoneSurrogate { offset: at },
            JsonError::Duplicate { field } => ErrorKind::DuplicateField(field),
        };
        return Err(CommandError::new(id.unwrap_or(None), kind));
    }
    let id = id?;
    if doc.top[1].is_some() && doc.top[2].is_some() {
        // `requestId` is another name for `id`: both given (even one `null`) is one field given
        // twice, named by the alias, the one a reader would take out.
        return Err(CommandError::new(
            id,
            ErrorKind::DuplicateField("requestId"),
        ));
    }
    let top = |k: usize| value(line, doc.top[k]);
    let fail = |kind| Err(CommandError::new(id.clone(), kind));
    let kind = match top(0) {
        Value::Str(s) => s,
        Value::Absent => return fail(ErrorKind::MissingField("type")),
        other => return fail(wrong("type", "a string", &other)),
    };
    match kind.as_ref() {
        "subscribe" => {
            let stream = match required_str(top(3), "stream") {
                Ok(s) => s,
                Err(k) => return fail(k),
            };
            if let Err(k) = validate_stream(&stream, "stream") {
                return fail(k);
            }
            let device_id = match optional_str(top(4), "deviceId", "a string or null") {
                Ok(d) => d,
                Err(k) => return fail(k),
            };
            let subscription_id = match optional_str(top(5), "subscriptionId", "a string or null") {
                Ok(s) => s,
                Err(k) => return fail(k),
            };
            Ok(Command::Subscribe {
                id,
                stream,
                device_id,
                subscription_id,
            })
        }
        // Required here: `null` is no id (the missing field's error below).
        "unsubscribe" => match optional_str(top(5), "subscriptionId", "a string") {
            Ok(Some(subscription_id)) => Ok(Command::Unsubscribe {
                id,
                subscription_id,
            }),
            Ok(None) => fail(
                required_str(top(5), "subscriptionId")
                    .err()
                    .unwrap_or(ErrorKind::MissingField("subscriptionId")),
            ),
            Err(k) => fail(k),
        },
        "publish" => {
            let message = match doc.top[json::MESSAGE] {
                None => return fail(ErrorKind::MissingField("message")),
                Some(t) if t.kind != Kind::Object => {
                    return fail(ErrorKind::WrongType {
                        field: "message",
                        expected: "an object",
                        got: t.type_name(),
                    })
                }
                Some(t) => t,
            };
            if let Some(field) = doc.head_repeated {
                return fail(ErrorKind::DuplicateField(field));
            }
            let meta = match publish_meta(line, &doc) {
                Ok(meta) => meta,
                Err(k) => return fail(k),
            };
            Ok(Command::Publish {
                id,
                message: one_line(&line[message.start..message.end]),
                meta,
            })
        }
        "ping" => Ok(Command::Ping { id }),
        "pong" => Ok(Command::Pong { id }),
        "auth" => match required_str(top(json::TOKEN), "token") {
            Ok(token) => Ok(Command::Auth {
                id,
                token: Credential(token),
            }),
            Err(k) => fail(k),
        },
        other => fail(ErrorKind::UnknownCommand(echo(other))),
    }
}

/// At most this many bytes of a client's text are echoed in an error.
pub const MAX_ECHO_BYTES: usize = codes::MAX_ECHO_BYTES;

pub(crate) use codes::echo;

/// A copy of a published message that is one line whatever framing it arrived in: a raw `\n` or
/// `\r` can only be whitespace in valid JSON (strings escape them), so it becomes a space, and an
/// NDJSON subscriber still reads one message per line.
pub(super) fn one_line(message: &[u8]) -> Bytes {
    let mut copy = message.to_vec();
    powerhub_plugin::frame::flatten_line_breaks(&mut copy);
    copy.into()
}

/// The `type` of a line that is a JSON object whose `type` is a string, else `None` (for the
/// session's answer to a command before authentication; the line's other faults aside).
pub(super) fn command_type(line: &[u8], max_depth: usize) -> Option<String> {
    let (doc, read) = json::read(line, max_depth);
    if matches!(read, Err(ref e) if !matches!(e, json::JsonError::Duplicate { .. })) {
        return None;
    }
    match value(line, doc.top[0]) {
        Value::Str(s) => Some(s.into_owned()),
        _ => None,
    }
}

fn publish_meta(line: &[u8], doc: &json::Doc) -> Result<PublishMeta, ErrorKind> {
    let head = |k: usize| value(line, doc.head[k]);
    let stream = required_str(head(1), "message.stream")?;
    validate_stream(&stream, "message.stream")?;
    let kind = required_str(head(0), "message.type")?;
    let device_id = field(head(2), "message.deviceId")?;
    if let Some(d) = device_id.as_str() {
        let reason = match d.len() {
            0 => "must not be empty",
            n if n > MAX_NAME_BYTES => "must be at most 256 bytes",
            _ => "",
        };
        if !reason.is_empty() {
            return Err(ErrorKind::InvalidValue {
                field: "message.deviceId",
                reason: reason.into(),
            });
        }
    }
    let device_session_uuid = field(head(3), "message.deviceSessionUuid")?;
    Ok(PublishMeta {
        stream,
        kind,
        device_id,
        device_session_uuid,
    })
}

/// The longest stream name, device id or subscription id, in bytes: names are kept for as long
/// as a subscription lives (several copies: the session's, the hub's topic and id), so a client
/// cannot make them large.
pub const MAX_NAME_BYTES: usize = 256;

/// Stream names are topic prefixes: non-empty, at most [`MAX_NAME_BYTES`], without `/` (the
/// separator of the per-device topic).
fn validate_stream(stream: &str, field: &'static str) -> Result<(), ErrorKind> {
    let reason = if stream.is_empty() {
        "must not be empty"
    } else if stream.len() > MAX_NAME_BYTES {
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

fn field(v: Value<'_>, name: &'static str) -> Result<Field, ErrorKind> {
    match v {
        Value::Absent => Ok(Field::Absent),
        Value::Null => Ok(Field::Null),
        Value::Str(s) => Ok(Field::str(s.as_ref())),
        other => Err(wrong(name, "a string or null", &other)),
    }
}

fn required_str(v: Value<'_>, name: &'static str) -> Result<String, ErrorKind> {
    match v {
        Value::Str(s) => Ok(s.into_owned()),
        Value::Absent => Err(ErrorKind::MissingField(name)),
        other => Err(wrong(name, "a string", &other)),
    }
}

/// An optional name: absent or `null` is `None`; a string must be 1 to [`MAX_NAME_BYTES`] bytes.
/// Another type is refused as not `expected` (what the command accepts there).
fn optional_str(
    v: Value<'_>,
    name: &'static str,
    expected: &'static str,
) -> Result<Option<String>, ErrorKind> {
    match v {
        Value::Absent | Value::Null => Ok(None),
        Value::Str(s) if s.is_empty() => Err(ErrorKind::InvalidValue {
            field: name,
            reason: "must not be empty".into(),
        }),
        Value::Str(s) if s.len() > MAX_NAME_BYTES => Err(ErrorKind::InvalidValue {
            field: name,
            reason: "must be at most 256 bytes".into(),
        }),
        Value::Str(s) => Ok(Some(s.into_owned())),
        other => Err(wrong(name, expected, &other)),
    }
}

/// The request id in `token`: a string, or a number kept as written.
fn request_id(
    line: &[u8],
    token: Option<Token>,
    name: &'static str,
) -> Result<Option<RequestId>, CommandError> {
    let Some(t) = token else {
        return Ok(None);
    };
    match t.kind {
        Kind::Null => Ok(None),
        Kind::Integer | Kind::Number => Ok(Some(RequestId::number(t.text(line)))),
        Kind::String { .. } => Ok(t.string(line).map(|s| RequestId::Str(s.into_owned()))),
        _ => Err(CommandError::new(
            None,
            ErrorKind::WrongType {
                field: name,
                expected: "a string or a number",
                got: t.type_name(),
            },
        )),
    }
}

fn wrong(field: &'static str, expected: &'static str, got: &Value<'_>) -> ErrorKind {
    ErrorKind::WrongType {
        field,
        expected,
        got: got.type_name(),
    }
}

/// The request id of a line that failed before the parser (not UTF-8, too long), when the
/// top-level `id` / `requestId` member can still be read.
pub(crate) fn best_effort_id(line: &[u8]) -> Option<RequestId> {
    let (doc, _) = json::read(line, DEFAULT_MAX_JSON_DEPTH);
    request_id(line, doc.top[1], "id")
        .ok()
        .flatten()
        .or_else(|| request_id(line, doc.top[2], "requestId").ok().flatten())
}

#[cfg(test)]
mod tests {
    use super::{ErrorKind, ERROR_CODES};

    /// Every error a command can get has a code of the documented list (docs_match checks the
    /// list against docs/protocol.md).
    #[test]
    fn every_error_kind_has_a_listed_code() {
        let kinds = [
            ErrorKind::InvalidUtf8 { offset: 0 },
            ErrorKind::InvalidJson(String::new()),
            ErrorKind::MissingField("f"),
            ErrorKind::WrongType {
                field: "f",
                expected: "e",
                got: "g",
            },
            ErrorKind::InvalidValue {
                field: "f",
                reason: String::new(),
            },
            ErrorKind::UnknownCommand(String::new()),
            ErrorKind::LineTooLong { size: 2, limit: 1 },
            ErrorKind::UnknownSubscription(String::new()),
            ErrorKind::DuplicateSubscription(String::new()),
            ErrorKind::TooManySubscriptions { limit: 1 },
            ErrorKind::TooDeep { limit: 1 },
            ErrorKind::LoneSurrogate { offset: 0 },
            ErrorKind::DuplicateField("f"),
            ErrorKind::Fatal(String::new()),
            ErrorKind::AuthRequired,
            ErrorKind::UserMismatch {
                current: String::new(),
                presented: String::new(),
            },
            ErrorKind::PermissionDenied(
                crate::security::permissions::Permissions::none()
                    .check(crate::security::permissions::Action::Publish, "s", None)
                    .unwrap_err(),
            ),
            ErrorKind::ReservedType("error"),
            ErrorKind::RateLimited {
                limit: "publish_messages_per_second",
                rate: 1,
            },
        ];
        let auth_kinds = crate::security::auth::AuthError::CODES.iter().map(|code| {
            assert!(ERROR_CODES.contains(code), "{code}");
        });
        assert_eq!(auth_kinds.count(), 12);
        for kind in kinds {
            // An exhaustive match: a new kind must be added above.
            match kind {
                ErrorKind::InvalidUtf8 { .. }
                | ErrorKind::InvalidJson(_)
                | ErrorKind::MissingField(_)
                | ErrorKind::WrongType { .. }
                | ErrorKind::InvalidValue { .. }
                | ErrorKind::UnknownCommand(_)
                | ErrorKind::LineTooLong { .. }
                | ErrorKind::UnknownSubscription(_)
                | ErrorKind::DuplicateSubscription(_)
                | ErrorKind::TooManySubscriptions { .. }
                | ErrorKind::TooDeep { .. }
                | ErrorKind::LoneSurrogate { .. }
                | ErrorKind::DuplicateField(_)
                | ErrorKind::Fatal(_)
                | ErrorKind::AuthRequired
                | ErrorKind::Auth(_)
                | ErrorKind::UserMismatch { .. }
                | ErrorKind::PermissionDenied(_)
                | ErrorKind::ReservedType(_)
                | ErrorKind::RateLimited { .. } => {}
            }
            assert!(ERROR_CODES.contains(&kind.code()), "{kind:?}");
            assert_eq!(kind.limit().is_some(), kind.code() == super::LIMIT_EXCEEDED);
        }
    }

    /// A subscribe's `deviceId` and `subscriptionId` take `null` as absent: a value of another
    /// type is told so (the error says what is accepted).
    #[test]
    fn an_optional_name_of_the_wrong_type_is_told_that_null_is_accepted_too() {
        for (line, field) in [
            (
                r#"{"type":"subscribe","id":1,"stream":"s","deviceId":5}"#,
                "deviceId",
            ),
            (
                r#"{"type":"subscribe","id":1,"stream":"s","subscriptionId":[]}"#,
                "subscriptionId",
            ),
        ] {
            let err = super::parse_full_default(line.as_bytes()).unwrap_err();
            let text = err.kind.to_string();
            assert!(
                text.starts_with(&format!("field `{field}` must be a string or null, got")),
                "{line}: {text}"
            );
        }
        // On `unsubscribe` the id is required: `null` is none, and a wrong type is told so.
        let line = br#"{"type":"unsubscribe","id":1,"subscriptionId":true}"#;
        assert_eq!(
            super::parse_full_default(line)
                .unwrap_err()
                .kind
                .to_string(),
            "field `subscriptionId` must be a string, got a boolean"
        );
        for line in [
            r#"{"type":"subscribe","id":1,"stream":"s","deviceId":null}"#,
            r#"{"type":"subscribe","id":1,"stream":"s","subscriptionId":null}"#,
        ] {
            assert!(super::parse_full_default(line.as_bytes()).is_ok(), "{line}");
        }
    }
}
