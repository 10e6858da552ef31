//! The per-connection outbound queue of the push-stream back-pressure spec (sans-IO).
//!
//! One [`Outbox`] per push connection. It owns no socket, no thread and reads no clock: every
//! input that depends on time takes an `Instant`, and the runtime pulls what to write with
//! [`Outbox::poll_transmit`] and reports how much the socket took with [`Outbox::on_written`].
//!
//! # States
//!
//! - **Healthy**: every message pushed is written at the next [`poll_transmit`](Outbox::poll_transmit),
//!   in its original JSON form, in push order. A shared chunk of NDJSON lines is written as it is
//!   (with [`Framing::Ndjson`]: the same `Bytes`, no parse, no copy).
//! - **Paused**: a write the socket did not fully take (`on_written(n)` with `n` below what was
//!   offered) pauses the connection. The untaken bytes stay *unsent* ([`Outbox::unsent_bytes`],
//!   the spec's `socket.writableLength`); nothing else is written until the socket is writable
//!   again ([`Outbox::on_writable`], the drain event) and the unsent bytes are fully taken. While
//!   paused, messages wait in a FIFO where the coalescing and dropping rules apply. A push that
//!   takes a healthy outbox's backlog (unsent plus queued bytes) past
//!   [`OutboxConfig::high_water_bytes`] pauses it too, as a socket's `write()` past its
//!   high-water mark returns false: messages pushed faster than any socket takes them (a burst
//!   of large frames fanned out in one turn) are under the rules before they are encoded. A
//!   transmit encodes at most [`ENCODE_AHEAD`] bytes ahead of the socket (plus one message, or
//!   [`ENCODE_SLACK`] of a shared batch), so a partial write leaves the rest under the rules
//!   too.
//!
//! # Rules while paused
//!
//! - Types in [`OutboxConfig::coalesce_types`] (`screenshot_update`, `hierarchy_update`) keep only
//!   the latest message per slot (subscription, `deviceId`, `deviceSessionUuid`, type); a
//!   replacement takes its slot's original FIFO position. Absent, `null` and string session UUIDs
//!   are three slots (epochs); a new epoch's slot is appended, so it queues after the previous
//!   epoch's pending frames and whatever was pushed in between.
//! - Every other message (and any message carrying `id` or `requestId`) is lossless FIFO.
//! - While more than [`OutboxConfig::high_water_bytes`] are unsent, an uncorrelated message of a
//!   [`OutboxConfig::drop_types`] type (`screenshot_update`) is not queued: it is counted as
//!   dropped and, at most once per (subscription, `deviceId`, `deviceSessionUuid`), replaced by the
//!   spec's `frames_dropped` notification appended to the FIFO. The "once" is reset whenever a
//!   drain attempt or a push observes the unsent bytes at or below the threshold. The same check
//!   applies when the FIFO is written out, message by message (a shared chunk pushed while
//!   healthy is written as it is, unread: it is only split and checked if a pause comes first).
//!
//! Classifying a message reads five top-level fields (`type`, `deviceId`, `deviceSessionUuid`,
//! `id`, `requestId`) with a `memchr` scan that skips the rest (a 2 MiB image is one string);
//! messages with escapes in those fields, odd types or duplicate keys go through serde_json, and
//! what cannot be read is lossless.
//! - [`Outbox::unsubscribe`] removes the subscription's pending coalescible frames and its
//!   notification state, and queues the acknowledgement after everything already queued.
//!
//! # Liveness
//!
//! A keepalive ping is queued every [`OutboxConfig::keepalive_interval`], whatever the state and
//! whether or not the connection has subscriptions. Liveness is refreshed only by
//! [`Outbox::on_pong`] or by drain progress (bytes taken by the socket while the connection is
//! paused), never by a write a healthy socket took; past [`OutboxConfig::liveness_timeout`]
//! without either, [`Outbox::handle_timeout`] returns [`TimeoutAction::Reap`].
//!
//! # Memory bound
//!
//! While paused: the unsent bytes (never more than one turn's writes), at most one pending frame
//! per coalescing slot, and lossless messages, which the liveness timeout bounds in time.
//!
//! # Examples
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Instant;
//! use bytes::{Bytes, BytesMut};
//! use powerhub::outbox::{Framing, Outbox, OutboxConfig, PayloadFactory};
//! use powerhub::plugin::{ProtocolError, ProtocolOutput, StreamProtocol};
//!
//! // A minimal NDJSON framer.
//! #[derive(Debug)]
//! struct Lines;
//! impl StreamProtocol for Lines {
//!     fn decode(&mut self, _: &mut BytesMut, _: &mut ProtocolOutput) -> Result<(), ProtocolError> { Ok(()) }
//!     fn encode_text(&mut self, json: &[u8], out: &mut BytesMut) { out.extend_from_slice(json); out.extend_from_slice(b"\n"); }
//!     fn name(&self) -> &str { "ndjson" }
//! }
//!
//! let t0 = Instant::now();
//! let config = OutboxConfig { framing: Framing::Ndjson, ..OutboxConfig::default() };
//! let mut outbox = Outbox::new(config, Arc::new(PayloadFactory), t0).unwrap();
//! let chunk = Bytes::from_static(b"{\"type\":\"telemetry\",\"n\":1}\n");
//! outbox.push_shared("s-1", chunk.clone(), t0);
//!
//! let mut out = Vec::new();
//! let offered = outbox.poll_transmit(&mut Lines, &mut out, t0);
//! assert_eq!(offered, chunk.len());
//! assert_eq!(out[0].as_ptr(), chunk.as_ptr()); // the shared chunk itself: no copy
//! outbox.on_written(offered, t0);              // the socket took everything
//! assert_eq!(outbox.unsent_bytes(), 0);
//! ```

mod blocks;
mod config;
mod event;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use powerhub_plugin::StreamProtocol;

use blocks::Blocks;
pub use config::{Framing, OutboxConfig, OutboxConfigError};
pub(crate) use event::write_json_str;
pub use event::{
    frames_dropped_json, Field, MessageFactory, MessageMeta, PayloadFactory, PushEvent,
};

/// The push protocol's JSON keepalive ping, sent when the stream protocol has no ping of its own.
pub const PING_JSON: &[u8] = br#"{"type":"ping"}"#;

/// How many encoded bytes a healthy outbox keeps ahead of the socket: a transmit encodes queued
/// messages until this many bytes are unsent (at least one message). So when the socket takes
/// only part of a write, at most this much (plus one message, or plus [`ENCODE_SLACK`] of a
/// shared batch) beyond what it took is out of the reach of the coalescing and dropping rules.
pub const ENCODE_AHEAD: usize = 64 << 10;

/// How far past [`ENCODE_AHEAD`] a shared batch (the hub's NDJSON lines) may go whole. Cutting
/// batches at the budget costs connections that are behind about twice the writes (fan-out at
/// N = 100, 1 KiB: 5.3 M deliveries/s against 6.6–7.0 M whole); a batch longer than this past
/// the budget (64 screenshots of 256 KiB: 16 MiB) is cut after the line that reaches it.
pub const ENCODE_SLACK: usize = ENCODE_AHEAD;

/// Messages shorter than this are copied into one contiguous buffer with their framing; longer
/// ones are written as their own `Bytes` (no copy).
const COPY_BELOW: usize = 512;

static NEWLINE: &[u8] = b"\n";

/// Most subscription ids an outbox remembers (a cache: past it, ids are allocated per push).
const MAX_NAMES: usize = 64;

/// What [`Outbox::handle_timeout`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TimeoutAction {
    /// Nothing is due.
    Nothing,
    /// A keepalive ping was queued: call [`Outbox::poll_transmit`].
    SendPing,
    /// The liveness timeout passed without a pong or drain progress: close the connection.
    /// The outbox writes nothing more.
    Reap,
}

/// Counters of one outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Frames replaced in their slot by a newer one while paused (never serialized).
    pub coalesced: u64,
    /// Frames dropped because too many bytes were unsent (with or without a notification).
    pub frames_dropped: u64,
    /// `frames_dropped` notifications queued.
    pub notifications: u64,
    /// Pending frames removed by an unsubscribe.
    pub removed: u64,
    /// Keepalive pings queued.
    pub pings: u64,
    /// Entries waiting in the FIFO, not yet encoded for the wire (a message; a shared chunk
    /// counts once, until a pause splits it: one holding no message of a coalesced or dropped
    /// type stays whole).
    pub queued: usize,
    /// Bytes of the messages waiting in the FIFO (default serialization for deferred events).
    pub queued_bytes: usize,
    /// Bytes encoded but not yet taken by the socket (the spec's `writableLength`).
    pub unsent_bytes: usize,
    /// Bytes the socket took.
    pub bytes_written: u64,
}

/// A mark of `Outbox::marks`: the socket refused part of the last write.
const REFUSED: u8 = 1;
/// Something was queued since the last [`Outbox::take_activity`].
const FRESH: u8 = 2;
/// The socket took bytes since the last [`Outbox::take_activity`].
const TOOK: u8 = 4;
/// The push connection's grace past its output limit (see [`Outbox::take_grace`]).
const GRACE: u8 = 8;

/// The per-connection outbound queue: see the [module documentation](self).
#[derive(Debug)]
pub struct Outbox {
    config: Arc<OutboxConfig>,
    factory: Arc<dyn MessageFactory>,
    /// Messages not yet encoded, in order. `queue[i]` has sequence number `head_seq + i`.
    queue: Blocks<Item>,
    head_seq: u64,
    /// The first items of the queue that were admitted under the paused rules (what was queued
    /// when the connection last became healthy); those after them were queued as they came.
    /// 32 bits, as `ruled_kinds`: a connection's state stays within 512 bytes.
    admitted: u32,
    /// Queued messages of a coalesced or dropped type (uncorrelated): while there are none, a
    /// pause admits only what was queued since the last one (see [`Outbox::pause`]).
    ruled_kinds: u32,
    /// Coalescing slots and `frames_dropped` keys: allocated only while one of them is held
    /// (paused, or over the threshold), so a healthy outbox holds no hash table.
    drops: Option<Box<DropState>>,
    /// Encoded bytes not yet taken by the socket, in order; the front may be partly written.
    wire: VecDeque<Bytes>,
    wire_len: usize,
    /// Bytes offered by the last `poll_transmit` (a prefix of `wire`), saturated at `u32::MAX`:
    /// a socket takes less than 2 GiB per write, so a larger offer reads as partly taken either
    /// way (32 bits keep a connection's state within 512 bytes).
    offered: u32,
    /// Scratch buffer small messages are framed into.
    scratch: BytesMut,
    /// Subscription ids seen, so a push does not allocate its id (a connection has few).
    names: Vec<Arc<str>>,
    paused: bool,
    /// Paused and waiting for `on_writable` before offering the unsent bytes again.
    awaiting_writable: bool,
    /// `REFUSED`, `FRESH`, `TOOK` and `GRACE`, one byte (a connection's state stays within an
    /// allocator size class).
    marks: u8,
    reaped: bool,
    last_alive: Instant,
    next_ping: Instant,
    stats: OutboxStats,
}

/// The state of the rules that apply while paused.
#[derive(Debug, Default)]
struct DropState {
    /// Coalescing slot -> sequence number of its pending frame (only while paused).
    slots: HashMap<SlotKey, u64>,
    /// (subscription, deviceId, deviceSessionUuid) that already got a `frames_dropped`.
    notified: HashSet<DropKey>,
}

#[derive(Debug)]
enum Item {
    /// A lossless control message (JSON, no newline).
    Control(Bytes),
    /// Lossless bytes already in the connection's wire form (a hub frame on a frame-protocol
    /// connection): written as they are.
    Wire(Bytes),
    /// A keepalive ping.
    Ping,
    /// A message for a subscription, classified.
    Message {
        sub: Arc<str>,
        meta: MessageMeta,
        body: Body,
    },
    /// An unclassified chunk of NDJSON lines (only while healthy). `batch` is the length of
    /// the shared batch the lines were cut from (more than theirs once a write took its
    /// start): what any slice of them keeps in memory.
    Shared {
        sub: Arc<str>,
        lines: Bytes,
        batch: usize,
    },
    /// A frame removed by coalescing or unsubscribe (keeps sequence numbers stable).
    Removed,
}

#[derive(Debug)]
enum Body {
    /// Serialized through the factory when written.
    Event(PushEvent),
    /// One JSON message from a shared chunk (no newline).
    Json(Bytes),
}

impl Body {
    fn len(&self) -> usize {
        match self {
            Body::Event(e) => e.payload().len(),
            Body::Json(b) => b.len(),
        }
    }
}

impl Item {
    fn len(&self) -> usize {
        match self {
            Item::Control(b) | Item::Wire(b) => b.len(),
            Item::Ping => PING_JSON.len(),
            Item::Message { body, .. } => body.len(),
            Item::Shared { lines, .. } => lines.len(),
            Item::Removed => 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SlotKey {
    sub: Arc<str>,
    device: Field,
    session: Field,
    kind: Arc<str>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct DropKey {
    sub: Arc<str>,
    device: Field,
    session: Field,
}

impl Outbox {
    /// A healthy, empty outbox; keepalive and liveness timers start at `now`.
    ///
    /// Pass the same `Arc<OutboxConfig>` to every connection to share it. The config is validated;
    /// the error names the wrong field.
    pub fn new(
        config: impl Into<Arc<OutboxConfig>>,
        factory: Arc<dyn MessageFactory>,
        now: Instant,
    ) -> Result<Self, OutboxConfigError> {
        let config = config.into();
        config.validate()?;
        Ok(Outbox {
            next_ping: now + config.keepalive_interval,
            config,
            factory,
            queue: Blocks::new(),
            head_seq: 0,
            admitted: 0,
            ruled_kinds: 0,
            drops: None,
            wire: VecDeque::new(),
            wire_len: 0,
            offered: 0,
            scratch: BytesMut::new(),
            names: Vec::new(),
            paused: false,
            awaiting_writable: false,
            marks: 0,
            reaped: false,
            last_alive: now,
            stats: OutboxStats::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &OutboxConfig {
        &self.config
    }

    /// Queues a message for subscription `sub`, serialized through the [`MessageFactory`] only
    /// when it is written.
    pub fn push_event(&mut self, sub: &str, event: PushEvent, now: Instant) {
        let _ = now;
        if self.reaped {
            return;
        }
        self.observe_send();
        let meta = event.meta().clone();
        let item = Item::Message {
            sub: self.intern(sub),
            meta,
            body: Body::Event(event),
        };
        if self.paused {
            self.admit_paused(item);
        } else {
            self.enqueue(item);
        }
    }

    /// Queues a shared chunk of one or more complete JSON messages, each ending in `\n` (the hub's
    /// NDJSON batch frame), for subscription `sub`.
    ///
    /// Healthy: written as it is at the next transmit (with [`Framing::Ndjson`], the same `Bytes`).
    /// Paused: split into messages and classified so that the coalescing rules apply, unless
    /// none of its messages can be of a coalesced or dropped type (then it is queued whole, as
    /// lossless FIFO would queue its messages).
    /// With a [`MessageFactory`] that is not the identity, each message of the chunk becomes a
    /// [`PushEvent`] serialized through the factory when written.
    pub fn push_shared(&mut self, sub: &str, lines: Bytes, now: Instant) {
        if self.reaped || lines.is_empty() {
            return;
        }
        if !self.factory.is_identity() {
            for line in split_lines(&lines) {
                self.push_event(sub, PushEvent::from_json(line), now);
            }
            return;
        }
        self.observe_send();
        let item = Item::Shared {
            sub: self.intern(sub),
            batch: lines.len(),
            lines,
        };
        if self.paused {
            self.admit_paused(item);
        } else {
            self.enqueue(item);
        }
    }

    /// Queues a control message (a reply, an error, a pong): lossless FIFO. `json` is one JSON
    /// message without trailing newline.
    pub fn push_control(&mut self, json: Bytes, now: Instant) {
        let _ = now;
        if self.reaped {
            return;
        }
        self.observe_send();
        self.enqueue(Item::Control(json));
    }

    /// Queues bytes already framed for the wire (lossless FIFO, like a control message), written
    /// as they are: the same `Bytes`, never copied. For a shared frame whose encoding is the
    /// connection's wire form (the hub's binary frame on a frame-protocol connection).
    pub fn push_wire(&mut self, bytes: Bytes, now: Instant) {
        let _ = now;
        if self.reaped || bytes.is_empty() {
            return;
        }
        self.observe_send();
        self.enqueue(Item::Wire(bytes));
    }

    /// Removes the pending coalescible frames and the notification state of subscription `sub`,
    /// then queues its acknowledgement `ack` (lossless, after everything already queued).
    ///
    /// Lossless messages of `sub` already queued stay queued and keep their order.
    pub fn unsubscribe(&mut self, sub: &str, ack: Bytes, now: Instant) {
        let _ = now;
        if self.reaped {
            return;
        }
        let mut removed = Vec::new();
        if let Some(drops) = self.drops.as_deref_mut() {
            drops.slots.retain(|key, seq| {
                if &*key.sub == sub {
                    removed.push(*seq);
                    false
                } else {
                    true
                }
            });
            drops.notified.retain(|key| &*key.sub != sub);
        }
        self.trim_drops();
        for seq in removed {
            if let Some(item) = self.item_mut(seq) {
                let old = std::mem::replace(item, Item::Removed);
                self.ruled_kinds -= u32::from(is_ruled(&self.config, &old));
                self.stats.queued_bytes -= old.len();
                self.stats.queued -= 1;
                self.stats.removed += 1;
            }
        }
        self.names.retain(|name| &**name != sub);
        self.push_control(ack, now);
    }

    /// Appends what to write next to `out` and returns its length in bytes; 0 when there is
    /// nothing to write (or the connection waits for [`on_writable`](Self::on_writable)).
    ///
    /// `out` always starts at the first unsent byte: after a partial write it starts mid-message.
    /// Report what the socket took with [`on_written`](Self::on_written); calling
    /// `poll_transmit` again without doing so offers the same bytes again (plus what was queued
    /// since). `framer` frames messages (and keepalive pings) for the wire; `now` is passed to
    /// the [`MessageFactory`].
    pub fn poll_transmit(
        &mut self,
        framer: &mut dyn StreamProtocol,
        out: &mut Vec<Bytes>,
        now: Instant,
    ) -> usize {
        self.poll_transmit_max(framer, out, now, usize::MAX)
    }

    /// [`poll_transmit`](Self::poll_transmit), offering at most `max_segments` `Bytes` (say, what
    /// is left of the runtime's `IOV_MAX` gather list). When the socket takes all of a limited
    /// offer, the connection is not paused and the next call offers the rest.
    pub fn poll_transmit_max(
        &mut self,
        framer: &mut dyn StreamProtocol,
        out: &mut Vec<Bytes>,
        now: Instant,
        max_segments: usize,
    ) -> usize {
        if self.reaped || self.awaiting_writable || max_segments == 0 {
            self.offered = 0;
            return 0;
        }
        if self.paused && self.wire_len == 0 {
            // Paused by the backlog (not by the socket) and everything unsent is taken: what
            // waits under the rules is written now.
            self.resume();
        }
        if !self.paused {
            self.encode_queue(framer, now);
        }
        let mut offered = 0;
        for segment in self.wire.iter().take(max_segments) {
            offered += segment.len();
            out.push(segment.clone());
        }
        self.offered = u32::try_from(offered).unwrap_or(u32::MAX);
        offered
    }

    /// Reports that the socket took the first `n` bytes of what the last
    /// [`poll_transmit`](Self::poll_transmit) offered. Less than offered pauses the connection
    /// until [`on_writable`](Self::on_writable); bytes taken while paused are drain progress and
    /// refresh liveness. The connection is healthy again once every unsent byte is taken.
    pub fn on_written(&mut self, n: usize, now: Instant) {
        let offered = self.offered as usize;
        let n = n.min(offered);
        let partial = n < offered;
        self.mark(REFUSED, partial);
        if n > 0 {
            self.mark(TOOK, true);
        }
        self.offered = 0;
        let mut left = n;
        while let Some(front) = self.wire.front_mut() {
            if left == 0 {
                break;
            }
            if front.len() <= left {
                left -= front.len();
                self.wire.pop_front();
            } else {
                let _ = front.split_to(left);
                left = 0;
            }
        }
        self.wire_len -= n;
        self.stats.bytes_written += n as u64;
        self.stats.unsent_bytes = self.wire_len;
        if self.paused && n > 0 {
            self.last_alive = now;
        }
        // A write observes the unsent bytes: at or below the threshold re-arms notifications.
        if self.wire_len <= self.config.high_water_bytes {
            self.clear_notified();
        }
        if self.wire_len == 0 {
            // Healthy again: what was admitted while paused stays queued (and its slots stay
            // known to `unsubscribe`) until the next transmit writes it. (A connection that was
            // healthy stays so: what it queued meanwhile was admitted by nothing.)
            if self.paused {
                self.resume();
            }
        } else if partial {
            self.awaiting_writable = true;
            if !self.paused {
                self.pause();
            }
        }
        if self.wire.is_empty() && self.scratch.capacity() > 64 << 10 {
            self.scratch = BytesMut::new();
        }
    }

    /// The socket is writable again (the drain event): the unsent bytes are offered at the next
    /// [`poll_transmit`](Self::poll_transmit).
    pub fn on_writable(&mut self, now: Instant) {
        let _ = now;
        self.awaiting_writable = false;
        if self.wire_len <= self.config.high_water_bytes {
            self.clear_notified();
        }
    }

    /// An inbound pong (the push protocol's `pong`, or a transport pong): refreshes liveness.
    pub fn on_pong(&mut self, now: Instant) {
        self.last_alive = now;
    }

    /// A layer below the connection (TLS) saw its socket take bytes after refusing some: drain
    /// progress, which refreshes liveness as [`on_written`](Self::on_written)'s does.
    pub(crate) fn on_drain_progress(&mut self, now: Instant) {
        self.last_alive = now;
    }

    /// When the peer last showed it is alive: its last pong, or the last write the socket took
    /// part of (drain progress).
    pub(crate) fn last_alive(&self) -> Instant {
        self.last_alive
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called; `None` once reaped.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.reaped {
            return None;
        }
        Some(
            self.next_ping
                .min(self.last_alive + self.config.liveness_timeout),
        )
    }

    /// Runs the timers due at `now`: reaps the connection past the liveness timeout, else queues
    /// a keepalive ping when one is due.
    pub fn handle_timeout(&mut self, now: Instant) -> TimeoutAction {
        if self.reaped {
            return TimeoutAction::Nothing;
        }
        if now >= self.last_alive + self.config.liveness_timeout {
            self.reaped = true;
            self.queue.clear();
            self.clear_slots();
            self.wire.clear();
            self.wire_len = 0;
            self.offered = 0;
            self.clear_notified();
            self.ruled_kinds = 0;
            self.resume();
            self.awaiting_writable = false;
            self.stats.queued = 0;
            self.stats.queued_bytes = 0;
            self.stats.unsent_bytes = 0;
            return TimeoutAction::Reap;
        }
        if now >= self.next_ping {
            self.next_ping = now + self.config.keepalive_interval;
            self.stats.pings += 1;
            self.enqueue(Item::Ping);
            return TimeoutAction::SendPing;
        }
        TimeoutAction::Nothing
    }

    /// Bytes encoded for the wire and not yet taken by the socket (the spec's
    /// `socket.writableLength`).
    pub fn unsent_bytes(&self) -> usize {
        self.wire_len
    }

    /// Pauses a healthy outbox whose backlog (unsent plus queued bytes) is over `bytes`, as a
    /// push past [`OutboxConfig::high_water_bytes`] does. An owner that closes the connection
    /// past a memory limit calls it after its pushes with a fraction of that limit, so that the
    /// coalescing rules take over before the limit does: a stream of one slot's frames pushed
    /// faster than the socket takes them keeps one frame, however low the limit.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Instant;
    /// use bytes::Bytes;
    /// use powerhub::outbox::{Outbox, OutboxConfig, PayloadFactory};
    ///
    /// let now = Instant::now();
    /// let mut outbox = Outbox::new(OutboxConfig::default(), Arc::new(PayloadFactory), now).unwrap();
    /// let frame = |n: u32| Bytes::from(format!(
    ///     "{{\"type\":\"screenshot_update\",\"stream\":\"s\",\"deviceId\":\"d\",\"n\":{n},\"p\":\"{}\"}}\n",
    ///     "x".repeat(600),
    /// ));
    /// outbox.push_shared("sub-1", frame(1), now);
    /// outbox.pause_past(1024);
    /// assert!(!outbox.is_paused());
    /// outbox.push_shared("sub-1", frame(2), now);
    /// outbox.pause_past(1024);
    /// assert!(outbox.is_paused(), "past 1024 bytes of backlog, far under the high-water mark");
    /// ```
    pub fn pause_past(&mut self, bytes: usize) {
        if !self.paused && self.wire_len + self.stats.queued_bytes > bytes {
            self.pause();
        }
    }

    /// Whether the paused rules apply: a partial write paused the connection, or its backlog
    /// passed [`OutboxConfig::high_water_bytes`] (or the mark of
    /// [`pause_past`](Self::pause_past)), and the socket has not taken every unsent byte since.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// Whether something was queued, and whether the socket took some bytes, since the last
    /// call (the first call: since the outbox was made).
    pub fn take_activity(&mut self) -> (bool, bool) {
        let marks = self.marks;
        self.marks &= !(FRESH | TOOK);
        (marks & FRESH != 0, marks & TOOK != 0)
    }

    /// Sets the grace mark, kept here for the push connection (which lets a subscriber past its
    /// output limit once per progress): whether it was set already.
    pub(crate) fn take_grace(&mut self) -> bool {
        let was = self.marks & GRACE != 0;
        self.mark(GRACE, true);
        was
    }

    /// Clears the grace mark (see [`take_grace`](Self::take_grace)).
    pub(crate) fn clear_grace(&mut self) {
        self.mark(GRACE, false);
    }

    fn mark(&mut self, mark: u8, on: bool) {
        if on {
            self.marks |= mark;
        } else {
            self.marks &= !mark;
        }
    }

    /// Whether the socket refused part of the last write: the peer is behind, until a write
    /// is taken whole. Unlike [`wants_writable`](Self::wants_writable) this stays set from
    /// the readiness event to the next write's result.
    pub fn socket_refused(&self) -> bool {
        self.marks & REFUSED != 0 && !self.reaped
    }

    /// Whether the outbox waits for [`on_writable`](Self::on_writable) (register write interest).
    pub fn wants_writable(&self) -> bool {
        self.awaiting_writable && !self.reaped
    }

    /// Whether [`poll_transmit`](Self::poll_transmit) would offer bytes now.
    pub fn has_transmit(&self) -> bool {
        !self.reaped && !self.awaiting_writable && (self.wire_len > 0 || !self.queue.is_empty())
    }

    /// Frees the memory the outbox keeps for reuse while it holds nothing: the FIFO's and the
    /// wire's capacity and the framing scratch buffer. Call it on a connection that has been
    /// idle for a while (a busy one would only allocate them again); what is queued is
    /// unaffected, and the next push allocates what it needs.
    pub fn shrink_idle(&mut self) {
        if self.queue.is_empty() && self.queue.capacity() > 0 {
            self.queue = Blocks::new();
        }
        if self.wire.is_empty() && self.wire.capacity() > 0 {
            self.wire = VecDeque::new();
        }
        if self.scratch.is_empty() && self.scratch.capacity() > 0 {
            self.scratch = BytesMut::new();
        }
    }

    /// Drops every message not yet encoded for the wire, for a connection that closes over a
    /// limit: its final error then follows only what was already encoded (at most one offer of
    /// the socket's write), and nothing follows the error. Returns how many were dropped.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Instant;
    /// use powerhub::outbox::{Outbox, OutboxConfig, PayloadFactory};
    ///
    /// let now = Instant::now();
    /// let mut outbox = Outbox::new(OutboxConfig::default(), Arc::new(PayloadFactory), now).unwrap();
    /// outbox.push_control(r#"{"type":"pong"}"#.into(), now);
    /// assert_eq!(outbox.discard_queued(), 1);
    /// assert_eq!(outbox.stats().queued, 0);
    /// ```
    pub fn discard_queued(&mut self) -> usize {
        let dropped = self
            .queue
            .iter()
            .filter(|i| !matches!(i, Item::Removed))
            .count();
        self.head_seq += self.queue.len() as u64;
        self.queue = Blocks::new();
        self.ruled_kinds = 0;
        self.admitted = 0;
        self.drops = None;
        self.stats.queued = 0;
        self.stats.queued_bytes = 0;
        dropped
    }

    /// The memory the outbox holds for unsent output, in bytes: the messages and encoded bytes
    /// waiting, plus the queues' bookkeeping (a queue entry per message, whatever its size). A
    /// client that sends many small commands and never reads holds far more than the replies'
    /// bytes: this is what a memory limit on a connection must count.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Instant;
    /// use powerhub::outbox::{Outbox, OutboxConfig, PayloadFactory};
    ///
    /// let now = Instant::now();
    /// let mut outbox = Outbox::new(OutboxConfig::default(), Arc::new(PayloadFactory), now).unwrap();
    /// for _ in 0..1000 {
    ///     outbox.push_control(r#"{"type":"pong"}"#.into(), now);
    /// }
    /// assert_eq!(outbox.stats().queued_bytes, 15_000);
    /// assert!(outbox.memory_bytes() > 2 * 15_000);
    /// ```
    pub fn memory_bytes(&self) -> usize {
        self.stats.queued_bytes
            + self.wire_len
            + self.queue.capacity() * std::mem::size_of::<Item>()
            + self.wire.capacity() * std::mem::size_of::<Bytes>()
            + self.scratch.capacity()
    }

    /// [`memory_bytes`](Self::memory_bytes) with the queues' entries counted as they are used,
    /// not as allocated: what writes take back down (a queue keeps its capacity once drained).
    pub(crate) fn live_bytes(&self) -> usize {
        self.stats.queued_bytes
            + self.wire_len
            + self.queue.len() * std::mem::size_of::<Item>()
            + self.wire.len() * std::mem::size_of::<Bytes>()
    }

    /// Whether the liveness timeout reaped the connection.
    pub fn is_reaped(&self) -> bool {
        self.reaped
    }

    /// The counters.
    pub fn stats(&self) -> OutboxStats {
        self.stats
    }

    // ---- internals ------------------------------------------------------------------------

    /// The shared id `sub`, allocated once per subscription.
    fn intern(&mut self, sub: &str) -> Arc<str> {
        if let Some(name) = self.names.iter().find(|name| &***name == sub) {
            return Arc::clone(name);
        }
        let name: Arc<str> = Arc::from(sub);
        if self.names.len() < MAX_NAMES {
            self.names.push(Arc::clone(&name));
        }
        name
    }

    /// Forgets the coalescing slots (what they point to stays queued).
    fn clear_slots(&mut self) {
        if let Some(drops) = self.drops.as_deref_mut() {
            drops.slots.clear();
            self.trim_drops();
        }
    }

    /// Re-arms every `frames_dropped` notification.
    fn clear_notified(&mut self) {
        if let Some(drops) = self.drops.as_deref_mut() {
            drops.notified.clear();
            self.trim_drops();
        }
    }

    /// Frees the drop state once it holds nothing.
    fn trim_drops(&mut self) {
        if self
            .drops
            .as_deref()
            .is_some_and(|d| d.slots.is_empty() && d.notified.is_empty())
        {
            self.drops = None;
        }
    }

    fn item_mut(&mut self, seq: u64) -> Option<&mut Item> {
        let idx = seq.checked_sub(self.head_seq)?;
        self.queue.get_mut(usize::try_from(idx).ok()?)
    }

    fn push_back(&mut self, item: Item) -> u64 {
        self.ruled_kinds += u32::from(is_ruled(&self.config, &item));
        self.stats.queued += 1;
        self.stats.queued_bytes += item.len();
        self.queue.push_back(item);
        self.head_seq + self.queue.len() as u64 - 1
    }

    /// Queues `item` in order. A healthy outbox whose backlog (unsent plus queued bytes) passes
    /// the high-water mark pauses, as a socket's `write()` returning false would: what is
    /// queued is then under the rules (a stream of large frames of one slot keeps one, however
    /// fast it is pushed), until the socket has taken every unsent byte.
    fn enqueue(&mut self, item: Item) {
        self.push_back(item);
        self.pause_past(self.config.high_water_bytes);
    }

    /// A push observes the unsent bytes: at or below the threshold re-arms notifications. It
    /// is also output that came (see [`take_activity`](Self::take_activity)).
    fn observe_send(&mut self) {
        self.mark(FRESH, true);
        if self.drops.is_some() && self.wire_len <= self.config.high_water_bytes {
            self.clear_notified();
        }
    }

    fn over_threshold(&self) -> bool {
        self.wire_len > self.config.high_water_bytes
    }

    /// The connection becomes paused: what was queued since it was last healthy is admitted
    /// under the paused rules (classified, coalesced).
    ///
    /// What was admitted before stays as it is when the queue holds no message of a coalesced
    /// or dropped type: admitted again, lossless messages would stay where they are. So a
    /// reader that keeps flipping between healthy and paused behind a deep backlog costs what
    /// came since its last flip, not its whole backlog each time. Otherwise the whole queue is
    /// admitted again, in order (its slots are found again, and a screenshot waiting over the
    /// threshold is dropped for its notification).
    fn pause(&mut self) {
        self.paused = true;
        self.clear_slots();
        if self.ruled_kinds == 0 {
            let since = self.queue.len() - (self.admitted as usize).min(self.queue.len());
            let mut came = Vec::with_capacity(since);
            for _ in 0..since {
                let item = self.queue.pop_back().expect("within the queue");
                self.took(&item);
                came.push(item);
            }
            for item in came.into_iter().rev() {
                self.admit_paused(item);
            }
            return;
        }
        let queued = std::mem::take(&mut self.queue);
        self.head_seq += queued.len() as u64;
        self.ruled_kinds = 0;
        self.stats.queued = 0;
        self.stats.queued_bytes = 0;
        for item in queued {
            self.admit_paused(item);
        }
    }

    /// The connection is healthy again: everything queued now was admitted under the rules.
    fn resume(&mut self) {
        self.paused = false;
        self.admitted = u32::try_from(self.queue.len()).unwrap_or(u32::MAX);
    }

    /// Counts out an item taken off the queue.
    fn took(&mut self, item: &Item) {
        if !matches!(item, Item::Removed) {
            self.stats.queued -= 1;
            self.stats.queued_bytes -= item.len();
        }
        self.ruled_kinds -= u32::from(is_ruled(&self.config, item));
    }

    fn admit_paused(&mut self, item: Item) {
        match item {
            // A chunk none of whose messages the rules treat apart from lossless FIFO stays
            // whole: queued as its messages one by one would be, with no classification.
            Item::Shared { sub, lines, batch } if self.config.all_lossless(&lines) => {
                self.push_back(Item::Shared { sub, lines, batch });
            }
            Item::Shared { sub, lines, batch } => {
                let first = self.head_seq + self.queue.len() as u64;
                let mut replaced = Vec::new();
                for line in split_lines(&lines) {
                    let meta = MessageMeta::classify(&line);
                    let kept = self.admit_message(Arc::clone(&sub), meta, Body::Json(line));
                    replaced.extend(kept.filter(|&seq| seq < first));
                }
                self.unpin(&lines, batch, first, &replaced);
            }
            Item::Message { sub, meta, body } => {
                self.admit_message(sub, meta, body);
            }
            Item::Removed => {}
            other => {
                self.push_back(other);
            }
        }
    }

    /// Admits one message under the paused rules; the sequence number of the item that holds
    /// it now (appended, or a slot's frame replaced in place), `None` when it was dropped.
    fn admit_message(&mut self, sub: Arc<str>, meta: MessageMeta, body: Body) -> Option<u64> {
        if !meta.correlated && self.config.is_droppable(&meta.kind) {
            if self.over_threshold() {
                self.drop_frame(&sub, &meta, false);
                return None;
            }
            self.clear_notified();
        }
        if meta.correlated || !self.config.is_coalescible(&meta.kind) {
            return Some(self.push_back(Item::Message { sub, meta, body }));
        }
        let key = SlotKey {
            sub: Arc::clone(&sub),
            device: meta.device_id.clone(),
            session: meta.device_session_uuid.clone(),
            kind: Arc::clone(&meta.kind),
        };
        if let Some(&seq) = self.drops.as_ref().and_then(|d| d.slots.get(&key)) {
            let new_len = body.len();
            if let Some(Item::Message { body: old, .. }) = self.item_mut(seq) {
                let old_len = old.len();
                *old = body;
                self.stats.queued_bytes = self.stats.queued_bytes - old_len + new_len;
                self.stats.coalesced += 1;
                return Some(seq);
            }
        }
        let seq = self.push_back(Item::Message { sub, meta, body });
        self.drops.get_or_insert_default().slots.insert(key, seq);
        Some(seq)
    }

    /// After the messages of shared chunk `chunk` (cut from a batch of `batch` bytes, all of
    /// which a slice of it keeps in memory) were admitted one by one (appended from
    /// `first` on, or put in place of the slots' frames at `replaced`): the messages kept
    /// are slices of the chunk, and any one of them holds all of it in memory, the bytes of
    /// the messages the rules removed (a coalesced screenshot, a dropped one) included, which
    /// the outbox does not count. So a kept message is copied out when the batch would hold
    /// more than twice as much for it: a coalesced frame (replaced later, one by one) alone
    /// against the batch, the lossless messages (kept until written) together. What a
    /// connection holds then stays within twice what it counts, however many frames its
    /// slots replace behind a lossless backlog; a chunk mostly kept is not copied.
    fn unpin(&mut self, chunk: &Bytes, batch: usize, first: u64, replaced: &[u64]) {
        let start = chunk.as_ptr() as usize;
        let within = |b: &Bytes| (start..start + chunk.len()).contains(&(b.as_ptr() as usize));
        let config = Arc::clone(&self.config);
        let coalesced = |meta: &MessageMeta| !meta.correlated && config.is_coalescible(&meta.kind);
        let end = self.head_seq + self.queue.len() as u64;
        let kept = || replaced.iter().copied().chain(first..end);
        let mut lossless = 0;
        for seq in kept() {
            if let Some(Item::Message {
                meta,
                body: Body::Json(b),
                ..
            }) = self.item_mut(seq)
            {
                if within(b) && !coalesced(meta) {
                    lossless += b.len();
                }
            }
        }
        let copy_lossless = 2 * lossless < batch;
        for seq in kept() {
            if let Some(Item::Message {
                meta,
                body: Body::Json(b),
                ..
            }) = self.item_mut(seq)
            {
                let copy = if coalesced(meta) {
                    2 * b.len() < batch
                } else {
                    copy_lossless
                };
                if copy && within(b) {
                    *b = Bytes::copy_from_slice(b);
                }
            }
        }
    }

    /// Counts a dropped frame and queues its notification if its key has none outstanding. With
    /// `in_place`, the notification takes the dropped frame's place in the wire order instead of being
    /// appended to the FIFO.
    fn drop_frame(&mut self, sub: &Arc<str>, meta: &MessageMeta, in_place: bool) -> Option<Bytes> {
        self.stats.frames_dropped += 1;
        let key = DropKey {
            sub: Arc::clone(sub),
            device: meta.device_id.clone(),
            session: meta.device_session_uuid.clone(),
        };
        if !self.drops.get_or_insert_default().notified.insert(key) {
            return None;
        }
        self.stats.notifications += 1;
        let json = frames_dropped_json(sub, &meta.device_id, &meta.device_session_uuid, &meta.kind);
        if in_place {
            return Some(json);
        }
        self.push_back(Item::Control(json));
        None
    }

    /// Encodes the whole FIFO onto the wire (healthy only).
    fn encode_queue(&mut self, framer: &mut dyn StreamProtocol, now: Instant) {
        self.clear_slots();
        // A write commits a bounded amount: past `ENCODE_AHEAD` unsent bytes, what is queued
        // stays queued, where a pause (a partial write) still applies the rules to it.
        while self.wire_len < ENCODE_AHEAD {
            let Some(item) = self.queue.pop_front() else {
                break;
            };
            self.head_seq += 1;
            self.took(&item);
            let was_admitted = self.admitted > 0;
            self.admitted = self.admitted.saturating_sub(1);
            match item {
                Item::Control(json) => self.encode_json(framer, json),
                Item::Wire(bytes) => self.append_bytes(bytes),
                Item::Ping => {
                    let before = self.scratch.len();
                    if framer.encode_ping(&mut self.scratch) {
                        self.wire_len += self.scratch.len() - before;
                    } else {
                        self.encode_json(framer, Bytes::from_static(PING_JSON));
                    }
                }
                Item::Message { sub, meta, body } => {
                    if !meta.correlated && self.config.is_droppable(&meta.kind) {
                        if self.over_threshold() {
                            if let Some(json) = self.drop_frame(&sub, &meta, true) {
                                self.encode_json(framer, json);
                            }
                            continue;
                        }
                        self.clear_notified();
                    }
                    let json = match body {
                        Body::Json(json) => json,
                        Body::Event(event) => self.factory.create_push_message(&sub, &event, now),
                    };
                    self.encode_json(framer, json);
                }
                Item::Shared { sub, lines, batch } => {
                    // A shared chunk holds a whole batch: only its lines up to the budget (and
                    // the one that crosses it) go now; the rest stays first in the queue, where
                    // a pause applies the rules to it.
                    let lines = match split_at_budget(lines, ENCODE_AHEAD - self.wire_len) {
                        (now_lines, Some(rest)) => {
                            let rest = Item::Shared {
                                sub,
                                lines: rest,
                                batch,
                            };
                            self.push_front(rest);
                            // The rest is what the chunk was: admitted, or queued as it came.
                            self.admitted += u32::from(was_admitted);
                            now_lines
                        }
                        (lines, None) => lines,
                    };
                    self.encode_shared(framer, lines);
                }
                Item::Removed => {}
            }
        }
        self.flush_scratch();
        self.stats.unsent_bytes = self.wire_len;
    }

    /// Puts `item` back first in the queue (under the sequence number it had there).
    fn push_front(&mut self, item: Item) {
        self.ruled_kinds += u32::from(is_ruled(&self.config, &item));
        self.head_seq -= 1;
        self.stats.queued += 1;
        self.stats.queued_bytes += item.len();
        self.queue.push_front(item);
    }

    /// Encodes a shared chunk's lines onto the wire.
    fn encode_shared(&mut self, framer: &mut dyn StreamProtocol, lines: Bytes) {
        match self.config.framing {
            Framing::Ndjson => {
                let terminated = lines.last() == Some(&b'\n');
                self.append_bytes(lines);
                if !terminated {
                    self.scratch.extend_from_slice(NEWLINE);
                    self.wire_len += 1;
                }
            }
            Framing::Protocol => {
                for line in split_lines(&lines) {
                    let before = self.scratch.len();
                    framer.encode_text(&line, &mut self.scratch);
                    self.wire_len += self.scratch.len() - before;
                }
            }
        }
    }

    /// Frames one JSON message (no newline) onto the wire.
    fn encode_json(&mut self, framer: &mut dyn StreamProtocol, json: Bytes) {
        match self.config.framing {
            Framing::Ndjson if json.len() >= COPY_BELOW => {
                self.append_bytes(json);
                self.scratch.extend_from_slice(NEWLINE);
                self.wire_len += 1;
            }
            Framing::Ndjson => {
                self.scratch.extend_from_slice(&json);
                self.scratch.extend_from_slice(NEWLINE);
                self.wire_len += json.len() + 1;
            }
            Framing::Protocol => {
                let before = self.scratch.len();
                framer.encode_text(&json, &mut self.scratch);
                self.wire_len += self.scratch.len() - before;
            }
        }
    }

    /// Appends a `Bytes` to the wire as its own segment (after what the scratch holds).
    fn append_bytes(&mut self, bytes: Bytes) {
        if bytes.is_empty() {
            return;
        }
        self.flush_scratch();
        self.wire_len += bytes.len();
        self.wire.push_back(bytes);
    }

    /// Moves the scratch buffer's bytes onto the wire as one segment (their length is already in
    /// `wire_len`).
    fn flush_scratch(&mut self) {
        if !self.scratch.is_empty() {
            if self.wire.capacity() == 0 {
                // As for the queue: one slot first, doubling from there.
                self.wire.reserve_exact(1);
            }
            self.wire.push_back(self.scratch.split().freeze());
        }
    }
}

/// The lines of an NDJSON chunk as zero-copy slices, each with its newline (a last line
/// without one is kept as it is).
pub(crate) fn whole_lines(lines: &Bytes) -> impl Iterator<Item = Bytes> + '_ {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= lines.len() {
            return None;
        }
        let end = memchr_newline(&lines[start..]).map_or(lines.len(), |i| start + i + 1);
        let line = lines.slice(start..end);
        start = end;
        Some(line)
    })
}

/// The JSON messages of an NDJSON chunk, without their newlines (zero-copy slices); empty lines
/// are skipped, a last line without newline is kept.
fn split_lines(lines: &Bytes) -> impl Iterator<Item = Bytes> + '_ {
    whole_lines(lines).filter_map(|line| {
        let text = match line.last() {
            Some(&b'\n') => line.slice(..line.len() - 1),
            _ => line,
        };
        let trimmed = trim_cr(&text);
        (!trimmed.is_empty()).then_some(trimmed)
    })
}

fn trim_cr(line: &Bytes) -> Bytes {
    if line.last() == Some(&b'\r') {
        line.slice(..line.len() - 1)
    } else {
        line.clone()
    }
}

/// Whether the paused rules treat `item` apart from lossless FIFO: a message of a coalesced or
/// dropped type, uncorrelated.
fn is_ruled(config: &OutboxConfig, item: &Item) -> bool {
    matches!(item, Item::Message { meta, .. }
        if !meta.correlated
            && (config.is_coalescible(&meta.kind) || config.is_droppable(&meta.kind)))
}

/// `lines` (whole lines, each ending in `\n`) cut after the line that reaches `budget` bytes,
/// unless all of them fit in `budget` plus [`ENCODE_SLACK`]: the lines to write now (at least
/// one) and the rest, if any.
fn split_at_budget(lines: Bytes, budget: usize) -> (Bytes, Option<Bytes>) {
    if lines.len() <= budget + ENCODE_SLACK {
        return (lines, None);
    }
    let from = budget.saturating_sub(1);
    match memchr_newline(&lines[from..]).map(|i| from + i + 1) {
        Some(cut) if cut < lines.len() => (lines.slice(..cut), Some(lines.slice(cut..))),
        _ => (lines, None),
    }
}

fn memchr_newline(haystack: &[u8]) -> Option<usize> {
    memchr::memchr(b'\n', haystack)
}
