//! The push-stream spec at any depth of backlog, on real sockets and both IO backends: a push
//! subscription's only queue is its connection's outbox, so what holds for a connection a few
//! bytes behind holds for one megabytes behind (past `limits.backpressure_bytes`, which no longer
//! hands anything to another queue), and a burst loses nothing for readers that keep reading.
//!
//! The stalled readers read nothing until the server's socket is full (`unsent_bytes` above
//! zero: the outbox is paused), which 16 messages of 900 KiB (more than the kernel's send and
//! receive buffers hold on loopback) make sure of.

mod engine_support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use engine_support::*;
use powerhub::hub::{Message, PublishOptions};
use powerhub::runtime::{BackendChoice, Config};

/// A 900 KiB lossless message: 16 of them are more than the kernel's buffers hold.
const BIG: usize = 900 << 10;
const BACKLOG: u64 = 16;

fn config(backend: BackendChoice) -> Config {
    let mut config = base_config(backend);
    // Small, so that the old hand-over point is passed many times over.
    config.limits.backpressure_bytes = 64 << 10;
    config
}

/// A client subscribed to `stream` that reads nothing until the test says so.
fn stalled_client(server: &Server, stream: &str) -> Client {
    let mut c = Client::connect(server.addr);
    c.subscribe(stream);
    c
}

fn publish_json(server: &Server, stream: &str, json: String) {
    let n = server
        .engine
        .hub()
        .publish(
            stream,
            Message::json(json).unwrap(),
            PublishOptions::default(),
        )
        .unwrap();
    assert!(n >= 1, "the publish reached its subscriber");
}

/// Publishes `count` big lossless messages (`seq` from `first`) and waits until the server's
/// socket to the stalled reader is full.
fn backlog(server: &Server, stream: &str, first: u64, count: u64) {
    for seq in first..first + count {
        publish(&server.engine, stream, seq, BIG);
    }
    eventually("the stalled reader's socket is full", || {
        server.engine.stats().unsent_bytes > 0
    });
}

fn telemetry(stream: &str, n: u64) -> String {
    format!(r#"{{"type":"telemetry","stream":"{stream}","n":{n}}}"#)
}

fn screenshot(stream: &str, n: u64, pad: usize) -> String {
    format!(
        r#"{{"type":"screenshot_update","stream":"{stream}","deviceId":"d1","captureSequence":{n},"png":"{}"}}"#,
        "x".repeat(pad)
    )
}

/// Reads the stalled client's messages (keepalive pings left out) until `until` says stop.
fn read_until(
    c: &mut Client,
    mut until: impl FnMut(&serde_json::Value) -> bool,
) -> Vec<serde_json::Value> {
    let mut got = Vec::new();
    loop {
        let v = c.msg();
        let stop = until(&v);
        got.push(v);
        if stop {
            return got;
        }
    }
}

/// The `field` of every message of type `kind` in `got`, in order.
fn numbers(got: &[serde_json::Value], kind: &str, field: &str) -> Vec<u64> {
    got.iter()
        .filter(|v| v["type"] == kind)
        .map(|v| v[field].as_u64().expect("a number"))
        .collect()
}

#[test]
fn lossless_messages_are_delivered_in_order_behind_any_backlog() {
    on_both_backends(|backend| {
        let server = start(config(backend));
        let mut c = stalled_client(&server, "deep");
        backlog(&server, "deep", 0, BACKLOG);
        for n in 0..6001 {
            publish_json(&server, "deep", telemetry("deep", n));
        }
        let got = read_until(&mut c, |v| v["type"] == "telemetry" && v["n"] == 6000);
        let big = numbers(&got, "tick", "seq");
        assert_eq!(
            big,
            (0..BACKLOG).collect::<Vec<_>>(),
            "every 900 KiB message, in order"
        );
        let small = numbers(&got, "telemetry", "n");
        assert_eq!(small.len(), 6001, "no telemetry message was lost");
        assert!(small.windows(2).all(|w| w[0] + 1 == w[1]), "in order");
        assert_eq!(server.engine.hub().stats().dropped, 0);
    });
}

#[test]
fn a_reply_never_overtakes_messages_published_before_its_command() {
    on_both_backends(|backend| {
        let server = start(config(backend));
        let mut c = stalled_client(&server, "order");
        backlog(&server, "order", 0, BACKLOG);
        for n in 0..4 {
            publish_json(&server, "order", telemetry("order", n));
        }
        c.send(r#"{"type":"ping","id":77}"#);
        let got = read_until(&mut c, |v| v["type"] == "pong");
        let before_pong = numbers(&got, "telemetry", "n");
        assert_eq!(
            before_pong,
            vec![0, 1, 2, 3],
            "the pong came after all four"
        );
        assert_eq!(got.last().unwrap()["requestId"], 77);
    });
}

/// The same rule for a connection's own publishes: a publish and a command in one write (one
/// receive, several commands) get the delivery first, then the reply; a publish with an id gets
/// its delivery before the `published` reply of the next one.
#[test]
fn a_reply_never_overtakes_the_delivery_of_an_earlier_publish_in_the_same_write() {
    on_both_backends(|backend| {
        let server = start(config(backend));
        let mut c = stalled_client(&server, "own");
        c.send_raw(
            concat!(
                r#"{"type":"publish","message":{"type":"m","stream":"own","n":0}}"#,
                "\n",
                r#"{"type":"ping","id":1}"#,
                "\n",
                r#"{"type":"publish","id":2,"message":{"type":"m","stream":"own","n":1}}"#,
                "\n",
                r#"{"type":"publish","id":3,"message":{"type":"m","stream":"own","n":2}}"#,
                "\n",
            )
            .as_bytes(),
        );
        let got = read_until(&mut c, |v| v["requestId"] == 3);
        let order: Vec<String> = got
            .iter()
            .map(|v| match v["type"].as_str().unwrap() {
                "m" => format!("m{}", v["n"]),
                kind => format!("{kind}{}", v["requestId"]),
            })
            .collect();
        assert_eq!(
            order,
            ["m0", "pong1", "published2", "m1", "published3"],
            "each delivery before the replies to the commands after its publish"
        );
    });
}

#[test]
fn a_screenshot_waiting_behind_a_backlog_is_replaced_by_the_next_for_its_slot() {
    on_both_backends(|backend| {
        let server = start(config(backend));
        let mut c = stalled_client(&server, "shots");
        backlog(&server, "shots", 0, BACKLOG);
        publish_json(&server, "shots", screenshot("shots", 1, 100));
        publish_json(&server, "shots", screenshot("shots", 2, 100));
        publish_json(&server, "shots", telemetry("shots", 0));
        let got = read_until(&mut c, |v| v["type"] == "telemetry");
        let shots = numbers(&got, "screenshot_update", "captureSequence");
        assert_eq!(shots, vec![2], "one frame for the slot, the newest");
    });
}

#[test]
fn an_unsubscribe_keeps_the_messages_published_before_it() {
    on_both_backends(|backend| {
        let server = start(config(backend));
        let mut c = stalled_client(&server, "unsub");
        backlog(&server, "unsub", 0, BACKLOG);
        publish_json(&server, "unsub", telemetry("unsub", 0));
        publish_json(&server, "unsub", telemetry("unsub", 1));
        c.send(r#"{"type":"unsubscribe","id":"u","subscriptionId":"unsub-1"}"#);
        let got = read_until(&mut c, |v| v["type"] == "unsubscribed");
        let kept = numbers(&got, "telemetry", "n");
        assert_eq!(
            kept,
            vec![0, 1],
            "both lossless messages came before the acknowledgement"
        );
        assert_eq!(
            got.iter().filter(|v| v["type"] == "tick").count(),
            BACKLOG as usize,
            "and the backlog before them"
        );
    });
}

/// 10 000 × 256 KiB screenshots of one slot (2.5 GiB) to a reader that never reads: the server
/// holds one pending frame for the slot (plus what it already encoded), not the stream.
#[test]
fn screenshots_of_one_slot_to_a_stalled_reader_cost_bounded_memory() {
    on_both_backends(|backend| {
        // A connection whose socket has refused nothing yet counts as paused once its backlog
        // passes `outbox.high_water_bytes` (docs/config.md): what one fan-out pass queues before
        // its first write is a healthy reader's, up to that much. A small mark keeps that part
        // to a frame or two, so the bound below checks the paused rules.
        let mut config = config(backend);
        config.outbox.high_water_bytes = 64 << 10;
        config.outbox.drop_types = Vec::new();
        let server = start(config);
        let mut c = stalled_client(&server, "flood");
        let pad = 256 << 10;
        let mut peak = 0;
        // The same 256 KiB frame (a clone shares its bytes), the last one numbered 9 999:
        // the slot's content is what matters to the rules, not the sequence number.
        let frame = Message::json(screenshot("flood", 0, pad)).unwrap();
        for n in 0..10_000 {
            let m = if n == 9_999 {
                Message::json(screenshot("flood", n, pad)).unwrap()
            } else {
                frame.clone()
            };
            let reached = server
                .engine
                .hub()
                .publish("flood", m, PublishOptions::default())
                .unwrap();
            assert_eq!(reached, 1);
            if n % 500 == 0 {
                peak = peak.max(server.engine.stats().unsent_bytes);
            }
        }
        publish_json(&server, "flood", telemetry("flood", 0));
        peak = peak.max(server.engine.stats().unsent_bytes);
        // The kernel's buffers and one write of at most ENCODE_AHEAD (one frame here) are
        // unsent; the queue holds one frame for the slot.
        assert!(
            peak <= 4 * pad,
            "the server held {peak} unsent bytes for one slot"
        );
        let got = read_until(&mut c, |v| v["type"] == "telemetry");
        let shots = numbers(&got, "screenshot_update", "captureSequence");
        assert!(
            shots.len() < 100,
            "{} stale frames were delivered",
            shots.len()
        );
        assert_eq!(shots.last(), Some(&9999), "the newest frame is delivered");
    });
}

/// Under a `limits.max_outbox_bytes` far below `outbox.high_water_bytes`, a burst of one slot's
/// screenshots (one write of 20 000, 1 KiB each) to a reader that reads nothing yet keeps one
/// frame for the slot: the coalescing rules take over before the limit (at a quarter of it), so
/// the reader is not closed, and gets the newest frame after what its socket held.
#[test]
fn one_slots_frames_keep_one_frame_under_a_max_outbox_bytes_below_the_high_water_mark() {
    on_both_backends(|backend| {
        let mut config = config(backend);
        config.limits.max_outbox_bytes = 256 << 10;
        let server = start(config);
        let mut c = stalled_client(&server, "flood");
        let mut publisher = Client::connect(server.addr);
        let mut burst = String::new();
        for n in 0..20_000 {
            burst.push_str(r#"{"type":"publish","message":"#);
            burst.push_str(&screenshot("flood", n, 1000));
            burst.push_str("}\n");
        }
        burst.push_str(r#"{"type":"publish","message":"#);
        burst.push_str(&telemetry("flood", 0));
        burst.push_str("}\n");
        publisher.send_raw(burst.as_bytes());
        let got = read_until(&mut c, |v| v["type"] == "telemetry" || v["type"] == "error");
        assert_eq!(
            got.last().map(|v| &v["type"]),
            Some(&serde_json::json!("telemetry")),
            "the reader was closed: {:?}",
            got.last()
        );
        let shots = numbers(&got, "screenshot_update", "captureSequence");
        assert_eq!(shots.last(), Some(&19_999), "the newest frame is delivered");
        assert!(
            shots.len() < 10_000,
            "{} frames were delivered",
            shots.len()
        );
    });
}

/// One publisher's single write of 20 000 messages: readers that keep reading get every one, in
/// order (there is no count-bounded queue between the publish and their outboxes).
#[test]
fn readers_that_keep_reading_lose_nothing_when_one_write_carries_20000_messages() {
    on_both_backends(|backend| {
        let server = start(config(backend));
        const READERS: usize = 4;
        const MESSAGES: u64 = 20_000;
        let received = Arc::new(AtomicU64::new(0));
        let readers = in_order_readers(
            server.addr,
            "burst",
            READERS,
            MESSAGES,
            &received,
            "a reader lost or reordered a message of the burst",
        );
        let mut publisher = Client::connect(server.addr);
        let mut burst = String::new();
        for seq in 0..MESSAGES {
            burst.push_str(r#"{"type":"publish","message":"#);
            burst.push_str(&message("burst", seq, 16));
            burst.push_str("}\n");
        }
        publisher.send_raw(burst.as_bytes());
        for r in readers {
            r.join().unwrap();
        }
        assert_eq!(received.load(Ordering::Relaxed), MESSAGES * READERS as u64);
        assert_eq!(server.engine.hub().stats().dropped, 0);
    });
}

/// A write commits a bounded amount. Screenshots of one slot (1 KiB each) go to a reader that
/// reads nothing, 128 at a time (more than one write carries) until the server's socket is full,
/// then 4 000 more at once. Of what went out after the bytes the kernel had taken by then, all
/// but the newest frame fit in what one write may carry beyond the kernel's take
/// (`ENCODE_AHEAD`, 64 KiB, plus `ENCODE_SLACK` of a batch or one frame): a gather write that turns out partial gives the frames
/// it did not start back to the outbox, where the next frame of their slot replaces them.
#[test]
fn one_frame_per_slot_after_a_partial_write() {
    on_both_backends(|backend| {
        let server = start(config(backend));
        let mut c = stalled_client(&server, "shots");
        let before = server.engine.stats().bytes_out;
        let pad = 1 << 10;
        let mut n = 0;
        while server.engine.stats().unsent_bytes == 0 {
            assert!(
                n < 1 << 20,
                "1 GiB of screenshots and the socket is not full"
            );
            let sent = server.engine.stats().bytes_out;
            for _ in 0..128 {
                publish_json(&server, "shots", screenshot("shots", n, pad));
                n += 1;
            }
            eventually(
                "the shard writes the screenshots or its socket is full",
                || {
                    let s = server.engine.stats();
                    s.bytes_out > sent || s.unsent_bytes > 0
                },
            );
        }
        let last_shot = n + 4_000 - 1;
        while n <= last_shot {
            publish_json(&server, "shots", screenshot("shots", n, pad));
            n += 1;
        }
        publish_json(&server, "shots", telemetry("shots", 0));
        // Wait until the kernel takes nothing more.
        let (mut taken, mut still) = (0, 0);
        eventually("the stalled reader's socket stays full", || {
            let s = server.engine.stats();
            still = if s.bytes_out == taken { still + 1 } else { 0 };
            taken = s.bytes_out;
            std::thread::sleep(std::time::Duration::from_millis(20));
            s.unsent_bytes > 0 && still >= 10
        });
        let taken = (taken - before) as usize;
        // Read everything, with each line's offset in the stream since the subscription.
        let (mut at, mut after, mut shots) = (0usize, Vec::new(), Vec::new());
        loop {
            let line = c.line().expect("a line before the end of the stream");
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            let start = at;
            at += line.len() + 1;
            if v["type"] == "screenshot_update" {
                shots.push(v["captureSequence"].as_u64().unwrap());
                if start >= taken {
                    after.push(line.len() + 1);
                }
            }
            if v["type"] == "telemetry" {
                break;
            }
        }
        assert_eq!(
            shots.last(),
            Some(&last_shot),
            "the newest frame is delivered"
        );
        assert!(shots.windows(2).all(|w| w[0] < w[1]), "frames in order");
        let frame = pad + 100;
        let stale: usize = after[..after.len().saturating_sub(1)].iter().sum();
        let most = powerhub::outbox::ENCODE_AHEAD + powerhub::outbox::ENCODE_SLACK.max(frame);
        assert!(
            stale <= most,
            "{stale} bytes of stale frames ({} frames) went out after the {taken} bytes the kernel had taken",
            after.len().saturating_sub(1)
        );
    });
}
