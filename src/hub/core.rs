//! The hub's shared state and its drain: what `Hub` and `Subscription` delegate to.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::{Condvar, Mutex, RwLock};
use powerhub_plugin::frame;
use powerhub_plugin::{CloseReason, Completion, SendError, SendOutcome, Sink, SubscriberRef};

use super::direct::{DirectCursor, DirectLog, Slot, Tail};
use super::error::{
    panic_message, DeliveryError, FlushError, OptionsError, PublishError, SubscribeError,
};
use super::handlers::Pool;
use super::message::Delivery;
use super::options::SlowConsumer;
use super::options::{
    BytesAcknowledged, Codec, Driver, HubOptions, PublishOptions, SubscribeOptions,
    RETAINED_PER_TOPIC,
};
pub(crate) use super::queue::Entry;
use super::queue::{CursorPop, Offer, Queue, TopicLog};
use super::stats::{Presence, Stats, SubscriberStats, TurnMetrics};
use super::Message;

pub(crate) type Handler = Arc<dyn Fn(&Delivery<'_>) + Send + Sync>;

/// A batch as a receiver takes it: shared by reference with every subscriber that took the same
/// range of its topic's log this pass.
pub(crate) type SharedBatch = Arc<Vec<Arc<Entry>>>;

/// What runs for a subscriber once its transport took a batch.
pub(crate) enum Consumer {
    /// Nothing: the sink is the only consumer.
    Sink,
    /// A handler, per message.
    Each(Handler),
    /// A receiver's hand-off, once per batch; it needs no frame (nothing is encoded for it).
    Batch(Arc<dyn HandOffEnd>),
    /// A receiver that reads the topic's [`DirectLog`] itself: never drained.
    Direct(Arc<DirectCursor>),
}

/// The receiving end of a fed receiver's hand-off, as the hub sees it.
pub(crate) trait HandOffEnd: Send + Sync {
    /// Takes the batch the hub sent.
    fn hand(&self, batch: &SharedBatch);

    /// A publication reached the subscriber that no drain will hand over: queued while the hub
    /// drains only on `flush` (`batch: false`), or dropped with nothing queued (`max_queue: 0`).
    /// A consumer waiting in `recv` looks again: it takes the first itself and reports the
    /// second as a lag. Called on the publishing thread, under the topics read lock.
    fn poke(&self);
}

/// What [`Sub::feed`] (or a receiver's taking of the rest after its end) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Feed {
    /// A batch was handed over (or its send is held for the consumer): look again.
    Handed,
    /// Nothing to hand over, or nothing this thread may hand over now.
    Nothing,
    /// The drain lock is taken (a drainer or another feed): look again shortly.
    Busy,
}

/// A fan-out that is not the hub's own: a shard's interest in a topic, on behalf of the
/// subscriptions of its connections (see `runtime::fanout`).
///
/// A publication to the topic is handed to each of its taps on the publishing thread, while the
/// topics read lock is held: [`Tap::offer`] must be cheap and never block (it queues the entry
/// and, at most once per batch, wakes the tap's owner). The hub queues nothing for a tap, applies
/// no slow-consumer policy to it and encodes nothing for it: the owner does all of that on its
/// own thread.
pub(crate) trait Tap: Send + Sync {
    /// A publication to the topic, in the publisher's order (the last consumer of a
    /// publication is handed the hub's own reference).
    fn offer(&self, entry: Arc<Entry>);
    /// A run of publications to the topic, in the publisher's order, as that many
    /// [`offer`](Tap::offer)s one after another.
    fn offer_run(&self, entries: Vec<Arc<Entry>>) {
        for entry in entries {
            self.offer(entry);
        }
    }
    /// How many subscriptions the tap serves (what a publish counts as delivered to).
    fn subscribers(&self) -> usize;
    /// The tap's subscriptions, for [`Stats::list`] and [`Presence`]: their hub ids and
    /// transport contexts.
    fn members(&self, out: &mut Vec<TapMember>);
    /// The hub closed: no publication follows. The owner ends the tap's subscriptions.
    fn hub_closed(&self);
}

/// One subscription behind a [`Tap`], as stats and presence list it.
#[derive(Clone)]
pub(crate) struct TapMember {
    pub(crate) id: Arc<str>,
    pub(crate) transport: Arc<dyn std::any::Any + Send + Sync>,
    /// Bytes handed to the subscription's transport (its connection's outbox), for
    /// `bytes_sent`. Written by the tap's owner only; read by `stats()`.
    pub(crate) bytes_sent: Arc<AtomicU64>,
}

thread_local! {
    /// Whether this thread is inside a drain: [`NOT_DRAINING`], [`IN_HANDLER`] (running a
    /// handler outside the drain lock: on the pool, or on the thread that completed a held
    /// send) or [`HOLDS_DRAIN`] (holding the drain lock, and whatever it calls). A handler,
    /// sink or hook that calls `flush` or `turn` from either would wait for itself.
    static DRAINING: Cell<u8> = const { Cell::new(NOT_DRAINING) };
}

const NOT_DRAINING: u8 = 0;
const IN_HANDLER: u8 = 1;
const HOLDS_DRAIN: u8 = 2;

/// Marks the current thread as draining while alive, then restores what it was (a guard
/// entered inside a drain, as a handler job run inline, leaves the drain marked).
struct DrainingGuard(u8);

impl DrainingGuard {
    /// The drain lock is held from now until the guard drops.
    fn enter() -> DrainingGuard {
        DrainingGuard(DRAINING.with(|d| d.replace(HOLDS_DRAIN)))
    }

    /// A handler runs from now until the guard drops (inside the drain, it stays marked as
    /// holding the lock).
    fn handler() -> DrainingGuard {
        DrainingGuard(DRAINING.with(|d| d.replace(d.get().max(IN_HANDLER))))
    }
}

impl Drop for DrainingGuard {
    fn drop(&mut self) {
        let before = self.0;
        DRAINING.with(|d| d.set(before));
    }
}

/// Whether this thread is inside a drain or a handler (see [`DRAINING`]).
fn draining() -> bool {
    DRAINING.with(Cell::get) != NOT_DRAINING
}

/// Whether this thread holds the drain lock (so it cannot take it again).
fn holds_drain() -> bool {
    DRAINING.with(Cell::get) == HOLDS_DRAIN
}

/// A subscriber's send state: `generation << 3 | phase`, in one atomic word so the common
/// case (the sink accepts at once) costs no lock. Only the drain lock's holder (a drainer, or a
/// receiver's feed) starts a send (bumping the generation); a completion acts only on its own
/// generation.
mod phase {
    /// No send outstanding.
    pub(super) const IDLE: u64 = 0;
    /// Inside `Sink::send`.
    pub(super) const SENDING: u64 = 1;
    /// The completion ran inside `Sink::send` with `Ok`.
    pub(super) const EARLY_OK: u64 = 2;
    /// The completion was dropped inside `Sink::send` (normal for an accepted send).
    pub(super) const EARLY_DROPPED: u64 = 3;
    /// The completion ran inside `Sink::send` with an error, kept in `Sub::pending`.
    pub(super) const EARLY_ERR: u64 = 4;
    /// The sink returned `Pending`; the batch waits in `Sub::pending` for the completion.
    pub(super) const PENDING: u64 = 5;
    /// Finishing: accounting and handlers run, still in flight.
    pub(super) const FINISHING: u64 = 6;
    /// The phase bits.
    pub(super) const MASK: u64 = 7;
}

/// A batch taken off a queue: owned (popped from a ring), or shared by every cursor subscriber
/// that took the same range of the topic log this turn.
enum Batch {
    Owned(Vec<Arc<Entry>>),
    Shared(Arc<Vec<Arc<Entry>>>),
}

impl Default for Batch {
    fn default() -> Self {
        Batch::Owned(Vec::new())
    }
}

impl Batch {
    /// The batch by reference: the shared one as is, an owned one copied (a reference count
    /// per entry).
    fn share(&self) -> SharedBatch {
        match self {
            Batch::Owned(v) => Arc::new(v.clone()),
            Batch::Shared(v) => Arc::clone(v),
        }
    }
}

impl std::ops::Deref for Batch {
    type Target = [Arc<Entry>];
    fn deref(&self) -> &[Arc<Entry>] {
        match self {
            Batch::Owned(v) => v,
            Batch::Shared(v) => v,
        }
    }
}

/// What a pending send leaves behind for its completion.
#[derive(Default)]
struct PendingSend {
    batch: Batch,
    len: usize,
    early_error: Option<SendError>,
}

/// One subscription.
pub(crate) struct Sub {
    pub(crate) sref: SubscriberRef,
    queue: Queue,
    max_batch: usize,
    pub(crate) priority: i32,
    /// Subscription order, for drain-order ties.
    order: u64,
    codec: Codec,
    sink: Arc<dyn Sink>,
    consumer: Consumer,
    ack: Option<BytesAcknowledged>,
    pub(crate) closed: AtomicBool,
    /// The topic number of the first publication the subscription can be offered (the oldest
    /// retained one, else the topic's next), set once while subscribing: a receiver tells a
    /// loss before its first message from a publication that came before it. `Relaxed`: read
    /// after the subscribe that set it returned.
    pub(crate) start: AtomicU64,
    /// `generation << 3 | phase`; see [`phase`].
    send_state: AtomicU64,
    /// A handler of this subscriber is running outside the drain (on the handler pool, or on
    /// the thread that completed a held send: see [`Inner::handle`]). A flush waits for it
    /// even after the subscription ended (a handler may unsubscribe itself and go on to
    /// subscribe or publish): what the handler does before it returns belongs to the flush.
    handling: AtomicBool,
    /// A receiver's batch is between its queue and its hand-off: set by the drain lock's holder
    /// (a drainer, or the receiver's own feed: see `Inner::feed`) before it pops (SeqCst),
    /// cleared once the batch was handed over or held pending. While it is set, an empty queue
    /// does not mean the receiver has everything before its drops (see `HandOffRx::try_next`,
    /// which reads it after the queue's length).
    taking: AtomicBool,
    dropped: AtomicU64,
    bytes_sent: AtomicU64,
    /// Entries that left the queue (popped or evicted); `flush` uses it to know when what was
    /// queued at its start is gone.
    removed: AtomicU64,
    pending: Mutex<PendingSend>,
    /// The hub, for completions of pending sends.
    hub: Weak<Inner>,
}

impl Sub {
    /// Messages its policy (or its close) dropped so far.
    pub(crate) fn dropped_count(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Messages waiting in its queue.
    pub(crate) fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Whether the drainer holds a batch of this receiver between its queue and its hand-off.
    pub(crate) fn is_taking(&self) -> bool {
        // SeqCst: read after the queue's length (see `taking`).
        self.taking.load(Ordering::SeqCst)
    }

    /// What a fed receiver's queue still holds once its subscription ended (an unsubscribe or
    /// the hub's close keep it for the receiver; a `disconnect` discarded it), counted as
    /// delivered: see [`Inner::take_rest`]. `None` while a drainer is visiting it.
    pub(crate) fn take_rest(&self) -> Option<Vec<Arc<Entry>>> {
        match self.hub.upgrade() {
            Some(hub) => hub.take_rest(self),
            None => {
                // The hub is gone, and its drainers with it.
                let mut rest = Vec::new();
                self.queue.pop_into(usize::MAX, &mut rest);
                Some(rest)
            }
        }
    }

    /// Its receiver found nothing handed over while its queue holds messages: the next batch
    /// is handed over now, on the receiver's thread (see [`Inner::feed`]).
    pub(crate) fn feed(self: &Arc<Sub>) -> Feed {
        self.hub
            .upgrade()
            .map_or(Feed::Nothing, |hub| hub.feed(self))
    }

    /// A fed receiver's consumer looks at a publication no drain hands over (see
    /// [`HandOffEnd::poke`]); nothing for other subscribers.
    fn poke(&self) {
        if let Consumer::Batch(end) = &self.consumer {
            end.poke();
        }
    }

    /// Whether the drain feeds it to a receiver, which takes its queue at its own pace.
    fn is_fed_receiver(&self) -> bool {
        matches!(self.consumer, Consumer::Batch(_))
    }

    /// Its queue at its end (`reason`): discarded (returns how many), unless a fed receiver
    /// takes it after an unsubscribe or the hub's close, as a direct receiver receives what was
    /// published before its end (`Sub::take_rest`); a slow consumer's queue is its loss.
    fn end_queue(&self, reason: CloseReason) -> u64 {
        if self.is_fed_receiver() && reason != CloseReason::SlowConsumer {
            0
        } else {
            self.queue.clear() as u64
        }
    }

    /// Its direct receiver's counts join the hub's (see [`Inner::fold_direct`]).
    pub(crate) fn fold_direct(&self, dc: &DirectCursor) {
        if let Some(hub) = self.hub.upgrade() {
            hub.fold_direct(dc);
        }
    }

    /// Its direct receiver is gone and committed its counts: the hub forgets its cursor.
    pub(crate) fn forget_ended(&self, dc: &Arc<DirectCursor>) {
        if let Some(hub) = self.hub.upgrade() {
            hub.forget_ended(dc);
        }
    }

    fn in_flight(&self) -> bool {
        // SeqCst pairs with the flush waiter count (see `Inner::notify_flush`).
        self.send_state.load(Ordering::SeqCst) & phase::MASK != phase::IDLE
    }

    /// The completion of send `generation`.
    fn on_completion(self: &Arc<Sub>, generation: u64, result: Result<(), SendError>) {
        let sending = generation << 3 | phase::SENDING;
        let early = match &result {
            Ok(()) => phase::EARLY_OK,
            Err(SendError::CompletionDropped) => phase::EARLY_DROPPED,
            Err(e) => {
                // Stored before the CAS publishes EARLY_ERR; the mutex orders the two.
                self.pending.lock().early_error = Some(e.clone());
                phase::EARLY_ERR
            }
        };
        let cur = match self.send_state.compare_exchange(
            sending,
            generation << 3 | early,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return, // the drainer, still inside `send`, picks it up
            Err(cur) => cur,
        };
        if early == phase::EARLY_ERR {
            self.pending.lock().early_error = None;
        }
        let pending = generation << 3 | phase::PENDING;
        if cur != pending
            || self
                .send_state
                .compare_exchange(
                    pending,
                    generation << 3 | phase::FINISHING,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_err()
        {
            return; // a stale or repeated completion, or one for an accepted send
        }
        let (batch, len) = {
            let mut p = self.pending.lock();
            (std::mem::take(&mut p.batch), p.len)
        };
        let r = result.map_err(|error| DeliveryError::SendFailed {
            id: self.sref.id().to_owned(),
            error,
        });
        match self.hub.upgrade() {
            Some(inner) => {
                inner.finish(self, batch, len, generation, r, false, None);
            }
            None => self
                .send_state
                .store(generation << 3 | phase::IDLE, Ordering::SeqCst),
        }
    }
}

#[derive(Default)]
struct Topic {
    /// Subscribers with queues of their own (drop-newest, disconnect, message priority,
    /// `max_queue: 0`): a publication is offered to each.
    subs: Vec<Arc<Sub>>,
    /// FIFO drop-oldest subscribers: cursors into `log`; a publication is appended once.
    cursors: Vec<Arc<Sub>>,
    log: Arc<TopicLog>,
    retained: Mutex<VecDeque<Arc<Entry>>>,
    /// The next publication's [`Entry::topic_seq`] and the direct log's writing end; held while
    /// the publication is numbered and offered, so that every subscriber queues the topic's
    /// publications in number order. Shared with the topic's [`Publisher`](super::Publisher)s,
    /// which keep the topic listed while they live.
    order: TopicOrder,
    /// Listed in [`Ready::topics`] since a publication queued something for its subscribers;
    /// cleared by the pass that takes it (under the topics write lock).
    dirty: AtomicBool,
    /// Every subscriber of the topic in drain order (highest priority first, then subscription
    /// order): a pass over one topic takes this list by reference, without sorting or cloning
    /// it. Changed in place unless a pass holds it (`Arc::make_mut`).
    all: Arc<Vec<Arc<Sub>>>,
    /// How many cursor subscribers have each `max_queue`: the log keeps the largest.
    caps: BTreeMap<usize, usize>,
    /// Fan-outs of other owners (one per interested shard): handed every publication.
    taps: Vec<Arc<dyn Tap>>,
    /// The publications of the topic's direct receivers, while it has some.
    direct: Option<Arc<DirectLog>>,
    /// How many direct receivers have each `max_queue`: the log keeps the largest.
    direct_caps: BTreeMap<usize, usize>,
    /// Direct receivers.
    direct_count: usize,
}

/// A topic's [`Order`], shared by the topic and its publishers' handles.
pub(crate) type TopicOrder = Arc<Mutex<Order>>;

/// What a topic's publishers take one at a time (see [`Topic::order`]).
#[derive(Default)]
pub(crate) struct Order {
    next: u64,
    tail: Tail,
    route: Route,
}

/// How a publisher's handle publishes to the topic, kept current by every change to its
/// consumers (under the topics write lock, then this lock).
#[derive(Default)]
enum Route {
    /// Through [`Inner::publish`], under the topics lock: the general path.
    #[default]
    ByName,
    /// The topic's only consumers are its direct receivers: the handle appends to their log
    /// under this lock alone (what [`Inner::publish`] would do, without the topics lock).
    Direct {
        log: Arc<DirectLog>,
        receivers: usize,
    },
}

impl Topic {
    /// Whether a consumer keeps the topic's entries past the shards' fan-out (a subscriber's
    /// queue, a drop-oldest cursor on the log, direct receivers): their publications are
    /// numbered in the topic's order, and a slice of a receive is made its own.
    fn keeps_entries(&self) -> bool {
        !self.subs.is_empty() || !self.cursors.is_empty() || self.direct.is_some()
    }

    /// No consumer and no publisher's handle: the topic can go.
    fn is_empty(&self) -> bool {
        self.has_no_consumer() && Arc::strong_count(&self.order) == 1
    }

    /// No subscriber of any kind (a publisher's handle may still hold the topic).
    fn has_no_consumer(&self) -> bool {
        self.subs.is_empty()
            && self.cursors.is_empty()
            && self.taps.is_empty()
            && self.direct.is_none()
    }

    /// No consumer but direct receivers, if any: a publication that is not retained then goes
    /// inline into their log, and nowhere else.
    fn only_receivers(&self) -> bool {
        self.subs.is_empty() && self.cursors.is_empty() && self.taps.is_empty()
    }

    /// Brings the handles' route up to date with the consumers (called after every change to
    /// them, under the topics write lock).
    fn reroute(&self) {
        let route = match &self.direct {
            Some(log) if self.only_receivers() => Route::Direct {
                log: Arc::clone(log),
                receivers: self.direct_count,
            },
            _ => Route::ByName,
        };
        let mut order = self.order.lock();
        if self.direct.is_none() {
            // The ended log's writing end goes with it (it holds the log).
            order.tail = Tail::default();
        }
        order.route = route;
    }

    fn log_id(&self) -> u64 {
        self.log.id()
    }
}

/// What the next pass visits: topics published to, and single subscribers with work (a
/// retained replay, a completion that left messages queued, a flush). A pass costs what these
/// hold, not the number of subscribers the hub has.
#[derive(Default)]
struct Ready {
    topics: Vec<Arc<str>>,
    subs: Vec<Arc<Sub>>,
}

#[derive(Default)]
struct WakeState {
    deadline: Option<Instant>,
    last_now: Option<Instant>,
}

/// Key of the encode memo ([`EncodeMemo`]): a batch is identified by its codec and the sequence
/// numbers of its entries (globally unique, so the topic is implied).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct MemoKey {
    codec: Codec,
    first: u64,
    last: u64,
    len: usize,
    mix: u64,
}

impl MemoKey {
    fn of(codec: Codec, batch: &[Arc<Entry>]) -> MemoKey {
        let mut mix = 0xcbf2_9ce4_8422_2325_u64;
        for e in batch {
            mix = (mix ^ e.seq).wrapping_mul(0x0000_0100_0000_01b3);
        }
        MemoKey {
            codec,
            first: batch.first().map_or(0, |e| e.seq),
            last: batch.last().map_or(0, |e| e.seq),
            len: batch.len(),
            mix,
        }
    }
}

/// A hasher for [`MemoKey`]: the key already mixes the sequence numbers, so it is folded, not
/// re-hashed with SipHash.
#[derive(Default)]
struct MemoHasher(u64);

impl Hasher for MemoHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

type Memo = HashMap<MemoKey, (Vec<u64>, Bytes), std::hash::BuildHasherDefault<MemoHasher>>;

/// The encode memo: the frames encoded lately, kept across passes. Subscribers of one topic
/// take the same batch in different passes when some were in flight (a send pending, a handler
/// waiting on the pool): the later ones find the frame the first encoded. A batch's key is its
/// codec and sequence numbers, which no later batch has, so a kept frame is never wrong, only
/// possibly unused: the oldest go first once the memo holds more than [`MEMO_BYTES`] of frames
/// or [`MEMO_FRAMES`] frames, which bounds what an idle hub keeps. Holds frames, never messages.
#[derive(Default)]
struct EncodeMemo {
    frames: Memo,
    /// Keys in the order they were encoded, the oldest first.
    order: VecDeque<MemoKey>,
    /// The bytes of `frames`' frames.
    bytes: usize,
}

/// How long the drain thread, woken from idle, waits for publications to stop before its turn
/// (see `Inner::settle`).
const SETTLE_QUIET: Duration = Duration::from_micros(5);
/// The longest such wait, however long publications keep coming.
const SETTLE_MAX: Duration = Duration::from_micros(20);

/// The most frame bytes the encode memo keeps.
const MEMO_BYTES: usize = 1 << 20;
/// The most frames the encode memo keeps.
const MEMO_FRAMES: usize = 1024;

impl EncodeMemo {
    /// The frame encoded for exactly `batch` under `key`.
    fn get(&self, key: &MemoKey, batch: &[Arc<Entry>]) -> Option<Bytes> {
        let (seqs, frame) = self.frames.get(key)?;
        seqs.iter()
            .copied()
            .eq(batch.iter().map(|e| e.seq))
            .then(|| frame.clone())
    }

    /// Keeps `frame`, encoded for `batch`, letting the oldest go past the bounds. A frame
    /// larger than the bound is not kept past the pass that encoded it.
    fn insert(&mut self, key: MemoKey, batch: &[Arc<Entry>], frame: &Bytes) {
        let seqs = batch.iter().map(|e| e.seq).collect();
        if let Some((_, old)) = self.frames.insert(key, (seqs, frame.clone())) {
            // A key whose sequence numbers differed (a hash collision): replaced in place.
            self.bytes -= old.len();
        } else {
            self.order.push_back(key);
        }
        self.bytes += frame.len();
    }

    /// After a pass: the oldest frames go until the memo is within its bounds.
    fn trim(&mut self) {
        while self.bytes > MEMO_BYTES || self.order.len() > MEMO_FRAMES {
            let Some(key) = self.order.pop_front() else {
                break;
            };
            if let Some((_, frame)) = self.frames.remove(&key) {
                self.bytes -= frame.len();
            }
        }
    }
}

/// Per-pass memo of cursor batches: (log, first log index, length, codec) to the shared batch
/// and its frame.
type RangeMemo = HashMap<
    (u64, u64, usize, Codec),
    (SharedBatch, Option<Bytes>),
    std::hash::BuildHasherDefault<MemoHasher>,
>;

#[derive(Default)]
struct DrainState {
    /// Scratch for the list of subscribers a pass visits (see `take_ready`).
    order: Vec<Arc<Sub>>,
    /// How many entries each subscriber of `order` takes this turn.
    budgets: Vec<usize>,
    memo: EncodeMemo,
    ranges: RangeMemo,
    /// The range key of a cursor batch just cloned from the log, to memoise once encoded.
    pending_range: Option<(u64, u64, usize, Codec)>,
    batch: Vec<Arc<Entry>>,
    /// Topic logs a cursor took from this pass: (log id, index in `order` of one of its
    /// subscribers), trimmed at the end of the pass.
    touched: Vec<(u64, usize)>,
    /// Handlers to run, handed to the pool at the end of the pass.
    jobs: Vec<Job>,
}

/// A batch whose handler runs on the handler pool; its subscriber is in flight until it ran.
pub(crate) struct Job {
    sub: Arc<Sub>,
    batch: Batch,
    generation: u64,
}

#[derive(Default)]
struct Counters {
    delivered: AtomicU64,
    dropped: AtomicU64,
    disconnected: AtomicU64,
    encoded: AtomicU64,
    errors: AtomicU64,
}

/// Keeps [`Inner::stats`] from reading the drop and delivery counts while one moves from an
/// estimate to a counter: a cursor's uncommitted evictions to `dropped`, a direct receiver's
/// lag (its position moves past what it lost) to `dropped`, a receiver's own count of what it
/// received to `delivered`. Each such move is two or more writes; a snapshot taken between them
/// counted the messages twice or not at all, so a counter that never goes back went back.
///
/// Movers hold it shared (many at once; only moves take it, never a publish or a plain
/// receive), `stats()` exclusively while it reads the counts. It is taken before any cursor or
/// queue lock and never held across user code.
#[derive(Debug, Default)]
pub(crate) struct StatsGate(RwLock<()>);

impl StatsGate {
    /// Held while a count moves.
    pub(crate) fn moving(&self) -> parking_lot::RwLockReadGuard<'_, ()> {
        self.0.read()
    }

    /// Held while `stats()` reads the counts.
    fn reading(&self) -> parking_lot::RwLockWriteGuard<'_, ()> {
        self.0.write()
    }
}

/// The topics by name.
type TopicMap = HashMap<Arc<str>, Topic, foldhash::fast::RandomState>;

/// How far the first [`Inner::close`] got.
#[derive(Debug, Default)]
struct Closing {
    /// The thread that runs it.
    by: Option<std::thread::ThreadId>,
    /// It returned (or panicked): every subscriber was closed and its adapter told.
    done: bool,
}

/// Marks the first close done when dropped, so that a teardown that panics (a user's close
/// adapter is caught, but a closure's destructor is not) does not leave later closes waiting.
struct CloseDone<'a>(&'a Inner);

impl Drop for CloseDone<'_> {
    fn drop(&mut self) {
        self.0.closing.lock().done = true;
        self.0.closing_cv.notify_all();
    }
}

/// The hub's shared state.
pub(crate) struct Inner {
    /// A weak handle to this hub, captured by send completions.
    me: Weak<Inner>,
    opts: HubOptions,
    sink: Arc<dyn Sink>,
    closed: AtomicBool,
    seq: AtomicU64,
    next_sub: AtomicU64,
    /// Topic names come from clients: a fast hash, seeded per process.
    topics: RwLock<TopicMap>,
    ids: Mutex<HashMap<Arc<str>, Arc<Sub>>>,
    /// Subscribers removed while one of their handlers ran on the pool (a handler that
    /// unsubscribes itself): out of `ids`, but a flush waits for that handler to return. Taken
    /// off when it returned. Lock order: `ids` before `retiring`.
    retiring: Mutex<Vec<Arc<Sub>>>,
    /// The cursors of direct receivers whose subscription ended while the receiver lives: its
    /// losses past the bound (not received yet, so not committed) and what it received since
    /// still count in `stats()`. Pruned once only this list holds a cursor (the receiver
    /// dropped, and counted what was left).
    ended_direct: Mutex<HashMap<usize, Arc<DirectCursor>>>,
    /// Lock order: `topics` before `ready`.
    ready: Mutex<Ready>,
    counters: Counters,
    /// See [`StatsGate`].
    gate: Arc<StatsGate>,
    /// Set by publish and by completions when there is something to drain.
    work: AtomicBool,
    wake: Mutex<WakeState>,
    wake_cv: Condvar,
    drain: Mutex<DrainState>,
    flush_mx: Mutex<()>,
    flush_cv: Condvar,
    /// Flushes waiting on `flush_cv`; completions only take `flush_mx` when there are some.
    flush_waiters: AtomicUsize,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The `close` that won the race: its thread, and whether it has torn everything down. A
    /// concurrent `close` waits on `closing_cv` until it has, so that every `close` returns
    /// after the close adapters were told.
    closing: Mutex<Closing>,
    closing_cv: Condvar,
    /// Where handlers run under [`Driver::Thread`] (under [`Driver::Manual`], in the turn).
    handlers: Option<Arc<Pool<Job>>>,
}

impl Inner {
    pub(crate) fn new(sink: Arc<dyn Sink>, opts: HubOptions) -> Result<Arc<Inner>, OptionsError> {
        opts.validate()?;
        let driver = opts.driver;
        let inline = opts.inline_handlers;
        let spawn = driver == Driver::Thread && opts.batch;
        let inner = Arc::new_cyclic(|me| Inner {
            me: me.clone(),
            opts,
            sink,
            closed: AtomicBool::new(false),
            seq: AtomicU64::new(0),
            next_sub: AtomicU64::new(0),
            topics: RwLock::new(HashMap::default()),
            ids: Mutex::new(HashMap::new()),
            retiring: Mutex::new(Vec::new()),
            ended_direct: Mutex::new(HashMap::new()),
            ready: Mutex::new(Ready::default()),
            counters: Counters::default(),
            gate: Arc::default(),
            work: AtomicBool::new(false),
            wake: Mutex::new(WakeState::default()),
            wake_cv: Condvar::new(),
            drain: Mutex::new(DrainState::default()),
            flush_mx: Mutex::new(()),
            flush_cv: Condvar::new(),
            flush_waiters: AtomicUsize::new(0),
            thread: Mutex::new(None),
            closing: Mutex::new(Closing::default()),
            closing_cv: Condvar::new(),
            handlers: (driver == Driver::Thread && !inline).then(|| {
                let hub = me.clone();
                Pool::new(move |job: Job| match hub.upgrade() {
                    Some(inner) => inner.run_job(job),
                    None => job
                        .sub
                        .send_state
                        .store(job.generation << 3 | phase::IDLE, Ordering::SeqCst),
                })
            }),
        });
        if spawn {
            let runner = Arc::clone(&inner);
            let handle = std::thread::Builder::new()
                .name("powerhub-drain".into())
                .spawn(move || runner.run_thread())
                .map_err(|e| OptionsError::Spawn(e.to_string()))?;
            *inner.thread.lock() = Some(handle);
        }
        Ok(inner)
    }

    pub(crate) fn message_priority(&self) -> bool {
        self.opts.message_priority
    }

    pub(crate) fn is_closed(&self) -> bool {
        // SeqCst pairs with the flush waiter count (see `notify_flush`); a plain load on x86.
        self.closed.load(Ordering::SeqCst)
    }

    // ---- subscribe / unsubscribe -------------------------------------------------------------

    pub(crate) fn subscribe(
        &self,
        topic: &str,
        consumer: Consumer,
        opts: SubscribeOptions,
    ) -> Result<Arc<Sub>, SubscribeError> {
        if self.is_closed() {
            return Err(SubscribeError::Closed);
        }
        // A receiver takes entries, never a frame: the raw codec's one-message frames do not
        // bound its batches.
        let frames = matches!(consumer, Consumer::Sink | Consumer::Each(_));
        opts.validate(self.opts.codec, frames)?;
        let mut topics = self.topics.write();
        if self.is_closed() {
            return Err(SubscribeError::Closed);
        }
        let mut ids = self.ids.lock();
        let id: Arc<str> = match opts.id {
            Some(id) => {
                if ids.contains_key(&id) {
                    return Err(SubscribeError::DuplicateId(id.to_string()));
                }
                id
            }
            None => loop {
                let n = self.next_sub.fetch_add(1, Ordering::Relaxed);
                let id: Arc<str> = format!("sub-{n}").into();
                if !ids.contains_key(&id) {
                    break id;
                }
            },
        };
        // The subscriber's topic name shares the topic's key: one allocation per topic, not
        // per subscriber.
        let key = match topics.get_key_value(topic) {
            Some((key, _)) => Arc::clone(key),
            None => Arc::from(topic),
        };
        let mut sref = SubscriberRef::new(Arc::clone(&id), Arc::clone(&key));
        if let Some(t) = opts.transport {
            sref = sref.with_transport(t);
        }
        let entry = topics.entry(key).or_default();
        let direct = matches!(consumer, Consumer::Direct(_));
        let cursor = !direct
            && !self.opts.message_priority
            && opts.slow_consumer == SlowConsumer::DropOldest
            && opts.max_queue > 0;
        let queue = if direct {
            // Its queue is its position in the topic's direct log.
            Queue::new(0, opts.slow_consumer, false)
        } else if cursor {
            if entry.log.cap() < opts.max_queue {
                entry.log.set_cap(opts.max_queue);
            }
            Queue::cursor(opts.max_queue, Arc::clone(&entry.log))
        } else {
            Queue::new(
                opts.max_queue,
                opts.slow_consumer,
                self.opts.message_priority,
            )
        };
        let sub = Arc::new(Sub {
            sref,
            queue,
            max_batch: opts.max_batch,
            priority: opts.priority,
            order: self.next_sub.fetch_add(1, Ordering::Relaxed),
            codec: opts.codec.unwrap_or(self.opts.codec),
            sink: opts.sink.unwrap_or_else(|| Arc::clone(&self.sink)),
            consumer,
            ack: opts.bytes_acknowledged,
            closed: AtomicBool::new(false),
            start: AtomicU64::new(0),
            send_state: AtomicU64::new(0),
            handling: AtomicBool::new(false),
            taking: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            removed: AtomicU64::new(0),
            pending: Mutex::new(PendingSend::default()),
            hub: self.me.clone(),
        });
        ids.insert(id, Arc::clone(&sub));
        drop(ids);
        if let Consumer::Direct(dc) = &sub.consumer {
            let log = entry
                .direct
                .get_or_insert_with(|| DirectLog::new(opts.max_queue));
            *entry.direct_caps.entry(opts.max_queue).or_default() += 1;
            entry.direct_count += 1;
            log.set_cap(entry.direct_caps.last_key_value().map_or(0, |(&c, _)| c));
            // The retained log first, then what is published from now on; the receiver applies
            // its policy to both as one queue. The topics write lock keeps publishes out.
            // Publishers' handles append under the topic's order lock alone: it keeps them out
            // while the start is read.
            let replay: Vec<Arc<Entry>> = entry.retained.lock().iter().cloned().collect();
            let order = entry.order.lock();
            let head = log.head();
            *dc.start.lock() = Some((head, replay.clone()));
            dc.replay_left.store(replay.len(), Ordering::Relaxed);
            dc.pos.store(head, Ordering::Relaxed);
            drop(order);
            let _ = dc.log.set(Arc::clone(log));
            entry.reroute();
            drop(topics);
            return Ok(sub);
        }
        if cursor {
            *entry.caps.entry(opts.max_queue).or_default() += 1;
            entry.cursors.push(Arc::clone(&sub));
        } else {
            entry.subs.push(Arc::clone(&sub));
        }
        entry.reroute();
        // Read after the reroute, under the order lock: a publisher's handle that appended to
        // the receivers' log alone (not offered to this subscription) is numbered before it,
        // and every later publication comes by name, after this subscribe.
        let next = entry.order.lock().next;
        let start = entry.retained.lock().front().map_or(next, |e| e.topic_seq);
        sub.start.store(start, Ordering::Relaxed);
        let all = Arc::make_mut(&mut entry.all);
        // Usually the end: subscription order grows.
        let at = all.partition_point(|s| drain_key(s) <= drain_key(&sub));
        all.insert(at, Arc::clone(&sub));
        // Replay the retained log through the subscriber's own queue and policy. Holding the
        // topics write lock keeps publishes out, so replay and live traffic cannot interleave.
        let mut queued = 0;
        let mut disconnect = Vec::new();
        for e in entry.retained.lock().iter() {
            self.offer(&sub, e, &mut queued, &mut disconnect);
            if !disconnect.is_empty() {
                // Cut loose by `disconnect`: the rest of the log is not offered.
                break;
            }
        }
        if queued > 0 && !sub.closed.load(Ordering::Acquire) {
            self.ready.lock().subs.push(Arc::clone(&sub));
        }
        drop(topics);
        for s in disconnect {
            self.remove(&s, CloseReason::SlowConsumer);
        }
        if queued > 0 {
            self.wake();
        }
        Ok(sub)
    }

    pub(crate) fn unsubscribe_id(&self, id: &str) -> bool {
        let sub = self.ids.lock().get(id).cloned();
        match sub {
            Some(sub) => self.remove(&sub, CloseReason::Unsubscribe),
            None => false,
        }
    }

    /// Detaches `sub` and calls its close adapter; `false` if it was already gone.
    pub(crate) fn remove(&self, sub: &Arc<Sub>, reason: CloseReason) -> bool {
        // SeqCst pairs with the flush waiter count (see `notify_flush`).
        if sub.closed.swap(true, Ordering::SeqCst) {
            return false;
        }
        {
            let mut topics = self.topics.write();
            // Its counts move to the counters and it leaves `ids` in one step for `stats()`
            // (see `StatsGate`); under the topics lock, so no publish adds to them meanwhile.
            let _moving = self.gate.moving();
            if let Some(t) = topics.get_mut(sub.sref.topic()) {
                // Every list is sorted (subscription order, or drain order): a binary search,
                // so that many subscribers leaving one topic is not quadratic in comparisons.
                let all = Arc::make_mut(&mut t.all);
                if let Ok(i) = all.binary_search_by_key(&drain_key(sub), |s| drain_key(s)) {
                    all.remove(i);
                }
                if let Consumer::Direct(dc) = &sub.consumer {
                    // Its end is the log's head now, under the locks that keep publishes out
                    // (the topics lock, and the order lock for publishers' handles): what is
                    // published after this is not for it.
                    let order = t.order.lock();
                    dc.close(reason);
                    drop(order);
                    // What it received so far joins the hub's count (the rest, at its drop).
                    self.fold_direct(dc);
                    if let Some(n) = t.direct_caps.get_mut(&dc.cap) {
                        *n -= 1;
                        if *n == 0 {
                            t.direct_caps.remove(&dc.cap);
                        }
                    }
                    t.direct_count = t.direct_count.saturating_sub(1);
                    match t.direct_caps.last_key_value() {
                        Some((&cap, _)) => {
                            if let Some(log) = &t.direct {
                                log.set_cap(cap);
                            }
                        }
                        None => t.direct = None,
                    }
                } else if sub.queue.is_cursor() {
                    if let Ok(i) = t.cursors.binary_search_by_key(&sub.order, |s| s.order) {
                        t.cursors.remove(i);
                    }
                    let cap = sub.queue.capacity();
                    if let Some(n) = t.caps.get_mut(&cap) {
                        *n -= 1;
                        if *n == 0 {
                            t.caps.remove(&cap);
                        }
                    }
                    // The log keeps what the largest remaining cursor needs.
                    t.log
                        .set_cap(t.caps.last_key_value().map_or(0, |(&c, _)| c));
                    // What only the leaving subscriber still needed goes with it.
                    if !t.log.holds_nothing() {
                        release_passed(t);
                    }
                } else if let Ok(i) = t.subs.binary_search_by_key(&sub.order, |s| s.order) {
                    t.subs.remove(i);
                }
                t.reroute();
                if t.is_empty() {
                    // The last subscriber left: release the retained log with the topic.
                    topics.remove(sub.sref.topic());
                } else if t.has_no_consumer() {
                    // Kept by a publisher's handle: the retained log goes all the same.
                    t.retained.lock().clear();
                }
            }
            // A cursor's evictions so far (none can follow: it left its topic's cursors above,
            // and publishes wait for the topics lock).
            self.commit_overflow(sub);
            let mut ids = self.ids.lock();
            {
                // Read under the lock that `Inner::handle` takes to clear a closed subscriber's
                // entry: `closed` was set (SeqCst) before this read; a handler still running
                // now sees it when it returns and takes the entry off (see `Inner::handle`).
                let mut retiring = self.retiring.lock();
                if sub.handling.load(Ordering::SeqCst) {
                    retiring.push(Arc::clone(sub));
                }
            }
            if ids.get(sub.sref.id()).is_some_and(|s| Arc::ptr_eq(s, sub)) {
                ids.remove(sub.sref.id());
            }
            if let Consumer::Direct(dc) = &sub.consumer {
                // Under `ids`, as it leaves it: `stats()` reads both under that lock, so it
                // counts the receiver once, in one list or the other.
                self.ended(dc);
            }
        }
        let discarded = sub.end_queue(reason);
        if reason == CloseReason::SlowConsumer {
            self.counters.disconnected.fetch_add(1, Ordering::Relaxed);
            sub.dropped.fetch_add(discarded, Ordering::Relaxed);
            self.counters
                .dropped
                .fetch_add(discarded, Ordering::Relaxed);
        }
        self.close_adapter(sub, reason);
        self.notify_flush();
        true
    }

    /// The last step of a subscriber's removal: its transport is told, and a direct receiver
    /// waiting to count its own end (`DirectCursor::wait_removed`) may go on.
    fn close_adapter(&self, sub: &Sub, reason: CloseReason) {
        let r = catch_unwind(AssertUnwindSafe(|| sub.sink.close(&sub.sref, reason)));
        if let Err(p) = r {
            self.report(
                &DeliveryError::SinkPanicked {
                    id: sub.sref.id().to_owned(),
                    message: panic_message(&*p),
                },
                Some(&sub.sref),
            );
        }
        if let Consumer::Direct(dc) = &sub.consumer {
            dc.mark_removed();
        }
    }

    // ---- publish ------------------------------------------------------------------------------

    pub(crate) fn publish(
        &self,
        topic: &str,
        message: Message,
        opts: PublishOptions,
    ) -> Result<usize, PublishError> {
        if opts.priority.is_some() && !self.opts.message_priority {
            return Err(PublishError::PriorityWithoutMessagePriority);
        }
        if self.is_closed() {
            return Ok(0);
        }
        let priority = opts.priority.unwrap_or(0);
        let mut queued = 0;
        let mut tapped = 0;
        let mut disconnect = Vec::new();
        let fanned = FannedOut {
            queued: &mut queued,
            tapped: &mut tapped,
            disconnect: &mut disconnect,
            run: None,
        };
        {
            let topics = self.topics.read();
            if let Some((key, t)) = topics.get_key_value(topic) {
                self.publish_to(t, priority, message, opts.retain, fanned);
                self.list_ready(key, t, queued);
            } else if opts.retain {
                // The retained log needs the topic. A subscribe may have made it since the read.
                drop(topics);
                let mut topics = self.topics.write();
                if self.is_closed() {
                    return Ok(0);
                }
                topics.entry(Arc::from(topic)).or_default();
                if let Some((key, t)) = topics.get_key_value(topic) {
                    self.publish_to(t, priority, message, true, fanned);
                    self.list_ready(key, t, queued);
                }
            } else {
                // Nobody to number it for: counted as published all the same.
                self.seq.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.after_publish(disconnect, queued);
        Ok(queued + tapped)
    }

    /// Numbers `message` in topic `t` and fans it out, under a topics lock (the caller then
    /// lists the topic for the next turn).
    fn publish_to(
        &self,
        t: &Topic,
        priority: i32,
        message: Message,
        retain: bool,
        fanned: FannedOut<'_>,
    ) {
        let (mut order, entry) = numbered(t, &self.seq, priority, message, retain);
        let tail = order.as_deref_mut().map(|o| &mut o.tail);
        self.fan_out(t, entry, retain, tail, fanned);
        drop(order);
    }

    /// Publishes `messages` to `topic` in order with default options, as that many
    /// [`publish`](Self::publish) calls one after another would (nothing of another publisher
    /// between them), under one lookup of the topic and one hold of its order; each shard's
    /// tap takes the run as one offer. What a connection's receive of many publishes to one
    /// topic costs the hub, once. Empties `messages`; returns what each message reached.
    pub(crate) fn publish_run(&self, topic: &str, messages: &mut Vec<Message>) -> usize {
        let n = messages.len();
        if n <= 1 {
            return messages.pop().map_or(0, |m| {
                self.publish(topic, m, PublishOptions::default())
                    .unwrap_or(0)
            });
        }
        if self.is_closed() {
            messages.clear();
            return 0;
        }
        let (mut queued, mut tapped) = (0, 0);
        let mut disconnect = Vec::new();
        {
            let topics = self.topics.read();
            let Some((key, t)) = topics.get_key_value(topic) else {
                // Nobody to number them for: counted as published all the same.
                self.seq.fetch_add(n as u64, Ordering::Relaxed);
                messages.clear();
                return 0;
            };
            // As `numbered`, for the run: one hold of the topic's order, numbers in a block.
            let numbers = t.keeps_entries();
            let mut order = numbers.then(|| t.order.lock());
            let first = self.seq.fetch_add(n as u64, Ordering::Relaxed);
            let taps = u32::try_from(t.taps.len()).unwrap_or(u32::MAX);
            let mut run = Vec::with_capacity(if t.taps.is_empty() { 0 } else { n });
            for (k, mut message) in messages.drain(..).enumerate() {
                // Kept past the fan-out by one of those: a slice of a receive becomes its own.
                if numbers {
                    message.own();
                }
                let topic_seq = order.as_deref().map_or(0, |o| o.next);
                if let Some(o) = order.as_deref_mut() {
                    o.next += 1;
                }
                let entry = Entry::new(first + k as u64, topic_seq, 0, message, taps);
                let tail = order.as_deref_mut().map(|o| &mut o.tail);
                let fanned = FannedOut {
                    queued: &mut queued,
                    tapped: &mut tapped,
                    disconnect: &mut disconnect,
                    run: Some(&mut run),
                };
                self.fan_out(t, entry, false, tail, fanned);
            }
            // The taps take the run under the same hold of the order as one publish's entry.
            if let Some((last, others)) = t.taps.split_last() {
                for tap in others {
                    tap.offer_run(run.clone());
                    tapped += tap.subscribers() * n;
                }
                tapped += last.subscribers() * n;
                last.offer_run(run);
            }
            drop(order);
            self.list_ready(key, t, queued);
        }
        self.after_publish(disconnect, queued);
        (queued + tapped) / n
    }

    /// Lists topic `t` (named `key`) for the drain when a publish queued something for its
    /// subscribers. AcqRel: one publisher lists the topic per pass; the pass clears the flag
    /// under the topics write lock, which excludes the caller's read-locked section.
    fn list_ready(&self, key: &Arc<str>, t: &Topic, queued: usize) {
        if queued > 0 && !t.dirty.swap(true, Ordering::AcqRel) {
            self.ready.lock().topics.push(Arc::clone(key));
        }
    }

    /// After a publish, outside the topics lock: closes the slow consumers it found and wakes
    /// the drain if it queued anything.
    fn after_publish(&self, disconnect: Vec<Arc<Sub>>, queued: usize) {
        for s in disconnect {
            self.remove(&s, CloseReason::SlowConsumer);
        }
        if queued > 0 {
            self.wake();
        }
    }

    // ---- publishers' handles ------------------------------------------------------------------

    /// The order of `topic`, listed (with the topic) while the returned handle lives; an
    /// unlisted one on a closed hub (its route is [`Route::ByName`], which finds it closed).
    pub(crate) fn publisher_order(&self, topic: &str) -> TopicOrder {
        let mut topics = self.topics.write();
        if self.is_closed() {
            return TopicOrder::default();
        }
        if let Some(t) = topics.get(topic) {
            return Arc::clone(&t.order);
        }
        // A new topic has no consumers: its route is the default, by name.
        let t = topics.entry(Arc::from(topic)).or_default();
        Arc::clone(&t.order)
    }

    /// [`publish`](Inner::publish) through a publisher's handle of `topic`: while the topic's
    /// only consumers are direct receivers (and the publication is neither retained nor
    /// prioritized), under the topic's order lock alone, without the topics lock; otherwise
    /// through `publish`. Either way the publication is numbered under the order lock, so the
    /// two paths agree on the topic's order.
    pub(crate) fn publish_at(
        &self,
        topic: &str,
        order: &Mutex<Order>,
        message: Message,
        opts: PublishOptions,
    ) -> Result<usize, PublishError> {
        if !opts.retain && opts.priority.is_none() {
            let mut o = order.lock();
            let Order { next, tail, route } = &mut *o;
            if let Route::Direct { log, receivers } = route {
                // Read under the lock that `tear_down` takes to reroute: a publication here
                // either precedes the close or is not made.
                if self.is_closed() {
                    return Ok(0);
                }
                let seq = self.seq.fetch_add(1, Ordering::Relaxed);
                let entry = Entry::new(seq, *next, 0, message, 0);
                *next += 1;
                log.append(tail, Slot::Own(entry));
                return Ok(*receivers);
            }
        }
        self.publish(topic, message, opts)
    }

    /// A publisher's handle of `topic` goes: its reference to the topic's order is dropped
    /// under the topics write lock, and the topic goes too if it was the last thing keeping it.
    pub(crate) fn release_publisher(&self, topic: &str, order: TopicOrder) {
        let mut topics = self.topics.write();
        let listed = topics
            .get(topic)
            .is_some_and(|t| Arc::ptr_eq(&t.order, &order));
        // Dropped under the lock, so that of two handles going at once the second sees the
        // first gone.
        drop(order);
        // A handle is not a subscriber: a retained log stays (until the last subscriber of the
        // topic leaves, as without handles).
        if listed
            && topics
                .get(topic)
                .is_some_and(|t| t.is_empty() && t.retained.lock().is_empty())
        {
            topics.remove(topic);
        }
    }

    // ---- taps -------------------------------------------------------------------------------

    /// Hands every later publication to `topic` to `tap` too (see [`Tap`]). Taps see no retained
    /// replay. `false` once the hub is closed.
    pub(crate) fn attach_tap(&self, topic: &str, tap: Arc<dyn Tap>) -> bool {
        let mut topics = self.topics.write();
        if self.is_closed() {
            return false;
        }
        let key = match topics.get_key_value(topic) {
            Some((key, _)) => Arc::clone(key),
            None => Arc::from(topic),
        };
        let t = topics.entry(key).or_default();
        t.taps.push(tap);
        t.reroute();
        true
    }

    /// Stops handing `topic`'s publications to `tap`. Once this returns, no publisher calls
    /// the tap again (publishers hand over under the topics read lock, which this excludes).
    pub(crate) fn detach_tap(&self, topic: &str, tap: &Arc<dyn Tap>) {
        let mut topics = self.topics.write();
        if let Some(t) = topics.get_mut(topic) {
            t.taps.retain(|x| !Arc::ptr_eq(x, tap));
            t.reroute();
            if t.is_empty() {
                topics.remove(topic);
            } else if t.has_no_consumer() {
                t.retained.lock().clear();
            }
        }
        drop(topics);
        self.notify_flush();
    }

    /// Counts what the owner of a tap delivered and encoded (its fan-out's share of
    /// [`Stats::delivered`] and [`Stats::encoded`]).
    pub(crate) fn count_tapped(&self, delivered: u64, encoded: u64) {
        if delivered > 0 {
            self.counters
                .delivered
                .fetch_add(delivered, Ordering::Relaxed);
        }
        if encoded > 0 {
            self.counters.encoded.fetch_add(encoded, Ordering::Relaxed);
        }
    }

    /// Counts a subscription its tap's owner closed as a slow consumer ([`Stats::disconnected`]).
    pub(crate) fn count_tap_disconnect(&self) {
        self.counters.disconnected.fetch_add(1, Ordering::Relaxed);
    }

    /// The members of every tap, topic by topic; of `topic`'s taps only, if given.
    fn tap_members(&self, topic: Option<&str>) -> Vec<(Arc<str>, TapMember)> {
        let topics = self.topics.read();
        let mut out = Vec::new();
        let mut scratch = Vec::new();
        let mut take = |name: &Arc<str>, t: &Topic| {
            for tap in &t.taps {
                tap.members(&mut scratch);
                out.extend(scratch.drain(..).map(|m| (Arc::clone(name), m)));
            }
        };
        match topic {
            // One topic's presence costs its own members, not the server's.
            Some(want) => {
                if let Some((name, t)) = topics.get_key_value(want) {
                    take(name, t);
                }
            }
            None => {
                for (name, t) in topics.iter() {
                    take(name, t);
                }
            }
        }
        out
    }

    /// Queues `entry` for every subscriber of `t` (and in its retained log, with `retain`): one
    /// append for all the cursors, an offer to each subscriber with a queue of its own. The
    /// receivers' log, last, takes the entry itself at `tail` (no reference count taken and
    /// given back per publication); when the receivers are its only consumers, inline (no
    /// allocation). `tail` is `None` only when [`numbered`] took no lock: no receivers. With
    /// `fanned.run`, the taps are not offered the entry: it joins the run they take after it.
    fn fan_out(
        &self,
        t: &Topic,
        entry: Entry,
        retain: bool,
        tail: Option<&mut Tail>,
        fanned: FannedOut<'_>,
    ) {
        let FannedOut {
            queued,
            tapped: tap_counted,
            disconnect,
            run,
        } = fanned;
        let direct = t.direct.as_ref().zip(tail);
        if !retain && t.only_receivers() {
            if let Some((log, tail)) = direct {
                log.append(tail, Slot::Own(entry));
                *tap_counted += t.direct_count;
            }
            return;
        }
        let entry = Arc::new(entry);
        if retain {
            self::retain(t, &entry);
        }
        if !t.cursors.is_empty() {
            // Drop-oldest always queues: every cursor subscriber counts.
            t.log.append(&entry);
            *queued += t.cursors.len();
        }
        for sub in &t.subs {
            self.offer(sub, &entry, queued, disconnect);
        }
        if let Some((direct, tail)) = direct {
            // Read by the receivers themselves: nothing for the drain.
            direct.append(tail, Slot::Shared(Arc::clone(&entry)));
            *tap_counted += t.direct_count;
        }
        if let Some(run) = run {
            if !t.taps.is_empty() {
                run.push(entry);
            }
            return;
        }
        // One offer per tap counted in `Entry::taps` (the same list, under the same lock): the
        // seals' count depends on it (`hub/sealed.rs`). The last tap takes the hub's reference.
        if let Some((last, others)) = t.taps.split_last() {
            for tap in others {
                tap.offer(Arc::clone(&entry));
                *tap_counted += tap.subscribers();
            }
            *tap_counted += last.subscribers();
            last.offer(entry);
        }
    }

    /// Commits a cursor queue's lazily applied evictions to the drop counters; returns the
    /// queue's length. The caller holds the stats gate ([`StatsGate::moving`]).
    fn commit_overflow(&self, sub: &Sub) -> usize {
        let (n, len) = sub.queue.normalize();
        let n = n as u64;
        if n > 0 {
            sub.removed.fetch_add(n, Ordering::Relaxed);
            sub.dropped.fetch_add(n, Ordering::Relaxed);
            self.counters.dropped.fetch_add(n, Ordering::Relaxed);
        }
        len
    }

    fn offer(
        &self,
        sub: &Arc<Sub>,
        entry: &Arc<Entry>,
        queued: &mut usize,
        disconnect: &mut Vec<Arc<Sub>>,
    ) {
        if sub.closed.load(Ordering::Acquire) {
            return;
        }
        // The queue counts what it evicts in `sub.dropped` itself (see `Queue::offer`).
        match sub.queue.offer(Arc::clone(entry), &sub.dropped) {
            Offer::Queued { evicted } => {
                *queued += 1;
                if evicted > 0 {
                    sub.removed.fetch_add(evicted as u64, Ordering::Relaxed);
                    self.counters
                        .dropped
                        .fetch_add(evicted as u64, Ordering::Relaxed);
                }
                if !self.opts.batch {
                    sub.poke();
                }
            }
            Offer::Dropped => {
                sub.dropped.fetch_add(1, Ordering::Relaxed);
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                // A full queue is the consumer's to take first: only an empty one (a zero
                // capacity) leaves a waiting receiver nothing to wake for.
                if sub.is_fed_receiver() && sub.queue.is_empty() {
                    sub.poke();
                }
            }
            Offer::Disconnect => {
                sub.dropped.fetch_add(1, Ordering::Relaxed);
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                disconnect.push(Arc::clone(sub));
            }
        }
    }

    /// Marks that there is work and wakes the drain thread if it sleeps.
    fn wake(&self) {
        // AcqRel: the queue pushes before this are visible to the drainer that clears the flag.
        if self.work.swap(true, Ordering::AcqRel) || !self.opts.batch {
            return;
        }
        match self.opts.driver {
            Driver::Thread => {
                let _g = self.wake.lock();
                self.wake_cv.notify_one();
            }
            Driver::Manual => {
                if let Some(hook) = &self.opts.on_work {
                    // Called from `publish`, `subscribe` and completions: a panic here would
                    // leave them half done (a subscriber live but not returned, a flush not
                    // woken), so it stops at the hook.
                    if let Err(p) = catch_unwind(AssertUnwindSafe(|| hook())) {
                        tracing::error!(panic = %panic_message(&*p), "powerhub: the on_work hook panicked");
                    }
                }
            }
        }
    }

    // ---- drivers ------------------------------------------------------------------------------

    fn run_thread(self: Arc<Self>) {
        let delay = self.opts.batch_delay;
        // Whether the thread was idle before this turn: it starts so, and the first turn may
        // start in the middle of the first burst, as one after a sleep.
        let mut idle = true;
        // Publications numbered before the last turn: a wake with none since (a completion
        // that left work queued, a retained replay) has no burst to wait for.
        let mut seq_at_turn = 0;
        loop {
            {
                let mut g = self.wake.lock();
                while !self.work.load(Ordering::Acquire) && !self.is_closed() {
                    self.wake_cv.wait(&mut g);
                    idle = true;
                }
                if self.is_closed() {
                    return;
                }
                if !delay.is_zero() {
                    let deadline = Instant::now() + delay;
                    while !self.is_closed() && Instant::now() < deadline {
                        self.wake_cv.wait_until(&mut g, deadline);
                    }
                    if self.is_closed() {
                        return;
                    }
                }
            }
            if idle && delay.is_zero() && self.seq.load(Ordering::Relaxed) != seq_at_turn {
                self.settle();
            }
            idle = false;
            seq_at_turn = self.seq.load(Ordering::Relaxed);
            self.run_turn();
        }
    }

    /// Woken from idle by a publication, with no batching window: the turn waits until no
    /// publication came for [`SETTLE_QUIET`] (at most [`SETTLE_MAX`]), so that a burst
    /// published in one go (the spec's "same microtask") goes out as one batch even when the
    /// drain thread wakes in the middle of it. Best effort: a publisher preempted for longer in
    /// the middle of its burst still sees it split. A busy hub never sleeps, so it never pays
    /// this; an idle one pays 5 to 20 µs (spinning) on the first publication after a sleep,
    /// and nothing when woken by anything else (a completion, a retained replay). Outside the
    /// drain lock: a `flush` meanwhile takes the burst at once.
    fn settle(&self) {
        let start = Instant::now();
        let mut seen = self.seq.load(Ordering::Relaxed);
        let mut quiet_since = start;
        loop {
            std::hint::spin_loop();
            let now = Instant::now();
            let seq = self.seq.load(Ordering::Relaxed);
            if seq != seen {
                seen = seq;
                quiet_since = now;
            }
            if now - quiet_since >= SETTLE_QUIET || now - start >= SETTLE_MAX || self.is_closed() {
                return;
            }
        }
    }

    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        if self.is_closed() || !self.opts.batch {
            return None;
        }
        let w = self.wake.lock();
        if let Some(d) = w.deadline {
            return Some(d);
        }
        if self.work.load(Ordering::Acquire) {
            return Some(w.last_now.unwrap_or_else(Instant::now));
        }
        None
    }

    pub(crate) fn turn(&self, now: Instant) {
        if self.is_closed() || !self.opts.batch {
            return;
        }
        let delay = self.opts.batch_delay;
        {
            let mut w = self.wake.lock();
            w.last_now = Some(now);
            match w.deadline {
                None => {
                    if !self.work.load(Ordering::Acquire) {
                        return;
                    }
                    if !delay.is_zero() {
                        w.deadline = Some(now + delay);
                        return;
                    }
                }
                Some(d) if now < d => return,
                Some(_) => w.deadline = None,
            }
        }
        self.run_turn();
    }

    fn run_turn(&self) {
        if draining() {
            return;
        }
        let mut st = self.drain.lock();
        let _guard = DrainingGuard::enter();
        // AcqRel swap: reads-from the publisher's `wake` swap, so its queue pushes are visible.
        self.work.swap(false, Ordering::AcqRel);
        let m = self.drain_pass(&mut st);
        drop(st);
        self.emit_metrics(m);
    }

    fn emit_metrics(&self, mut m: TurnMetrics) {
        if let Some(hook) = &self.opts.metrics {
            if m.frames == 0 && m.encode_dropped == 0 && m.send_failures == 0 {
                return;
            }
            m.published_total = self.seq.load(Ordering::Relaxed);
            m.dropped_total = self.counters.dropped.load(Ordering::Relaxed);
            m.disconnected_total = self.counters.disconnected.load(Ordering::Relaxed);
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| hook(&m))) {
                tracing::error!(panic = %panic_message(&*p), "powerhub: the metrics hook panicked");
            }
        }
    }

    /// Lists every live subscriber for the next pass (a flush visits them all).
    fn mark_all_ready(&self) {
        let all: Vec<Arc<Sub>> = self.ids.lock().values().cloned().collect();
        self.ready.lock().subs.extend(all);
    }

    /// The pass's subscribers: those of the topics published to and those listed singly, each
    /// once, highest priority first, then in subscription order. One topic and nothing else
    /// (the common turn) is that topic's own list, shared. Call with the topics write lock
    /// held: no publish is half-way, so a topic's flag and list agree.
    fn take_ready(&self, topics: &TopicMap, scratch: &mut Vec<Arc<Sub>>) -> Arc<Vec<Arc<Sub>>> {
        let (names, subs) = {
            let mut r = self.ready.lock();
            (std::mem::take(&mut r.topics), std::mem::take(&mut r.subs))
        };
        let mut found = names.iter().filter_map(|name| topics.get(name));
        if names.len() == 1 && subs.is_empty() {
            return match found.next() {
                Some(t) => {
                    t.dirty.store(false, Ordering::Release);
                    Arc::clone(&t.all)
                }
                None => Arc::default(),
            };
        }
        scratch.clear();
        for t in found {
            t.dirty.store(false, Ordering::Release);
            scratch.extend(t.all.iter().cloned());
        }
        scratch.extend(subs);
        scratch.sort_unstable_by_key(|s| drain_key(s));
        scratch.dedup_by(|a, b| Arc::ptr_eq(a, b));
        Arc::new(std::mem::take(scratch))
    }

    /// One pass over the subscribers with work ([`Ready`]), highest priority first: each one
    /// not in flight sends what it had queued when the pass began, one frame per batch of up to
    /// `max_batch`.
    fn drain_pass(&self, st: &mut DrainState) -> TurnMetrics {
        let mut m = TurnMetrics::default();
        let order;
        // The turn boundary: every queue's length, read while no publish is half-way through
        // its subscribers (publishes hold the topics read lock). Subscribers that queued the same
        // publications therefore take the same batches and share their frames, even while other
        // threads keep publishing.
        st.budgets.clear();
        {
            let topics = self.topics.write();
            order = self.take_ready(&topics, &mut st.order);
            let _moving = self.gate.moving();
            st.budgets
                .extend(order.iter().map(|s| self.commit_overflow(s)));
        }
        let budgets = std::mem::take(&mut st.budgets);
        st.touched.clear();
        for (i, (sub, &budget)) in order.iter().zip(&budgets).enumerate() {
            if self.is_closed() {
                break;
            }
            if sub.closed.load(Ordering::Acquire) || sub.in_flight() {
                continue;
            }
            let mut budget = budget;
            // A receiver's batch is marked as taken from before its pop until its hand-off.
            let _taking = matches!(sub.consumer, Consumer::Batch(_)).then(|| Taking::mark(sub));
            while budget > 0 {
                let want = sub.max_batch.min(budget);
                let (batch, frame) = if sub.queue.is_cursor() {
                    match self.pop_cursor(st, sub, want) {
                        Some(taken) => {
                            // Subscribers of a topic are mostly adjacent in the drain order:
                            // this keeps the list short; `release_taken` dedups the rest.
                            let log_id = sub.queue.log_id();
                            if st.touched.last().is_none_or(|&(id, _)| id != log_id) {
                                st.touched.push((log_id, i));
                            }
                            taken
                        }
                        None => break,
                    }
                } else {
                    let mut batch = std::mem::take(&mut st.batch);
                    batch.clear();
                    sub.queue.pop_into(want, &mut batch);
                    if batch.is_empty() {
                        st.batch = batch;
                        break;
                    }
                    (Batch::Owned(batch), None)
                };
                budget = budget.saturating_sub(batch.len());
                sub.removed.fetch_add(batch.len() as u64, Ordering::Relaxed);
                let framed = !matches!(sub.consumer, Consumer::Batch(_));
                let mut batch = batch;
                if framed && frame.is_none() {
                    // A binary message under a text codec cannot be framed: it alone is
                    // dropped and reported; the batch's JSON messages go on.
                    match self.drop_unframable(sub, batch, &mut m) {
                        Some(rest) => batch = rest,
                        None => {
                            st.pending_range = None;
                            continue;
                        }
                    }
                    if matches!(batch, Batch::Owned(_)) {
                        // Filtered: not the range other subscribers at this cursor share.
                        st.pending_range = None;
                    }
                }
                let frame = match frame {
                    Some(f) => Ok(Some(f)),
                    // A receiver takes the entries: no frame is encoded for it.
                    None if !framed => Ok(None),
                    None => self
                        .frame_for(&mut st.memo, sub.codec, &batch, &mut m)
                        .map(Some),
                };
                let frame = match frame {
                    Ok(f) => f,
                    Err(e) => {
                        let n = batch.len() as u64;
                        sub.dropped.fetch_add(n, Ordering::Relaxed);
                        self.counters.dropped.fetch_add(n, Ordering::Relaxed);
                        m.encode_dropped += n;
                        self.report(&e, Some(&sub.sref));
                        if let Batch::Owned(v) = batch {
                            st.batch = v;
                        }
                        continue;
                    }
                };
                if let Batch::Shared(shared) = &batch {
                    // Remember the range so the next subscriber at the same cursor shares it
                    // (with its frame, unless it was taken by a receiver, which needs none).
                    if let Some(key) = st.pending_range.take() {
                        st.ranges.insert(key, (Arc::clone(shared), frame.clone()));
                    }
                }
                let frame = frame.unwrap_or_default();
                match self.send(sub, frame, batch, &mut m, &mut st.jobs) {
                    Some(Batch::Owned(back)) => st.batch = back,
                    Some(Batch::Shared(_)) => {}
                    None => break,
                }
            }
        }
        if let Some(pool) = &self.handlers {
            if !st.jobs.is_empty() {
                pool.push_all(st.jobs.drain(..));
            }
        }
        self.release_taken(&order, &mut st.touched);
        // Let go of the subscribers (and what their handlers hold) now; keep the capacity.
        if let Ok(mut v) = Arc::try_unwrap(order) {
            v.clear();
            st.order = v;
        }
        st.budgets = budgets;
        st.memo.trim();
        st.ranges.clear();
        st.batch.clear();
        m
    }

    /// Lets each topic log this pass took from forget the entries every one of its cursors has
    /// passed. Holding the topics read lock keeps subscribes (and so new cursors, which start
    /// at the head) out while the floor is computed; publishes may go on, they only append.
    /// The cost is two atomic loads per cursor subscriber of a touched topic, in the drainer,
    /// never in `publish`.
    fn release_taken(&self, order: &[Arc<Sub>], touched: &mut Vec<(u64, usize)>) {
        if touched.is_empty() {
            return;
        }
        touched.sort_unstable_by_key(|&(id, _)| id);
        touched.dedup_by_key(|&mut (id, _)| id);
        let topics = self.topics.read();
        for &(log_id, i) in touched.iter() {
            let Some(t) = topics.get(order[i].sref.topic()) else {
                continue;
            };
            // The topic may have gone and come back with a new log since the pass took.
            if t.log_id() != log_id {
                continue;
            }
            release_passed(t);
        }
        drop(topics);
        touched.clear();
    }

    /// Takes up to `want` entries of a cursor subscriber: a range of its topic log shared with
    /// every subscriber that takes the same range this pass (with its frame), or replayed
    /// entries. `None` when nothing is queued.
    fn pop_cursor(
        &self,
        st: &mut DrainState,
        sub: &Sub,
        want: usize,
    ) -> Option<(Batch, Option<Bytes>)> {
        let log_id = sub.queue.log_id();
        let codec = sub.codec;
        let ranges = &st.ranges;
        let moving = self.gate.moving();
        let (evicted, popped) = sub.queue.pop_cursor(want, |start, k| {
            ranges.contains_key(&(log_id, start, k, codec))
        });
        if evicted > 0 {
            let n = evicted as u64;
            sub.removed.fetch_add(n, Ordering::Relaxed);
            sub.dropped.fetch_add(n, Ordering::Relaxed);
            self.counters.dropped.fetch_add(n, Ordering::Relaxed);
        }
        drop(moving);
        st.pending_range = None;
        match popped {
            CursorPop::Empty => None,
            CursorPop::Prefix(v) => Some((Batch::Owned(v), None)),
            CursorPop::Range {
                start,
                k,
                entries: None,
            } => {
                let (batch, frame) = &st.ranges[&(log_id, start, k, codec)];
                Some((Batch::Shared(Arc::clone(batch)), frame.clone()))
            }
            CursorPop::Range {
                start,
                k,
                entries: Some(v),
            } => {
                st.pending_range = Some((log_id, start, k, codec));
                Some((Batch::Shared(Arc::new(v)), None))
            }
        }
    }

    /// `batch` without the messages `sub`'s codec cannot frame (binary ones under `json` or
    /// `ndjson`), which are counted in `dropped` and reported; the batch itself when it has
    /// none, `None` when nothing is left of it.
    fn drop_unframable(&self, sub: &Sub, batch: Batch, m: &mut TurnMetrics) -> Option<Batch> {
        if !matches!(sub.codec, Codec::Json | Codec::Ndjson)
            || batch.iter().all(|e| e.message.is_json())
        {
            return Some(batch);
        }
        let keep: Vec<Arc<Entry>> = batch
            .iter()
            .filter(|e| e.message.is_json())
            .cloned()
            .collect();
        let n = batch.len() - keep.len();
        let e = DeliveryError::Encode {
            codec: sub.codec.as_str(),
            messages: n,
            reason: format!(
                "{n} binary message(s); only JSON messages can be framed by `{}` (the batch's \
                 other messages are sent)",
                sub.codec.as_str()
            ),
        };
        sub.dropped.fetch_add(n as u64, Ordering::Relaxed);
        self.counters.dropped.fetch_add(n as u64, Ordering::Relaxed);
        m.encode_dropped += n as u64;
        self.report(&e, Some(&sub.sref));
        (!keep.is_empty()).then_some(Batch::Owned(keep))
    }

    fn frame_for(
        &self,
        memo: &mut EncodeMemo,
        codec: Codec,
        batch: &[Arc<Entry>],
        m: &mut TurnMetrics,
    ) -> Result<Bytes, DeliveryError> {
        let key = MemoKey::of(codec, batch);
        if let Some(frame) = memo.get(&key, batch) {
            return Ok(frame);
        }
        let frame = encode(codec, batch)?;
        self.counters.encoded.fetch_add(1, Ordering::Relaxed);
        m.encoded += 1;
        memo.insert(key, batch, &frame);
        Ok(frame)
    }

    /// Sends one frame. Returns the batch vector for reuse, or `None` when the send is pending
    /// (the subscriber is done for this pass).
    fn send(
        &self,
        sub: &Arc<Sub>,
        frame: Bytes,
        batch: Batch,
        m: &mut TurnMetrics,
        jobs: &mut Vec<Job>,
    ) -> Option<Batch> {
        let n = batch.len() as u64;
        m.frames += 1;
        m.messages += n;
        // Offered from here on: counted before the transport, a handler or a receiver sees the
        // batch, so none of them reads a `delivered` without it.
        self.counters.delivered.fetch_add(n, Ordering::Relaxed);
        let len = frame.len();
        // Only the drain lock's holder starts sends, and the previous one is finished (IDLE):
        // bump the generation so a late completion of an older send is recognised and ignored.
        let generation = (sub.send_state.load(Ordering::Acquire) >> 3) + 1;
        sub.send_state
            .store(generation << 3 | phase::SENDING, Ordering::SeqCst);
        let target = Arc::clone(sub);
        let done = Completion::new(move |result| target.on_completion(generation, result));
        let outcome = catch_unwind(AssertUnwindSafe(|| sub.sink.send(&sub.sref, frame, done)));
        let failed = |error| DeliveryError::SendFailed {
            id: sub.sref.id().to_owned(),
            error,
        };
        let result = match outcome {
            Ok(SendOutcome::Accepted) => Ok(()),
            Ok(SendOutcome::Pending) => {
                {
                    let mut p = sub.pending.lock();
                    p.batch = batch;
                    p.len = len;
                }
                let sending = generation << 3 | phase::SENDING;
                let pending = generation << 3 | phase::PENDING;
                match sub.send_state.compare_exchange(
                    sending,
                    pending,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => return None,
                    Err(cur) => {
                        // The completion already ran, inside `send`.
                        let mut p = sub.pending.lock();
                        let batch = std::mem::take(&mut p.batch);
                        let r = match cur & phase::MASK {
                            phase::EARLY_OK => Ok(()),
                            phase::EARLY_ERR => Err(failed(
                                p.early_error.take().unwrap_or(SendError::CompletionDropped),
                            )),
                            _ => Err(failed(SendError::CompletionDropped)),
                        };
                        drop(p);
                        if r.is_err() {
                            m.send_failures += 1;
                        }
                        sub.send_state
                            .store(generation << 3 | phase::FINISHING, Ordering::SeqCst);
                        return self.finish(sub, batch, len, generation, r, true, Some(jobs));
                    }
                }
            }
            Ok(SendOutcome::Failed(error)) => Err(failed(error)),
            Ok(other) => Err(failed(SendError::Refused(format!(
                "unknown send outcome {other:?}"
            )))),
            Err(p) => Err(DeliveryError::SinkPanicked {
                id: sub.sref.id().to_owned(),
                message: panic_message(&*p),
            }),
        };
        // Accepted or failed: a completion that runs from now on finds FINISHING and is ignored.
        sub.send_state
            .store(generation << 3 | phase::FINISHING, Ordering::SeqCst);
        if result.is_err() {
            m.send_failures += 1;
        }
        self.finish(sub, batch, len, generation, result, true, Some(jobs))
    }

    /// After a send ended: account, run the handler (only after the transport took the batch),
    /// clear in-flight, and wake whoever waits. Returns the batch, or `None` when the handler
    /// was handed to the handler pool (`jobs`, queued at the end of the pass, or the pool
    /// itself outside a pass): the subscriber stays in flight until [`Inner::run_job`] ran it.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        sub: &Arc<Sub>,
        batch: Batch,
        len: usize,
        generation: u64,
        result: Result<(), DeliveryError>,
        in_pass: bool,
        jobs: Option<&mut Vec<Job>>,
    ) -> Option<Batch> {
        match result {
            Ok(()) => {
                // One send at a time per subscriber: only this thread writes `bytes_sent` now.
                let total = sub.bytes_sent.load(Ordering::Relaxed) + len as u64;
                sub.bytes_sent.store(total, Ordering::Relaxed);
                if let Some(ack) = &sub.ack {
                    if let Err(p) = catch_unwind(AssertUnwindSafe(|| ack(total, &sub.sref))) {
                        self.report(
                            &DeliveryError::AckCallbackPanicked {
                                id: sub.sref.id().to_owned(),
                                message: panic_message(&*p),
                            },
                            Some(&sub.sref),
                        );
                    }
                }
                match &sub.consumer {
                    Consumer::Sink | Consumer::Direct(_) => {}
                    Consumer::Batch(end) => end.hand(&batch.share()),
                    Consumer::Each(handler) => match &self.handlers {
                        Some(pool) => {
                            let job = Job {
                                sub: Arc::clone(sub),
                                batch,
                                generation,
                            };
                            match jobs {
                                Some(jobs) => jobs.push(job),
                                None => pool.push_all([job]),
                            }
                            return None;
                        }
                        // In the drain (inline handlers, a manual turn), which holds the
                        // drain lock and checked `closed` at its visit.
                        None if in_pass => self.run_handler(sub, handler, &batch),
                        // On the thread that completed a held send, as the pool would.
                        None => self.handle(sub, handler, &batch),
                    },
                }
            }
            Err(e) => self.report(&e, Some(&sub.sref)),
        }
        self.finished(sub, generation, in_pass);
        Some(batch)
    }

    /// Hands a fed receiver its next batch on its consumer's thread, as the drain would: the
    /// consumer pulls what its hand-off did not get, so it does not wait for a drain that may
    /// not come (`batch(false)` sends only on a flush, which does not wait for consumers;
    /// `Driver::Manual` on a turn). Under the drain lock, as every send starts, taken only if
    /// it is free: a receive does not wait out another subscriber's send or handler
    /// ([`Feed::Busy`]: the receiver looks again shortly).
    fn feed(&self, sub: &Arc<Sub>) -> Feed {
        if holds_drain() || self.is_closed() {
            return Feed::Nothing;
        }
        let Some(mut st) = self.drain.try_lock() else {
            return Feed::Busy;
        };
        if sub.closed.load(Ordering::Acquire) || sub.in_flight() {
            return Feed::Nothing;
        }
        let guard = DrainingGuard::enter();
        let taking = Taking::mark(sub);
        let mut batch = std::mem::take(&mut st.batch);
        batch.clear();
        sub.queue.pop_into(sub.max_batch, &mut batch);
        if batch.is_empty() {
            st.batch = batch;
            return Feed::Nothing;
        }
        sub.removed.fetch_add(batch.len() as u64, Ordering::Relaxed);
        let mut m = TurnMetrics::default();
        let mut jobs = Vec::new();
        // A receiver takes the entries: no frame is encoded for it.
        if let Some(Batch::Owned(back)) =
            self.send(sub, Bytes::new(), Batch::Owned(batch), &mut m, &mut jobs)
        {
            st.batch = back;
        }
        drop(taking);
        drop(guard);
        drop(st);
        self.emit_metrics(m);
        Feed::Handed
    }

    /// A fed receiver's queue after its end, taken by the receiver (and counted as delivered)
    /// under the drain lock: no drainer is between a pop of it and that batch's hand-over, so
    /// every batch popped before is already handed over, and none is popped after (the
    /// subscriber is closed). `None` while the lock is taken: the receiver looks again.
    fn take_rest(&self, sub: &Sub) -> Option<Vec<Arc<Entry>>> {
        let _st = if holds_drain() {
            // This thread is the drainer, between two visits (a handler run inline).
            None
        } else {
            Some(self.drain.try_lock()?)
        };
        let mut rest = Vec::new();
        sub.queue.pop_into(usize::MAX, &mut rest);
        let n = rest.len() as u64;
        if n > 0 {
            sub.removed.fetch_add(n, Ordering::Relaxed);
            self.counters.delivered.fetch_add(n, Ordering::Relaxed);
        }
        Some(rest)
    }

    /// Runs `handler` for each message of `batch`, isolating panics.
    fn run_handler(&self, sub: &Sub, handler: &Handler, batch: &[Arc<Entry>]) {
        for e in batch {
            let d = Delivery::of(&sub.sref, e);
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| handler(&d))) {
                self.report(
                    &DeliveryError::HandlerPanicked {
                        id: sub.sref.id().to_owned(),
                        message: panic_message(&*p),
                    },
                    Some(&sub.sref),
                );
            }
        }
    }

    /// A handler job, on a worker of the handler pool: the handler (unless the subscription
    /// ended meanwhile), then the end of the send.
    fn run_job(&self, job: Job) {
        let Job {
            sub,
            batch,
            generation,
        } = job;
        if let Consumer::Each(handler) = &sub.consumer {
            self.handle(&sub, handler, &batch);
        }
        drop(batch);
        self.finished(&sub, generation, false);
    }

    /// Runs `sub`'s handler for `batch` unless the subscriber or the hub is closed by now, on
    /// whichever thread ends the send: the pool's, the drainer's, or the one that completed a
    /// held send. Marked as draining meanwhile: a handler that calls `flush` or `shutdown`
    /// would wait for its own subscriber, and gets [`FlushError::InsideDrain`] instead.
    fn handle(&self, sub: &Arc<Sub>, handler: &Handler, batch: &[Arc<Entry>]) {
        // Set before `closed` is read, SeqCst both: a flush that reads `closed` set (by this
        // handler unsubscribing itself, or by anyone once the handler started) and then
        // `handling` sees the handler running until it returned.
        sub.handling.store(true, Ordering::SeqCst);
        if !sub.closed.load(Ordering::SeqCst) && !self.is_closed() {
            let _guard = DrainingGuard::handler();
            self.run_handler(sub, handler, batch);
        }
        sub.handling.store(false, Ordering::SeqCst);
        if sub.closed.load(Ordering::SeqCst) {
            // Removed while its handler ran (or about to be): `remove` decided under this lock
            // whether it listed the subscriber, after `closed` and before this.
            self.retiring.lock().retain(|s| !Arc::ptr_eq(s, sub));
        }
    }

    /// The end of a send: the subscriber is idle again; one that queued more meanwhile is
    /// listed for the next pass (a send that ended inside its own pass needs not), and waiting
    /// flushes are woken.
    fn finished(&self, sub: &Arc<Sub>, generation: u64, in_pass: bool) {
        // SeqCst pairs with the flush waiter count (see `notify_flush`).
        sub.send_state
            .store(generation << 3 | phase::IDLE, Ordering::SeqCst);
        if !in_pass && !sub.closed.load(Ordering::Acquire) && !sub.queue.is_empty() {
            self.ready.lock().subs.push(Arc::clone(sub));
            self.wake();
        }
        self.notify_flush();
    }

    /// Wakes waiting flushes. The state change a flush waits for (`in_flight` cleared, `closed`
    /// set) is stored SeqCst before this loads the waiter count SeqCst, and a flush increments
    /// the count SeqCst before it re-checks that state: one of the two sees the other, so no
    /// wake-up is lost while completions with no flush waiting skip the mutex.
    fn notify_flush(&self) {
        if self.flush_waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.flush_mx.lock();
            self.flush_cv.notify_all();
        }
    }

    pub(crate) fn report(&self, err: &DeliveryError, sub: Option<&SubscriberRef>) {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        match &self.opts.on_error {
            Some(hook) => {
                let _ = catch_unwind(AssertUnwindSafe(|| hook(err, sub)));
            }
            None => tracing::warn!(subscriber = sub.map(|s| s.id()), "powerhub: {err}"),
        }
    }

    // ---- flush / close --------------------------------------------------------------------------

    pub(crate) fn flush(&self, deadline: Option<Instant>) -> Result<(), FlushError> {
        if self.is_closed() {
            return Err(FlushError::Closed);
        }
        if draining() {
            return Err(FlushError::InsideDrain);
        }
        // What each subscriber must have got rid of: everything queued when the flush first
        // holds the drain lock. Read under it, which every pop holds (a drainer's, a receiver's
        // feed or rest), so no pop falls between the two reads (one did, and the target came out
        // short by its batch: the flush returned with that much still queued); the length
        // first, so a pop counted after it cannot shorten the target. Only an eviction racing
        // the reads (a drop-oldest queue overflowing meanwhile) can, by one each.
        let target = |s: &Arc<Sub>| {
            let queued = s.queue.len() as u64;
            (Arc::clone(s), s.removed.load(Ordering::Relaxed) + queued)
        };
        let mut targets: Option<Vec<(Arc<Sub>, u64)>> = None;
        // A fed receiver whose hand-off holds a batch its consumer has not started has its
        // queue where it needs it: the consumer's next receives take the rest, at its pace (a
        // flush on the consumer's own thread must not wait for it).
        let done = |s: &Sub, target: u64| {
            (s.closed.load(Ordering::SeqCst) && !s.handling.load(Ordering::SeqCst))
                || (s.is_fed_receiver() && s.in_flight())
                || (!s.in_flight()
                    && (s.removed.load(Ordering::Relaxed) >= target || s.queue.is_empty()))
        };
        loop {
            {
                // Another thread's pass (an inline handler, a sink that blocks) holds the drain:
                // waited for no longer than the deadline.
                let mut st = match deadline {
                    None => self.drain.lock(),
                    Some(d) => match self.drain.try_lock_until(d) {
                        Some(st) => st,
                        None if self.is_closed() => return Err(FlushError::Closed),
                        None => return Err(FlushError::Timeout),
                    },
                };
                let targets = targets.get_or_insert_with(|| {
                    let ids = self.ids.lock();
                    let retiring = self.retiring.lock();
                    ids.values().chain(retiring.iter()).map(target).collect()
                });
                // This pass sends what a batching window gathered: the window is over.
                self.wake.lock().deadline = None;
                let guard = DrainingGuard::enter();
                // AcqRel: reads-from the publisher's `wake` swap, so its pushes are visible.
                self.work.swap(false, Ordering::AcqRel);
                self.mark_all_ready();
                let m = self.drain_pass(&mut st);
                // Checked under the drain lock: a drainer pops a batch and starts its send
                // under it, so no batch is between its queue and its send now.
                let finished = targets.iter().all(|(s, t)| done(s, *t));
                drop(guard);
                drop(st);
                self.emit_metrics(m);
                if self.is_closed() {
                    return Err(FlushError::Closed);
                }
                if finished {
                    break;
                }
            }
            // Wait for an outstanding send to complete, then drain again.
            let targets = targets.as_deref().unwrap_or_default();
            let mut g = self.flush_mx.lock();
            self.flush_waiters.fetch_add(1, Ordering::SeqCst);
            while !self.is_closed() && targets.iter().any(|(s, t)| !done(s, *t) && s.in_flight()) {
                match deadline {
                    None => self.flush_cv.wait(&mut g),
                    Some(d) => {
                        if self.flush_cv.wait_until(&mut g, d).timed_out() {
                            self.flush_waiters.fetch_sub(1, Ordering::SeqCst);
                            return Err(FlushError::Timeout);
                        }
                    }
                }
            }
            self.flush_waiters.fetch_sub(1, Ordering::SeqCst);
        }
        // Errors isolated on the way (a failing sink, a panicking handler or accounting
        // callback, an encode failure) were each reported to the error hook and counted; they
        // do not make the flush fail: every queue reached its transport (the realtime-hub
        // spec: "a bad accounting callback must not become a delivery failure").
        Ok(())
    }

    pub(crate) fn close(&self) {
        {
            // Under `closing`, so that a `close` that loses the race finds the winner's thread.
            let mut closing = self.closing.lock();
            if self.closed.swap(true, Ordering::SeqCst) {
                // Not from inside the winner's own teardown (an adapter or handler it called),
                // nor from a drain (the winner may be joining the drain thread): those return
                // at once, as before.
                if closing.by != Some(std::thread::current().id()) && !draining() {
                    while !closing.done {
                        self.closing_cv.wait(&mut closing);
                    }
                }
                return;
            }
            closing.by = Some(std::thread::current().id());
        }
        let _done = CloseDone(self);
        self.tear_down();
    }

    /// What the first `close` does.
    fn tear_down(&self) {
        {
            let _g = self.wake.lock();
            self.wake_cv.notify_all();
        }
        let topics = std::mem::take(&mut *self.topics.write());
        for t in topics.values() {
            // Publishers' handles go through `publish`, which finds the hub closed; the log's
            // writing end lets go of the log.
            let mut order = t.order.lock();
            order.route = Route::ByName;
            order.tail = Tail::default();
        }
        let mut subs: Vec<Arc<Sub>> = {
            // The subscribers leave `ids` with their evictions committed, in one step for
            // `stats()` (see `StatsGate`): what their queues dropped stays counted.
            let _moving = self.gate.moving();
            let mut ids = self.ids.lock();
            let subs: Vec<Arc<Sub>> = ids.drain().map(|(_, s)| s).collect();
            for sub in &subs {
                match &sub.consumer {
                    // Direct receivers leave `ids` here: `stats()` finds them in
                    // `ended_direct`.
                    Consumer::Direct(dc) => self.ended(dc),
                    _ => {
                        self.commit_overflow(sub);
                    }
                }
            }
            subs
        };
        subs.sort_by_key(|s| s.order);
        for sub in &subs {
            if !sub.closed.swap(true, Ordering::AcqRel) {
                sub.end_queue(CloseReason::HubClosed);
                self.close_adapter(sub, CloseReason::HubClosed);
            }
        }
        for t in topics.values() {
            for tap in &t.taps {
                tap.hub_closed();
            }
        }
        // The retained logs go with the topics.
        drop(topics);
        *self.ready.lock() = Ready::default();
        if let Some(pool) = &self.handlers {
            pool.close();
        }
        self.notify_flush();
        let handle = self.thread.lock().take();
        if let Some(handle) = handle {
            // Not from the drain thread itself, nor from a thread inside a drain (a handler run
            // by `flush`): the drain thread may be waiting for that drain. It exits on its own.
            if handle.thread().id() != std::thread::current().id() && !draining() {
                let _ = handle.join();
            }
        }
    }

    // ---- observation ------------------------------------------------------------------------------

    /// A direct receiver's subscription ended: its cursor joins `ended_direct` (called under
    /// the `ids` lock; lock order `ids` before `ended_direct`).
    fn ended(&self, dc: &Arc<DirectCursor>) {
        self.ended_direct
            .lock()
            .insert(cursor_key(dc), Arc::clone(dc));
    }

    /// The receiver of an ended subscription is gone and committed its counts: its cursor
    /// leaves `ended_direct` (and with it the log it holds).
    pub(crate) fn forget_ended(&self, dc: &Arc<DirectCursor>) {
        let _ids = self.ids.lock();
        let gone = self.ended_direct.lock().remove(&cursor_key(dc));
        drop(_ids);
        // Dropped outside the locks: it may hold the topic's last chunks.
        drop(gone);
    }

    /// A direct receiver's counts not yet in the hub's counters join them (`delivered`,
    /// `dropped`; see [`DirectCursor::fold`]). The caller holds the stats gate.
    fn fold_direct(&self, dc: &DirectCursor) {
        let (received, dropped) = dc.fold();
        self.counters
            .delivered
            .fetch_add(received, Ordering::Relaxed);
        self.counters.dropped.fetch_add(dropped, Ordering::Relaxed);
    }

    pub(crate) fn stats_gate(&self) -> Arc<StatsGate> {
        Arc::clone(&self.gate)
    }

    pub(crate) fn stats(&self) -> Stats {
        // The subscribers and the ended receivers in one look under `ids`: a receiver leaves
        // one for the other under that lock, so it is counted once.
        let (mut subs, ended) = {
            let ids = self.ids.lock();
            let subs: Vec<Arc<Sub>> = ids.values().cloned().collect();
            let ended: Vec<Arc<DirectCursor>> =
                self.ended_direct.lock().values().cloned().collect();
            (subs, ended)
        };
        subs.sort_by_key(|s| (Reverse(s.priority), s.order));
        let taps = self.tap_members(None);
        let topics = self.topics.read().len();
        // No count moves from an estimate to a counter while they are read (see `StatsGate`).
        let reading = self.gate.reading();
        // Evictions a cursor queue has not committed yet count as dropped already.
        let mut uncommitted = 0;
        // What live direct receivers received and the counter has not taken in yet.
        let mut received = 0;
        // So do those of ended direct receivers that still live (they are in no list).
        for dc in &ended {
            let c = dc.snapshot();
            received += c.received_unfolded;
            uncommitted += c.dropped_unfolded;
        }
        let mut list: Vec<SubscriberStats> = subs
            .iter()
            .map(|s| {
                let (queued, dropped) = match &s.consumer {
                    Consumer::Direct(dc) => {
                        let c = dc.snapshot();
                        received += c.received_unfolded;
                        uncommitted += c.dropped_unfolded;
                        (c.queued, c.dropped)
                    }
                    _ => {
                        let overflow = s.queue.overflow() as u64;
                        uncommitted += overflow;
                        (s.queue.len(), s.dropped.load(Ordering::Relaxed) + overflow)
                    }
                };
                SubscriberStats {
                    id: s.sref.id().to_owned(),
                    topic: s.sref.topic().to_owned(),
                    queued,
                    dropped,
                    bytes_sent: s.bytes_sent.load(Ordering::Relaxed),
                    in_flight: s.in_flight(),
                    priority: s.priority,
                }
            })
            .collect();
        let delivered = self.counters.delivered.load(Ordering::Relaxed) + received;
        let dropped = self.counters.dropped.load(Ordering::Relaxed) + uncommitted;
        drop(reading);
        list.extend(taps.into_iter().map(|(topic, m)| SubscriberStats {
            id: m.id.to_string(),
            topic: topic.to_string(),
            queued: 0,
            dropped: 0,
            bytes_sent: m.bytes_sent.load(Ordering::Relaxed),
            in_flight: false,
            priority: 0,
        }));
        Stats {
            subscribers: list.len(),
            topics,
            published: self.seq.load(Ordering::Relaxed),
            delivered,
            dropped,
            disconnected: self.counters.disconnected.load(Ordering::Relaxed),
            bytes_out: list.iter().map(|s| s.bytes_sent).sum(),
            encoded: self.counters.encoded.load(Ordering::Relaxed),
            list,
        }
    }

    pub(crate) fn presence(&self, topic: Option<&str>) -> Vec<Presence> {
        let mut subs: Vec<Arc<Sub>> = self
            .ids
            .lock()
            .values()
            .filter(|s| topic.is_none_or(|t| s.sref.topic() == t))
            .cloned()
            .collect();
        subs.sort_by_key(|s| s.order);
        let mut out: Vec<Presence> = subs
            .iter()
            .map(|s| Presence {
                id: s.sref.id().to_owned(),
                topic: s.sref.topic().to_owned(),
                transport: s.sref.transport_any().cloned(),
            })
            .collect();
        out.extend(self.tap_members(topic).into_iter().map(|(t, m)| Presence {
            id: m.id.to_string(),
            topic: t.to_string(),
            transport: Some(m.transport),
        }));
        out
    }
}

/// A subscriber's place in a pass: highest priority first, then subscription order.
fn drain_key(s: &Sub) -> (Reverse<i32>, u64) {
    (Reverse(s.priority), s.order)
}

/// Releases the entries of `t`'s log that every cursor subscriber of `t` has passed. Call with
/// the topics lock held (read or write), so no cursor joins meanwhile.
fn release_passed(t: &Topic) {
    let floor = t
        .cursors
        .iter()
        .filter_map(|s| s.queue.cursor_floor())
        .min();
    // No cursor left: `set_cap(0)` has emptied the log already.
    if let Some(floor) = floor {
        t.log.release_before(floor);
    }
}

/// The key of a direct receiver's cursor among the ended ones: its address (the entry holds the
/// cursor, so the address is not reused while it is listed), so that dropping each of many
/// receivers finds its own in constant time.
fn cursor_key(dc: &Arc<DirectCursor>) -> usize {
    Arc::as_ptr(dc) as usize
}

/// Marks a receiver's batches as taken (`Sub::taking`) for the drainer's visit to it: set before
/// the first pop, cleared when the visit ends (every batch handed over or held pending).
struct Taking<'a>(&'a Sub);

impl<'a> Taking<'a> {
    fn mark(sub: &'a Sub) -> Taking<'a> {
        // SeqCst, before the pop: a receiver that sees the pop in the queue's length sees this.
        sub.taking.store(true, Ordering::SeqCst);
        Taking(sub)
    }
}

impl Drop for Taking<'_> {
    fn drop(&mut self) {
        self.0.taking.store(false, Ordering::SeqCst);
    }
}

/// The entry of the next publication in topic `t`, numbered in the hub (from `counter`, which
/// doubles as the `published` counter) and in the topic; the guard keeps the next publication of
/// the topic out until this one is offered to every subscriber.
///
/// The hub-wide number is taken under the topic's order lock, as the topic's number is, so the
/// two agree in order: of two publishers racing on one topic, the one numbered first in the
/// topic is numbered first in the hub too (a subscriber's queue breaks priority ties by it, and
/// `seq` increases in delivery order). The lock's acquire and release order the two
/// increments; the increment itself is `Relaxed` (a count).
///
/// A topic whose only consumers are taps (the engine's push fan-out, which reads neither number)
/// and that retains nothing is not numbered in the topic: its publishers take no lock.
/// Where [`Inner::fan_out`] counts what a publication reached and keeps what it must do after.
struct FannedOut<'a> {
    /// Queued for subscribers with queues of their own and cursor subscribers.
    queued: &'a mut usize,
    /// Subscriptions behind the taps, and direct receivers.
    tapped: &'a mut usize,
    /// Subscribers to close as slow consumers, after the topics lock.
    disconnect: &'a mut Vec<Arc<Sub>>,
    /// A run's publications for the taps, which take them at once after the run.
    run: Option<&'a mut Vec<Arc<Entry>>>,
}

fn numbered<'t>(
    t: &'t Topic,
    counter: &AtomicU64,
    priority: i32,
    mut message: Message,
    retain: bool,
) -> (Option<parking_lot::MutexGuard<'t, Order>>, Entry) {
    let numbers = retain || t.keeps_entries();
    // Kept past the fan-out (retained, or by one of those): a slice of a receive becomes its
    // own.
    if numbers {
        message.own();
    }
    let mut order = numbers.then(|| t.order.lock());
    let seq = counter.fetch_add(1, Ordering::Relaxed);
    let topic_seq = order.as_deref().map_or(0, |o| o.next);
    if let Some(o) = order.as_deref_mut() {
        o.next += 1;
    }
    let taps = u32::try_from(t.taps.len()).unwrap_or(u32::MAX);
    (order, Entry::new(seq, topic_seq, priority, message, taps))
}

fn retain(topic: &Topic, entry: &Arc<Entry>) {
    let mut log = topic.retained.lock();
    if log.len() == RETAINED_PER_TOPIC {
        log.pop_front();
    }
    log.push_back(Arc::clone(entry));
}

fn encode(codec: Codec, batch: &[Arc<Entry>]) -> Result<Bytes, DeliveryError> {
    let refuse = |reason: String| DeliveryError::Encode {
        codec: codec.as_str(),
        messages: batch.len(),
        reason,
    };
    match codec {
        Codec::Json | Codec::Ndjson => {
            if let Some(i) = batch.iter().position(|e| !e.message.is_json()) {
                return Err(refuse(format!(
                    "message {i} is binary; only JSON messages can be framed by `{}`",
                    codec.as_str()
                )));
            }
            let texts = batch.iter().map(|e| &e.message.bytes()[..]);
            if codec == Codec::Json {
                Ok(frame::encode_json_batch(texts)?)
            } else {
                Ok(frame::encode_ndjson_batch(texts))
            }
        }
        Codec::Raw => {
            if batch.len() != 1 {
                return Err(refuse(
                    "`codec: raw` carries exactly one message per frame".into(),
                ));
            }
            Ok(frame::encode_raw(batch[0].message.bytes())?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(seqs: std::ops::Range<u64>) -> Vec<Arc<Entry>> {
        seqs.map(|s| Arc::new(Entry::new(s, s, 0, Message::binary(vec![0u8]), 0)))
            .collect()
    }

    #[test]
    fn the_encode_memo_keeps_frames_across_passes_within_its_bounds() {
        let mut memo = EncodeMemo::default();
        let frame = Bytes::from(vec![0u8; MEMO_BYTES / 4]);
        let batches: Vec<_> = (0..6).map(|i| batch(i * 2..i * 2 + 2)).collect();
        let keys: Vec<_> = batches
            .iter()
            .map(|b| MemoKey::of(Codec::Json, b))
            .collect();
        for (k, b) in keys.iter().zip(&batches).take(4) {
            memo.insert(*k, b, &frame);
        }
        memo.trim();
        assert!(
            memo.get(&keys[0], &batches[0]).is_some(),
            "kept across the pass"
        );
        // Another codec, or other sequence numbers, are another batch.
        assert!(memo
            .get(&MemoKey::of(Codec::Ndjson, &batches[0]), &batches[0])
            .is_none());
        assert!(memo.get(&keys[0], &batches[1]).is_none());
        for (k, b) in keys.iter().zip(&batches).skip(4) {
            memo.insert(*k, b, &frame);
        }
        memo.trim();
        assert_eq!(memo.bytes, MEMO_BYTES, "the oldest went first");
        assert!(memo.get(&keys[1], &batches[1]).is_none());
        assert!(memo.get(&keys[5], &batches[5]).is_some());
        for i in 0..=MEMO_FRAMES as u64 {
            let b = batch(100 + i..101 + i);
            memo.insert(
                MemoKey::of(Codec::Json, &b),
                &b,
                &Bytes::from_static(b"[0]"),
            );
        }
        memo.trim();
        assert_eq!(memo.order.len(), MEMO_FRAMES);
        assert_eq!(memo.frames.len(), MEMO_FRAMES);
    }
}
