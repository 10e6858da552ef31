//! The `code` of every error the push protocol's server sends, on every transport.
//!
//! An error is `{"type":"error","requestId":..,"code":..,"message":..}`, plus `"limit"` (the
//! config key) when `code` is [`LIMIT_EXCEEDED`]. Transports and the core build their errors
//! from these constants, and the protocol reference lists exactly [`ALL`] (a test checks both).
//!
//! ```
//! use powerhub_plugin::codes;
//! assert!(codes::ALL.contains(&codes::LIMIT_EXCEEDED));
//! ```

/// The line is not UTF-8.
pub const INVALID_UTF8: &str = "invalid_utf8";
/// The line is not a JSON object.
pub const INVALID_JSON: &str = "invalid_json";
/// A string escapes half a surrogate pair.
pub const LONE_SURROGATE: &str = "lone_surrogate";
/// A field the server reads is given twice.
pub const DUPLICATE_FIELD: &str = "duplicate_field";
/// A required field is absent.
pub const MISSING_FIELD: &str = "missing_field";
/// A field has the wrong JSON type.
pub const WRONG_TYPE: &str = "wrong_type";
/// A field has a value the protocol does not accept.
pub const INVALID_VALUE: &str = "invalid_value";
/// `type` names no command.
pub const UNKNOWN_COMMAND: &str = "unknown_command";
/// `unsubscribe` names no subscription of the connection.
pub const UNKNOWN_SUBSCRIPTION: &str = "unknown_subscription";
/// `subscriptionId` is already used on the connection.
pub const DUPLICATE_SUBSCRIPTION: &str = "duplicate_subscription";
/// The hub refused a subscription.
pub const SUBSCRIBE_FAILED: &str = "subscribe_failed";
/// The hub refused a publish.
pub const PUBLISH_FAILED: &str = "publish_failed";
/// A binary message where the protocol carries commands as text.
pub const UNSUPPORTED: &str = "unsupported";
/// A limit or a deadline was reached; the error's `limit` names the config key.
pub const LIMIT_EXCEEDED: &str = "limit_exceeded";
/// A subscription fell behind under the `disconnect` slow-consumer policy.
pub const SLOW_CONSUMER: &str = "slow_consumer";
/// The hub closed the connection's subscriptions.
pub const HUB_CLOSED: &str = "hub_closed";
/// The server shuts down.
pub const SHUTDOWN: &str = "shutdown";
/// The server failed while handling the connection (a fault of the server or of a transport
/// plugin, caught on the connection's shard): the connection closes, the others go on.
pub const INTERNAL_ERROR: &str = "internal_error";
/// The binary frame protocol: a frame that cannot be decoded.
pub const BAD_FRAME: &str = "bad_frame";
/// NDJSON input that cannot be framed into lines.
pub const FATAL: &str = "fatal";
/// A TLS handshake arrived on a listener without TLS; the connection closes.
pub const TLS_NOT_ENABLED: &str = "tls_not_enabled";
/// Authentication is on and the connection has not authenticated: only `auth`, `ping` and
/// `pong` are accepted until it does.
pub const AUTH_REQUIRED: &str = "auth_required";
/// A publish or subscribe the connection's user may not make; the error names the stream.
pub const PERMISSION_DENIED: &str = "permission_denied";
/// A published message whose `type` is one of the server's reply types (`error`, `pong`, ...),
/// refused so that no client can pass for the server.
pub const RESERVED_TYPE: &str = "reserved_type";
/// A fresh token on an authenticated connection names another user.
pub const USER_MISMATCH: &str = "user_mismatch";
/// No static token matches, and the token is not a JWT this server verifies.
pub const UNKNOWN_TOKEN: &str = "unknown_token";
/// A JWT whose signature does not verify.
pub const BAD_SIGNATURE: &str = "bad_signature";
/// A token past its `exp`; also the close of a connection whose token expired.
pub const TOKEN_EXPIRED: &str = "token_expired";
/// The close of a connection whose client certificate (mutual TLS) passed its `notAfter`.
pub const CERTIFICATE_EXPIRED: &str = "certificate_expired";
/// A JWT before its `nbf`.
pub const TOKEN_NOT_YET_VALID: &str = "token_not_yet_valid";
/// A JWT for another audience.
pub const WRONG_AUDIENCE: &str = "wrong_audience";
/// A JWT from another issuer.
pub const WRONG_ISSUER: &str = "wrong_issuer";
/// A token that is not a well-formed JWT (parts, base64url, JSON, claim types, length).
pub const MALFORMED_TOKEN: &str = "malformed_token";
/// A JWT whose header says `alg: none`.
pub const ALG_NONE: &str = "alg_none";
/// A JWT signed with another algorithm than the server's.
pub const ALGORITHM_NOT_ALLOWED: &str = "algorithm_not_allowed";
/// A JWT without a `sub`.
pub const MISSING_SUB: &str = "missing_sub";
/// A JWT without an `exp`, on a server that requires one (`[auth.jwt] require_exp`).
pub const MISSING_EXP: &str = "missing_exp";
/// A JWT whose permissions claim is not a permission set.
pub const INVALID_PERMISSIONS: &str = "invalid_permissions";

/// Every code, in the order the protocol reference lists them.
pub const ALL: &[&str] = &[
    INVALID_UTF8,
    INVALID_JSON,
    LONE_SURROGATE,
    DUPLICATE_FIELD,
    MISSING_FIELD,
    WRONG_TYPE,
    INVALID_VALUE,
    UNKNOWN_COMMAND,
    UNKNOWN_SUBSCRIPTION,
    DUPLICATE_SUBSCRIPTION,
    SUBSCRIBE_FAILED,
    PUBLISH_FAILED,
    UNSUPPORTED,
    LIMIT_EXCEEDED,
    SLOW_CONSUMER,
    HUB_CLOSED,
    SHUTDOWN,
    INTERNAL_ERROR,
    BAD_FRAME,
    FATAL,
    TLS_NOT_ENABLED,
    AUTH_REQUIRED,
    PERMISSION_DENIED,
    RESERVED_TYPE,
    USER_MISMATCH,
    UNKNOWN_TOKEN,
    BAD_SIGNATURE,
    TOKEN_EXPIRED,
    CERTIFICATE_EXPIRED,
    TOKEN_NOT_YET_VALID,
    WRONG_AUDIENCE,
    WRONG_ISSUER,
    MALFORMED_TOKEN,
    ALG_NONE,
    ALGORITHM_NOT_ALLOWED,
    MISSING_SUB,
    MISSING_EXP,
    INVALID_PERMISSIONS,
];

/// At most this many bytes of a client's text are quoted in an error (or an HTTP refusal).
pub const MAX_ECHO_BYTES: usize = 128;

/// `text`, cut to [`MAX_ECHO_BYTES`] at a character boundary, with `…` when cut: an error never
/// echoes unbounded client text.
///
/// ```
/// use powerhub_plugin::codes::echo;
/// assert_eq!(echo("short"), "short");
/// assert_eq!(echo(&"é".repeat(100)), format!("{}…", "é".repeat(64)));
/// ```
pub fn echo(text: &str) -> String {
    if text.len() <= MAX_ECHO_BYTES {
        return text.to_owned();
    }
    let mut end = MAX_ECHO_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}
