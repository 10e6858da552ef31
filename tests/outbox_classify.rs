//! The outbox reads five fields of every message (`type`, `deviceId`, `deviceSessionUuid`, `id`,
//! `requestId`) to decide whether it may be coalesced or dropped. A misread correlated reply
//! would be coalesced away, so the classifier is compared with a plain serde_json model on
//! generated objects (nested look-alike keys, escaped keys and strings, every value type), and
//! must never panic on malformed or arbitrary bytes.

use powerhub::outbox::{Field, MessageMeta};
use proptest::prelude::*;
use serde_json::Value;

mod mutate;

const KEYS: &[&str] = &[
    "type",
    "deviceId",
    "deviceSessionUuid",
    "id",
    "requestId",
    "png",
    "nested",
    "captureSequence",
];

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i32>().prop_map(Value::from),
        "[a-z_]{0,8}".prop_map(Value::from),
        // Quotes, backslashes, braces, control and non-ASCII characters: escapes on the wire.
        "[a-z\"\\\\{}:,\\n\u{e9}\u{1F600}]{0,8}".prop_map(Value::from),
        Just(Value::from("screenshot_update")),
        Just(Value::from("hierarchy_update")),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            // Nested objects carry the same keys: only the top level counts.
            prop::collection::btree_map(prop::sample::select(KEYS), inner, 0..3).prop_map(|m| {
                Value::Object(m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
            }),
        ]
    })
}

/// One member: key index, value, whether to write the key with a `\u` escape, whitespace.
fn members() -> impl Strategy<Value = Vec<(usize, Value, bool, bool)>> {
    prop::collection::vec(
        (
            0..KEYS.len(),
            value(),
            prop::bool::weighted(0.15),
            any::<bool>(),
        ),
        0..6,
    )
    .prop_map(|mut ms| {
        // Unique keys: duplicates are a different question (serde rejects them).
        let mut seen = std::collections::HashSet::new();
        ms.retain(|m| seen.insert(m.0));
        ms
    })
}

fn render(ms: &[(usize, Value, bool, bool)]) -> String {
    let mut s = String::from("{");
    for (i, (k, v, escaped, ws)) in ms.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let sp = if *ws { " " } else { "" };
        let key = KEYS[*k];
        if *escaped {
            // The first character as a \u escape: the same key to any JSON reader.
            let mut chars = key.chars();
            let c = chars.next().unwrap();
            s.push_str(&format!(
                "{sp}\"\\u{:04x}{}\"{sp}:{sp}",
                c as u32,
                chars.as_str()
            ));
        } else {
            s.push_str(&format!("{sp}\"{key}\"{sp}:{sp}"));
        }
        s.push_str(&serde_json::to_string(v).unwrap());
    }
    s.push('}');
    s
}

/// The plain model: what a JSON reader sees at the top level.
fn model(json: &str) -> MessageMeta {
    let Ok(Value::Object(map)) = serde_json::from_str::<Value>(json) else {
        return MessageMeta::default();
    };
    let field = |k: &str| match map.get(k) {
        None => Some(Field::Absent),
        Some(Value::Null) => Some(Field::Null),
        Some(Value::String(s)) => Some(Field::str(s.as_str())),
        Some(_) => None,
    };
    let kind = match map.get("type") {
        None | Some(Value::Null) => Some(String::new()),
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => None,
    };
    match (kind, field("deviceId"), field("deviceSessionUuid")) {
        (Some(kind), Some(device_id), Some(device_session_uuid)) => MessageMeta {
            kind: kind.into(),
            device_id,
            device_session_uuid,
            correlated: map.contains_key("id") || map.contains_key("requestId"),
        },
        // A field of an unexpected type: the message is treated as lossless.
        _ => MessageMeta::default(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn classify_reads_the_top_level_fields_like_a_json_reader(ms in members()) {
        let json = render(&ms);
        prop_assert_eq!(MessageMeta::classify(json.as_bytes()), model(&json), "{}", json);
    }

    #[test]
    fn classify_never_panics_on_mutated_messages(
        ms in members(),
        edits in mutate::edits(1..4),
    ) {
        let mut bytes = render(&ms).into_bytes();
        mutate::apply(&mut bytes, &edits);
        let _ = MessageMeta::classify(&bytes);
    }

    #[test]
    fn classify_never_panics_on_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = MessageMeta::classify(&bytes);
    }
}
