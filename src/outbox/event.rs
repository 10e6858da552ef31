//! Messages for an outbox: deferred push events, their classification, and the message factory.

use std::any::Any;
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use serde::de::{Deserializer, IgnoredAny};
use serde::Deserialize;

/// A JSON string field that may be absent, `null` or a string: three distinct values.
///
/// `deviceSessionUuid` absent, `null` and `"s-1"` are three distinct epochs, and a
/// `frames_dropped` notification preserves `deviceId` / `deviceSessionUuid` exactly as one of
/// these three.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum Field {
    /// The field is not in the message.
    #[default]
    Absent,
    /// The field is `null`.
    Null,
    /// The field is a string.
    Str(Arc<str>),
}

impl Field {
    /// A string field.
    pub fn str(s: impl Into<Arc<str>>) -> Self {
        Field::Str(s.into())
    }

    /// The string, if the field is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Field::Str(s) => Some(s),
            _ => None,
        }
    }
}

impl From<&str> for Field {
    fn from(s: &str) -> Self {
        Field::Str(s.into())
    }
}

impl From<Option<&str>> for Field {
    /// `None` is `null`; use [`Field::Absent`] for an absent field.
    fn from(s: Option<&str>) -> Self {
        s.map_or(Field::Null, Field::from)
    }
}

/// What the outbox needs to know about a message to apply the back-pressure rules.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MessageMeta {
    /// The `type` field; empty when absent or not a string (then the message is lossless).
    pub kind: Arc<str>,
    /// The `deviceId` field.
    pub device_id: Field,
    /// The `deviceSessionUuid` field: its epoch.
    pub device_session_uuid: Field,
    /// Whether the message carries `id` or `requestId` (any value, `null` included): such a
    /// message is a correlated reply and never coalesced or dropped.
    pub correlated: bool,
}

impl MessageMeta {
    /// Reads `type`, `deviceId`, `deviceSessionUuid`, `id` and `requestId` from one JSON message.
    ///
    /// A message that is not a JSON object, or whose fields have unexpected types, gets an empty
    /// `kind` and is therefore treated as lossless (never coalesced, never dropped).
    ///
    /// ```
    /// use powerhub::outbox::{Field, MessageMeta};
    ///
    /// let meta = MessageMeta::classify(
    ///     br#"{"type":"screenshot_update","deviceId":"d1","deviceSessionUuid":null,"png":"..."}"#,
    /// );
    /// assert_eq!(&*meta.kind, "screenshot_update");
    /// assert_eq!(meta.device_id, Field::str("d1"));
    /// assert_eq!(meta.device_session_uuid, Field::Null);
    /// assert!(!meta.correlated);
    /// ```
    pub fn classify(json: &[u8]) -> MessageMeta {
        Self::scan(json).unwrap_or_else(|| Self::classify_slow(json))
    }

    /// The fast path: a top-level scan (strings skipped with `memchr`), reading only the five
    /// fields; `None` when the message is not plain enough (escapes, odd types, malformed).
    fn scan(json: &[u8]) -> Option<MessageMeta> {
        let keys = ["type", "deviceId", "deviceSessionUuid", "id", "requestId"];
        let ([kind, device, session, id, request_id], ok) =
            crate::protocol::scan::members(json, keys);
        if !ok {
            return None;
        }
        let field = |span: Option<std::ops::Range<usize>>| -> Option<Field> {
            match span {
                None => Some(Field::Absent),
                Some(r) if &json[r.clone()] == b"null" => Some(Field::Null),
                Some(r) => crate::protocol::scan::plain_str(&json[r]).map(Field::str),
            }
        };
        let kind = match kind {
            None => Arc::from(""),
            Some(r) => Arc::from(crate::protocol::scan::plain_str(&json[r])?),
        };
        Some(MessageMeta {
            kind,
            device_id: field(device)?,
            device_session_uuid: field(session)?,
            correlated: id.is_some() || request_id.is_some(),
        })
    }

    /// The general path: serde_json reads the five fields (escaped strings included); a message
    /// it rejects is lossless.
    fn classify_slow(json: &[u8]) -> MessageMeta {
        match serde_json::from_slice::<Head<'_>>(json) {
            Ok(head) => MessageMeta {
                kind: match head.kind {
                    Some(Cow::Borrowed(s)) => Arc::from(s),
                    Some(Cow::Owned(s)) => Arc::from(s),
                    None => Arc::from(""),
                },
                device_id: head.device_id.0,
                device_session_uuid: head.device_session_uuid.0,
                correlated: head.id || head.request_id,
            },
            Err(_) => MessageMeta {
                kind: Arc::from(""),
                ..MessageMeta::default()
            },
        }
    }
}

#[derive(Deserialize)]
struct Head<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(rename = "deviceId", default)]
    device_id: FieldDe,
    #[serde(rename = "deviceSessionUuid", default)]
    device_session_uuid: FieldDe,
    #[serde(default, deserialize_with = "present")]
    id: bool,
    #[serde(rename = "requestId", default, deserialize_with = "present")]
    request_id: bool,
}

#[derive(Default)]
struct FieldDe(Field);

impl<'de> Deserialize<'de> for FieldDe {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v: Option<Cow<'de, str>> = Option::deserialize(d)?;
        Ok(FieldDe(match v {
            None => Field::Null,
            Some(s) => Field::Str(Arc::from(&*s)),
        }))
    }
}

fn present<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    IgnoredAny::deserialize(d).map(|_| true)
}

/// A message for one subscription, serialized through the [`MessageFactory`] only when it is
/// written (so a frame that is coalesced away is never serialized).
///
/// ```
/// use bytes::Bytes;
/// use powerhub::outbox::{Field, PushEvent};
///
/// let event = PushEvent::new("screenshot_update", Bytes::from_static(br#"{"type":"screenshot_update"}"#))
///     .device_id("emulator-5554")
///     .device_session_uuid(Field::Null);
/// assert_eq!(event.kind(), "screenshot_update");
/// assert_eq!(event.meta().device_session_uuid, Field::Null);
/// ```
#[derive(Clone)]
pub struct PushEvent {
    meta: MessageMeta,
    payload: Bytes,
    context: Option<Arc<dyn Any + Send + Sync>>,
}

impl PushEvent {
    /// An event of type `kind` whose default serialization is `payload` (a JSON message without
    /// trailing newline); `deviceId` / `deviceSessionUuid` absent, uncorrelated.
    pub fn new(kind: impl Into<Arc<str>>, payload: Bytes) -> Self {
        PushEvent {
            meta: MessageMeta {
                kind: kind.into(),
                ..MessageMeta::default()
            },
            payload,
            context: None,
        }
    }

    /// An event whose metadata is read from `payload` itself ([`MessageMeta::classify`]).
    pub fn from_json(payload: Bytes) -> Self {
        PushEvent {
            meta: MessageMeta::classify(&payload),
            payload,
            context: None,
        }
    }

    /// Sets `deviceId`.
    pub fn device_id(mut self, device_id: impl Into<Field>) -> Self {
        self.meta.device_id = device_id.into();
        self
    }

    /// Sets `deviceSessionUuid` (the epoch).
    pub fn device_session_uuid(mut self, uuid: impl Into<Field>) -> Self {
        self.meta.device_session_uuid = uuid.into();
        self
    }

    /// Marks the event as carrying `id` / `requestId` (lossless, never coalesced or dropped).
    pub fn correlated(mut self, correlated: bool) -> Self {
        self.meta.correlated = correlated;
        self
    }

    /// Attaches a value the [`MessageFactory`] may use (the unserialized message, say).
    pub fn context(mut self, context: Arc<dyn Any + Send + Sync>) -> Self {
        self.context = Some(context);
        self
    }

    /// The message type.
    pub fn kind(&self) -> &str {
        &self.meta.kind
    }

    /// The metadata the back-pressure rules use.
    pub fn meta(&self) -> &MessageMeta {
        &self.meta
    }

    /// The default serialization: the published JSON message.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// The attached context, downcast to `T`.
    pub fn context_ref<T: Any>(&self) -> Option<&T> {
        self.context.as_deref()?.downcast_ref::<T>()
    }
}

impl fmt::Debug for PushEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PushEvent")
            .field("meta", &self.meta)
            .field("payload_len", &self.payload.len())
            .field("context", &self.context.is_some())
            .finish()
    }
}

/// Serializes one delivered message: the spec's `createPushMessage` hook.
///
/// Called once per message that is actually written (never for a frame coalesced away or
/// dropped), with the subscription it is for and the time of the write, so it may add
/// subscriber-specific fields and per-call timestamps. It returns one JSON message without
/// trailing newline; the outbox frames it. It must not rewrite `captureSequence`.
///
/// ```
/// use std::time::Instant;
/// use bytes::Bytes;
/// use powerhub::outbox::{MessageFactory, PushEvent};
///
/// #[derive(Debug)]
/// struct WithSubscription;
///
/// impl MessageFactory for WithSubscription {
///     fn create_push_message(&self, subscription: &str, event: &PushEvent, _now: Instant) -> Bytes {
///         format!(r#"{{"type":"{}","subscriptionId":"{}"}}"#, event.kind(), subscription).into()
///     }
/// }
/// let event = PushEvent::new("telemetry", Bytes::new());
/// let json = WithSubscription.create_push_message("s-1", &event, Instant::now());
/// assert_eq!(&json[..], br#"{"type":"telemetry","subscriptionId":"s-1"}"#);
/// ```
pub trait MessageFactory: Send + Sync + fmt::Debug + 'static {
    /// Serializes `event` for `subscription` at time `now`.
    fn create_push_message(&self, subscription: &str, event: &PushEvent, now: Instant) -> Bytes;

    /// Whether the factory always returns the payload unchanged. When `true`,
    /// [`Outbox::push_shared`](super::Outbox::push_shared) writes shared chunks as they are;
    /// when `false` (the default), it splits them into messages, each serialized through the
    /// factory.
    fn is_identity(&self) -> bool {
        false
    }
}

/// The default [`MessageFactory`]: the event's payload, unchanged (byte-identical for every
/// subscriber).
#[derive(Debug, Clone, Copy, Default)]
pub struct PayloadFactory;

impl MessageFactory for PayloadFactory {
    fn create_push_message(&self, _subscription: &str, event: &PushEvent, _now: Instant) -> Bytes {
        event.payload.clone()
    }

    fn is_identity(&self) -> bool {
        true
    }
}

/// Builds the spec's `frames_dropped` notification, fields in the spec's order:
/// `type`, `subscriptionId`, `deviceId` (omitted when absent), `deviceSessionUuid` (omitted when
/// absent), `droppedType`, `reason`.
///
/// ```
/// use powerhub::outbox::{frames_dropped_json, Field};
///
/// let json = frames_dropped_json("observationstream-1", &Field::str("emulator-5554"),
///                                &Field::Null, "screenshot_update");
/// assert_eq!(&json[..], &br#"{"type":"frames_dropped","subscriptionId":"observationstream-1","deviceId":"emulator-5554","deviceSessionUuid":null,"droppedType":"screenshot_update","reason":"backpressure"}"#[..]);
/// ```
pub fn frames_dropped_json(
    subscription: &str,
    device_id: &Field,
    device_session_uuid: &Field,
    dropped_type: &str,
) -> Bytes {
    let mut out = Vec::with_capacity(160);
    out.extend_from_slice(br#"{"type":"frames_dropped","subscriptionId":"#);
    write_json_str(&mut out, subscription);
    write_field(&mut out, b"deviceId", device_id);
    write_field(&mut out, b"deviceSessionUuid", device_session_uuid);
    out.extend_from_slice(br#","droppedType":"#);
    write_json_str(&mut out, dropped_type);
    out.extend_from_slice(br#","reason":"backpressure"}"#);
    out.into()
}

fn write_field(out: &mut Vec<u8>, name: &[u8], field: &Field) {
    match field {
        Field::Absent => {}
        Field::Null => {
            out.extend_from_slice(b",\"");
            out.extend_from_slice(name);
            out.extend_from_slice(b"\":null");
        }
        Field::Str(s) => {
            out.extend_from_slice(b",\"");
            out.extend_from_slice(name);
            out.extend_from_slice(b"\":");
            write_json_str(out, s);
        }
    }
}

/// Appends `s` as a JSON string literal (quoted, escaped).
pub(crate) fn write_json_str(out: &mut Vec<u8>, s: &str) {
    // Serializing a `str` into a `Vec` cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

#[cfg(test)]
mod tests {
    use super::MessageMeta;

    #[test]
    fn fast_and_slow_classification_agree() {
        let cases = [
            r#"{"type":"screenshot_update","deviceId":"d1","deviceSessionUuid":null,"png":"AAAA"}"#,
            r#"{"png":"A\"B","type":"hierarchy_update","deviceSessionUuid":"s"}"#,
            r#"{"type":"screenshot_update","id":null}"#,
            r#"{"type":"screenshot_update","requestId":{"a":[1]}}"#,
            r#"{ "type" : "x" , "deviceId" : "d" }"#,
            r#"{"deviceId":"d"}"#,
            r#"{}"#,
        ];
        for json in cases {
            let fast = MessageMeta::scan(json.as_bytes()).expect(json);
            assert_eq!(fast, MessageMeta::classify_slow(json.as_bytes()), "{json}");
        }
    }

    #[test]
    fn unusual_messages_fall_back_and_are_lossless() {
        for json in [
            r#"{"type":"t\u0041"}"#,
            r#"{"type":5}"#,
            r#"{"type":"a","deviceId":7}"#,
            "[1]",
            "{",
            "",
        ] {
            assert!(MessageMeta::scan(json.as_bytes()).is_none(), "{json}");
        }
        assert_eq!(&*MessageMeta::classify(br#"{"type":"t\u0041"}"#).kind, "tA");
        assert_eq!(&*MessageMeta::classify(br#"{"type":5}"#).kind, "");
        assert_eq!(
            &*MessageMeta::classify(br#"{"type":"a","deviceId":7}"#).kind,
            ""
        );
        assert_eq!(&*MessageMeta::classify(b"{").kind, "");
    }
}
