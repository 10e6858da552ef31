//! A stalled connection receiving 2 MiB screenshots at 30 Hz for a simulated minute holds at most
//! one pending screenshot per slot and emits the `frames_dropped` notifications the spec allows,
//! no more.

mod outbox_support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use outbox_support::{ndjson, ndjson_config, Conn};
use powerhub::outbox::{Field, MessageFactory, PushEvent, TimeoutAction};

const FRAME: usize = 2 << 20;
const HZ: u64 = 30;

/// The time of frame `tick` (exact: no accumulated rounding).
fn at(tick: u64) -> Duration {
    Duration::from_nanos(tick * 1_000_000_000 / HZ)
}

/// Builds `{"type":..,"deviceId":..,"deviceSessionUuid":"s1","captureSequence":N,"png":"<2 MiB>"}`
/// at write time only, from the event's sequence number and the shared image bytes.
#[derive(Debug, Default)]
struct Screens {
    calls: AtomicUsize,
}

impl MessageFactory for Screens {
    fn create_push_message(&self, _sub: &str, event: &PushEvent, _now: Instant) -> Bytes {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let seq = event.context_ref::<u64>().copied().unwrap_or(0);
        let device = event.meta().device_id.as_str().unwrap_or("");
        let mut json = format!(
            r#"{{"type":"{}","deviceId":"{device}","deviceSessionUuid":"s1","captureSequence":{seq},"png":""#,
            event.kind()
        )
        .into_bytes();
        json.extend_from_slice(event.payload());
        json.extend_from_slice(b"\"}");
        json.into()
    }
}

fn frame(kind: &str, device: &str, seq: u64, png: &Bytes) -> PushEvent {
    PushEvent::new(kind, png.clone())
        .device_id(device)
        .device_session_uuid("s1")
        .context(Arc::new(seq))
}

fn notice(device: &str) -> String {
    format!(
        r#"{{"type":"frames_dropped","subscriptionId":"obs","deviceId":"{device}","deviceSessionUuid":"s1","droppedType":"screenshot_update","reason":"backpressure"}}"#
    )
}

/// Six devices, reader stalled from the first write on (the socket takes nothing of a 9 MiB
/// reply and never becomes writable): the unsent bytes stay above 8 MiB, so each (subscription, device, session)
/// gets exactly one notification for the whole stall; no screenshot is retained; hierarchies keep
/// one per slot; keepalive keeps running and the connection is reaped at the liveness timeout.
#[test]
fn stalled_above_threshold_emits_one_notification_per_device_and_holds_no_screenshot() {
    let png = Bytes::from(vec![b'A'; FRAME]);
    let tree = Bytes::from_static(b"[]");
    let factory = Arc::new(Screens::default());
    let mut c = Conn::with(ndjson_config(), factory.clone(), ndjson());
    let devices = ["d1", "d2", "d3", "d4", "d5", "d6"];
    let mut reaped_at = None;
    // A reply of 9 MiB, the first thing the connection writes: a write commits one message at
    // least, so the stall holds more than the threshold unsent.
    let big = format!(r#"{{"type":"pong","pad":"{}"}}"#, "p".repeat(9 << 20));
    let now = c.now;
    c.outbox.push_control(Bytes::from(big), now);
    for tick in 0..(60 * HZ) {
        c.now = c.t0 + at(tick);
        if reaped_at.is_none() {
            for d in devices {
                let now = c.now;
                c.outbox
                    .push_event("obs", frame("screenshot_update", d, tick, &png), now);
                c.outbox
                    .push_event("obs", frame("hierarchy_update", d, tick, &tree), now);
            }
        }
        // The runtime's turn: the first write is taken not at all, and the socket never drains.
        if tick == 0 {
            let (offered, taken) = c.write(0);
            assert!(offered > 8 << 20 && taken == 0);
        } else {
            assert_eq!(
                c.write(usize::MAX),
                (0, 0),
                "nothing is written while stalled"
            );
        }
        match c.outbox.handle_timeout(c.now) {
            TimeoutAction::Reap => reaped_at = Some(tick),
            TimeoutAction::SendPing | TimeoutAction::Nothing => {}
            _ => unreachable!(),
        }
        let st = c.outbox.stats();
        // One hierarchy per slot, the notifications, at most three keepalive pings.
        assert!(
            st.queued <= devices.len() + devices.len() + 3,
            "queued {}",
            st.queued
        );
        assert!(
            st.queued_bytes <= devices.len() * 1024,
            "no screenshot is retained: {}",
            st.queued_bytes
        );
    }
    let st = c.outbox.stats();
    assert_eq!(
        reaped_at,
        Some(45 * HZ),
        "reaped at the liveness timeout (45 s)"
    );
    assert_eq!(
        st.notifications,
        devices.len() as u64,
        "one notification per (subscription, device, session)"
    );
    // The first write carried the reply only; every screenshot was dropped.
    assert_eq!(st.frames_dropped, (45 * HZ + 1) * devices.len() as u64);
    assert_eq!(st.pings, 2);
    assert_eq!(st.queued, 0, "reaping frees the queue");
    assert_eq!(st.unsent_bytes, 0);
    // Serialized: nothing (the notifications are not factory-made, and the retained
    // hierarchies were never written).
    assert_eq!(factory.calls.load(Ordering::SeqCst), 0);
    assert!(c.read.is_empty());
}

/// One device, reader stalled below the threshold (the first write took 64 KiB of a 2 MiB frame)
/// but alive (it answers pings): no notification is allowed, one screenshot and one hierarchy
/// are retained, and after a minute the drain delivers the rest of the first frame, then the
/// latest screenshot and hierarchy, then the keepalive pings, and nothing else. (The first write
/// carries the first screenshot only: a write commits at most `ENCODE_AHEAD` bytes or one
/// message, so the first hierarchy stayed under the rules and was replaced too.)
#[test]
fn stalled_below_threshold_retains_the_latest_screenshot_per_slot_and_drops_nothing() {
    let png = Bytes::from(vec![b'B'; FRAME]);
    let tree = Bytes::from_static(b"[1]");
    let factory = Arc::new(Screens::default());
    let mut c = Conn::with(ndjson_config(), factory.clone(), ndjson());
    let last = 60 * HZ - 1;
    for tick in 0..=last {
        c.now = c.t0 + at(tick);
        let now = c.now;
        c.outbox
            .push_event("obs", frame("screenshot_update", "d1", tick, &png), now);
        c.outbox
            .push_event("obs", frame("hierarchy_update", "d1", tick, &tree), now);
        if tick == 0 {
            c.write(64 << 10);
        } else {
            assert_eq!(c.write(usize::MAX), (0, 0));
        }
        if tick % (10 * HZ) == 0 {
            c.outbox.on_pong(now);
        }
        assert_ne!(c.outbox.handle_timeout(now), TimeoutAction::Reap);
        let st = c.outbox.stats();
        assert!(
            st.queued <= 2 + 4,
            "one screenshot and one hierarchy per slot, plus pings"
        );
        assert!(st.queued_bytes <= FRAME + 64);
    }
    let st = c.outbox.stats();
    assert_eq!(st.notifications, 0);
    assert_eq!(st.frames_dropped, 0);
    assert_eq!(st.coalesced, 2 * (last - 1) + 1);
    let calls_before = factory.calls.load(Ordering::SeqCst);
    assert_eq!(
        calls_before, 1,
        "only the first write's frame was serialized"
    );

    c.drain();
    let read = c.take();
    let got: Vec<&str> = read.lines().collect();
    assert_eq!(got.len(), 1 + 2 + 3);
    let head = |line: &str| line[..line.find(",\"png\"").unwrap()].to_owned();
    assert_eq!(
        head(got[0]),
        r#"{"type":"screenshot_update","deviceId":"d1","deviceSessionUuid":"s1","captureSequence":0"#
    );
    // The first hierarchy's slot was queued before the second screenshot's: the latest
    // hierarchy keeps that place.
    assert_eq!(
        head(got[1]),
        format!(
            r#"{{"type":"hierarchy_update","deviceId":"d1","deviceSessionUuid":"s1","captureSequence":{last}"#
        )
    );
    assert_eq!(
        head(got[2]),
        format!(
            r#"{{"type":"screenshot_update","deviceId":"d1","deviceSessionUuid":"s1","captureSequence":{last}"#
        )
    );
    assert_eq!(&got[3..], [r#"{"type":"ping"}"#; 3]);
    assert_eq!(factory.calls.load(Ordering::SeqCst), 3);
    assert!(!read.contains("frames_dropped"));
    let _ = notice("d1");
}

/// The shared fast path (the hub's NDJSON chunks) under the same load for two simulated seconds:
/// chunks are classified only while paused, and at most one screenshot per slot is retained.
#[test]
fn stalled_shared_chunks_hold_one_screenshot_per_slot() {
    let mut c = Conn::new(ndjson_config());
    let pad = "C".repeat(FRAME);
    let mut first = String::new();
    for tick in 0..(2 * HZ) {
        c.now = c.t0 + at(tick);
        let chunk = format!(
            "{{\"type\":\"screenshot_update\",\"deviceId\":\"d1\",\"deviceSessionUuid\":null,\"captureSequence\":{tick},\"png\":\"{pad}\"}}\n"
        );
        if tick == 0 {
            first = chunk.clone();
        }
        c.shared("obs", &chunk);
        if tick == 0 {
            c.write(1000);
        }
        let st = c.outbox.stats();
        assert!(st.queued <= 1 && st.queued_bytes <= FRAME + 200);
    }
    c.drain();
    let read = c.take();
    assert!(read.starts_with(&first));
    let second = &read[first.len()..];
    assert!(second.starts_with(&format!(
        "{{\"type\":\"screenshot_update\",\"deviceId\":\"d1\",\"deviceSessionUuid\":null,\"captureSequence\":{}",
        2 * HZ - 1
    )));
    assert_eq!(read.lines().count(), 2);
    assert_eq!(c.outbox.stats().frames_dropped, 0);
    let _ = Field::Null;
}

/// The lines the paused rules keep from a shared chunk are slices of it, and any one of them
/// would hold the whole chunk in memory, the frames the rules removed included, uncounted. A
/// stalled reader sent (screenshot of one slot, small lossless message) chunks keeps one
/// screenshot and every small message: the chunks it no longer needs are freed (a copy of each
/// small message is kept instead), so what it holds stays what it counts.
#[test]
fn lossless_messages_kept_from_shared_chunks_do_not_hold_the_frames_coalesced_away() {
    let mut c = Conn::new(ndjson_config());
    c.stall_with(r#"{"type":"stall"}"#, 1);
    let pad = "C".repeat(500_000);
    let mut chunks = Vec::new();
    for n in 0..50 {
        let chunk = Bytes::from(format!(
            "{{\"type\":\"screenshot_update\",\"deviceId\":\"d1\",\"captureSequence\":{n},\"png\":\"{pad}\"}}\n\
             {{\"type\":\"navigation\",\"n\":{n}}}\n"
        ));
        let now = c.now;
        c.outbox.push_shared("obs", chunk.clone(), now);
        chunks.push(chunk);
    }
    let held: Vec<usize> = (0..chunks.len())
        .filter(|&i| !chunks[i].is_unique())
        .collect();
    assert_eq!(
        held,
        [49],
        "only the chunk of the pending screenshot is held"
    );
    let st = c.outbox.stats();
    assert_eq!(st.coalesced, 49);
    assert!(c.outbox.memory_bytes() < 3 * 500_000, "{st:?}");
    c.drain();
    let lines = c.lines();
    assert_eq!(
        lines.len(),
        1 + 50 + 1,
        "the stall, 50 navigations, one screenshot"
    );
    assert!(
        lines[1].contains("\"captureSequence\":49"),
        "the screenshot keeps the first one's place"
    );
    for (i, line) in lines[2..].iter().enumerate() {
        assert_eq!(line, &format!("{{\"type\":\"navigation\",\"n\":{i}}}"));
    }
}
