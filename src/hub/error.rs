//! The hub's errors: one enum per operation ([`OptionsError`] for building a hub,
//! [`SubscribeError`], [`PublishError`], [`MessageError`], [`FlushError`]) and one for what is
//! reported asynchronously to the `on_error` hook ([`DeliveryError`]). [`HubError`] is any of
//! them, for callers that propagate several with `?`.

use powerhub_plugin::frame::FrameError;
use powerhub_plugin::SendError;

/// [`HubOptions`](super::HubOptions) the hub cannot honour: from [`Hub::new`](super::Hub::new),
/// [`HubOptions::validate`](super::HubOptions::validate) and
/// [`HubOptions::from_config`](super::HubOptions::from_config).
///
/// ```
/// use std::time::Duration;
/// use powerhub::hub::{Hub, HubOptions, OptionsError};
/// use powerhub::transport::SpySink;
///
/// let err = Hub::new(SpySink::new(), HubOptions::default().batch_delay(Duration::from_secs(61)))
///     .unwrap_err();
/// assert!(matches!(err, OptionsError::Invalid { option: "batch_delay", .. }));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OptionsError {
    /// An option has a value the hub cannot honour; `option` is its name.
    #[error("invalid option `{option}`: {reason}")]
    Invalid {
        /// The option's name, e.g. `batch_delay`.
        option: &'static str,
        /// What is wrong with the value.
        reason: String,
    },
    /// The drain thread ([`Driver::Thread`](super::Driver::Thread)) could not be started.
    #[error("cannot start the hub's drain thread: {0}")]
    Spawn(String),
}

/// Why [`Hub::subscribe`](super::Hub::subscribe) (and `subscribe_sink`, `receiver`) refused.
///
/// ```
/// use powerhub::hub::{Hub, HubOptions, SubscribeError, SubscribeOptions};
/// use powerhub::transport::SpySink;
///
/// let hub = Hub::new(SpySink::new(), HubOptions::default())?;
/// let _a = hub.subscribe_sink("t", SubscribeOptions::default().id("a"))?;
/// let err = hub.subscribe_sink("t", SubscribeOptions::default().id("a")).unwrap_err();
/// assert_eq!(err, SubscribeError::DuplicateId("a".into()));
/// hub.close();
/// assert_eq!(hub.subscribe_sink("t", SubscribeOptions::default()).unwrap_err(), SubscribeError::Closed);
/// # Ok::<(), powerhub::hub::HubError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubscribeError {
    /// The hub is closed.
    #[error("the hub is closed")]
    Closed,
    /// A subscriber id that is already in use.
    #[error("duplicate subscriber `id`: {0:?} is already subscribed")]
    DuplicateId(String),
    /// A subscriber that is sent frames under the `raw` codec asked for batches of more than
    /// one message (a [`Receiver`](super::Receiver) takes messages, not frames: it is not held
    /// to this).
    #[error(
        "`codec: raw` delivers one message per frame, so a subscriber must use `max_batch: 1` \
         (got `max_batch: {max_batch}`)"
    )]
    RawNeedsMaxBatchOne {
        /// The `max_batch` the subscriber asked for.
        max_batch: usize,
    },
    /// A [`SubscribeOptions`](super::SubscribeOptions) value the hub cannot honour.
    #[error("invalid option `{option}`: {reason}")]
    InvalidOption {
        /// The option's name, e.g. `max_batch`.
        option: &'static str,
        /// What is wrong with the value.
        reason: String,
    },
}

/// Why [`Hub::publish`](super::Hub::publish) (or `publish_json`) refused. Publishing to a closed
/// hub is not an error: it reaches no subscriber and returns `Ok(0)`, as the spec says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// A `priority` on a hub without `message_priority`.
    #[error(
        "`priority` on publish requires the hub option `message_priority: true`; without it the \
         ordering would be silently ignored"
    )]
    PriorityWithoutMessagePriority,
    /// `publish_json` could not serialize the value.
    #[error(transparent)]
    Message(#[from] MessageError),
}

/// Why a [`Message`](super::Message) could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// Text given as JSON is not valid JSON.
    #[error("message is not valid JSON: {0}")]
    InvalidJson(String),
    /// A value could not be serialized as JSON.
    #[error("cannot serialize the message as JSON: {0}")]
    Serialize(String),
}

/// Why [`Hub::flush`](super::Hub::flush) (`flush_timeout`, `flush_async`, `shutdown`) did not
/// confirm that every queue reached its transport.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FlushError {
    /// The hub is closed (before the flush, or while it waited).
    #[error("the hub is closed")]
    Closed,
    /// [`Hub::flush_timeout`](super::Hub::flush_timeout): a send in flight did not complete in
    /// time. What was handed to transports stays with them.
    #[error("flush timed out waiting for a transport to complete a send")]
    Timeout,
    /// Called from a handler, sink or hook running inside the hub's drain, where it would wait
    /// for itself.
    #[error(
        "`flush()` called from inside the hub's drain (a handler, sink or hook); it would wait \
         for itself"
    )]
    InsideDrain,
    /// [`Hub::flush_async`](super::Hub::flush_async) could not start the thread it runs on.
    #[error("cannot start the thread that runs the flush: {0}")]
    Spawn(String),
}

/// A delivery failure, isolated to its subscriber and passed to the
/// [`on_error`](super::HubOptions::on_error) hook; never returned by a call. Each names the
/// subscriber (or codec) involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeliveryError {
    /// Messages could not be encoded and were dropped (counted in `dropped`): the binary
    /// messages of a batch under `json` or `ndjson` (the batch's other messages are sent), or
    /// a batch the codec refuses whole.
    #[error("cannot encode a batch of {messages} message(s) with codec `{codec}`: {reason}")]
    Encode {
        /// The codec in use.
        codec: &'static str,
        /// Messages dropped.
        messages: usize,
        /// Why.
        reason: String,
    },
    /// The frame format refused the batch (too large); its messages were dropped.
    #[error("frame: {0}")]
    Frame(#[from] FrameError),
    /// The transport failed a send for this subscriber.
    #[error("send to subscriber {id:?} failed: {error}")]
    SendFailed {
        /// The subscriber's id.
        id: String,
        /// The transport's error.
        error: SendError,
    },
    /// The transport panicked inside `send` or `close`; the panic was caught and isolated.
    #[error("transport panicked while sending to subscriber {id:?}: {message}")]
    SinkPanicked {
        /// The subscriber's id.
        id: String,
        /// The panic message.
        message: String,
    },
    /// A subscriber's handler panicked; the panic was caught and isolated.
    #[error("handler of subscriber {id:?} panicked: {message}")]
    HandlerPanicked {
        /// The subscriber's id.
        id: String,
        /// The panic message.
        message: String,
    },
    /// A subscriber's `bytes_acknowledged` callback panicked; delivery was not affected.
    #[error("`bytes_acknowledged` callback of subscriber {id:?} panicked: {message}")]
    AckCallbackPanicked {
        /// The subscriber's id.
        id: String,
        /// The panic message.
        message: String,
    },
}

/// Any hub error: what each operation's own error converts into, for code that propagates
/// several with `?`. Match the operation's error type where the cause matters.
///
/// ```
/// use powerhub::hub::{Hub, HubError, HubOptions, SubscribeOptions};
/// use powerhub::transport::SpySink;
///
/// fn run() -> Result<(), HubError> {
///     let hub = Hub::new(SpySink::new(), HubOptions::default())?; // OptionsError
///     let _s = hub.subscribe_sink("t", SubscribeOptions::default())?; // SubscribeError
///     hub.publish_json("t", &1)?; // PublishError
///     hub.shutdown()?; // FlushError
///     Ok(())
/// }
/// run()?;
/// # Ok::<(), HubError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    /// Building the hub.
    #[error(transparent)]
    Options(#[from] OptionsError),
    /// Subscribing.
    #[error(transparent)]
    Subscribe(#[from] SubscribeError),
    /// Publishing.
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// Making a message.
    #[error(transparent)]
    Message(#[from] MessageError),
    /// Flushing or shutting down.
    #[error(transparent)]
    Flush(#[from] FlushError),
    /// A delivery failure.
    #[error(transparent)]
    Delivery(#[from] DeliveryError),
}

impl SubscribeError {
    pub(crate) fn invalid(option: &'static str, reason: impl Into<String>) -> Self {
        SubscribeError::InvalidOption {
            option,
            reason: reason.into(),
        }
    }
}

impl OptionsError {
    pub(crate) fn invalid(option: &'static str, reason: impl Into<String>) -> Self {
        OptionsError::Invalid {
            option,
            reason: reason.into(),
        }
    }
}

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
