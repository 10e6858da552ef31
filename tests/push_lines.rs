//! An NDJSON receive of many lines is handed to the push connection as one run
//! (`Inbound::Lines`), read line by line where it lies. Each line of a run is handled exactly as
//! the same line received alone: the same requests in the same order, the same bytes written.
//! A connection that gathers publish runs (`PushConfig::with_publish_runs`) asks the same
//! publishes, some of them as one `Request::PublishRun`.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use powerhub::outbox::{OutboxConfig, PayloadFactory};
use powerhub::plugin::{ProtocolFactory, ProtocolLimits};
use powerhub::protocol::{Session, SessionConfig};
use powerhub::push::{PushConfig, PushConnection, PushLimits, Request};
use proptest::prelude::*;

/// Lines a client sends: usual publishes (with and without an id, to a device's topic too),
/// other commands, commands refused, blank lines, `\r\n` endings and lines that are not JSON.
const LINES: &[&str] = &[
    r#"{"type":"publish","message":{"type":"t","stream":"s","n":1}}"#,
    r#"{"type":"publish","id":7,"message":{"type":"t","stream":"s","deviceId":"d","n":2}}"#,
    "{\"type\":\"publish\",\"message\":{\"type\":\"t\",\"stream\":\"s\",\"n\":3}}\r",
    r#"{"type":"publish","message":{"type":"t","stream":"s","p":"\u0078"}}"#,
    r#"{"type":"subscribe","id":1,"stream":"s"}"#,
    r#"{"type":"unsubscribe","id":2,"stream":"s"}"#,
    r#"{"type":"ping","id":3}"#,
    "{\"type\":\"ping\",\"id\":4}\r",
    r#"{"type":"publish","message":{"type":"t"}}"#,
    r#"{"type":"publish","message":{"type":"t","stream":"s2","n":5}}"#,
    r#"{"type":"publish","message":{"type":"t","stream":"$x","n":6}}"#,
    // Over the session's `max_line_bytes` (100 here): refused, the connection stays.
    r#"{"type":"publish","message":{"type":"t","stream":"s","pad":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}}"#,
    r#"{"type":"nope"}"#,
    "not json",
    "",
    "   ",
    " \t\r",
];

/// A connection over NDJSON; with `gather`, it gathers publish runs.
fn connection(now: Instant, gather: bool) -> PushConnection {
    let config = PushConfig::new(
        PushLimits::default(),
        OutboxConfig::default(),
        Arc::new(PayloadFactory),
    )
    .expect("a valid config")
    .with_publish_runs(gather);
    let proto = powerhub_ndjson::NdjsonFactory.new_connection(&ProtocolLimits::default());
    PushConnection::new(
        proto,
        Session::new(
            1,
            SessionConfig {
                max_line_bytes: 100,
                ..SessionConfig::default()
            },
        ),
        &Arc::new(config),
        now,
    )
    .expect("a valid config")
}

/// Feeds `receives` one after another, answers every request alike, and writes everything:
/// the requests (with a publish's topics) and the bytes written. With `gather`, the connection
/// gathers publish runs, and each message of a run is listed as its own publish would be.
fn run(receives: &[Vec<u8>], gather: bool) -> (Vec<String>, Vec<u8>) {
    let now = Instant::now();
    // One wall clock for both runs: replies that carry the time read the same.
    let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let mut conn = connection(now, gather);
    let mut requests = Vec::new();
    let mut wire = Vec::new();
    for input in receives {
        conn.handle_input(input, now);
        while let Some(request) = conn.poll(now, wall) {
            match &request {
                Request::Subscribe { .. } => conn.subscribe_done(Ok(()), now),
                Request::Unsubscribe { .. } => conn.unsubscribe_done(now),
                Request::Publish { .. } => {
                    let topics: Vec<&str> = conn.publish_topics().collect();
                    requests.push(format!("{topics:?}"));
                    conn.publish_done(Ok(1), now);
                }
                Request::PublishRun { messages } => {
                    assert!(gather, "a run asked of a connection that gathers none");
                    let topics: Vec<&str> = conn.publish_topics().collect();
                    assert_eq!(topics.len(), 1, "a run has one topic");
                    for message in messages {
                        requests.push(format!("{topics:?}"));
                        let one = Request::Publish {
                            message: message.clone(),
                        };
                        requests.push(format!("{one:?}"));
                    }
                    continue;
                }
                // Where the driver fans out depends on where the receives end: not compared.
                Request::FanOut => continue,
                other => panic!("unexpected request {other:?}"),
            }
            requests.push(format!("{request:?}"));
        }
        let mut chunks = Vec::new();
        while let Some(transmit) = conn.poll_transmit(&mut chunks, 64, now) {
            for c in &chunks {
                wire.extend_from_slice(c);
            }
            let taken = transmit.len();
            conn.on_written(transmit, taken, now);
            chunks.clear();
        }
    }
    (requests, wire)
}

/// `lines`, each ended by `\n`.
fn text(lines: &[&str]) -> Vec<u8> {
    lines
        .iter()
        .flat_map(|l| [l.as_bytes(), b"\n"].concat())
        .collect()
}

#[test]
fn each_line_of_one_receive_is_handled_as_that_line_received_alone() {
    let one = run(&[text(LINES)], false);
    let alone = run(&LINES.iter().map(|l| text(&[l])).collect::<Vec<_>>(), false);
    assert_eq!(one.0, alone.0);
    assert_eq!(
        String::from_utf8_lossy(&one.1),
        String::from_utf8_lossy(&alone.1)
    );
    assert!(
        one.0.iter().filter(|r| r.starts_with("Publish")).count() >= 3,
        "{:?}",
        one.0
    );
}

proptest! {
    /// Any sequence of the lines, cut into receives anywhere, is handled as the lines sent one
    /// receive each.
    #[test]
    fn a_run_of_lines_cut_anywhere_is_handled_as_its_lines_one_by_one(
        picks in prop::collection::vec(0..LINES.len(), 1..24),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
        gather in any::<bool>(),
    ) {
        let lines: Vec<&str> = picks.iter().map(|&i| LINES[i]).collect();
        let all = text(&lines);
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(all.len() + 1)).collect();
        at.push(0);
        at.push(all.len());
        at.sort_unstable();
        let receives: Vec<Vec<u8>> = at.windows(2).map(|w| all[w[0]..w[1]].to_vec()).collect();
        let alone = run(&lines.iter().map(|l| text(&[l])).collect::<Vec<_>>(), false);
        prop_assert_eq!(run(&receives, gather), alone);
    }
}

#[test]
fn publishes_without_an_id_to_one_topic_are_asked_as_one_run_in_the_order_read() {
    let now = Instant::now();
    let wall = SystemTime::now();
    let mut conn = connection(now, true);
    let publish = |stream: &str, n: u32| {
        format!(r#"{{"type":"publish","message":{{"type":"t","stream":"{stream}","n":{n}}}}}"#)
    };
    let lines = [
        publish("s", 1),
        publish("s", 2),
        publish("s", 3),
        publish("s2", 4),
        publish("s2", 5),
        r#"{"type":"publish","id":9,"message":{"type":"t","stream":"s2","n":6}}"#.to_owned(),
        publish("s2", 7),
        r#"{"type":"subscribe","id":1,"stream":"s"}"#.to_owned(),
        publish("s", 8),
        publish("s", 9),
    ];
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    conn.handle_input(&text(&refs), now);
    let mut asked = Vec::new();
    while let Some(request) = conn.poll(now, wall) {
        let topic = conn.publish_topics().collect::<Vec<_>>().join(",");
        let n = |m: &powerhub::hub::Message| {
            let json: serde_json::Value = serde_json::from_slice(m.bytes()).unwrap();
            json["n"].as_u64().unwrap()
        };
        match request {
            Request::PublishRun { messages } => {
                asked.push(format!(
                    "run {topic} {:?}",
                    messages.iter().map(n).collect::<Vec<_>>()
                ));
            }
            Request::Publish { message } => {
                asked.push(format!("one {topic} {}", n(&message)));
                conn.publish_done(Ok(0), now);
            }
            Request::Subscribe { .. } => {
                asked.push("subscribe".to_owned());
                conn.subscribe_done(Ok(()), now);
            }
            Request::FanOut => asked.push("fan out".to_owned()),
            other => panic!("unexpected request {other:?}"),
        }
    }
    // A run ends before a publish of another topic, one with an id and any other command; a
    // subscribed connection gathers none (each of its publishes is fanned out before its next
    // command).
    assert_eq!(
        asked,
        [
            "run s [1, 2, 3]",
            "run s2 [4, 5]",
            "one s2 6",
            "run s2 [7]",
            "subscribe",
            "one s 8",
            "fan out",
            "one s 9",
        ]
    );
}
