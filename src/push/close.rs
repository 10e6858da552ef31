//! Why a connection closes, and how the server says so in the connection's protocol.
//!
//! Every close the server decides is said before the socket is closed:
//!
//! | ending | error `code` (`limit`) | WebSocket close | before a handshake |
//! | --- | --- | --- | --- |
//! | a limit (`max_connections`, `max_subscriptions_per_connection`, `max_outbox_bytes`) | `limit_exceeded` (the key) | 1008 | HTTP 503 |
//! | a deadline (`first_message_timeout_ms`, `idle_timeout_ms`, `liveness_timeout_ms`) | `limit_exceeded` (the key) | 1008 | HTTP 408 |
//! | a subscription fell behind under `slow_consumer = "disconnect"` | `slow_consumer` | 1008 | HTTP 503 |
//! | a refused first token, or the connection's token expired | the auth code (`bad_signature`, `token_expired`, ...) | 1008 | HTTP 503 |
//! | a TLS handshake on a listener without TLS | `tls_not_enabled` | 1008 | HTTP 400 |
//! | the hub closed the connection's subscriptions | `hub_closed` | 1001 | HTTP 503 |
//! | the server shuts down | `shutdown` | 1001 | HTTP 503 |
//!
//! The error is the push protocol's `{"type":"error","requestId":..,"code":..,"message":..}`
//! (plus `"limit":"<config key>"` for a limit), framed by the connection's protocol (an NDJSON
//! line, a one-message frame, a WebSocket text message); a WebSocket connection then gets a close
//! frame with the code, last, once everything queued before it is written. A connection whose
//! opening handshake has not completed gets the protocol's refusal instead
//! ([`StreamProtocol::encode_refusal`](powerhub_plugin::StreamProtocol::encode_refusal): an HTTP
//! response on WebSocket), or nothing where the protocol has none. Protocol errors (a message too
//! large, a broken frame) are said by the protocol plugin itself.
//!
//! The ending also names the close in its log line: one line per connection, when its slot is
//! freed.

use bytes::Bytes;
use powerhub_plugin::codes;

use crate::protocol::{reply, RequestId};

/// WebSocket close codes the runtime sends (RFC 6455 section 7.4.1).
const GOING_AWAY: u16 = 1001;
const POLICY: u16 = 1008;
const INTERNAL: u16 = 1011;

/// What the server says before a close it decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A limit: code `limit_exceeded`, the ending's reason as `limit`.
    Limit,
    /// A deadline: as [`Kind::Limit`], but HTTP 408 before a handshake.
    Timeout,
    /// A subscription fell behind under `disconnect`.
    SlowConsumer,
    /// A refusal whose code is the ending's reason (an auth error code).
    Refused,
    /// The client speaks another protocol than the listener's (`tls_not_enabled`): as
    /// [`Kind::Refused`], but HTTP 400 before a handshake, the client's mistake rather than
    /// the server's state.
    WrongProtocol,
    /// The hub closed the subscriptions.
    HubClosed,
    /// The server shuts down.
    Shutdown,
    /// The server failed handling the connection.
    Internal,
}

/// Why a connection closes: from the moment the close is decided to its log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ending {
    /// The limit's config key, or a word naming the ending (`peer_closed`, `shutdown`, ...).
    pub(crate) reason: &'static str,
    /// What is said to the peer; `None` when the server has nothing to say (the peer closed,
    /// the protocol said it, or nothing can be written any more).
    kind: Option<Kind>,
    /// The error's message, or what the log line adds (a protocol or IO error).
    pub(crate) detail: String,
    /// The request the error answers.
    request_id: Option<RequestId>,
    /// The error goes after everything queued (else ahead of it, at the next message boundary).
    in_order: bool,
    /// The close code still to be framed once everything is written (set when the error was
    /// queued on a ready protocol).
    pub(crate) close_code: Option<u16>,
    /// The protocol said the close itself (a decode error's final error or close frame, or
    /// its answer to the peer's close): nothing queued may follow.
    pub(crate) said_by_protocol: bool,
    /// What the protocol said on closing, written once everything framed before it is (then
    /// nothing more).
    pub(crate) last_words: Vec<Bytes>,
    /// Subscriptions the connection held when the close began.
    pub(crate) subscriptions: usize,
}

/// A limit error: the push protocol's `error` (code `limit_exceeded`) answering `request_id`,
/// plus a `limit` field naming the config key:
/// `{"type":"error","requestId":..,"code":"limit_exceeded","message":..,"limit":"<key>"}`.
pub(crate) fn limit_error(request_id: Option<&RequestId>, limit: &str, message: &str) -> Bytes {
    reply::error_with_limit(request_id, codes::LIMIT_EXCEEDED, message, Some(limit))
}

impl Ending {
    fn new(reason: &'static str, kind: Option<Kind>, detail: String) -> Ending {
        Ending {
            reason,
            kind,
            detail,
            request_id: None,
            in_order: false,
            close_code: None,
            said_by_protocol: false,
            last_words: Vec::new(),
            subscriptions: 0,
        }
    }

    /// Over limit `key`: an error naming it.
    pub(crate) fn limit(key: &'static str, message: String) -> Ending {
        Ending::new(key, Some(Kind::Limit), message)
    }

    /// Past deadline `key`: an error naming it.
    pub(crate) fn timeout(key: &'static str, message: String) -> Ending {
        Ending::new(key, Some(Kind::Timeout), message)
    }

    /// Whether the peer let a deadline pass (it was given the whole of it to speak).
    pub(crate) fn is_timeout(&self) -> bool {
        matches!(self.kind, Some(Kind::Timeout))
    }

    /// Whether the server shuts down.
    pub(crate) fn is_shutdown(&self) -> bool {
        matches!(self.kind, Some(Kind::Shutdown))
    }

    /// A subscription fell behind under `slow_consumer = "disconnect"`.
    pub(crate) fn slow_consumer(message: String) -> Ending {
        Ending::new("slow_consumer", Some(Kind::SlowConsumer), message)
    }

    /// A refused first token or an expired one: an error with the auth error `code`.
    pub(crate) fn auth(code: &'static str, message: String) -> Ending {
        Ending::refused(code, message)
    }

    /// The connection is refused: an error with `code`, then the close (WebSocket 1008).
    pub(crate) fn refused(code: &'static str, message: String) -> Ending {
        Ending::new(code, Some(Kind::Refused), message)
    }

    /// The client speaks another protocol than the listener's: an error with `code`, HTTP 400
    /// before a handshake.
    pub(crate) fn wrong_protocol(code: &'static str, message: String) -> Ending {
        Ending::new(code, Some(Kind::WrongProtocol), message)
    }

    /// The hub closed the connection's subscriptions.
    pub(crate) fn hub_closed(message: String) -> Ending {
        Ending::new("hub_closed", Some(Kind::HubClosed), message)
    }

    /// The server shuts down: said after everything queued.
    pub(crate) fn shutdown() -> Ending {
        Ending::new(
            "shutdown",
            Some(Kind::Shutdown),
            "the server is shutting down".to_owned(),
        )
        .in_order()
    }

    /// The server failed while handling the connection (a panic caught on its shard): the
    /// error, then the close (WebSocket 1011).
    pub(crate) fn internal(message: String) -> Ending {
        Ending::new(codes::INTERNAL_ERROR, Some(Kind::Internal), message)
    }

    /// A close with nothing to say: the peer closed, the protocol said it already, or nothing
    /// can be written any more. `reason` names it in the log, `detail` adds to it.
    pub(crate) fn unsaid(reason: &'static str, detail: String) -> Ending {
        Ending::new(reason, None, detail)
    }

    /// The protocol said the close itself (its final error or close frame, which the close
    /// takes as its last words): nothing queued follows.
    pub(crate) fn said_by_protocol(mut self) -> Ending {
        self.said_by_protocol = true;
        self
    }

    /// The error answers the request `id`.
    pub(crate) fn answering(mut self, id: Option<&RequestId>) -> Ending {
        self.request_id = id.cloned();
        self
    }

    /// The error goes after everything already queued for the connection.
    pub(crate) fn in_order(mut self) -> Ending {
        self.in_order = true;
        self
    }

    /// Whether the close is worth a log line at `info`: the server decided it for this
    /// connection (a limit, a deadline, a slow consumer, a protocol error, a refused TLS
    /// handshake), not for all of them
    /// at shutdown, unless the shutdown's deadline cut it (what it had queued is lost).
    pub(crate) fn is_notable(&self) -> bool {
        matches!(self.kind, Some(k) if k != Kind::Shutdown)
            || self.reason == "protocol_error"
            // A refused TLS handshake (a client certificate refused or missing, a client that
            // speaks no TLS): the operator sees why a client could not connect.
            || self.reason.starts_with("tls_")
            || self.reason.starts_with("max_")
            // Cut by the shutdown's deadline: what it still had queued is lost.
            || self.reason == "shutdown_timeout_ms"
    }

    /// The push protocol's error to send, if any.
    pub(crate) fn error(&self) -> Option<Bytes> {
        let code = match self.kind? {
            Kind::Limit | Kind::Timeout => {
                return Some(limit_error(
                    self.request_id.as_ref(),
                    self.reason,
                    &self.detail,
                ))
            }
            Kind::SlowConsumer => codes::SLOW_CONSUMER,
            Kind::Refused | Kind::WrongProtocol => self.reason,
            Kind::HubClosed => codes::HUB_CLOSED,
            Kind::Shutdown => codes::SHUTDOWN,
            Kind::Internal => codes::INTERNAL_ERROR,
        };
        Some(reply::error(self.request_id.as_ref(), code, &self.detail))
    }

    /// Whether the error goes after what is queued.
    pub(crate) fn is_in_order(&self) -> bool {
        self.in_order
    }

    /// The WebSocket close code that follows the error.
    pub(crate) fn websocket_code(&self) -> Option<u16> {
        Some(match self.kind? {
            Kind::Limit
            | Kind::Timeout
            | Kind::SlowConsumer
            | Kind::Refused
            | Kind::WrongProtocol => POLICY,
            Kind::HubClosed | Kind::Shutdown => GOING_AWAY,
            Kind::Internal => INTERNAL,
        })
    }

    /// The HTTP status of a refusal before the protocol's handshake completed.
    pub(crate) fn http_status(&self) -> Option<u16> {
        Some(match self.kind? {
            Kind::Timeout => 408,
            Kind::Internal => 500,
            Kind::WrongProtocol => 400,
            _ => 503,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_error_names_its_key_and_answers_its_request() {
        let e = Ending::limit("max_subscriptions_per_connection", "too many".into())
            .answering(Some(&RequestId::Int(7)));
        let v: serde_json::Value = serde_json::from_slice(&e.error().unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"type":"error","requestId":7,"code":"limit_exceeded",
                "message":"too many","limit":"max_subscriptions_per_connection"})
        );
        assert_eq!(e.websocket_code(), Some(1008));
        assert_eq!(e.http_status(), Some(503));
    }

    #[test]
    fn shutdown_is_said_in_order_with_going_away() {
        let e = Ending::shutdown();
        let v: serde_json::Value = serde_json::from_slice(&e.error().unwrap()).unwrap();
        assert_eq!(v["code"], "shutdown");
        assert!(v["requestId"].is_null());
        assert!(e.is_in_order());
        assert_eq!(e.websocket_code(), Some(1001));
        assert_eq!(
            Ending::timeout("idle_timeout_ms", String::new()).http_status(),
            Some(408)
        );
        assert_eq!(Ending::unsaid("peer_closed", String::new()).error(), None);
    }

    /// Every close the server decides is logged at `info`; a peer's own close is not.
    #[test]
    fn a_close_the_server_decides_is_notable_and_a_peers_is_not() {
        for reason in [
            "tls_certificate",
            "tls_handshake",
            "tls_protocol",
            "protocol_error",
        ] {
            assert!(
                Ending::unsaid(reason, String::new()).is_notable(),
                "{reason}"
            );
        }
        assert!(Ending::limit("max_outbox_bytes", String::new()).is_notable());
        assert!(!Ending::unsaid("peer_closed", String::new()).is_notable());
        assert!(!Ending::shutdown().is_notable());
    }
}
