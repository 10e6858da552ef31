//! Hub, subscribe and publish options, their validation, and their config-file form.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use powerhub_plugin::{Sink, SubscriberRef};
use serde::Deserialize;

use super::error::{DeliveryError, OptionsError, SubscribeError};
use super::stats::TurnMetrics;

/// Largest accepted `batch_delay`: a window longer than this is a misconfiguration.
pub const MAX_BATCH_DELAY: Duration = Duration::from_secs(60);
/// Largest accepted `max_queue` per subscriber.
pub const MAX_QUEUE_LIMIT: usize = 1 << 20;
/// Largest accepted `max_batch` per subscriber.
pub const MAX_BATCH_LIMIT: usize = 1 << 16;
/// Messages kept per topic by `retain`.
pub const RETAINED_PER_TOPIC: usize = 32;

/// How outgoing batches are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    /// A binary frame whose payload is a JSON array of the batch (see
    /// [`powerhub_plugin::frame`]).
    #[default]
    Json,
    /// A binary frame carrying exactly one message's bytes; subscribers must use `max_batch: 1`.
    Raw,
    /// The batch's JSON messages, each followed by `\n`, with no frame header: the push server's
    /// wire form.
    Ndjson,
}

impl Codec {
    /// The option value's name: `json`, `raw` or `ndjson`.
    pub fn as_str(self) -> &'static str {
        match self {
            Codec::Json => "json",
            Codec::Raw => "raw",
            Codec::Ndjson => "ndjson",
        }
    }
}

/// What a subscriber's full queue does with the next message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SlowConsumer {
    /// Discard the oldest queued message (under `message_priority`: the lowest-priority, newest
    /// one) to make room. With nothing queued (`max_queue: 0`) the incoming one is dropped.
    #[default]
    DropOldest,
    /// Refuse the incoming message and keep what is queued.
    DropNewest,
    /// Close the subscriber with reason `slow-consumer`.
    Disconnect,
}

/// Who drives the hub's turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Driver {
    /// The hub owns one drain thread, woken by `publish`. One turn is everything published
    /// before the thread next drains; `batch_delay` widens it. Without a `batch_delay`, the
    /// thread woken from idle by a publication first waits for publications to pause for 5 µs
    /// (at most 20 µs, spinning), so that a burst published in one go is one batch (best
    /// effort: a publisher preempted in the middle of its burst may still see it split).
    #[default]
    Thread,
    /// No thread: the owner calls [`Hub::poll_timeout`](super::Hub::poll_timeout) and
    /// [`Hub::turn`](super::Hub::turn) with its own clock (a shard, or a test's virtual clock).
    Manual,
}

/// The error hook: every delivery error, with the subscriber it concerns when there is one.
pub type ErrorHook = Arc<dyn Fn(&DeliveryError, Option<&SubscriberRef>) + Send + Sync>;
/// The metrics hook: called after every turn that sent or dropped something.
pub type MetricsHook = Arc<dyn Fn(&TurnMetrics) + Send + Sync>;
/// The `bytes_acknowledged` callback: the subscriber's cumulative `bytes_sent`, after each send
/// the transport took.
pub type BytesAcknowledged = Arc<dyn Fn(u64, &SubscriberRef) + Send + Sync>;
/// The work hook of a [`Driver::Manual`] hub: called when work arrives while none was pending.
pub type WorkHook = Arc<dyn Fn() + Send + Sync>;

/// Options of a [`Hub`](super::Hub).
///
/// ```
/// use std::time::Duration;
/// use powerhub::hub::{Codec, HubOptions};
///
/// let opts = HubOptions::default().batch_delay(Duration::from_millis(5)).codec(Codec::Json);
/// assert!(opts.validate().is_ok());
/// ```
#[derive(Clone)]
pub struct HubOptions {
    pub(crate) batch: bool,
    pub(crate) batch_delay: Duration,
    pub(crate) codec: Codec,
    pub(crate) message_priority: bool,
    pub(crate) on_error: Option<ErrorHook>,
    pub(crate) metrics: Option<MetricsHook>,
    pub(crate) driver: Driver,
    pub(crate) on_work: Option<WorkHook>,
    pub(crate) inline_handlers: bool,
}

impl Default for HubOptions {
    fn default() -> Self {
        HubOptions {
            batch: true,
            batch_delay: Duration::ZERO,
            codec: Codec::Json,
            message_priority: false,
            on_error: None,
            metrics: None,
            driver: Driver::Thread,
            on_work: None,
            inline_handlers: false,
        }
    }
}

impl fmt::Debug for HubOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubOptions")
            .field("batch", &self.batch)
            .field("batch_delay", &self.batch_delay)
            .field("codec", &self.codec)
            .field("message_priority", &self.message_priority)
            .field("on_error", &self.on_error.is_some())
            .field("metrics", &self.metrics.is_some())
            .field("driver", &self.driver)
            .field("on_work", &self.on_work.is_some())
            .field("inline_handlers", &self.inline_handlers)
            .finish()
    }
}

impl HubOptions {
    /// Coalesce what is published in one turn into one frame per subscriber batch (default
    /// `true`). With `false` only [`Hub::flush`](super::Hub::flush) sends.
    pub fn batch(mut self, batch: bool) -> Self {
        self.batch = batch;
        self
    }

    /// Widen the coalescing window: a turn that finds new work sends it `batch_delay` later
    /// (default zero: at once). At most [`MAX_BATCH_DELAY`].
    pub fn batch_delay(mut self, delay: Duration) -> Self {
        self.batch_delay = delay;
        self
    }

    /// Default codec of outgoing frames (`json`).
    pub fn codec(mut self, codec: Codec) -> Self {
        self.codec = codec;
        self
    }

    /// Under [`Driver::Thread`]: run handlers on the drain thread itself, as the subscriber's
    /// batch is sent (default `false`: they run on the hub's handler pool, where a handler that
    /// blocks delays only its own subscriber). Inline is faster (no hand-over per batch: about
    /// 1.6× the deliveries per second with 10 000 subscribers in the perf tool's in-process
    /// scenario) but a handler that blocks then delays every subscriber of the hub; choose it
    /// only for handlers that never block. Under [`Driver::Manual`] handlers run in the
    /// owner's [`Hub::turn`](super::Hub::turn). In both cases (inline or manual), the handler
    /// of a batch whose send the transport held (`SendOutcome::Pending`) runs on the thread
    /// that completes the send.
    pub fn inline_handlers(mut self, on: bool) -> Self {
        self.inline_handlers = on;
        self
    }

    /// Order each subscriber's queue by the `priority` given to `publish` (default `false`).
    pub fn message_priority(mut self, on: bool) -> Self {
        self.message_priority = on;
        self
    }

    /// The error hook. Without one, errors are logged with `tracing` at `warn`.
    pub fn on_error(
        mut self,
        hook: impl Fn(&DeliveryError, Option<&SubscriberRef>) + Send + Sync + 'static,
    ) -> Self {
        self.on_error = Some(Arc::new(hook));
        self
    }

    /// The metrics hook, called with a [`TurnMetrics`] after each turn that did something.
    #[doc(alias = "observability")]
    pub fn metrics(mut self, hook: impl Fn(&TurnMetrics) + Send + Sync + 'static) -> Self {
        self.metrics = Some(Arc::new(hook));
        self
    }

    /// Who drives the turns (default [`Driver::Thread`]).
    pub fn driver(mut self, driver: Driver) -> Self {
        self.driver = driver;
        self
    }

    /// Under [`Driver::Manual`]: called, on the publishing (or completing) thread, when work
    /// arrives while the hub had none pending — a publish, or a completion that leaves a
    /// subscriber with queued messages. The owner schedules a [`Hub::turn`](super::Hub::turn)
    /// from it (an event loop wakes itself), so nothing polls an idle hub. The hook must not
    /// call back into the hub. Ignored under [`Driver::Thread`].
    ///
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::sync::Arc;
    /// use std::time::Instant;
    /// use powerhub::hub::{Driver, Hub, HubOptions, SubscribeOptions};
    /// use powerhub::transport::SpySink;
    ///
    /// let wakes = Arc::new(AtomicUsize::new(0));
    /// let w = Arc::clone(&wakes);
    /// let opts = HubOptions::default()
    ///     .driver(Driver::Manual)
    ///     .on_work(move || { w.fetch_add(1, Ordering::Relaxed); });
    /// let spy = SpySink::new();
    /// let hub = Hub::new(spy.clone(), opts)?;
    /// let _sub = hub.subscribe("t", |_| {}, SubscribeOptions::default())?;
    /// hub.publish_json("t", &1)?;
    /// hub.publish_json("t", &2)?; // already pending: no second wake-up
    /// assert_eq!(wakes.load(Ordering::Relaxed), 1);
    /// hub.turn(Instant::now());
    /// assert_eq!(spy.frames().len(), 1);
    /// # Ok::<(), powerhub::hub::HubError>(())
    /// ```
    pub fn on_work(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_work = Some(Arc::new(hook));
        self
    }

    /// Checks every option; the error names the first invalid one.
    pub fn validate(&self) -> Result<(), OptionsError> {
        if self.batch_delay > MAX_BATCH_DELAY {
            return Err(OptionsError::invalid(
                "batch_delay",
                format!(
                    "{:?} exceeds the maximum {:?}",
                    self.batch_delay, MAX_BATCH_DELAY
                ),
            ));
        }
        Ok(())
    }

    /// Options from their config-file form (hooks are code, so they are set afterwards).
    pub fn from_config(config: &HubConfig) -> Result<Self, OptionsError> {
        let ms = config.batch_delay_ms;
        if !ms.is_finite() || ms < 0.0 {
            return Err(OptionsError::invalid(
                "batch_delay_ms",
                format!("{ms} is not a finite, non-negative number of milliseconds"),
            ));
        }
        if ms > MAX_BATCH_DELAY.as_millis() as f64 {
            return Err(OptionsError::invalid(
                "batch_delay_ms",
                format!("{ms} exceeds the maximum {}", MAX_BATCH_DELAY.as_millis()),
            ));
        }
        let opts = HubOptions::default()
            .batch(config.batch)
            .batch_delay(Duration::from_secs_f64(ms / 1000.0))
            .codec(config.codec)
            .message_priority(config.message_priority);
        opts.validate()?;
        Ok(opts)
    }
}

/// The config-file form of [`HubOptions`]; unknown fields are an error that names them.
///
/// ```
/// use powerhub::hub::{HubConfig, HubOptions};
///
/// let cfg: HubConfig = serde_json::from_str(r#"{"batch_delay_ms": 2, "codec": "ndjson"}"#).unwrap();
/// assert!(HubOptions::from_config(&cfg).is_ok());
/// let err = serde_json::from_str::<HubConfig>(r#"{"batchdelay": 2}"#).unwrap_err();
/// assert!(err.to_string().contains("unknown field `batchdelay`"));
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct HubConfig {
    /// See [`HubOptions::batch`].
    pub batch: bool,
    /// See [`HubOptions::batch_delay`], in milliseconds; negative and NaN are rejected.
    pub batch_delay_ms: f64,
    /// See [`HubOptions::codec`].
    pub codec: Codec,
    /// See [`HubOptions::message_priority`].
    pub message_priority: bool,
}

impl Default for HubConfig {
    fn default() -> Self {
        HubConfig {
            batch: true,
            batch_delay_ms: 0.0,
            codec: Codec::Json,
            message_priority: false,
        }
    }
}

/// Options of one subscription.
///
/// ```
/// use powerhub::hub::{SlowConsumer, SubscribeOptions};
///
/// let opts = SubscribeOptions::default().max_queue(128).slow_consumer(SlowConsumer::Disconnect).id("client-42");
/// # let _ = opts;
/// ```
#[derive(Clone)]
pub struct SubscribeOptions {
    pub(crate) max_queue: usize,
    pub(crate) slow_consumer: SlowConsumer,
    pub(crate) max_batch: usize,
    pub(crate) id: Option<Arc<str>>,
    pub(crate) transport: Option<Arc<dyn Any + Send + Sync>>,
    pub(crate) priority: i32,
    pub(crate) bytes_acknowledged: Option<BytesAcknowledged>,
    pub(crate) sink: Option<Arc<dyn Sink>>,
    pub(crate) codec: Option<Codec>,
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        SubscribeOptions {
            max_queue: 64,
            slow_consumer: SlowConsumer::DropOldest,
            max_batch: 32,
            id: None,
            transport: None,
            priority: 0,
            bytes_acknowledged: None,
            sink: None,
            codec: None,
        }
    }
}

impl fmt::Debug for SubscribeOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SubscribeOptions")
            .field("max_queue", &self.max_queue)
            .field("slow_consumer", &self.slow_consumer)
            .field("max_batch", &self.max_batch)
            .field("id", &self.id)
            .field("transport", &self.transport.is_some())
            .field("priority", &self.priority)
            .field("bytes_acknowledged", &self.bytes_acknowledged.is_some())
            .field("sink", &self.sink)
            .field("codec", &self.codec)
            .finish()
    }
}

impl SubscribeOptions {
    /// Queue capacity in messages (default 64; 0 means no buffering, see the spec).
    pub fn max_queue(mut self, n: usize) -> Self {
        self.max_queue = n;
        self
    }

    /// What a full queue does (default [`SlowConsumer::DropOldest`]).
    pub fn slow_consumer(mut self, policy: SlowConsumer) -> Self {
        self.slow_consumer = policy;
        self
    }

    /// Most messages per frame (default 32, at least 1).
    pub fn max_batch(mut self, n: usize) -> Self {
        self.max_batch = n;
        self
    }

    /// The subscriber's unique id (default: generated, `sub-N`).
    pub fn id(mut self, id: impl Into<Arc<str>>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Opaque transport context handed to the sink in [`SubscriberRef`].
    pub fn transport(mut self, context: Arc<dyn Any + Send + Sync>) -> Self {
        self.transport = Some(context);
        self
    }

    /// Drain order: higher first, ties by subscription order (default 0).
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// Called with the subscriber's cumulative `bytes_sent` each time its transport takes a
    /// frame.
    pub fn bytes_acknowledged(
        mut self,
        callback: impl Fn(u64, &SubscriberRef) + Send + Sync + 'static,
    ) -> Self {
        self.bytes_acknowledged = Some(Arc::new(callback));
        self
    }

    /// A transport for this subscription only, instead of the hub's.
    pub fn sink(mut self, sink: Arc<dyn Sink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// A codec for this subscription only, instead of the hub's.
    pub fn codec(mut self, codec: Codec) -> Self {
        self.codec = Some(codec);
        self
    }

    /// Applies the config-file form of the numeric options.
    pub fn with_config(mut self, config: &SubscribeConfig) -> Self {
        self.max_queue = config.max_queue;
        self.slow_consumer = config.slow_consumer;
        self.max_batch = config.max_batch;
        self.priority = config.priority;
        if let Some(codec) = config.codec {
            self.codec = Some(codec);
        }
        self
    }

    /// Checks the options; `frames`: the subscriber is sent encoded frames (a receiver is not,
    /// so the raw codec does not bound its batches).
    pub(crate) fn validate(&self, hub_codec: Codec, frames: bool) -> Result<(), SubscribeError> {
        if self.max_queue > MAX_QUEUE_LIMIT {
            return Err(SubscribeError::invalid(
                "max_queue",
                format!("{} exceeds the limit {MAX_QUEUE_LIMIT}", self.max_queue),
            ));
        }
        if self.max_batch == 0 {
            return Err(SubscribeError::invalid("max_batch", "must be at least 1"));
        }
        if self.max_batch > MAX_BATCH_LIMIT {
            return Err(SubscribeError::invalid(
                "max_batch",
                format!("{} exceeds the limit {MAX_BATCH_LIMIT}", self.max_batch),
            ));
        }
        if let Some(id) = &self.id {
            if id.is_empty() {
                return Err(SubscribeError::invalid("id", "must not be empty"));
            }
        }
        if frames && self.codec.unwrap_or(hub_codec) == Codec::Raw && self.max_batch != 1 {
            return Err(SubscribeError::RawNeedsMaxBatchOne {
                max_batch: self.max_batch,
            });
        }
        Ok(())
    }
}

/// The config-file form of the numeric [`SubscribeOptions`]; unknown fields are an error.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct SubscribeConfig {
    /// See [`SubscribeOptions::max_queue`].
    pub max_queue: usize,
    /// See [`SubscribeOptions::slow_consumer`].
    pub slow_consumer: SlowConsumer,
    /// See [`SubscribeOptions::max_batch`].
    pub max_batch: usize,
    /// See [`SubscribeOptions::priority`].
    pub priority: i32,
    /// See [`SubscribeOptions::codec`].
    pub codec: Option<Codec>,
}

impl Default for SubscribeConfig {
    fn default() -> Self {
        SubscribeConfig {
            max_queue: 64,
            slow_consumer: SlowConsumer::DropOldest,
            max_batch: 32,
            priority: 0,
            codec: None,
        }
    }
}

/// Options of one publication.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PublishOptions {
    pub(crate) retain: bool,
    pub(crate) priority: Option<i32>,
}

impl PublishOptions {
    /// Keep the message in the topic's retained log (last 32) for later subscribers.
    pub fn retain(mut self, retain: bool) -> Self {
        self.retain = retain;
        self
    }

    /// Order the message within each subscriber's queue (higher first); requires the hub's
    /// `message_priority`.
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = Some(priority);
        self
    }
}
