//! The plugin API of powerhub: what a transport implements.
//!
//! A transport is a trait object registered by name; the core never matches over an enum of
//! transports. Two shapes exist:
//!
//! 1. **Sinks** ([`Sink`]) own their IO: an in-process channel, a test spy, a user's custom
//!    transport. The hub hands each subscriber's batch frame to [`Sink::send`] and learns from the
//!    [`SendOutcome`] whether the transport took it (back-pressure is visible), and calls
//!    [`Sink::close`] with a [`CloseReason`] on teardown.
//! 2. **Stream protocols** ([`StreamProtocol`], built by a [`ProtocolFactory`]) are sans-IO: they
//!    turn inbound bytes into [`Inbound`] events and outbound messages into bytes. The runtime's
//!    shards own the sockets and do every read and write.
//!
//! This crate is small and stable so that a plugin author depends on it alone.
//!
//! # Examples
//!
//! A sink that counts the bytes it is handed:
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use powerhub_plugin::{Completion, Frame, SendOutcome, Sink, SubscriberRef};
//!
//! #[derive(Debug, Default)]
//! struct Counting(AtomicUsize);
//!
//! impl Sink for Counting {
//!     fn send(&self, _sub: &SubscriberRef, frame: Frame, _done: Completion) -> SendOutcome {
//!         self.0.fetch_add(frame.len(), Ordering::Relaxed);
//!         SendOutcome::Accepted
//!     }
//! }
//!
//! let sink = Counting::default();
//! let sub = SubscriberRef::new("client-1", "prices");
//! let outcome = sink.send(&sub, Frame::from_static(b"abc"), Completion::noop());
//! assert!(matches!(outcome, SendOutcome::Accepted));
//! assert_eq!(sink.0.load(Ordering::Relaxed), 3);
//! ```

use std::any::Any;
use std::fmt;
use std::sync::Arc;

pub mod codes;
pub mod frame;

pub use bytes::{Bytes, BytesMut};

/// An encoded frame: immutable and shared by reference.
///
/// One frame is encoded per (topic, batch) and the same buffer reaches every subscriber that
/// receives that batch; the type makes the spec's "treat the frame as read-only" rule a
/// compile-time fact. A transport that needs to own the bytes clones the handle (cheap).
pub type Frame = Bytes;

/// Why the hub closes a subscriber; passed to [`Sink::close`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CloseReason {
    /// The subscriber was unsubscribed through its handle or by id.
    Unsubscribe,
    /// The subscriber fell behind under the `disconnect` slow-consumer policy.
    SlowConsumer,
    /// The hub was closed or shut down.
    HubClosed,
}

impl CloseReason {
    /// The spec's wire name of the reason: `unsubscribe`, `slow-consumer` or `hub-closed`.
    ///
    /// ```
    /// assert_eq!(powerhub_plugin::CloseReason::SlowConsumer.as_str(), "slow-consumer");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::Unsubscribe => "unsubscribe",
            CloseReason::SlowConsumer => "slow-consumer",
            CloseReason::HubClosed => "hub-closed",
        }
    }
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The subscriber a frame is for, as a sink sees it: its id, its topic, and the opaque
/// `transport` context given at subscribe time (the spec's `sub.socket`).
///
/// Cloning is cheap (reference counts).
///
/// ```
/// use std::sync::Arc;
/// use powerhub_plugin::SubscriberRef;
///
/// let sub = SubscriberRef::new("client-42", "trades").with_transport(Arc::new(7_u32));
/// assert_eq!(sub.id(), "client-42");
/// assert_eq!(sub.topic(), "trades");
/// assert_eq!(sub.transport::<u32>(), Some(&7));
/// ```
#[derive(Clone)]
pub struct SubscriberRef {
    id: Arc<str>,
    topic: Arc<str>,
    transport: Option<Arc<dyn Any + Send + Sync>>,
}

impl SubscriberRef {
    /// A subscriber reference with no transport context.
    pub fn new(id: impl Into<Arc<str>>, topic: impl Into<Arc<str>>) -> Self {
        SubscriberRef {
            id: id.into(),
            topic: topic.into(),
            transport: None,
        }
    }

    /// The same reference carrying `transport` as its context.
    pub fn with_transport(mut self, transport: Arc<dyn Any + Send + Sync>) -> Self {
        self.transport = Some(transport);
        self
    }

    /// The subscriber's unique id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The shared id, for transports that keep it.
    pub fn id_arc(&self) -> &Arc<str> {
        &self.id
    }

    /// The topic the subscriber listens to.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The transport context downcast to `T`, if one was given and it is a `T`.
    pub fn transport<T: Any>(&self) -> Option<&T> {
        self.transport.as_deref()?.downcast_ref::<T>()
    }

    /// The raw transport context.
    pub fn transport_any(&self) -> Option<&Arc<dyn Any + Send + Sync>> {
        self.transport.as_ref()
    }
}

impl fmt::Debug for SubscriberRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SubscriberRef")
            .field("id", &self.id)
            .field("topic", &self.topic)
            .field("transport", &self.transport.is_some())
            .finish()
    }
}

/// Why a send failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The transport refused the frame; the string says why.
    #[error("transport refused the frame: {0}")]
    Refused(String),
    /// The transport is closed.
    #[error("transport is closed")]
    Closed,
    /// A send reported [`SendOutcome::Pending`] and its [`Completion`] was dropped uncompleted.
    #[error("the transport dropped a pending send without completing it")]
    CompletionDropped,
}

/// What a [`Sink`] did with a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendOutcome {
    /// The transport took the frame; the subscriber may be sent its next frame.
    Accepted,
    /// The transport took the frame but has not finished with it (back-pressure). The sink keeps
    /// the [`Completion`] and calls [`Completion::complete`] when it is done; until then the hub
    /// hands this subscriber no further frame.
    Pending,
    /// The transport could not take the frame. The hub reports the error and isolates it from
    /// other subscribers.
    Failed(SendError),
}

/// The hub's callback for a send that returned [`SendOutcome::Pending`].
///
/// Call [`complete`](Completion::complete) exactly once when the transport is done with the
/// frame. Dropping a completion of a pending send without calling it reports
/// [`SendError::CompletionDropped`], so a lost completion never hangs `flush()`. For sends that
/// returned [`SendOutcome::Accepted`] or [`SendOutcome::Failed`] the completion is ignored.
pub struct Completion {
    callback: Option<CompletionFn>,
}

type CompletionFn = Box<dyn FnOnce(Result<(), SendError>) + Send>;

impl Completion {
    /// A completion that runs `callback` with the send's result.
    pub fn new(callback: impl FnOnce(Result<(), SendError>) + Send + 'static) -> Self {
        Completion {
            callback: Some(Box::new(callback)),
        }
    }

    /// A completion that does nothing: for tests and for callers outside a hub.
    pub fn noop() -> Self {
        Completion { callback: None }
    }

    /// Reports the result of a pending send.
    pub fn complete(mut self, result: Result<(), SendError>) {
        if let Some(callback) = self.callback.take() {
            callback(result);
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if let Some(callback) = self.callback.take() {
            callback(Err(SendError::CompletionDropped));
        }
    }
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("armed", &self.callback.is_some())
            .finish()
    }
}

/// A transport that owns its IO: the spec's `send` and `close` adapters as one trait object.
///
/// `send` is called from the thread that drains the hub, never concurrently for one subscriber,
/// and never while that subscriber has a send outstanding. It must not block: a transport that
/// cannot take the frame now returns [`SendOutcome::Pending`] and completes later.
pub trait Sink: Send + Sync + fmt::Debug + 'static {
    /// Hands one encoded frame to the transport for `sub`.
    fn send(&self, sub: &SubscriberRef, frame: Frame, done: Completion) -> SendOutcome;

    /// Tells the transport that `sub` is closed, and why. The default does nothing.
    fn close(&self, sub: &SubscriberRef, reason: CloseReason) {
        let _ = (sub, reason);
    }
}

impl<S: Sink + ?Sized> Sink for Arc<S> {
    fn send(&self, sub: &SubscriberRef, frame: Frame, done: Completion) -> SendOutcome {
        (**self).send(sub, frame, done)
    }

    fn close(&self, sub: &SubscriberRef, reason: CloseReason) {
        (**self).close(sub, reason)
    }
}

/// Limits a stream protocol enforces while decoding, set by the runtime from its config.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProtocolLimits {
    /// Largest inbound message (an NDJSON line, a WebSocket message, a binary frame), in bytes.
    pub max_message_bytes: usize,
    /// Largest opening handshake (for protocols that have one), in bytes.
    pub max_handshake_bytes: usize,
}

impl Default for ProtocolLimits {
    fn default() -> Self {
        ProtocolLimits {
            max_message_bytes: 1 << 20,
            max_handshake_bytes: 8 << 10,
        }
    }
}

impl ProtocolLimits {
    /// Limits with the given maximum message size and the default handshake size.
    pub fn with_max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// Limits with the given maximum handshake size.
    pub fn with_max_handshake_bytes(mut self, bytes: usize) -> Self {
        self.max_handshake_bytes = bytes;
        self
    }
}

/// One event decoded from a connection's inbound bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Inbound {
    /// One complete JSON message (an NDJSON line without its newline, a WebSocket text message).
    Text(Bytes),
    /// One complete binary message (a hub frame).
    Binary(Bytes),
    /// A run of complete text messages, each ended by `\n`, from
    /// [`StreamProtocol::decode_runs`] only: each line, without a `\r` before its newline, is
    /// one message as an [`Inbound::Text`] would carry it, and a blank line is none. The
    /// protocol checked every line against its limits; the run holds at least one message. A
    /// receive of many newline-delimited messages is one event, not one per message.
    Lines(Bytes),
    /// A transport-level pong: refreshes liveness like the push protocol's `pong` command.
    Pong,
    /// A credential the client presented in the protocol's own handshake (WebSocket: an
    /// `Authorization: Bearer …` header, or a `token` query parameter, which browsers can
    /// send): the runtime verifies it as the push protocol's `auth` command without an id. At
    /// most one per connection, before any message.
    Credential(String),
    /// The peer asked to close. The plugin has already queued its reply in
    /// [`ProtocolOutput::urgent`] where the protocol has one.
    Close {
        /// The close status the peer gave (WebSocket), or 1000.
        code: u16,
        /// The reason text the peer gave.
        reason: String,
    },
}

/// Where [`StreamProtocol::decode`] puts what it produced.
#[derive(Debug, Default)]
pub struct ProtocolOutput {
    /// Decoded events, in arrival order.
    pub events: Vec<Inbound>,
    /// Bytes the runtime writes before any queued data, at the next frame boundary: a handshake
    /// response, a pong for a ping, a close reply. Control never queues behind data.
    pub urgent: BytesMut,
}

impl ProtocolOutput {
    /// Clears events and urgent bytes, keeping their capacity.
    pub fn clear(&mut self) {
        self.events.clear();
        self.urgent.clear();
    }
}

/// Why a stream protocol rejected its input. After an error the runtime writes
/// [`ProtocolOutput::urgent`] (where the plugin put a close frame or an HTTP error response), then
/// closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// An inbound message or handshake is larger than a configured limit.
    #[error("{what} of at least {size} bytes exceeds the limit {limit_name} = {limit}")]
    TooLarge {
        /// What was too large ("line", "message", "handshake", "frame").
        what: &'static str,
        /// The option that sets the limit, e.g. `max_message_bytes`.
        limit_name: &'static str,
        /// The size seen (at least this many bytes).
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The opening handshake was invalid; the string names what was wrong.
    #[error("handshake rejected: {0}")]
    Handshake(String),
    /// The peer broke the protocol; the string names the rule.
    #[error("protocol violation: {0}")]
    Violation(String),
}

/// A sans-IO stream protocol for one connection: framing only, no sockets.
///
/// The runtime reads bytes into a buffer and calls [`decode`](StreamProtocol::decode), which
/// consumes every complete message from the front of `input` and leaves a partial one in place.
/// Outbound JSON messages and binary frames are encoded with the `encode_*` methods, which append
/// to `out`.
pub trait StreamProtocol: Send + fmt::Debug {
    /// Decodes every complete inbound message at the front of `input`, removing its bytes.
    fn decode(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError>;

    /// As [`decode`](StreamProtocol::decode), for a caller that also takes [`Inbound::Lines`]:
    /// a protocol whose messages are newline-delimited may hand a run of them as one event.
    /// The runtime calls this one. The default decodes message by message.
    ///
    /// ```
    /// use powerhub_plugin::{BytesMut, Inbound, ProtocolError, ProtocolOutput, StreamProtocol};
    ///
    /// /// Every byte is a message of its own.
    /// #[derive(Debug)]
    /// struct Bytewise;
    /// impl StreamProtocol for Bytewise {
    ///     fn decode(&mut self, input: &mut BytesMut, out: &mut ProtocolOutput) -> Result<(), ProtocolError> {
    ///         while !input.is_empty() {
    ///             out.events.push(Inbound::Text(input.split_to(1).freeze()));
    ///         }
    ///         Ok(())
    ///     }
    ///     fn encode_text(&mut self, _: &[u8], _: &mut BytesMut) {}
    ///     fn name(&self) -> &str { "bytewise" }
    /// }
    ///
    /// let mut out = ProtocolOutput::default();
    /// Bytewise.decode_runs(&mut BytesMut::from(&b"ab"[..]), &mut out).unwrap();
    /// assert_eq!(out.events, vec![Inbound::Text("a".into()), Inbound::Text("b".into())]);
    /// ```
    fn decode_runs(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError> {
        self.decode(input, out)
    }

    /// The peer ended its stream (a TCP end of stream) with `input` holding what
    /// [`decode`](StreamProtocol::decode) left: a message cut short. Decodes a last message
    /// the protocol allows without its terminator into `out` (NDJSON: a last line without its
    /// newline), or returns the error that names what was cut off, with the protocol's final
    /// words in [`ProtocolOutput::urgent`] as for a decode error. Leaves `input` empty.
    ///
    /// The default: nothing left is no error; anything left is a
    /// [`ProtocolError::Violation`] that says how many bytes of a message arrived.
    ///
    /// ```
    /// use bytes::BytesMut;
    /// use powerhub_plugin::{ProtocolError, ProtocolOutput, StreamProtocol};
    ///
    /// #[derive(Debug)]
    /// struct Fixed;
    /// impl StreamProtocol for Fixed {
    ///     fn decode(&mut self, _: &mut BytesMut, _: &mut ProtocolOutput) -> Result<(), ProtocolError> {
    ///         Ok(())
    ///     }
    ///     fn encode_text(&mut self, _: &[u8], _: &mut BytesMut) {}
    ///     fn name(&self) -> &str { "fixed" }
    /// }
    ///
    /// let mut out = ProtocolOutput::default();
    /// assert_eq!(Fixed.decode_end(&mut BytesMut::new(), &mut out), Ok(()));
    /// let err = Fixed.decode_end(&mut BytesMut::from(&b"abc"[..]), &mut out).unwrap_err();
    /// assert!(err.to_string().contains("3 of its bytes"), "{err}");
    /// ```
    fn decode_end(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError> {
        let _ = out;
        if input.is_empty() {
            return Ok(());
        }
        let cut = input.len();
        input.clear();
        Err(ProtocolError::Violation(format!(
            "the stream ended inside a message ({cut} of its bytes arrived)"
        )))
    }

    /// Appends one outbound JSON message (without trailing newline) framed for the wire.
    fn encode_text(&mut self, json: &[u8], out: &mut BytesMut);

    /// Appends one outbound binary message (a hub frame). Protocols without a binary channel
    /// return a [`ProtocolError::Violation`] that says so.
    fn encode_binary(&mut self, frame: &[u8], out: &mut BytesMut) -> Result<(), ProtocolError> {
        let _ = (frame, out);
        Err(ProtocolError::Violation(format!(
            "the {} protocol has no binary messages",
            self.name()
        )))
    }

    /// Appends a protocol-level ping if the protocol has one and returns `true`; returns `false`
    /// when the runtime must send the push protocol's JSON `ping` instead.
    fn encode_ping(&mut self, out: &mut BytesMut) -> bool {
        let _ = out;
        false
    }

    /// Appends the protocol's close message, if it has one. `code` is a close status of
    /// RFC 6455 section 7.4 (the runtime sends 1001 when it shuts down, 1008 for a policy, a
    /// limit or a deadline); `reason` is at most 123 bytes (longer is cut). The runtime calls it
    /// last, once everything queued for the connection is written.
    fn encode_close(&mut self, code: u16, reason: &str, out: &mut BytesMut) {
        let _ = (code, reason, out);
    }

    /// Appends the protocol's refusal of a connection whose opening handshake has not completed
    /// (an HTTP error response, for a protocol that upgrades from HTTP) and returns `true`;
    /// nothing may follow it. `status` is an HTTP status code (503 over `max_connections` or at
    /// shutdown, 408 when the handshake did not complete in time) and `message` says why.
    ///
    /// The default returns `false`: before its handshake the protocol has no agreed framing,
    /// so the runtime closes such a connection without a word.
    fn encode_refusal(&mut self, status: u16, message: &str, out: &mut BytesMut) -> bool {
        let _ = (status, message, out);
        false
    }

    /// Whether the opening handshake is complete, so that data may be written.
    fn is_ready(&self) -> bool {
        true
    }

    /// Bytes of an unfinished inbound message the protocol holds itself, beyond the runtime's
    /// input buffer (a WebSocket message being assembled from its frames): the runtime counts
    /// them with its own for its limits on what a connection may hold. The default, 0, is for
    /// a protocol that leaves unfinished messages in the input buffer.
    fn pending_message_bytes(&self) -> usize {
        0
    }

    /// The protocol's registered name, for logs and errors.
    fn name(&self) -> &str;
}

/// Builds a [`StreamProtocol`] per accepted connection; registered by name at start-up.
pub trait ProtocolFactory: Send + Sync + fmt::Debug + 'static {
    /// The name under which the protocol is registered and named in the config (`ndjson`,
    /// `websocket`, `frame`, …).
    fn name(&self) -> &str;

    /// A fresh protocol state machine for one connection. Called on the shard that serves
    /// it; a panic here (or in the first [`StreamProtocol::encode_text`] calls, which tell the
    /// server what the protocol writes) loses that connection, closed at once with nothing
    /// said, as no protocol exists yet to say it; the shard and its other connections go on.
    fn new_connection(&self, limits: &ProtocolLimits) -> Box<dyn StreamProtocol>;

    /// The factory one listener uses, given that listener's settings from the server's config:
    /// `Ok(None)` (the default) when the settings change nothing for this protocol, so the
    /// listener uses this factory; an error names the setting that cannot apply.
    fn for_listener(
        &self,
        options: &ListenerOptions,
    ) -> Result<Option<Arc<dyn ProtocolFactory>>, String> {
        let _ = options;
        Ok(None)
    }
}

/// Which browser origins a listener accepts (the `Origin` of a WebSocket upgrade); protocols
/// without origins ignore it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OriginPolicy {
    /// The protocol's own configuration decides (the default).
    #[default]
    Protocol,
    /// Any origin, and requests without one.
    Any,
    /// Exactly these origins (`scheme://host[:port]`, or `null`), and requests without one
    /// (programs, not browsers).
    Listed(Vec<String>),
    /// Origins on the host the request was sent to (its `Host` header), and requests without
    /// one.
    SameHost,
}

/// One listener's settings that a protocol factory may need (see
/// [`ProtocolFactory::for_listener`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenerOptions {
    /// The origins the listener accepts.
    pub origins: OriginPolicy,
    /// Whether the listener serves the protocol's page on a plain request (the WebSocket
    /// plugin's live page on a `GET` without `Upgrade`); `None`: as the protocol's own
    /// configuration says. Protocols without a page ignore it.
    pub serve_page: Option<bool>,
}

impl ListenerOptions {
    /// Options with this origin policy.
    pub fn with_origins(mut self, origins: OriginPolicy) -> Self {
        self.origins = origins;
        self
    }

    /// Options that serve the protocol's page, or not.
    ///
    /// ```
    /// use powerhub_plugin::ListenerOptions;
    ///
    /// let options = ListenerOptions::default().with_serve_page(false);
    /// assert_eq!(options.serve_page, Some(false));
    /// ```
    pub fn with_serve_page(mut self, serve: bool) -> Self {
        self.serve_page = Some(serve);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn dropped_completion_reports_completion_dropped() {
        let seen = Arc::new(Mutex::new(None));
        let seen2 = Arc::clone(&seen);
        drop(Completion::new(move |r| *seen2.lock().unwrap() = Some(r)));
        assert_eq!(
            *seen.lock().unwrap(),
            Some(Err(SendError::CompletionDropped))
        );
    }

    #[test]
    fn completed_completion_reports_once() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = Arc::clone(&seen);
        Completion::new(move |r| seen2.lock().unwrap().push(r)).complete(Ok(()));
        assert_eq!(*seen.lock().unwrap(), vec![Ok(())]);
    }
}
