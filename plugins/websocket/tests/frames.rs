//! Data framing, control frames and limits (RFC 6455 sections 5 and 7), one test per rule,
//! with the close code each violation must produce.

mod util;

use powerhub_plugin::{BytesMut, Inbound, ProtocolError, ProtocolLimits, ProtocolOutput};
use powerhub_websocket::WebSocketConfig;
use util::*;

const TEXT: u8 = 0x1;
const BINARY: u8 = 0x2;
const CONT: u8 = 0x0;
const CLOSE: u8 = 0x8;
const PING: u8 = 0x9;
const PONG: u8 = 0xA;
const K: [u8; 4] = [1, 2, 3, 4];

fn text(s: &str) -> Inbound {
    Inbound::Text(s.to_owned().into())
}

#[test]
fn text_message_is_decoded_and_unmasked() {
    let step = after_upgrade(&data(TEXT, b"{\"type\":\"ping\"}"));
    assert_eq!(step.result, Ok(()));
    assert_eq!(step.events, vec![text("{\"type\":\"ping\"}")]);
    assert!(step.urgent.is_empty());
}

#[test]
fn binary_message_is_decoded_and_not_utf8_checked() {
    let step = after_upgrade(&data(BINARY, &[0xff, 0x00, 0xc0]));
    assert_eq!(
        step.events,
        vec![Inbound::Binary(vec![0xff, 0x00, 0xc0].into())]
    );
}

#[test]
fn empty_messages_are_delivered() {
    let mut bytes = data(TEXT, b"");
    bytes.extend(frame(false, BINARY, b"", K));
    bytes.extend(frame(true, CONT, b"", K));
    let step = after_upgrade(&bytes);
    assert_eq!(
        step.events,
        vec![text(""), Inbound::Binary(Default::default())]
    );
}

#[test]
fn lengths_16_and_64_bit_are_decoded() {
    let medium = "m".repeat(300);
    let large = "L".repeat(70_000);
    let mut bytes = data(TEXT, medium.as_bytes());
    bytes.extend(data(TEXT, large.as_bytes()));
    let step = after_upgrade(&bytes);
    assert_eq!(step.events, vec![text(&medium), text(&large)]);
}

#[test]
fn several_messages_in_one_read_are_all_decoded() {
    let mut bytes = Vec::new();
    for i in 0..5 {
        bytes.extend(data(TEXT, format!("{i}").as_bytes()));
    }
    let step = after_upgrade(&bytes);
    assert_eq!(step.events.len(), 5);
    assert_eq!(step.left, 0);
}

#[test]
fn partial_frame_is_consumed_so_the_input_buffer_stays_small() {
    let mut conn = upgraded(WebSocketConfig::default());
    let frame = data(BINARY, &[7u8; 5000]);
    let mut input = BytesMut::new();
    let mut out = ProtocolOutput::default();
    for chunk in frame.chunks(700) {
        input.extend_from_slice(chunk);
        conn.decode(&mut input, &mut out).unwrap();
        assert!(
            input.len() < 14,
            "a partial frame stays in the codec, not the input"
        );
    }
    assert_eq!(out.events, vec![Inbound::Binary(vec![7u8; 5000].into())]);
}

#[test]
fn unmasked_client_frame_closes_1002() {
    let mut bytes = data(TEXT, b"hi");
    bytes[1] &= 0x7f;
    let reason = assert_closed_with(&after_upgrade(&bytes), 1002);
    assert!(reason.contains("not masked"), "{reason}");
}

#[test]
fn reserved_bits_close_1002() {
    for bit in [0x40, 0x20, 0x10] {
        let mut bytes = data(TEXT, b"hi");
        bytes[0] |= bit;
        let reason = assert_closed_with(&after_upgrade(&bytes), 1002);
        assert!(reason.contains("reserved bits"), "{reason}");
    }
}

#[test]
fn unknown_opcodes_close_1002() {
    for opcode in [0x3, 0x7, 0xB, 0xF] {
        let reason = assert_closed_with(&after_upgrade(&data(opcode, b"")), 1002);
        assert!(reason.contains("unknown opcode"), "{reason}");
    }
}

#[test]
fn control_frame_over_125_bytes_closes_1002() {
    let reason = assert_closed_with(&after_upgrade(&data(PING, &[0u8; 126])), 1002);
    assert!(reason.contains("125"), "{reason}");
}

#[test]
fn fragmented_control_frame_closes_1002() {
    let reason = assert_closed_with(&after_upgrade(&frame(false, PING, b"x", K)), 1002);
    assert!(reason.contains("fragmented control"), "{reason}");
}

#[test]
fn continuation_without_a_started_message_closes_1002() {
    let reason = assert_closed_with(&after_upgrade(&data(CONT, b"x")), 1002);
    assert!(reason.contains("continuation"), "{reason}");
}

#[test]
fn new_data_frame_inside_a_fragmented_message_closes_1002() {
    let mut bytes = frame(false, TEXT, b"a", K);
    bytes.extend(data(BINARY, b"b"));
    let reason = assert_closed_with(&after_upgrade(&bytes), 1002);
    assert!(reason.contains("inside a fragmented message"), "{reason}");
}

#[test]
fn fragmented_message_is_reassembled() {
    let mut bytes = frame(false, TEXT, b"{\"a\":", K);
    bytes.extend(frame(false, CONT, b"", [9, 9, 9, 9]));
    bytes.extend(frame(true, CONT, b"1}", [5, 6, 7, 8]));
    let step = after_upgrade(&bytes);
    assert_eq!(step.events, vec![text("{\"a\":1}")]);
}

#[test]
fn control_frames_interleaved_in_a_fragmented_message_are_handled() {
    let mut bytes = frame(false, TEXT, b"hel", K);
    bytes.extend(data(PING, b"p1"));
    bytes.extend(data(PONG, b""));
    bytes.extend(frame(true, CONT, b"lo", K));
    let step = after_upgrade(&bytes);
    assert_eq!(step.result, Ok(()));
    assert_eq!(step.events, vec![Inbound::Pong, text("hello")]);
    assert_eq!(
        server_frames(&step.urgent),
        vec![(true, PONG, b"p1".to_vec())]
    );
}

#[test]
fn ping_is_answered_with_a_pong_in_urgent_with_the_same_payload() {
    let step = after_upgrade(&data(PING, b"are you there"));
    assert!(step.events.is_empty());
    assert_eq!(
        server_frames(&step.urgent),
        vec![(true, PONG, b"are you there".to_vec())]
    );
}

#[test]
fn pong_is_reported_as_inbound_pong() {
    let step = after_upgrade(&data(PONG, b"whatever"));
    assert_eq!(step.events, vec![Inbound::Pong]);
    assert!(step.urgent.is_empty());
}

#[test]
fn control_frames_never_queue_behind_data() {
    // The server has a large data frame encoded (queued by the runtime) when a ping arrives:
    // the pong goes to `urgent`, which the runtime writes before queued data.
    let mut conn = upgraded(WebSocketConfig::default());
    let mut queued = BytesMut::new();
    conn.encode_binary(&[0u8; 100_000], &mut queued).unwrap();
    let step = feed(conn.as_mut(), &data(PING, b"1"));
    assert_eq!(
        server_frames(&step.urgent),
        vec![(true, PONG, b"1".to_vec())]
    );
    assert_eq!(queued.len(), 100_010);
}

#[test]
fn close_is_echoed_with_the_same_code() {
    let mut conn = upgraded(WebSocketConfig::default());
    let step = feed(conn.as_mut(), &data(CLOSE, &close_payload(1001, "bye")));
    assert_eq!(step.result, Ok(()));
    assert_eq!(
        step.events,
        vec![Inbound::Close {
            code: 1001,
            reason: "bye".into()
        }]
    );
    assert_eq!(close_of(&step.urgent).0, 1001);
    assert!(!conn.is_ready());
}

#[test]
fn close_without_a_code_is_answered_empty_and_reported_as_1005() {
    let step = after_upgrade(&data(CLOSE, b""));
    assert_eq!(
        step.events,
        vec![Inbound::Close {
            code: 1005,
            reason: String::new()
        }]
    );
    assert_eq!(server_frames(&step.urgent), vec![(true, CLOSE, Vec::new())]);
}

#[test]
fn close_with_an_invalid_code_closes_1002() {
    for code in [0, 999, 1004, 1005, 1006, 1015, 1016, 2999, 5000, 65535] {
        let step = after_upgrade(&data(CLOSE, &close_payload(code, "")));
        let reason = assert_closed_with(&step, 1002);
        assert!(reason.contains("invalid close code"), "{code}: {reason}");
        assert!(step.events.is_empty());
    }
}

#[test]
fn close_with_a_valid_code_is_accepted() {
    for code in [
        1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014, 3000, 4999,
    ] {
        let step = after_upgrade(&data(CLOSE, &close_payload(code, "")));
        assert_eq!(step.result, Ok(()), "{code}");
        assert_eq!(close_of(&step.urgent).0, code);
    }
}

#[test]
fn close_with_a_one_byte_payload_closes_1002() {
    assert_closed_with(&after_upgrade(&data(CLOSE, &[3])), 1002);
}

#[test]
fn close_reason_not_utf8_closes_1007() {
    let mut payload = close_payload(1000, "");
    payload.extend_from_slice(&[0xff, 0xfe]);
    assert_closed_with(&after_upgrade(&data(CLOSE, &payload)), 1007);
}

#[test]
fn input_after_the_peer_close_is_ignored() {
    let mut bytes = data(CLOSE, &close_payload(1000, ""));
    bytes.extend(data(TEXT, b"late"));
    bytes.extend([0xff; 20]);
    let mut conn = upgraded(WebSocketConfig::default());
    let step = feed(conn.as_mut(), &bytes);
    assert_eq!(step.result, Ok(()));
    assert_eq!(step.events.len(), 1);
    assert_eq!(step.left, 0);
    let step = feed(conn.as_mut(), &data(PING, b""));
    assert!(step.events.is_empty() && step.urgent.is_empty() && step.result.is_ok());
}

#[test]
fn invalid_utf8_text_closes_1007() {
    let reason = assert_closed_with(&after_upgrade(&data(TEXT, b"ok \xc0\xaf")), 1007);
    assert!(reason.contains("UTF-8"), "{reason}");
    // An encoded surrogate is not UTF-8 either.
    assert_closed_with(&after_upgrade(&data(TEXT, b"\xed\xa0\x80")), 1007);
}

#[test]
fn invalid_utf8_is_found_in_the_first_fragment_before_the_message_ends() {
    let step = after_upgrade(&frame(false, TEXT, b"ab\xff", K));
    assert_closed_with(&step, 1007);
}

#[test]
fn utf8_sequence_split_across_fragments_is_valid() {
    let euro = "€".as_bytes();
    let mut bytes = frame(false, TEXT, &euro[..1], K);
    bytes.extend(frame(false, CONT, &euro[1..2], K));
    bytes.extend(frame(true, CONT, &euro[2..], K));
    let step = after_upgrade(&bytes);
    assert_eq!(step.events, vec![text("€")]);
}

#[test]
fn truncated_utf8_at_the_end_of_a_message_closes_1007() {
    let euro = "€".as_bytes();
    let mut bytes = frame(false, TEXT, b"x", K);
    bytes.extend(frame(true, CONT, &euro[..2], K));
    assert_closed_with(&after_upgrade(&bytes), 1007);
    assert_closed_with(&after_upgrade(&data(TEXT, &euro[..2])), 1007);
}

#[test]
fn frame_over_max_frame_bytes_closes_1009_naming_the_limit() {
    let mut conn = upgraded(WebSocketConfig::default().with_max_frame_bytes(100));
    // Only the header is sent: the limit applies before the payload arrives.
    let header = &data(BINARY, &[0u8; 101])[..6];
    let step = feed(conn.as_mut(), header);
    assert_closed_with(&step, 1009);
    assert_eq!(
        step.result,
        Err(ProtocolError::TooLarge {
            what: "frame",
            limit_name: "max_frame_bytes",
            size: 101,
            limit: 100
        })
    );
    assert!(step
        .result
        .unwrap_err()
        .to_string()
        .contains("max_frame_bytes"));
}

#[test]
fn message_over_max_message_bytes_closes_1009_naming_the_limit() {
    let mut conn = upgraded(WebSocketConfig::default().with_max_message_bytes(100));
    let mut bytes = frame(false, BINARY, &[0u8; 60], K);
    bytes.extend(frame(true, CONT, &[0u8; 60], K));
    let step = feed(conn.as_mut(), &bytes);
    assert_closed_with(&step, 1009);
    assert_eq!(
        step.result,
        Err(ProtocolError::TooLarge {
            what: "message",
            limit_name: "max_message_bytes",
            size: 120,
            limit: 100
        })
    );
}

#[test]
fn message_limit_is_the_tighter_of_config_and_runtime() {
    let factory = factory(WebSocketConfig::default());
    let mut conn = factory.connection(&ProtocolLimits::default().with_max_message_bytes(10));
    assert!(feed(&mut conn, request("/", "").as_bytes()).result.is_ok());
    let step = feed(&mut conn, &data(TEXT, b"01234567890"));
    assert_closed_with(&step, 1009);
}

#[test]
fn length_64_bit_with_the_top_bit_set_closes_1002() {
    let bytes = [0x82, 0xff, 0x80, 0, 0, 0, 0, 0, 0, 1, 1, 2, 3, 4];
    assert_closed_with(&after_upgrade(&bytes), 1002);
}

#[test]
fn non_minimal_length_encoding_closes_1002() {
    let bytes = [0x82, 0x80 | 126, 0, 5, 1, 2, 3, 4, 0, 0, 0, 0, 0];
    assert_closed_with(&after_upgrade(&bytes), 1002);
    let bytes = [0x82, 0x80 | 127, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 1, 2, 3, 4];
    assert_closed_with(&after_upgrade(&bytes), 1002);
}

#[test]
fn protocol_error_is_sticky_and_discards_input() {
    let mut conn = upgraded(WebSocketConfig::default());
    let first = feed(conn.as_mut(), &[0x81, 0x02, b'h', b'i']);
    let again = feed(conn.as_mut(), &data(TEXT, b"x"));
    assert!(first.result.is_err());
    assert_eq!(first.result, again.result);
    assert!(again.urgent.is_empty() && again.events.is_empty());
    assert_eq!(again.left, 0);
}

#[test]
fn events_before_a_violation_are_kept() {
    let mut bytes = data(TEXT, b"first");
    bytes.extend([0x81, 0x01, b'x']);
    let step = after_upgrade(&bytes);
    assert_eq!(step.events, vec![text("first")]);
    assert_closed_with(&step, 1002);
}

#[test]
fn server_frames_are_unmasked_text_and_binary() {
    let mut conn = upgraded(WebSocketConfig::default());
    let mut wire = BytesMut::new();
    conn.encode_text(b"{\"n\":1}", &mut wire);
    conn.encode_binary(&[1, 2, 3], &mut wire).unwrap();
    conn.encode_text(&[b'x'; 300], &mut wire);
    assert_eq!(
        server_frames(&wire),
        vec![
            (true, TEXT, b"{\"n\":1}".to_vec()),
            (true, BINARY, vec![1, 2, 3]),
            (true, TEXT, vec![b'x'; 300])
        ]
    );
}

#[test]
fn encode_ping_writes_a_ping_frame() {
    let mut conn = upgraded(WebSocketConfig::default());
    let mut wire = BytesMut::new();
    assert!(conn.encode_ping(&mut wire));
    assert_eq!(server_frames(&wire), vec![(true, PING, Vec::new())]);
}

#[test]
fn server_close_then_peer_reply_completes_without_a_second_close() {
    let mut conn = upgraded(WebSocketConfig::default());
    let mut wire = BytesMut::new();
    conn.encode_close(1001, "shutting down", &mut wire);
    assert_eq!(close_of(&wire), (1001, "shutting down".to_owned()));
    assert!(!conn.is_ready());
    // No data frame may follow a close frame.
    let mut after = BytesMut::new();
    conn.encode_text(b"{}", &mut after);
    assert!(conn.encode_binary(b"x", &mut after).is_err());
    conn.encode_close(1000, "", &mut after);
    assert!(after.is_empty());
    // A ping in flight is not answered any more; the peer's close ends the handshake.
    let mut bytes = data(PING, b"");
    bytes.extend(data(CLOSE, &close_payload(1001, "")));
    let step = feed(conn.as_mut(), &bytes);
    assert_eq!(step.result, Ok(()));
    assert_eq!(
        step.events,
        vec![Inbound::Close {
            code: 1001,
            reason: String::new()
        }]
    );
    assert!(step.urgent.is_empty());
}

#[test]
fn violation_after_server_close_sends_no_second_close() {
    let mut conn = upgraded(WebSocketConfig::default());
    conn.encode_close(1000, "", &mut BytesMut::new());
    let step = feed(conn.as_mut(), &[0x81, 0x01, b'x']);
    assert!(step.result.is_err());
    assert!(step.urgent.is_empty());
}

#[test]
fn not_ready_before_the_handshake() {
    let conn = connection(WebSocketConfig::default());
    assert!(!conn.is_ready());
    assert_eq!(conn.name(), "websocket");
}

/// Decodes `bytes` on an upgraded connection, then ends the stream.
fn ended(bytes: &[u8]) -> Step {
    let mut conn = upgraded(WebSocketConfig::default());
    let mut input = BytesMut::from(bytes);
    let mut out = ProtocolOutput::default();
    let mut result = conn.decode(&mut input, &mut out);
    if result.is_ok() {
        result = conn.decode_end(&mut input, &mut out);
    }
    Step {
        result,
        events: out.events,
        urgent: out.urgent.to_vec(),
        left: input.len(),
    }
}

#[test]
fn a_frame_or_message_cut_short_by_the_end_of_stream_is_a_protocol_error_1002() {
    let whole = data(TEXT, b"{\"type\":\"ping\"}");
    let ok = ended(&whole);
    assert_eq!(ok.result, Ok(()));
    assert_eq!(ok.events, vec![text("{\"type\":\"ping\"}")]);
    assert!(ok.urgent.is_empty());
    for cut in 1..whole.len() {
        let step = ended(&whole[..cut]);
        let reason = assert_closed_with(&step, 1002);
        assert!(
            reason.contains("the stream ended inside a frame"),
            "{reason}"
        );
        assert_eq!(step.left, 0);
    }
    // A fragmented message whose final frame never came.
    let step = ended(&frame(false, TEXT, b"{\"a\"", K));
    let reason = assert_closed_with(&step, 1002);
    assert!(reason.contains("fragmented message"), "{reason}");
}

#[test]
fn a_handshake_cut_short_by_the_end_of_stream_gets_http_400() {
    let mut conn = connection(WebSocketConfig::default());
    let mut input = BytesMut::from(&b"GET / HTTP/1.1\r\nHost: x\r\n"[..]);
    let mut out = ProtocolOutput::default();
    conn.decode(&mut input, &mut out).unwrap();
    let err = conn.decode_end(&mut input, &mut out).unwrap_err();
    assert!(matches!(err, ProtocolError::Handshake(_)), "{err}");
    assert_eq!(status_of(&out.urgent), 400);
    // Nothing at all before the end: nothing to say.
    let mut conn = connection(WebSocketConfig::default());
    let mut out = ProtocolOutput::default();
    assert_eq!(conn.decode_end(&mut BytesMut::new(), &mut out), Ok(()));
    assert!(out.urgent.is_empty());
}
