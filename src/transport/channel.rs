//! The in-process channel transport: the spec's `MessagePort` role.
//!
//! [`channel`] returns a [`ChannelSink`] to give the hub and a [`ChannelReceiver`] that another
//! part of the program consumes, as a blocking [`Iterator`] or as an async
//! [`futures_core::Stream`]. The channel is bounded: when `capacity` events wait unread, a send
//! parks its frame and returns `Pending`; the parked send completes when the consumer catches up,
//! so the hub sees real back-pressure. Parked sends are bounded too: the hub has at most one send
//! outstanding per subscriber.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use powerhub_plugin::{
    CloseReason, Completion, Frame, SendError, SendOutcome, Sink, SubscriberRef,
};

/// What the consumer of a channel receives.
#[derive(Debug, Clone)]
pub enum ChannelEvent {
    /// A frame for a subscriber.
    Frame {
        /// The subscriber.
        subscriber: SubscriberRef,
        /// The shared frame.
        frame: Frame,
    },
    /// The hub closed a subscriber.
    Closed {
        /// The subscriber.
        subscriber: SubscriberRef,
        /// Why.
        reason: CloseReason,
    },
}

#[derive(Debug)]
struct State {
    queue: VecDeque<ChannelEvent>,
    parked: VecDeque<(ChannelEvent, Option<Completion>)>,
    capacity: usize,
    senders: usize,
    receiver_alive: bool,
    waker: Option<Waker>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    ready: Condvar,
}

/// A bounded in-process channel of hub events; `capacity` is at least 1.
///
/// ```
/// use powerhub::hub::{Hub, HubOptions, SubscribeOptions};
/// use powerhub::transport::{channel, ChannelEvent};
///
/// let (sink, rx) = channel(16);
/// let hub = Hub::new(sink, HubOptions::default())?;
/// hub.subscribe("t", |_| {}, SubscribeOptions::default().id("a"))?.detach();
/// hub.publish_json("t", &1)?;
/// hub.flush()?;
/// drop(hub); // closes the hub and lets go of its sink: the iterator ends after the close event
///            // (a `Subscription` handle kept past it would not hold the channel open)
/// let events: Vec<ChannelEvent> = rx.collect();
/// assert!(matches!(events[0], ChannelEvent::Frame { .. }));
/// assert!(matches!(events[1], ChannelEvent::Closed { .. }));
/// # Ok::<(), powerhub::hub::HubError>(())
/// ```
#[doc(alias = "PowerMessagePort")]
pub fn channel(capacity: usize) -> (ChannelSink, ChannelReceiver) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            parked: VecDeque::new(),
            capacity: capacity.max(1),
            senders: 1,
            receiver_alive: true,
            waker: None,
        }),
        ready: Condvar::new(),
    });
    (
        ChannelSink {
            shared: Arc::clone(&shared),
        },
        ChannelReceiver { shared },
    )
}

/// The sending half: a [`Sink`]. Clones share the channel; the receiver ends once every clone is
/// dropped and everything was read.
#[derive(Debug)]
pub struct ChannelSink {
    shared: Arc<Shared>,
}

impl Clone for ChannelSink {
    fn clone(&self) -> Self {
        self.shared.state.lock().senders += 1;
        ChannelSink {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl Drop for ChannelSink {
    fn drop(&mut self) {
        let waker = {
            let mut st = self.shared.state.lock();
            st.senders -= 1;
            if st.senders > 0 {
                return;
            }
            st.waker.take()
        };
        self.shared.ready.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl ChannelSink {
    fn push(&self, event: ChannelEvent, done: Option<Completion>) -> SendOutcome {
        let (waker, outcome, unused) = {
            let mut st = self.shared.state.lock();
            if !st.receiver_alive {
                return SendOutcome::Failed(SendError::Closed);
            }
            if st.queue.len() < st.capacity && st.parked.is_empty() {
                st.queue.push_back(event);
                (st.waker.take(), SendOutcome::Accepted, done)
            } else {
                // Full: park the event; its completion runs when the consumer makes room.
                st.parked.push_back((event, done));
                (None, SendOutcome::Pending, None)
            }
        };
        // The completion of an accepted send is not needed; drop it outside the lock.
        drop(unused);
        if outcome == SendOutcome::Accepted {
            self.shared.ready.notify_one();
            if let Some(w) = waker {
                w.wake();
            }
        }
        outcome
    }
}

impl Sink for ChannelSink {
    fn send(&self, sub: &SubscriberRef, frame: Frame, done: Completion) -> SendOutcome {
        self.push(
            ChannelEvent::Frame {
                subscriber: sub.clone(),
                frame,
            },
            Some(done),
        )
    }

    fn close(&self, sub: &SubscriberRef, reason: CloseReason) {
        let _ = self.push(
            ChannelEvent::Closed {
                subscriber: sub.clone(),
                reason,
            },
            None,
        );
    }
}

/// Why [`ChannelReceiver::try_recv`] returned nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TryRecvError {
    /// Nothing is waiting now.
    #[error("channel is empty")]
    Empty,
    /// Every sender is gone and everything was read.
    #[error("channel is disconnected")]
    Disconnected,
}

/// The receiving half: a blocking [`Iterator`] and an async [`futures_core::Stream`].
#[derive(Debug)]
pub struct ChannelReceiver {
    shared: Arc<Shared>,
}

impl ChannelReceiver {
    /// Pops one event, moving parked sends into the freed room; returns the completions to run.
    fn pop(st: &mut State) -> Option<(ChannelEvent, Vec<Completion>)> {
        let event = st.queue.pop_front()?;
        let mut done = Vec::new();
        while st.queue.len() < st.capacity {
            let Some((ev, c)) = st.parked.pop_front() else {
                break;
            };
            st.queue.push_back(ev);
            done.extend(c);
        }
        Some((event, done))
    }

    fn deliver(popped: (ChannelEvent, Vec<Completion>)) -> ChannelEvent {
        let (event, done) = popped;
        for c in done {
            c.complete(Ok(()));
        }
        event
    }

    /// The next event without waiting.
    pub fn try_recv(&self) -> Result<ChannelEvent, TryRecvError> {
        let mut st = self.shared.state.lock();
        match Self::pop(&mut st) {
            Some(p) => {
                drop(st);
                Ok(Self::deliver(p))
            }
            None if st.senders == 0 => Err(TryRecvError::Disconnected),
            None => Err(TryRecvError::Empty),
        }
    }

    /// The next event, waiting for it; `None` once every sender is gone and all was read.
    pub fn recv(&self) -> Option<ChannelEvent> {
        let mut st = self.shared.state.lock();
        loop {
            if let Some(p) = Self::pop(&mut st) {
                drop(st);
                return Some(Self::deliver(p));
            }
            if st.senders == 0 {
                return None;
            }
            self.shared.ready.wait(&mut st);
        }
    }

    /// The next event, waiting at most `timeout` (one too long for the clock to hold, such as
    /// `Duration::MAX`, waits as [`recv`](Self::recv) does).
    pub fn recv_timeout(&self, timeout: Duration) -> Result<ChannelEvent, TryRecvError> {
        let Some(deadline) = Instant::now().checked_add(timeout) else {
            return self.recv().ok_or(TryRecvError::Disconnected);
        };
        let mut st = self.shared.state.lock();
        loop {
            if let Some(p) = Self::pop(&mut st) {
                drop(st);
                return Ok(Self::deliver(p));
            }
            if st.senders == 0 {
                return Err(TryRecvError::Disconnected);
            }
            if self.shared.ready.wait_until(&mut st, deadline).timed_out() {
                return Err(TryRecvError::Empty);
            }
        }
    }

    /// Events waiting to be read (queued and parked).
    pub fn len(&self) -> usize {
        let st = self.shared.state.lock();
        st.queue.len() + st.parked.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Iterator for ChannelReceiver {
    type Item = ChannelEvent;

    fn next(&mut self) -> Option<ChannelEvent> {
        self.recv()
    }
}

impl futures_core::Stream for ChannelReceiver {
    type Item = ChannelEvent;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<ChannelEvent>> {
        let mut st = self.shared.state.lock();
        if let Some(p) = Self::pop(&mut st) {
            drop(st);
            return Poll::Ready(Some(Self::deliver(p)));
        }
        if st.senders == 0 {
            return Poll::Ready(None);
        }
        st.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for ChannelReceiver {
    fn drop(&mut self) {
        let parked: Vec<_> = {
            let mut st = self.shared.state.lock();
            st.receiver_alive = false;
            st.queue.clear();
            st.parked.drain(..).collect()
        };
        for (_, c) in parked {
            if let Some(c) = c {
                c.complete(Err(SendError::Closed));
            }
        }
    }
}
