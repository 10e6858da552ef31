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

struct Model {
    hw: usize,
    ndjson: bool,
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
    fn frame(&self, json: &str) -> Vec<u8> {
        if self.ndjson {
            format!("{json}\n").into_bytes()
        } else {
            format!("<{json}>|").into_bytes()
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
                        let ping = if self.ndjson {
                            b"{\"type\":\"ping\"}\n".to_vec()
                        } else {
                            b"PING|".to_vec()
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
    let mut m = Model {
        hw,
        ndjson,
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
    };
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
