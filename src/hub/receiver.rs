//! A receiver per subscriber: see [`Receiver`].

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use powerhub_plugin::{CloseReason, Completion, Frame, SendOutcome, Sink, SubscriberRef};

use super::core::Sub;
use super::{Delivery, Message, SlowConsumer, Subscription};

/// One message a [`Receiver`] received.
#[derive(Debug, Clone)]
pub struct Received {
    message: Message,
    seq: u64,
    topic_seq: u64,
    priority: i32,
}

impl Received {
    /// The message.
    pub fn message(&self) -> &Message {
        &self.message
    }

    /// The message, owned.
    pub fn into_message(self) -> Message {
        self.message
    }

    /// The hub-wide publication number (increasing in publish order across all topics).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The message's number within its topic (see [`Delivery::topic_seq`]): consecutive for a
    /// receiver that lost nothing.
    pub fn topic_seq(&self) -> u64 {
        self.topic_seq
    }

    /// The priority it was published with (0 when none).
    pub fn priority(&self) -> i32 {
        self.priority
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

/// One message handed over, with the subscriber's drop count when it was.
#[derive(Debug)]
struct Item {
    received: Received,
    dropped_before: u64,
}

#[derive(Debug, Default)]
struct State {
    items: VecDeque<Item>,
    /// The hub's send waiting for room (the subscriber's next batch stays in its queue).
    pending: Option<Completion>,
    closed: Option<CloseReason>,
    waker: Option<Waker>,
}

/// What the hub and the receiver share.
struct Chan {
    state: Mutex<State>,
    ready: Condvar,
    /// The subscriber's slow-consumer policy.
    policy: SlowConsumer,
    /// The subscriber, for its drop count (set once subscribed).
    sub: OnceLock<Arc<Sub>>,
}

impl std::fmt::Debug for Chan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chan")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Chan {
    fn dropped(&self) -> u64 {
        self.sub.get().map_or(0, |s| s.dropped_count())
    }

    /// Messages the hub holds in the subscriber's queue.
    fn queued(&self) -> usize {
        self.sub.get().map_or(0, |s| s.queued())
    }

    /// Wakes the consumer (blocked or async); called with the state locked.
    fn notify(&self, st: &mut State) {
        self.ready.notify_one();
        if let Some(w) = st.waker.take() {
            w.wake();
        }
    }

    fn push(&self, d: &Delivery<'_>) {
        let dropped_before = self.dropped();
        let mut st = self.state.lock();
        st.items.push_back(Item {
            received: Received {
                message: d.message().clone(),
                seq: d.seq(),
                topic_seq: d.topic_seq(),
                priority: d.priority(),
            },
            dropped_before,
        });
        self.notify(&mut st);
    }
}

/// The receiver's transport in the hub: takes a batch when the hand-off is empty, else holds the
/// send pending until the consumer emptied it.
#[derive(Debug)]
struct HandOff(Arc<Chan>);

impl Sink for HandOff {
    fn send(&self, _sub: &SubscriberRef, _frame: Frame, done: Completion) -> SendOutcome {
        let mut st = self.0.state.lock();
        if st.closed.is_some() || st.items.is_empty() {
            // The handler (run by the hub once the send is accepted) hands the messages over.
            drop(st);
            drop(done);
            return SendOutcome::Accepted;
        }
        st.pending = Some(done);
        SendOutcome::Pending
    }

    fn close(&self, _sub: &SubscriberRef, reason: CloseReason) {
        let pending = {
            let mut st = self.0.state.lock();
            st.closed = Some(reason);
            self.0.notify(&mut st);
            st.pending.take()
        };
        if let Some(done) = pending {
            done.complete(Ok(()));
        }
    }
}

/// A receiver per subscriber: the hub's deliveries pulled by the consumer, blocking or async,
/// with the losses of its slow-consumer policy visible where they happened.
///
/// A [`Receiver`] is a hub subscriber like any other (its queue, `max_queue`, `max_batch` and
/// slow-consumer policy are the hub's, and so are its `stats()` row and its place in
/// `presence()`), whose transport is a small hand-off: the hub hands it one batch at a time and
/// holds the next one in the subscriber's queue until the consumer took the previous one. So:
///
/// - **A slow consumer only lags itself.** Nothing the consumer does runs on the hub's drain;
///   while it does not receive, its own queue fills and its own policy applies, as a
///   `tokio::sync::broadcast` receiver lags alone.
/// - **Losses are seen where they are.** Under `drop-oldest` and `drop-newest`, a receive that
///   would pass messages the policy dropped returns [`RecvError::Lagged`] with their count first
///   (the subscriber's `dropped` since the last one), then the messages after the gap. Every
///   [`Received`] also carries its [`topic_seq`](Received::topic_seq): consecutive unless
///   something was dropped.
/// - **The end is said.** After `disconnect`, an unsubscribe or the hub's close, the messages
///   already handed over are still received, then [`RecvError::Closed`] with the reason.
/// - **Dropping the receiver unsubscribes.**
/// - A consumer that does not receive holds the hub's next batch for it pending, as a transport
///   that has not completed a send: [`Hub::flush`](super::Hub::flush) waits for it, as for any
///   transport; [`Hub::flush_timeout`](super::Hub::flush_timeout) bounds the wait.
///
/// The async side needs no particular runtime: [`Receiver::recv_async`] is a future woken by
/// the hub through the task's `Waker`, and `Receiver` is a [`futures_core::Stream`].
///
/// ```
/// use std::time::Instant;
/// use powerhub::hub::{Driver, Hub, HubOptions, Message, PublishOptions, RecvError, SubscribeOptions};
/// use powerhub::plugin::CloseReason;
/// use powerhub::transport::SpySink;
///
/// let hub = Hub::new(SpySink::new(), HubOptions::default().driver(Driver::Manual))?;
/// // A queue of two messages, handed over one at a time.
/// let mut rx = hub.receiver("prices", SubscribeOptions::default().max_queue(2).max_batch(1))?;
/// let publish = |px: u32| {
///     let m = Message::json(format!("{{\"px\":{px}}}")).unwrap();
///     hub.publish("prices", m, PublishOptions::default())
/// };
/// publish(0)?;
/// hub.turn(Instant::now()); // 0 is handed over
/// for px in 1..5 {
///     publish(px)?; // the queue keeps the newest two (drop-oldest): 1 and 2 are dropped
/// }
/// hub.turn(Instant::now()); // 3 waits for the consumer, 4 in the queue
/// assert_eq!(rx.recv()?.topic_seq(), 0);
/// assert_eq!(rx.recv().unwrap_err(), RecvError::Lagged { missed: 2 });
/// assert_eq!(rx.recv()?.topic_seq(), 3);
/// hub.turn(Instant::now());
/// assert_eq!(rx.recv()?.topic_seq(), 4);
/// hub.close();
/// assert_eq!(rx.recv().unwrap_err(), RecvError::Closed { reason: CloseReason::HubClosed });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Made by [`Hub::receiver`](super::Hub::receiver).
#[derive(Debug)]
pub struct Receiver {
    chan: Arc<Chan>,
    sub: Subscription,
    /// What the consumer was told about losses.
    seen: Seen,
}

impl Receiver {
    pub(super) fn subscribe(
        hub: &super::Hub,
        topic: &str,
        options: super::SubscribeOptions,
    ) -> Result<Receiver, super::SubscribeError> {
        let chan = Arc::new(Chan {
            state: Mutex::new(State::default()),
            ready: Condvar::new(),
            policy: options.slow_consumer,
            sub: OnceLock::new(),
        });
        let handler_chan = Arc::clone(&chan);
        let options = options.sink(Arc::new(HandOff(Arc::clone(&chan))));
        let sub = hub.subscribe(topic, move |d: &Delivery<'_>| handler_chan.push(d), options)?;
        let _ = chan.sub.set(Arc::clone(&sub.sub));
        Ok(Receiver {
            chan,
            sub,
            seen: Seen::default(),
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
    pub fn try_recv(&mut self) -> Result<Received, TryRecvError> {
        let chan = &self.chan;
        loop {
            let mut st = chan.state.lock();
            let (result, pending) = take(chan, &mut self.seen, &mut st);
            drop(st);
            let Some(done) = pending else {
                return result;
            };
            // The hub's next batch: its handler runs here, on the consumer's thread.
            done.complete(Ok(()));
            if !matches!(result, Err(TryRecvError::Empty)) {
                return result;
            }
        }
    }

    /// The next message, waiting for it.
    ///
    /// # Errors
    ///
    /// [`RecvError::Lagged`] once for messages the policy dropped; [`RecvError::Closed`] after
    /// the last message of a closed subscription.
    pub fn recv(&mut self) -> Result<Received, RecvError> {
        match self.recv_until(None) {
            Ok(m) => Ok(m),
            Err(RecvTimeoutError::Lagged { missed }) => Err(RecvError::Lagged { missed }),
            Err(RecvTimeoutError::Closed { reason }) => Err(RecvError::Closed { reason }),
            Err(RecvTimeoutError::Timeout) => unreachable!("no deadline"),
        }
    }

    /// The next message, waiting at most `timeout`.
    ///
    /// # Errors
    ///
    /// As [`Receiver::recv`], and [`RecvTimeoutError::Timeout`].
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Received, RecvTimeoutError> {
        self.recv_until(Some(Instant::now() + timeout))
    }

    fn recv_until(&mut self, deadline: Option<Instant>) -> Result<Received, RecvTimeoutError> {
        let chan = Arc::clone(&self.chan);
        let mut st = chan.state.lock();
        loop {
            let (result, pending) = take(&chan, &mut self.seen, &mut st);
            if let Some(done) = pending {
                drop(st);
                done.complete(Ok(()));
                if !matches!(result, Err(TryRecvError::Empty)) {
                    return map_timeout(result);
                }
                st = chan.state.lock();
                continue;
            }
            match result {
                Err(TryRecvError::Empty) => {}
                other => return map_timeout(other),
            }
            match deadline {
                None => chan.ready.wait(&mut st),
                Some(d) => {
                    if chan.ready.wait_until(&mut st, d).timed_out() {
                        let (result, pending) = take(&chan, &mut self.seen, &mut st);
                        drop(st);
                        if let Some(done) = pending {
                            done.complete(Ok(()));
                        }
                        return match result {
                            Err(TryRecvError::Empty) => Err(RecvTimeoutError::Timeout),
                            other => map_timeout(other),
                        };
                    }
                }
            }
        }
    }

    /// The next message, as a future woken by the hub (any executor, or none: it only needs
    /// the task's `Waker`).
    pub fn recv_async(&mut self) -> RecvFuture<'_> {
        RecvFuture { rx: self }
    }

    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Received, RecvError>> {
        loop {
            let chan = &self.chan;
            let mut st = chan.state.lock();
            let (result, pending) = take(chan, &mut self.seen, &mut st);
            if matches!(result, Err(TryRecvError::Empty)) && pending.is_none() {
                st.waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
            drop(st);
            if let Some(done) = pending {
                done.complete(Ok(()));
            }
            return Poll::Ready(match result {
                Ok(m) => Ok(m),
                Err(TryRecvError::Lagged { missed }) => Err(RecvError::Lagged { missed }),
                Err(TryRecvError::Closed { reason }) => Err(RecvError::Closed { reason }),
                Err(TryRecvError::Empty) => continue,
            });
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
}

/// What is next, under the lock; and the hub's pending send to complete once unlocked.
///
/// A loss is reported where it is: before the next message when its topic number skips the
/// dropped ones (and the drop count agrees: a gap can also be a publication from before the
/// subscription), or once nothing more is waiting (losses after the last message received, as
/// under `drop-newest`). The subscriber's queue length is read with the hand-off locked: the hub
/// never takes the hand-off's lock while it holds a queue's (it pops a batch, lets go of the
/// queue, then sends), so the order hand-off → queue cannot deadlock.
///
/// The hub's next batch is asked for once the hand-off is empty (one wake-up of the hub per
/// batch, not per message).
fn take(
    chan: &Chan,
    seen: &mut Seen,
    st: &mut State,
) -> (Result<Received, TryRecvError>, Option<Completion>) {
    let result = match st.items.front() {
        Some(item) => {
            let unreported = item.dropped_before.saturating_sub(seen.reported);
            let gap = match seen.last {
                Some(last) => item.received.topic_seq.saturating_sub(last + 1),
                // Nothing received yet: under drop-oldest the drops before the first handed
                // over message were older than it.
                None if chan.policy == SlowConsumer::DropOldest => unreported,
                None => 0,
            };
            let missed = gap.min(unreported);
            if missed > 0 {
                seen.reported += missed;
                seen.last = Some(item.received.topic_seq.saturating_sub(1));
                Err(TryRecvError::Lagged { missed })
            } else {
                let item = st.items.pop_front().expect("checked");
                let n = item.received.topic_seq;
                seen.last = Some(seen.last.map_or(n, |last| last.max(n)));
                Ok(item.received)
            }
        }
        None => {
            let dropped = chan.dropped();
            // Losses behind messages the hub still holds for the receiver are reported after
            // those messages.
            let held = st.pending.is_some() || chan.queued() > 0;
            if dropped > seen.reported && st.closed.is_none() && !held {
                let missed = dropped - seen.reported;
                seen.reported = dropped;
                Err(TryRecvError::Lagged { missed })
            } else {
                match st.closed {
                    Some(reason) => Err(TryRecvError::Closed { reason }),
                    None => Err(TryRecvError::Empty),
                }
            }
        }
    };
    let pending = if st.items.is_empty() {
        st.pending.take()
    } else {
        None
    };
    (result, pending)
}

fn map_timeout(r: Result<Received, TryRecvError>) -> Result<Received, RecvTimeoutError> {
    match r {
        Ok(m) => Ok(m),
        Err(TryRecvError::Lagged { missed }) => Err(RecvTimeoutError::Lagged { missed }),
        Err(TryRecvError::Closed { reason }) => Err(RecvTimeoutError::Closed { reason }),
        Err(TryRecvError::Empty) => Err(RecvTimeoutError::Timeout),
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
