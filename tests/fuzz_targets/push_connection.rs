//! The push connection fed arbitrary bytes, without sockets: the connection's stream protocol
//! (ndjson, websocket or frame) decodes what arrives, each inbound text goes through the push
//! [`Session`], its publishes to a real hub (driven by hand), and what the hub holds for a
//! subscribed topic is fanned out as the shard's fan-out does (`runtime/shard.rs`,
//! `fan_out_slot`): cut into batches, each encoded once per wire format, the same `Bytes` into
//! the connection's [`Outbox`], the subscriptions' only queue. What the outbox writes goes to a
//! socket that takes all, part or none of it, on a virtual clock. It is the shard's
//! per-connection path with the IO taken out (the shard's tap of a topic is a hub receiver
//! here, with room for everything: the tap is lossless).
//!
//! What must hold: nothing panics; everything written is well framed for the protocol and every
//! message in it is a JSON object that was either a reply, a published message, a keepalive
//! ping or a `frames_dropped` notice; every reply is written, in order (replies are lossless);
//! once drained, the outbox holds nothing.
//!
//! Input: byte 0 chooses the protocol (bits 0-1: ndjson, websocket, frame, ndjson), whether the
//! check frames the lines itself (bit 2: the rest is lines, each sent as one message of the
//! protocol) or sends the rest as it is, small limits (bit 3) and the slow-consumer setting
//! (bits 4-5; only `disconnect` acts on a push connection); byte 1 seeds the schedule (receive
//! sizes, what the socket takes, clock steps).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use powerhub::hub::{
    Driver, Hub, HubOptions, PublishOptions, Receiver, SlowConsumer, SubscribeOptions,
    TryRecvError, MAX_QUEUE_LIMIT,
};
use powerhub::outbox::{Framing, Outbox, OutboxConfig, PayloadFactory, TimeoutAction, PING_JSON};
use powerhub::plugin::frame::{self, FrameError};
use powerhub::plugin::{
    Inbound, ProtocolError, ProtocolFactory, ProtocolLimits, ProtocolOutput, StreamProtocol,
};
use powerhub::protocol::{reply, Action, Session, SessionConfig};
use powerhub_frame::FrameFactory;
use powerhub_ndjson::{NdjsonFactory, NdjsonProtocol};
use powerhub_websocket::{WebSocketConfig, WebSocketFactory};

use super::support::{
    check_http_response, client_frame, feed_chunked, feed_whole, is_json, is_json_object,
    server_frames, Rng, HANDSHAKE,
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

/// The connection: what the runtime's `Conn` holds, less the socket, with the shard's fan-out
/// of its topics.
struct Conn {
    proto: Box<dyn StreamProtocol>,
    hub_frames: bool,
    inbuf: BytesMut,
    output: ProtocolOutput,
    outbox: Outbox,
    session: Session,
    limits: Limits,
    /// `subscriptions.slow_consumer = "disconnect"`.
    disconnect: bool,
    /// Room in a tap: more than the messages one input can publish (the shard's tap has no
    /// bound; the hub allocates a receiver's queue to its room).
    tap_room: usize,
    /// Per subscribed topic: the tap (what the hub holds for the shard) and the subscriptions.
    topics: HashMap<String, (Receiver, Vec<Arc<str>>)>,
    /// Still taking commands and deliveries (the runtime's `State::Open`).
    open: bool,
    /// The liveness timeout reaped it: nothing more is written.
    reaped: bool,
    /// Everything the protocol put in `urgent`, and the urgent messages the connection framed.
    urgent: Vec<u8>,
    /// What the socket took of the outbox's bytes, in order.
    wire: Vec<u8>,
    /// Every lossless message pushed to the outbox, in order.
    controls: Vec<Bytes>,
    /// Every message published.
    published: HashSet<Bytes>,
}

impl Conn {
    fn new(protocol: u8, limits: Limits, disconnect: bool, input: usize, now: Instant) -> Self {
        let protocol_limits = ProtocolLimits::default().with_max_message_bytes(limits.max_message);
        let factory: Box<dyn ProtocolFactory> = match protocol {
            1 => {
                Box::new(WebSocketFactory::new(WebSocketConfig::default()).expect("a valid config"))
            }
            2 => Box::new(FrameFactory),
            _ => Box::new(NdjsonFactory),
        };
        let mut proto = factory.new_connection(&protocol_limits);
        // As the shard tells them apart (`frames_as_ndjson`, `frames_as_hub_frames`).
        let mut probe = BytesMut::new();
        proto.encode_text(b"{}", &mut probe);
        let framing = if &probe[..] == b"{}\n" {
            Framing::Ndjson
        } else {
            Framing::Protocol
        };
        let sample = frame::encode_json_batch([&b"{}"[..]]).expect("encodes");
        let mut probe = BytesMut::new();
        proto.encode_text(&sample, &mut probe);
        let hub_frames = probe[..] == sample[..];
        let config = OutboxConfig {
            high_water_bytes: limits.high_water,
            framing,
            ..OutboxConfig::default()
        };
        let outbox = Outbox::new(config, Arc::new(PayloadFactory), now).expect("a valid config");
        // The session's own limits stay the defaults: the subscription limit is checked before
        // it (as the shard does), and the framing limits the line.
        let session = Session::new(7, SessionConfig::default());
        Conn {
            proto,
            hub_frames,
            inbuf: BytesMut::new(),
            output: ProtocolOutput::default(),
            outbox,
            session,
            limits,
            disconnect,
            tap_room: (input + 16).min(MAX_QUEUE_LIMIT),
            topics: HashMap::new(),
            open: true,
            reaped: false,
            urgent: Vec::new(),
            wire: Vec::new(),
            controls: Vec::new(),
            published: HashSet::new(),
        }
    }

    fn control(&mut self, json: Bytes, now: Instant) {
        self.controls.push(json.clone());
        self.outbox.push_control(json, now);
    }

    fn push_urgent_text(&mut self, json: &[u8]) {
        let mut buf = BytesMut::new();
        self.proto.encode_text(json, &mut buf);
        self.urgent.extend_from_slice(&buf);
    }

    fn backlog(&self) -> usize {
        let stats = self.outbox.stats();
        stats.unsent_bytes + stats.queued_bytes
    }

    /// A limit error, urgent, then the close (the shard's `close_with` of a limit ending).
    fn close_on_limit(&mut self, hub: &Hub, limit: &str, message: &str) {
        let v = serde_json::json!({
            "type": "error", "requestId": null, "code": "limit_exceeded",
            "limit": limit, "message": message,
        });
        self.push_urgent_text(v.to_string().as_bytes());
        self.begin_close(hub);
    }

    /// Received bytes: decode them and run the session on each event (the shard's
    /// `after_input`).
    fn receive(&mut self, hub: &Hub, bytes: &[u8], now: Instant) {
        if !self.open {
            return;
        }
        self.inbuf.extend_from_slice(bytes);
        self.output.clear();
        let result = self.proto.decode(&mut self.inbuf, &mut self.output);
        self.urgent.extend_from_slice(&self.output.urgent);
        let mut close = false;
        let events = std::mem::take(&mut self.output.events);
        for event in events {
            match event {
                Inbound::Text(line) => {
                    if self.on_text(hub, line, now) {
                        close = true;
                        break;
                    }
                    if self.outbox.memory_bytes() > self.limits.max_outbox {
                        let msg = "unsent output exceeds max_outbox_bytes";
                        self.close_on_limit(hub, "max_outbox_bytes", msg);
                        return;
                    }
                }
                Inbound::Binary(_) => {
                    let err = reply::error(None, "unsupported", "binary messages carry no command");
                    self.control(err, now);
                }
                Inbound::Pong => self.outbox.on_pong(now),
                Inbound::Close { .. } => {
                    close = true;
                    break;
                }
                other => panic!("an event this check does not know: {other:?}"),
            }
        }
        if result.is_err() || close {
            self.begin_close(hub);
        }
    }

    /// One inbound JSON message (the runtime's `session::on_text`); `true` to close.
    fn on_text(&mut self, hub: &Hub, line: Bytes, now: Instant) -> bool {
        let cmd = match self.session.parse(line) {
            Ok(cmd) => cmd,
            Err(e) => {
                self.control(e.to_reply(), now);
                return false;
            }
        };
        let limit = self.limits.max_subscriptions;
        if matches!(cmd, powerhub::protocol::Command::Subscribe { .. })
            && self.session.subscriptions().count() >= limit
        {
            let msg = format!("a connection may hold at most {limit} subscriptions");
            self.close_on_limit(hub, "max_subscriptions_per_connection", &msg);
            return true;
        }
        let request_id = cmd.request_id().cloned();
        match self.session.handle_command(cmd) {
            Action::Subscribe {
                subscription_id,
                topic,
                reply,
                ..
            } => {
                // What the topic holds was published before this subscription: it goes to
                // the subscriptions there were (the shard's `subscribe`).
                self.fan_out(hub, &topic, now);
                let tapped = match self.topics.get_mut(&topic) {
                    Some((_, subs)) => {
                        subs.push(Arc::clone(&subscription_id));
                        Ok(())
                    }
                    None => {
                        let tap = SubscribeOptions::default()
                            .max_queue(self.tap_room)
                            .slow_consumer(SlowConsumer::DropNewest);
                        hub.receiver(&topic, tap).map(|rx| {
                            self.topics
                                .insert(topic.clone(), (rx, vec![Arc::clone(&subscription_id)]));
                        })
                    }
                };
                match tapped {
                    Ok(()) => self.control(reply, now),
                    Err(e) => {
                        let err = self.session.subscribe_failed(
                            &subscription_id,
                            request_id.as_ref(),
                            &e.to_string(),
                        );
                        self.control(err, now);
                    }
                }
            }
            Action::Unsubscribe {
                subscription_id,
                topic,
                ack,
                ..
            } => {
                // What the topic holds was published before the unsubscribe (the shard's
                // `unsubscribe`).
                self.fan_out(hub, &topic, now);
                if let Some((_, subs)) = self.topics.get_mut(&topic) {
                    subs.retain(|s| *s != subscription_id);
                    if subs.is_empty() {
                        self.topics.remove(&topic);
                    }
                }
                self.controls.push(ack.clone());
                self.outbox.unsubscribe(&subscription_id, ack, now);
            }
            Action::Publish {
                request_id,
                topics,
                message,
                ..
            } => {
                assert!(
                    is_json_object(message.bytes()),
                    "a published message is not JSON"
                );
                self.published.insert(message.bytes().clone());
                let mut total = 0;
                let mut failure = None;
                for topic in &topics {
                    match hub.publish(topic, message.clone(), PublishOptions::default()) {
                        Ok(n) => total += n,
                        Err(e) => failure = Some(e),
                    }
                }
                match failure {
                    None if request_id.is_none() => {}
                    None => self.control(reply::published(request_id.as_ref(), total), now),
                    Some(e) => self.control(
                        reply::error(request_id.as_ref(), "publish_failed", &e.to_string()),
                        now,
                    ),
                }
            }
            Action::Reply(bytes) => self.control(bytes, now),
            Action::Pong => self.outbox.on_pong(now),
            other => panic!("an action this check does not know: {other:?}"),
        }
        false
    }

    /// Fans out what the hub holds for `topic` (the shard's `fan_out_slot`): batches of
    /// [`MAX_BATCH`], each encoded once, the same `Bytes` into the outbox for every
    /// subscription of the topic.
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
        if !self.open {
            return;
        }
        for batch in messages.chunks(MAX_BATCH) {
            let texts = || batch.iter().filter(|m| m.is_json()).map(|m| &m.bytes()[..]);
            if texts().count() == 0 {
                continue;
            }
            if self.hub_frames {
                let frame = frame::encode_json_batch(texts()).expect("a batch frames");
                for _ in &subs {
                    self.controls.push(frame.clone());
                    self.outbox.push_wire(frame.clone(), now);
                }
            } else {
                let lines = frame::encode_ndjson_batch(texts());
                for sub in &subs {
                    self.outbox.push_shared(sub, lines.clone(), now);
                }
            }
        }
        if closed {
            self.topics.remove(topic);
            self.begin_close(hub);
        }
    }

    /// Fans out every subscribed topic, then applies the shard's checks before a write
    /// (`flush_writes`): `max_outbox_bytes`, and under `disconnect` a connection behind.
    fn deliver(&mut self, hub: &Hub, now: Instant) {
        let topics: Vec<String> = self.topics.keys().cloned().collect();
        for topic in &topics {
            self.fan_out(hub, topic, now);
        }
        if !self.open {
            return;
        }
        if self.outbox.memory_bytes() > self.limits.max_outbox {
            self.close_on_limit(
                hub,
                "max_outbox_bytes",
                "unsent output exceeds max_outbox_bytes",
            );
        } else if self.disconnect
            && self.outbox.wants_writable()
            && self.session.subscriptions().next().is_some()
            && self.backlog() > self.limits.backpressure
        {
            let msg = "a connection whose socket is full fell behind under slow_consumer = \"disconnect\"";
            self.push_urgent_text(&reply::error(None, "slow_consumer", msg));
            self.begin_close(hub);
        }
    }

    /// Stops taking commands and deliveries and drops its subscriptions (`begin_close`).
    fn begin_close(&mut self, _hub: &Hub) {
        if !self.open {
            return;
        }
        self.open = false;
        self.session.close();
        // Dropping a tap ends its hub subscription.
        self.topics.clear();
    }

    /// Whether the outbox's bytes go to the socket: only to a ready protocol (a WebSocket after
    /// its handshake), but for the rest of a message already begun.
    fn can_write(&self) -> bool {
        !self.reaped && (self.proto.is_ready() || self.outbox.unsent_bytes() > 0)
    }

    /// One write: the outbox offers its bytes, the socket takes `take(offered)` of them.
    fn write(&mut self, now: Instant, take: impl FnOnce(usize) -> usize) {
        if !self.can_write() {
            return;
        }
        let mut chunks = Vec::new();
        let offered = self
            .outbox
            .poll_transmit(self.proto.as_mut(), &mut chunks, now);
        assert_eq!(offered, chunks.iter().map(Bytes::len).sum::<usize>());
        let taken = take(offered).min(offered);
        let mut left = taken;
        for chunk in &chunks {
            let n = left.min(chunk.len());
            self.wire.extend_from_slice(&chunk[..n]);
            left -= n;
        }
        if offered > 0 {
            self.outbox.on_written(taken, now);
        }
    }

    /// The shard's tick for this connection: keepalive and liveness.
    fn tick(&mut self, hub: &Hub, now: Instant) {
        if self.reaped || !self.open {
            return;
        }
        if self.outbox.poll_timeout().is_some_and(|t| t <= now)
            && self.outbox.handle_timeout(now) == TimeoutAction::Reap
        {
            self.reaped = true;
            self.begin_close(hub);
        }
    }
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
    let mut conn = Conn::new(protocol, limits, disconnect, stream.len(), now);
    let hub = Hub::new(
        powerhub::transport::SpySink::new(),
        HubOptions::default().driver(Driver::Manual),
    )
    .expect("valid hub options");

    let mut at = 0;
    while at < stream.len() && !conn.reaped {
        let n = rng.receive().min(stream.len() - at);
        conn.receive(&hub, &stream[at..at + n], now);
        at += n;
        hub.turn(now);
        conn.deliver(&hub, now);
        let how = rng.below(8);
        let cut = rng.next() as usize;
        conn.write(now, |offered| match how {
            0 => 0,
            1 => cut % (offered + 1),
            _ => offered,
        });
        if conn.outbox.wants_writable() && rng.below(4) != 0 {
            conn.outbox.on_writable(now);
        }
        now += match rng.below(64) {
            0 => Duration::from_secs(20),
            1..=3 => Duration::from_secs(5),
            _ => Duration::from_millis(1),
        };
        conn.tick(&hub, now);
    }

    // The end: no more input; the hub's queues are delivered and the outbox written out, at
    // one instant (no timer fires), until nothing moves.
    let mut rounds = 0;
    loop {
        hub.turn(now);
        conn.deliver(&hub, now);
        conn.outbox.on_writable(now);
        conn.write(now, |offered| offered);
        // A protocol that is not ready (a WebSocket before or after its handshake) takes no
        // data, so what its outbox holds stays there.
        let writes = conn.outbox.has_transmit() && conn.can_write();
        let idle = hub.poll_timeout().is_none() && !writes;
        if idle || conn.reaped {
            break;
        }
        rounds += 1;
        assert!(rounds < 100_000, "the hub and the outbox never settle");
    }
    conn.begin_close(&hub);
    hub.close();

    check_urgent(&conn);
    // Drained: every byte queued was written (a WebSocket that is closing writes no data).
    let drained = !conn.reaped && (protocol != 1 || conn.proto.is_ready());
    let messages = wire_messages(protocol, &conn.wire, drained);
    for m in &messages {
        assert!(
            is_json_object(m),
            "a message written is not a JSON object: {m:?}"
        );
        let known = conn.controls.iter().any(|c| c == m)
            || conn.published.contains(&m[..])
            || m[..] == *PING_JSON
            || is_frames_dropped(m);
        assert!(
            known,
            "a message nobody sent: {:?}",
            String::from_utf8_lossy(m)
        );
    }
    if !drained {
        return;
    }
    let stats = conn.outbox.stats();
    assert_eq!(
        conn.outbox.unsent_bytes(),
        0,
        "bytes left unsent after the drain"
    );
    assert_eq!(
        (stats.queued, stats.queued_bytes),
        (0, 0),
        "messages left queued"
    );
    assert_eq!(stats.bytes_written, conn.wire.len() as u64);
    // Replies are lossless and in order: every one appears, in order, among the messages.
    let mut written = messages.iter();
    for c in control_messages(&conn) {
        assert!(
            written.any(|m| *m == c),
            "reply {:?} not written (in order)",
            String::from_utf8_lossy(&c)
        );
    }
}

/// The `ndjson` framing splits the same lines off however the bytes arrive; a line over the
/// limit is refused either way (its size counts the bytes seen when it was refused, which
/// depends on the receives).
fn ndjson_splits(stream: &[u8], max_line: usize, rng: &mut Rng) {
    let whole = feed_whole(&mut NdjsonProtocol::new(max_line), stream);
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

fn is_frames_dropped(m: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(m)
        .is_ok_and(|v| v["type"] == "frames_dropped" && v["subscriptionId"].is_string())
}

/// The messages the lossless pushes stand for: a reply is one, a hub frame its elements.
fn control_messages(conn: &Conn) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for c in &conn.controls {
        if conn.hub_frames && c.starts_with(&frame::MAGIC) {
            let f = frame::decode(c).expect("the hub writes valid frames");
            let elements = f.json_messages().expect("the hub's frames hold JSON");
            out.extend(elements.into_iter().map(<[u8]>::to_vec));
        } else {
            out.push(c.to_vec());
        }
    }
    out
}

/// The JSON messages of what the socket took, framed as `protocol` frames them; unless
/// `drained`, the last one may be partial (and is left out).
fn wire_messages(protocol: u8, wire: &[u8], drained: bool) -> Vec<Vec<u8>> {
    match protocol {
        1 => {
            let (frames, partial) = server_frames(wire);
            assert!(partial == 0 || !drained, "a partial frame after the drain");
            frames
                .into_iter()
                .filter(|f| {
                    assert!(f.fin, "a fragmented server frame");
                    match f.opcode {
                        1 => true,
                        9 => {
                            assert!(f.payload.is_empty(), "a keepalive ping with a payload");
                            false
                        }
                        other => panic!("the outbox wrote opcode {other:#x}"),
                    }
                })
                .map(|f| {
                    assert!(
                        std::str::from_utf8(&f.payload).is_ok(),
                        "a text frame not UTF-8"
                    );
                    f.payload
                })
                .collect()
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

/// What the protocol and the connection put in `urgent` is well framed.
fn check_urgent(conn: &Conn) {
    let urgent = &conn.urgent[..];
    if urgent.is_empty() {
        return;
    }
    match conn.proto.name() {
        "websocket" => {
            let frames = if urgent.starts_with(b"HTTP/1.1 101 ") {
                let end = urgent
                    .windows(4)
                    .position(|w| w == b"\r\n\r\n")
                    .expect("a head")
                    + 4;
                &urgent[end..]
            } else {
                check_http_response(urgent);
                return;
            };
            let (frames, partial) = server_frames(frames);
            assert_eq!(partial, 0, "a partial urgent frame");
            for f in frames.iter().filter(|f| f.opcode == 1) {
                assert!(is_json_object(&f.payload), "an urgent text is not JSON");
            }
        }
        "frame" => {
            let mut rest = urgent;
            while !rest.is_empty() {
                let (f, used) = frame::decode_prefix(rest).expect("whole urgent frames");
                for m in f.json_messages().expect("urgent frames of JSON") {
                    assert!(is_json_object(m), "an urgent message is not JSON");
                }
                rest = &rest[used..];
            }
        }
        _ => {
            assert!(urgent.ends_with(b"\n"), "a partial urgent line");
            for line in urgent.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                assert!(is_json_object(line), "an urgent line is not JSON: {line:?}");
            }
        }
    }
}
