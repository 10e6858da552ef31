//! The command parser: the publish fast path, the full parser and the public entry points agree
//! on every line, and what they accept or answer is well formed.
//!
//! Input: one command line (without its newline), any bytes.

use std::cell::RefCell;

use bytes::Bytes;
use powerhub::protocol::fuzzing::{fast_publish, full};
use powerhub::protocol::{parse_command, Command, CommandParser, ErrorKind};

use super::support::{is_json, is_json_object};

thread_local! {
    /// A parser kept across inputs, as the server keeps one per thread: reused buffers must not
    /// change a result.
    static KEPT: RefCell<CommandParser> = RefCell::new(CommandParser::default());
}

/// The check.
pub(crate) fn check(line: &[u8]) {
    let full_result = full(line);
    let public = parse_command(&mut line.to_vec());
    assert_eq!(public, full_result, "parse_command and the full parser");
    let shared = CommandParser::default().parse_shared(Bytes::copy_from_slice(line));
    assert_eq!(shared, full_result, "parse_shared and the full parser");
    let kept = KEPT.with(|p| p.borrow_mut().parse(&mut line.to_vec()));
    assert_eq!(kept, full_result, "a reused parser and the full parser");

    match std::str::from_utf8(line) {
        Ok(_) => {
            // The differential check: a line the fast path reads, the full parser reads the same.
            if let Some(fast) = fast_publish(line) {
                assert!(
                    matches!(fast, Command::Publish { .. }),
                    "the fast path read a non-publish: {fast:?}"
                );
                assert_eq!(
                    full_result.as_ref(),
                    Ok(&fast),
                    "the fast path and the full parser disagree"
                );
            }
        }
        Err(e) => {
            // The fast path checks UTF-8 itself (the server no longer checks the whole line
            // before it): it must leave such a line to the full parser.
            assert!(
                fast_publish(line).is_none(),
                "the fast path read a line that is not UTF-8"
            );
            let err = full_result
                .as_ref()
                .expect_err("a line that is not UTF-8 is refused");
            assert_eq!(
                err.kind,
                ErrorKind::InvalidUtf8 {
                    offset: e.valid_up_to()
                }
            );
        }
    }

    match &full_result {
        Ok(Command::Publish { message, meta, .. }) => {
            // The message is a JSON object, a span of the line but for line breaks in its
            // whitespace (written as spaces), and it says what the meta says.
            assert!(
                is_json_object(message),
                "publish message is not a JSON object"
            );
            assert!(
                !message.contains(&b'\n') && !message.contains(&b'\r'),
                "a line break in a forwarded message"
            );
            let flattened: Vec<u8> = line
                .iter()
                .map(|&b| if matches!(b, b'\n' | b'\r') { b' ' } else { b })
                .collect();
            assert!(
                flattened.windows(message.len()).any(|w| w == &message[..]),
                "the message is not a span of the line"
            );
            assert_valid_stream(&meta.stream);
        }
        Ok(Command::Subscribe {
            stream, device_id, ..
        }) => {
            assert_valid_stream(stream);
            assert!(device_id.as_ref().is_none_or(|d| !d.is_empty()));
        }
        Ok(_) => {}
        Err(e) => {
            // Every refusal can be answered: the error reply is one JSON object on one line.
            let reply = e.to_reply();
            assert!(is_json_object(&reply), "error reply is not JSON: {reply:?}");
            assert!(!reply.contains(&b'\n'), "a line break in an error reply");
            let _ = e.to_string();
        }
    }
    if let Ok(cmd) = &full_result {
        if let Some(id) = cmd.request_id() {
            let mut json = Vec::new();
            id.write_json(&mut json);
            assert!(is_json(&json), "request id written as {json:?}");
        }
    }
}

/// Stream names are 1 to 256 bytes and contain no `/` (the protocol reference).
fn assert_valid_stream(stream: &str) {
    assert!(
        (1..=256).contains(&stream.len()) && !stream.contains('/'),
        "stream {stream:?} was accepted"
    );
}
