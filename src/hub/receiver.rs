//! A receiver per subscriber: see [`Receiver`].

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use powerhub_plugin::{CloseReason, Completion, Frame, SendOutcome, Sink, SubscriberRef};

use super::core::{Consumer, Entry, Feed, HandOffEnd, SharedBatch, Sub};
use super::direct::{flush_returns, DirectCursor, DirectReader, Held, Next};
use super::{Delivery, Message, SlowConsumer, Subscription};

/// One message a [`Receiver`] received.
///
/// A value of one word. A message received from the topic's log (a drop-oldest receiver's)
/// holds a reference that its chunk of the log (64 publications) lent the receiver in bulk, so
/// the receive itself takes no atomic operation. While it is held it keeps that chunk in memory;
/// [`into_message`](Received::into_message) keeps only the message.
///
/// Dropping it gives the reference back. Consecutive drops on one thread of messages from one
/// chunk are counted on the thread and reach the chunk together (no atomic operation each):
/// when that thread drops a message of another chunk, when a receiver on it finds nothing to
/// receive (and so before it waits), when a receiver is dropped on it, or when it exits. Until
/// then the thread holds back at most that one chunk from being freed.
#[derive(Clone)]
pub struct Received {
    held: Held,
}

impl std::fmt::Debug for Received {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Received")
            .field("seq", &self.seq())
            .field("topic_seq", &self.topic_seq())
            .field("priority", &self.priority())
            .field("message", self.message())
            .finish()
    }
}

impl Received {
    #[inline]
    fn of(e: &Arc<Entry>) -> Received {
        Received {
            held: Held::whole(Arc::clone(e)),
        }
    }

    #[inline]
    fn entry(&self) -> &Entry {
        self.held.entry()
    }

    /// The message.
    #[inline]
    pub fn message(&self) -> &Message {
        &self.entry().message
    }

    /// The message, owned.
    pub fn into_message(self) -> Message {
        self.held.into_message()
    }

    /// The hub-wide publication number (increasing in publish order across all topics).
    #[inline]
    pub fn seq(&self) -> u64 {
        self.entry().seq
    }

    /// The message's number within its topic (see [`Delivery::topic_seq`]): consecutive for a
    /// receiver that lost nothing.
    #[inline]
    pub fn topic_seq(&self) -> u64 {
        self.entry().topic_seq
    }

    /// The priority it was published with (0 when none).
    #[inline]
    pub fn priority(&self) -> i32 {
        self.entry().priority
    }
}

/// Why [`Receiver::recv`] returned no message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecvError {
    /// The subscriber's policy dropped `missed` messages since the last receive; the next
    /// receive returns the first message after them.
    #[error("the receiver lagged: its slow-consumer policy dropped {missed} message(s)")]
    Lagged {
        /// Messages dropped.
        missed: u64,
    },
    /// The subscription ended and everything handed over was received.
    #[error("the subscription is closed ({reason})")]
    Closed {
        /// Why it ended.
        reason: CloseReason,
    },
}

/// Why [`Receiver::try_recv`] returned no message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TryRecvError {
    /// Nothing to receive now.
    #[error("no message is waiting")]
    Empty,
    /// As [`RecvError::Lagged`].
    #[error("the receiver lagged: its slow-consumer policy dropped {missed} message(s)")]
    Lagged {
        /// Messages dropped.
        missed: u64,
    },
    /// As [`RecvError::Closed`].
    #[error("the subscription is closed ({reason})")]
    Closed {
        /// Why it ended.
        reason: CloseReason,
    },
}

/// Why [`Receiver::recv_timeout`] returned no message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecvTimeoutError {
    /// Nothing arrived in time.
    #[error("no message arrived in time")]
    Timeout,
    /// As [`RecvError::Lagged`].
    #[error("the receiver lagged: its slow-consumer policy dropped {missed} message(s)")]
    Lagged {
        /// Messages dropped.
        missed: u64,
    },
    /// As [`RecvError::Closed`].
    #[error("the subscription is closed ({reason})")]
    Closed {
        /// Why it ended.
        reason: CloseReason,
    },
}

/// One batch handed over, with the subscriber's drop count when it was.
#[derive(Debug)]
struct Handed {
    entries: SharedBatch,
    dropped_before: u64,
}

#[derive(Debug, Default)]
struct State {
    /// Batches handed over and not yet taken by the consumer (at most one while the hub's next
    /// send is held pending).
    batches: VecDeque<Handed>,
    /// The hub's send waiting for room (the subscriber's next batch stays in its queue).
    pending: Option<Completion>,
    closed: Option<CloseReason>,
    waker: Option<Waker>,
    /// A publication the consumer should look at that no hand-over brings
    /// ([`HandOffEnd::poke`]): cleared by the receive that is about to wait.
    poked: bool,
}

impl State {
    /// Whether a receive about to wait has something to look at first: a batch handed over, a
    /// held send, the end, or a poke (which this clears).
    fn has_news(&mut self) -> bool {
        !(self.batches.is_empty() && self.pending.is_none() && self.closed.is_none())
            || std::mem::take(&mut self.poked)
    }
}

/// What the hub and the receiver share.
struct Chan {
    state: Mutex<State>,
    ready: Condvar,
    /// The subscriber's slow-consumer policy.
    policy: SlowConsumer,
    /// The subscriber, for its drop count (set once subscribed). Weak: the subscriber holds
    /// this channel (its sink and its consumer), so a strong reference would be a cycle that
    /// outlives the subscription and the hub.
    sub: OnceLock<Weak<Sub>>,
}

impl std::fmt::Debug for Chan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chan")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Chan {
    /// The subscriber, while it lives (set once subscribed).
    fn sub(&self) -> Option<Arc<Sub>> {
        self.sub.get().and_then(Weak::upgrade)
    }

    fn dropped(&self) -> u64 {
        self.sub().map_or(0, |s| s.dropped_count())
    }

    /// What the hub holds for the subscriber: `(queued, taking)`, the messages in its queue and
    /// whether the drainer took a batch from it that it has not handed over yet (read in that
    /// order: see `Sub::taking`).
    fn held(&self) -> (usize, bool) {
        self.sub()
            .map_or((0, false), |s| (s.queued(), s.is_taking()))
    }

    /// Wakes the consumer (blocked or async) after what `st` changed: the waker is taken under
    /// the lock and woken after it (a waker may run code of its own, and the hub may hold its
    /// topics lock); a consumer about to wait reads the change under the lock first.
    fn notify(&self, mut st: MutexGuard<'_, State>) {
        let waker = st.waker.take();
        drop(st);
        self.ready.notify_one();
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// What the subscriber's queue still holds after its end, handed over as one last batch,
    /// after the batches handed before it ([`Feed::Busy`] while a drainer holds the drain
    /// lock).
    fn take_rest(&self) -> Feed {
        let Some(sub) = self.sub() else {
            return Feed::Nothing;
        };
        let Some(rest) = sub.take_rest() else {
            return Feed::Busy;
        };
        if rest.is_empty() {
            return Feed::Nothing;
        }
        self.state.lock().batches.push_back(Handed {
            entries: Arc::new(rest),
            dropped_before: sub.dropped_count(),
        });
        Feed::Handed
    }

    /// Nothing is handed over and nothing is on its way while the subscriber's queue holds
    /// messages: the hub hands the next batch over now ([`Feed::Handed`]: look again).
    fn feed(&self) -> Feed {
        match self.held() {
            (0, _) => Feed::Nothing,
            (_, true) => {
                // The drainer is handing a batch over: look again after it.
                std::thread::yield_now();
                Feed::Handed
            }
            _ => self.sub().map_or(Feed::Nothing, |s| s.feed()),
        }
    }
}

impl HandOffEnd for Chan {
    /// The hub's hand-over of one batch, after the send was accepted: one lock and one
    /// reference count per batch, whatever its length.
    fn hand(&self, entries: &SharedBatch) {
        let dropped_before = self.dropped();
        let mut st = self.state.lock();
        st.batches.push_back(Handed {
            entries: Arc::clone(entries),
            dropped_before,
        });
        self.notify(st);
    }

    fn poke(&self) {
        let mut st = self.state.lock();
        st.poked = true;
        self.notify(st);
    }
}

/// The receiver's transport in the hub: takes a batch when the hand-off is empty, else holds the
/// send pending until the consumer emptied it.
#[derive(Debug)]
struct HandOff(Arc<Chan>);

impl Sink for HandOff {
    fn send(&self, _sub: &SubscriberRef, _frame: Frame, done: Completion) -> SendOutcome {
        let mut st = self.0.state.lock();
        if st.closed.is_some() || st.batches.is_empty() {
            // The hub hands the batch over (`Chan::hand`) once the send is accepted.
            drop(st);
            drop(done);
            return SendOutcome::Accepted;
        }
        st.pending = Some(done);
        SendOutcome::Pending
    }

    fn close(&self, _sub: &SubscriberRef, reason: CloseReason) {
        // The held send first: its batch is handed over (inside `complete`) before the end is
        // said, so the receiver never finds the end with a batch still to come.
        let pending = self.0.state.lock().pending.take();
        if let Some(done) = pending {
            done.complete(Ok(()));
        }
        let mut st = self.0.state.lock();
        st.closed = Some(reason);
        self.0.notify(st);
    }
}

/// A receiver per subscriber: the hub's deliveries pulled by the consumer, blocking or async,
/// with the losses of its slow-consumer policy visible where they happened.
///
/// A [`Receiver`] is a hub subscriber like any other: its `max_queue` and slow-consumer policy
/// are the hub's, and so are its `stats()` row and its place in `presence()`. How it gets its
/// messages depends on the policy:
///
/// - **`drop-oldest`** (the default, without `message_priority`): the receiver reads its topic
///   itself, as a `tokio::sync::broadcast` receiver reads its channel. The topic keeps its
///   recent publications in chunks of 64; each receiver keeps a position and holds one chunk,
///   so a receive inside a chunk is two comparisons (the run's end, and the bound against
///   the log's head), a load and a store of its count, with no lock and (with
///   [`try_recv_ref`](Receiver::try_recv_ref)) no reference count. The drain never visits it,
///   `max_batch` does not apply, and [`Hub::flush`](super::Hub::flush) does not wait for it (its
///   queue is its place in the topic). The bound is applied when a receive finds more than
///   `max_queue` waiting: the oldest go, counted, reported as [`RecvError::Lagged`].
/// - **`drop-newest`, `disconnect`, or `message_priority`**: the drain feeds it one batch at a
///   time, by reference (the batch the topic's other subscribers take; nothing is encoded for
///   it), and holds the next batch in the subscriber's queue until the consumer started on the
///   previous one, as a transport that has not completed a send. [`Hub::flush`](super::Hub::flush)
///   does not wait for the consumer: the rest of the queue is taken by its next receives, so a
///   flush on the consumer's own thread returns.
///
/// Either way:
///
/// - **A slow consumer only lags itself.** Nothing the consumer does runs on the hub's drain;
///   while it does not receive, its own queue fills and its own policy applies.
/// - **Losses are seen where they are.** A receive that would pass messages the policy dropped
///   returns [`RecvError::Lagged`] with their count first, then the messages after the gap.
///   Every [`Received`] also carries its [`topic_seq`](Received::topic_seq): consecutive unless
///   something was dropped.
/// - **The end is said.** After `disconnect`, an unsubscribe or the hub's close, the rest is
///   received, then [`RecvError::Closed`] with the reason. The rest is, for a FIFO drop-oldest
///   receiver (the default, which reads its topic itself), everything published before the end
///   within its bound; for the others (drop-newest, disconnect, `message_priority`), after an
///   unsubscribe or the hub's close, what was handed over and then what the subscriber's queue
///   still held (counted in `delivered` as it is taken), then a [`RecvError::Lagged`] for
///   drops no message after them showed (a drop-newest queue full until the end). A
///   `disconnect` ends with what was
///   handed over: the queue is the slow consumer's loss, counted in `stats().dropped`, and the
///   receiver is told by [`RecvError::Closed`] with reason `slow-consumer`, not by a `Lagged`.
/// - **Dropping the receiver unsubscribes.**
///
/// The async side needs no particular runtime: [`Receiver::recv_async`] is a future woken by
/// the hub through the task's `Waker`, and `Receiver` is a [`futures_core::Stream`].
///
/// ```
/// use powerhub::hub::{Hub, HubOptions, Message, PublishOptions, RecvError, SubscribeOptions};
/// use powerhub::plugin::CloseReason;
/// use powerhub::transport::SpySink;
///
/// let hub = Hub::new(SpySink::new(), HubOptions::default())?;
/// // A queue of two messages (drop-oldest).
/// let mut rx = hub.receiver("prices", SubscribeOptions::default().max_queue(2))?;
/// let publish = |px: u32| {
///     let m = Message::json(format!("{{\"px\":{px}}}")).unwrap();
///     hub.publish("prices", m, PublishOptions::default())
/// };
/// publish(0)?;
/// assert_eq!(rx.recv()?.topic_seq(), 0);
/// for px in 1..5 {
///     publish(px)?; // the queue keeps the newest two: 1 and 2 are dropped
/// }
/// assert_eq!(rx.recv().unwrap_err(), RecvError::Lagged { missed: 2 });
/// assert_eq!(rx.recv()?.topic_seq(), 3);
/// assert_eq!(rx.recv()?.topic_seq(), 4);
/// hub.close();
/// assert_eq!(rx.recv().unwrap_err(), RecvError::Closed { reason: CloseReason::HubClosed });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Made by [`Hub::receiver`](super::Hub::receiver).
#[derive(Debug)]
pub struct Receiver {
    sub: Subscription,
    mode: Mode,
}

/// How the receiver gets its messages.
#[derive(Debug)]
enum Mode {
    /// FIFO drop-oldest (the default): from the topic's direct log, without the drain.
    Direct(DirectRx),
    /// Every other policy: batches handed over by the drain.
    HandOff(HandOffRx),
}

/// A receiver reading its topic's direct log.
struct DirectRx {
    reader: DirectReader,
    sub: Arc<Sub>,
    /// Messages received, stored in the cursor at each receive (for the hub's `delivered`).
    received: u64,
    /// The async registration still pending, if any (its epoch and waker).
    registered: Option<(u64, Waker)>,
}

impl std::fmt::Debug for DirectRx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectRx")
            .field("received", &self.received)
            .finish_non_exhaustive()
    }
}

/// The direct receiver's transport in the hub: nothing is ever sent to it (it is never
/// drained); its close records the end.
struct DirectEnd(Arc<DirectCursor>);

impl std::fmt::Debug for DirectEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectEnd").finish_non_exhaustive()
    }
}

impl Sink for DirectEnd {
    fn send(&self, _sub: &SubscriberRef, _frame: Frame, _done: Completion) -> SendOutcome {
        SendOutcome::Accepted
    }

    fn close(&self, _sub: &SubscriberRef, reason: CloseReason) {
        self.0.close(reason);
    }
}

impl DirectRx {
    /// Counts a receive where `stats()` reads it: a plain store to the receiver's own cursor
    /// (no read-modify-write, nothing another thread writes), so that `delivered` is exact
    /// after every receive.
    #[inline(always)]
    fn count_receive(&mut self) {
        self.received += 1;
        self.reader
            .cursor
            .received
            .store(self.received, Ordering::Relaxed);
    }

    fn try_next(&mut self) -> Result<(), TryRecvError> {
        match self.reader.next() {
            Next::Message => {
                self.count_receive();
                Ok(())
            }
            Next::Lagged(missed) => Err(TryRecvError::Lagged { missed }),
            Next::Empty => Err(TryRecvError::Empty),
            Next::Closed(reason) => Err(TryRecvError::Closed { reason }),
        }
    }
}

impl Drop for DirectRx {
    fn drop(&mut self) {
        // The subscription is gone by now (the `Subscription` drops first, and its removal
        // counted what the cursor said): what was received since is counted here.
        let cursor = &self.reader.cursor;
        cursor.received.store(self.received, Ordering::Relaxed);
        if !self.sub.closed.load(Ordering::Acquire) {
            return;
        }
        // A removal on another thread (an unsubscribe by id, the hub's close) sets `closed`
        // first: its end, its fold and its listing among the ended receivers come before ours.
        cursor.wait_removed();
        {
            let _moving = cursor.gate.moving();
            // What its bound dropped and it never received is dropped now (counted once:
            // `stats()` counted it as beyond the bound until here), from its exact position.
            self.reader.sync_cursor();
            cursor.take_overflow();
            self.sub.fold_direct(cursor);
        }
        self.sub.forget_ended(cursor);
    }
}

/// A receiver fed batches by the drain.
struct HandOffRx {
    chan: Arc<Chan>,
    /// The subscriber, kept while the receiver lives (the handle keeps only a weak reference):
    /// once the hub let it go, the receiver still takes the rest of its queue and its drop
    /// count from it.
    _sub: Arc<Sub>,
    /// What the consumer was told about losses.
    seen: Seen,
    /// The batch being received, and the index of its next message.
    local: Option<Handed>,
    pos: usize,
    /// The last receive could not take its next batch itself (the drain lock was taken): a
    /// wait looks again after [`FEED_RETRY`].
    busy: bool,
}

impl std::fmt::Debug for HandOffRx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandOffRx")
            .field("chan", &self.chan)
            .field("seen", &self.seen)
            .field("pos", &self.pos)
            .finish_non_exhaustive()
    }
}

/// How soon a receive that found the drain lock taken looks again.
const FEED_RETRY: Duration = Duration::from_millis(1);

impl Receiver {
    pub(super) fn subscribe(
        hub: &super::Hub,
        topic: &str,
        options: super::SubscribeOptions,
    ) -> Result<Receiver, super::SubscribeError> {
        if hub.reads_directly(&options) {
            let cursor = DirectCursor::new(options.max_queue, hub.stats_gate());
            let options = options.sink(Arc::new(DirectEnd(Arc::clone(&cursor))));
            let (sub, subscriber) =
                hub.subscribe_consumer(topic, Consumer::Direct(Arc::clone(&cursor)), options)?;
            let direct = DirectRx {
                reader: DirectReader::new(cursor),
                sub: subscriber,
                received: 0,
                registered: None,
            };
            return Ok(Receiver {
                sub,
                mode: Mode::Direct(direct),
            });
        }
        let chan = Arc::new(Chan {
            state: Mutex::new(State::default()),
            ready: Condvar::new(),
            policy: options.slow_consumer,
            sub: OnceLock::new(),
        });
        let options = options.sink(Arc::new(HandOff(Arc::clone(&chan))));
        let end: Arc<dyn HandOffEnd> = Arc::clone(&chan) as _;
        let (sub, subscriber) = hub.subscribe_consumer(topic, Consumer::Batch(end), options)?;
        let _ = chan.sub.set(Arc::downgrade(&subscriber));
        let start = subscriber.start.load(std::sync::atomic::Ordering::Relaxed);
        Ok(Receiver {
            sub,
            mode: Mode::HandOff(HandOffRx {
                chan,
                _sub: subscriber,
                seen: Seen {
                    start,
                    ..Seen::default()
                },
                local: None,
                pos: 0,
                busy: false,
            }),
        })
    }

    /// The subscription (its id, topic, whether it is active).
    pub fn subscription(&self) -> &Subscription {
        &self.sub
    }

    /// The next message, or why there is none now, without waiting.
    ///
    /// # Errors
    ///
    /// [`TryRecvError::Empty`] when nothing waits; [`TryRecvError::Lagged`] once for messages
    /// the policy dropped; [`TryRecvError::Closed`] after the last message of a closed
    /// subscription.
    #[inline]
    pub fn try_recv(&mut self) -> Result<Received, TryRecvError> {
        if let Mode::Direct(d) = &mut self.mode {
            if let Some(slot) = d.reader.next_owned_in_run() {
                d.count_receive();
                return Ok(Received { held: slot });
            }
        }
        self.try_recv_slow()
    }

    /// [`try_recv`](Receiver::try_recv) outside a run: kept out of line so that the fast path
    /// inlines into the caller's loop.
    #[inline(never)]
    fn try_recv_slow(&mut self) -> Result<Received, TryRecvError> {
        self.try_next()?;
        Ok(self.received())
    }

    /// [`try_recv`](Receiver::try_recv) without taking a reference to the message: the
    /// delivery borrows the receiver until the next receive. The cheapest way to consume (no
    /// atomic operation per message); [`Delivery::message`] clones it when it must be kept.
    ///
    /// ```
    /// use powerhub::hub::{Hub, HubOptions, SubscribeOptions};
    /// use powerhub::transport::SpySink;
    ///
    /// let hub = Hub::new(SpySink::new(), HubOptions::default())?;
    /// let mut rx = hub.receiver("t", SubscribeOptions::default())?;
    /// hub.publish_json("t", &7)?;
    /// let d = rx.try_recv_ref()?;
    /// assert_eq!((&d.message().bytes()[..], d.topic_seq(), d.topic()), (&b"7"[..], 0, "t"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`try_recv`](Receiver::try_recv).
    #[inline]
    pub fn try_recv_ref(&mut self) -> Result<Delivery<'_>, TryRecvError> {
        if matches!(&self.mode, Mode::Direct(d) if d.reader.in_run()) {
            let subscriber = &self.sub.sref;
            let Mode::Direct(d) = &mut self.mode else {
                unreachable!("matched above")
            };
            // Counted first: the delivery borrows the reader.
            d.count_receive();
            let e = d.reader.next_in_run().expect("inside a run");
            return Ok(Delivery::of(subscriber, e));
        }
        self.try_recv_ref_slow()
    }

    /// [`try_recv_ref`](Receiver::try_recv_ref) outside a run (see
    /// [`try_recv_slow`](Receiver::try_recv_slow)).
    #[inline(never)]
    fn try_recv_ref_slow(&mut self) -> Result<Delivery<'_>, TryRecvError> {
        self.try_next()?;
        Ok(self.delivery())
    }

    /// The next message, waiting for it.
    ///
    /// # Errors
    ///
    /// [`RecvError::Lagged`] once for messages the policy dropped; [`RecvError::Closed`] after
    /// the last message of a closed subscription.
    pub fn recv(&mut self) -> Result<Received, RecvError> {
        self.recv_until(None).map_err(no_deadline)?;
        Ok(self.received())
    }

    /// [`recv`](Receiver::recv), borrowing the message as
    /// [`try_recv_ref`](Receiver::try_recv_ref) does.
    ///
    /// # Errors
    ///
    /// As [`recv`](Receiver::recv).
    pub fn recv_ref(&mut self) -> Result<Delivery<'_>, RecvError> {
        self.recv_until(None).map_err(no_deadline)?;
        Ok(self.delivery())
    }

    /// The next message, waiting at most `timeout` (one too long for the clock to hold, such
    /// as `Duration::MAX`, waits as [`recv`](Receiver::recv) does).
    ///
    /// # Errors
    ///
    /// As [`Receiver::recv`], and [`RecvTimeoutError::Timeout`].
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Received, RecvTimeoutError> {
        self.recv_until(Instant::now().checked_add(timeout))?;
        Ok(self.received())
    }

    /// The next message, as a future woken by the hub (any executor, or none: it only needs
    /// the task's `Waker`).
    pub fn recv_async(&mut self) -> RecvFuture<'_> {
        RecvFuture { rx: self }
    }

    /// The message the last successful receive took.
    fn entry(&self) -> &Entry {
        match &self.mode {
            Mode::Direct(d) => d.reader.current(),
            Mode::HandOff(h) => h.current(),
        }
    }

    fn received(&mut self) -> Received {
        match &mut self.mode {
            Mode::Direct(d) => Received {
                held: d.reader.current_owned(),
            },
            Mode::HandOff(h) => Received::of(h.current()),
        }
    }

    fn delivery(&self) -> Delivery<'_> {
        Delivery::of(&self.sub.sref, self.entry())
    }

    fn try_next(&mut self) -> Result<(), TryRecvError> {
        let next = match &mut self.mode {
            Mode::Direct(d) => d.try_next(),
            Mode::HandOff(h) => h.try_next(),
        };
        if matches!(next, Err(TryRecvError::Empty | TryRecvError::Closed { .. })) {
            // Nothing to receive (the caller may wait next): what this thread's drops held
            // back reaches its chunk (see `Received`).
            flush_returns();
        }
        next
    }

    fn recv_until(&mut self, deadline: Option<Instant>) -> Result<(), RecvTimeoutError> {
        loop {
            match self.try_next() {
                Err(TryRecvError::Empty) => {}
                other => return map_timeout(other),
            }
            let in_time = match &self.mode {
                Mode::Direct(d) => d.reader.log().wait_until(|| d.reader.ready(), deadline),
                Mode::HandOff(h) => h.wait_until(deadline),
            };
            if !in_time {
                return match self.try_next() {
                    Err(TryRecvError::Empty) => Err(RecvTimeoutError::Timeout),
                    other => map_timeout(other),
                };
            }
        }
    }

    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Received, RecvError>> {
        loop {
            match self.try_next() {
                Ok(()) => return Poll::Ready(Ok(self.received())),
                Err(TryRecvError::Lagged { missed }) => {
                    return Poll::Ready(Err(RecvError::Lagged { missed }))
                }
                Err(TryRecvError::Closed { reason }) => {
                    return Poll::Ready(Err(RecvError::Closed { reason }))
                }
                Err(TryRecvError::Empty) => {}
            }
            let pending = match &mut self.mode {
                Mode::Direct(d) => {
                    let reader = &d.reader;
                    match reader
                        .log()
                        .register(cx.waker(), d.registered.as_ref(), || reader.ready())
                    {
                        Some(epoch) => {
                            d.registered = Some((epoch, cx.waker().clone()));
                            true
                        }
                        None => false,
                    }
                }
                Mode::HandOff(h) => {
                    let mut st = h.chan.state.lock();
                    let idle = !st.has_news();
                    if idle {
                        st.waker = Some(cx.waker().clone());
                        if h.busy {
                            // It could not take its next batch itself: polled again soon.
                            cx.waker().wake_by_ref();
                        }
                    }
                    idle
                }
            };
            if pending {
                return Poll::Pending;
            }
        }
    }
}

impl HandOffRx {
    /// The message the last successful receive took.
    fn current(&self) -> &Arc<Entry> {
        let handed = self
            .local
            .as_ref()
            .expect("a message was taken from the batch");
        &handed.entries[self.pos - 1]
    }

    /// The next message of the local batch (its index), a loss to report before it, or `None`
    /// once the batch is done. No lock.
    ///
    /// A loss is reported where it is: before the next message when its topic number skips the
    /// dropped ones and the drop count agrees (a gap can also be a publication from before the
    /// subscription).
    fn next_local(&mut self) -> Option<Result<(), TryRecvError>> {
        let handed = self.local.as_ref()?;
        let e = handed.entries.get(self.pos)?;
        let seen = &mut self.seen;
        let unreported = handed.dropped_before.saturating_sub(seen.reported);
        let gap = match seen.last {
            Some(last) => e.topic_seq.saturating_sub(last + 1),
            // Nothing received yet: the publications between the first the subscription could
            // be offered and this one. (A batch's drop count is read when it is handed over, so
            // it may count drops of publications after the batch: they are reported at their
            // gap, not before the batch.)
            None => e.topic_seq.saturating_sub(seen.start),
        };
        let missed = gap.min(unreported);
        if missed > 0 {
            seen.reported += missed;
            seen.last = Some(e.topic_seq.saturating_sub(1));
            return Some(Err(TryRecvError::Lagged { missed }));
        }
        let n = e.topic_seq;
        seen.last = Some(seen.last.map_or(n, |last| last.max(n)));
        self.pos += 1;
        Some(Ok(()))
    }

    /// The next message (taken into the local batch), or why there is none now.
    ///
    /// Once the local batch is done, the next handed-over batch becomes local; when that
    /// empties the hand-off, the hub's held send is completed (outside the lock), which hands
    /// the subscriber's next batch over while the consumer works through this one. With
    /// nothing handed over, losses after the last message received (as under `drop-newest`) are
    /// reported once the hub holds nothing more for the receiver. With nothing handed over and
    /// messages in the subscriber's queue, the receiver takes its next batch itself
    /// (`Chan::feed`, if the drain lock is free); after the end, the rest of the queue
    /// (`Chan::take_rest`), after the batches handed over. The subscriber's queue length is
    /// read with the hand-off locked: the hub never takes the hand-off's lock while it holds a
    /// queue's (it pops a batch, lets go of the queue, then sends), so the order hand-off →
    /// queue cannot deadlock.
    fn try_next(&mut self) -> Result<(), TryRecvError> {
        self.busy = false;
        loop {
            if let Some(r) = self.next_local() {
                return r;
            }
            self.local = None;
            let chan = Arc::clone(&self.chan);
            let mut st = chan.state.lock();
            if let Some(handed) = st.batches.pop_front() {
                self.local = Some(handed);
                self.pos = 0;
                let pending = if st.batches.is_empty() {
                    st.pending.take()
                } else {
                    None
                };
                drop(st);
                if let Some(done) = pending {
                    done.complete(Ok(()));
                }
                continue;
            }
            if let Some(done) = st.pending.take() {
                // Nothing handed over but a batch held: let it come (the hub hands it over
                // inside `complete`), then look again.
                drop(st);
                done.complete(Ok(()));
                continue;
            }
            if st.closed.is_none() {
                // The rest of the queue, pulled: the drain may not come (`batch(false)`, a
                // manual driver) or come later.
                drop(st);
                match chan.feed() {
                    Feed::Handed => continue,
                    Feed::Busy => self.busy = true,
                    Feed::Nothing => {}
                }
                st = chan.state.lock();
                if !st.batches.is_empty() || st.pending.is_some() {
                    continue;
                }
            }
            let dropped = chan.dropped();
            if dropped > self.seen.reported && st.closed.is_none() {
                match chan.held() {
                    (0, false) => {
                        let missed = dropped - self.seen.reported;
                        self.seen.reported = dropped;
                        if chan.policy == SlowConsumer::DropNewest {
                            // Nothing is queued or on its way: every publication after the last
                            // one received was refused, so these are the next `missed` numbers.
                            // The next message's gap is said now, not again before it.
                            if let Some(last) = self.seen.last.as_mut() {
                                *last += missed;
                            }
                        }
                        return Err(TryRecvError::Lagged { missed });
                    }
                    (0, true) => {
                        // The drainer is handing a batch over: the drops may come after it.
                        // Its visit is short (a pop and a hand-over); look again after it.
                        drop(st);
                        std::thread::yield_now();
                        continue;
                    }
                    _ => {}
                }
            }
            let Some(reason) = st.closed else {
                return Err(TryRecvError::Empty);
            };
            // Ended: the batches handed over, then the rest of the queue (an unsubscribe or the
            // hub's close keep it for the receiver), then the end. The rest is taken under the
            // drain lock, so every batch a drainer popped before is in the hand-off ahead of it.
            drop(st);
            match chan.take_rest() {
                Feed::Handed => continue,
                Feed::Nothing => {
                    // Drops no message after them showed (a drop-newest queue full until the
                    // end), said before the end as they would have been before it. A
                    // `disconnect` subscriber's discarded queue is what `SlowConsumer` says.
                    let dropped = chan.dropped();
                    if dropped > self.seen.reported && chan.policy != SlowConsumer::Disconnect {
                        let missed = dropped - self.seen.reported;
                        self.seen.reported = dropped;
                        return Err(TryRecvError::Lagged { missed });
                    }
                    return Err(TryRecvError::Closed { reason });
                }
                Feed::Busy => {
                    std::thread::yield_now();
                    continue;
                }
            }
        }
    }

    /// Waits until something was handed over or the end; `false` on the deadline.
    fn wait_until(&self, deadline: Option<Instant>) -> bool {
        let mut st = self.chan.state.lock();
        // Anything that arrived since `try_next` let go of the lock is looked at first.
        if st.has_news() {
            return true;
        }
        if self.busy {
            // The last receive found the drain lock taken and could not take its next batch
            // itself: look again shortly, whether or not that drain hands it over.
            let retry = Instant::now() + FEED_RETRY;
            let until = deadline.map_or(retry, |d| d.min(retry));
            let _ = self.chan.ready.wait_until(&mut st, until);
            return deadline.is_none_or(|d| Instant::now() < d);
        }
        match deadline {
            None => {
                self.chan.ready.wait(&mut st);
                true
            }
            Some(d) => !self.chan.ready.wait_until(&mut st, d).timed_out(),
        }
    }
}

/// What the receiver already told its consumer about losses.
#[derive(Debug, Default)]
struct Seen {
    /// Drops reported in `Lagged` so far.
    reported: u64,
    /// The topic number of the last message received.
    last: Option<u64>,
    /// The topic number of the first publication the subscription could be offered.
    start: u64,
}

fn map_timeout(r: Result<(), TryRecvError>) -> Result<(), RecvTimeoutError> {
    match r {
        Ok(()) => Ok(()),
        Err(TryRecvError::Lagged { missed }) => Err(RecvTimeoutError::Lagged { missed }),
        Err(TryRecvError::Closed { reason }) => Err(RecvTimeoutError::Closed { reason }),
        Err(TryRecvError::Empty) => Err(RecvTimeoutError::Timeout),
    }
}

/// A receive with no deadline cannot time out.
fn no_deadline(e: RecvTimeoutError) -> RecvError {
    match e {
        RecvTimeoutError::Lagged { missed } => RecvError::Lagged { missed },
        RecvTimeoutError::Closed { reason } => RecvError::Closed { reason },
        RecvTimeoutError::Timeout => unreachable!("no deadline"),
    }
}

/// The future of [`Receiver::recv_async`].
#[derive(Debug)]
#[must_use = "a future does nothing unless polled"]
pub struct RecvFuture<'a> {
    rx: &'a mut Receiver,
}

impl Future for RecvFuture<'_> {
    type Output = Result<Received, RecvError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.rx.poll_recv(cx)
    }
}

/// Messages and lags until the subscription closes: `Some(Ok(message))`,
/// `Some(Err(RecvError::Lagged { .. }))`, and `None` once closed (the reason is lost: use
/// [`Receiver::recv_async`] to see it).
impl futures_core::Stream for Receiver {
    type Item = Result<Received, RecvError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.poll_recv(cx) {
            Poll::Ready(Err(RecvError::Closed { .. })) => Poll::Ready(None),
            Poll::Ready(other) => Poll::Ready(Some(other)),
            Poll::Pending => Poll::Pending,
        }
    }
}
