//! The push connection: one client of the push server, without its socket.
//!
//! [`PushConnection`] is the whole per-connection state machine of the push protocol, sans-IO in
//! the style of `quinn-proto`: the driver (the server's shard, a test, a fuzz target) feeds it
//! received bytes with [`handle_input`](PushConnection::handle_input), runs what they ask for
//! with [`poll`](PushConnection::poll), writes what
//! [`poll_transmit`](PushConnection::poll_transmit) offers and reports what the socket took with
//! [`on_written`](PushConnection::on_written), and drives its timers with
//! [`poll_timeout`](PushConnection::poll_timeout) and
//! [`handle_timeout`](PushConnection::handle_timeout). It never reads a clock, blocks or touches
//! a socket.
//!
//! It holds, in one place, every rule of a connection:
//!
//! - the stream protocol (NDJSON, WebSocket, the frame protocol) that frames its messages,
//! - the push [`Session`] that reads its commands,
//! - its [`Outbox`], the only queue of its subscriptions (the push-stream back-pressure rules:
//!   coalescing, lossless FIFO, `frames_dropped`, keepalive and liveness), and
//!   the protocol's urgent lane (handshake replies, pongs, close replies), written at message
//!   boundaries,
//! - the order of what it sends: a reply never overtakes a delivery published before its
//!   command (the driver is asked to fan out first, [`Request::FanOut`]),
//! - its limits and deadlines (`max_outbox_bytes`, the first-message deadline, the idle
//!   deadline, liveness, token expiry), and how every close it decides is said in its protocol.
//!
//! What it does not own is the fan-out: a subscribe, an unsubscribe or a publish is handed to
//! the driver as a [`Request`], which answers it (`subscribe_done`, `unsubscribe_done`,
//! `publish_done`) before the next `poll`; deliveries come back through
//! [`deliver_lines`](PushConnection::deliver_lines) and
//! [`deliver_frame`](PushConnection::deliver_frame).
//!
//! # Example
//!
//! A publisher and a subscriber on one NDJSON connection, driven by hand:
//!
//! ```
//! use std::sync::Arc;
//! use std::time::{Instant, SystemTime};
//! use bytes::Bytes;
//! use powerhub::outbox::{OutboxConfig, PayloadFactory};
//! use powerhub::plugin::ProtocolFactory;
//! use powerhub::protocol::{Session, SessionConfig};
//! use powerhub::push::{PushConfig, PushConnection, PushLimits, Request};
//! use powerhub_ndjson::NdjsonFactory;
//!
//! let config = Arc::new(
//!     PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory))
//!         .unwrap(),
//! );
//! let now = Instant::now();
//! let proto = NdjsonFactory.new_connection(&Default::default());
//! let session = Session::new(1, SessionConfig::default());
//! let mut conn = PushConnection::new(proto, session, &config, now).unwrap();
//!
//! conn.handle_input(
//!     br#"{"type":"subscribe","id":1,"stream":"s"}
//! {"type":"publish","id":2,"message":{"type":"telemetry","stream":"s","seq":1}}
//! "#,
//!     now,
//! );
//! let mut published = Vec::new();
//! while let Some(request) = conn.poll(now, SystemTime::now()) {
//!     match request {
//!         Request::Subscribe { .. } => conn.subscribe_done(Ok(()), now),
//!         Request::Publish { message, .. } => {
//!             // The stream's topic (and the device's, when the message names one).
//!             assert_eq!(conn.publish_topics().collect::<Vec<_>>(), ["s"]);
//!             published.push(message);
//!             conn.publish_done(Ok(1), now);
//!         }
//!         _ => {}
//!     }
//! }
//! // The driver's fan-out: one NDJSON batch for the subscription.
//! let line = [published[0].bytes().as_ref(), b"\n"].concat();
//! conn.deliver_lines("1", Bytes::from(line), now);
//!
//! let mut out = Vec::new();
//! let transmit = conn.poll_transmit(&mut out, 1024, now).unwrap();
//! let wire: Vec<u8> = out.concat();
//! let text = String::from_utf8(wire).unwrap();
//! assert!(text.starts_with(r#"{"type":"subscribed""#));
//! assert!(text.contains(r#""type":"published""#));
//! assert!(text.ends_with("{\"type\":\"telemetry\",\"stream\":\"s\",\"seq\":1}\n"));
//! conn.on_written(transmit, transmit.len(), now);
//! assert_eq!(conn.backlog(), 0);
//! ```

pub(crate) mod close;
pub(crate) mod writeq;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Buf, Bytes, BytesMut};
use powerhub_plugin::{codes, Inbound, ProtocolError, ProtocolOutput, StreamProtocol};

use crate::hub::{Message, PublishError, SubscribeError};
use crate::outbox::{
    Framing, MessageFactory, Outbox, OutboxConfig, OutboxConfigError, OutboxStats, TimeoutAction,
};
use crate::protocol::{
    fast, reply, topic_parts, Action, Command, CommandError, RequestId, Session, SubscriptionInfo,
};
use crate::runtime::{Config, SlowConsumerChoice};
use crate::security::tls::PeerSubject;

pub(crate) use close::Ending;
use writeq::WriteQueue;
pub(crate) use writeq::MAX_IOV;

/// The default of [`PushLimits::max_unauthenticated_message_bytes`]
/// (`limits.max_unauthenticated_message_bytes`), 64 KiB: the most bytes of one unfinished
/// message a connection holds before it authenticates, where the server requires
/// authentication. An `auth` command with a token of some kilobytes fits
/// many times over, and a client that has not authenticated cannot make the server hold
/// `max_message_bytes` (16 MiB by default) for it. Past it the connection is closed with a
/// `limit_exceeded` error naming `max_unauthenticated_message_bytes`.
pub const MAX_UNAUTHENTICATED_MESSAGE_BYTES: usize = 64 << 10;

/// The default of [`PushLimits::input_hold_timeout_ms`] (`limits.input_hold_timeout_ms`): how
/// long a connection's input waits for its output to drain (see
/// [`PushConnection::input_waiting`]) while its peer reads none of it and sends no pong: past
/// this (and a write tried then, [`PROBE_WAIT`]) its input is handled again, so a peer that
/// never reads is closed at `max_outbox_bytes`. Ten seconds: on loopback a reader with a large
/// receive buffer frees the socket a 64 KiB segment at a time, so one taking its replies at
/// 20 KB/s shows progress only every few seconds (five was too short for it). Held input costs
/// no more memory meanwhile: the output stays near a quarter of the limit.
pub const INPUT_WAIT: Duration = Duration::from_secs(10);

/// The default of [`PushLimits::stall_timeout_ms`] (`limits.stall_timeout_ms`): how long a
/// connection past `max_outbox_bytes` whose socket refused part of its last write, and that is
/// sent nothing more, may go without its peer taking any of it before a write is tried, and,
/// that write taking nothing within [`PROBE_WAIT`], the connection is closed at the limit. On
/// loopback a reader with a large receive buffer acknowledges in steps of a 64 KiB segment, so
/// one reading 20 KB/s shows progress only every three seconds or so.
pub const STALL_WAIT: Duration = Duration::from_secs(5);

/// How long a held input, or a connection past `max_outbox_bytes` behind its socket, waits for
/// a write tried at its deadline ([`PushConnection::probe_writable`]) to show whether the peer
/// reads.
pub const PROBE_WAIT: Duration = Duration::from_millis(100);

/// A decoded-event list larger than this is not kept between inputs.
const KEEP_EVENTS: usize = 1024;
/// A partial message kept between inputs is copied into a buffer of its own size when the
/// buffer it sits in is larger than twice its length plus this.
const KEEP_SLACK: usize = 1024;

/// The limits a push connection enforces itself (the `[limits]` of the server's config).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PushLimits {
    /// Most bytes of unsent output (with their queue entries) a connection may hold; past it
    /// the connection is closed with an error naming `max_outbox_bytes`.
    pub max_outbox_bytes: usize,
    /// A connection that has not completed its protocol's handshake, authenticated (where the
    /// server requires it) and sent a complete message within this many milliseconds is closed
    /// with an error naming `first_message_timeout_ms`.
    pub first_message_timeout_ms: u64,
    /// A connection that sent nothing for this many milliseconds is closed with an error naming
    /// `idle_timeout_ms`; 0 for none.
    pub idle_timeout_ms: u64,
    /// Under `subscriptions.slow_consumer = "disconnect"`: a subscribed connection whose socket
    /// refused part of a write and that holds more than this many bytes is closed with a
    /// `slow_consumer` error. `None` (the default): the outbox's rules alone apply.
    pub disconnect_backlog_bytes: Option<usize>,
    /// A connection whose input is held back (its output past a quarter of `max_outbox_bytes`)
    /// and whose peer reads none of its output for this many milliseconds has its input handled
    /// again (see [`INPUT_WAIT`], the default).
    pub input_hold_timeout_ms: u64,
    /// A connection past `max_outbox_bytes`, behind its socket and sent nothing more, whose peer
    /// takes nothing for this many milliseconds is closed at the limit (see [`STALL_WAIT`], the
    /// default).
    pub stall_timeout_ms: u64,
    /// Where the server requires authentication, the most bytes of one unfinished message a
    /// connection that has not authenticated may hold; past it the connection is closed with
    /// an error naming `max_unauthenticated_message_bytes` (see
    /// [`MAX_UNAUTHENTICATED_MESSAGE_BYTES`], the default).
    pub max_unauthenticated_message_bytes: usize,
}

impl Default for PushLimits {
    /// The defaults of the server's `[limits]` (`Config::default()`): 32 MiB, 5 s, 300 s, no
    /// slow-consumer disconnect, 10 s for held input, 5 s for a stall.
    fn default() -> Self {
        PushLimits::from_config(&Config::default())
    }
}

impl PushLimits {
    /// The limits a server's `config` sets: its `[limits]`, and under
    /// `subscriptions.slow_consumer = "disconnect"` its `backpressure_bytes` as
    /// [`disconnect_backlog_bytes`](Self::disconnect_backlog_bytes).
    ///
    /// ```
    /// use powerhub::runtime::{Config, SlowConsumerChoice};
    /// let mut config = Config::default();
    /// config.subscriptions.slow_consumer = SlowConsumerChoice::Disconnect;
    /// let limits = powerhub::push::PushLimits::from_config(&config);
    /// assert_eq!(limits.disconnect_backlog_bytes, Some(config.limits.backpressure_bytes));
    /// ```
    pub fn from_config(config: &Config) -> PushLimits {
        let limits = &config.limits;
        let disconnect = config.subscriptions.slow_consumer == SlowConsumerChoice::Disconnect;
        PushLimits {
            max_outbox_bytes: limits.max_outbox_bytes,
            first_message_timeout_ms: limits.first_message_timeout_ms,
            idle_timeout_ms: limits.idle_timeout_ms,
            disconnect_backlog_bytes: disconnect.then_some(limits.backpressure_bytes),
            input_hold_timeout_ms: limits.input_hold_timeout_ms,
            stall_timeout_ms: limits.stall_timeout_ms,
            max_unauthenticated_message_bytes: limits.max_unauthenticated_message_bytes,
        }
    }

    /// These limits with `max_outbox_bytes` = `bytes`.
    ///
    /// ```
    /// let limits = powerhub::push::PushLimits::default().with_max_outbox_bytes(1 << 20);
    /// assert_eq!(limits.max_outbox_bytes, 1 << 20);
    /// ```
    pub fn with_max_outbox_bytes(mut self, bytes: usize) -> Self {
        self.max_outbox_bytes = bytes;
        self
    }

    /// These limits with `first_message_timeout_ms` = `ms`.
    ///
    /// ```
    /// let limits = powerhub::push::PushLimits::default().with_first_message_timeout_ms(2000);
    /// assert_eq!(limits.first_message_timeout_ms, 2000);
    /// ```
    pub fn with_first_message_timeout_ms(mut self, ms: u64) -> Self {
        self.first_message_timeout_ms = ms;
        self
    }

    /// These limits with `disconnect_backlog_bytes` = `bytes`.
    ///
    /// ```
    /// let limits = powerhub::push::PushLimits::default().with_disconnect_backlog_bytes(Some(8 << 20));
    /// assert_eq!(limits.disconnect_backlog_bytes, Some(8 << 20));
    /// ```
    pub fn with_disconnect_backlog_bytes(mut self, bytes: Option<usize>) -> Self {
        self.disconnect_backlog_bytes = bytes;
        self
    }

    /// These limits with `idle_timeout_ms` = `ms` (0: none).
    ///
    /// ```
    /// let limits = powerhub::push::PushLimits::default().with_idle_timeout_ms(0);
    /// assert_eq!(limits.idle_timeout_ms, 0);
    /// ```
    pub fn with_idle_timeout_ms(mut self, ms: u64) -> Self {
        self.idle_timeout_ms = ms;
        self
    }

    /// These limits with `input_hold_timeout_ms` = `ms`.
    ///
    /// ```
    /// use powerhub::push::PushLimits;
    /// let limits = PushLimits::default().with_input_hold_timeout_ms(30_000);
    /// assert_eq!(limits.input_hold_timeout_ms, 30_000);
    /// assert_eq!(PushLimits::default().input_hold_timeout_ms, 10_000);
    /// ```
    pub fn with_input_hold_timeout_ms(mut self, ms: u64) -> Self {
        self.input_hold_timeout_ms = ms;
        self
    }

    /// These limits with `stall_timeout_ms` = `ms`.
    ///
    /// ```
    /// use powerhub::push::PushLimits;
    /// let limits = PushLimits::default().with_stall_timeout_ms(2_000);
    /// assert_eq!(limits.stall_timeout_ms, 2_000);
    /// assert_eq!(PushLimits::default().stall_timeout_ms, 5_000);
    /// ```
    pub fn with_stall_timeout_ms(mut self, ms: u64) -> Self {
        self.stall_timeout_ms = ms;
        self
    }

    /// These limits with `max_unauthenticated_message_bytes` = `bytes`.
    ///
    /// ```
    /// use powerhub::push::{PushLimits, MAX_UNAUTHENTICATED_MESSAGE_BYTES};
    /// let limits = PushLimits::default().with_max_unauthenticated_message_bytes(4096);
    /// assert_eq!(limits.max_unauthenticated_message_bytes, 4096);
    /// assert_eq!(
    ///     PushLimits::default().max_unauthenticated_message_bytes,
    ///     MAX_UNAUTHENTICATED_MESSAGE_BYTES
    /// );
    /// ```
    pub fn with_max_unauthenticated_message_bytes(mut self, bytes: usize) -> Self {
        self.max_unauthenticated_message_bytes = bytes;
        self
    }
}

impl PushLimits {
    /// Checks the limits as the server's configuration does for its `[limits]`: a wait of 0
    /// would close a connection (or try its socket) before its peer could answer, and a
    /// `max_outbox_bytes` of 0 would close every connection at its first reply. The error names
    /// the first field that is wrong.
    ///
    /// ```
    /// use powerhub::push::{PushLimits, PushLimitsError};
    /// assert!(PushLimits::default().validate().is_ok());
    /// let err = PushLimits::default().with_stall_timeout_ms(0).validate().unwrap_err();
    /// assert_eq!(err, PushLimitsError::Zero { field: "stall_timeout_ms" });
    /// assert_eq!(err.to_string(), "stall_timeout_ms must be at least 1, got 0");
    /// ```
    pub fn validate(&self) -> Result<(), PushLimitsError> {
        let fields = [
            ("max_outbox_bytes", self.max_outbox_bytes as u64),
            ("first_message_timeout_ms", self.first_message_timeout_ms),
            ("input_hold_timeout_ms", self.input_hold_timeout_ms),
            ("stall_timeout_ms", self.stall_timeout_ms),
            (
                "max_unauthenticated_message_bytes",
                self.max_unauthenticated_message_bytes as u64,
            ),
        ];
        match fields.into_iter().find(|&(_, value)| value == 0) {
            Some((field, _)) => Err(PushLimitsError::Zero { field }),
            None => Ok(()),
        }
    }
}

/// Why [`PushLimits`] were rejected; each variant names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PushLimitsError {
    /// A limit that must be at least 1 is 0 (`idle_timeout_ms`, where 0 means none, is not one).
    #[error("{field} must be at least 1, got 0")]
    Zero {
        /// The field of [`PushLimits`].
        field: &'static str,
    },
}

/// Why a [`PushConfig`] was rejected: its limits or its outbox settings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PushConfigError {
    /// The limits are invalid (see [`PushLimits::validate`]).
    #[error("invalid push limits: {0}")]
    Limits(#[from] PushLimitsError),
    /// The outbox settings are invalid (see [`OutboxConfig::validate`]).
    #[error("invalid outbox settings: {0}")]
    Outbox(#[from] OutboxConfigError),
}

/// What every push connection of a server shares: its limits, its outbox settings (one per
/// framing) and the factory of its notifications.
pub struct PushConfig {
    limits: PushLimits,
    outbox_ndjson: Arc<OutboxConfig>,
    outbox_protocol: Arc<OutboxConfig>,
    factory: Arc<dyn MessageFactory>,
    /// Connections gather publish runs ([`PushConfig::with_publish_runs`]).
    publish_runs: bool,
}

impl std::fmt::Debug for PushConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushConfig")
            .field("limits", &self.limits)
            .field("outbox", &self.outbox_protocol)
            .finish_non_exhaustive()
    }
}

impl PushConfig {
    /// The shared settings. `outbox`'s framing is ignored: each connection's comes from its
    /// protocol (NDJSON lines, or the protocol's own frames).
    ///
    /// # Errors
    ///
    /// The limits are invalid (see [`PushLimits::validate`]), or the outbox settings are (see
    /// [`OutboxConfig::validate`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// use powerhub::push::{PushConfig, PushConfigError, PushLimits, PushLimitsError};
    ///
    /// let config = PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory));
    /// assert!(config.is_ok());
    /// let limits = PushLimits::default().with_first_message_timeout_ms(0);
    /// let err = PushConfig::new(limits, OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap_err();
    /// assert_eq!(err, PushConfigError::Limits(PushLimitsError::Zero { field: "first_message_timeout_ms" }));
    /// ```
    pub fn new(
        limits: PushLimits,
        outbox: OutboxConfig,
        factory: Arc<dyn MessageFactory>,
    ) -> Result<PushConfig, PushConfigError> {
        limits.validate()?;
        let outbox_protocol = OutboxConfig {
            framing: Framing::Protocol,
            ..outbox
        };
        outbox_protocol.validate()?;
        let outbox_ndjson = OutboxConfig {
            framing: Framing::Ndjson,
            ..outbox_protocol.clone()
        };
        Ok(PushConfig {
            limits,
            outbox_ndjson: Arc::new(outbox_ndjson),
            outbox_protocol: Arc::new(outbox_protocol),
            factory,
            publish_runs: false,
        })
    }

    /// With `on`, a connection asks publishes without an id to one topic, read one after
    /// another from one receive, as one [`Request::PublishRun`] each run instead of a
    /// [`Request::Publish`] each (off by default): a driver that publishes a run at once saves a
    /// request per message. Nothing else changes: a run ends before any other line, which is
    /// handled after it, and a subscribed connection gathers none.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::{Instant, SystemTime};
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits, Request};
    /// let config = PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory))
    ///     .unwrap()
    ///     .with_publish_runs(true);
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let (now, wall) = (Instant::now(), SystemTime::now());
    /// let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &Arc::new(config), now).unwrap();
    /// let publish = |n: u32| format!("{{\"type\":\"publish\",\"message\":{{\"type\":\"t\",\"stream\":\"s\",\"n\":{n}}}}}\n");
    /// conn.handle_input((publish(1) + &publish(2)).as_bytes(), now);
    /// match conn.poll(now, wall) {
    ///     Some(Request::PublishRun { messages }) => {
    ///         assert_eq!(messages.len(), 2);
    ///         assert_eq!(conn.publish_topics().collect::<Vec<_>>(), ["s"]);
    ///     }
    ///     other => panic!("{other:?}"),
    /// }
    /// assert_eq!(conn.poll(now, wall), None);
    /// ```
    #[must_use]
    pub fn with_publish_runs(mut self, on: bool) -> PushConfig {
        self.publish_runs = on;
        self
    }

    /// The limits.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::push::{PushConfig, PushLimits};
    /// let config = PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap();
    /// assert_eq!(config.limits(), &PushLimits::default());
    /// ```
    pub fn limits(&self) -> &PushLimits {
        &self.limits
    }
}

/// What a push connection asks its driver to do, from [`PushConnection::poll`]. Each is
/// answered (where it says so) before the next `poll`; one left unanswered is answered as
/// failed by that `poll`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Request {
    /// Fan out, now, everything published so far to the subscriptions it reaches (this
    /// connection's among them): the reply to the next command must not overtake a delivery
    /// published before it. Asked when input arrives for a subscribed connection, and after a
    /// publish of this connection that is followed by another command in the same input.
    FanOut,
    /// Fan out what `topic` holds so far, add subscription `subscription_id` to the fan-out of
    /// `topic`, and answer with [`PushConnection::subscribe_done`].
    Subscribe {
        /// The id the client gave the subscription (in deliveries' `frames_dropped`, in
        /// `unsubscribe`).
        subscription_id: Arc<str>,
        /// The connection-unique subscriber id (`c<connection>:<subscription>`).
        hub_id: Arc<str>,
        /// The topic.
        topic: String,
    },
    /// Fan out what `topic` holds so far, remove subscription `subscription_id` from the
    /// fan-out of `topic`, and answer with [`PushConnection::unsubscribe_done`].
    Unsubscribe {
        /// The id the client gave the subscription.
        subscription_id: Arc<str>,
        /// The topic.
        topic: String,
    },
    /// Publish `message` to every topic of [`PushConnection::publish_topics`] (the stream
    /// topic, then the device topic when the message names a device), and answer with
    /// [`PushConnection::publish_done`] (the subscriber count, summed).
    Publish {
        /// The message, byte for byte as the client wrote it.
        message: Message,
    },
    /// Publish `messages`, in order, to the one topic of [`PushConnection::publish_topics`]:
    /// publishes without an id, read one after another from one receive, none of them
    /// answered. Asked only of a connection whose config
    /// [gathers publish runs](PushConfig::with_publish_runs), in place of a
    /// [`Request::Publish`] per message; a connection gathers none while it is subscribed
    /// (each of its publishes is fanned out before its next command).
    PublishRun {
        /// The messages, each byte for byte as the client wrote it, in the order read.
        messages: Vec<Message>,
    },
}

/// A request waiting for its answer.
#[derive(Debug)]
enum Pending {
    Subscribe {
        subscription_id: Arc<str>,
        reply: Bytes,
        request_id: Option<RequestId>,
    },
    Unsubscribe {
        subscription_id: Arc<str>,
        ack: Bytes,
    },
    Publish {
        request_id: Option<RequestId>,
    },
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushState {
    /// Taking commands and deliveries.
    Open,
    /// The close is decided: no more commands or deliveries; what is queued (and the close
    /// message of the protocol, last) is still written. The driver closes the socket once
    /// [`PushConnection::is_written`] says everything went.
    Closing,
    /// Closed with nothing more to write (nothing could be said): the driver closes the socket
    /// now.
    Aborted,
}

/// One [`PushConnection::poll_transmit`] offer: the urgent lane's bytes and the outbox's, in
/// the order they were put in the gather list. Report what the socket took of it with
/// [`PushConnection::on_written`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    urgent_first: bool,
    urgent: usize,
    outbox: usize,
}

impl Transmit {
    /// The bytes offered.
    ///
    /// ```
    /// # use powerhub::push::Transmit;
    /// fn all(t: Transmit) -> usize { t.len() }
    /// ```
    pub fn len(&self) -> usize {
        self.urgent + self.outbox
    }

    /// Whether nothing was offered (never so for a transmit `poll_transmit` returned).
    ///
    /// ```
    /// # use powerhub::push::Transmit;
    /// fn none(t: Transmit) -> bool { t.is_empty() }
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How `n` bytes taken split between the urgent bytes and the outbox's.
    fn split(&self, n: usize) -> (usize, usize) {
        if self.urgent_first {
            let urgent = n.min(self.urgent);
            (urgent, (n - urgent).min(self.outbox))
        } else {
            let outbox = n.min(self.outbox);
            (n.saturating_sub(outbox).min(self.urgent), outbox)
        }
    }
}

/// What a connection did, for its close's log line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PushCounts {
    /// Bytes received.
    pub bytes_in: u64,
    /// Bytes written: everything the connection said, its protocol's own replies (a handshake
    /// response, a refusal, a close frame) and final errors included. Over TLS, the plaintext
    /// handed to TLS (its records' overhead and TLS's own messages are not counted).
    pub bytes_out: u64,
    /// Messages received (commands, binary messages).
    pub messages_in: u32,
    /// Batches delivered to its subscriptions.
    pub deliveries: u32,
}

/// One push connection, without its socket (see the [module docs](self)).
pub struct PushConnection {
    proto: Box<dyn StreamProtocol>,
    /// The protocol's wire form is the hub's binary frame: deliveries are hub frames.
    hub_frames: bool,
    /// The input being handled; `None` (no allocation) once an idle connection freed it.
    input: Option<Box<Input>>,
    /// Pre-framed bytes written before the outbox's at the next message boundary: the
    /// protocol's handshake replies, pongs and close replies, and errors said ahead of what is
    /// queued.
    urgent: WriteQueue,
    /// The push-stream outbox: replies, deliveries, keepalive, coalescing while paused.
    outbox: Outbox,
    session: Session,
    config: Arc<PushConfig>,
    state: PushState,
    /// Why the connection closes, once that is decided.
    ending: Option<Box<Ending>>,
    /// When the connection started; timestamps below are milliseconds since.
    started: Instant,
    last_inbound_ms: u64,
    counts: PushCounts,
    /// Errors to count (limits; protocol errors), taken by the driver.
    limit_errors: u16,
    protocol_errors: u16,
    /// Output memory discarded by a close (taken by the driver; saturating).
    freed: u32,
    /// A transmit is out, not yet reported.
    transmitting: bool,
    /// The socket took part of what the outbox offered: its stream may be mid-message, and
    /// urgent bytes wait until it offered everything again.
    outbox_mid: bool,
    /// Fan out before the input's first command.
    fan_out_first: bool,
    /// A command of the input being handled published.
    published: bool,
    /// The input holds a message (not only a keepalive pong).
    greeting: bool,
    /// A complete message arrived (after the protocol's handshake and authentication): the
    /// first-message deadline no longer applies.
    greeted: bool,
}

/// Whole seconds since the Unix epoch at `t` (0 before it).
fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl std::fmt::Debug for PushConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushConnection")
            .field("protocol", &self.proto.name())
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// The most messages a publish run reserves room for at its start (it grows past that).
const MAX_RUN_RESERVE: usize = 4096;

/// Received bytes and what the protocol decoded of them.
#[derive(Debug, Default)]
struct Input {
    /// Received bytes not decoded yet (a partial message); empty, with no allocation, between
    /// messages.
    buf: BytesMut,
    /// The rest of a receive taken whole behind a partial message
    /// ([`PushConnection::receive_owned`]): decoded where it lies once `buf`, which ends that
    /// message, is.
    rest: Option<BytesMut>,
    /// Decoded events of the input being handled, from `next_event` on, and the protocol's
    /// urgent scratch.
    output: ProtocolOutput,
    next_event: usize,
    /// Where the next line of the event at `next_event` starts, when that is an
    /// [`Inbound::Lines`] run.
    line_at: usize,
    /// The input's decode failed: handled after its events.
    error: Option<ProtocolError>,
    /// A request of the input waiting for its answer.
    pending: Option<Pending>,
    /// What the protocol said when its decode failed or it answered the peer's close (its
    /// final error, close frame): held for the close, which writes it last.
    last_words: Vec<Bytes>,
    /// The topics of the publish asked for last ([`PushConnection::publish_topics`]).
    topics: TopicList,
    /// The publish run being gathered ([`Request::PublishRun`]): empty between polls.
    run: Vec<Message>,
    /// What the line after a run asked, asked by the next poll, after the run.
    after_run: Option<Request>,
    /// Since when the output has been over the input mark with input to handle (see
    /// [`PushConnection::input_waiting`]): kept across inputs until the output is found under
    /// the mark, so that a peer that reads nothing waits `input_hold_timeout_ms` once, not once
    /// per receive.
    held_since: Option<Instant>,
    /// When, during the current hold or stall, the driver was last asked to try a write
    /// without waiting for the socket's readiness ([`PushConnection::probe_writable`]), or a
    /// stall's deadline counted the write in flight as that try.
    probed: Option<Instant>,
    /// When the socket last went from taking every write to refusing part of one: where a
    /// stall past `max_outbox_bytes` is timed from, with the peer's later signs of life (the
    /// write itself is no sign of life: the kernel's buffer took it, not the peer). `None`
    /// while the socket takes everything.
    behind_since: Option<Instant>,
    /// Output held below the connection (a TLS layer's ciphertext) while that layer's socket
    /// refuses part of its writes; 0 while it takes everything
    /// ([`PushConnection::on_below_written`]). Counted with the connection's own output by the
    /// stall and by `max_outbox_bytes`.
    below: usize,
}

/// Appends received bytes to an input buffer. Into an empty one, an allocation of just what
/// arrived: the lines decoded from it share it, and it is freed with the last of them. Behind a
/// partial message that its buffer has no room for, a new buffer for both, at least twice the
/// partial's length (a long message arriving in pieces is copied a bounded number of times per
/// byte): growing the old buffer would copy the whole receive it was split from, not only the
/// partial message.
pub(crate) fn append_input(buf: &mut BytesMut, data: &[u8]) {
    let partial = buf.len();
    if partial == 0 {
        let mut fresh = BytesMut::with_capacity(data.len());
        crate::copy::put(&mut fresh, data);
        *buf = fresh;
    } else if buf.capacity() - partial < data.len() {
        let mut grown = BytesMut::with_capacity((partial + data.len()).max(2 * partial));
        crate::copy::put(&mut grown, buf);
        crate::copy::put(&mut grown, data);
        *buf = grown;
    } else {
        crate::copy::put(buf, data);
    }
}

/// [`append_input`] of bytes in a buffer of their own: into an empty input buffer, that buffer
/// itself (no copy).
fn append_owned(buf: &mut BytesMut, data: BytesMut) {
    if buf.is_empty() {
        *buf = data;
    } else {
        append_input(buf, &data);
    }
}

/// What [`Input::take_event`] hands out.
enum Taken {
    /// A decoded event (never an [`Inbound::Lines`]).
    Event(Inbound),
    /// The next line of a run of lines, from `run[start]` to its newline (not found yet). The
    /// run is lent: once the line's end is known ([`Input::end_line`]), it goes back with
    /// [`Input::give_back`] unless that was its last line.
    Line { run: Bytes, start: usize },
}

impl Input {
    /// The next decoded event or line of a run, taken (an event's slot keeps a placeholder
    /// until the list is cleared). The lines of a run are read where they lie: no `Bytes` and
    /// no event per line.
    fn take_event(&mut self) -> Option<Taken> {
        let event = self.output.events.get_mut(self.next_event)?;
        let Inbound::Lines(run) = event else {
            self.next_event += 1;
            return Some(Taken::Event(std::mem::replace(event, Inbound::Pong)));
        };
        Some(Taken::Line {
            run: std::mem::take(run),
            start: self.line_at,
        })
    }

    /// The line of a [`Taken::Line`] ends at `newline` (its run's length where the run ends
    /// without one): the next line starts past it. Whether it was the run's last line.
    fn end_line(&mut self, run_len: usize, newline: usize) -> bool {
        let last = newline + 1 >= run_len;
        if last {
            self.next_event += 1;
            self.line_at = 0;
        } else {
            self.line_at = newline + 1;
        }
        last
    }

    /// The line of a [`Taken::Line`] that the publish read did not take, cut at its newline:
    /// where it ends as a line of its own (before a `\r` that precedes the newline), and
    /// whether it was the run's last line ([`Input::end_line`]). A run ends with a newline (the
    /// protocol's contract); a run cut short ends at its end all the same.
    fn cut_line(&mut self, run: &[u8], start: usize) -> (usize, bool) {
        let newline = memchr::memchr(b'\n', &run[start..]).map_or(run.len(), |n| start + n);
        let last = self.end_line(run.len(), newline);
        let end = newline - usize::from(newline > start && run[newline - 1] == b'\r');
        (end, last)
    }

    /// Puts back the run a [`Taken::Line`] lent, if its event is still the one being read.
    fn give_back(&mut self, run: Bytes) {
        if let Some(Inbound::Lines(slot)) = self.output.events.get_mut(self.next_event) {
            if slot.is_empty() {
                *slot = run;
            }
        }
    }
}

/// The topics of one publish, one after another in one string that keeps its capacity from
/// publish to publish (no allocation per publish).
#[derive(Debug, Default)]
struct TopicList {
    text: String,
    /// Where each topic ends in `text`.
    ends: Vec<usize>,
}

impl TopicList {
    /// Whether the list is the one topic of a message of `stream` without a device.
    fn is(&self, stream: &str) -> bool {
        self.ends.len() == 1 && self.text == stream
    }

    /// Makes the list the topics of a message of `stream` and `device` ([`publish_topics`]'s
    /// rule: the stream's topic, and the device's when the message names one).
    ///
    /// [`publish_topics`]: crate::protocol::publish_topics
    fn set_message(&mut self, stream: &str, device: Option<&str>) {
        // A publisher most often publishes to the same stream again: the list it has is kept.
        if device.is_none() && self.is(stream) {
            return;
        }
        self.text.clear();
        self.ends.clear();
        self.push(topic_parts(stream, None));
        if device.is_some() {
            self.push(topic_parts(stream, device));
        }
    }

    /// Adds the topic written as `parts`.
    fn push(&mut self, parts: [&str; 3]) {
        // An empty part is not copied (a stream's topic is one part).
        for part in parts.into_iter().filter(|p| !p.is_empty()) {
            self.text.push_str(part);
        }
        self.ends.push(self.text.len());
    }

    fn iter(&self) -> PublishTopics<'_> {
        PublishTopics {
            text: &self.text,
            ends: self.ends.iter(),
            start: 0,
        }
    }
}

/// The topics of a [`Request::Publish`], from [`PushConnection::publish_topics`].
#[derive(Debug, Clone)]
pub struct PublishTopics<'a> {
    text: &'a str,
    ends: std::slice::Iter<'a, usize>,
    start: usize,
}

impl<'a> Iterator for PublishTopics<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let &end = self.ends.next()?;
        let topic = &self.text[self.start..end];
        self.start = end;
        Some(topic)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.ends.size_hint()
    }
}

impl ExactSizeIterator for PublishTopics<'_> {}

/// Whether `proto` frames a JSON message as the NDJSON line (the message and `\n`).
fn frames_as_ndjson(proto: &mut dyn StreamProtocol) -> bool {
    let mut probe = BytesMut::new();
    proto.encode_text(b"{}", &mut probe);
    &probe[..] == b"{}\n"
}

/// Whether `proto` writes a hub JSON-batch frame as it is (the frame protocol), so a batch's
/// one frame goes to every such subscriber as it is.
fn frames_as_hub_frames(proto: &mut dyn StreamProtocol) -> bool {
    let Ok(sample) = powerhub_plugin::frame::encode_json_batch([&b"{}"[..]]) else {
        return false;
    };
    let mut probe = BytesMut::new();
    proto.encode_text(&sample, &mut probe);
    probe[..] == sample[..]
}

impl PushConnection {
    /// A connection speaking `proto`, reading commands with `session`, started at `now`.
    ///
    /// # Errors
    ///
    /// The outbox refuses its settings (never for a [`PushConfig`], which validated them).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::Instant;
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits, PushState};
    /// let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// let conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, Instant::now()).unwrap();
    /// assert_eq!(conn.state(), PushState::Open);
    /// ```
    pub fn new(
        mut proto: Box<dyn StreamProtocol>,
        session: Session,
        config: &Arc<PushConfig>,
        now: Instant,
    ) -> Result<PushConnection, OutboxConfigError> {
        let hub_frames = frames_as_hub_frames(proto.as_mut());
        let outbox_config = if frames_as_ndjson(proto.as_mut()) {
            &config.outbox_ndjson
        } else {
            &config.outbox_protocol
        };
        let outbox = Outbox::new(Arc::clone(outbox_config), Arc::clone(&config.factory), now)?;
        Ok(PushConnection {
            proto,
            hub_frames,
            input: None,
            urgent: WriteQueue::default(),
            outbox,
            session,
            config: Arc::clone(config),
            state: PushState::Open,
            ending: None,
            started: now,
            last_inbound_ms: 0,
            counts: PushCounts::default(),
            limit_errors: 0,
            protocol_errors: 0,
            freed: 0,
            transmitting: false,
            outbox_mid: false,
            fan_out_first: false,
            published: false,
            greeting: false,
            greeted: false,
        })
    }

    fn millis(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.started).as_millis() as u64
    }

    /// Bytes received from the peer (plaintext): decodes them. Then call [`poll`](Self::poll)
    /// until it returns `None`.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::{Instant, SystemTime};
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// # let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// conn.handle_input(b"{\"type\":\"ping\",\"id\":7}\n", now);
    /// assert_eq!(conn.poll(now, SystemTime::now()), None); // a ping needs nothing of the driver
    /// let mut out = Vec::new();
    /// conn.poll_transmit(&mut out, 16, now).unwrap();
    /// assert_eq!(out.concat(), b"{\"type\":\"pong\",\"requestId\":7}\n");
    /// ```
    pub fn handle_input(&mut self, data: &[u8], now: Instant) {
        self.receive(data);
        self.decode_input(now, false);
    }

    /// Appends received plaintext to the input buffer (counted), without decoding it.
    pub(crate) fn receive(&mut self, data: &[u8]) {
        self.count_received(data.len());
        if self.state != PushState::Open {
            return;
        }
        let input = self.input.get_or_insert_with(Box::default);
        append_input(input.rest.as_mut().unwrap_or(&mut input.buf), data);
    }

    /// Received plaintext in a buffer of its own (a backend's receive buffer, taken whole):
    /// it becomes the input buffer where the input is empty, so the lines decoded from it share
    /// it rather than a copy.
    ///
    /// Behind a partial message, only the bytes to the first newline (where an NDJSON message
    /// ends) are copied to it; the rest is decoded where it lies once the partial message is.
    /// A protocol whose message does not end there has the rest copied behind it then.
    pub(crate) fn receive_owned(&mut self, mut data: BytesMut) {
        self.count_received(data.len());
        if self.state != PushState::Open {
            return;
        }
        let input = self.input.get_or_insert_with(Box::default);
        if let Some(rest) = input.rest.as_mut() {
            append_input(rest, &data);
            return;
        }
        if !input.buf.is_empty() {
            if let Some(end) = memchr::memchr(b'\n', &data).filter(|&end| end + 1 < data.len()) {
                append_input(&mut input.buf, &data[..=end]);
                data.advance(end + 1);
                input.rest = Some(data);
                return;
            }
        }
        append_owned(&mut input.buf, data);
    }

    /// Drops received bytes not decoded yet (the connection is closing: nothing more is read).
    pub(crate) fn discard_input(&mut self) {
        if let Some(input) = self.input.as_deref_mut() {
            input.buf.clear();
            input.rest = None;
        }
    }

    /// Counts `n` bytes received (a TLS record's, decrypted into [`inbuf_mut`](Self::inbuf_mut)).
    pub(crate) fn count_received(&mut self, n: usize) {
        self.counts.bytes_in += n as u64;
    }

    /// The buffer received plaintext goes into (a TLS layer decrypts into it), before
    /// [`decode_received`](Self::decode_received).
    pub(crate) fn inbuf_mut(&mut self) -> &mut BytesMut {
        &mut self.input.get_or_insert_with(Box::default).buf
    }

    /// The peer ended its stream (a TCP end of stream): a message it cut short is read as the
    /// protocol's last message (an NDJSON line without its newline) or refused with an error
    /// that names it, said in the protocol (see
    /// [`StreamProtocol::decode_end`]). Then call
    /// [`poll`](Self::poll) until it returns `None`, and close the connection as the peer did,
    /// after what is queued.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::{Instant, SystemTime};
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// # let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// conn.handle_input(b"{\"type\":\"ping\",\"id\":7}", now); // no newline yet
    /// assert_eq!(conn.poll(now, SystemTime::now()), None);
    /// conn.handle_end_of_stream(now); // nor ever: the last line is read as it is
    /// assert_eq!(conn.poll(now, SystemTime::now()), None);
    /// let mut out = Vec::new();
    /// conn.poll_transmit(&mut out, 16, now).unwrap();
    /// assert_eq!(out.concat(), b"{\"type\":\"pong\",\"requestId\":7}\n");
    /// ```
    pub fn handle_end_of_stream(&mut self, now: Instant) {
        self.decode_input(now, true);
    }

    /// Decodes what the input buffer holds (see [`handle_input`](Self::handle_input)); at the
    /// peer's `end` of stream, all of it (see [`handle_end_of_stream`](Self::handle_end_of_stream)).
    pub(crate) fn decode_input(&mut self, now: Instant, end: bool) {
        if !end {
            self.last_inbound_ms = self.millis(now);
        }
        let input = self.input.get_or_insert_with(Box::default);
        if self.state != PushState::Open || input.error.is_some() {
            // Closed, or closing on a decode error not polled yet: nothing more is read.
            input.buf.clear();
            input.rest = None;
            return;
        }
        // Events of an earlier input not polled yet stay first.
        if input.next_event >= input.output.events.len() {
            input.output.events.clear();
            input.next_event = 0;
            input.line_at = 0;
            self.published = false;
        }
        input.output.urgent.clear();
        let result = if end {
            if let Some(rest) = input.rest.take() {
                append_input(&mut input.buf, &rest);
            }
            self.proto.decode_end(&mut input.buf, &mut input.output)
        } else {
            let mut result = self.proto.decode_runs(&mut input.buf, &mut input.output);
            // A receive's rest, behind the message that `buf` ended (after an error nothing
            // more is read).
            if let Some(rest) = input.rest.take().filter(|_| result.is_ok()) {
                append_owned(&mut input.buf, rest);
                result = self.proto.decode_runs(&mut input.buf, &mut input.output);
            }
            result
        };
        if input.buf.is_empty() {
            // Nothing partial: hold no buffer while waiting for input.
            input.buf = BytesMut::new();
        } else if input.buf.capacity() > 2 * input.buf.len() + KEEP_SLACK {
            // A partial message at the end of a large receive: keep only its bytes.
            input.buf = BytesMut::from(&input.buf[..]);
        }
        if !input.output.urgent.is_empty() {
            let words = input.output.urgent.split().freeze();
            // A decode that failed, or that read the peer's close, ends with the protocol's
            // last words: they wait for the close, behind what is framed before them.
            let last = result.is_err()
                || input.output.events[input.next_event..]
                    .iter()
                    .any(|e| matches!(e, Inbound::Close { .. }));
            if last {
                input.last_words.push(words);
            } else {
                self.urgent.push(words);
            }
        }
        // A message meets the first-message deadline (once the connection authenticated, where
        // the server requires it); a keepalive pong does not.
        self.greeting |= input.output.events[input.next_event..].iter().any(|e| {
            matches!(
                e,
                Inbound::Text(_) | Inbound::Lines(_) | Inbound::Binary(_) | Inbound::Close { .. }
            )
        });
        let nothing_to_handle = input.next_event >= input.output.events.len();
        if let Err(e) = result {
            input.error = Some(e);
        } else if nothing_to_handle && self.close_if_unauthenticated_input_too_long(now) {
            // (With commands to handle, judged once they are: an `auth` command read with the
            // long message would lift the limit.)
            return;
        }
        // What was published before this input reaches the outbox before the replies to it.
        self.fan_out_first = self.is_subscribed();
    }

    /// Where the server requires authentication and the connection has not authenticated:
    /// closes it, naming `max_unauthenticated_message_bytes`, if it holds more than that of an
    /// unfinished message; whether it did. Judged once the commands read before that message
    /// are handled.
    fn close_if_unauthenticated_input_too_long(&mut self, now: Instant) -> bool {
        // The session first: an authenticated connection (or a server without authentication)
        // pays no call into the protocol. An opening handshake under way (WebSocket's) is held
        // to `limits.max_handshake_bytes` instead.
        if !self.session.awaiting_auth() || !self.proto.is_ready() {
            return false;
        }
        let buffered = self
            .input
            .as_deref()
            .map_or(0, |i| i.buf.len() + i.rest.as_ref().map_or(0, |r| r.len()));
        let held = buffered + self.proto.pending_message_bytes();
        let most = self.config.limits.max_unauthenticated_message_bytes;
        if held <= most {
            return false;
        }
        self.limit_errors = self.limit_errors.saturating_add(1);
        let msg = format!(
            "{held} bytes of a message before authentication exceed \
             max_unauthenticated_message_bytes = {most}; authenticate first"
        );
        self.discard_input();
        // After the answers to what came before it (a `ping` read with it).
        let ending = Ending::limit("max_unauthenticated_message_bytes", msg).in_order();
        self.close(ending, now);
        true
    }

    fn is_subscribed(&self) -> bool {
        self.session.subscriptions().next().is_some()
    }

    /// Whether the output (unsent bytes with the queue entries in use) is over a quarter of
    /// `max_outbox_bytes`: what `max_outbox_bytes` counts (the queues' capacity, which grows by
    /// doubling, and their scratch) stays under the limit while the input waits. A protocol
    /// that takes no more of the outbox's bytes (a WebSocket that read the peer's close) is
    /// never over it: its output will not drain, and what waits may be that close.
    fn over_input_mark(&self) -> bool {
        self.proto.is_ready()
            && self.outbox.live_bytes() + self.urgent.unsent()
                > self.config.limits.max_outbox_bytes / 4
    }

    /// Until when input over the input mark waits: `input_hold_timeout_ms` past the later of the
    /// hold's start and the peer's last sign of life (a write it took part of, a pong). A peer
    /// that reads nothing for that long has its input handled again, so its output reaches
    /// `max_outbox_bytes` and it is closed as the limit says.
    fn hold_deadline(&self, since: Instant) -> Instant {
        let wait = Duration::from_millis(self.config.limits.input_hold_timeout_ms);
        let deadline = since.max(self.outbox.last_alive()) + wait;
        // A write tried at the deadline (see `probe_writable`) is waited for.
        match self.input.as_deref().and_then(|i| i.probed) {
            Some(at) => deadline.max(at + PROBE_WAIT),
            None => deadline,
        }
    }

    /// Whether the driver should try a write now, without waiting for the socket's readiness:
    /// the hold's deadline has come while the driver waits for the socket to become writable
    /// ([`Outbox::wants_writable`]), and no such try was made since the peer last took
    /// output. A readiness event comes only once much of the socket's buffer is free, which a
    /// reader taking its replies slowly, but all along, may need longer than
    /// `input_hold_timeout_ms` for; the write shows whether the peer reads (its progress extends
    /// the hold), and the hold waits [`PROBE_WAIT`] for it. The driver makes the write happen (the epoll and
    /// io_uring shards end the wait for readiness at once), then calls
    /// [`on_writable`](Self::on_writable) as for a readiness event.
    ///
    /// The same holds for a connection past `max_outbox_bytes` whose socket refused part of its
    /// last write and that is sent nothing more, `stall_timeout_ms` after its socket began
    /// refusing (or after the peer's last sign of life). A driver calls this before
    /// [`handle_timeout`](Self::handle_timeout), which would otherwise count the write in flight
    /// as the try.
    pub fn probe_writable(&mut self, now: Instant) -> bool {
        if self.state != PushState::Open {
            return false;
        }
        let hold = self.hold_start().map(|since| self.hold_deadline(since));
        let Some(due) = hold.into_iter().chain(self.stall_deadline()).min() else {
            return false;
        };
        if now < due || !(self.outbox.wants_writable() || self.held_below() > 0) {
            return false;
        }
        // A try is made once per sign of life; progress at the very instant of the try (a
        // driver that writes at once, on one clock reading) is its answer, and a later deadline
        // may try again.
        if self.tried_since(self.last_life()).is_some() {
            return false;
        }
        let Some(input) = self.input.as_deref_mut() else {
            return false;
        };
        input.probed = Some(now);
        true
    }

    /// The peer's last sign of life (its last pong or drain progress), or the write its socket
    /// began refusing at, whichever is later: a stall is timed from there.
    fn last_life(&self) -> Instant {
        let alive = self.outbox.last_alive();
        self.input
            .as_deref()
            .and_then(|i| i.behind_since)
            .map_or(alive, |behind| behind.max(alive))
    }

    /// The write tried since the peer's last sign of life (see
    /// [`probe_writable`](Self::probe_writable)), if one was.
    fn tried_since(&self, life: Instant) -> Option<Instant> {
        self.input
            .as_deref()
            .and_then(|i| i.probed)
            .filter(|&at| at > life)
    }

    /// When a connection past `max_outbox_bytes`, its socket refusing part of its last write,
    /// is next judged if the peer takes nothing more: `stall_timeout_ms` after the later of the
    /// write its socket began refusing at and the peer's last sign of life, then [`PROBE_WAIT`]
    /// after a write tried at that deadline (see [`probe_writable`](Self::probe_writable)),
    /// which closes it if the try took nothing. A delivery that finds it behind and past the
    /// limit closes it at once (see [`check_limits`](Self::check_limits)); this is for one sent
    /// nothing more, whose output would otherwise wait for the liveness timeout. `None` while it
    /// is under the limit or its socket took all of its last write.
    fn stall_deadline(&self) -> Option<Instant> {
        if !self.behind_socket() || self.held_output() <= self.config.limits.max_outbox_bytes {
            return None;
        }
        let life = self.last_life();
        Some(match self.tried_since(life) {
            Some(at) => at + PROBE_WAIT,
            None => life + Duration::from_millis(self.config.limits.stall_timeout_ms),
        })
    }

    /// Whether [`poll`](Self::poll) handles no more input at `now` (see
    /// [`hold_deadline`](Self::hold_deadline)); starts the hold, or ends it under the mark.
    ///
    /// A hold that ends counts as input at `now` for `idle_timeout_ms`: the peer sent what the
    /// server did not read meanwhile (see [`idle_deadline`](Self::idle_deadline)).
    #[inline]
    fn hold_input(&mut self, now: Instant) -> bool {
        let over = self.over_input_mark();
        if !over && self.input.as_deref().is_none_or(|i| i.held_since.is_none()) {
            // The usual case, on every command: no hold, none to end.
            return false;
        }
        self.hold_or_release(over, now)
    }

    /// [`hold_input`](Self::hold_input) with a hold to start, keep or end.
    #[inline(never)]
    fn hold_or_release(&mut self, over: bool, now: Instant) -> bool {
        let Some(input) = self.input.as_deref_mut() else {
            return false;
        };
        if !over {
            input.probed = None;
            if input.held_since.take().is_some() {
                self.last_inbound_ms = self.millis(now);
            }
            return false;
        }
        input.held_since.get_or_insert(now);
        let held = self.within_hold(now);
        if !held {
            self.last_inbound_ms = self.millis(now);
        }
        held
    }

    /// When `idle_timeout_ms` closes the connection: that long after the last input, unless
    /// received input waits to be handled while the output is over the input mark (held back,
    /// see [`input_waiting`](Self::input_waiting)): a peer whose input the server does not read
    /// is not idle. `None` without the timeout.
    fn idle_deadline(&self) -> Option<u64> {
        let idle = self.config.limits.idle_timeout_ms;
        let held_back = self.input_waiting() && self.over_input_mark();
        (idle > 0 && !held_back).then(|| self.last_inbound_ms.saturating_add(idle))
    }

    /// Whether `now` is before the deadline of the hold begun (true when none has begun: it
    /// begins at the next [`poll`](Self::poll)).
    fn within_hold(&self, now: Instant) -> bool {
        self.input
            .as_deref()
            .and_then(|i| i.held_since)
            .is_none_or(|since| now < self.hold_deadline(since))
    }

    /// Whether received input waits, not yet handled, because the output is over a quarter of
    /// `max_outbox_bytes`: the driver reads nothing more from the peer, and once writes have
    /// taken the output back under that mark ([`input_held`](Self::input_held) false), or at
    /// [`poll_timeout`](Self::poll_timeout) when the peer read none of it for
    /// `input_hold_timeout_ms`, calls [`poll`](Self::poll) again to handle the rest. So a client that pipelines commands
    /// faster than it reads their replies is slowed by TCP's flow control, as its reading
    /// allows, instead of being closed at the limit; one that reads nothing is closed at the
    /// limit.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::{Instant, SystemTime};
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits};
    /// let limits = PushLimits::default().with_max_outbox_bytes(65536);
    /// let config = Arc::new(PushConfig::new(limits, OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// // 2000 bad lines: an error reply each, far more than the outbox may hold.
    /// conn.handle_input(&b"x\n".repeat(2000), now);
    /// assert_eq!(conn.poll(now, SystemTime::now()), None);
    /// assert!(conn.input_waiting() && conn.input_held(now));
    /// let mut out = Vec::new();
    /// let t = conn.poll_transmit(&mut out, 1024, now).unwrap();
    /// let n = t.len();
    /// conn.on_written(t, n, now); // the client read it all
    /// assert!(!conn.input_held(now));
    /// assert_eq!(conn.poll(now, SystemTime::now()), None); // handles more of the rest
    /// ```
    pub fn input_waiting(&self) -> bool {
        self.state == PushState::Open
            && self
                .input
                .as_deref()
                .is_some_and(|i| i.next_event < i.output.events.len())
    }

    /// Whether waiting input is still held back by the output at `now` (see
    /// [`input_waiting`](Self::input_waiting)).
    pub fn input_held(&self, now: Instant) -> bool {
        self.input_waiting() && self.over_input_mark() && self.within_hold(now)
    }

    /// When the current hold began, if input waits over the mark and one has begun.
    fn hold_start(&self) -> Option<Instant> {
        self.input
            .as_deref()
            .and_then(|i| i.held_since)
            .filter(|_| self.input_waiting() && self.over_input_mark())
    }

    /// Handles the received input up to the next thing the driver must do, and returns it;
    /// `None` once the input is handled. `now` and `wall` are the input's time (one clock read
    /// per input: its commands arrived together).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::{Instant, SystemTime};
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits, Request};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// # let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// conn.handle_input(b"{\"type\":\"subscribe\",\"stream\":\"s\"}\n", now);
    /// match conn.poll(now, SystemTime::now()) {
    ///     Some(Request::Subscribe { topic, .. }) => {
    ///         assert_eq!(topic, "s");
    ///         conn.subscribe_done(Ok(()), now);
    ///     }
    ///     other => panic!("{other:?}"),
    /// }
    /// assert_eq!(conn.poll(now, SystemTime::now()), None);
    /// ```
    pub fn poll(&mut self, now: Instant, wall: SystemTime) -> Option<Request> {
        if let Some(request) = self.input.as_deref_mut().and_then(|i| i.after_run.take()) {
            return Some(request);
        }
        self.settle_pending(now);
        // Input that arrives once the token has expired is not handled: the driver's timer
        // closes such a connection too, but only at its next tick.
        self.close_if_expired(now, wall);
        'input: loop {
            if self.state != PushState::Open {
                self.end_input();
                self.count_decode_error();
                return None;
            }
            // A client's own replies past the limit (a subscriber's output is judged after each
            // input and delivery instead, by `check_limits`, when it grew).
            if !self.is_subscribed() {
                // (Only a subscriber is ever let through as not behind.)
                if let Some(ending) = self.over_outbox(true) {
                    self.close(ending, now);
                    continue;
                }
            }
            if std::mem::take(&mut self.fan_out_first) {
                return Some(Request::FanOut);
            }
            let Some(started) = self
                .input
                .as_deref()
                .filter(|i| i.next_event < i.output.events.len())
                .map(|i| i.next_event > 0 || i.line_at > 0)
            else {
                let failed = self.input.as_deref().is_some_and(|i| i.error.is_some());
                if failed && std::mem::take(&mut self.published) && self.is_subscribed() {
                    // The input ends in what cannot be read past, and its last command
                    // published to a connection subscribed itself: that fan-out goes before
                    // the final error, as for any command after a publish.
                    return Some(Request::FanOut);
                }
                self.end_input();
                if let Some(ending) = self.count_decode_error() {
                    self.close(ending, now);
                } else {
                    // The commands read with an unfinished message are handled, and none of
                    // them authenticated the connection.
                    self.close_if_unauthenticated_input_too_long(now);
                }
                return None;
            };
            if started && std::mem::take(&mut self.published) && self.is_subscribed() {
                // The command before this one published, and the connection is subscribed: that
                // fan-out goes first, so that the reply to this command does not overtake a
                // delivery published before it. (A connection that does not subscribe, as most
                // publishers, keeps its batches whole.)
                return Some(Request::FanOut);
            }
            if self.hold_input(now) {
                // The rest of the input waits for the output to drain (see `input_waiting`):
                // a client that pipelines commands faster than it reads their replies is held
                // back by TCP, not cut at `max_outbox_bytes`. What it handled meets the
                // first-message deadline already.
                if started && self.greeting && !self.session.awaiting_auth() {
                    self.greeted = true;
                }
                return None;
            }
            let Some(taken) = self.input.as_deref_mut().and_then(Input::take_event) else {
                continue;
            };
            let event = match taken {
                Taken::Event(event) => event,
                Taken::Line { run, mut start } => loop {
                    // A usual publish is read where it lies, its line's end found by the read;
                    // any other line is cut at its newline, and sliced off the run and parsed as
                    // a text event's.
                    let mut read = self.session.read_publish_line(&run[start..]);
                    // A line that joins the run being gathered goes into it if it is published
                    // (what `runs_publish` checks of a first publish holds of it already).
                    let joins = self.gathering();
                    if joins && !matches!(&read, Ok((p, _)) if self.joins_run(p)) {
                        // The line is read by the next poll, after the run is asked.
                        self.input_mut().give_back(run);
                        return Some(self.take_run());
                    }
                    // Matched in place: the read publish is not moved.
                    let (request, last) = match &mut read {
                        Ok((publish, newline)) => {
                            let newline = *newline;
                            let last = self.input_mut().end_line(run.len(), start + newline);
                            self.counts.messages_in = self.counts.messages_in.saturating_add(1);
                            // Without its `\r`, as `cut_line` cuts other lines.
                            let line = &run[start..start + newline];
                            let line = line.strip_suffix(b"\r").unwrap_or(line);
                            let request = if self.refused_as_long(line, now) {
                                None
                            } else {
                                self.publish_read(publish, &run, now, wall)
                            };
                            (request, last)
                        }
                        &mut Err(reread) => {
                            let (end, last) = self.input_mut().cut_line(&run, start);
                            if run[start..end].iter().all(u8::is_ascii_whitespace) {
                                if !last {
                                    self.input_mut().give_back(run);
                                }
                                continue 'input;
                            }
                            self.counts.messages_in = self.counts.messages_in.saturating_add(1);
                            let request = if self.refused_as_long(&run[start..end], now) {
                                None
                            } else {
                                let read = reread
                                    .then(|| self.session.read_publish(&run[start..end]))
                                    .flatten();
                                match read {
                                    Some(mut publish) => {
                                        self.publish_read(&mut publish, &run, now, wall)
                                    }
                                    None => self.command_line(run.slice(start..end), now, wall),
                                }
                            };
                            (request, last)
                        }
                    };
                    let request = match request {
                        Some(Request::Publish { message }) if joins || self.runs_publish() => {
                            // Gathered, answered with nothing (it has no id); the run's next
                            // line is read at once, with nothing in between to check: this
                            // publish changed neither the output nor the connection's state.
                            let input = self.input_mut();
                            // It holds no allocation (a publish without an id): forgotten, with
                            // no drop to call.
                            std::mem::forget(input.pending.take());
                            if input.run.is_empty() && !last {
                                // Room for the run's lines if they are as long as this one.
                                let line = input.line_at.saturating_sub(start).max(1);
                                let rest = run.len() - start;
                                input.run.reserve((rest / line).min(MAX_RUN_RESERVE));
                            }
                            input.run.push(message);
                            if last {
                                return Some(self.take_run());
                            }
                            start = input.line_at;
                            continue;
                        }
                        other => other,
                    };
                    if !last {
                        self.input_mut().give_back(run);
                    }
                    if self.gathering() {
                        // A publish of the run refused (its error queued): the run goes first.
                        // (A refusal asks nothing of the driver today; were a line that joins
                        // to ask something, it would be asked right after the run.)
                        if let Some(request) = request {
                            self.input_mut().after_run = Some(request);
                        }
                        return Some(self.take_run());
                    }
                    match request {
                        Some(request) => return Some(request),
                        None => continue 'input,
                    }
                },
            };
            match event {
                Inbound::Text(line) => {
                    self.counts.messages_in = self.counts.messages_in.saturating_add(1);
                    // A usual publish is read where it lies (the line may share one receive
                    // with others), and handled without making its command; any other line is
                    // parsed in place, copied first only if its bytes are shared.
                    let request = if self.refused_as_long(&line, now) {
                        None
                    } else {
                        match self.session.read_publish(&line) {
                            Some(mut publish) => self.publish_read(&mut publish, &line, now, wall),
                            None => self.command_line(line, now, wall),
                        }
                    };
                    if request.is_some() {
                        return request;
                    }
                }
                Inbound::Binary(_) => {
                    self.counts.messages_in = self.counts.messages_in.saturating_add(1);
                    let err =
                        reply::error(None, codes::UNSUPPORTED, "binary messages carry no command");
                    self.outbox.push_control(err, now);
                }
                Inbound::Pong => self.outbox.on_pong(now),
                Inbound::Credential(token) => {
                    let action = self.session.authenticate(&token, wall);
                    if let Some(request) = self.perform(action, None, now) {
                        return Some(request);
                    }
                }
                Inbound::Close { code, reason } => {
                    // The protocol's answer (a WebSocket close reply) goes last.
                    let detail = format!("close code {code}: {reason}");
                    let ending = Ending::unsaid("peer_closed", detail).said_by_protocol();
                    self.close(ending, now);
                }
                _ => {}
            }
        }
    }

    /// The ending for the input's decode error, if it had one (counted: a protocol error, and
    /// a limit error when it was over a limit). The protocol said it (its final error or close
    /// frame is in the urgent bytes); the log names the limit when one was exceeded.
    fn count_decode_error(&mut self) -> Option<Ending> {
        let e = self.input.as_deref_mut()?.error.take()?;
        self.protocol_errors = self.protocol_errors.saturating_add(1);
        let reason = match e {
            ProtocolError::TooLarge { limit_name, .. } => {
                self.limit_errors = self.limit_errors.saturating_add(1);
                limit_name
            }
            _ => "protocol_error",
        };
        // After everything queued: the replies to the commands read before the input that
        // cannot be read past, and what was delivered before them, as a peer that sent them in
        // another receive would have had them.
        Some(
            Ending::unsaid(reason, e.to_string())
                .said_by_protocol()
                .in_order(),
        )
    }

    /// The input is handled: the first-message deadline is met if it held a message; the event
    /// list is cleared (and not kept when large).
    fn end_input(&mut self) {
        if std::mem::take(&mut self.greeting) && !self.session.awaiting_auth() {
            self.greeted = true;
        }
        if let Some(input) = self.input.as_deref_mut() {
            input.output.events.clear();
            input.next_event = 0;
            input.line_at = 0;
            if input.output.events.capacity() > KEEP_EVENTS {
                input.output.events = Vec::new();
            }
        }
    }

    /// Does what the session asked for one command (`request_id` is the command's); a request
    /// for the driver, if it needs one.
    fn perform(
        &mut self,
        action: Action,
        request_id: Option<RequestId>,
        now: Instant,
    ) -> Option<Request> {
        match action {
            Action::Subscribe {
                subscription_id,
                hub_id,
                topic,
                reply,
            } => {
                *self.pending_slot() = Some(Pending::Subscribe {
                    subscription_id: Arc::clone(&subscription_id),
                    reply,
                    request_id,
                });
                return Some(Request::Subscribe {
                    subscription_id,
                    hub_id: hub_id.into(),
                    topic,
                });
            }
            Action::Unsubscribe {
                subscription_id,
                topic,
                ack,
                ..
            } => {
                *self.pending_slot() = Some(Pending::Unsubscribe {
                    subscription_id: Arc::clone(&subscription_id),
                    ack,
                });
                return Some(Request::Unsubscribe {
                    subscription_id,
                    topic,
                });
            }
            Action::Publish {
                request_id,
                message,
                meta,
                ..
            } => {
                // The action's `topics`, written into the kept list by the same rule.
                self.input_mut()
                    .topics
                    .set_message(&meta.stream, meta.device_id.as_str());
                return Some(self.ask_publish(request_id, message));
            }
            Action::Reply(bytes) => {
                // A limit refused this command and the connection stays: counted as a close
                // on a limit is.
                if reply::is_limit_error(&bytes) {
                    self.limit_errors = self.limit_errors.saturating_add(1);
                }
                self.outbox.push_control(bytes, now);
            }
            Action::Pong => self.outbox.on_pong(now),
            Action::CloseOnAuth {
                request_id,
                code,
                message,
            } => {
                let ending = Ending::auth(code, message)
                    .answering(request_id.as_ref())
                    .in_order();
                self.close(ending, now);
            }
            Action::CloseOnLimit {
                request_id,
                limit,
                message,
            } => {
                self.limit_errors = self.limit_errors.saturating_add(1);
                // In order after the replies already queued, then the close.
                let ending = Ending::limit(limit, message)
                    .answering(request_id.as_ref())
                    .in_order();
                self.close(ending, now);
            }
        }
        None
    }

    /// Asks the driver to publish `message` to the topics listed in the input.
    fn ask_publish(&mut self, request_id: Option<RequestId>, message: Message) -> Request {
        self.published = true;
        // No id, no acknowledgement: the publisher cannot correlate one (docs/protocol.md); a
        // failure is still said.
        *self.pending_slot() = Some(Pending::Publish { request_id });
        Request::Publish { message }
    }

    /// A publish the session read where it lies ([`Session::read_publish`]): checked, then
    /// asked of the driver; or answered (an error, a close) when a check refuses it.
    fn publish_read(
        &mut self,
        publish: &mut fast::Publish<'_>,
        owner: &Bytes,
        now: Instant,
        wall: SystemTime,
    ) -> Option<Request> {
        if let Some(action) = self.session.check_read_publish(publish, wall) {
            return self.perform(action, publish.id.take(), now);
        }
        // A slice of the receive, not a copy (the hub copies it where it keeps it).
        let message = publish.message_in(owner);
        self.input_mut()
            .topics
            .set_message(publish.stream, publish.device_id());
        Some(self.ask_publish(publish.id.take(), message))
    }

    /// Whether the publish asked last waits for what it reached (a publish with an id, whose
    /// `published` reply carries the count); one without an id is answered with nothing.
    pub(crate) fn publish_wants_reach(&self) -> bool {
        matches!(
            self.input.as_deref().and_then(|i| i.pending.as_ref()),
            Some(Pending::Publish {
                request_id: Some(_)
            })
        )
    }

    /// The topics of the last [`Request::Publish`]: the stream's topic, then the device's when
    /// the message names a device; after a [`Request::PublishRun`], the run's one topic.
    pub fn publish_topics(&self) -> PublishTopics<'_> {
        static NONE: TopicList = TopicList {
            text: String::new(),
            ends: Vec::new(),
        };
        self.input.as_deref().map_or(&NONE, |i| &i.topics).iter()
    }

    /// Whether `line` is over the session's `max_line_bytes` (under the framing's limit, which
    /// closes), and then answered as [`refuse_line`](Self::refuse_line) answers.
    #[inline]
    fn refused_as_long(&mut self, line: &[u8], now: Instant) -> bool {
        match self.session.line_too_long(line) {
            Some(e) => {
                self.refuse_line(&e, now);
                true
            }
            None => false,
        }
    }

    /// Answers a line over one of the session's limits (`max_line_bytes`, `max_json_depth`):
    /// its error, counted as a limit error; the connection stays.
    #[cold]
    fn refuse_line(&mut self, e: &CommandError, now: Instant) -> Option<Request> {
        self.limit_errors = self.limit_errors.saturating_add(1);
        self.outbox.push_control(e.to_reply(), now);
        None
    }

    /// Parses and handles one line that is not a usual publish; a request for the driver, if
    /// it needs one.
    fn command_line(&mut self, line: Bytes, now: Instant, wall: SystemTime) -> Option<Request> {
        let cmd = match self.session.parse(line) {
            Ok(cmd) => cmd,
            // Over a limit (a line nested deeper than `max_json_depth`): counted as any limit
            // error; the connection stays.
            Err(e) if e.kind.limit().is_some() => return self.refuse_line(&e, now),
            Err(e) => {
                self.outbox.push_control(e.to_reply(), now);
                return None;
            }
        };
        let request_id = cmd.request_id().cloned();
        let action = self.session.handle_command_at(cmd, wall);
        self.perform(action, request_id, now)
    }

    /// Whether a publish run is being gathered.
    fn gathering(&self) -> bool {
        self.input.as_deref().is_some_and(|i| !i.run.is_empty())
    }

    /// Whether `publish`, read while a run is gathered, joins it: no id, the run's one topic.
    fn joins_run(&self, publish: &fast::Publish<'_>) -> bool {
        publish.id.is_none()
            && publish.device_id().is_none()
            && self
                .input
                .as_deref()
                .is_some_and(|i| i.topics.is(publish.stream))
    }

    /// Whether the publish just asked goes into a run: runs are gathered, the connection is
    /// not subscribed, and the publish has no id and one topic.
    fn runs_publish(&self) -> bool {
        self.config.publish_runs
            && self.input.as_deref().is_some_and(|i| {
                matches!(i.pending, Some(Pending::Publish { request_id: None }))
                    && i.topics.ends.len() == 1
            })
            && !self.is_subscribed()
    }

    /// The run gathered, asked of the driver.
    fn take_run(&mut self) -> Request {
        Request::PublishRun {
            messages: std::mem::take(&mut self.input_mut().run),
        }
    }

    fn input_mut(&mut self) -> &mut Input {
        self.input.get_or_insert_with(Box::default)
    }

    fn pending_slot(&mut self) -> &mut Option<Pending> {
        &mut self.input_mut().pending
    }

    /// The request waiting for its answer, taken if `is` says it is the one answered.
    fn take_pending(&mut self, is: impl FnOnce(&mut Pending) -> bool) -> Option<Pending> {
        self.input.as_deref_mut()?.pending.take_if(is)
    }

    /// Answers a request the driver left unanswered, as failed.
    fn settle_pending(&mut self, now: Instant) {
        match self.input.as_deref().and_then(|i| i.pending.as_ref()) {
            None => {}
            Some(Pending::Subscribe { .. }) => {
                self.subscribe_done(Err(SubscribeError::Closed), now)
            }
            Some(Pending::Unsubscribe { .. }) => self.unsubscribe_done(now),
            Some(Pending::Publish { .. }) => {
                if let Some(Pending::Publish { request_id }) = self.take_pending(|_| true) {
                    let err = reply::error(
                        request_id.as_ref(),
                        codes::PUBLISH_FAILED,
                        "the message was not published",
                    );
                    self.outbox.push_control(err, now);
                }
            }
        }
    }

    /// Answers [`Request::Subscribe`]: its `subscribed` reply is queued (before any delivery to
    /// it), or, when the fan-out refused it, its error.
    ///
    /// See [`poll`](Self::poll) for an example.
    pub fn subscribe_done(&mut self, result: Result<(), SubscribeError>, now: Instant) {
        let Some(Pending::Subscribe {
            subscription_id,
            reply,
            request_id,
        }) = self.take_pending(|p| matches!(p, Pending::Subscribe { .. }))
        else {
            return;
        };
        match result {
            Ok(()) => self.outbox.push_control(reply, now),
            Err(e) => {
                let err = self.session.subscribe_failed(
                    &subscription_id,
                    request_id.as_ref(),
                    &e.to_string(),
                );
                self.outbox.push_control(err, now);
            }
        }
    }

    /// Answers [`Request::Unsubscribe`]: the outbox drops the subscription's pending
    /// coalescible frames and queues its `unsubscribed` acknowledgement.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::{Instant, SystemTime};
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits, Request};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// # let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// conn.handle_input(b"{\"type\":\"subscribe\",\"stream\":\"s\",\"subscriptionId\":\"a\"}\n{\"type\":\"unsubscribe\",\"subscriptionId\":\"a\"}\n", now);
    /// while let Some(request) = conn.poll(now, SystemTime::now()) {
    ///     match request {
    ///         Request::Subscribe { .. } => conn.subscribe_done(Ok(()), now),
    ///         Request::Unsubscribe { .. } => conn.unsubscribe_done(now),
    ///         _ => {}
    ///     }
    /// }
    /// assert!(conn.session().subscriptions().next().is_none());
    /// ```
    pub fn unsubscribe_done(&mut self, now: Instant) {
        let Some(Pending::Unsubscribe {
            subscription_id,
            ack,
        }) = self.take_pending(|p| matches!(p, Pending::Unsubscribe { .. }))
        else {
            return;
        };
        self.outbox.unsubscribe(&subscription_id, ack, now);
    }

    /// Answers [`Request::Publish`] with the subscriber count (summed over its topics) or the
    /// failure: a publish with an id is acknowledged; a failure is said either way.
    ///
    /// See the [module docs](self) for an example.
    pub fn publish_done(&mut self, result: Result<usize, PublishError>, now: Instant) {
        let Some(Pending::Publish { request_id }) =
            self.take_pending(|p| matches!(p, Pending::Publish { .. }))
        else {
            return;
        };
        match result {
            Ok(_) if request_id.is_none() => {}
            Ok(total) => self
                .outbox
                .push_control(reply::published(request_id.as_ref(), total), now),
            Err(e) => self.outbox.push_control(
                reply::error(request_id.as_ref(), codes::PUBLISH_FAILED, &e.to_string()),
                now,
            ),
        }
    }

    /// A client certificate the TLS handshake verified, valid until `valid_until` (the
    /// earliest `notAfter` of the chain the client presented, if it could be read): the
    /// connection is closed with `certificate_expired` once that passes, at once where it has
    /// at `wall` (a resumed session is not verified again). A subject listed in the auth policy
    /// authenticates the connection before any of its commands is read.
    pub(crate) fn certificate_verified(
        &mut self,
        subject: Option<&PeerSubject>,
        valid_until: Option<SystemTime>,
        now: Instant,
        wall: SystemTime,
    ) {
        if let Some(at) = valid_until {
            self.session.limit_to_certificate(unix_secs(at));
            if self.close_if_expired(now, wall) {
                return;
            }
        }
        let Some(subject) = subject else {
            return;
        };
        if let Some(action) = self.session.authenticate_certificate(subject) {
            // An authentication needs nothing of the driver.
            let request = self.perform(action, None, now);
            debug_assert!(request.is_none());
        }
    }

    /// Delivers one NDJSON batch (`lines`: JSON messages, each ending in `\n`) to subscription
    /// `subscription_id`, under the outbox's rules; `false` (and nothing queued) unless the
    /// connection is open. Batches for a frame-protocol connection go through
    /// [`deliver_frame`](Self::deliver_frame) (see [`hub_frames`](Self::hub_frames)).
    ///
    /// See the [module docs](self) for an example.
    pub fn deliver_lines(&mut self, subscription_id: &str, lines: Bytes, now: Instant) -> bool {
        if self.state != PushState::Open {
            return false;
        }
        self.outbox.push_shared(subscription_id, lines, now);
        self.pause_before_limit();
        self.counts.deliveries = self.counts.deliveries.saturating_add(1);
        true
    }

    /// The coalescing rules take over before `max_outbox_bytes` closes the connection, however
    /// low it is set: at a quarter of it, where that is under `outbox.high_water_bytes` (a
    /// quarter, as what the limit counts, the queue's capacity, grows by doubling).
    fn pause_before_limit(&mut self) {
        self.outbox
            .pause_past(self.config.limits.max_outbox_bytes / 4);
    }

    /// Delivers one hub JSON-batch frame, lossless and in order with the replies, written as it
    /// is (the frame protocol's wire form is the hub frame); `false` (and nothing queued) unless
    /// the connection is open. A frame is never coalesced: the driver delivers a batch this
    /// way only while [`takes_frames`](Self::takes_frames) says so, else with
    /// [`deliver_lines`](Self::deliver_lines), under the outbox's rules (each message then
    /// framed on its own when written).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::Instant;
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::{frame, ProtocolFactory};
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let now = Instant::now();
    /// let proto = powerhub_frame::FrameFactory.new_connection(&Default::default());
    /// let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// assert!(conn.hub_frames());
    /// let batch = frame::encode_json_batch([&b"{\"a\":1}"[..]]).unwrap();
    /// assert!(conn.deliver_frame(batch.clone(), now));
    /// let mut out = Vec::new();
    /// conn.poll_transmit(&mut out, 16, now).unwrap();
    /// assert_eq!(out, [batch]);
    /// ```
    pub fn deliver_frame(&mut self, frame: Bytes, now: Instant) -> bool {
        if self.state != PushState::Open {
            return false;
        }
        self.outbox.push_wire(frame, now);
        self.pause_before_limit();
        self.counts.deliveries = self.counts.deliveries.saturating_add(1);
        true
    }

    /// Whether deliveries to this connection are hub frames ([`deliver_frame`](Self::deliver_frame))
    /// rather than NDJSON batches ([`deliver_lines`](Self::deliver_lines)).
    ///
    /// See [`deliver_frame`](Self::deliver_frame) for an example.
    pub fn hub_frames(&self) -> bool {
        self.hub_frames
    }

    /// Whether the next batch goes as a hub frame ([`deliver_frame`](Self::deliver_frame)): on
    /// a frame-protocol connection whose outbox is not paused. Behind its socket a frame is
    /// never coalesced, so the batch goes as lines instead, under the outbox's rules.
    pub fn takes_frames(&self) -> bool {
        self.hub_frames && !self.outbox.is_paused()
    }

    /// The hub closed subscription `subscription_id` (the driver's fan-out dropped it): the
    /// connection forgets it and closes, saying so.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::Instant;
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits, PushState};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// # let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// conn.subscription_ended("a", now);
    /// assert_eq!(conn.state(), PushState::Closing);
    /// assert_eq!(conn.close_reason(), Some("hub_closed"));
    /// ```
    pub fn subscription_ended(&mut self, subscription_id: &str, now: Instant) {
        // No acknowledgement is sent.
        let _ = self.session.handle_command(Command::Unsubscribe {
            id: None,
            subscription_id: subscription_id.to_owned(),
        });
        let ending = Ending::hub_closed(format!("the hub closed subscription {subscription_id}"));
        self.close(ending, now);
    }

    /// The server shuts down: the connection says so after everything queued (WebSocket: close
    /// 1001), then closes.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::Instant;
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits, PushState};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// # let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// conn.shutdown(now);
    /// let mut out = Vec::new();
    /// conn.poll_transmit(&mut out, 16, now).unwrap();
    /// assert!(String::from_utf8(out.concat()).unwrap().contains(r#""code":"shutdown""#));
    /// ```
    pub fn shutdown(&mut self, now: Instant) {
        self.close(Ending::shutdown(), now);
    }

    /// Closes for `ending`, saying it in the connection's protocol (see [`close`]): its error
    /// ahead of what is queued or after it, then (once everything is written) the protocol's
    /// close message; before the protocol's handshake, the protocol's refusal. Nothing when the
    /// close was decided already.
    pub(crate) fn close(&mut self, mut ending: Ending, now: Instant) {
        if self.state != PushState::Open {
            return;
        }
        ending.subscriptions = self.session.subscriptions().count();
        if let Some(error) = ending.error() {
            if self.proto.is_ready() {
                if ending.is_in_order() {
                    self.outbox.push_control(error, now);
                } else if !self.outbox.is_reaped() {
                    // The final error: after what is already encoded for the wire, and with
                    // nothing after it (what was queued behind is dropped with the connection).
                    self.discard_queued();
                    self.outbox.push_control(error, now);
                } else {
                    self.push_urgent_text(&error);
                }
                ending.close_code = ending.websocket_code();
            } else if let Some(status) = ending.http_status() {
                let mut buf = BytesMut::new();
                if self.proto.encode_refusal(status, &ending.detail, &mut buf) {
                    self.urgent.push(buf.freeze());
                }
            }
        }
        // What the protocol said on stopping (a decode's final error or close frame, its answer
        // to the peer's close) goes last, whatever closes the connection.
        if let Some(input) = self.input.as_deref_mut() {
            ending.last_words.append(&mut input.last_words);
        }
        if (ending.said_by_protocol && !ending.is_in_order()) || !self.proto.is_ready() {
            // The protocol said its last words out of turn, or carries no more data (it
            // answered the peer's close, or never finished its handshake): nothing queued may
            // follow. What the outbox encoded is still written, ahead of those words. (A
            // decode error's last words wait in order, behind everything queued.)
            self.discard_queued();
        }
        self.ending = Some(Box::new(ending));
        self.state = PushState::Closing;
    }

    /// Drops what the outbox holds not yet encoded for the wire, counting the memory freed.
    fn discard_queued(&mut self) {
        let before = self.output_memory();
        self.outbox.discard_queued();
        let freed = before.saturating_sub(self.output_memory());
        self.freed = self
            .freed
            .saturating_add(u32::try_from(freed).unwrap_or(u32::MAX));
    }

    /// Closes at once for `ending` (unless a close was decided before), saying nothing more.
    pub(crate) fn abort(&mut self, mut ending: Ending) {
        if self.ending.is_none() {
            ending.subscriptions = self.session.subscriptions().count();
            self.ending = Some(Box::new(ending));
        }
        self.state = PushState::Aborted;
    }

    /// When the connection's credential expires: its token's expiry or, from one second past
    /// its `notAfter`, its client certificate's, the earlier of the two; `None` if neither
    /// does.
    pub(crate) fn expires_at(&self) -> Option<SystemTime> {
        let token = self.session.expires_at();
        let Some(last) = self.session.certificate_until() else {
            return token;
        };
        let certificate = UNIX_EPOCH.checked_add(Duration::from_secs(last.saturating_add(1)));
        match (token, certificate) {
            (Some(t), Some(c)) => Some(t.min(c)),
            (t, c) => t.or(c),
        }
    }

    /// Closes the connection with `certificate_expired` if its client certificate has expired
    /// at `wall`, else with `token_expired` if its token has; whether it did.
    fn close_if_expired(&mut self, now: Instant, wall: SystemTime) -> bool {
        if self.state != PushState::Open {
            return false;
        }
        if let Some(last) = self
            .session
            .certificate_until()
            .filter(|&last| unix_secs(wall) > last)
        {
            let whose = self
                .session
                .user()
                .map_or_else(String::new, |u| format!(" (the connection of user `{u}`)"));
            let msg = format!(
                "the client certificate expired{whose}: its notAfter ({last} in Unix seconds) \
                 has passed; reconnect with a renewed one"
            );
            self.close(
                Ending::auth(codes::CERTIFICATE_EXPIRED, msg).in_order(),
                now,
            );
            return true;
        }
        if self.session.expires_at().is_none_or(|at| wall < at) {
            return false;
        }
        let msg = format!(
            "the token of user `{}` expired; send a fresh one before it does",
            self.session.user().unwrap_or_default()
        );
        self.close(Ending::auth(codes::TOKEN_EXPIRED, msg).in_order(), now);
        true
    }

    /// Queues one JSON message, framed by the connection's protocol, ahead of queued data.
    fn push_urgent_text(&mut self, json: &[u8]) {
        let mut buf = BytesMut::with_capacity(json.len() + 16);
        self.proto.encode_text(json, &mut buf);
        self.urgent.push(buf.freeze());
    }

    /// The ending of a connection whose unsent output passed `max_outbox_bytes` (counted as a
    /// limit error), if it did. A subscribed connection that is not `behind` (its socket
    /// refused nothing of the last write) is written to first, however much one fan-out queued
    /// for it: a reader that keeps up is not closed for a message, or a batch, larger than the
    /// limit; one whose socket then refuses part of it is judged at its next delivery.
    ///
    /// Such a connection is let through once per progress: judged again with no byte taken
    /// since (its send refused whole, or still waiting for room in the socket), it is behind.
    fn over_outbox(&mut self, behind: bool) -> Option<Ending> {
        let held = self.held_output();
        let max = self.config.limits.max_outbox_bytes;
        if held <= max {
            self.outbox.clear_grace();
            return None;
        }
        // The grace (kept in the outbox's marks): set once let through, cleared by progress.
        if !behind && self.is_subscribed() && !self.outbox.take_grace() {
            return None;
        }
        self.limit_errors = self.limit_errors.saturating_add(1);
        let msg = format!(
            "{held} bytes of unsent output (with their queue entries) exceed max_outbox_bytes = {max}"
        );
        Some(Ending::limit("max_outbox_bytes", msg))
    }

    /// Checks the limits on what the connection holds, after deliveries and before a write:
    /// past `max_outbox_bytes` it closes with an error naming the limit; under
    /// [`disconnect_backlog_bytes`](PushLimits::disconnect_backlog_bytes), a subscribed
    /// connection whose socket refused part of a write and that holds more closes with a
    /// `slow_consumer` error. A subscribed connection whose socket refused nothing of its last
    /// write is written to before either is judged: a reader that keeps up is not closed for
    /// one large message or batch. `max_outbox_bytes` is judged when output came since the last
    /// check (a delivery, a reply), not when only writes moved it. Output a layer below the
    /// connection holds while its socket refuses it (a TLS connection's ciphertext) counts with
    /// the connection's own. Returns whether it closed as a slow consumer.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::Instant;
    /// # use bytes::Bytes;
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits, PushState};
    /// let limits = PushLimits::default().with_max_outbox_bytes(1000);
    /// let config = Arc::new(PushConfig::new(limits, OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// conn.deliver_lines("a", Bytes::from(format!("{{\"x\":\"{}\"}}\n", "y".repeat(2000))), now);
    /// conn.check_limits(now);
    /// assert_eq!(conn.close_reason(), Some("max_outbox_bytes"));
    /// ```
    pub fn check_limits(&mut self, now: Instant) -> bool {
        if self.state != PushState::Open {
            return false;
        }
        // Whether output came (a delivery, a reply) and whether the socket took some, since
        // the last check.
        let (grew, took) = self.outbox.take_activity();
        if took {
            self.outbox.clear_grace();
        }
        // (With the output held below the connection, TLS ciphertext its socket refuses.)
        let backlog = self.backlog() + self.held_below();
        // A healthy reader, whose socket takes every write, is never behind however much one
        // fan-out queued for it.
        let behind = self.behind_socket();
        let subscribed = self.is_subscribed();
        let limit = match self.config.limits.disconnect_backlog_bytes {
            // Under `disconnect`, a connection past both bounds at once (a burst fanned out in
            // one turn to a reader already behind) is closed as what it is, a slow consumer:
            // the smaller bound is the one the policy names.
            Some(limit) if behind && subscribed && backlog > limit => limit,
            // `max_outbox_bytes` is judged when output came since the last look (a delivery, a
            // reply), not when only writes moved it: a reader taking a message larger than the
            // limit, its socket refusing part of each write, is behind only once more comes
            // while it is. A subscriber not behind is written to first (see `over_outbox`).
            _ if !grew => return false,
            _ => {
                if let Some(ending) = self.over_outbox(behind) {
                    self.close(ending, now);
                }
                return false;
            }
        };
        let msg = format!(
            "{backlog} bytes wait for a connection whose socket is full, more than backpressure_bytes = {limit} under subscriptions.slow_consumer = \"disconnect\""
        );
        self.close(Ending::slow_consumer(msg), now);
        true
    }

    /// The next write: urgent bytes first at a message boundary (nothing of the outbox's
    /// half-written), else after what the outbox offers, at most `max_chunks` chunks appended
    /// to `out` (each a `Bytes` by reference: a shared batch is never copied). A closing
    /// connection's protocol close message goes last, once everything else is written. `None`
    /// when there is nothing to write.
    ///
    /// See [`handle_input`](Self::handle_input) for an example.
    pub fn poll_transmit(
        &mut self,
        out: &mut Vec<Bytes>,
        max_chunks: usize,
        now: Instant,
    ) -> Option<Transmit> {
        if self.state == PushState::Aborted || max_chunks == 0 {
            return None;
        }
        if self.state == PushState::Closing && self.queues_empty() {
            if let Some(ending) = self.ending.as_deref_mut() {
                // The protocol's last words, once everything before them is written.
                for words in ending.last_words.drain(..) {
                    self.urgent.push(words);
                }
            }
            if let Some(code) = self.ending.as_deref_mut().and_then(|e| e.close_code.take()) {
                let reason = self.ending.as_deref().map_or("", |e| e.detail.as_str());
                let mut buf = BytesMut::new();
                self.proto.encode_close(code, reason, &mut buf);
                self.urgent.push(buf.freeze());
            }
        }
        let start = out.len();
        // Urgent bytes go first at a message boundary of the outbox's stream, and whenever an
        // urgent message is half written (it was begun at such a boundary; the outbox wrote
        // nothing since).
        let at_boundary = !self.outbox_mid || self.urgent.is_partial();
        let mut urgent = 0;
        if at_boundary {
            urgent = self.urgent.prepare(out, max_chunks);
        }
        let room = max_chunks - (out.len() - start);
        // The outbox's bytes go to a ready protocol only (a WebSocket after its handshake), and
        // what it framed before the protocol stopped.
        let outbox = if room > 0 && (self.proto.is_ready() || self.outbox.unsent_bytes() > 0) {
            self.outbox
                .poll_transmit_max(self.proto.as_mut(), out, now, room)
        } else {
            0
        };
        if !at_boundary && outbox > 0 && outbox == self.outbox.unsent_bytes() {
            // Mid-message: urgent bytes follow only an offer that ends the outbox's stream
            // (everything it encoded ends at a message boundary). An outbox that waits for the
            // socket offers nothing, and nothing goes in the middle of its message.
            let room = max_chunks - (out.len() - start);
            urgent = self.urgent.prepare(out, room);
        }
        let transmit = Transmit {
            urgent_first: at_boundary,
            urgent,
            outbox,
        };
        if transmit.is_empty() {
            return None;
        }
        self.transmitting = true;
        Some(transmit)
    }

    /// The socket took the first `n` bytes of `transmit` (0 when it took none).
    ///
    /// See the [module docs](self) for an example.
    pub fn on_written(&mut self, transmit: Transmit, n: usize, now: Instant) {
        self.transmitting = false;
        self.counts.bytes_out += n as u64;
        let (urgent, outbox) = transmit.split(n);
        self.urgent.advance(urgent);
        if transmit.outbox > 0 {
            let was_behind = self.outbox.socket_refused();
            self.outbox.on_written(outbox, now);
            let behind = self.outbox.socket_refused();
            if behind != was_behind {
                // Where a stall is timed from (see `stall_deadline`).
                if behind {
                    self.input_mut().behind_since = Some(now);
                } else if let Some(input) = self.input.as_deref_mut().filter(|i| i.below == 0) {
                    // (Output held below, still refused, keeps the stall's timing.)
                    input.behind_since = None;
                }
            }
            // None of it taken leaves the outbox's stream where it was; else it is at a message
            // boundary for sure only once nothing of it is unsent.
            if outbox > 0 {
                self.outbox_mid = self.outbox.unsent_bytes() > 0;
            }
        }
    }

    /// A layer below the connection (TLS) wrote to the socket: it now holds `held` bytes of
    /// output the socket has not taken, `refused` if the socket refused part of the write, and
    /// the socket `took` some of it. While the socket refuses, those bytes count with the
    /// connection's own output (for the stall past `max_outbox_bytes` and for the limit), and
    /// the stall is timed from the write it began refusing at; bytes taken after a refusal are
    /// drain progress and refresh liveness, as a plaintext socket's are
    /// ([`on_written`](Self::on_written)).
    pub(crate) fn on_below_written(
        &mut self,
        held: usize,
        refused: bool,
        took: bool,
        now: Instant,
    ) {
        let was = self.held_below();
        if took && was > 0 {
            self.outbox.on_drain_progress(now);
        }
        if refused {
            let own = self.outbox.socket_refused();
            let input = self.input_mut();
            if was == 0 && !own {
                input.behind_since = Some(now);
            }
            input.below = held.max(1);
        } else if was > 0 {
            let own = self.outbox.socket_refused();
            if let Some(input) = self.input.as_deref_mut() {
                input.below = 0;
                if !own {
                    input.behind_since = None;
                }
            }
        }
    }

    /// Output held below the connection while its socket refuses it (see
    /// [`on_below_written`](Self::on_below_written)).
    fn held_below(&self) -> usize {
        self.input.as_deref().map_or(0, |i| i.below)
    }

    /// Whether the socket refused part of the last write: the outbox's, or the layer's below.
    fn behind_socket(&self) -> bool {
        self.outbox.socket_refused() || self.held_below() > 0
    }

    /// The output `max_outbox_bytes` bounds: the connection's own and what is held below it.
    fn held_output(&self) -> usize {
        self.output_memory() + self.held_below()
    }

    /// The socket drained after a partial write (see
    /// [`Outbox::on_writable`](crate::outbox::Outbox::on_writable)).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::Instant;
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// # let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// conn.shutdown(now);
    /// let mut out = Vec::new();
    /// let t = conn.poll_transmit(&mut out, 16, now).unwrap();
    /// conn.on_written(t, 3, now); // a partial write: paused
    /// assert!(conn.outbox().wants_writable());
    /// conn.on_writable(now);
    /// assert!(!conn.outbox().wants_writable());
    /// ```
    pub fn on_writable(&mut self, now: Instant) {
        self.outbox.on_writable(now);
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next due: the first-message and idle
    /// deadlines, keepalive and liveness (a token's expiry is checked by the wall clock at
    /// every `handle_timeout`).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::{Duration, Instant};
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// # let conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// // Nothing arrived yet: the first-message deadline comes first.
    /// assert_eq!(conn.poll_timeout(), Some(now + Duration::from_secs(5)));
    /// ```
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.state != PushState::Open {
            return None;
        }
        let limits = &self.config.limits;
        let first = (!self.greeted)
            .then(|| self.started + Duration::from_millis(limits.first_message_timeout_ms));
        let idle = self
            .idle_deadline()
            .map(|ms| self.started + Duration::from_millis(ms));
        // Held input is handled again once the peer has read nothing for
        // `input_hold_timeout_ms`.
        let input = self.hold_start().map(|since| self.hold_deadline(since));
        [
            first,
            idle,
            input,
            self.stall_deadline(),
            self.outbox.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs the timers due at `now` (`wall`: the wall clock, for a token's expiry): a deadline
    /// passed closes the connection with an error naming it; keepalive queues a ping; liveness
    /// closes a connection whose peer neither answers nor reads.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::{Duration, Instant, SystemTime};
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits, PushState};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// # let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// conn.handle_timeout(now + Duration::from_secs(5), SystemTime::now());
    /// assert_eq!(conn.state(), PushState::Closing);
    /// assert_eq!(conn.close_reason(), Some("first_message_timeout_ms"));
    /// ```
    pub fn handle_timeout(&mut self, now: Instant, wall: SystemTime) {
        if self.state != PushState::Open {
            return;
        }
        let limits = &self.config.limits;
        let now_ms = self.millis(now);
        if !self.greeted && now_ms >= limits.first_message_timeout_ms {
            self.limit_errors = self.limit_errors.saturating_add(1);
            let ms = limits.first_message_timeout_ms;
            let msg = if self.session.awaiting_auth() && self.proto.is_ready() {
                format!("not authenticated within first_message_timeout_ms = {ms}")
            } else if self.proto.is_ready() {
                format!("no complete message within first_message_timeout_ms = {ms}")
            } else {
                format!(
                    "the opening handshake did not complete within first_message_timeout_ms = {ms}"
                )
            };
            self.close(Ending::timeout("first_message_timeout_ms", msg), now);
            return;
        }
        let idle = limits.idle_timeout_ms;
        if self.close_if_expired(now, wall) {
            return;
        }
        if self.idle_deadline().is_some_and(|at| now_ms >= at) {
            self.limit_errors = self.limit_errors.saturating_add(1);
            let msg = format!("no input for idle_timeout_ms = {idle}");
            self.close(Ending::timeout("idle_timeout_ms", msg), now);
            return;
        }
        if self.stall_deadline().is_some_and(|at| now >= at) {
            if self.tried_since(self.last_life()).is_none() {
                // No try could be made (a write in flight, or one the driver is about to
                // make): that write is the try, and its result within `PROBE_WAIT` decides.
                self.input_mut().probed = Some(now);
            } else if let Some(ending) = self.over_outbox(true) {
                // Past the limit and behind its socket, and a write tried since the peer's last
                // sign of life took nothing: judged without waiting for a delivery.
                self.close(ending, now);
                return;
            }
        }
        if self.outbox.poll_timeout().is_some_and(|t| t <= now) {
            // Everything encoded was written, so the stream is at a message boundary: a final
            // error can follow what the peer got.
            let at_boundary = self.outbox.unsent_bytes() == 0 && !self.transmitting;
            if self.outbox.handle_timeout(now) == TimeoutAction::Reap {
                let ms = self.outbox.config().liveness_timeout.as_millis();
                let msg = format!("no pong and no drain progress for liveness_timeout_ms = {ms}");
                let key = "liveness_timeout_ms";
                if at_boundary {
                    self.close(Ending::timeout(key, msg), now);
                } else {
                    // Half a message may be on the wire, and the peer reads nothing: there is
                    // no way to say it. Still a close the server decided (an abort writes no
                    // error, whatever the ending's kind), so its log line is at `info`.
                    self.abort(Ending::timeout(key, msg));
                }
            }
        }
    }

    /// Where the connection is in its life.
    ///
    /// See [`new`](Self::new) for an example.
    pub fn state(&self) -> PushState {
        self.state
    }

    /// Why the connection closes, once that is decided: the limit's config key, or a word
    /// (`peer_closed`, `shutdown`, `hub_closed`, an error code, ...).
    ///
    /// See [`handle_timeout`](Self::handle_timeout) for an example.
    pub fn close_reason(&self) -> Option<&str> {
        self.ending.as_deref().map(|e| e.reason)
    }

    /// The ending, for the close's log line.
    pub(crate) fn ending(&self) -> Option<&Ending> {
        self.ending.as_deref()
    }

    /// Whether everything queued is written (urgent bytes, the outbox, a pending close
    /// message): a closing connection's socket can be closed.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::Instant;
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// # let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// assert!(conn.is_written());
    /// conn.shutdown(now);
    /// assert!(!conn.is_written());
    /// ```
    pub fn is_written(&self) -> bool {
        self.queues_empty()
            && self
                .ending
                .as_deref()
                .is_none_or(|e| e.close_code.is_none() && e.last_words.is_empty())
    }

    /// Whether the urgent lane and the outbox hold nothing to write.
    fn queues_empty(&self) -> bool {
        self.urgent.is_empty() && !self.outbox.has_transmit() && self.outbox.unsent_bytes() == 0
    }

    /// The connection's subscriptions, ended: the driver removes them from its fan-out once
    /// the connection closes (no more deliveries reach it).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::Instant;
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, Instant::now()).unwrap();
    /// assert!(conn.take_subscriptions().is_empty());
    /// ```
    pub fn take_subscriptions(&mut self) -> Vec<(Arc<str>, SubscriptionInfo)> {
        self.session.close()
    }

    /// The push session (subscriptions, identity).
    ///
    /// See [`unsubscribe_done`](Self::unsubscribe_done) for an example.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The outbox (its counters, whether it waits for the socket).
    ///
    /// See [`on_writable`](Self::on_writable) for an example.
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    /// The outbox's counters.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::Instant;
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, Instant::now()).unwrap();
    /// assert_eq!(conn.stats().bytes_written, 0);
    /// ```
    pub fn stats(&self) -> OutboxStats {
        self.outbox.stats()
    }

    /// The stream protocol.
    pub(crate) fn proto(&self) -> &dyn StreamProtocol {
        self.proto.as_ref()
    }

    /// What the connection did (bytes and messages in, deliveries).
    ///
    /// See [`counts`](PushCounts) fields; e.g. `conn.counts().bytes_in` after
    /// [`handle_input`](Self::handle_input).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use std::time::Instant;
    /// # use powerhub::outbox::{OutboxConfig, PayloadFactory};
    /// # use powerhub::plugin::ProtocolFactory;
    /// # use powerhub::protocol::{Session, SessionConfig};
    /// # use powerhub::push::{PushConfig, PushConnection, PushLimits};
    /// # let config = Arc::new(PushConfig::new(PushLimits::default(), OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap());
    /// # let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    /// # let now = Instant::now();
    /// # let mut conn = PushConnection::new(proto, Session::new(1, SessionConfig::default()), &config, now).unwrap();
    /// conn.handle_input(b"{\"type\":\"ping\"}\n", now);
    /// assert_eq!(conn.counts().bytes_in, 16);
    /// ```
    pub fn counts(&self) -> PushCounts {
        self.counts
    }

    /// Limit and protocol errors since the last call (the driver adds them to its counters).
    pub(crate) fn take_errors(&mut self) -> (u32, u32) {
        (
            u32::from(std::mem::take(&mut self.limit_errors)),
            u32::from(std::mem::take(&mut self.protocol_errors)),
        )
    }

    /// Output memory a close discarded since the last call.
    pub(crate) fn take_freed(&mut self) -> usize {
        std::mem::take(&mut self.freed) as usize
    }

    /// Bytes the connection holds for the peer: the outbox's unsent and queued bytes and the
    /// urgent lane's.
    ///
    /// See the [module docs](self) for an example.
    pub fn backlog(&self) -> usize {
        let stats = self.outbox.stats();
        stats.unsent_bytes + stats.queued_bytes + self.urgent.unsent()
    }

    /// The memory the connection's unsent output holds (what `max_outbox_bytes` bounds): the
    /// backlog's bytes plus the outbox's queue entries.
    pub(crate) fn output_memory(&self) -> usize {
        self.outbox.memory_bytes() + self.urgent.unsent()
    }

    /// Memory held for input: the partial message's buffer.
    pub(crate) fn input_memory(&self) -> usize {
        self.input.as_deref().map_or(0, |i| i.buf.capacity())
    }

    /// Frees what an idle connection keeps for its next write or read (queue capacities,
    /// framing scratch, an empty input buffer, the event list).
    pub(crate) fn shrink_idle(&mut self) {
        self.outbox.shrink_idle();
        if self.input.as_deref().is_some_and(|i| {
            i.buf.is_empty()
                && i.output.events.is_empty()
                && i.error.is_none()
                && i.pending.is_none()
                && i.last_words.is_empty()
                && i.behind_since.is_none()
                && i.below == 0
        }) {
            self.input = None;
        }
    }

    /// When the connection started (its accept).
    pub(crate) fn started(&self) -> Instant {
        self.started
    }

    /// When input last arrived (or was last handled: see [`touch_input`](Self::touch_input)).
    pub(crate) fn last_input(&self) -> Instant {
        self.started + Duration::from_millis(self.last_inbound_ms)
    }

    /// Input was handled at `now`: a large input can take longer to handle than a shutdown's
    /// quiet period, and it is quiet from when it was handled.
    pub(crate) fn touch_input(&mut self, now: Instant) {
        self.last_inbound_ms = self.millis(now);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Instant, SystemTime};

    use proptest::prelude::*;

    use super::*;
    use crate::outbox::{OutboxConfig, PayloadFactory};
    use crate::plugin::ProtocolFactory;
    use crate::protocol::{Session, SessionConfig};

    const HANDSHAKE: &[u8] = b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n\
        Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
        Sec-WebSocket-Version: 13\r\n\r\n";

    #[test]
    fn limits_of_zero_that_would_close_every_connection_are_refused_naming_the_field() {
        type Zeroed = fn(PushLimits) -> PushLimits;
        let cases: [(&str, Zeroed); 4] = [
            ("max_outbox_bytes", |l| l.with_max_outbox_bytes(0)),
            ("first_message_timeout_ms", |l| {
                l.with_first_message_timeout_ms(0)
            }),
            ("input_hold_timeout_ms", |l| l.with_input_hold_timeout_ms(0)),
            ("stall_timeout_ms", |l| l.with_stall_timeout_ms(0)),
        ];
        for (field, zero) in cases {
            let limits = zero(PushLimits::default());
            assert_eq!(limits.validate(), Err(PushLimitsError::Zero { field }));
            let err = PushConfig::new(limits, OutboxConfig::default(), Arc::new(PayloadFactory))
                .unwrap_err();
            assert_eq!(
                err,
                PushConfigError::Limits(PushLimitsError::Zero { field })
            );
            assert!(err.to_string().contains(field), "{err}");
        }
        // 0 means "none" for the idle timeout, and one byte is a (tiny) limit.
        let limits = PushLimits::default()
            .with_idle_timeout_ms(0)
            .with_max_outbox_bytes(1);
        assert_eq!(limits.validate(), Ok(()));
        let outbox = OutboxConfig {
            high_water_bytes: 0,
            ..OutboxConfig::default()
        };
        let err = PushConfig::new(PushLimits::default(), outbox, Arc::new(PayloadFactory));
        assert!(matches!(
            err,
            Err(PushConfigError::Outbox(OutboxConfigError::ZeroHighWater))
        ));
    }

    /// A push configuration of the default limits and outbox.
    fn default_config() -> Arc<PushConfig> {
        let config = PushConfig::new(
            PushLimits::default(),
            OutboxConfig::default(),
            Arc::new(PayloadFactory),
        );
        Arc::new(config.unwrap())
    }

    #[test]
    fn a_connection_is_closed_with_certificate_expired_once_its_certificates_not_after_passed() {
        let config = default_config();
        let now = Instant::now();
        let not_after = UNIX_EPOCH + Duration::from_secs(1_900_000_000);
        let connection = || {
            let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
            let session = Session::new(1, SessionConfig::default());
            let mut conn = PushConnection::new(proto, session, &config, now).unwrap();
            let verified_at = not_after - Duration::from_secs(10);
            conn.certificate_verified(None, Some(not_after), now, verified_at);
            conn
        };
        let said = |conn: &mut PushConnection| {
            let mut out = Vec::new();
            conn.poll_transmit(&mut out, 16, now);
            String::from_utf8(out.concat()).unwrap()
        };

        // Valid through its last second; the driver is asked to look from the next one.
        let mut conn = connection();
        assert_eq!(conn.expires_at(), Some(not_after + Duration::from_secs(1)));
        conn.handle_timeout(now, not_after + Duration::from_millis(999));
        assert_eq!(conn.state(), PushState::Open);
        conn.handle_timeout(now, not_after + Duration::from_secs(1));
        assert_eq!(conn.close_reason(), Some(codes::CERTIFICATE_EXPIRED));
        let out = said(&mut conn);
        assert!(out.contains(r#""code":"certificate_expired""#), "{out}");
        assert!(out.contains("1900000000"), "{out}");

        // A command arriving after it is not handled: the close comes first.
        let mut conn = connection();
        conn.handle_input(b"{\"type\":\"ping\",\"id\":7}\n", now);
        assert_eq!(conn.poll(now, not_after + Duration::from_secs(2)), None);
        assert_eq!(conn.close_reason(), Some(codes::CERTIFICATE_EXPIRED));
        let out = said(&mut conn);
        assert!(!out.contains("pong"), "{out}");

        // Expired when the handshake completes (a resumed session is not verified again): closed
        // at once, before a listed subject authenticates the connection.
        let auth: crate::security::auth::AuthConfig =
            toml::from_str("[[certificates]]\nsubject = \"CN=alice\"\n").unwrap();
        let authenticator =
            Arc::new(crate::security::auth::Authenticator::from_config(&auth).unwrap());
        let listed = || {
            let policy = crate::protocol::AuthPolicy::new(Arc::clone(&authenticator));
            let session = Session::new(1, SessionConfig::default()).with_auth(policy);
            let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
            PushConnection::new(proto, session, &config, now).unwrap()
        };
        let mut conn = listed();
        let subject = PeerSubject {
            distinguished_name: "CN=alice".into(),
            common_name: Some("alice".into()),
        };
        let late = not_after + Duration::from_secs(5);
        conn.certificate_verified(Some(&subject), Some(not_after), now, late);
        assert_eq!(conn.close_reason(), Some(codes::CERTIFICATE_EXPIRED));
        let out = said(&mut conn);
        assert!(!out.contains("authenticated"), "{out}");
        // The same subject, valid: authenticated.
        let mut conn = listed();
        let early = not_after - Duration::from_secs(5);
        conn.certificate_verified(Some(&subject), Some(not_after), now, early);
        assert_eq!(conn.close_reason(), None);
        assert!(said(&mut conn).contains(r#""user":"alice""#));
    }

    /// The client's bytes for `lines`: as they are, or each a masked WebSocket text frame
    /// behind the handshake.
    fn client_bytes(lines: &[String], websocket: bool) -> Vec<u8> {
        if !websocket {
            return lines.concat().into_bytes();
        }
        let key = [0x5a, 0x13, 0xc7, 0x01];
        let mut out = HANDSHAKE.to_vec();
        for line in lines {
            let line = line.trim_end().as_bytes();
            out.push(0x81);
            if line.len() < 126 {
                out.push(0x80 | line.len() as u8);
            } else {
                out.push(0x80 | 126);
                out.extend_from_slice(&(line.len() as u16).to_be_bytes());
            }
            out.extend_from_slice(&key);
            out.extend(line.iter().zip(key.iter().cycle()).map(|(b, k)| b ^ k));
        }
        out
    }

    /// The messages the connection publishes when `bytes` arrive in pieces cut at `cuts`, a
    /// piece given as copied bytes or (where `owned` says) as a taken receive buffer.
    fn published(bytes: &[u8], cuts: &[usize], owned: &[bool], websocket: bool) -> Vec<Vec<u8>> {
        let config = default_config();
        let now = Instant::now();
        let proto = if websocket {
            powerhub_websocket::WebSocketFactory::new(Default::default())
                .unwrap()
                .new_connection(&Default::default())
        } else {
            powerhub_ndjson::NdjsonFactory.new_connection(&Default::default())
        };
        let session = Session::new(1, SessionConfig::default());
        let mut conn = PushConnection::new(proto, session, &config, now).unwrap();
        let mut cuts: Vec<usize> = cuts.iter().map(|&c| c % (bytes.len() + 1)).collect();
        cuts.extend([0, bytes.len()]);
        cuts.sort_unstable();
        let mut out = Vec::new();
        for (i, piece) in cuts.windows(2).enumerate() {
            let piece = &bytes[piece[0]..piece[1]];
            if owned[i % owned.len()] {
                conn.receive_owned(BytesMut::from(piece));
            } else {
                conn.receive(piece);
            }
            conn.decode_input(now, false);
            while let Some(request) = conn.poll(now, SystemTime::now()) {
                if let Request::Publish { message } = request {
                    out.push(message.bytes().to_vec());
                    conn.publish_done(Ok(0), now);
                }
            }
        }
        assert_eq!(
            conn.state(),
            PushState::Open,
            "the input was read without error"
        );
        out
    }

    proptest! {
        /// A receive taken whole (decoded where it lies, behind a partial message) reads the
        /// same messages as copied bytes do, wherever the input is cut, on both protocols.
        #[test]
        fn a_receive_taken_whole_reads_what_copied_bytes_read_wherever_it_is_cut(
            sizes in prop::collection::vec(0usize..400, 1..30),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
            owned in prop::collection::vec(any::<bool>(), 1..6),
            websocket in any::<bool>(),
        ) {
            let messages: Vec<String> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| format!(r#"{{"type":"t","stream":"s","i":{i},"p":"{}"}}"#, "x".repeat(n)))
                .collect();
            let lines: Vec<String> = messages
                .iter()
                .map(|m| format!("{{\"type\":\"publish\",\"message\":{m}}}\n"))
                .collect();
            let bytes = client_bytes(&lines, websocket);
            let got = published(&bytes, &cuts, &owned, websocket);
            let want: Vec<Vec<u8>> = messages.into_iter().map(String::into_bytes).collect();
            prop_assert_eq!(got, want);
        }
    }

    /// Output held below the connection (a TLS layer's ciphertext) while its socket refuses it
    /// counts with the connection's own: past `max_outbox_bytes` the stall rule judges it as it
    /// judges a plaintext backlog (`stall_timeout_ms` after the refusal or the peer's last sign
    /// of life, a write tried, then the close naming the limit). Bytes the socket takes after a
    /// refusal are drain progress, which moves the stall's deadline; once the socket takes
    /// everything, nothing is held below and no stall is timed.
    #[test]
    fn output_held_below_the_connection_is_judged_by_the_stall_rule() {
        use std::time::Duration;
        let limits = PushLimits::default()
            .with_max_outbox_bytes(1 << 20)
            .with_stall_timeout_ms(1_000);
        let config = Arc::new(
            PushConfig::new(limits, OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap(),
        );
        let open = |now| {
            let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
            let session = Session::new(1, SessionConfig::default());
            let mut conn = PushConnection::new(proto, session, &config, now).unwrap();
            conn.handle_input(b"{\"type\":\"subscribe\",\"stream\":\"s\"}\n", now);
            let Some(Request::Subscribe { .. }) = conn.poll(now, SystemTime::now()) else {
                panic!("a subscribe");
            };
            conn.subscribe_done(Ok(()), now);
            conn
        };
        let t0 = Instant::now();
        let second = Duration::from_secs(1);
        let mut conn = open(t0);
        // The next timer without a stall (a deadline or the keepalive), seconds away.
        let quiet = conn.poll_timeout();
        assert!(quiet >= Some(t0 + 5 * second), "{quiet:?}");
        // 2 MiB of ciphertext the socket refused at 3 s: a stall is timed from the refusal
        // (not from the connection's last sign of life, at 0), and the first refused write is
        // no sign of life.
        let refused = t0 + 3 * second;
        conn.on_below_written(2 << 20, true, true, refused);
        assert_eq!(conn.outbox().last_alive(), t0);
        assert_eq!(conn.poll_timeout(), Some(refused + second));
        assert!(!conn.probe_writable(refused + second / 2), "not due yet");
        // The socket takes some after the refusal: drain progress, which refreshes liveness
        // and moves the deadline.
        let t1 = refused + second * 4 / 5;
        conn.on_below_written((2 << 20) - 1000, true, true, t1);
        assert_eq!(conn.outbox().last_alive(), t1);
        assert_eq!(conn.poll_timeout(), Some(t1 + second));
        // At the deadline a write is asked for; it takes nothing within PROBE_WAIT: closed.
        let t2 = t1 + second;
        assert!(conn.probe_writable(t2), "a write tried at the deadline");
        conn.handle_timeout(t2, SystemTime::now());
        assert_eq!(conn.state(), PushState::Open);
        assert_eq!(conn.poll_timeout(), Some(t2 + PROBE_WAIT));
        conn.handle_timeout(t2 + PROBE_WAIT, SystemTime::now());
        assert_eq!(conn.state(), PushState::Closing);
        assert_eq!(conn.close_reason(), Some("max_outbox_bytes"));
        // Under the limit, or once the socket took everything, no stall is timed.
        let mut under = open(t0);
        under.on_below_written(1000, true, true, t0);
        assert_eq!(under.poll_timeout(), quiet);
        let mut drained = open(t0);
        drained.on_below_written(2 << 20, true, true, t0);
        drained.on_below_written(0, false, true, t1);
        assert_eq!(drained.poll_timeout(), quiet);
        drained.handle_timeout(t2 + PROBE_WAIT, SystemTime::now());
        assert_eq!(drained.state(), PushState::Open);
    }
}
