//! Builders for the server's messages (one JSON object each, no trailing newline).
//!
//! Hand-written with serde_json's string escaping: field order is fixed and documented in the
//! protocol reference, and `requestId` is the client's `id` unchanged.

use bytes::Bytes;

use super::command::RequestId;
use crate::outbox::write_json_str;

fn start(kind: &str, request_id: Option<&RequestId>) -> Vec<u8> {
    let mut out = Vec::with_capacity(96);
    out.extend_from_slice(br#"{"type":"#);
    write_json_str(&mut out, kind);
    if let Some(id) = request_id {
        out.extend_from_slice(br#","requestId":"#);
        id.write_json(&mut out);
    }
    out
}

fn str_field(out: &mut Vec<u8>, name: &str, value: &str) {
    out.push(b',');
    write_json_str(out, name);
    out.push(b':');
    write_json_str(out, value);
}

/// `{"type":"subscribed"[,"requestId":..],"subscriptionId":..,"stream":..[,"deviceId":..]}`.
///
/// ```
/// use powerhub::protocol::{reply, RequestId};
/// let r = reply::subscribed(Some(&RequestId::Int(1)), "obs-1", "obs", Some("d1"));
/// assert_eq!(&r[..], br#"{"type":"subscribed","requestId":1,"subscriptionId":"obs-1","stream":"obs","deviceId":"d1"}"#);
/// ```
pub fn subscribed(
    request_id: Option<&RequestId>,
    subscription_id: &str,
    stream: &str,
    device_id: Option<&str>,
) -> Bytes {
    let mut out = start("subscribed", request_id);
    str_field(&mut out, "subscriptionId", subscription_id);
    str_field(&mut out, "stream", stream);
    if let Some(device) = device_id {
        str_field(&mut out, "deviceId", device);
    }
    out.push(b'}');
    out.into()
}

/// `{"type":"unsubscribed"[,"requestId":..],"subscriptionId":..}`.
pub fn unsubscribed(request_id: Option<&RequestId>, subscription_id: &str) -> Bytes {
    let mut out = start("unsubscribed", request_id);
    str_field(&mut out, "subscriptionId", subscription_id);
    out.push(b'}');
    out.into()
}

/// `{"type":"published"[,"requestId":..],"delivered":N}`: `N` is the number of subscriptions
/// the message was queued for.
pub fn published(request_id: Option<&RequestId>, delivered: usize) -> Bytes {
    let mut out = start("published", request_id);
    out.extend_from_slice(br#","delivered":"#);
    out.extend_from_slice(delivered.to_string().as_bytes());
    out.push(b'}');
    out.into()
}

/// `{"type":"pong"[,"requestId":..]}`: the answer to a client `ping`.
pub fn pong(request_id: Option<&RequestId>) -> Bytes {
    let mut out = start("pong", request_id);
    out.push(b'}');
    out.into()
}

/// `{"type":"authenticated"[,"requestId":..],"user":..,"expiresAt":<unix seconds or null>}`: the
/// answer to an `auth` command (or to a token given in the WebSocket handshake). `expiresAt` is
/// when the connection will be closed with `token_expired` unless a fresh token arrives.
///
/// ```
/// use powerhub::protocol::{reply, RequestId};
/// let r = reply::authenticated(Some(&RequestId::Int(1)), "alice", Some(1_700_000_060));
/// assert_eq!(&r[..], br#"{"type":"authenticated","requestId":1,"user":"alice","expiresAt":1700000060}"#);
/// let r = reply::authenticated(None, "dashboard", None);
/// assert_eq!(&r[..], br#"{"type":"authenticated","user":"dashboard","expiresAt":null}"#);
/// ```
pub fn authenticated(request_id: Option<&RequestId>, user: &str, expires_at: Option<u64>) -> Bytes {
    let mut out = start("authenticated", request_id);
    str_field(&mut out, "user", user);
    out.extend_from_slice(br#","expiresAt":"#);
    match expires_at {
        Some(t) => out.extend_from_slice(t.to_string().as_bytes()),
        None => out.extend_from_slice(b"null"),
    }
    out.push(b'}');
    out.into()
}

/// `{"type":"ping"}`: the server's keepalive ([`crate::outbox::PING_JSON`]).
pub fn ping() -> Bytes {
    Bytes::from_static(crate::outbox::PING_JSON)
}

/// `{"type":"error","requestId":<id or null>,"code":..,"message":..}`.
///
/// ```
/// use powerhub::protocol::reply;
/// let r = reply::error(None, "invalid_json", "invalid JSON: expected `:`");
/// assert_eq!(&r[..], br#"{"type":"error","requestId":null,"code":"invalid_json","message":"invalid JSON: expected `:`"}"#);
/// ```
pub fn error(request_id: Option<&RequestId>, code: &str, message: &str) -> Bytes {
    error_with_limit(request_id, code, message, None)
}

/// Whether `reply` is a `limit_exceeded` error as [`error_with_limit`] writes it (the server
/// counts them in its `limit_errors`). Escaped strings (an echoed string id, the message)
/// cannot hold the unescaped `,"code":"` this looks for, so only the code field matches.
///
/// ```
/// use powerhub::protocol::{reply, RequestId};
/// let r = reply::error_with_limit(None, "limit_exceeded", "too deep", Some("max_json_depth"));
/// assert!(reply::is_limit_error(&r));
/// let id = RequestId::Str(r#"","code":"limit_exceeded","#.into());
/// assert!(!reply::is_limit_error(&reply::error(Some(&id), "invalid_json", "bad")));
/// ```
pub fn is_limit_error(reply: &[u8]) -> bool {
    const LIMIT_CODE: &[u8] = br#","code":"limit_exceeded","#;
    reply.starts_with(br#"{"type":"error","requestId":"#)
        && memchr::memmem::find(reply, LIMIT_CODE).is_some()
}

/// An error about a limit: [`error`] with `"limit":<the config key>` after the message.
///
/// ```
/// use powerhub::protocol::{reply, RequestId};
/// let r = reply::error_with_limit(Some(&RequestId::Int(3)), "limit_exceeded", "line too long", Some("max_message_bytes"));
/// assert_eq!(&r[..], br#"{"type":"error","requestId":3,"code":"limit_exceeded","message":"line too long","limit":"max_message_bytes"}"#);
/// ```
pub fn error_with_limit(
    request_id: Option<&RequestId>,
    code: &str,
    message: &str,
    limit: Option<&str>,
) -> Bytes {
    let mut out = Vec::with_capacity(64 + message.len());
    out.extend_from_slice(br#"{"type":"error","requestId":"#);
    match request_id {
        Some(id) => id.write_json(&mut out),
        None => out.extend_from_slice(b"null"),
    }
    str_field(&mut out, "code", code);
    str_field(&mut out, "message", message);
    if let Some(limit) = limit {
        str_field(&mut out, "limit", limit);
    }
    out.push(b'}');
    out.into()
}
