//! Property tests of the decoder: random bytes and mutated frames and handshakes, fed in random
//! splits, give errors and never panic; memory stays bounded; any split of the input gives the
//! same events; valid traffic decodes to what a plain model of the messages says.

mod util;

use powerhub_plugin::{
    BytesMut, Inbound, ProtocolError, ProtocolLimits, ProtocolOutput, StreamProtocol,
};
use powerhub_websocket::{WebSocket, WebSocketConfig};
use proptest::prelude::*;
use util::*;

const MAX_FRAME: usize = 4096;
const MAX_MESSAGE: usize = 8192;
const MAX_HANDSHAKE: usize = 1024;

fn conn() -> WebSocket {
    let config = WebSocketConfig::default()
        .with_max_frame_bytes(MAX_FRAME)
        .with_max_message_bytes(MAX_MESSAGE)
        .with_max_handshake_bytes(MAX_HANDSHAKE)
        .with_serve_page(true);
    factory(config).connection(&ProtocolLimits::default())
}

/// Everything a connection produced from one input.
#[derive(Debug, PartialEq)]
struct Run {
    events: Vec<Inbound>,
    urgent: Vec<u8>,
    error: Option<ProtocolError>,
}

/// Feeds `bytes` cut at `cuts` (positions, any order), checking the memory bounds after every
/// call; stops at the first error.
fn run(bytes: &[u8], cuts: &[usize]) -> Run {
    let mut conn = conn();
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.push(bytes.len());
    points.sort_unstable();
    let mut input = BytesMut::new();
    let mut out = ProtocolOutput::default();
    let mut run = Run {
        events: Vec::new(),
        urgent: Vec::new(),
        error: None,
    };
    let mut start = 0;
    for end in points {
        input.extend_from_slice(&bytes[start..end]);
        start = end;
        let result = conn.decode(&mut input, &mut out);
        run.events.append(&mut out.events);
        run.urgent.extend_from_slice(&out.urgent);
        out.clear();
        assert!(
            conn.buffered_bytes() <= MAX_MESSAGE + 125,
            "codec holds {} bytes",
            conn.buffered_bytes()
        );
        if let Err(error) = result {
            assert_eq!(input.len(), 0, "input is dropped after an error");
            run.error = Some(error);
            break;
        }
        if conn.is_ready() {
            assert!(
                input.len() < 14,
                "only a partial header stays in the input, not {}",
                input.len()
            );
        } else {
            assert!(
                input.len() <= MAX_HANDSHAKE,
                "handshake input grew to {}",
                input.len()
            );
        }
    }
    run
}

/// One client operation of valid traffic.
#[derive(Debug, Clone)]
enum Op {
    /// A message cut into fragments at `cuts`, with an optional ping after the first fragment.
    Message {
        text: bool,
        payload: Vec<u8>,
        cuts: Vec<usize>,
        ping: Option<Vec<u8>>,
    },
    Ping(Vec<u8>),
    Pong(Vec<u8>),
}

fn op() -> impl Strategy<Value = Op> {
    let control = proptest::collection::vec(any::<u8>(), 0..=125);
    prop_oneof![
        4 => (any::<bool>(), ".{0,200}", proptest::collection::vec(any::<u8>(), 0..300),
              proptest::collection::vec(0usize..400, 0..4), proptest::option::of(control.clone()))
            .prop_map(|(text, s, bin, cuts, ping)| Op::Message {
                payload: if text { s.into_bytes() } else { bin },
                text,
                cuts,
                ping,
            }),
        1 => control.clone().prop_map(Op::Ping),
        1 => control.prop_map(Op::Pong),
    ]
}

/// Client bytes for `ops` (after a valid handshake), the events and urgent bytes a correct
/// server produces for them (the model), and where each frame starts.
fn encode(ops: &[Op], close: Option<u16>, key: [u8; 4]) -> (Vec<u8>, Vec<Inbound>, Vec<u8>) {
    let mut bytes = request("/", "").into_bytes();
    let mut events = Vec::new();
    let mut urgent = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Accept: {ACCEPT}\r\n\r\n"
    )
    .into_bytes();
    let pong = |payload: &[u8], urgent: &mut Vec<u8>| {
        urgent.extend([0x8a, payload.len() as u8]);
        urgent.extend_from_slice(payload);
    };
    for op in ops {
        match op {
            Op::Message {
                text,
                payload,
                cuts,
                ping,
            } => {
                let mut points: Vec<usize> = cuts.iter().map(|c| c % (payload.len() + 1)).collect();
                points.sort_unstable();
                points.push(payload.len());
                let mut start = 0;
                for (i, &end) in points.iter().enumerate() {
                    let opcode = if i == 0 {
                        if *text {
                            1
                        } else {
                            2
                        }
                    } else {
                        0
                    };
                    bytes.extend(frame(
                        i + 1 == points.len(),
                        opcode,
                        &payload[start..end],
                        key,
                    ));
                    start = end;
                    if let (0, Some(ping)) = (i, ping) {
                        bytes.extend(frame(true, 0x9, ping, key));
                        pong(ping, &mut urgent);
                    }
                }
                let data = payload.clone().into();
                events.push(if *text {
                    Inbound::Text(data)
                } else {
                    Inbound::Binary(data)
                });
            }
            Op::Ping(payload) => {
                bytes.extend(frame(true, 0x9, payload, key));
                pong(payload, &mut urgent);
            }
            Op::Pong(payload) => {
                bytes.extend(frame(true, 0xA, payload, key));
                events.push(Inbound::Pong);
            }
        }
    }
    if let Some(code) = close {
        bytes.extend(frame(true, 0x8, &code.to_be_bytes(), key));
        urgent.extend([0x88, 2]);
        urgent.extend(code.to_be_bytes());
        events.push(Inbound::Close {
            code,
            reason: String::new(),
        });
    }
    (bytes, events, urgent)
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, bit: u8 },
    Set { at: usize, byte: u8 },
    Insert { at: usize, bytes: Vec<u8> },
    Delete { at: usize, len: usize },
    Truncate { at: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (any::<usize>(), 1usize..16).prop_map(|(at, len)| Mutation::Delete { at, len }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
    ]
}

fn mutate(bytes: &mut Vec<u8>, mutations: &[Mutation]) {
    for m in mutations {
        if bytes.is_empty() {
            return;
        }
        let n = bytes.len();
        match m {
            Mutation::Flip { at, bit } => bytes[at % n] ^= 1 << bit,
            Mutation::Set { at, byte } => bytes[at % n] = *byte,
            Mutation::Insert { at, bytes: new } => {
                let at = at % (n + 1);
                bytes.splice(at..at, new.iter().copied());
            }
            Mutation::Delete { at, len } => {
                let at = at % n;
                bytes.drain(at..(at + len).min(n));
            }
            Mutation::Truncate { at } => bytes.truncate(at % n),
        }
    }
}

fn cuts() -> impl Strategy<Value = Vec<usize>> {
    proptest::collection::vec(any::<usize>(), 0..24)
}

/// A few handshake shapes to mutate: upgrades, page requests, junk headers.
fn handshake() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(request("/", "").into_bytes()),
        Just(request("/", "Origin: http://x.test\r\n").into_bytes()),
        Just(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n".to_vec()),
        Just(b"HEAD /?q=1 HTTP/1.0\r\n\r\n".to_vec()),
        ".{0,300}".prop_map(|s| format!("GET /{s} HTTP/1.1\r\nHost: h\r\n\r\n").into_bytes()),
        // Leading empty lines, which HTTP parsers skip.
        "[\r\n]{0,8}".prop_map(|s| format!("{s}{}", request("/", "")).into_bytes()),
    ]
}

proptest! {
    // 512 cases unless PROPTEST_CASES asks for another number.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(512),
        ..ProptestConfig::default()
    })]

    /// Random bytes, before and after a valid handshake: errors or partial input, never a panic,
    /// and the same outcome for any split.
    #[test]
    fn random_bytes_never_panic_and_any_split_gives_the_same_events(
        upgrade in any::<bool>(),
        junk in proptest::collection::vec(any::<u8>(), 0..2048),
        split in cuts(),
    ) {
        let mut bytes = if upgrade { request("/", "").into_bytes() } else { Vec::new() };
        bytes.extend(junk);
        let whole = run(&bytes, &[]);
        prop_assert_eq!(&run(&bytes, &split), &whole);
    }

    /// Random bytes with only masked-frame-like headers: reach deeper into the frame decoder.
    #[test]
    fn random_masked_frames_never_panic_and_any_split_gives_the_same_events(
        frames in proptest::collection::vec(
            (0u8..16, any::<bool>(), proptest::collection::vec(any::<u8>(), 0..200), any::<[u8; 4]>()),
            0..12,
        ),
        split in cuts(),
    ) {
        let mut bytes = request("/", "").into_bytes();
        for (opcode, fin, payload, key) in frames {
            bytes.extend(frame(fin, opcode, &payload, key));
        }
        let whole = run(&bytes, &[]);
        prop_assert_eq!(&run(&bytes, &split), &whole);
    }

    /// Valid traffic decodes to exactly the model's events and replies, whatever the split.
    #[test]
    fn valid_traffic_matches_the_model_for_any_split(
        ops in proptest::collection::vec(op(), 0..12),
        close in proptest::option::of(prop_oneof![Just(1000u16), Just(1001), Just(3000), Just(4999)]),
        key in any::<[u8; 4]>(),
        split in cuts(),
    ) {
        let (bytes, events, urgent) = encode(&ops, close, key);
        let got = run(&bytes, &split);
        prop_assert_eq!(got, Run { events, urgent, error: None });
    }

    /// Mutated valid traffic: never a panic, bounded memory, the same outcome for any split.
    #[test]
    fn mutated_frames_never_panic_and_any_split_gives_the_same_events(
        ops in proptest::collection::vec(op(), 1..8),
        key in any::<[u8; 4]>(),
        mutations in proptest::collection::vec(mutation(), 1..6),
        split in cuts(),
    ) {
        let (mut bytes, _, _) = encode(&ops, None, key);
        mutate(&mut bytes, &mutations);
        let whole = run(&bytes, &[]);
        prop_assert_eq!(&run(&bytes, &split), &whole);
        prop_assert_eq!(&run(&bytes, &(0..bytes.len()).collect::<Vec<_>>()), &whole);
    }

    /// Mutated handshakes: an HTTP response and an error, a page, or an upgrade; never a panic.
    #[test]
    fn mutated_handshakes_never_panic_and_any_split_gives_the_same_response(
        request in handshake(),
        mutations in proptest::collection::vec(mutation(), 0..6),
        split in cuts(),
    ) {
        let mut bytes = request;
        mutate(&mut bytes, &mutations);
        let whole = run(&bytes, &[]);
        prop_assert_eq!(&run(&bytes, &split), &whole);
        // A refused handshake is answered with an HTTP error; an accepted one with 101 (bytes
        // after it are frames, which may then break a rule).
        if let Some(error) = &whole.error {
            let refused = matches!(
                error,
                ProtocolError::Handshake(_) | ProtocolError::TooLarge { what: "handshake", .. }
            );
            let expected: &[u8] = if refused { b"HTTP/1.1 4" } else { b"HTTP/1.1 101 " };
            prop_assert!(
                whole.urgent.starts_with(expected),
                "{:?}",
                String::from_utf8_lossy(&whole.urgent)
            );
        }
    }
}

/// A frame header announcing more than the limit is refused at once, before its payload is
/// read: an attacker cannot make the codec buffer past the limits.
#[test]
fn oversized_announcements_are_refused_before_buffering() {
    let mut conn = conn();
    let mut input = BytesMut::from(request("/", "").as_bytes());
    let mut out = ProtocolOutput::default();
    conn.decode(&mut input, &mut out).unwrap();
    // Fragments that add up past the message limit, fed slowly.
    let chunk = vec![0u8; MAX_FRAME];
    let mut bytes = frame(false, 2, &chunk, [1, 2, 3, 4]);
    bytes.extend(frame(false, 0, &chunk, [1, 2, 3, 4]));
    bytes.extend(frame(true, 0, &chunk, [1, 2, 3, 4]));
    let mut failed = false;
    for piece in bytes.chunks(100) {
        input.extend_from_slice(piece);
        if conn.decode(&mut input, &mut out).is_err() {
            failed = true;
            break;
        }
        assert!(conn.buffered_bytes() <= MAX_MESSAGE);
    }
    assert!(failed);
    assert_eq!(
        conn.buffered_bytes(),
        0,
        "buffers are released after an error"
    );
}

proptest! {
    /// Any valid upgrade (header names in any case and order, token lists, extra headers, a
    /// query) is accepted with the right key, whatever the split.
    #[test]
    fn valid_handshakes_in_any_form_are_accepted(
        upper in proptest::collection::vec(any::<bool>(), 6),
        order in Just((0..6usize).collect::<Vec<_>>()).prop_shuffle(),
        extra in proptest::collection::vec(("[A-Za-z][A-Za-z0-9-]{0,15}", "[ -~]{0,40}"), 0..6),
        query in proptest::option::of("[a-z0-9=&]{0,20}"),
        key in any::<[u8; 16]>(),
        split in cuts(),
    ) {
        use base64::Engine as _;
        let key = base64::engine::general_purpose::STANDARD.encode(key);
        let case = |name: &str, up: bool| if up { name.to_ascii_uppercase() } else { name.to_ascii_lowercase() };
        let fields = [
            format!("{}: localhost", case("Host", upper[0])),
            format!("{}: WebSocket", case("Upgrade", upper[1])),
            format!("{}: keep-alive, Upgrade", case("Connection", upper[2])),
            format!("{}: {key}", case("Sec-WebSocket-Key", upper[3])),
            format!("{}: 13", case("Sec-WebSocket-Version", upper[4])),
            format!("{}: http://any.test", case("Origin", upper[5])),
        ];
        let mut head = format!("GET /{} HTTP/1.1\r\n", query.map(|q| format!("?{q}")).unwrap_or_default());
        for i in order {
            head.push_str(&fields[i]);
            head.push_str("\r\n");
        }
        for (name, value) in extra {
            if !name.to_ascii_lowercase().starts_with("sec-websocket") {
                head.push_str(&format!("X-{name}: {}\r\n", value.trim()));
            }
        }
        head.push_str("\r\n");
        let got = run(head.as_bytes(), &split);
        prop_assert_eq!(got.error, None);
        let response = String::from_utf8(got.urgent).unwrap();
        prop_assert!(response.starts_with("HTTP/1.1 101 Switching Protocols\r\n"), "{}", response);
        let accept = format!("Sec-WebSocket-Accept: {}\r\n", powerhub_websocket::accept_key(key.as_bytes()));
        prop_assert!(response.contains(&accept), "{}", response);
    }
}
