//! The push session of one connection: client commands in, replies and hub subscriptions out.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use powerhub_plugin::CloseReason;

use super::shard::Conn;
use super::Shared;

/// A connection's subscriptions.
#[derive(Debug, Default)]
pub(crate) struct Session {
    subs: HashMap<Arc<str>, SubEntry>,
}

#[derive(Debug)]
struct SubEntry {
    binary: bool,
}

/// Builds an `error` reply.
pub(crate) fn error_json(request_id: Option<&str>, code: &str, message: &str, limit: Option<&str>) -> String {
    let mut v = serde_json::json!({ "type": "error", "error": code, "message": message });
    if let Some(id) = request_id {
        v["requestId"] = serde_json::Value::String(id.to_owned());
    }
    if let Some(limit) = limit {
        v["limit"] = serde_json::Value::String(limit.to_owned());
    }
    v.to_string()
}

/// Handles one inbound JSON message. Returns `true` when the connection must close.
pub(crate) fn on_text(conn: &mut Conn, _shared: &Shared, line: Bytes) -> bool {
    let value: serde_json::Value = match serde_json::from_slice(&line) {
        Ok(v) => v,
        Err(e) => {
            conn.send_text(error_json(None, "invalid_json", &e.to_string(), None).as_bytes());
            return false;
        }
    };
    match value.get("type").and_then(|t| t.as_str()) {
        Some("ping") => conn.send_text(br#"{"type":"pong"}"#),
        Some("pong") => {}
        _ => conn.send_text(error_json(None, "unknown_command", "unknown command", None).as_bytes()),
    }
    false
}

/// The hub closed subscription `sub`. Returns `true` when the connection must close.
pub(crate) fn on_sub_closed(conn: &mut Conn, _shared: &Shared, sub: &str, reason: CloseReason) -> bool {
    conn.session.subs.remove(sub);
    matches!(reason, CloseReason::SlowConsumer | CloseReason::HubClosed)
}

/// Whether subscription `sub` receives binary hub frames.
pub(crate) fn sub_is_binary(conn: &Conn, sub: &str) -> bool {
    conn.session.subs.get(sub).is_some_and(|s| s.binary)
}

/// Drops every subscription of a closing connection.
pub(crate) fn release(conn: &mut Conn, _shared: &Shared) {
    conn.session.subs.clear();
}
