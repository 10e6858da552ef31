//! Counters, the per-subscriber list, presence.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// A snapshot of the hub's counters and subscribers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Live subscribers.
    pub subscribers: usize,
    /// Topics with subscribers, a retained log or a [`Publisher`](crate::hub::Publisher) handle.
    pub topics: usize,
    /// Publications (a retained replay is not one).
    pub published: u64,
    /// Messages offered to transports (sent in a batch, whatever the send's outcome), and
    /// messages receivers received. A drop-oldest [`Receiver`](crate::hub::Receiver) reads its
    /// topic's log itself: each message counts at its receive, and waits in that receiver's
    /// `queued` until then. A drop-newest, disconnect or priority receiver is handed its
    /// messages as a transport is, a batch (at most `max_batch`) at a time: a batch counts when
    /// it is handed over, and leaves `queued` then, before its consumer receives it.
    pub delivered: u64,
    /// Messages lost: evicted or refused by a policy, discarded on disconnect, or in a batch
    /// that could not be encoded. A counter to alert on: it never goes back.
    pub dropped: u64,
    /// Subscribers closed by the `disconnect` policy.
    pub disconnected: u64,
    /// Bytes of frames taken by the transports of the live subscribers: always the sum of
    /// `list[i].bytes_sent`, as the spec states. Unlike the counters above it is not
    /// monotonic: it goes down when a subscriber leaves (to 0 once none is left).
    pub bytes_out: u64,
    /// Frames encoded (one per distinct (batch, codec) per turn, whatever the subscriber count;
    /// in a server, one per (topic batch, wire format) however many shards send it).
    pub encoded: u64,
    /// Every live subscriber, in drain order.
    pub list: Vec<SubscriberStats>,
}

/// One subscriber's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubscriberStats {
    /// The subscriber's id.
    pub id: String,
    /// Its topic.
    pub topic: String,
    /// Messages waiting in its queue. A drop-newest, disconnect or priority receiver may also
    /// hold one batch handed over to it and not yet received (see [`Stats::delivered`]), which
    /// this does not count.
    pub queued: usize,
    /// Messages it lost.
    pub dropped: u64,
    /// Bytes of frames its transport took.
    pub bytes_sent: u64,
    /// Whether a send is outstanding.
    pub in_flight: bool,
    /// The drain priority it was given.
    pub priority: i32,
}

/// One live subscriber, as [`Hub::presence`](super::Hub::presence) reports it. An owned copy:
/// changing it does not affect the hub.
#[derive(Clone)]
#[non_exhaustive]
pub struct Presence {
    /// The subscriber's id.
    pub id: String,
    /// Its topic.
    pub topic: String,
    /// The transport context given at subscribe time.
    pub transport: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for Presence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Presence")
            .field("id", &self.id)
            .field("topic", &self.topic)
            .field("transport", &self.transport.is_some())
            .finish()
    }
}

/// What one turn did, handed to the `metrics` hook, plus the hub's running totals.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TurnMetrics {
    /// Frames handed to transports in this turn.
    pub frames: u64,
    /// Messages in those frames.
    pub messages: u64,
    /// Frames encoded in this turn (the rest were shared).
    pub encoded: u64,
    /// Messages dropped because their batch could not be encoded, in this turn.
    pub encode_dropped: u64,
    /// Sends that failed or panicked in this turn.
    pub send_failures: u64,
    /// Running total of publications.
    pub published_total: u64,
    /// Running total of dropped messages.
    pub dropped_total: u64,
    /// Running total of disconnected subscribers.
    pub disconnected_total: u64,
}
