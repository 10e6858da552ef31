//! The command parser never panics, whatever the input, and agrees with serde_json on what is
//! valid JSON.

use powerhub::protocol::{parse_command, Command, ErrorKind};
use proptest::prelude::*;

mod mutate;

const VALID: &[&str] = &[
    r#"{"type":"subscribe","id":"r1","stream":"obs","deviceId":"d1"}"#,
    r#"{"type":"unsubscribe","id":2,"subscriptionId":"obs-1"}"#,
    r#"{"type":"publish","id":"p","message":{"type":"screenshot_update","stream":"obs","deviceId":null,"png":"\u00e9\"x"}}"#,
    r#"{"type":"ping"}"#,
    r#"{"type":"pong","extra":[1,2,{"a":null}]}"#,
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(mut bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = parse_command(&mut bytes);
    }

    #[test]
    fn mutated_commands_never_panic_and_agree_with_serde_json(
        which in 0..VALID.len(),
        edits in mutate::edits(0..4),
    ) {
        let mut line = VALID[which].as_bytes().to_vec();
        mutate::apply(&mut line, &edits);
        let serde_ok = serde_json::from_slice::<serde_json::Value>(&line).is_ok_and(|v| v.is_object());
        let original = line.clone();
        let result = parse_command(&mut line);
        if let Err(e) = &result {
            let invalid = matches!(e.kind, ErrorKind::InvalidJson(_) | ErrorKind::InvalidUtf8 { .. } | ErrorKind::LoneSurrogate { .. } | ErrorKind::TooDeep { .. });
            // The parser and serde_json agree on validity (repeats of a field the server reads
            // aside, which serde_json accepts into a map and the parser refuses by name).
            prop_assert!(!(serde_ok && invalid), "{e} for {:?}", String::from_utf8_lossy(&original));
        }
        if let Ok(Command::Publish { message, .. }) = result {
            // The forwarded message is exactly a span of the original line, but for line breaks
            // in its whitespace, which become spaces (NDJSON framing); and it is valid JSON.
            let flattened: Vec<u8> = original
                .iter()
                .map(|&b| if matches!(b, b'\n' | b'\r') { b' ' } else { b })
                .collect();
            prop_assert!(flattened.windows(message.len()).any(|w| w == &message[..]));
            prop_assert!(serde_json::from_slice::<serde_json::Value>(&message).is_ok());
        }
    }
}
