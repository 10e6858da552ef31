//! One test per rule of the push-stream back-pressure spec, on a virtual clock, asserting the
//! exact bytes the client reads.

mod outbox_support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use outbox_support::{ndjson, ndjson_config, shot, state, tree, Conn, Counting, Marked, Session};
use powerhub::outbox::{
    Field, Framing, Outbox, OutboxConfig, OutboxConfigError, PayloadFactory, PushEvent,
    TimeoutAction,
};

const S1: Session<'static> = Session::Str("s1");
const STALL: &str = r#"{"type":"subscribed","requestId":"r0","subscriptionId":"obs-1"}"#;

fn stalled(config: OutboxConfig) -> Conn {
    let mut c = Conn::new(config);
    c.stall_with(STALL, 10);
    c
}

fn rest_of_stall() -> String {
    format!("{STALL}\n")
}

fn lines(ls: &[&str]) -> String {
    ls.iter().map(|l| format!("{l}\n")).collect()
}

// ---- healthy -----------------------------------------------------------------------------

#[test]
fn healthy_connection_delivers_each_message_at_once_in_its_original_json_form() {
    let mut c = Conn::new(ndjson_config());
    let chunk = "{\"type\":\"telemetry\", \"n\" : 1}\n{\"type\":\"screenshot_update\",\"deviceId\":\"d\",\"captureSequence\":1}\n";
    c.shared("s1", chunk);
    c.flush();
    assert_eq!(c.take(), chunk);
    c.event("s1", r#"{"type":"navigation",  "to":"home"}"#);
    c.control(r#"{"type":"pong","requestId":1}"#);
    c.flush();
    assert_eq!(
        c.take(),
        "{\"type\":\"navigation\",  \"to\":\"home\"}\n{\"type\":\"pong\",\"requestId\":1}\n"
    );
}

#[test]
fn healthy_connection_does_not_coalesce_state_updates() {
    let mut c = Conn::new(ndjson_config());
    let (a, b) = (shot(Some("d"), S1, 1, 0), shot(Some("d"), S1, 2, 0));
    c.event("s", &a);
    c.event("s", &b);
    c.flush();
    assert_eq!(c.take(), lines(&[&a, &b]));
    assert_eq!(c.outbox.stats().coalesced, 0);
}

#[test]
fn healthy_shared_chunk_is_written_without_copy() {
    let t0 = Instant::now();
    let mut outbox = Outbox::new(ndjson_config(), Arc::new(PayloadFactory), t0).unwrap();
    let chunk = Bytes::from_static(b"{\"type\":\"a\"}\n{\"type\":\"b\"}\n");
    outbox.push_shared("s", chunk.clone(), t0);
    let mut out = Vec::new();
    let n = outbox.poll_transmit(&mut ndjson(), &mut out, t0);
    assert_eq!(n, chunk.len());
    assert_eq!(out.len(), 1);
    assert_eq!(
        out[0].as_ptr(),
        chunk.as_ptr(),
        "the shared chunk itself goes on the wire"
    );
}

// ---- pause -------------------------------------------------------------------------------

/// A healthy connection whose socket took all it was offered has admitted nothing of what it
/// still has queued: the next pause applies the rules to all of it (here, one pending frame for
/// the slot of the screenshots queued while healthy).
#[test]
fn a_full_write_while_healthy_leaves_what_is_queued_to_the_rules_of_the_next_pause() {
    let mut c = Conn::new(ndjson_config());
    for seq in 0..200 {
        c.shared("s", &format!("{}\n", shot(Some("d"), S1, seq, 1000)));
    }
    // The first 64 KiB, all taken: still healthy, about 130 screenshots still queued.
    let (offered, taken) = c.write(usize::MAX);
    assert_eq!(offered, taken);
    assert!(!c.outbox.is_paused());
    // The next offer, partly taken: paused, and what is queued is admitted.
    let (offered, taken) = c.write(10);
    assert!(taken < offered);
    assert!(c.outbox.is_paused());
    let stats = c.outbox.stats();
    assert_eq!(stats.queued, 1, "one pending frame for the slot: {stats:?}");
    assert!(stats.coalesced > 30, "{stats:?}");
}

#[test]
fn partial_write_pauses_until_drain_and_resumes_mid_message() {
    let mut c = Conn::new(ndjson_config());
    let a = r#"{"type":"telemetry","n":1}"#;
    let b = r#"{"type":"telemetry","n":2}"#;
    let d = r#"{"type":"telemetry","n":3}"#;
    c.shared("s", &format!("{a}\n{b}\n"));
    assert_eq!(c.write(5), (a.len() + b.len() + 2, 5));
    assert!(c.outbox.is_paused());
    assert!(c.outbox.wants_writable());
    c.event("s", d);
    // No drain yet: nothing is offered.
    assert_eq!(c.write(usize::MAX), (0, 0));
    assert_eq!(c.read_str(), &a[..5]);
    // Drain: the unsent bytes only, from mid-message.
    c.outbox.on_writable(c.now);
    let (offered, _) = c.write(7);
    assert_eq!(offered, a.len() + b.len() + 2 - 5);
    assert!(c.outbox.is_paused());
    c.outbox.on_writable(c.now);
    c.flush();
    assert!(!c.outbox.is_paused());
    assert_eq!(
        c.take(),
        lines(&[a, b, d]),
        "nothing reordered, nothing duplicated"
    );
}

// ---- coalescing --------------------------------------------------------------------------

#[test]
fn paused_screenshot_and_hierarchy_keep_only_the_latest_per_slot() {
    let mut c = stalled(ndjson_config());
    for seq in 1..=3 {
        c.event("obs-1", &shot(Some("d1"), S1, seq, 4));
        c.event("obs-1", &tree(Some("d1"), S1, seq));
    }
    assert_eq!(c.outbox.stats().queued, 2);
    c.drain();
    assert_eq!(
        c.read_str(),
        format!(
            "{}{}",
            rest_of_stall(),
            lines(&[&shot(Some("d1"), S1, 3, 4), &tree(Some("d1"), S1, 3)])
        )
    );
    assert_eq!(c.outbox.stats().coalesced, 4);
}

#[test]
fn hierarchy_diff_annotations_are_advisory_the_latest_full_tree_replaces_the_earlier_ones() {
    let mut c = stalled(ndjson_config());
    let trees = [
        r#"{"type":"hierarchy_update","deviceId":"d1","deviceSessionUuid":"s1","captureSequence":1,"tree":{"id":"root","children":[]},"diff":{"added":["root"]}}"#,
        r#"{"type":"hierarchy_update","deviceId":"d1","deviceSessionUuid":"s1","captureSequence":2,"tree":{"id":"root","children":[{"id":"a"}]},"diff":{"added":["a"],"base":1}}"#,
        r#"{"type":"hierarchy_update","deviceId":"d1","deviceSessionUuid":"s1","captureSequence":3,"tree":{"id":"root","children":[{"id":"b"}]},"diff":{"removed":["a"],"added":["b"],"base":2}}"#,
    ];
    c.shared("obs-1", &lines(&trees[..2]));
    c.event("obs-1", trees[2]);
    assert_eq!(
        c.outbox.stats().queued,
        1,
        "one slot, whatever the diffs say"
    );
    c.drain();
    assert_eq!(
        c.read_str(),
        format!("{}{}", rest_of_stall(), lines(&[trees[2]])),
        "the surviving tree is delivered byte for byte, diff annotation included"
    );
    assert_eq!(c.outbox.stats().coalesced, 2);
}

#[test]
fn paused_shared_chunks_are_split_and_coalesced_like_events() {
    let mut c = stalled(ndjson_config());
    let chunk: String = (1..=3)
        .map(|s| {
            format!(
                "{}\n{}\n",
                shot(Some("d1"), S1, s, 2),
                tree(Some("d1"), S1, s)
            )
        })
        .collect();
    c.shared("obs-1", &chunk);
    c.drain();
    assert_eq!(
        c.read_str(),
        format!(
            "{}{}",
            rest_of_stall(),
            lines(&[&shot(Some("d1"), S1, 3, 2), &tree(Some("d1"), S1, 3)])
        )
    );
}

#[test]
fn absent_null_and_string_session_uuids_are_three_distinct_epochs() {
    let mut c = stalled(ndjson_config());
    for seq in 1..=2 {
        for session in [Session::Absent, Session::Null, Session::Str("u")] {
            c.event("obs-1", &shot(Some("d1"), session, seq, 0));
        }
    }
    c.drain();
    let want =
        [Session::Absent, Session::Null, Session::Str("u")].map(|s| shot(Some("d1"), s, 2, 0));
    assert_eq!(
        c.read_str(),
        format!(
            "{}{}",
            rest_of_stall(),
            lines(&want.each_ref().map(String::as_str))
        )
    );
}

#[test]
fn replacement_keeps_its_slot_position_ahead_of_later_acknowledgements() {
    let mut c = stalled(ndjson_config());
    let ack = r#"{"type":"published","requestId":"r5","delivered":3}"#;
    c.event("obs-1", &shot(Some("d1"), S1, 1, 0));
    c.control(ack);
    c.event("obs-1", &shot(Some("d1"), S1, 2, 0));
    c.drain();
    assert_eq!(
        c.read_str(),
        format!(
            "{}{}",
            rest_of_stall(),
            lines(&[&shot(Some("d1"), S1, 2, 0), ack])
        )
    );
}

#[test]
fn all_device_subscription_keeps_a_slot_per_device_session_and_type() {
    let mut c = stalled(ndjson_config());
    let frames = [
        shot(Some("d1"), S1, 1, 0),
        shot(Some("d2"), S1, 1, 0),
        tree(Some("d1"), S1, 1),
        shot(Some("d1"), Session::Str("s2"), 1, 0),
        shot(Some("d2"), S1, 2, 0),
        shot(Some("d1"), S1, 2, 0),
        tree(Some("d1"), S1, 2),
    ];
    let chunk: String = frames.iter().map(|f| format!("{f}\n")).collect();
    c.shared("all", &chunk);
    c.drain();
    let want = [&frames[5], &frames[4], &frames[6], &frames[3]].map(String::as_str);
    assert_eq!(c.read_str(), format!("{}{}", rest_of_stall(), lines(&want)));
}

#[test]
fn new_epoch_frames_queue_after_previous_epoch_pending_frames_and_lifecycle_events() {
    let mut c = stalled(ndjson_config());
    let ended = r#"{"type":"device_session_ended","deviceId":"d1","deviceSessionUuid":"s1"}"#;
    let started = r#"{"type":"device_session_started","deviceId":"d1","deviceSessionUuid":"s2"}"#;
    let s2 = Session::Str("s2");
    c.event("obs-1", &shot(Some("d1"), S1, 1, 0));
    c.event("obs-1", &tree(Some("d1"), S1, 1));
    c.event("obs-1", ended);
    c.event("obs-1", started);
    c.event("obs-1", &shot(Some("d1"), s2, 1, 0));
    c.event("obs-1", &tree(Some("d1"), s2, 1));
    c.event("obs-1", &shot(Some("d1"), s2, 2, 0));
    c.drain();
    let want = [
        shot(Some("d1"), S1, 1, 0),
        tree(Some("d1"), S1, 1),
        ended.to_owned(),
        started.to_owned(),
        shot(Some("d1"), s2, 2, 0),
        tree(Some("d1"), s2, 1),
    ];
    assert_eq!(
        c.read_str(),
        format!(
            "{}{}",
            rest_of_stall(),
            lines(&want.each_ref().map(String::as_str))
        )
    );
}

#[test]
fn every_other_type_stays_fifo_and_lossless_while_paused() {
    let mut c = stalled(ndjson_config());
    let kinds = [
        "ping",
        "pong",
        "error",
        "subscribed",
        "unsubscribed",
        "device_lifecycle",
        "build_context",
        "navigation",
        "storage_update",
        "performance_update",
        "telemetry",
        "failure",
        "observation_update",
        "some_future_type",
    ];
    let mut want = Vec::new();
    for round in 0..2 {
        let mut chunk = String::new();
        for kind in kinds {
            let m = state(kind, Some("d1"), S1, round, 0);
            chunk.push_str(&format!("{m}\n"));
            want.push(m);
        }
        c.shared("obs-1", &chunk);
        c.control(r#"{"type":"error","code":"x"}"#);
        want.push(r#"{"type":"error","code":"x"}"#.to_owned());
    }
    c.drain();
    assert_eq!(
        c.read_str(),
        format!(
            "{}{}",
            rest_of_stall(),
            lines(&want.iter().map(String::as_str).collect::<Vec<_>>())
        )
    );
    assert_eq!(c.outbox.stats().coalesced, 0);
}

#[test]
fn messages_carrying_id_or_request_id_are_lossless_even_if_named_like_state_updates() {
    let mut c = stalled(ndjson_config());
    let msgs = [
        r#"{"type":"screenshot_update","id":1,"deviceId":"d1","deviceSessionUuid":"s1"}"#,
        r#"{"type":"screenshot_update","id":2,"deviceId":"d1","deviceSessionUuid":"s1"}"#,
        r#"{"type":"hierarchy_update","requestId":"q","deviceId":"d1","deviceSessionUuid":"s1"}"#,
        r#"{"type":"hierarchy_update","requestId":"q","deviceId":"d1","deviceSessionUuid":"s1"}"#,
        r#"{"type":"hierarchy_update","id":null,"deviceId":"d1","deviceSessionUuid":"s1"}"#,
    ];
    c.shared("obs-1", &lines(&msgs[..3]));
    for m in &msgs[3..] {
        c.event("obs-1", m);
    }
    c.drain();
    assert_eq!(c.read_str(), format!("{}{}", rest_of_stall(), lines(&msgs)));
}

// ---- unsubscribe -------------------------------------------------------------------------

#[test]
fn unsubscribe_removes_retained_state_while_controls_and_the_ack_keep_their_order() {
    let mut c = stalled(ndjson_config());
    let x = r#"{"type":"subscribed","requestId":"r2","subscriptionId":"b"}"#;
    let life = r#"{"type":"device_lifecycle","deviceId":"d1","state":"online"}"#;
    let ack = r#"{"type":"unsubscribed","requestId":"r3","subscriptionId":"a"}"#;
    c.event("a", &shot(Some("d1"), S1, 1, 0));
    c.event("a", &tree(Some("d1"), S1, 1));
    c.event("b", &shot(Some("d1"), S1, 1, 0));
    c.control(x);
    c.event("a", life);
    let now = c.now;
    c.outbox
        .unsubscribe("a", Bytes::from_static(ack.as_bytes()), now);
    assert_eq!(c.outbox.stats().removed, 2);
    c.drain();
    assert_eq!(
        c.read_str(),
        format!(
            "{}{}",
            rest_of_stall(),
            lines(&[&shot(Some("d1"), S1, 1, 0), x, life, ack])
        )
    );
}

// ---- frames_dropped ----------------------------------------------------------------------

fn over_threshold() -> Conn {
    // 64 bytes of threshold; the stall leaves ~55 of a 65-byte reply plus a big control unsent.
    let config = OutboxConfig {
        high_water_bytes: 64,
        ..ndjson_config()
    };
    let mut c = Conn::new(config);
    c.stall_with(
        &format!(r#"{{"type":"subscribed","pad":"{}"}}"#, "x".repeat(100)),
        10,
    );
    assert!(c.outbox.unsent_bytes() > 64);
    c.take();
    c
}

#[test]
fn over_threshold_screenshot_is_replaced_by_the_exact_frames_dropped_notification() {
    let mut c = over_threshold();
    let frame = shot(
        Some("emulator-5554"),
        Session::Str("device-session-1"),
        1,
        1000,
    );
    c.event("observationstream-1", &frame);
    assert_eq!(c.outbox.stats().frames_dropped, 1);
    c.drain();
    let read = c.take();
    let want = "{\"type\":\"frames_dropped\",\"subscriptionId\":\"observationstream-1\",\"deviceId\":\"emulator-5554\",\"deviceSessionUuid\":\"device-session-1\",\"droppedType\":\"screenshot_update\",\"reason\":\"backpressure\"}\n";
    assert!(read.ends_with(want), "{read}");
    assert!(!read.contains("AAAA"), "no screenshot bytes");
}

#[test]
fn only_unsent_bytes_exceeding_the_threshold_drop_a_screenshot_exactly_at_it_does_not() {
    let stall = format!(r#"{{"type":"subscribed","pad":"{}"}}"#, "x".repeat(100));
    let unsent = stall.len() + 1 - 10; // the line and its newline, 10 bytes taken
    for (threshold, dropped) in [(unsent, 0), (unsent - 1, 1)] {
        let config = OutboxConfig {
            high_water_bytes: threshold,
            ..ndjson_config()
        };
        let mut c = Conn::new(config);
        c.stall_with(&stall, 10);
        assert_eq!(c.outbox.unsent_bytes(), unsent);
        c.event("o", &shot(Some("d1"), S1, 1, 0));
        assert_eq!(
            c.outbox.stats().frames_dropped,
            dropped,
            "threshold {threshold}, unsent {unsent}"
        );
        c.drain();
        let read = c.take();
        assert_eq!(
            read.contains("frames_dropped"),
            dropped == 1,
            "threshold {threshold}: {read}"
        );
        assert_eq!(
            read.contains(&shot(Some("d1"), S1, 1, 0)),
            dropped == 0,
            "threshold {threshold}: {read}"
        );
    }
}

#[test]
fn frames_dropped_preserves_device_fields_including_null_and_omits_them_when_absent() {
    let mut c = over_threshold();
    c.event("o", &shot(None, Session::Absent, 1, 0));
    c.event("o", &shot(Some("d"), Session::Null, 1, 0));
    c.event(
        "o",
        r#"{"type":"screenshot_update","deviceId":null,"deviceSessionUuid":"u"}"#,
    );
    c.drain();
    let read = c.take();
    let tail: Vec<&str> = read.lines().skip(1).collect();
    assert_eq!(
        tail,
        [
            r#"{"type":"frames_dropped","subscriptionId":"o","droppedType":"screenshot_update","reason":"backpressure"}"#,
            r#"{"type":"frames_dropped","subscriptionId":"o","deviceId":"d","deviceSessionUuid":null,"droppedType":"screenshot_update","reason":"backpressure"}"#,
            r#"{"type":"frames_dropped","subscriptionId":"o","deviceId":null,"deviceSessionUuid":"u","droppedType":"screenshot_update","reason":"backpressure"}"#,
        ]
    );
}

#[test]
fn frames_dropped_is_sent_at_most_once_per_key_until_the_buffer_is_seen_at_or_below_the_threshold()
{
    let mut c = over_threshold();
    for seq in 0..5 {
        c.event("o", &shot(Some("d1"), S1, seq, 0));
        c.event("o", &shot(Some("d2"), S1, seq, 0));
        c.event("p", &shot(Some("d1"), S1, seq, 0));
    }
    let st = c.outbox.stats();
    assert_eq!((st.frames_dropped, st.notifications), (15, 3));
    // A drain attempt that leaves the buffer above the threshold does not re-arm.
    c.outbox.on_writable(c.now);
    c.write(2);
    assert!(c.outbox.unsent_bytes() > 64);
    c.event("o", &shot(Some("d1"), S1, 9, 0));
    assert_eq!(c.outbox.stats().notifications, 3);
    // A full drain observes the buffer below the threshold: the next stall notifies again.
    c.drain();
    c.stall_with(&format!(r#"{{"type":"x","pad":"{}"}}"#, "y".repeat(100)), 1);
    c.event("o", &shot(Some("d1"), S1, 10, 0));
    assert_eq!(c.outbox.stats().notifications, 4);
}

#[test]
fn frames_dropped_shares_the_control_fifo() {
    let mut c = over_threshold();
    let a = r#"{"type":"published","requestId":"a","delivered":1}"#;
    let b = r#"{"type":"published","requestId":"b","delivered":1}"#;
    c.control(a);
    c.event("o", &shot(Some("d1"), S1, 1, 0));
    c.control(b);
    c.drain();
    let read = c.take();
    let tail: Vec<&str> = read.lines().skip(1).collect();
    assert_eq!(
        tail,
        [
            a,
            r#"{"type":"frames_dropped","subscriptionId":"o","deviceId":"d1","deviceSessionUuid":"s1","droppedType":"screenshot_update","reason":"backpressure"}"#,
            b
        ]
    );
}

#[test]
fn only_uncorrelated_screenshots_are_dropped_over_the_threshold() {
    let mut c = over_threshold();
    let t = tree(Some("d1"), S1, 1);
    let corr =
        r#"{"type":"screenshot_update","requestId":"q1","deviceId":"d1","deviceSessionUuid":"s1"}"#;
    c.event("o", &t);
    c.event("o", corr);
    c.drain();
    let read = c.take();
    assert_eq!(read.lines().skip(1).collect::<Vec<_>>(), [t.as_str(), corr]);
    assert_eq!(c.outbox.stats().frames_dropped, 0);
}

#[test]
fn threshold_is_not_a_frame_size_limit_the_first_frame_is_admitted_unchanged() {
    let mut c = Conn::new(ndjson_config());
    let big = shot(Some("d1"), S1, 1, 9 << 20);
    c.event("o", &big);
    let (offered, _) = c.write(1 << 16);
    assert_eq!(offered, big.len() + 1);
    assert!(c.outbox.unsent_bytes() > 8 << 20);
    c.outbox.on_writable(c.now);
    c.flush();
    assert_eq!(c.take(), format!("{big}\n"));
    assert_eq!(c.outbox.stats().frames_dropped, 0);
}

#[test]
fn threshold_applies_message_by_message_when_the_fifo_is_written() {
    let config = OutboxConfig {
        high_water_bytes: 1000,
        ..ndjson_config()
    };
    let mut c = Conn::new(config);
    let frames: Vec<String> = (0..3)
        .map(|d| shot(Some(&format!("d{d}")), S1, 1, 600))
        .collect();
    for f in &frames {
        c.event("o", f);
    }
    c.flush();
    let read = c.take();
    let got: Vec<&str> = read.lines().collect();
    assert_eq!(got[..2], [frames[0].as_str(), frames[1].as_str()]);
    assert_eq!(
        got[2],
        r#"{"type":"frames_dropped","subscriptionId":"o","deviceId":"d2","deviceSessionUuid":"s1","droppedType":"screenshot_update","reason":"backpressure"}"#
    );
}

// ---- memory bound ------------------------------------------------------------------------

#[test]
fn stalled_connection_writes_nothing_more_and_holds_one_frame_per_slot_plus_controls() {
    let mut c = stalled(ndjson_config());
    for seq in 0..1000 {
        for d in ["d1", "d2", "d3"] {
            c.event("o", &shot(Some(d), S1, seq, 100));
            c.event("o", &tree(Some(d), S1, seq));
        }
        assert_eq!(c.write(usize::MAX), (0, 0), "no drain: nothing written");
    }
    c.control(r#"{"type":"pong"}"#);
    let st = c.outbox.stats();
    assert_eq!(st.queued, 7);
    assert!(
        st.queued_bytes
            < 3 * (shot(Some("d1"), S1, 999, 100).len() + tree(Some("d1"), S1, 999).len()) + 20
    );
}

// ---- keepalive and liveness --------------------------------------------------------------

#[test]
fn keepalive_pings_and_reaping_run_while_stalled() {
    let mut c = stalled(ndjson_config());
    assert_eq!(c.outbox.poll_timeout(), Some(c.at(15.0)));
    assert_eq!(c.outbox.handle_timeout(c.at(14.9)), TimeoutAction::Nothing);
    assert_eq!(c.outbox.handle_timeout(c.at(15.0)), TimeoutAction::SendPing);
    assert_eq!(c.outbox.handle_timeout(c.at(30.0)), TimeoutAction::SendPing);
    assert_eq!(c.outbox.stats().pings, 2);
    assert_eq!(c.outbox.poll_timeout(), Some(c.at(45.0)));
    assert_eq!(c.outbox.handle_timeout(c.at(45.0)), TimeoutAction::Reap);
    assert!(c.outbox.is_reaped());
    assert_eq!(c.outbox.poll_timeout(), None);
    c.outbox.on_writable(c.now);
    assert_eq!(c.write(usize::MAX), (0, 0));
}

#[test]
fn successful_local_writes_do_not_refresh_liveness() {
    let mut c = Conn::new(ndjson_config());
    for s in 0..45 {
        c.now = c.at(f64::from(s));
        c.control(r#"{"type":"telemetry"}"#);
        c.flush();
        let _ = c.outbox.handle_timeout(c.now);
    }
    assert_eq!(c.outbox.handle_timeout(c.at(45.0)), TimeoutAction::Reap);
}

#[test]
fn inbound_pong_refreshes_liveness() {
    let mut c = Conn::new(ndjson_config());
    assert_eq!(c.outbox.handle_timeout(c.at(15.0)), TimeoutAction::SendPing);
    c.outbox.on_pong(c.at(30.0));
    assert_ne!(c.outbox.handle_timeout(c.at(45.0)), TimeoutAction::Reap);
    assert_eq!(c.outbox.handle_timeout(c.at(75.0)), TimeoutAction::Reap);
}

#[test]
fn drain_progress_refreshes_liveness() {
    let mut c = stalled(ndjson_config());
    c.now = c.at(40.0);
    c.outbox.on_writable(c.now);
    c.write(5);
    assert!(c.outbox.is_paused());
    assert_ne!(c.outbox.handle_timeout(c.at(50.0)), TimeoutAction::Reap);
    assert_eq!(c.outbox.handle_timeout(c.at(85.0)), TimeoutAction::Reap);
}

#[test]
fn connection_without_subscription_gets_keepalive_while_a_stalled_reply_is_queued() {
    let mut c = Conn::new(ndjson_config());
    let reply = r#"{"type":"error","requestId":"r1","code":"unknown_command","message":"unknown command `x`"}"#;
    c.stall_with(reply, 3);
    assert_eq!(c.outbox.handle_timeout(c.at(15.0)), TimeoutAction::SendPing);
    c.now = c.at(16.0);
    c.drain();
    assert_eq!(c.take(), format!("{reply}\n{{\"type\":\"ping\"}}\n"));
}

// ---- serialization -----------------------------------------------------------------------

#[test]
fn serialization_is_per_delivered_message_through_the_message_factory() {
    let factory = Arc::new(Counting::default());
    let mut c = Conn::with(ndjson_config(), factory.clone(), ndjson());
    let e = r#"{"type":"telemetry","v":1}"#;
    c.event("a", e);
    c.event("b", e);
    c.shared("c", &format!("{e}\n"));
    c.flush();
    assert_eq!(
        c.take(),
        lines(&[
            r#"{"sub":"a","call":1,"payload":{"type":"telemetry","v":1}}"#,
            r#"{"sub":"b","call":2,"payload":{"type":"telemetry","v":1}}"#,
            r#"{"sub":"c","call":3,"payload":{"type":"telemetry","v":1}}"#,
        ])
    );
}

#[test]
fn deferred_state_frame_is_serialized_only_if_it_survives_coalescing() {
    let factory = Arc::new(Counting::default());
    let mut c = Conn::with(ndjson_config(), factory.clone(), ndjson());
    c.stall_with(STALL, 3);
    for seq in 0..10 {
        c.event("a", &shot(Some("d1"), S1, seq, 0));
    }
    c.shared("a", &format!("{}\n", tree(Some("d1"), S1, 1)));
    c.shared("a", &format!("{}\n", tree(Some("d1"), S1, 2)));
    assert_eq!(
        factory.calls.load(Ordering::SeqCst),
        0,
        "nothing serialized while paused"
    );
    c.drain();
    assert_eq!(factory.calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        c.take(),
        format!(
            "{}{}",
            rest_of_stall(),
            lines(&[
                &format!(
                    r#"{{"sub":"a","call":1,"payload":{}}}"#,
                    shot(Some("d1"), S1, 9, 0)
                ),
                &format!(
                    r#"{{"sub":"a","call":2,"payload":{}}}"#,
                    tree(Some("d1"), S1, 2)
                ),
            ])
        )
    );
}

#[test]
fn capture_sequence_is_never_rewritten() {
    let mut c = stalled(ndjson_config());
    c.event("o", &shot(Some("d1"), S1, 7, 0));
    c.event("o", &tree(Some("d1"), S1, 7));
    c.event("o", &shot(Some("d1"), S1, 9, 0));
    c.drain();
    // The client gets screenshot 9 and hierarchy 7: it pairs them by captureSequence (they do
    // not pair), the outbox does not pretend they do.
    assert_eq!(
        c.read_str(),
        format!(
            "{}{}",
            rest_of_stall(),
            lines(&[&shot(Some("d1"), S1, 9, 0), &tree(Some("d1"), S1, 7)])
        )
    );
}

// ---- configuration -----------------------------------------------------------------------

#[test]
fn defaults_are_the_spec_values_and_validation_names_the_field() {
    let d = OutboxConfig::default();
    assert_eq!(d.coalesce_types, ["screenshot_update", "hierarchy_update"]);
    assert_eq!(d.drop_types, ["screenshot_update"]);
    assert_eq!(d.high_water_bytes, 8 * 1024 * 1024);
    assert_eq!(
        (d.keepalive_interval, d.liveness_timeout),
        (Duration::from_secs(15), Duration::from_secs(45))
    );
    let t0 = Instant::now();
    let err = |config| Outbox::new(config, Arc::new(PayloadFactory), t0).unwrap_err();
    let e = err(OutboxConfig {
        high_water_bytes: 0,
        ..d.clone()
    });
    assert!(
        matches!(e, OutboxConfigError::ZeroHighWater) && e.to_string().contains("high_water_bytes")
    );
    let e = err(OutboxConfig {
        keepalive_interval: Duration::ZERO,
        ..d.clone()
    });
    assert!(e.to_string().contains("keepalive_interval"));
    let e = err(OutboxConfig {
        liveness_timeout: Duration::from_secs(15),
        ..d.clone()
    });
    assert!(e.to_string().contains("liveness_timeout"));
    let e = err(OutboxConfig {
        coalesce_types: vec![String::new()],
        ..d.clone()
    });
    assert!(e.to_string().contains("coalesce_types"));
    let e = err(OutboxConfig {
        drop_types: vec![String::new()],
        ..d
    });
    assert!(e.to_string().contains("drop_types"));
}

#[test]
fn coalescible_types_threshold_and_intervals_are_configurable() {
    let config = OutboxConfig {
        coalesce_types: vec!["cursor_update".into()],
        drop_types: vec!["cursor_update".into()],
        high_water_bytes: 64,
        keepalive_interval: Duration::from_secs(1),
        liveness_timeout: Duration::from_secs(3),
        ..ndjson_config()
    };
    let mut c = Conn::new(config);
    c.stall_with(r#"{"type":"x"}"#, 1);
    c.event("o", r#"{"type":"cursor_update","x":1}"#);
    c.event("o", r#"{"type":"cursor_update","x":2}"#);
    c.event("o", &shot(Some("d"), S1, 1, 0));
    c.event("o", &shot(Some("d"), S1, 2, 0));
    assert_eq!(c.outbox.handle_timeout(c.at(1.0)), TimeoutAction::SendPing);
    c.drain();
    assert_eq!(
        c.take(),
        format!(
            "{}{}",
            "{\"type\":\"x\"}\n",
            lines(&[
                r#"{"type":"cursor_update","x":2}"#,
                &shot(Some("d"), S1, 1, 0),
                &shot(Some("d"), S1, 2, 0),
                r#"{"type":"ping"}"#
            ])
        )
    );
    assert_eq!(c.outbox.handle_timeout(c.at(4.0)), TimeoutAction::Reap);
}

#[test]
fn protocol_framing_frames_every_message_and_the_ping_through_the_stream_protocol() {
    let config = OutboxConfig {
        framing: Framing::Protocol,
        ..OutboxConfig::default()
    };
    let mut c = Conn::with(config, Arc::new(PayloadFactory), Marked);
    c.shared("a", "{\"type\":\"a\"}\n{\"type\":\"b\"}\n");
    c.control(r#"{"type":"pong"}"#);
    assert_eq!(c.outbox.handle_timeout(c.at(15.0)), TimeoutAction::SendPing);
    c.flush();
    assert_eq!(
        c.take(),
        r#"<{"type":"a"}>|<{"type":"b"}>|<{"type":"pong"}>|PING|"#
    );
}

#[test]
fn push_event_metadata_can_be_given_without_parsing() {
    let mut c = stalled(ndjson_config());
    let now = c.now;
    for n in 0..3 {
        let ev = PushEvent::new("screenshot_update", Bytes::from(format!(r#"{{"n":{n}}}"#)))
            .device_id("d1")
            .device_session_uuid(Field::Null);
        c.outbox.push_event("o", ev, now);
    }
    c.drain();
    assert_eq!(
        c.read_str(),
        format!("{}{}", rest_of_stall(), "{\"n\":2}\n")
    );
}

#[test]
fn limited_offer_fully_taken_is_not_back_pressure() {
    let mut c = Conn::new(ndjson_config());
    let big = shot(Some("d1"), S1, 1, 600); // its own segment
    let small = r#"{"type":"telemetry"}"#;
    c.event("o", &big);
    c.event("o", small);
    let now = c.now;
    let mut out = Vec::new();
    let n = c.outbox.poll_transmit_max(&mut ndjson(), &mut out, now, 1);
    assert_eq!((out.len(), n), (1, big.len()));
    c.read.extend_from_slice(&out[0]);
    c.outbox.on_written(n, now);
    assert!(!c.outbox.is_paused() && !c.outbox.wants_writable());
    c.flush();
    assert_eq!(c.take(), lines(&[&big, small]));
}

#[test]
fn an_idle_outbox_is_small() {
    // Idle connections: the outbox is a few hundred bytes and allocates nothing until used.
    let size = std::mem::size_of::<Outbox>();
    println!("size_of::<Outbox>() = {size}");
    assert!(size <= 512, "size_of::<Outbox>() = {size}");
}

#[test]
fn shared_chunk_without_final_newline_still_ends_its_line() {
    let mut c = Conn::new(ndjson_config());
    c.shared("s", "{\"type\":\"a\"}\n{\"type\":\"b\"}");
    c.control(r#"{"type":"c"}"#);
    c.flush();
    assert_eq!(
        c.take(),
        "{\"type\":\"a\"}\n{\"type\":\"b\"}\n{\"type\":\"c\"}\n"
    );
}

// ---- a write commits a bounded amount ------------------------------------------------------

/// 4 000 × 1 KiB screenshots of one slot pushed to a healthy connection whose socket then
/// takes only part of the write: the frames the socket did not start go back under the rules,
/// so what the reader gets beyond the bytes the socket took is at most `ENCODE_AHEAD` (plus one
/// frame), and then one frame for the slot: the newest.
#[test]
fn a_partial_write_leaves_at_most_encode_ahead_bytes_out_of_the_rules_reach() {
    let mut c = Conn::new(ndjson_config());
    let frames: Vec<String> = (0..4000).map(|n| shot(Some("d"), S1, n, 1000)).collect();
    for f in &frames {
        c.event("s1", f);
    }
    let frame_len = frames[0].len() + 1;
    let (offered, taken) = partial_write(&mut c, frame_len);
    assert!(c.outbox.is_paused());
    c.drain();
    at_most_one_write_past_the_take(&c, (offered, taken), frame_len, &frames[3999]);
    assert!(c.outbox.stats().coalesced >= 3000);
}

/// The socket takes 10 000 bytes of the first write, then nothing until it drains: the write is
/// partial, and carried at most `ENCODE_AHEAD` plus a frame. Returns (offered, taken).
fn partial_write(c: &mut Conn, frame_len: usize) -> (usize, usize) {
    use powerhub::outbox::ENCODE_AHEAD;
    let (offered, taken) = c.write(10_000);
    assert!(taken < offered, "the write is partial");
    assert!(
        offered <= ENCODE_AHEAD + frame_len,
        "one write carried {offered} bytes, more than ENCODE_AHEAD = {ENCODE_AHEAD} plus a frame"
    );
    (offered, taken)
}

/// What the reader got after the drain: what the socket took (whole or in part), what was
/// committed after it, and the slot's one pending frame, the newest, last.
fn at_most_one_write_past_the_take(
    c: &Conn,
    (offered, taken): (usize, usize),
    frame_len: usize,
    newest: &str,
) {
    let got = c.lines();
    let beyond_taken = (offered - taken).div_ceil(frame_len);
    assert!(
        got.len() <= taken.div_ceil(frame_len) + beyond_taken + 1,
        "{} frames reached the reader",
        got.len()
    );
    assert_eq!(
        got.last().unwrap(),
        newest,
        "the slot's newest frame comes last"
    );
}

/// The same bound when the frames come as the shards deliver them, in shared chunks of a whole
/// batch (64 messages of 3 KiB, more than `ENCODE_AHEAD` + `ENCODE_SLACK`): a write carries a chunk's lines up to
/// the budget only, the rest of the chunk stays queued under the rules.
#[test]
fn a_partial_write_of_a_shared_batch_leaves_at_most_encode_ahead_bytes_out_of_the_rules_reach() {
    use powerhub::outbox::{ENCODE_AHEAD, ENCODE_SLACK};
    let mut c = Conn::new(ndjson_config());
    let frames: Vec<String> = (0..4096).map(|n| shot(Some("d"), S1, n, 3000)).collect();
    let frame_len = frames[0].len() + 1;
    let batch = |b: &[String]| b.iter().map(|f| format!("{f}\n")).collect::<String>();
    assert!(
        64 * frame_len > ENCODE_AHEAD + ENCODE_SLACK,
        "a batch is more than one write carries"
    );
    c.shared("s1", &batch(&frames[..64]));
    let written = partial_write(&mut c, frame_len);
    for b in frames[64..].chunks(64) {
        c.shared("s1", &batch(b));
    }
    c.drain();
    at_most_one_write_past_the_take(&c, written, frame_len, &frames[4095]);
}

/// The same holds for a reader that never drains: the outbox holds one pending frame for the
/// slot, whatever was pushed.
#[test]
fn a_stalled_slot_holds_one_pending_frame_however_many_are_pushed() {
    let mut c = Conn::new(ndjson_config());
    c.event("s1", &shot(Some("d"), S1, 0, 1000));
    let (offered, taken) = c.write(100);
    assert!(taken < offered);
    for n in 1..10_000 {
        c.event("s1", &shot(Some("d"), S1, n, 1000));
    }
    let stats = c.outbox.stats();
    assert_eq!(stats.queued, 1, "one pending frame for the slot: {stats:?}");
    assert!(stats.queued_bytes < 2000, "{stats:?}");
}

/// A socket's `write()` returns false once its buffer passes the high-water mark: so does the
/// outbox's backlog. Frames pushed faster than any write takes them (here 40 screenshots of one
/// slot with no transmit in between, 4 KiB each against a 16 KiB mark) coalesce before they are
/// encoded: the reader gets the first ones, up to the mark, and then the newest.
#[test]
fn a_backlog_past_the_high_water_mark_pauses_a_healthy_connection() {
    let config = OutboxConfig {
        high_water_bytes: 16 << 10,
        ..ndjson_config()
    };
    let mut c = Conn::new(config);
    let frames: Vec<String> = (0..40).map(|n| shot(Some("d"), S1, n, 4096)).collect();
    for f in &frames {
        c.event("s1", f);
    }
    assert!(c.outbox.is_paused(), "the backlog passed the mark");
    let st = c.outbox.stats();
    assert!(st.coalesced > 30, "{st:?}");
    c.flush();
    let got = c.lines();
    assert!(got.len() <= 5, "{} frames reached the reader", got.len());
    assert_eq!(
        got.last().unwrap(),
        &frames[39],
        "the newest frame comes last"
    );
    assert!(
        !c.outbox.is_paused(),
        "healthy again once everything is written"
    );
}
