//! The push connection fed arbitrary bytes, without sockets: the real
//! [`PushConnection`](powerhub::push::PushConnection) (stream protocol, push session, outbox and
//! urgent lane, deadlines) decodes what arrives and runs its commands; this check is its driver,
//! as the server's shard is: publishes go to a real hub (driven by hand), and what the hub holds
//! for a subscribed topic is fanned out as the shard's fan-out does (cut into batches, each
//! encoded once per wire format, the same `Bytes` to every subscription of the topic). What
//! the connection offers goes to a socket that takes all, part or none of it, on a virtual
//! clock. (The shard's tap of a topic is a hub receiver here, with room for everything.)
//!
//! What must hold: nothing panics; everything written is well framed for the protocol and every
//! message in it is a JSON object that was either published or is a message type the server
//! sends (a reply, a keepalive ping, a `frames_dropped` notice, an error); once drained, the
//! connection holds nothing; a shutdown after that is said and written in full.
//!
//! Input: byte 0 chooses the protocol (bits 0-1: ndjson, websocket, frame, ndjson), whether the
//! check frames the lines itself (bit 2: the rest is lines, each sent as one message of the
//! protocol) or sends the rest as it is, small limits (bit 3) and the slow-consumer setting
//! (bits 4-5; only `disconnect` acts on a push connection), and whether the server requires
//! authentication (bit 6: static tokens `tok`, whose user has permissions, per-user limits of its
//! own and a publish rate, and `t2`, whose user has none; the seeds carry the tokens, which the
//! fuzzer cannot guess through their hash); byte 1 seeds the schedule (receive sizes, what the
//! socket takes, clock steps).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use powerhub::hub::{
    Driver, Hub, HubOptions, PublishOptions, Receiver, SlowConsumer, SubscribeOptions,
    TryRecvError, MAX_QUEUE_LIMIT,
};
use powerhub::outbox::{OutboxConfig, PayloadFactory};
use powerhub::plugin::frame::{self, FrameError};
use powerhub::plugin::{Inbound, ProtocolError, ProtocolFactory, ProtocolLimits};
use powerhub::protocol::{AuthPolicy, Session, SessionConfig};
use powerhub::push::{PushConfig, PushConnection, PushLimits, PushState, Request};
use powerhub::security::auth::{AuthConfig, Authenticator};
use powerhub_frame::FrameFactory;
use powerhub_ndjson::{NdjsonFactory, NdjsonProtocol};
use powerhub_websocket::{WebSocketConfig, WebSocketFactory};

use super::support::{
    assert_ends_cleanly, check_http_response, client_frame, feed_chunked, feed_whole, is_json,
    is_json_object, server_frames, Rng, HANDSHAKE,
};

/// Messages per fan-out batch (the server's `subscriptions.max_batch`, small here).
const MAX_BATCH: usize = 4;

/// The limits of one run.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_message: usize,
    max_subscriptions: usize,
    high_water: usize,
    backpressure: usize,
    max_outbox: usize,
}

impl Limits {
    fn new(small: bool) -> Self {
        if small {
            Limits {
                max_message: 256,
                max_subscriptions: 4,
                high_water: 128,
                backpressure: 256,
                max_outbox: 4096,
            }
        } else {
            Limits {
                max_message: 1 << 20,
                max_subscriptions: 256,
                high_water: 8 << 20,
                backpressure: 8 << 20,
                max_outbox: 32 << 20,
            }
        }
    }
}

/// The message types the server sends besides what was published.
const SERVER_TYPES: &[&str] = &[
    "pong",
    "published",
    "subscribed",
    "unsubscribed",
    "error",
    "authenticated",
    "ping",
    "frames_dropped",
];

/// The driver: the push connection, the hub's taps of its topics, and what the socket took.
struct Conn {
    push: PushConnection,
    /// Room in a tap: more than the messages one input can publish.
    tap_room: usize,
    /// Per subscribed topic: the tap (what the hub holds for the shard) and the subscriptions.
    topics: HashMap<String, (Receiver, Vec<Arc<str>>)>,
    /// What the socket took, in order.
    wire: Vec<u8>,
    /// Every message published.
    published: HashSet<Bytes>,
}

impl Conn {
    fn new(
        protocol: u8,
        limits: Limits,
        disconnect: bool,
        auth: bool,
        input: usize,
        now: Instant,
    ) -> Self {
        let protocol_limits = ProtocolLimits::default().with_max_message_bytes(limits.max_message);
        let factory: Box<dyn ProtocolFactory> = match protocol {
            1 => {
                Box::new(WebSocketFactory::new(WebSocketConfig::default()).expect("a valid config"))
            }
            2 => Box::new(FrameFactory),
            _ => Box::new(NdjsonFactory),
        };
        let proto = factory.new_connection(&protocol_limits);
        let outbox = OutboxConfig {
            high_water_bytes: limits.high_water,
            ..OutboxConfig::default()
        };
        let push_limits = PushLimits::default()
            .with_max_outbox_bytes(limits.max_outbox)
            .with_disconnect_backlog_bytes(disconnect.then_some(limits.backpressure));
        // Publish runs gathered, as the server's shards drive connections.
        let config = PushConfig::new(push_limits, outbox, Arc::new(PayloadFactory))
            .expect("a valid config")
            .with_publish_runs(true);
        let session_config = SessionConfig {
            max_line_bytes: limits.max_message,
            max_subscriptions: limits.max_subscriptions,
            ..SessionConfig::default()
        };
        let mut session = Session::new(7, session_config);
        if auth {
            session = session.with_auth(auth_policy());
        }
        Conn {
            push: PushConnection::new(proto, session, &Arc::new(config), now)
                .expect("a valid config"),
            tap_room: (input + 16).min(MAX_QUEUE_LIMIT),
            topics: HashMap::new(),
            wire: Vec::new(),
            published: HashSet::new(),
        }
    }

    fn is_open(&self) -> bool {
        self.push.state() == PushState::Open
    }

    /// Received bytes: the connection decodes them; the driver does what it asks (the shard's
    /// `after_input`).
    fn receive(&mut self, hub: &Hub, bytes: &[u8], now: Instant) {
        self.push.handle_input(bytes, now);
        self.run(hub, now);
    }

    /// Input left waiting for the output to drain is handled once it is no longer held (the
    /// shard's `resume_input`, after a write or at the connection's timer).
    fn resume(&mut self, hub: &Hub, now: Instant) {
        if self.resumable(now) {
            self.run(hub, now);
        }
    }

    /// Whether input waits that is no longer held.
    fn resumable(&self, now: Instant) -> bool {
        self.push.input_waiting() && !self.push.input_held(now)
    }

    /// Does what the connection asks for its decoded input (the shard's `run_input`).
    fn run(&mut self, hub: &Hub, now: Instant) {
        while let Some(request) = self.push.poll(now, SystemTime::now()) {
            match request {
                Request::FanOut => self.deliver(hub, now),
                Request::Subscribe {
                    subscription_id,
                    topic,
                    ..
                } => {
                    // What the topic holds was published before this subscription.
                    self.fan_out(hub, &topic, now);
                    let result = match self.topics.get_mut(&topic) {
                        Some((_, subs)) => {
                            subs.push(subscription_id);
                            Ok(())
                        }
                        None => {
                            let tap = SubscribeOptions::default()
                                .max_queue(self.tap_room)
                                .slow_consumer(SlowConsumer::DropNewest);
                            hub.receiver(&topic, tap).map(|rx| {
                                self.topics
                                    .insert(topic.clone(), (rx, vec![subscription_id]));
                            })
                        }
                    };
                    self.push.subscribe_done(result, now);
                }
                Request::Unsubscribe {
                    subscription_id,
                    topic,
                } => {
                    // What the topic holds was published before the unsubscribe.
                    self.fan_out(hub, &topic, now);
                    if let Some((_, subs)) = self.topics.get_mut(&topic) {
                        subs.retain(|s| *s != subscription_id);
                        if subs.is_empty() {
                            self.topics.remove(&topic);
                        }
                    }
                    self.push.unsubscribe_done(now);
                }
                Request::Publish { message } => {
                    let topics: Vec<String> =
                        self.push.publish_topics().map(String::from).collect();
                    assert!(
                        is_json_object(message.bytes()),
                        "a published message is not JSON"
                    );
                    self.published.insert(message.bytes().clone());
                    let mut result = Ok(0);
                    for topic in &topics {
                        match hub.publish(topic, message.clone(), PublishOptions::default()) {
                            Ok(n) => result = result.map(|t| t + n),
                            Err(e) => result = Err(e),
                        }
                    }
                    self.push.publish_done(result, now);
                }
                Request::PublishRun { messages } => {
                    // As the shard publishes a run: in order, to its one topic.
                    let topics: Vec<String> =
                        self.push.publish_topics().map(String::from).collect();
                    assert_eq!(topics.len(), 1, "a run has one topic");
                    for message in messages {
                        assert!(
                            is_json_object(message.bytes()),
                            "a published message is not JSON"
                        );
                        self.published.insert(message.bytes().clone());
                        let _ = hub.publish(&topics[0], message, PublishOptions::default());
                    }
                }
                other => panic!("a request this check does not know: {other:?}"),
            }
        }
        self.settle();
    }

    /// A close the connection decided ends its subscriptions (the shard's `release_session`).
    fn settle(&mut self) {
        if !self.is_open() {
            self.push.take_subscriptions();
            // Dropping a tap ends its hub subscription.
            self.topics.clear();
        }
    }

    /// Fans out what the hub holds for `topic` (the shard's `fan_out_slot`): batches of
    /// [`MAX_BATCH`], each encoded once, the same `Bytes` to every subscription of the topic.
    fn fan_out(&mut self, hub: &Hub, topic: &str, now: Instant) {
        hub.turn(now);
        let Some((rx, subs)) = self.topics.get_mut(topic) else {
            return;
        };
        let mut messages = Vec::new();
        let mut closed = false;
        loop {
            match rx.try_recv() {
                Ok(r) => messages.push(r.into_message()),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Lagged { missed }) => {
                    panic!("the tap of {topic:?} lost {missed} message(s): the check's fault")
                }
                Err(_) => {
                    closed = true;
                    break;
                }
            }
        }
        let subs = subs.clone();
        for batch in messages.chunks(MAX_BATCH) {
            let texts = || batch.iter().filter(|m| m.is_json()).map(|m| &m.bytes()[..]);
            if texts().count() == 0 {
                continue;
            }
            if self.push.hub_frames() {
                let frame = frame::encode_json_batch(texts()).expect("a batch frames");
                for _ in &subs {
                    self.push.deliver_frame(frame.clone(), now);
                }
            } else {
                let lines = frame::encode_ndjson_batch(texts());
                for sub in &subs {
                    self.push.deliver_lines(sub, lines.clone(), now);
                }
            }
        }
        if closed {
            self.topics.remove(topic);
            if let Some(sub) = subs.first() {
                self.push.subscription_ended(sub, now);
            }
            self.settle();
        }
    }

    /// Fans out every subscribed topic, then the checks before a write (`max_outbox_bytes`,
    /// and under `disconnect` a connection behind).
    fn deliver(&mut self, hub: &Hub, now: Instant) {
        let topics: Vec<String> = self.topics.keys().cloned().collect();
        for topic in &topics {
            self.fan_out(hub, topic, now);
        }
        self.push.check_limits(now);
        self.settle();
    }

    /// One write: the connection offers its bytes, the socket takes `take(offered)` of them.
    fn write(&mut self, now: Instant, take: impl FnOnce(usize) -> usize) {
        let mut chunks = Vec::new();
        let Some(transmit) = self.push.poll_transmit(&mut chunks, 64, now) else {
            return;
        };
        let offered = transmit.len();
        assert_eq!(offered, chunks.iter().map(Bytes::len).sum::<usize>());
        assert!(offered > 0, "an empty transmit");
        let taken = take(offered).min(offered);
        let mut left = taken;
        for chunk in &chunks {
            let n = left.min(chunk.len());
            self.wire.extend_from_slice(&chunk[..n]);
            left -= n;
        }
        self.push.on_written(transmit, taken, now);
    }

    /// The shard's tick for this connection.
    fn tick(&mut self, now: Instant) {
        if self.push.poll_timeout().is_some_and(|t| t <= now) {
            self.push.handle_timeout(now, SystemTime::now());
            self.settle();
        }
    }
}

/// The policy of a server with `[auth]`: two static tokens (see the module docs).
fn auth_policy() -> AuthPolicy {
    let config: AuthConfig = serde_json::from_str(
        r#"{"tokens":[
            {"token":"tok","user":"u",
             "permissions":{"publish":{"allow":["obs","obs/>"],"deny":["obs/secret"]},
                            "subscribe":{"allow":["obs","obs/*","$stats"]}},
             "limits":{"max_subscriptions":3},
             "rates":{"publish_messages_per_second":20}},
            {"token":"t2","user":"v"}],
           "max_connections_per_user":1}"#,
    )
    .expect("a valid [auth]");
    let mut policy = AuthPolicy::new(Arc::new(
        Authenticator::from_config(&config).expect("a valid authenticator"),
    ));
    policy.max_connections_per_user = config.max_connections_per_user;
    policy
}

/// The client's bytes for `lines`, each sent as one message of the protocol.
fn frame_lines(protocol: u8, body: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut stream = Vec::new();
    match protocol {
        1 => {
            stream.extend_from_slice(HANDSHAKE);
            for line in body.split(|&b| b == b'\n') {
                let key = (rng.next() as u32).to_be_bytes();
                let opcode = if std::str::from_utf8(line).is_ok() {
                    1
                } else {
                    2
                };
                match rng.below(8) {
                    0 if line.len() > 1 => {
                        let (a, b) = line.split_at(line.len() / 2);
                        client_frame(&mut stream, false, opcode, a, key);
                        client_frame(&mut stream, true, 9, b"p", key);
                        client_frame(&mut stream, true, 0, b, key);
                    }
                    1 => {
                        client_frame(&mut stream, true, 10, b"", key);
                        client_frame(&mut stream, true, opcode, line, key);
                    }
                    _ => client_frame(&mut stream, true, opcode, line, key),
                }
            }
        }
        2 => {
            for line in body.split(|&b| b == b'\n') {
                let f = if is_json(line) && !line.is_empty() {
                    frame::encode_json_batch([line])
                } else {
                    frame::encode_raw(line)
                };
                stream.extend_from_slice(&f.expect("a small frame encodes"));
            }
        }
        _ => {
            stream.extend_from_slice(body);
            stream.push(b'\n');
        }
    }
    stream
}

/// The check.
pub(crate) fn check(data: &[u8]) {
    let [mode, seed, body @ ..] = data else {
        return;
    };
    let protocol = mode & 3;
    let limits = Limits::new(mode & 8 != 0);
    // 1 and 3: drop-newest and drop-oldest, which leave a push connection to the outbox.
    let disconnect = (mode >> 4) & 3 == 2;
    let auth = mode & 0x40 != 0;
    let mut rng = Rng::new(u64::from(*seed));
    let stream = if mode & 4 != 0 {
        frame_lines(protocol, body, &mut rng)
    } else {
        body.to_vec()
    };

    if protocol == 0 || protocol == 3 {
        ndjson_splits(&stream, limits.max_message, &mut rng.clone());
    }

    let mut now = Instant::now();
    let mut conn = Conn::new(protocol, limits, disconnect, auth, stream.len(), now);
    let hub = Hub::new(
        powerhub::transport::SpySink::new(),
        HubOptions::default().driver(Driver::Manual),
    )
    .expect("valid hub options");

    let mut at = 0;
    while at < stream.len() && conn.push.state() != PushState::Aborted {
        let n = rng.receive().min(stream.len() - at);
        conn.receive(&hub, &stream[at..at + n], now);
        at += n;
        conn.deliver(&hub, now);
        let how = rng.below(8);
        let cut = rng.next() as usize;
        conn.write(now, |offered| match how {
            0 => 0,
            1 => cut % (offered + 1),
            _ => offered,
        });
        conn.resume(&hub, now);
        if conn.push.outbox().wants_writable() && rng.below(4) != 0 {
            conn.push.on_writable(now);
        }
        now += match rng.below(64) {
            0 => Duration::from_secs(20),
            1..=3 => Duration::from_secs(5),
            _ => Duration::from_millis(1),
        };
        conn.tick(now);
        conn.resume(&hub, now);
    }

    // The end: no more input; the hub's queues are delivered and everything written, at one
    // instant (no timer fires), until nothing moves.
    let mut rounds = 0;
    loop {
        hub.turn(now);
        conn.deliver(&hub, now);
        conn.push.on_writable(now);
        let before = conn.wire.len();
        conn.write(now, |offered| offered);
        conn.resume(&hub, now);
        let idle =
            hub.poll_timeout().is_none() && conn.wire.len() == before && !conn.resumable(now);
        if idle {
            break;
        }
        rounds += 1;
        assert!(rounds < 100_000, "the hub and the connection never settle");
    }
    let drained = conn.push.state() != PushState::Aborted;
    if drained {
        // A protocol that is not ready (a WebSocket before its handshake) takes no data; what
        // its outbox holds stays there until the close.
        let ready = protocol != 1 || conn.wire.starts_with(b"HTTP/1.1 101 ");
        if ready && conn.push.state() == PushState::Open {
            assert!(conn.push.is_written(), "bytes left unsent after the drain");
            let stats = conn.push.stats();
            assert_eq!(
                (stats.queued, stats.queued_bytes),
                (0, 0),
                "messages left queued"
            );
        }
        // The shutdown is said, and everything before it written.
        conn.push.shutdown(now);
        conn.settle();
        for _ in 0..10_000 {
            conn.push.on_writable(now);
            let before = conn.wire.len();
            conn.write(now, |offered| offered);
            if conn.wire.len() == before {
                break;
            }
        }
        if ready || protocol != 1 {
            assert!(conn.push.is_written(), "the close was not written in full");
        }
    }
    hub.close();

    let messages = wire_messages(protocol, &conn.wire, drained);
    // A connection that closed on a decode error ends with the protocol's final error (on
    // WebSocket its close frame, checked with the frames): nothing follows it.
    let decode_error = matches!(
        conn.push.close_reason(),
        Some("max_message_bytes" | "protocol_error")
    );
    if decode_error && protocol != 1 && conn.push.is_written() {
        let last = messages.last().expect("the final error was written");
        assert!(
            is_error(last),
            "the final error is not last: {:?}",
            String::from_utf8_lossy(last)
        );
    }
    for m in &messages {
        assert!(
            is_json_object(m),
            "a message written is not a JSON object: {m:?}"
        );
        let known = conn.published.contains(&m[..]) || is_server_message(m);
        assert!(
            known,
            "a message nobody sent: {:?}",
            String::from_utf8_lossy(m)
        );
    }
}

/// Whether `m` is an `error` message.
fn is_error(m: &[u8]) -> bool {
    message_type(m).is_some_and(|t| t == "error")
}

/// The `ndjson` framing splits the same lines off however the bytes arrive; a line over the
/// limit is refused either way (its size counts the bytes seen when it was refused, which
/// depends on the receives).
fn ndjson_splits(stream: &[u8], max_line: usize, rng: &mut Rng) {
    let mut proto = NdjsonProtocol::new(max_line);
    let whole = feed_whole(&mut proto, stream);
    assert_ends_cleanly(&mut proto, &whole);
    let chunked = feed_chunked(&mut NdjsonProtocol::new(max_line), stream, rng);
    assert_eq!(whole.events, chunked.events, "ndjson: whole and in chunks");
    match (&whole.result, &chunked.result) {
        (Ok(()), Ok(())) => {
            assert_eq!(whole.rest, chunked.rest);
            assert!(whole.urgent.is_empty() && chunked.urgent.is_empty());
        }
        (
            Err(ProtocolError::TooLarge { what, limit, .. }),
            Err(ProtocolError::TooLarge {
                what: what2,
                limit: limit2,
                ..
            }),
        ) => assert_eq!((what, limit), (what2, limit2)),
        other => panic!("ndjson: whole and in chunks end differently: {other:?}"),
    }
    for event in &whole.events {
        match event {
            Inbound::Text(line) => {
                assert!(line.len() <= max_line && !line.contains(&b'\n'));
                assert!(
                    !line.iter().all(u8::is_ascii_whitespace),
                    "an empty line decoded"
                );
            }
            other => panic!("ndjson decoded {other:?}"),
        }
    }
}

/// A message of a type the server sends.
fn is_server_message(m: &[u8]) -> bool {
    message_type(m).is_some_and(|t| SERVER_TYPES.contains(&t.as_str()))
}

/// The string `type` of the JSON object `m`. Its other members are skipped, not converted: an
/// id the server echoes as sent may be any valid JSON number (`2e2222`, 400 digits), which
/// `serde_json::Value` cannot hold.
fn message_type(m: &[u8]) -> Option<String> {
    struct TypeOf;
    impl<'de> serde::de::Visitor<'de> for TypeOf {
        type Value = Option<String>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut kind = None;
            while let Some(key) = map.next_key::<String>()? {
                if key == "type" {
                    kind = Some(map.next_value::<String>()?);
                } else {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
            Ok(kind)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(m);
    let kind = serde::Deserializer::deserialize_map(&mut de, TypeOf).ok()?;
    de.end().ok()?;
    kind
}

/// The JSON messages of what the socket took, framed as `protocol` frames them (a WebSocket's
/// opening handshake response first); unless `drained`, the last one may be partial (and is
/// left out).
fn wire_messages(protocol: u8, wire: &[u8], drained: bool) -> Vec<Vec<u8>> {
    match protocol {
        1 => {
            if wire.is_empty() {
                return Vec::new();
            }
            let Some(end) = wire.windows(4).position(|w| w == b"\r\n\r\n") else {
                assert!(!drained, "a partial HTTP response after the drain");
                return Vec::new();
            };
            if !wire.starts_with(b"HTTP/1.1 101 ") {
                // A refusal or the page: an HTTP response, and nothing after it.
                if drained {
                    check_http_response(wire);
                }
                return Vec::new();
            }
            let (frames, partial) = server_frames(&wire[end + 4..]);
            assert!(partial == 0 || !drained, "a partial frame after the drain");
            let mut closed = false;
            let mut out = Vec::new();
            for f in frames {
                assert!(f.fin, "a fragmented server frame");
                assert!(!closed, "a frame after the close frame");
                match f.opcode {
                    1 => {
                        assert!(
                            std::str::from_utf8(&f.payload).is_ok(),
                            "a text frame not UTF-8"
                        );
                        out.push(f.payload);
                    }
                    9 => assert!(f.payload.is_empty(), "a keepalive ping with a payload"),
                    10 => {}
                    8 => closed = true,
                    other => panic!("the server wrote opcode {other:#x}"),
                }
            }
            out
        }
        2 => {
            let mut out = Vec::new();
            let mut rest = wire;
            while !rest.is_empty() {
                let (f, used) = match frame::decode_prefix(rest) {
                    Ok(f) => f,
                    Err(FrameError::Truncated { .. }) if !drained => break,
                    Err(e) => panic!("the wire holds no whole frame: {e}"),
                };
                let elements = f.json_messages().expect("frames of JSON");
                out.extend(elements.into_iter().map(<[u8]>::to_vec));
                rest = &rest[used..];
            }
            out
        }
        _ => {
            let whole = match wire.iter().rposition(|&b| b == b'\n') {
                Some(end) => &wire[..=end],
                None => &[][..],
            };
            assert!(
                whole.len() == wire.len() || !drained,
                "a partial line after the drain"
            );
            whole
                .split(|&b| b == b'\n')
                .filter(|l| !l.is_empty())
                .map(<[u8]>::to_vec)
                .collect()
        }
    }
}
