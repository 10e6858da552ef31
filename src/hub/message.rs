//! Messages and what a handler sees of a delivery.

use bytes::Bytes;
use powerhub_plugin::SubscriberRef;
use serde::Serialize;

use super::error::MessageError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Json,
    /// JSON known to hold no raw line break (`\n`, `\r`): an NDJSON line as it is.
    JsonLine,
    /// A [`Kind::JsonLine`] whose bytes are a slice of a connection's receive (no copy): made
    /// its own ([`Message::own`]) before anything keeps it past the fan-out, so that it never
    /// holds the rest of the receive.
    JsonLineOfReceive,
    Binary,
}

/// A published message: JSON text or opaque bytes, cheap to clone (`Bytes`).
///
/// A JSON message can be framed by every codec; a binary message only by `raw` (under `json` or
/// `ndjson` it is an encode failure, counted in `dropped` and reported).
///
/// ```
/// use powerhub::hub::Message;
///
/// let m = Message::json(r#"{"a":1}"#).unwrap();
/// assert!(m.is_json());
/// assert!(Message::json("{nope").is_err());
/// let b = Message::binary(vec![0u8, 1, 2]);
/// assert_eq!(b.bytes().len(), 3);
/// ```
#[derive(Debug, Clone)]
pub struct Message {
    body: Bytes,
    kind: Kind,
}

/// Two messages are equal when their bytes are and both are JSON or both binary (whether a
/// JSON message is known to be one line is how it was made, not what it is).
impl PartialEq for Message {
    fn eq(&self, other: &Message) -> bool {
        self.body == other.body && self.is_json() == other.is_json()
    }
}

impl Eq for Message {}

impl Message {
    /// A JSON message, validated.
    pub fn json(text: impl Into<Bytes>) -> Result<Message, MessageError> {
        let body = text.into();
        serde_json::from_slice::<serde::de::IgnoredAny>(&body)
            .map_err(|e| MessageError::InvalidJson(e.to_string()))?;
        Ok(Message {
            body,
            kind: Kind::Json,
        })
    }

    /// A JSON message whose text the caller already validated as JSON and made one line (the
    /// push protocol's parser does, for the message of a `publish` command), so a publish
    /// parses it once and its NDJSON encoding copies it as it is.
    pub(crate) fn json_validated(text: Bytes) -> Message {
        debug_assert!(memchr::memchr2(b'\n', b'\r', &text).is_none());
        Message {
            body: text,
            kind: Kind::JsonLine,
        }
    }

    /// [`json_validated`](Self::json_validated) for text that is a slice of a connection's
    /// receive, taken as it lies (no allocation, no copy). The hub copies it
    /// ([`own`](Self::own)) where it keeps the message beyond handing it to the shards' fan-out
    /// (a retained log, a queue of the hub's own subscribers, direct receivers), so that a small
    /// message never pins a large receive.
    pub(crate) fn json_line_of_receive(text: Bytes) -> Message {
        debug_assert!(memchr::memchr2(b'\n', b'\r', &text).is_none());
        Message {
            body: text,
            kind: Kind::JsonLineOfReceive,
        }
    }

    /// Makes a message that is a slice of a connection's receive its own copy; any other is
    /// left as it is.
    pub(crate) fn own(&mut self) {
        if self.kind == Kind::JsonLineOfReceive {
            self.body = Bytes::copy_from_slice(&self.body);
            self.kind = Kind::JsonLine;
        }
    }

    /// A JSON message serialized from `value`.
    pub fn to_json<T: Serialize + ?Sized>(value: &T) -> Result<Message, MessageError> {
        let body = serde_json::to_vec(value).map_err(|e| MessageError::Serialize(e.to_string()))?;
        Ok(Message {
            body: body.into(),
            kind: Kind::Json,
        })
    }

    /// An opaque binary message.
    pub fn binary(bytes: impl Into<Bytes>) -> Message {
        Message {
            body: bytes.into(),
            kind: Kind::Binary,
        }
    }

    /// The message's bytes (JSON text for a JSON message).
    pub fn bytes(&self) -> &Bytes {
        &self.body
    }

    /// Whether the message is JSON.
    pub fn is_json(&self) -> bool {
        matches!(
            self.kind,
            Kind::Json | Kind::JsonLine | Kind::JsonLineOfReceive
        )
    }

    /// Whether the message is JSON known to hold no raw line break.
    pub(crate) fn is_json_line(&self) -> bool {
        matches!(self.kind, Kind::JsonLine | Kind::JsonLineOfReceive)
    }
}

/// One message as the subscriber's handler sees it, after the transport took its batch (or as
/// a [`Receiver`](super::Receiver) lends it). Two references: cheap to return and to pass.
#[derive(Debug, Clone, Copy)]
pub struct Delivery<'a> {
    subscriber: &'a SubscriberRef,
    entry: &'a super::queue::Entry,
}

impl<'a> Delivery<'a> {
    #[inline]
    pub(crate) fn of(
        subscriber: &'a SubscriberRef,
        entry: &'a super::queue::Entry,
    ) -> Delivery<'a> {
        Delivery { subscriber, entry }
    }

    /// The subscriber (id, topic, transport context).
    pub fn subscriber(&self) -> &'a SubscriberRef {
        self.subscriber
    }

    /// The topic.
    pub fn topic(&self) -> &'a str {
        self.subscriber.topic()
    }

    /// The message.
    pub fn message(&self) -> &'a Message {
        &self.entry.message
    }

    /// The hub-wide publication sequence number of the message (increasing in publish order).
    pub fn seq(&self) -> u64 {
        self.entry.seq
    }

    /// The message's number within its topic: 0, 1, 2, … in publish order over the publications
    /// the topic kept for someone: those made while it had subscribers, and those it retained.
    /// A publication that reached nobody (made with no subscriber, and not retained) takes no
    /// number. Consecutive for a subscriber that missed nothing, so a gap is a message the
    /// subscriber's policy dropped (retained replays keep their numbers).
    pub fn topic_seq(&self) -> u64 {
        self.entry.topic_seq
    }

    /// The priority the message was published with (0 when none).
    pub fn priority(&self) -> i32 {
        self.entry.priority
    }
}

#[cfg(test)]
mod tests {
    use super::Message;
    use crate::hub::{Hub, HubOptions, PublishOptions, SubscribeOptions};
    use crate::transport::SpySink;
    use bytes::Bytes;

    /// A message that is a slice of a receive is copied where the hub keeps it (here a
    /// receiver's queue, and the retained log): what is kept never holds the receive's other
    /// bytes alive.
    #[test]
    fn a_message_sliced_from_a_receive_is_copied_where_the_hub_keeps_it() {
        let receive = Bytes::from(format!(
            "{}{{\"n\":1}}{}",
            "x".repeat(4096),
            "y".repeat(4096)
        ));
        let slice = receive.slice(4096..4103);
        let inside = |m: &Message| receive.as_ptr_range().contains(&m.bytes().as_ptr());
        let hub = Hub::new(SpySink::new(), HubOptions::default()).unwrap();
        let mut rx = hub.receiver("t", SubscribeOptions::default()).unwrap();
        let message = Message::json_line_of_receive(slice.clone());
        assert!(inside(&message), "taken as it lies");
        hub.publish("t", message, PublishOptions::default())
            .unwrap();
        let mut run = vec![Message::json_line_of_receive(slice.clone())];
        hub.publish_run("t", &mut run);
        for _ in 0..2 {
            let got = rx.try_recv().unwrap();
            assert_eq!(&got.message().bytes()[..], br#"{"n":1}"#);
            assert!(!inside(got.message()), "a copy of its own in the queue");
        }
        // Retained: a later subscriber is replayed the retained log first.
        let message = Message::json_line_of_receive(slice);
        hub.publish("r", message, PublishOptions::default().retain(true))
            .unwrap();
        let mut later = hub.receiver("r", SubscribeOptions::default()).unwrap();
        let got = later.try_recv().unwrap();
        assert_eq!(&got.message().bytes()[..], br#"{"n":1}"#);
        assert!(
            !inside(got.message()),
            "a copy of its own in the retained log"
        );
    }
}
