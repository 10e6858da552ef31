//! Outbox and push-protocol micro-benchmarks.
#![allow(missing_docs)] // criterion_group! generates undocumented items
//!
//! `cargo bench -p powerhub --bench outbox`
//!
//! - `healthy/*`: a connection that keeps up; one message (or one shared batch) pushed, offered
//!   by `poll_transmit` and fully taken by `on_written`. The NDJSON shared path is the hub's
//!   batch frame going to the socket as the same `Bytes`.
//! - `paused/*`: a stalled connection receiving state updates for 4 devices, each push coalesced
//!   into its slot (shared lines are classified; events carry their metadata).
//! - `parse/*`: one inbound command line through the command parser.
//! - `classify/*`: reading a paused line's five fields: the outbox's `memchr` top-level scan
//!   against serde_json.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use powerhub::outbox::{Framing, MessageMeta, Outbox, OutboxConfig, PayloadFactory, PushEvent};
use powerhub::plugin::{ProtocolError, ProtocolOutput, StreamProtocol};
use powerhub::protocol::parse_command;

#[derive(Debug)]
struct Ndjson;

impl StreamProtocol for Ndjson {
    fn decode(&mut self, _: &mut BytesMut, _: &mut ProtocolOutput) -> Result<(), ProtocolError> {
        Ok(())
    }
    fn encode_text(&mut self, json: &[u8], out: &mut BytesMut) {
        out.extend_from_slice(json);
        out.extend_from_slice(b"\n");
    }
    fn name(&self) -> &str {
        "ndjson"
    }
}

fn outbox(framing: Framing, now: Instant) -> Outbox {
    let config = OutboxConfig {
        framing,
        ..OutboxConfig::default()
    };
    Outbox::new(config, Arc::new(PayloadFactory), now).unwrap()
}

fn message(n: usize) -> String {
    format!(
        r#"{{"type":"telemetry","stream":"obs","deviceId":"emulator-5554","seq":{n},"cpu":0.25,"mem":123456789,"note":"{}"}}"#,
        "x".repeat(64)
    )
}

fn healthy(c: &mut Criterion) {
    let now = Instant::now();
    let mut g = c.benchmark_group("healthy");
    g.throughput(Throughput::Elements(1));
    let line = Bytes::from(format!("{}\n", message(1)));
    let json = Bytes::from(message(1));

    for (name, framing) in [
        ("shared_ndjson", Framing::Ndjson),
        ("shared_protocol", Framing::Protocol),
    ] {
        let mut ob = outbox(framing, now);
        let mut out = Vec::with_capacity(8);
        g.bench_function(name, |b| {
            b.iter(|| {
                ob.push_shared("obs-1", line.clone(), now);
                out.clear();
                let n = ob.poll_transmit(&mut Ndjson, &mut out, now);
                ob.on_written(black_box(n), now);
            })
        });
    }
    for (name, framing) in [
        ("event_ndjson", Framing::Ndjson),
        ("control_protocol", Framing::Protocol),
    ] {
        let mut ob = outbox(framing, now);
        let mut out = Vec::with_capacity(8);
        g.bench_function(name, |b| {
            b.iter(|| {
                if framing == Framing::Ndjson {
                    ob.push_event("obs-1", PushEvent::new("telemetry", json.clone()), now);
                } else {
                    ob.push_control(json.clone(), now);
                }
                out.clear();
                let n = ob.poll_transmit(&mut Ndjson, &mut out, now);
                ob.on_written(black_box(n), now);
            })
        });
    }
    // A batch of 32 messages as one shared chunk: per message.
    let batch: String = (0..32).map(|i| format!("{}\n", message(i))).collect();
    let batch = Bytes::from(batch);
    g.throughput(Throughput::Elements(32));
    let mut ob = outbox(Framing::Ndjson, now);
    let mut out = Vec::with_capacity(8);
    g.bench_function("shared_ndjson_batch32", |b| {
        b.iter(|| {
            ob.push_shared("obs-1", batch.clone(), now);
            out.clear();
            let n = ob.poll_transmit(&mut Ndjson, &mut out, now);
            ob.on_written(black_box(n), now);
        })
    });
    g.finish();
}

fn stalled(now: Instant) -> Outbox {
    let mut ob = outbox(Framing::Ndjson, now);
    ob.push_control(
        Bytes::from_static(br#"{"type":"subscribed","requestId":"r"}"#),
        now,
    );
    let mut out = Vec::new();
    ob.poll_transmit(&mut Ndjson, &mut out, now);
    ob.on_written(3, now);
    assert!(ob.is_paused());
    ob
}

fn paused(c: &mut Criterion) {
    let now = Instant::now();
    let mut g = c.benchmark_group("paused");
    g.throughput(Throughput::Elements(1));
    for (label, pad) in [("1KiB", 1 << 10), ("256KiB", 256 << 10)] {
        let lines: Vec<Bytes> = (0..4)
            .map(|d| {
                Bytes::from(format!(
                    "{{\"type\":\"screenshot_update\",\"deviceId\":\"d{d}\",\"deviceSessionUuid\":\"s\",\"captureSequence\":1,\"png\":\"{}\"}}\n",
                    "A".repeat(pad)
                ))
            })
            .collect();
        let mut ob = stalled(now);
        let mut i = 0;
        g.bench_function(format!("coalesce_shared_{label}"), |b| {
            b.iter(|| {
                i = (i + 1) & 3;
                ob.push_shared("obs-1", lines[i].clone(), now);
            })
        });
        let mut ob = stalled(now);
        let events: Vec<PushEvent> = (0..4)
            .map(|d| {
                PushEvent::new("screenshot_update", lines[d].slice(..lines[d].len() - 1))
                    .device_id(format!("d{d}").as_str())
                    .device_session_uuid("s")
            })
            .collect();
        g.bench_function(format!("coalesce_event_{label}"), |b| {
            b.iter_batched(
                || {
                    i = (i + 1) & 3;
                    events[i].clone()
                },
                |ev| ob.push_event("obs-1", ev, now),
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

fn parse(c: &mut Criterion) {
    let mut g = c.benchmark_group("parse");
    g.throughput(Throughput::Elements(1));
    let publish =
        format!(r#"{{"type":"publish","id":"p1","message":{}}}"#, message(7)).into_bytes();
    let subscribe =
        br#"{"type":"subscribe","id":"r1","stream":"obs","deviceId":"emulator-5554"}"#.to_vec();
    for (name, line) in [("publish_200B", publish), ("subscribe", subscribe)] {
        g.bench_function(name, |b| {
            b.iter_batched_ref(
                || line.clone(),
                |l| black_box(parse_command(l).unwrap()),
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

/// Why the outbox classifies paused lines with its own top-level scan: the same five fields read
/// by serde_json (a borrowed struct that skips every other field) against `MessageMeta::classify`.
fn classify(c: &mut Criterion) {
    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct Head<'a> {
        #[serde(rename = "type", borrow)]
        kind: Option<std::borrow::Cow<'a, str>>,
        #[serde(rename = "deviceId", borrow)]
        device_id: Option<std::borrow::Cow<'a, str>>,
        #[serde(rename = "deviceSessionUuid", borrow)]
        session: Option<std::borrow::Cow<'a, str>>,
        id: Option<serde::de::IgnoredAny>,
        #[serde(rename = "requestId")]
        request_id: Option<serde::de::IgnoredAny>,
    }
    let mut g = c.benchmark_group("classify");
    let line = format!(
        "{{\"type\":\"screenshot_update\",\"deviceId\":\"d1\",\"deviceSessionUuid\":\"s\",\"captureSequence\":1,\"png\":\"{}\"}}",
        "A".repeat(256 << 10)
    );
    g.throughput(Throughput::Bytes(line.len() as u64));
    g.bench_function("scan_256KiB", |b| {
        b.iter(|| black_box(MessageMeta::classify(line.as_bytes())))
    });
    g.bench_function("serde_json_256KiB", |b| {
        b.iter(|| {
            black_box(
                serde_json::from_slice::<Head<'_>>(line.as_bytes())
                    .unwrap()
                    .kind
                    .is_some(),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, healthy, paused, parse, classify);
criterion_main!(benches);
