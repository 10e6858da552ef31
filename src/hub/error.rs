//! The hub's error type.

use powerhub_plugin::frame::FrameError;
use powerhub_plugin::SendError;

/// Everything the hub reports: invalid options and calls (returned), and delivery failures
/// (passed to the `on_error` hook). Each variant names the option, limit or subscriber involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    /// [`Hub::flush_timeout`](super::Hub::flush_timeout): a send in flight did not complete
    /// in time.
    #[error("flush timed out waiting for a transport to complete a send")]
    FlushTimeout,
    /// An option has a value the hub cannot honour; `option` is its name.
    #[error("invalid option `{option}`: {reason}")]
    InvalidOption {
        /// The option's name, e.g. `max_batch`.
        option: &'static str,
        /// What is wrong with the value.
        reason: String,
    },
    /// A subscriber under the `raw` codec asked for batches of more than one message.
    #[error(
        "`codec: raw` delivers one message per frame, so a subscriber must use `max_batch: 1` \
         (got `max_batch: {max_batch}`)"
    )]
    RawNeedsMaxBatchOne {
        /// The `max_batch` the subscriber asked for.
        max_batch: usize,
    },
    /// A subscriber id that is already in use.
    #[error("duplicate subscriber `id`: {0:?} is already subscribed")]
    DuplicateId(String),
    /// `publish` was given a `priority` on a hub without `message_priority`.
    #[error(
        "`priority` on publish requires the hub option `message_priority: true`; without it the \
         ordering would be silently ignored"
    )]
    PriorityWithoutMessagePriority,
    /// The hub is closed: `subscribe` and `flush` fail after `close()`.
    #[error("the hub is closed")]
    Closed,
    /// A message given as JSON is not valid JSON.
    #[error("message is not valid JSON: {0}")]
    InvalidJson(String),
    /// A batch could not be encoded; its messages were dropped (counted in `dropped`).
    #[error("cannot encode a batch of {messages} message(s) with codec `{codec}`: {reason}")]
    Encode {
        /// The codec in use.
        codec: &'static str,
        /// Messages in the dropped batch.
        messages: usize,
        /// Why.
        reason: String,
    },
    /// The frame format refused the batch (too large).
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
    /// The transport panicked inside `send`; the panic was caught and isolated.
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
    /// `flush()` was called from a handler, sink or hook running inside the hub's drain, where
    /// it would wait for itself.
    #[error(
        "`flush()` called from inside the hub's drain (a handler, sink or hook); it would wait \
         for itself"
    )]
    FlushInsideDrain,
}

impl HubError {
    pub(crate) fn invalid(option: &'static str, reason: impl Into<String>) -> Self {
        HubError::InvalidOption {
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
