//! Property test: random interleavings of publishes, pauses, partial writes, drains,
//! unsubscribes and epoch changes. What the client reads equals a plain reference model, and the
//! outbox's memory stays within the bound (at most one pending frame per coalescing slot).

mod outbox_support;

use std::sync::Arc;

use bytes::Bytes;
use outbox_support::{ndjson, Conn, Marked};
use powerhub::outbox::{
    Framing, OutboxConfig, PayloadFactory, PushEvent, TimeoutAction, ENCODE_AHEAD,
};
use powerhub::plugin::StreamProtocol;
use proptest::prelude::*;

// ---- generated inputs ------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum F {
    Absent,
    Null,
    Str(u8),
}

#[derive(Debug, Clone)]
struct Msg {
    kind: &'static str,
    device: F,
    session: F,
    correlated: Option<&'static str>,
    pad: usize,
}

#[derive(Debug, Clone)]
enum Op {
    Event(u8, Msg),
    Shared(u8, Vec<Msg>),
    Control,
    Unsubscribe(u8),
    Write(usize),
    Writable,
    /// Advance the virtual clock by this many milliseconds and run the timers.
    Tick(u64),
    Pong,
}

fn field() -> impl Strategy<Value = F> {
    prop_oneof![Just(F::Absent), Just(F::Null), (1u8..3).prop_map(F::Str)]
}

fn msg() -> impl Strategy<Value = Msg> {
    let kind = prop_oneof![
        4 => Just("screenshot_update"),
        3 => Just("hierarchy_update"),
        1 => Just("device_lifecycle"),
        1 => Just("future_type"),
    ];
    let correlated =
        prop_oneof![6 => Just(None), 1 => Just(Some("id")), 1 => Just(Some("requestId"))];
    (kind, field(), field(), correlated, 0usize..120).prop_map(
        |(kind, device, session, correlated, pad)| Msg {
            kind,
            device,
            session,
            correlated,
            pad,
        },
    )
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..2, msg()).prop_map(|(s, m)| Op::Event(s, m)),
        4 => (0u8..2, prop::collection::vec(msg(), 1..4)).prop_map(|(s, m)| Op::Shared(s, m)),
        2 => Just(Op::Control),
        1 => (0u8..2).prop_map(Op::Unsubscribe),
        4 => prop_oneof![0usize..300, Just(usize::MAX)].prop_map(Op::Write),
        3 => Just(Op::Writable),
        2 => (0u64..20_000).prop_map(Op::Tick),
        1 => Just(Op::Pong),
    ]
}

fn write_field(out: &mut String, name: &str, f: F, prefix: &str) {
    match f {
        F::Absent => {}
        F::Null => out.push_str(&format!(r#","{name}":null"#)),
        F::Str(n) => out.push_str(&format!(r#","{name}":"{prefix}{n}""#)),
    }
}

fn render(m: &Msg, seq: u64) -> String {
    let mut s = format!(r#"{{"type":"{}""#, m.kind);
    write_field(&mut s, "deviceId", m.device, "d");
    write_field(&mut s, "deviceSessionUuid", m.session, "s");
    if let Some(c) = m.correlated {
        s.push_str(&format!(r#","{c}":{seq}"#));
    }
    s.push_str(&format!(
        r#","captureSequence":{seq},"png":"{}"}}"#,
        "x".repeat(m.pad)
    ));
    s
}

// ---- the reference model -----------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Item {
    Control(String),
    Ping,
    /// `retained`: admitted while paused (an unsubscribe removes it if coalescible).
    Msg {
        sub: u8,
        msg: Msg,
        json: String,
        retained: bool,
    },
    /// A shared chunk pushed while healthy: written as is, never inspected, unless a pause comes
    /// first (then each line is admitted).
    Chunk {
        sub: u8,
        lines: Vec<(Msg, String)>,
    },
}

/// How the model frames what it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire {
    /// A line per message.
    Ndjson,
    /// The test protocol `Marked`: `<json>|`, pings `PING|`.
    Marked,
    /// WebSocket server frames: a text frame per message, pings a ping frame.
    WebSocket,
}

struct Model {
    hw: usize,
    wire_format: Wire,
    paused: bool,
    awaiting: bool,
    queue: Vec<Item>,
    wire: Vec<u8>,
    notified: Vec<(u8, F, F)>,
    client: Vec<u8>,
    /// Virtual time in milliseconds; keepalive every 15 s, reaped 45 s after the last sign of
    /// life (a pong, or bytes taken while paused).
    now: u64,
    last_alive: u64,
    next_ping: u64,
    reaped: bool,
}

fn sub_name(s: u8) -> String {
    format!("sub{s}")
}

fn coalescible(m: &Msg) -> bool {
    m.correlated.is_none() && (m.kind == "screenshot_update" || m.kind == "hierarchy_update")
}

/// Whether the message's type is one the paused rules coalesce or drop (when uncorrelated).
fn names_a_ruled_type(m: &Msg) -> bool {
    m.kind == "screenshot_update" || m.kind == "hierarchy_update"
}

fn droppable(m: &Msg) -> bool {
    m.correlated.is_none() && m.kind == "screenshot_update"
}

fn notice(sub: u8, m: &Msg) -> String {
    let mut s = format!(
        r#"{{"type":"frames_dropped","subscriptionId":"{}""#,
        sub_name(sub)
    );
    write_field(&mut s, "deviceId", m.device, "d");
    write_field(&mut s, "deviceSessionUuid", m.session, "s");
    s.push_str(r#","droppedType":"screenshot_update","reason":"backpressure"}"#);
    s
}

impl Model {
    /// A new connection's model: high-water mark `hw`, NDJSON or the marked framing.
    fn new(hw: usize, wire_format: Wire) -> Self {
        Model {
            hw,
            wire_format,
            paused: false,
            awaiting: false,
            queue: Vec::new(),
            wire: Vec::new(),
            notified: Vec::new(),
            client: Vec::new(),
            now: 0,
            last_alive: 0,
            next_ping: 15_000,
            reaped: false,
        }
    }

    fn frame(&self, json: &str) -> Vec<u8> {
        match self.wire_format {
            Wire::Ndjson => format!("{json}\n").into_bytes(),
            Wire::Marked => format!("<{json}>|").into_bytes(),
            Wire::WebSocket => {
                // FIN and the text opcode; an unmasked length in its shortest form.
                let mut frame = vec![0x81];
                match json.len() {
                    n if n < 126 => frame.push(n as u8),
                    n if n <= 0xffff => {
                        frame.push(126);
                        frame.extend_from_slice(&(n as u16).to_be_bytes());
                    }
                    n => {
                        frame.push(127);
                        frame.extend_from_slice(&(n as u64).to_be_bytes());
                    }
                }
                frame.extend_from_slice(json.as_bytes());
                frame
            }
        }
    }

    fn observe(&mut self) {
        if self.wire.len() <= self.hw {
            self.notified.clear();
        }
    }

    fn push_msg(&mut self, sub: u8, msg: Msg, json: String) {
        if self.reaped {
            return;
        }
        self.observe();
        let item = Item::Msg {
            sub,
            msg,
            json,
            retained: false,
        };
        if self.paused {
            self.admit(item);
        } else {
            self.enqueue(item);
        }
    }

    /// Bytes waiting in the FIFO (a message's JSON, a chunk's lines with their newlines).
    fn queued_bytes(&self) -> usize {
        self.queue
            .iter()
            .map(|it| match it {
                Item::Control(json) | Item::Msg { json, .. } => json.len(),
                Item::Ping => r#"{"type":"ping"}"#.len(),
                Item::Chunk { lines, .. } => lines.iter().map(|(_, j)| j.len() + 1).sum(),
            })
            .sum()
    }

    /// Queues in order; a healthy connection whose backlog (unsent plus queued) passes the
    /// high-water mark pauses, as a socket's `write()` past it returns false.
    fn enqueue(&mut self, item: Item) {
        self.queue.push(item);
        if !self.paused && self.wire.len() + self.queued_bytes() > self.hw {
            self.pause();
        }
    }

    /// Pauses: what is queued is re-admitted under the paused rules.
    fn pause(&mut self) {
        self.paused = true;
        for item in std::mem::take(&mut self.queue) {
            self.admit(item);
        }
    }

    fn admit(&mut self, item: Item) {
        let (sub, msg, json) = match item {
            Item::Msg { sub, msg, json, .. } => (sub, msg, json),
            // A chunk whose messages name no coalesced or dropped type (whatever their
            // correlation) stays whole: its messages are lossless FIFO either way.
            Item::Chunk { sub, lines } if lines.iter().all(|(m, _)| !names_a_ruled_type(m)) => {
                self.queue.push(Item::Chunk { sub, lines });
                return;
            }
            Item::Chunk { sub, lines } => {
                for (msg, json) in lines {
                    self.admit(Item::Msg {
                        sub,
                        msg,
                        json,
                        retained: false,
                    });
                }
                return;
            }
            Item::Control(_) | Item::Ping => {
                self.queue.push(item);
                return;
            }
        };
        if droppable(&msg) {
            if self.wire.len() > self.hw {
                let key = (sub, msg.device, msg.session);
                if !self.notified.contains(&key) {
                    self.notified.push(key);
                    self.queue.push(Item::Control(notice(sub, &msg)));
                }
                return;
            }
            self.notified.clear();
        }
        if coalescible(&msg) {
            let same = |it: &Item| {
                matches!(it, Item::Msg { sub: s, msg: m, retained: true, .. }
                if *s == sub && m.kind == msg.kind && m.device == msg.device && m.session == msg.session && coalescible(m))
            };
            if let Some(i) = self.queue.iter().position(same) {
                self.queue[i] = Item::Msg {
                    sub,
                    msg,
                    json,
                    retained: true,
                };
                return;
            }
        }
        self.queue.push(Item::Msg {
            sub,
            msg,
            json,
            retained: true,
        });
    }

    fn control(&mut self, json: String) {
        if self.reaped {
            return;
        }
        self.observe();
        self.enqueue(Item::Control(json));
    }

    fn unsubscribe(&mut self, sub: u8, ack: String) {
        if self.reaped {
            return;
        }
        self.queue.retain(|it| !matches!(it, Item::Msg { sub: s, msg, retained: true, .. } if *s == sub && coalescible(msg)));
        self.notified.retain(|k| k.0 != sub);
        self.control(ack);
    }

    fn write(&mut self, cap: usize) {
        if self.awaiting || self.reaped {
            return;
        }
        if self.paused && self.wire.is_empty() {
            // Paused by the backlog, and everything unsent is taken.
            self.paused = false;
        }
        if !self.paused {
            // A transmit encodes until ENCODE_AHEAD bytes are unsent (at least one message).
            let mut rest = std::mem::take(&mut self.queue).into_iter();
            while self.wire.len() < ENCODE_AHEAD {
                let Some(item) = rest.next() else { break };
                let json = match item {
                    Item::Control(json) => json,
                    Item::Ping => {
                        let ping = match self.wire_format {
                            Wire::Ndjson => b"{\"type\":\"ping\"}\n".to_vec(),
                            Wire::Marked => b"PING|".to_vec(),
                            // A protocol ping frame (the browser answers it itself).
                            Wire::WebSocket => vec![0x89, 0x00],
                        };
                        self.wire.extend(ping);
                        continue;
                    }
                    Item::Chunk { lines, .. } => {
                        for (_, json) in lines {
                            let framed = self.frame(&json);
                            self.wire.extend(framed);
                        }
                        continue;
                    }
                    Item::Msg { sub, msg, json, .. } => {
                        if droppable(&msg) {
                            if self.wire.len() > self.hw {
                                let key = (sub, msg.device, msg.session);
                                if self.notified.contains(&key) {
                                    continue;
                                }
                                self.notified.push(key);
                                let n = notice(sub, &msg);
                                let framed = self.frame(&n);
                                self.wire.extend(framed);
                                continue;
                            }
                            self.notified.clear();
                        }
                        json
                    }
                };
                let framed = self.frame(&json);
                self.wire.extend(framed);
            }
            self.queue = rest.collect();
        }
        if self.wire.is_empty() {
            return;
        }
        let taken = cap.min(self.wire.len());
        self.client.extend(self.wire.drain(..taken));
        if self.paused && taken > 0 {
            self.last_alive = self.now;
        }
        if self.wire.is_empty() {
            self.paused = false;
            self.notified.clear();
        } else {
            self.awaiting = true;
            if self.wire.len() <= self.hw {
                self.notified.clear();
            }
            if !self.paused {
                self.pause();
            }
        }
    }

    fn tick(&mut self, ms: u64) -> bool {
        self.now += ms;
        if self.reaped {
            return false;
        }
        if self.now >= self.last_alive + 45_000 {
            self.reaped = true;
            self.queue.clear();
            self.wire.clear();
            self.paused = false;
            return true;
        }
        if self.now >= self.next_ping {
            self.next_ping = self.now + 15_000;
            self.enqueue(Item::Ping);
        }
        false
    }

    fn writable(&mut self) {
        self.awaiting = false;
        if self.wire.len() <= self.hw {
            self.notified.clear();
        }
    }

    /// The bound: at most one pending frame per coalescing slot.
    fn check_bound(&self) {
        let mut seen = Vec::new();
        for it in &self.queue {
            if let Item::Msg {
                sub,
                msg,
                retained: true,
                ..
            } = it
            {
                if coalescible(msg) {
                    let key = (*sub, msg.kind, msg.device, msg.session);
                    assert!(!seen.contains(&key), "two pending frames in slot {key:?}");
                    seen.push(key);
                }
            }
        }
    }
}

// ---- the comparison ------------------------------------------------------------------------

fn run<P: StreamProtocol>(
    ops: &[Op],
    hw: usize,
    framing: Framing,
    framer: P,
    ndjson: bool,
) -> Result<(), TestCaseError> {
    let config = OutboxConfig {
        high_water_bytes: hw,
        framing,
        ..OutboxConfig::default()
    };
    let mut c = Conn::with(config, Arc::new(PayloadFactory), framer);
    let mut m = Model::new(hw, if ndjson { Wire::Ndjson } else { Wire::Marked });
    let mut seq = 0u64;
    for op in ops {
        let now = c.now;
        match op {
            Op::Event(sub, msg) => {
                seq += 1;
                let json = render(msg, seq);
                c.outbox.push_event(
                    &sub_name(*sub),
                    PushEvent::from_json(Bytes::from(json.clone())),
                    now,
                );
                m.push_msg(*sub, msg.clone(), json);
            }
            Op::Shared(sub, msgs) => {
                let mut chunk = String::new();
                let mut jsons = Vec::new();
                for msg in msgs {
                    seq += 1;
                    let json = render(msg, seq);
                    chunk.push_str(&json);
                    chunk.push('\n');
                    jsons.push(json);
                }
                c.outbox
                    .push_shared(&sub_name(*sub), Bytes::from(chunk), now);
                if m.reaped {
                    continue;
                }
                // One push: the threshold is observed once, then each line is admitted.
                m.observe();
                let item = Item::Chunk {
                    sub: *sub,
                    lines: msgs.iter().cloned().zip(jsons).collect(),
                };
                if m.paused {
                    m.admit(item);
                } else {
                    m.enqueue(item);
                }
            }
            Op::Control => {
                seq += 1;
                let json = format!(r#"{{"type":"published","requestId":{seq}}}"#);
                c.outbox.push_control(Bytes::from(json.clone()), now);
                m.control(json);
            }
            Op::Unsubscribe(sub) => {
                seq += 1;
                let ack = format!(r#"{{"type":"unsubscribed","requestId":{seq}}}"#);
                c.outbox
                    .unsubscribe(&sub_name(*sub), Bytes::from(ack.clone()), now);
                m.unsubscribe(*sub, ack);
            }
            Op::Write(cap) => {
                c.write(*cap);
                m.write(*cap);
            }
            Op::Writable => {
                c.outbox.on_writable(now);
                m.writable();
            }
            Op::Tick(ms) => {
                c.advance(std::time::Duration::from_millis(*ms));
                let action = c.outbox.handle_timeout(c.now);
                let reaped = m.tick(*ms);
                prop_assert_eq!(action == TimeoutAction::Reap, reaped);
            }
            Op::Pong => {
                c.outbox.on_pong(now);
                if !m.reaped {
                    m.last_alive = m.now;
                }
            }
        }
        prop_assert_eq!(c.outbox.is_reaped(), m.reaped);
        m.check_bound();
        prop_assert_eq!(&c.read, &m.client, "client bytes after {:?}", op);
        prop_assert_eq!(c.outbox.unsent_bytes(), m.wire.len());
        prop_assert_eq!(c.outbox.is_paused(), m.paused);
        let queued = c.outbox.stats().queued;
        prop_assert_eq!(queued, m.queue.len(), "queued messages after {:?}", op);
    }
    // Finally drain everything: both agree on the whole stream.
    for _ in 0..100 {
        c.outbox.on_writable(c.now);
        m.writable();
        c.write(usize::MAX);
        m.write(usize::MAX);
    }
    prop_assert_eq!(&c.read, &m.client);
    prop_assert_eq!(c.outbox.stats().queued, 0);
    prop_assert_eq!(c.outbox.is_reaped(), m.reaped);
    prop_assert_eq!(c.outbox.unsent_bytes(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn outbox_matches_the_reference_model_ndjson(ops in prop::collection::vec(op(), 1..80), hw in prop_oneof![Just(60usize), Just(300), Just(1 << 20)]) {
        run(&ops, hw, Framing::Ndjson, ndjson(), true)?;
    }

    #[test]
    fn outbox_matches_the_reference_model_protocol_framing(ops in prop::collection::vec(op(), 1..80), hw in prop_oneof![Just(60usize), Just(300), Just(1 << 20)]) {
        run(&ops, hw, Framing::Protocol, Marked, false)?;
    }
}

// ---- the push connection against the model ----------------------------------------------------
//
// The same outbox model, one level up: commands go to a real `PushConnection` as input, this test
// is its driver (the server's shard: it answers subscribes, unsubscribes and publishes, and fans
// out what is published, in batches, when the connection asks or on its own turn), and the model
// says what the client reads. The connection-level rules the model adds: every command's reply
// is queued in command order; what was published before a command (and reaches a subscription
// of this connection) is delivered before that command's reply; a subscription gets nothing
// published before its `subscribe`; an unsubscribe delivers what was published before it; over
// NDJSON an input whose last line lacks its newline, followed by the client's end of stream, is
// handled as the whole input. Over NDJSON, and over WebSocket (after the upgrade, every command
// a masked text frame; the model's stream is then server frames: a text frame per message, a
// ping frame per keepalive).

use powerhub::hub::Message;
use powerhub::plugin::ProtocolFactory;
use powerhub::protocol::{reply, RequestId, Session, SessionConfig};
use powerhub::push::{PushConfig, PushConnection, PushLimits, PushState, Request};
use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

/// Messages per fan-out batch.
const BATCH: usize = 3;

#[derive(Debug, Clone)]
enum Cmd {
    /// Subscribe to stream `t`.
    Subscribe(u8),
    /// Unsubscribe the newest subscription to stream `t`, if there is one.
    Unsubscribe(u8),
    /// Publish to stream `t`, with an id (a reply) or without.
    Publish(u8, Msg, bool),
    Ping,
}

#[derive(Debug, Clone)]
enum PushOp {
    /// Commands arriving in one input; with `true`, over NDJSON, the last one without its
    /// newline, and then the end of the client's stream.
    Input(Vec<Cmd>, bool),
    /// Another client publishes to stream `t`.
    Elsewhere(u8, Vec<Msg>),
    /// The driver's own fan-out turn.
    Turn,
    Write(usize),
    Writable,
    Tick(u64),
    Pong,
    /// The client's WebSocket close frame (code 1000); nothing over NDJSON.
    PeerClose,
}

fn cmd() -> impl Strategy<Value = Cmd> {
    prop_oneof![
        2 => (0u8..2).prop_map(Cmd::Subscribe),
        1 => (0u8..2).prop_map(Cmd::Unsubscribe),
        4 => (0u8..2, msg(), any::<bool>()).prop_map(|(t, m, id)| Cmd::Publish(t, m, id)),
        1 => Just(Cmd::Ping),
    ]
}

fn push_op() -> impl Strategy<Value = PushOp> {
    prop_oneof![
        6 => (prop::collection::vec(cmd(), 1..4), prop::bool::weighted(0.2))
            .prop_map(|(cmds, ends)| PushOp::Input(cmds, ends)),
        3 => (0u8..2, prop::collection::vec(msg(), 1..4)).prop_map(|(t, m)| PushOp::Elsewhere(t, m)),
        2 => Just(PushOp::Turn),
        4 => prop_oneof![0usize..300, Just(usize::MAX)].prop_map(PushOp::Write),
        3 => Just(PushOp::Writable),
        2 => (0u64..20_000).prop_map(PushOp::Tick),
        1 => Just(PushOp::Pong),
        1 => Just(PushOp::PeerClose),
    ]
}

/// Published and not yet fanned out, per stream; the subscriptions per stream (oldest first).
#[derive(Default)]
struct Topics {
    pending: BTreeMap<u8, Vec<(Msg, String)>>,
    subs: BTreeMap<u8, Vec<u8>>,
}

impl Topics {
    /// Fans out what stream `t` holds: each batch's lines, once, to every subscription.
    fn fan_out(&mut self, t: u8) -> Vec<(u8, Vec<(Msg, String)>)> {
        let pending = self.pending.remove(&t).unwrap_or_default();
        let subs = self.subs.get(&t).cloned().unwrap_or_default();
        let mut out = Vec::new();
        for batch in pending.chunks(BATCH) {
            for &sub in &subs {
                out.push((sub, batch.to_vec()));
            }
        }
        out
    }

    fn fan_out_all(&mut self) -> Vec<(u8, Vec<(Msg, String)>)> {
        let streams: Vec<u8> = self.pending.keys().copied().collect();
        streams.into_iter().flat_map(|t| self.fan_out(t)).collect()
    }

    fn subscribed(&self) -> bool {
        self.subs.values().any(|s| !s.is_empty())
    }
}

fn lines(batch: &[(Msg, String)]) -> Bytes {
    let mut s = String::new();
    for (_, json) in batch {
        s.push_str(json);
        s.push('\n');
    }
    Bytes::from(s)
}

/// The model's side of a delivery (a shared chunk, as the outbox model takes it).
fn model_deliver(m: &mut Model, sub: u8, batch: Vec<(Msg, String)>) {
    if m.reaped {
        return;
    }
    m.observe();
    let item = Item::Chunk { sub, lines: batch };
    if m.paused {
        m.admit(item);
    } else {
        m.enqueue(item);
    }
}

/// A WebSocket client's opening handshake.
const HANDSHAKE: &[u8] = b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n\
Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";

/// The client's bytes for NDJSON `lines`: as they are, or each line a masked WebSocket text
/// frame.
fn client_input(lines: &str, websocket: bool) -> Vec<u8> {
    if !websocket {
        return lines.as_bytes().to_vec();
    }
    let key = [0x5a, 0x13, 0xc7, 0x01];
    let mut out = Vec::new();
    for line in lines.lines() {
        out.push(0x81);
        match line.len() {
            n if n < 126 => out.push(0x80 | n as u8),
            n => {
                out.push(0x80 | 126);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
        }
        out.extend_from_slice(&key);
        out.extend(line.bytes().zip(key.iter().cycle()).map(|(b, k)| b ^ k));
    }
    out
}

/// The driver: the connection's fan-out, as the shard runs it.
struct PushDriver {
    conn: PushConnection,
    topics: Topics,
    /// Every message published, by its JSON.
    known: std::collections::HashMap<String, Msg>,
    read: Vec<u8>,
    now: Instant,
}

impl PushDriver {
    fn deliver(&mut self, out: Vec<(u8, Vec<(Msg, String)>)>) {
        for (sub, batch) in out {
            self.conn
                .deliver_lines(&sub_name(sub), lines(&batch), self.now);
        }
    }

    fn input(&mut self, bytes: &[u8], stream_of: &BTreeMap<String, u8>) {
        self.input_ending(bytes, false, stream_of);
    }

    /// `bytes` arrive; with `end`, the client's stream ends behind them (before the driver
    /// polls: as one receive that carried both).
    fn input_ending(&mut self, bytes: &[u8], end: bool, stream_of: &BTreeMap<String, u8>) {
        let now = self.now;
        self.conn.handle_input(bytes, now);
        if end {
            self.conn.handle_end_of_stream(now);
        }
        while let Some(request) = self.conn.poll(now, SystemTime::now()) {
            match request {
                Request::FanOut => {
                    let out = self.topics.fan_out_all();
                    self.deliver(out);
                }
                Request::Subscribe {
                    subscription_id,
                    topic,
                    ..
                } => {
                    let t = stream_of[&topic];
                    let out = self.topics.fan_out(t);
                    self.deliver(out);
                    let sub: u8 = subscription_id[3..].parse().unwrap();
                    self.topics.subs.entry(t).or_default().push(sub);
                    self.conn.subscribe_done(Ok(()), now);
                }
                Request::Unsubscribe {
                    subscription_id,
                    topic,
                } => {
                    let t = stream_of[&topic];
                    let out = self.topics.fan_out(t);
                    self.deliver(out);
                    let sub: u8 = subscription_id[3..].parse().unwrap();
                    self.topics.subs.entry(t).or_default().retain(|s| *s != sub);
                    self.conn.unsubscribe_done(now);
                }
                Request::Publish { message } => {
                    let delivered = self.publish(&message, stream_of);
                    self.conn.publish_done(Ok(delivered), now);
                }
                // Gathered as the server's shards gather them: each message as its publish.
                Request::PublishRun { messages } => {
                    for message in &messages {
                        self.publish(message, stream_of);
                    }
                }
                other => panic!("unexpected request {other:?}"),
            }
        }
    }

    /// Queues `message` for the subscribers of the last publish's topics; returns how many.
    fn publish(&mut self, message: &Message, stream_of: &BTreeMap<String, u8>) -> usize {
        let mut delivered = 0;
        let topics: Vec<String> = self.conn.publish_topics().map(String::from).collect();
        for topic in &topics {
            if let Some(&t) = stream_of.get(topic) {
                delivered += self.topics.subs.get(&t).map_or(0, Vec::len);
                let json = String::from_utf8(message.bytes().to_vec()).unwrap();
                let msg = self.known[&json].clone();
                self.topics.pending.entry(t).or_default().push((msg, json));
            }
        }
        delivered
    }

    fn write(&mut self, cap: usize) {
        let mut out = Vec::new();
        let Some(t) = self.conn.poll_transmit(&mut out, 1024, self.now) else {
            return;
        };
        let mut left = cap.min(t.len());
        let taken = left;
        for b in &out {
            let n = left.min(b.len());
            self.read.extend_from_slice(&b[..n]);
            left -= n;
        }
        self.conn.on_written(t, taken, self.now);
    }
}

fn run_push(ops: &[PushOp], hw: usize, websocket: bool) -> Result<(), TestCaseError> {
    let outbox = OutboxConfig {
        high_water_bytes: hw,
        ..OutboxConfig::default()
    };
    // No first-message or idle deadline here: the outbox's timers are the model's.
    let limits = PushLimits::default()
        .with_first_message_timeout_ms(u64::MAX / 4)
        .with_idle_timeout_ms(0);
    // Publish runs gathered, as the server's shards drive connections.
    let config = Arc::new(
        PushConfig::new(limits, outbox, Arc::new(PayloadFactory))
            .unwrap()
            .with_publish_runs(true),
    );
    let t0 = Instant::now();
    let proto = if websocket {
        powerhub_websocket::WebSocketFactory::new(powerhub_websocket::WebSocketConfig::default())
            .unwrap()
            .new_connection(&Default::default())
    } else {
        powerhub_ndjson::NdjsonFactory.new_connection(&Default::default())
    };
    let session = Session::new(1, SessionConfig::default());
    let mut d = PushDriver {
        conn: PushConnection::new(proto, session, &config, t0).unwrap(),
        topics: Topics::default(),
        known: std::collections::HashMap::new(),
        read: Vec::new(),
        now: t0,
    };
    let stream_of: BTreeMap<String, u8> = (0u8..2).map(|t| (format!("st{t}"), t)).collect();
    let wire_format = if websocket {
        // The upgrade first: what the model follows is the stream of frames after it.
        d.input(HANDSHAKE, &stream_of);
        d.write(usize::MAX);
        prop_assert!(d.read.starts_with(b"HTTP/1.1 101 "), "the upgrade");
        prop_assert!(d.read.ends_with(b"\r\n\r\n"), "the upgrade alone");
        d.read.clear();
        Wire::WebSocket
    } else {
        Wire::Ndjson
    };
    let mut m = Model::new(hw, wire_format);
    let mut mt = Topics::default();
    let mut seq = 0u64;
    let mut next_sub = 0u8;
    let render_on = |m: &Msg, t: u8, seq: u64| -> String {
        let json = render(m, seq);
        format!("{{\"stream\":\"st{t}\",{}", &json[1..])
    };
    for op in ops {
        match op {
            PushOp::Input(cmds, ends) => {
                let mut input = String::new();
                let mut published = false;
                let mut sent = 0;
                for c in cmds {
                    if let Cmd::Unsubscribe(t) = c {
                        if mt.subs.get(t).is_none_or(Vec::is_empty) {
                            // Nothing to unsubscribe: not sent.
                            continue;
                        }
                    }
                    sent += 1;
                    // The model: what was published before the input (or before this command,
                    // by an earlier command of the input) reaches the connection's
                    // subscriptions before the replies to it.
                    if (sent == 1 || std::mem::take(&mut published)) && mt.subscribed() {
                        for (sub, batch) in mt.fan_out_all() {
                            model_deliver(&mut m, sub, batch);
                        }
                    }
                    published = false;
                    seq += 1;
                    let id = RequestId::Int(seq as i64);
                    match c {
                        Cmd::Subscribe(t) => {
                            let sub = next_sub;
                            next_sub += 1;
                            input.push_str(&format!(
                                r#"{{"type":"subscribe","id":{seq},"stream":"st{t}","subscriptionId":"{}"}}"#,
                                sub_name(sub)
                            ));
                            for (s, batch) in mt.fan_out(*t) {
                                model_deliver(&mut m, s, batch);
                            }
                            mt.subs.entry(*t).or_default().push(sub);
                            let r = reply::subscribed(
                                Some(&id),
                                &sub_name(sub),
                                &format!("st{t}"),
                                None,
                            );
                            m.control(String::from_utf8(r.to_vec()).unwrap());
                        }
                        Cmd::Unsubscribe(t) => {
                            let sub = *mt.subs[t].last().expect("checked above");
                            input.push_str(&format!(
                                r#"{{"type":"unsubscribe","id":{seq},"subscriptionId":"{}"}}"#,
                                sub_name(sub)
                            ));
                            for (s, batch) in mt.fan_out(*t) {
                                model_deliver(&mut m, s, batch);
                            }
                            mt.subs.entry(*t).or_default().retain(|s| *s != sub);
                            let ack = reply::unsubscribed(Some(&id), &sub_name(sub));
                            m.unsubscribe(sub, String::from_utf8(ack.to_vec()).unwrap());
                        }
                        Cmd::Publish(t, msg, with_id) => {
                            let json = render_on(msg, *t, seq);
                            d.known.insert(json.clone(), msg.clone());
                            if *with_id {
                                input.push_str(&format!(
                                    r#"{{"type":"publish","id":{seq},"message":{json}}}"#
                                ));
                            } else {
                                input
                                    .push_str(&format!(r#"{{"type":"publish","message":{json}}}"#));
                            }
                            let delivered = mt.subs.get(t).map_or(0, Vec::len);
                            mt.pending.entry(*t).or_default().push((msg.clone(), json));
                            published = true;
                            if *with_id {
                                let r = reply::published(Some(&id), delivered);
                                m.control(String::from_utf8(r.to_vec()).unwrap());
                            }
                        }
                        Cmd::Ping => {
                            input.push_str(&format!(r#"{{"type":"ping","id":{seq}}}"#));
                            let r = reply::pong(Some(&id));
                            m.control(String::from_utf8(r.to_vec()).unwrap());
                        }
                    }
                    input.push('\n');
                }
                if input.is_empty() {
                    continue;
                }
                // The end of the stream ends the last line as its newline would.
                let ends = *ends && !websocket;
                if ends {
                    input.pop();
                }
                d.input_ending(&client_input(&input, websocket), ends, &stream_of);
            }
            PushOp::Elsewhere(t, msgs) => {
                for msg in msgs {
                    seq += 1;
                    let json = render_on(msg, *t, seq);
                    d.known.insert(json.clone(), msg.clone());
                    d.topics
                        .pending
                        .entry(*t)
                        .or_default()
                        .push((msg.clone(), json.clone()));
                    mt.pending.entry(*t).or_default().push((msg.clone(), json));
                }
            }
            PushOp::Turn => {
                let out = d.topics.fan_out_all();
                d.deliver(out);
                for (sub, batch) in mt.fan_out_all() {
                    model_deliver(&mut m, sub, batch);
                }
            }
            PushOp::Write(cap) => {
                d.write(*cap);
                m.write(*cap);
            }
            PushOp::Writable => {
                d.conn.on_writable(d.now);
                m.writable();
            }
            PushOp::Tick(ms) => {
                d.now += Duration::from_millis(*ms);
                d.conn.handle_timeout(d.now, SystemTime::now());
                if m.tick(*ms) {
                    // Reaped: the connection closes (saying so, or not, by where its stream
                    // stands); the model says nothing of that.
                    prop_assert_ne!(d.conn.state(), PushState::Open);
                    return Ok(());
                }
                prop_assert_eq!(d.conn.state(), PushState::Open);
            }
            PushOp::PeerClose => {
                if !websocket {
                    continue;
                }
                let key = [1, 2, 3, 4];
                let mut close = vec![0x88, 0x82, 1, 2, 3, 4];
                close.extend(1000u16.to_be_bytes().iter().zip(key).map(|(b, k)| b ^ k));
                d.input(&close, &stream_of);
                prop_assert_eq!(d.conn.state(), PushState::Closing);
                for _ in 0..100 {
                    d.conn.on_writable(d.now);
                    d.write(usize::MAX);
                }
                // What was framed for the socket goes out ahead of the echoed close frame; what
                // was still queued (deliveries, replies, keepalives) can no longer be framed.
                let mut expected = m.client.clone();
                expected.extend_from_slice(&m.wire);
                expected.extend_from_slice(&[0x88, 0x02, 0x03, 0xe8]);
                prop_assert!(
                    d.read == expected,
                    "after the peer's close:\n{:?}\nexpected\n{:?}",
                    String::from_utf8_lossy(&d.read),
                    String::from_utf8_lossy(&expected)
                );
                prop_assert!(d.conn.is_written());
                prop_assert_eq!(d.conn.stats().queued, 0);
                return Ok(());
            }
            PushOp::Pong => {
                if mt.subscribed() {
                    for (sub, batch) in mt.fan_out_all() {
                        model_deliver(&mut m, sub, batch);
                    }
                }
                d.input(
                    &client_input("{\"type\":\"pong\"}\n", websocket),
                    &stream_of,
                );
                if !m.reaped {
                    m.last_alive = m.now;
                }
            }
        }
        m.check_bound();
        prop_assert!(
            d.read == m.client,
            "client bytes after {:?}:\n{:?}\nexpected\n{:?}",
            op,
            String::from_utf8_lossy(&d.read),
            String::from_utf8_lossy(&m.client)
        );
        prop_assert_eq!(d.conn.outbox().unsent_bytes(), m.wire.len());
        prop_assert_eq!(d.conn.outbox().is_paused(), m.paused);
        prop_assert_eq!(
            d.conn.stats().queued,
            m.queue.len(),
            "queued after {:?}",
            op
        );
    }
    // Finally everything is fanned out and drained: both agree on the whole stream.
    let out = d.topics.fan_out_all();
    d.deliver(out);
    for (sub, batch) in mt.fan_out_all() {
        model_deliver(&mut m, sub, batch);
    }
    for _ in 0..100 {
        d.conn.on_writable(d.now);
        m.writable();
        d.write(usize::MAX);
        m.write(usize::MAX);
    }
    prop_assert!(
        d.read == m.client,
        "client bytes at the end:\n{:?}\nexpected\n{:?}",
        String::from_utf8_lossy(&d.read),
        String::from_utf8_lossy(&m.client)
    );
    prop_assert!(d.conn.is_written());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn push_connection_matches_the_reference_model(ops in prop::collection::vec(push_op(), 1..60), hw in prop_oneof![Just(60usize), Just(300), Just(1 << 20)]) {
        run_push(&ops, hw, false)?;
    }

    #[test]
    fn push_connection_over_websocket_matches_the_reference_model(ops in prop::collection::vec(push_op(), 1..60), hw in prop_oneof![Just(60usize), Just(300), Just(1 << 20)]) {
        run_push(&ops, hw, true)?;
    }
}
