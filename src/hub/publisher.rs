//! A publisher's handle of one topic: [`Hub::publish`](super::Hub::publish) without the topic's
//! lookup.

use std::sync::Arc;

use serde::Serialize;

use super::core::{Inner, TopicOrder};
use super::{Message, PublishError, PublishOptions};

/// A handle that publishes to one topic, made by [`Hub::publisher`](super::Hub::publisher):
/// what [`Hub::publish`](super::Hub::publish) does, with the topic looked up once.
///
/// While the topic's only consumers are [`Receiver`](super::Receiver)s that read its log
/// directly (FIFO drop-oldest with a queue, the default, on a hub without `message_priority`),
/// a publication neither retained nor prioritized
/// takes the topic's own lock and no hub-wide one, and allocates nothing of its own; otherwise
/// it is published by name. Either way it is numbered in the topic with the others, in one
/// order ([`Received::topic_seq`](super::Received::topic_seq)).
///
/// The handle keeps its topic listed while it lives (an empty topic is one entry; dropping the
/// last handle lets it go, unless it has subscribers or retained messages); it does not keep
/// the hub open: after [`Hub::close`](super::Hub::close) a publish returns `Ok(0)`, as
/// `Hub::publish` does. Clones share the topic.
///
/// ```
/// use powerhub::hub::{Hub, HubOptions, Message, PublishOptions, SubscribeOptions};
/// use powerhub::transport::SpySink;
///
/// let hub = Hub::new(SpySink::new(), HubOptions::default())?;
/// let mut rx = hub.receiver("prices", SubscribeOptions::default())?;
/// let prices = hub.publisher("prices");
/// assert_eq!(prices.topic(), "prices");
/// assert_eq!(prices.publish(Message::json(r#"{"px":1}"#)?, PublishOptions::default())?, 1);
/// prices.publish_json(&serde_json::json!({"px": 2}))?;
/// hub.publish_json("prices", &serde_json::json!({"px": 3}))?; // by name, in the same order
/// for n in 0..3 {
///     assert_eq!(rx.try_recv()?.topic_seq(), n);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<Inner>,
    topic: Arc<str>,
    /// The topic's order; `None` only while the handle is dropped (it is released under the
    /// topics lock, see [`Inner::release_publisher`]).
    order: Option<TopicOrder>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    pub(super) fn new(inner: &Arc<Inner>, topic: &str) -> Publisher {
        Publisher {
            order: Some(inner.publisher_order(topic)),
            inner: Arc::clone(inner),
            topic: Arc::from(topic),
        }
    }

    /// The topic it publishes to.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Publishes `message` to the topic; returns how many subscribers queued it. As
    /// [`Hub::publish`](super::Hub::publish): never blocks on a subscriber, `Ok(0)` after the
    /// hub closed, and [`PublishError::PriorityWithoutMessagePriority`] for a `priority`
    /// without the hub's `message_priority`.
    pub fn publish(
        &self,
        message: Message,
        options: PublishOptions,
    ) -> Result<usize, PublishError> {
        let order = self.order.as_ref().expect("set until the handle drops");
        self.inner.publish_at(&self.topic, order, message, options)
    }

    /// Serializes `value` as JSON and publishes it with default options; a value that cannot be
    /// serialized is [`PublishError::Message`].
    pub fn publish_json<T: Serialize + ?Sized>(&self, value: &T) -> Result<usize, PublishError> {
        self.publish(Message::to_json(value)?, PublishOptions::default())
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Some(order) = self.order.take() {
            self.inner.release_publisher(&self.topic, order);
        }
    }
}
