//! The hub: topics, subscribers, slow-consumer policies, batches, retained log, priorities, stats.
//!
//! Every subscription has its own bounded queue and a declared [`SlowConsumer`] policy, so one
//! slow consumer is a bounded, observable, per-subscriber problem. What is published in one turn
//! is sent as one frame per subscriber batch (up to `max_batch` messages), and **one frame is
//! encoded per (batch, codec)** and shared by reference (`Bytes`) by every subscriber that
//! receives that batch: [`Stats::encoded`] stays at one per flush whatever the subscriber count.
//!
//! # Threads and turns
//!
//! [`Hub::publish`] is callable from any thread; it appends a reference-counted message once to
//! the topic's log, which every FIFO drop-oldest subscriber (the default) reads through its own
//! cursor, and pushes it into the queue of every other subscriber (a lock-free ring, or under
//! `message_priority` a small mutexed ordered map); it wakes the drainer once and never waits on
//! a subscriber. The drainer runs *turns*: each
//! turn visits the subscribers with queued work, highest [`SubscribeOptions::priority`] first,
//! pops up to `max_batch` messages, encodes (or reuses) the frame and hands it to the
//! subscriber's [`Sink`]. With [`Driver::Thread`] (default) the hub owns one drain thread; with
//! [`Driver::Manual`] the owner drives it with [`Hub::poll_timeout`] and [`Hub::turn`], passing
//! its own clock, and learns of new work through [`HubOptions::on_work`] (the engine runs its
//! hub this way, on a shard's event loop).
//!
//! A subscriber has at most one send outstanding: while a sink's [`SendOutcome::Pending`]
//! (see [`powerhub_plugin::SendOutcome`]) is not completed, the subscriber is skipped and its
//! queue absorbs new messages under its policy. Its handler runs for each message of a batch
//! after the transport took the batch.
//!
//! # Where code runs
//!
//! - **Handlers** ([`Hub::subscribe`]), under [`Driver::Thread`]: on the hub's handler pool,
//!   never on the drain. The subscriber stays in flight until its handler ran for the batch, so
//!   one subscriber's handler runs for one batch at a time, in order, while the handlers of
//!   other subscribers run on other workers: **a handler that blocks delays only its own
//!   subscriber** (whose queue fills under its own policy), as a slow `tokio::sync::broadcast`
//!   receiver lags only itself. The pool keeps a standby that takes over once a job waited
//!   1 ms behind busy workers. [`HubOptions::inline_handlers`] runs them on the drain thread
//!   instead (faster; a blocking handler then delays everyone). Under [`Driver::Manual`] they
//!   run in the owner's [`Hub::turn`] or [`Hub::flush`]. Without a pool (inline or manual), a
//!   batch whose send the transport held ([`SendOutcome::Pending`]) has its handler run by the
//!   thread that completes that send. A handler run outside the drain (on the pool, or by the
//!   completing thread) is not run once its subscriber or the hub is closed (the drain checks
//!   at each subscriber's visit), and a [`Hub::flush`] or [`Hub::shutdown`] from inside any
//!   handler returns [`FlushError::InsideDrain`].
//! - **Receivers** ([`Hub::receiver`]): the consumer's own thread or task; nothing of the
//!   consumer runs in the hub.
//! - **The sink** and the `bytes_acknowledged` callback: on the draining thread (or the thread
//!   that completes a pending send); they must not block.
//!
//! Handlers, sinks and hooks may publish, subscribe and unsubscribe, but must not call
//! [`Hub::flush`], [`Hub::turn`] or [`Hub::shutdown`], which would wait for the delivery they
//! run in ([`FlushError::InsideDrain`]).
//!
//! # Examples
//!
//! ```
//! use powerhub::hub::{Hub, HubOptions, Message, PublishOptions, SubscribeOptions};
//! use powerhub::transport::SpySink;
//!
//! let spy = SpySink::new();
//! let hub = Hub::new(spy.clone(), HubOptions::default())?;
//! let _sub = hub.subscribe("t", |_d| {}, SubscribeOptions::default().id("client-1"))?;
//! for i in 0..5 {
//!     hub.publish("t", Message::to_json(&i)?, PublishOptions::default())?;
//! }
//! hub.flush()?;
//! let frames = spy.frames();
//! let all: Vec<u8> = frames.iter().flat_map(|f| {
//!     let f = powerhub_plugin::frame::decode(&f.frame).unwrap();
//!     f.json_messages().unwrap().concat()
//! }).collect();
//! assert_eq!(all, b"01234");
//! assert_eq!(hub.stats().delivered, 5);
//! hub.shutdown()?;
//! # Ok::<(), powerhub::hub::HubError>(())
//! ```
//!
//! [`Sink`]: powerhub_plugin::Sink
//! [`SendOutcome::Pending`]: powerhub_plugin::SendOutcome::Pending

mod core;
mod direct;
pub(crate) use self::core::{Entry, Tap, TapMember};
mod error;
mod handlers;
mod message;
mod options;
mod publisher;
mod queue;
mod receiver;
mod sealed;
pub(crate) use self::sealed::SealedBatch;
mod slots;
mod stats;
mod task;

use std::sync::{Arc, Weak};
use std::time::Instant;

use powerhub_plugin::{CloseReason, Sink};
use serde::Serialize;

use self::core::{Consumer, Inner, Sub};
pub(crate) use self::error::panic_message;
pub use self::error::{
    DeliveryError, FlushError, HubError, MessageError, OptionsError, PublishError, SubscribeError,
};
pub use self::message::{Delivery, Message};
pub use self::options::{
    BytesAcknowledged, Codec, Driver, ErrorHook, HubConfig, HubOptions, MetricsHook,
    PublishOptions, SlowConsumer, SubscribeConfig, SubscribeOptions, WorkHook, MAX_BATCH_DELAY,
    MAX_BATCH_LIMIT, MAX_QUEUE_LIMIT, RETAINED_PER_TOPIC,
};
pub use self::publisher::Publisher;
pub use self::receiver::{
    Received, Receiver, RecvError, RecvFuture, RecvTimeoutError, TryRecvError,
};
pub use self::stats::{Presence, Stats, SubscriberStats, TurnMetrics};
pub use self::task::HubTask;
pub use powerhub_plugin::SubscriberRef;

/// Closes the hub when the last [`Hub`] clone is dropped.
struct Owner {
    inner: Arc<Inner>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.inner.close();
    }
}

/// A topic fan-out hub. Cheap to clone; every clone is the same hub; dropping the last clone
/// closes it (not gracefully: see [`Hub::close`]). A handler that captures a clone keeps the hub
/// alive until [`Hub::close`] detaches it.
///
/// # Examples
///
/// Driving the hub by hand on a virtual clock, as a runtime shard (or a test) does:
///
/// ```
/// use std::time::{Duration, Instant};
/// use powerhub::hub::{Driver, Hub, HubOptions, Message, PublishOptions, SlowConsumer, SubscribeOptions};
/// use powerhub::transport::SpySink;
///
/// let spy = SpySink::new();
/// let opts = HubOptions::default().driver(Driver::Manual).batch_delay(Duration::from_millis(10));
/// let hub = Hub::new(spy.clone(), opts)?;
/// let sub = hub.subscribe(
///     "trades",
///     |d| println!("{} got {:?}", d.subscriber().id(), d.message().bytes()),
///     SubscribeOptions::default().id("client-42").max_queue(128).slow_consumer(SlowConsumer::DropOldest),
/// )?;
/// assert_eq!(hub.publish("trades", Message::json(r#"{"px":1}"#)?, PublishOptions::default())?, 1);
///
/// let t0 = Instant::now();
/// hub.turn(t0); // opens the batch window
/// assert!(spy.frames().is_empty());
/// hub.turn(hub.poll_timeout().unwrap()); // the window closes: one frame
/// assert_eq!(spy.frames().len(), 1);
/// assert_eq!(hub.stats().encoded, 1);
/// assert!(sub.unsubscribe());
/// # Ok::<(), powerhub::hub::HubError>(())
/// ```
#[derive(Clone)]
pub struct Hub {
    owner: Arc<Owner>,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("closed", &self.is_closed())
            .finish_non_exhaustive()
    }
}

impl Hub {
    /// See [`core::Inner::attach_tap`].
    pub(crate) fn attach_tap(&self, topic: &str, tap: Arc<dyn core::Tap>) -> bool {
        self.owner.inner.attach_tap(topic, tap)
    }

    /// See [`core::Inner::detach_tap`].
    pub(crate) fn detach_tap(&self, topic: &str, tap: &Arc<dyn core::Tap>) {
        self.owner.inner.detach_tap(topic, tap)
    }

    /// See [`core::Inner::count_tapped`].
    pub(crate) fn count_tapped(&self, delivered: u64, encoded: u64) {
        self.owner.inner.count_tapped(delivered, encoded)
    }

    /// See [`core::Inner::count_tap_disconnect`].
    pub(crate) fn count_tap_disconnect(&self) {
        self.owner.inner.count_tap_disconnect()
    }

    /// A hub sending through `sink` (any [`Sink`], including an `Arc<dyn Sink>`).
    ///
    /// Fails with an error naming the option when `options` are invalid.
    pub fn new<S: Sink>(sink: S, options: HubOptions) -> Result<Hub, OptionsError> {
        let inner = Inner::new(Arc::new(sink), options)?;
        Ok(Hub {
            owner: Arc::new(Owner { inner }),
        })
    }

    fn inner(&self) -> &Arc<Inner> {
        &self.owner.inner
    }

    /// Whether a receiver with `options` reads its topic directly (FIFO drop-oldest with a
    /// queue), rather than being fed by the drain.
    fn reads_directly(&self, options: &SubscribeOptions) -> bool {
        options.slow_consumer == SlowConsumer::DropOldest
            && options.max_queue > 0
            && !self.inner().message_priority()
    }

    /// The gate a direct receiver holds while its counts move (see `core::StatsGate`).
    fn stats_gate(&self) -> Arc<self::core::StatsGate> {
        self.inner().stats_gate()
    }

    /// Subscribes `consumer`: the handle, and the subscriber (for a receiver, which holds it).
    fn subscribe_consumer(
        &self,
        topic: &str,
        consumer: Consumer,
        options: SubscribeOptions,
    ) -> Result<(Subscription, Arc<Sub>), SubscribeError> {
        let sub = self.inner().subscribe(topic, consumer, options)?;
        let handle = Subscription {
            hub: Arc::downgrade(self.inner()),
            sref: sub.sref.clone(),
            sub: Arc::downgrade(&sub),
            detached: false,
        };
        Ok((handle, sub))
    }

    /// Subscribes `handler` to `topic`. The handler runs for each delivered message after the
    /// transport took its batch, on the hub's handler pool (see the [module docs](self): a
    /// handler that blocks delays only this subscriber). The subscription lasts while the
    /// returned [`Subscription`] is held (or after [`Subscription::detach`]).
    ///
    /// Errors: [`SubscribeError::Closed`] after close, [`SubscribeError::DuplicateId`],
    /// [`SubscribeError::RawNeedsMaxBatchOne`], [`SubscribeError::InvalidOption`]. The retained
    /// log of the topic is replayed into the new subscriber's queue under its policy: under
    /// `disconnect`, a log longer than `max_queue` closes the subscriber during its own
    /// replay (as a slow consumer, counted in `disconnected`), so the subscription returned is
    /// already inactive ([`Subscription::is_active`]) and the rest of the log is not offered.
    /// Where it was the topic's only subscriber, its leaving releases the log, as any last
    /// subscriber's does: the next subscriber finds none.
    pub fn subscribe<F>(
        &self,
        topic: &str,
        handler: F,
        options: SubscribeOptions,
    ) -> Result<Subscription, SubscribeError>
    where
        F: Fn(&Delivery<'_>) + Send + Sync + 'static,
    {
        self.subscribe_consumer(topic, Consumer::Each(Arc::new(handler)), options)
            .map(|(handle, _)| handle)
    }

    /// Subscribes to `topic` with no handler: the subscriber's [`Sink`] (the hub's, or
    /// [`SubscribeOptions::sink`]) is its only consumer, and nothing runs per message after the
    /// transport took a batch. This is how a network transport subscribes its connections.
    /// Errors as [`subscribe`](Hub::subscribe).
    ///
    /// ```
    /// use powerhub::hub::{Driver, Hub, HubOptions, SubscribeOptions};
    /// use powerhub::transport::SpySink;
    ///
    /// let spy = SpySink::new();
    /// let hub = Hub::new(spy.clone(), HubOptions::default().driver(Driver::Manual))?;
    /// let _sub = hub.subscribe_sink("prices", SubscribeOptions::default().id("conn-7"))?;
    /// hub.publish_json("prices", &serde_json::json!({"px": 1}))?;
    /// hub.turn(std::time::Instant::now());
    /// assert_eq!(spy.frames_for("conn-7").len(), 1);
    /// # Ok::<(), powerhub::hub::HubError>(())
    /// ```
    pub fn subscribe_sink(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Subscription, SubscribeError> {
        self.subscribe_consumer(topic, Consumer::Sink, options)
            .map(|(handle, _)| handle)
    }

    /// Subscribes to `topic` with a receiver of its own: the consumer pulls the deliveries
    /// ([`Receiver::recv`], [`try_recv`](Receiver::recv), [`recv_timeout`](Receiver::recv_timeout),
    /// [`recv_async`](Receiver::recv_async), or as a `Stream`), sees what its policy dropped
    /// ([`RecvError::Lagged`]) and why it ended ([`RecvError::Closed`]); a slow consumer lags only
    /// itself. The options' `max_queue`, `max_batch`, `slow_consumer`, `id` and `priority` apply
    /// as to any subscriber; `sink` is replaced by the receiver's own. Dropping the receiver
    /// unsubscribes. Errors as [`subscribe`](Hub::subscribe).
    ///
    /// ```
    /// use powerhub::hub::{Hub, HubOptions, SubscribeOptions};
    /// use powerhub::transport::SpySink;
    ///
    /// let hub = Hub::new(SpySink::new(), HubOptions::default())?;
    /// let mut rx = hub.receiver("prices", SubscribeOptions::default())?;
    /// hub.publish_json("prices", &serde_json::json!({"px": 1}))?;
    /// let m = rx.recv_timeout(std::time::Duration::from_secs(5))?;
    /// assert_eq!(&m.message().bytes()[..], br#"{"px":1}"#);
    /// assert_eq!(m.topic_seq(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn receiver(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Receiver, SubscribeError> {
        Receiver::subscribe(self, topic, options)
    }

    /// Publishes `message` to `topic`; returns how many subscribers queued it.
    ///
    /// Never blocks on a subscriber. After [`close`](Hub::close) it returns `Ok(0)`. A
    /// `priority` without the hub's `message_priority` is
    /// [`PublishError::PriorityWithoutMessagePriority`].
    pub fn publish(
        &self,
        topic: &str,
        message: Message,
        options: PublishOptions,
    ) -> Result<usize, PublishError> {
        self.inner().publish(topic, message, options)
    }

    /// Publishes `messages` to `topic` in order with default options, as that many
    /// [`publish`](Hub::publish) calls one after another would, at one lookup of the topic
    /// (see `Inner::publish_run`). Empties `messages`; returns what each message reached.
    pub(crate) fn publish_run(&self, topic: &str, messages: &mut Vec<Message>) -> usize {
        self.inner().publish_run(topic, messages)
    }

    /// A handle that publishes to `topic` ([`Publisher::publish`]), as
    /// [`publish`](Hub::publish) does, with the topic looked up once: what a service that
    /// publishes to a few topics over and over keeps, as a channel's sender (making one and
    /// dropping one take the topics write lock). A publish through it that is neither retained
    /// nor prioritized, to a topic whose only consumers are [`receiver`](Hub::receiver)s that
    /// read the topic directly (FIFO drop-oldest with a queue, on a hub without
    /// `message_priority`), takes no hub-wide lock.
    ///
    /// ```
    /// use powerhub::hub::{Hub, HubOptions, SubscribeOptions};
    /// use powerhub::transport::SpySink;
    ///
    /// let hub = Hub::new(SpySink::new(), HubOptions::default())?;
    /// let mut rx = hub.receiver("ticks", SubscribeOptions::default())?;
    /// let ticks = hub.publisher("ticks");
    /// ticks.publish_json(&1)?;
    /// assert_eq!(&rx.try_recv()?.message().bytes()[..], b"1");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn publisher(&self, topic: &str) -> Publisher {
        Publisher::new(self.inner(), topic)
    }

    /// Serializes `value` as JSON and publishes it with default options; a value that cannot be
    /// serialized is [`PublishError::Message`].
    pub fn publish_json<T: Serialize + ?Sized>(
        &self,
        topic: &str,
        value: &T,
    ) -> Result<usize, PublishError> {
        self.publish(topic, Message::to_json(value)?, PublishOptions::default())
    }

    /// Drains every queue now, bypassing batching, and returns once every queue reached its
    /// transport, waiting for sends in flight (including ones that were outstanding before).
    /// What it covers is what was published before it was called (by any thread whose publish
    /// returned before, such as threads joined before it); publications during the flush may
    /// go out with it or after it.
    ///
    /// Delivery errors isolated on the way (a failing sink, a panicking handler or
    /// `bytes_acknowledged` callback, a message the codec cannot frame) do not make it fail:
    /// each was reported to the error hook when it happened, and every queue still reached its
    /// transport, which is what `flush` waits for. It returns [`FlushError::Closed`] on a closed
    /// hub. A transport that never completes a pending send holds `flush` until that subscriber
    /// is unsubscribed or the hub is closed (a waiting flush then returns
    /// [`FlushError::Closed`]); [`flush_timeout`](Hub::flush_timeout) bounds the wait. Called
    /// from a handler, sink or hook inside the drain it returns [`FlushError::InsideDrain`]
    /// instead of deadlocking.
    ///
    /// A [`Receiver`] is pulled by its consumer: `flush` does not wait for it to receive. A
    /// drop-oldest receiver's queue is its place in the topic; any other receiver is handed its
    /// next batch, and the rest of its queue waits for its next receives. So a flush on the
    /// consumer's own thread returns.
    pub fn flush(&self) -> Result<(), FlushError> {
        self.inner().flush(None)
    }

    /// [`flush`](Hub::flush), waiting at most `timeout` for sends in flight and for another
    /// thread's drain pass (an inline handler or a sink that blocks): past it
    /// [`FlushError::Timeout`] (what was handed to transports stays with them; nothing is
    /// lost or cancelled). A timeout too long for the clock to hold (`Duration::MAX`) waits
    /// as [`flush`](Hub::flush) does.
    pub fn flush_timeout(&self, timeout: std::time::Duration) -> Result<(), FlushError> {
        self.inner().flush(Instant::now().checked_add(timeout))
    }

    /// [`flush`](Hub::flush) as a future for async callers, on any executor (it needs none): the
    /// flush runs on a thread of its own, since it may wait for transports, and the future
    /// resolves with its result. Combine it with the executor's timer to bound it, or use
    /// [`flush_timeout`](Hub::flush_timeout) inside.
    ///
    /// ```
    /// use powerhub::hub::{Hub, HubOptions, SubscribeOptions};
    /// use powerhub::transport::SpySink;
    ///
    /// let spy = SpySink::new();
    /// let hub = Hub::new(spy.clone(), HubOptions::default().batch(false))?;
    /// let _s = hub.subscribe_sink("t", SubscribeOptions::default().id("a"))?;
    /// hub.publish_json("t", &serde_json::json!({"n": 1}))?;
    /// let rt = tokio::runtime::Builder::new_current_thread().build()?;
    /// rt.block_on(hub.flush_async())?;
    /// assert_eq!(spy.frames_for("a").len(), 1);
    /// rt.block_on(hub.shutdown_async())?;
    /// assert!(hub.is_closed());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn flush_async(&self) -> HubTask {
        HubTask::spawn(Arc::clone(self.inner()), |inner| inner.flush(None))
    }

    /// [`shutdown`](Hub::shutdown) as a future, as [`flush_async`](Hub::flush_async).
    ///
    /// Unlike [`flush_async`](Hub::flush_async), the task holds a [`Hub`] handle until the hub is
    /// closed: the shutdown stays graceful (flush, then close) even if the caller drops its
    /// handles meanwhile.
    pub fn shutdown_async(&self) -> HubTask {
        let hub = self.clone();
        HubTask::spawn(Arc::clone(self.inner()), move |_| hub.shutdown())
    }

    /// Unsubscribes the subscriber `id`; `false` if there is none. Its close adapter is called
    /// with reason `unsubscribe`.
    pub fn unsubscribe(&self, id: &str) -> bool {
        self.inner().unsubscribe_id(id)
    }

    /// A snapshot of the counters and of every subscriber.
    pub fn stats(&self) -> Stats {
        self.inner().stats()
    }

    /// The live subscribers, optionally only those of `topic`: an owned snapshot.
    ///
    /// ```
    /// use powerhub::hub::{Hub, HubOptions, SubscribeOptions};
    /// use powerhub::transport::SpySink;
    ///
    /// let hub = Hub::new(SpySink::new(), HubOptions::default())?;
    /// hub.subscribe_sink("t", SubscribeOptions::default().id("a"))?.detach();
    /// hub.subscribe_sink("u", SubscribeOptions::default().id("b"))?.detach();
    /// let ids = |p: Vec<powerhub::hub::Presence>| p.into_iter().map(|p| p.id).collect::<Vec<_>>();
    /// assert_eq!(ids(hub.presence(None)), ["a", "b"]);
    /// assert_eq!(ids(hub.presence(Some("u"))), ["b"]);
    /// assert_eq!(ids(hub.get_presence(Some("t"))), ["a"]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[doc(alias = "getPresence")]
    pub fn presence(&self, topic: Option<&str>) -> Vec<Presence> {
        self.inner().presence(topic)
    }

    /// [`presence`](Hub::presence) under the spec's other name (`getPresence(topic?)`).
    pub fn get_presence(&self, topic: Option<&str>) -> Vec<Presence> {
        self.presence(topic)
    }

    /// Under [`Driver::Manual`]: when the next [`turn`](Hub::turn) has work. `None` when there is
    /// nothing to do (or `batch` is off). An instant at or before now means "turn now".
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.inner().poll_timeout()
    }

    /// Under [`Driver::Manual`]: runs a turn at `now`. A turn that finds new work opens the
    /// `batch_delay` window at `now`; the batch goes out at the first turn at or after
    /// `now + batch_delay` (at once when the delay is zero). Does nothing when `batch` is off.
    pub fn turn(&self, now: Instant) {
        self.inner().turn(now)
    }

    /// Closes the hub, not gracefully: pending batches are dropped, every subscriber is
    /// detached and its close adapter called with reason `hub-closed`, retained logs are
    /// released. Idempotent: when several threads close the hub at once, each call returns
    /// once every close adapter was told (a call from inside that teardown, such as a close
    /// adapter or handler that closes the hub again, returns at once). So a thread must not
    /// call `close` while it holds something a close adapter waits for.
    #[doc(alias = "dispose")]
    pub fn close(&self) {
        self.inner().close()
    }

    /// Flushes, then closes, even when the flush fails (the hub was closed meanwhile, or it is
    /// called inside the drain); returns the flush's result. It waits for the transports as
    /// [`flush`](Hub::flush) does: with one that never completes a send, use
    /// [`shutdown_timeout`](Hub::shutdown_timeout).
    #[doc(alias = "asyncDispose")]
    pub fn shutdown(&self) -> Result<(), FlushError> {
        let flushed = self.flush();
        self.close();
        flushed
    }

    /// [`shutdown`](Hub::shutdown) with the flush bounded by `timeout`: the hub is closed by
    /// the time it returns, whatever the transports do; past the timeout the result is
    /// [`FlushError::Timeout`] (sends still in flight are the transports'; the close tells each
    /// subscriber's close adapter). The timeout bounds the flush, not the close: the close
    /// joins the drain thread, which first finishes the handler or send it is in (an inline
    /// handler that blocks holds it that long).
    ///
    /// ```
    /// use std::time::Duration;
    /// use powerhub::hub::{FlushError, Hub, HubOptions, SubscribeOptions};
    /// use powerhub::transport::{SpyMode, SpySink};
    ///
    /// // A transport that holds every send and never completes one.
    /// let spy = SpySink::new();
    /// spy.set_mode(SpyMode::Pending);
    /// let hub = Hub::new(spy, HubOptions::default())?;
    /// let _s = hub.subscribe_sink("t", SubscribeOptions::default().id("stuck"))?;
    /// hub.publish_json("t", &1)?;
    /// let r = hub.shutdown_timeout(Duration::from_millis(50));
    /// assert_eq!(r, Err(FlushError::Timeout));
    /// assert!(hub.is_closed());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shutdown_timeout(&self, timeout: std::time::Duration) -> Result<(), FlushError> {
        let flushed = self.flush_timeout(timeout);
        self.close();
        flushed
    }

    /// Whether the hub is closed.
    pub fn is_closed(&self) -> bool {
        self.inner().is_closed()
    }
}

/// The handle [`Hub::subscribe`] and [`Hub::subscribe_sink`] return: the subscription lasts as
/// long as it is held.
///
/// Dropping it unsubscribes (the close adapter is called with reason `unsubscribe`), as dropping
/// a channel's receiver ends it. [`detach`](Subscription::detach) keeps the subscription without
/// the handle, until [`Hub::unsubscribe`] by id, a `disconnect`, or the hub's close: how a
/// server keeps subscriptions by id.
///
/// ```
/// use powerhub::hub::{Hub, HubOptions, SubscribeOptions};
/// use powerhub::transport::SpySink;
///
/// let hub = Hub::new(SpySink::new(), HubOptions::default())?;
/// let held = hub.subscribe_sink("t", SubscribeOptions::default().id("held"))?;
/// drop(hub.subscribe_sink("t", SubscribeOptions::default().id("dropped"))?);
/// hub.subscribe_sink("t", SubscribeOptions::default().id("kept"))?.detach();
/// let mut ids: Vec<String> = hub.presence(Some("t")).into_iter().map(|p| p.id).collect();
/// ids.sort();
/// assert_eq!(ids, ["held", "kept"]);
/// assert!(hub.unsubscribe("kept"));
/// assert!(held.is_active());
/// # Ok::<(), powerhub::hub::HubError>(())
/// ```
#[must_use = "dropping a Subscription unsubscribes; call `.detach()` to keep it without the handle"]
pub struct Subscription {
    hub: Weak<Inner>,
    /// The subscriber's id and topic (and the transport context it was given), kept by the
    /// handle.
    sref: SubscriberRef,
    /// Not kept alive by the handle: once the hub let the subscriber go (its close, an
    /// unsubscribe by id, a `disconnect`), so does its sink (a channel's sender, whose receiver
    /// then ends), however long the handle is kept.
    sub: Weak<Sub>,
    /// [`Subscription::detach`] was called: the drop leaves the subscription in place.
    detached: bool,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if !self.detached {
            self.unsubscribe();
        }
    }
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("id", &self.id())
            .field("topic", &self.topic())
            .finish()
    }
}

impl Subscription {
    /// The subscriber's id.
    pub fn id(&self) -> &str {
        self.sref.id()
    }

    /// The subscriber's topic.
    pub fn topic(&self) -> &str {
        self.sref.topic()
    }

    /// Whether the subscription is still live.
    pub fn is_active(&self) -> bool {
        self.sub
            .upgrade()
            .is_some_and(|sub| !sub.closed.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Unsubscribes; `false` if it was already gone. Calls the close adapter with reason
    /// `unsubscribe`.
    pub fn unsubscribe(&self) -> bool {
        match (self.hub.upgrade(), self.sub.upgrade()) {
            (Some(inner), Some(sub)) => inner.remove(&sub, CloseReason::Unsubscribe),
            _ => false,
        }
    }

    /// Lets go of the handle and keeps the subscription: it lasts until [`Hub::unsubscribe`]
    /// with its id, a `disconnect`, or the hub's close. Returns the id.
    pub fn detach(mut self) -> String {
        self.detached = true;
        self.id().to_owned()
    }
}
