//! The push protocol's command parser: every command, every kind of bad input.

use bytes::Bytes;
use powerhub::outbox::Field;
use powerhub::protocol::{
    parse_command, Command, CommandError, CommandParser, ErrorKind, PublishMeta, RequestId,
};

fn parse(line: &str) -> Result<Command, CommandError> {
    let mut buf = line.as_bytes().to_vec();
    parse_command(&mut buf)
}

fn err(line: &str) -> CommandError {
    parse(line).unwrap_err()
}

fn rid(s: &str) -> Option<RequestId> {
    Some(RequestId::Str(s.into()))
}

#[test]
fn subscribe_to_one_device_or_all_devices_of_a_stream() {
    assert_eq!(
        parse(r#"{"type":"subscribe","id":"r1","stream":"obs","deviceId":"emulator-5554"}"#)
            .unwrap(),
        Command::Subscribe {
            id: rid("r1"),
            stream: "obs".into(),
            device_id: Some("emulator-5554".into()),
            subscription_id: None
        }
    );
    assert_eq!(
        parse(r#"{"type":"subscribe","id":2,"stream":"obs","subscriptionId":"mine"}"#).unwrap(),
        Command::Subscribe {
            id: Some(RequestId::Int(2)),
            stream: "obs".into(),
            device_id: None,
            subscription_id: Some("mine".into())
        }
    );
    assert_eq!(
        parse(r#"{"type":"subscribe","stream":"obs","deviceId":null}"#).unwrap(),
        Command::Subscribe {
            id: None,
            stream: "obs".into(),
            device_id: None,
            subscription_id: None
        }
    );
}

#[test]
fn unsubscribe_ping_and_pong() {
    assert_eq!(
        parse(r#"{"type":"unsubscribe","requestId":"r2","subscriptionId":"obs-1"}"#).unwrap(),
        Command::Unsubscribe {
            id: rid("r2"),
            subscription_id: "obs-1".into()
        }
    );
    assert_eq!(
        parse(r#"{"type":"ping","id":-5}"#).unwrap(),
        Command::Ping {
            id: Some(RequestId::Int(-5))
        }
    );
    assert_eq!(
        parse(r#"{"type":"pong"}"#).unwrap(),
        Command::Pong { id: None }
    );
}

#[test]
fn publish_carries_the_message_byte_for_byte() {
    let message = r#"{ "type" : "screenshot_update","stream":"obs","deviceId":"d1","deviceSessionUuid":null,"captureSequence":7,"png":"a\"b\u00e9\n"}"#;
    let line = format!(r#"{{"type":"publish","id":"p1","message":{message},"extra":[1,2]}}"#);
    let Command::Publish {
        id,
        message: got,
        meta,
    } = parse(&line).unwrap()
    else {
        panic!()
    };
    assert_eq!(id, rid("p1"));
    assert_eq!(got, Bytes::from(message.to_owned()));
    assert_eq!(
        meta,
        PublishMeta {
            stream: "obs".into(),
            kind: "screenshot_update".into(),
            device_id: Field::str("d1"),
            device_session_uuid: Field::Null
        }
    );
    let Command::Publish { meta, .. } =
        parse(r#"{"type":"publish","message":{"type":"t","stream":"s"}}"#).unwrap()
    else {
        panic!()
    };
    assert_eq!(
        (meta.device_id, meta.device_session_uuid),
        (Field::Absent, Field::Absent)
    );
}

#[test]
fn unknown_fields_are_tolerated() {
    assert_eq!(
        parse(r#"{"future":{"x":[1,{"y":null}]},"type":"ping","id":"r","also":true}"#).unwrap(),
        Command::Ping { id: rid("r") }
    );
}

#[test]
fn invalid_json_is_an_error_naming_the_problem_with_the_request_id_when_readable() {
    let e = err(r#"{"id":"r7","type":"subscribe","stream":}"#);
    assert!(matches!(e.kind, ErrorKind::InvalidJson(_)), "{e:?}");
    assert_eq!(e.request_id, rid("r7"));
    assert_eq!(e.kind.code(), "invalid_json");
    let e = err("not json");
    assert_eq!(e.request_id, None);
    assert!(matches!(err("[1,2]").kind, ErrorKind::InvalidJson(_)));
    assert!(matches!(err("").kind, ErrorKind::InvalidJson(_)));
}

#[test]
fn invalid_utf8_is_an_error_naming_the_offset() {
    let mut line = br#"{"type":"ping","id":"r1","x":"#.to_vec();
    line.extend_from_slice(b"\"\xff\"}");
    let e = parse_command(&mut line).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidUtf8 { offset: 30 });
    assert_eq!(e.request_id, rid("r1"));
    assert_eq!(e.to_reply(), Bytes::from_static(br#"{"type":"error","requestId":"r1","code":"invalid_utf8","message":"invalid UTF-8 at byte 30"}"#));
}

#[test]
fn missing_field_is_an_error_naming_the_field() {
    assert_eq!(err(r#"{"id":"a"}"#).kind, ErrorKind::MissingField("type"));
    assert_eq!(
        err(r#"{"type":"subscribe","id":"a"}"#).kind,
        ErrorKind::MissingField("stream")
    );
    assert_eq!(
        err(r#"{"type":"unsubscribe","id":"a"}"#).kind,
        ErrorKind::MissingField("subscriptionId")
    );
    assert_eq!(
        err(r#"{"type":"publish","id":"a"}"#).kind,
        ErrorKind::MissingField("message")
    );
    assert_eq!(
        err(r#"{"type":"publish","message":{"stream":"s"}}"#).kind,
        ErrorKind::MissingField("message.type")
    );
    assert_eq!(
        err(r#"{"type":"publish","message":{"type":"t"}}"#).kind,
        ErrorKind::MissingField("message.stream")
    );
    let e = err(r#"{"type":"subscribe","id":"a"}"#);
    assert_eq!(e.request_id, rid("a"));
    assert_eq!(e.to_reply(), Bytes::from_static(br#"{"type":"error","requestId":"a","code":"missing_field","message":"missing field `stream`"}"#));
}

#[test]
fn wrongly_typed_field_is_an_error_naming_the_field_and_types() {
    let cases = [
        (r#"{"type":7}"#, "type", "a string", "a number"),
        (
            r#"{"type":"subscribe","stream":["s"]}"#,
            "stream",
            "a string",
            "an array",
        ),
        (
            r#"{"type":"subscribe","stream":"s","deviceId":1.5}"#,
            "deviceId",
            "a string or null",
            "a number",
        ),
        (
            r#"{"type":"subscribe","stream":"s","subscriptionId":{}}"#,
            "subscriptionId",
            "a string or null",
            "an object",
        ),
        (
            r#"{"type":"unsubscribe","subscriptionId":true}"#,
            "subscriptionId",
            "a string",
            "a boolean",
        ),
        (
            r#"{"type":"publish","message":"x"}"#,
            "message",
            "an object",
            "a string",
        ),
        (
            r#"{"type":"publish","message":null}"#,
            "message",
            "an object",
            "null",
        ),
        (
            r#"{"type":"publish","message":{"type":"t","stream":"s","deviceId":5}}"#,
            "message.deviceId",
            "a string or null",
            "a number",
        ),
        (
            r#"{"type":"publish","message":{"type":"t","stream":"s","deviceSessionUuid":[]}}"#,
            "message.deviceSessionUuid",
            "a string or null",
            "an array",
        ),
        (
            r#"{"type":"ping","id":{"a":1}}"#,
            "id",
            "a string or a number",
            "an object",
        ),
    ];
    for (line, field, expected, got) in cases {
        assert_eq!(
            err(line).kind,
            ErrorKind::WrongType {
                field,
                expected,
                got
            },
            "{line}"
        );
    }
    assert_eq!(
        err(r#"{"type":"subscribe","id":"q","stream":1}"#).request_id,
        rid("q")
    );
}

#[test]
fn invalid_values_are_errors_naming_the_field() {
    for (line, field) in [
        (r#"{"type":"subscribe","stream":""}"#, "stream"),
        (r#"{"type":"subscribe","stream":"a/b"}"#, "stream"),
        (
            r#"{"type":"subscribe","stream":"s","deviceId":""}"#,
            "deviceId",
        ),
        (
            r#"{"type":"publish","message":{"type":"t","stream":"x/y"}}"#,
            "message.stream",
        ),
    ] {
        assert!(
            matches!(err(line).kind, ErrorKind::InvalidValue { field: f, .. } if f == field),
            "{line}"
        );
    }
}

#[test]
fn unknown_command_is_an_error_naming_it() {
    let e = err(r#"{"type":"subscirbe","id":"r9"}"#);
    assert_eq!(e.kind, ErrorKind::UnknownCommand("subscirbe".into()));
    assert_eq!(
        e.to_reply(),
        Bytes::from_static(br#"{"type":"error","requestId":"r9","code":"unknown_command","message":"unknown command `subscirbe`"}"#)
    );
}

#[test]
fn error_messages_are_escaped_json() {
    let e = err(r#"{"type":"a\"b\\c","id":"q\"1"}"#);
    let reply = e.to_reply();
    let v: serde_json::Value = serde_json::from_slice(&reply).unwrap();
    assert_eq!(v["requestId"], "q\"1");
    assert_eq!(v["message"], "unknown command `a\"b\\c`");
}

#[test]
fn published_message_with_line_breaks_in_its_whitespace_stays_one_line() {
    let line = "{\"type\":\"publish\",\"message\":{\r\n  \"type\": \"t\",\n  \"stream\": \"s\",\"text\":\"a\\nb\"\n}}";
    let Command::Publish { message, .. } = parse(line).unwrap() else {
        panic!()
    };
    assert_eq!(
        &message[..],
        b"{    \"type\": \"t\",   \"stream\": \"s\",\"text\":\"a\\nb\" }"
    );
}

/// JSON forbids raw control bytes inside strings, and the message is forwarded byte for byte, so a publish carrying one is refused with the request id.
#[test]
fn a_message_with_an_unescaped_control_character_is_refused() {
    for bad in [
        "{\"type\":\"publish\",\"id\":7,\"message\":{\"stream\":\"s\",\"type\":\"t\",\"x\":\"a\u{1}b\"}}",
        "{\"type\":\"publish\",\"id\":7,\"message\":{\"stream\":\"s\",\"type\":\"t\",\"x\":\"a\u{0}\"}}",
        "{\"type\":\"publish\",\"id\":7,\"message\":{\"stream\":\"s\",\"type\":\"t\",\"x\":\"a\tb\"}}",
        "{\"type\":\"publish\",\"id\":7,\"message\":{\"stream\":\"s\",\"type\":\"t\",\"x\":\"a\nb\"}}",
    ] {
        let e = err(bad);
        assert!(matches!(e.kind, ErrorKind::InvalidJson(_)), "{bad:?}: {e}");
        assert!(e.to_string().contains("control character"), "{e}");
        assert_eq!(e.request_id, Some(RequestId::Int(7)), "{bad:?}");
    }
    // Outside strings a tab or a line break is whitespace, and an escaped one is just text.
    let good = "{\"type\":\"publish\",\"id\":7,\"message\":{\"stream\":\"s\",\t\"type\":\"t\",\n\"x\":\"a\\u0001\\tb\\\\\"}}";
    assert!(parse(good).is_ok(), "{good:?}");
}

/// The nesting limit is checked before any recursion: a line nested far deeper than any stack
/// could follow gets a named error with its id, and the next line parses.
#[test]
fn nesting_deeper_than_max_json_depth_is_refused_by_name() {
    for n in [200, 13_084, 1_000_000] {
        let line = format!(
            r#"{{"type":"ping","id":1,"x":{}{}}}"#,
            "[".repeat(n),
            "]".repeat(n)
        );
        let e = err(&line);
        assert_eq!(e.kind, ErrorKind::TooDeep { limit: 128 }, "depth {n}");
        assert_eq!(e.request_id, Some(RequestId::Int(1)));
        assert_eq!(e.kind.code(), "limit_exceeded");
        let reply = String::from_utf8(e.to_reply().to_vec()).unwrap();
        assert!(reply.contains(r#""limit":"max_json_depth""#), "{reply}");
        // In a publish's message too: the fast path hands it over, the full parser refuses it.
        let line = format!(
            r#"{{"type":"publish","id":2,"message":{{"type":"t","stream":"s","x":{}{}}}}}"#,
            "{\"a\":".repeat(n),
            "}".repeat(n)
        );
        assert_eq!(err(&line).kind, ErrorKind::TooDeep { limit: 128 });
    }
    // 128 levels are allowed: the command object, and 127 arrays.
    let line = format!(
        r#"{{"type":"ping","x":{}{}}}"#,
        "[".repeat(127),
        "]".repeat(127)
    );
    assert!(parse(&line).is_ok());
    // A configured limit applies to the fast path too.
    let mut parser = CommandParser::default().max_depth(3);
    let mut line = br#"{"type":"publish","message":{"type":"t","stream":"s","x":[[1]]}}"#.to_vec();
    assert_eq!(
        parser.parse(&mut line).unwrap_err().kind,
        ErrorKind::TooDeep { limit: 3 }
    );
}

/// A lone surrogate escape is refused by name, whichever half it is, so no two spellings of a
/// stream name decode to one string.
#[test]
fn a_lone_surrogate_escape_is_refused_by_name() {
    for s in [r"\ud800", r"\udfff", r"\udbff\u0041", r"\udc00\ud800"] {
        let line = format!(r#"{{"type":"subscribe","id":"r","stream":"{s}"}}"#);
        let e = err(&line);
        assert!(
            matches!(e.kind, ErrorKind::LoneSurrogate { offset: 39 }),
            "{line}: {e}"
        );
        assert_eq!(e.kind.code(), "lone_surrogate");
        assert_eq!(e.request_id, rid("r"));
    }
    // A pair is one character, as written raw.
    let Command::Subscribe { stream, .. } =
        parse(r#"{"type":"subscribe","stream":"\ud83d\ude00"}"#).unwrap()
    else {
        panic!()
    };
    assert_eq!(stream, "😀");
    let Command::Subscribe { stream, .. } =
        parse(r#"{"type":"subscribe","stream":"\u0000"}"#).unwrap()
    else {
        panic!()
    };
    assert_eq!(stream, "\0");
}

/// Keys are compared as the strings they decode to, and a field the server reads may be given
/// once at each level it reads: in the command and in its message.
#[test]
fn a_field_the_server_reads_given_twice_is_refused_at_every_level() {
    for (line, field) in [
        (
            r#"{"type":"subscribe","stream":"a","stream":"b"}"#,
            "stream",
        ),
        (
            r#"{"type":"subscribe","stream":"a","str\u0065am":"b"}"#,
            "stream",
        ),
        (
            r#"{"type":"publish","message":{"type":"t","stream":"a","stream":"b"}}"#,
            "message.stream",
        ),
        (
            r#"{"type":"publish","message":{"type":"t","stream":"a","deviceId":"x","deviceId":"y"}}"#,
            "message.deviceId",
        ),
        (
            r#"{"type":"publish","message":{"type":"t","type":"u","stream":"a"}}"#,
            "message.type",
        ),
        (
            r#"{"type":"publish","message":{"type":"t","stream":"a","deviceSessionUuid":null,"deviceSessionUuid":"s"}}"#,
            "message.deviceSessionUuid",
        ),
        (
            r#"{"type":"publish","message":{"type":"t","stream":"a","id":1,"id":2}}"#,
            "message.id",
        ),
    ] {
        let e = err(line);
        assert_eq!(e.kind, ErrorKind::DuplicateField(field), "{line}");
        assert_eq!(e.kind.code(), "duplicate_field");
    }
    // A `message` is read by `publish` alone: on another command it is an unknown field, and
    // unknown fields are ignored, repeats inside them too.
    for line in [
        r#"{"type":"ping","id":2,"message":{"stream":"a","stream":"b"}}"#,
        r#"{"type":"ping","message":{"type":"t","type":"u"}}"#,
    ] {
        assert!(matches!(parse(line), Ok(Command::Ping { .. })), "{line}");
    }
    assert!(matches!(
        parse(r#"{"type":"subscribe","stream":"s","message":{"id":1,"id":2}}"#),
        Ok(Command::Subscribe { .. })
    ));
    // An escaped key that decodes to a field is that field.
    let Command::Subscribe { stream, .. } =
        parse(r#"{"type":"subscribe","str\u0065am":"s"}"#).unwrap()
    else {
        panic!()
    };
    assert_eq!(stream, "s");
    // Repeats of other members are JSON, and forwarded as written.
    assert!(parse(
        r#"{"type":"publish","x":1,"x":2,"message":{"type":"t","stream":"s","n":1,"n":2}}"#
    )
    .is_ok());
}

/// Any valid JSON number is accepted where the server does not need its value, and an id is
/// echoed exactly as it was sent.
#[test]
fn every_valid_json_number_is_accepted_and_an_id_is_echoed_as_sent() {
    for id in [
        "18446744073709551616",
        "123456789012345678901234567890",
        "1e999999",
        "-0",
        "1.5",
        "1E+2",
        "-9223372036854775809",
    ] {
        let line = format!(r#"{{"type":"ping","id":{id}}}"#);
        let Command::Ping { id: Some(got) } = parse(&line).unwrap() else {
            panic!("{line}")
        };
        let mut echoed = Vec::new();
        got.write_json(&mut echoed);
        assert_eq!(echoed, id.as_bytes());
        // And an error echoes it the same way.
        let line = format!(r#"{{"type":"nope","id":{id}}}"#);
        let reply = String::from_utf8(err(&line).to_reply().to_vec()).unwrap();
        assert!(reply.contains(&format!(r#""requestId":{id},"#)), "{reply}");
    }
    let Command::Ping { id } = parse(r#"{"type":"ping","id":9223372036854775807}"#).unwrap() else {
        panic!()
    };
    assert_eq!(id, Some(RequestId::Int(i64::MAX)));
    let big = format!(
        r#"{{"type":"publish","message":{{"type":"t","stream":"s","n":{}}}}}"#,
        "7".repeat(100_000)
    );
    assert!(parse(&big).is_ok());
    assert!(parse(r#"{"type":"publish","message":{"type":"t","stream":"s","n":[1e999999,-0,12345678901234567890123]}}"#).is_ok());
}

/// An error never echoes more than MAX_ECHO_BYTES of a client's text, however long it was.
#[test]
fn an_error_echoes_at_most_128_bytes_of_client_text() {
    let name = "x".repeat(512 << 10);
    let line = format!(r#"{{"type":"{name}","id":1}}"#);
    let reply = err(&line).to_reply();
    assert!(reply.len() < 300, "{} bytes", reply.len());
    let e = err(&line);
    assert!(e.to_string().contains(&"x".repeat(128)));
    assert!(!e.to_string().contains(&"x".repeat(129)));
    // Cut at a character boundary.
    let line = format!(r#"{{"type":"{}"}}"#, "é".repeat(100));
    assert!(err(&line).to_string().contains(&"é".repeat(64)));
}

/// Names live as long as a subscription, in several copies: a subscription id or device id
/// longer than MAX_NAME_BYTES is refused by name, in a subscribe and in a publish.
#[test]
fn a_name_longer_than_256_bytes_is_refused_by_name() {
    let long = "d".repeat(257);
    for (line, field) in [
        (
            format!(r#"{{"type":"subscribe","stream":"s","deviceId":"{long}"}}"#),
            "deviceId",
        ),
        (
            format!(r#"{{"type":"subscribe","stream":"s","subscriptionId":"{long}"}}"#),
            "subscriptionId",
        ),
        (
            format!(r#"{{"type":"subscribe","stream":"{long}"}}"#),
            "stream",
        ),
        (
            format!(r#"{{"type":"unsubscribe","subscriptionId":"{long}"}}"#),
            "subscriptionId",
        ),
        (
            format!(
                r#"{{"type":"publish","message":{{"type":"t","stream":"s","deviceId":"{long}"}}}}"#
            ),
            "message.deviceId",
        ),
    ] {
        let e = err(&line);
        assert!(
            matches!(&e.kind, ErrorKind::InvalidValue { field: f, reason } if *f == field && reason.contains("256")),
            "{field}: {e}"
        );
    }
    let e = err(r#"{"type":"unsubscribe","subscriptionId":""}"#);
    assert!(
        matches!(&e.kind, ErrorKind::InvalidValue { field: "subscriptionId", reason } if reason.contains("empty")),
        "{e}"
    );
    assert_eq!(
        err(r#"{"type":"unsubscribe"}"#).kind,
        ErrorKind::MissingField("subscriptionId")
    );
    let ok = "d".repeat(256);
    assert!(parse(&format!(
        r#"{{"type":"subscribe","stream":"s","deviceId":"{ok}","subscriptionId":"{ok}"}}"#
    ))
    .is_ok());
    assert!(parse(&format!(
        r#"{{"type":"unsubscribe","subscriptionId":"{ok}"}}"#
    ))
    .is_ok());
}

/// A subscription id the server makes up (`stream-N`) keeps to the bound a client's is held to,
/// so it can be given back in `unsubscribe`: a stream name near the bound is cut to make room.
#[test]
fn a_generated_subscription_id_is_at_most_256_bytes() {
    use powerhub::protocol::{Action, Session, SessionConfig};
    let mut session = Session::new(1, SessionConfig::default());
    for stream in ["s".repeat(256), "é".repeat(128), "s".repeat(250)] {
        let mut line = format!(r#"{{"type":"subscribe","stream":"{stream}"}}"#).into_bytes();
        let Action::Subscribe {
            subscription_id, ..
        } = session.handle_line(&mut line)
        else {
            panic!("not subscribed: {stream}");
        };
        assert!(subscription_id.len() <= 256, "{}", subscription_id.len());
        assert!(stream.starts_with(subscription_id.rsplit_once('-').unwrap().0));
        let mut line = format!(r#"{{"type":"unsubscribe","subscriptionId":"{subscription_id}"}}"#)
            .into_bytes();
        assert!(
            matches!(session.handle_line(&mut line), Action::Unsubscribe { .. }),
            "{subscription_id}"
        );
    }
}

/// An error echoes only an id the client sent: one the reader stopped inside (`01`) is not
/// echoed; `id` and `requestId` together are one field given twice.
#[test]
fn an_error_echoes_only_an_id_that_was_read_whole() {
    for line in [
        r#"{"type":"ping","id":01}"#,
        r#"{"type":"ping","id":12abc}"#,
        r#"{"type":"ping","id":007}"#,
    ] {
        let e = err(line);
        assert_eq!(e.request_id, None, "{line}: {e}");
        assert!(matches!(e.kind, ErrorKind::InvalidJson(_)), "{line}");
    }
    // Through `requestId` after a null `id`: the same rule.
    for line in [
        r#"{"type":"ping","id":null,"requestId":01}"#,
        r#"{"type":"ping","id":null,"requestId":12abc}"#,
    ] {
        let e = err(line);
        assert_eq!(e.request_id, None, "{line}: {e}");
    }
    assert_eq!(
        err(r#"{"type":"ping","id":null,"requestId":12,"x":tru}"#).request_id,
        Some(RequestId::Int(12))
    );
    // Read whole, then an error after it: echoed, also when the error is just past the id
    // (the line cut short after it, a wrong closer).
    assert_eq!(
        err(r#"{"type":"ping","id":12,"x":tru}"#).request_id,
        Some(RequestId::Int(12))
    );
    for (line, id) in [
        (r#"{"type":"ping","id":"x""#, RequestId::Str("x".into())),
        (r#"{"type":"ping","id":"x"]"#, RequestId::Str("x".into())),
        (r#"{"type":"ping","id":7"#, RequestId::Int(7)),
        (r#"{"type":"ping","id":7]"#, RequestId::Int(7)),
        (r#"{"type":"ping","id":7 x"#, RequestId::Int(7)),
    ] {
        let e = err(line);
        assert_eq!(e.request_id, Some(id), "{line}: {e}");
        assert!(matches!(e.kind, ErrorKind::InvalidJson(_)), "{line}");
    }
    // `id` and its alias `requestId` both given, even one of them `null`: the alias is named.
    for line in [
        r#"{"type":"ping","id":1,"requestId":2}"#,
        r#"{"type":"ping","id":null,"requestId":3}"#,
        r#"{"type":"ping","requestId":null,"id":3}"#,
        r#"{"type":"publish","id":1,"requestId":2,"message":{"type":"t","stream":"s"}}"#,
    ] {
        assert_eq!(
            err(line).kind,
            ErrorKind::DuplicateField("requestId"),
            "{line}"
        );
    }
    // A repeated field leaves the line JSON: an id after the repeat is read and echoed.
    let e = err(r#"{"type":"subscribe","stream":"s","stream":"t","id":"late"}"#);
    assert_eq!(e.kind, ErrorKind::DuplicateField("stream"));
    assert_eq!(e.request_id, Some(RequestId::Str("late".into())));
    let e = err(r#"{"type":"publish","message":{"type":"t","stream":"s","stream":"x"},"id":7}"#);
    assert_eq!(e.kind, ErrorKind::DuplicateField("message.stream"));
    assert_eq!(e.request_id, Some(RequestId::Int(7)));
}
