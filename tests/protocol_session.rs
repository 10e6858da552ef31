//! The sans-IO push session: commands to actions, errors that keep the connection usable, and
//! the topic mapping, wired to real outboxes and a small topic table standing in for the hub.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use powerhub::outbox::{Framing, Outbox, OutboxConfig, PayloadFactory};
use powerhub::plugin::ProtocolError;
use powerhub::protocol::{device_topic, stream_topic, Action, RequestId, Session, SessionConfig};

/// The `ndjson` plugin's framer, as the server uses it.
fn ndjson() -> powerhub_ndjson::NdjsonProtocol {
    powerhub_ndjson::NdjsonProtocol::new(1 << 20)
}

fn line(session: &mut Session, text: &str) -> Action {
    let mut buf = text.as_bytes().to_vec();
    session.handle_line(&mut buf)
}

fn reply(action: Action) -> String {
    match action {
        Action::Reply(b) => String::from_utf8(b.to_vec()).unwrap(),
        other => panic!("expected a reply, got {other:?}"),
    }
}

#[test]
fn subscribe_generates_ids_and_maps_devices_to_topics() {
    let mut s = Session::new(3, SessionConfig::default());
    let Action::Subscribe {
        subscription_id,
        hub_id,
        topic,
        reply,
    } = line(&mut s, r#"{"type":"subscribe","id":"r1","stream":"obs"}"#)
    else {
        panic!()
    };
    assert_eq!(
        (&*subscription_id, hub_id.as_str(), topic.as_str()),
        ("obs-1", "c3/obs-1", "obs")
    );
    assert_eq!(
        &reply[..],
        br#"{"type":"subscribed","requestId":"r1","subscriptionId":"obs-1","stream":"obs"}"#
    );
    let Action::Subscribe {
        subscription_id,
        topic,
        ..
    } = line(
        &mut s,
        r#"{"type":"subscribe","id":"r2","stream":"obs","deviceId":"d/1"}"#,
    )
    else {
        panic!()
    };
    assert_eq!((&*subscription_id, topic.as_str()), ("obs-2", "obs/d/1"));
    assert_eq!(topic, device_topic("obs", "d/1"));
    assert_eq!(stream_topic("obs"), "obs");
}

#[test]
fn unknown_subscription_id_is_an_error_and_the_connection_stays_usable() {
    let mut s = Session::new(1, SessionConfig::default());
    assert_eq!(
        reply(line(
            &mut s,
            r#"{"type":"unsubscribe","id":"u1","subscriptionId":"nope"}"#
        )),
        r#"{"type":"error","requestId":"u1","code":"unknown_subscription","message":"unknown subscription `nope`"}"#
    );
    assert!(matches!(
        line(
            &mut s,
            r#"{"type":"subscribe","stream":"obs","subscriptionId":"x"}"#
        ),
        Action::Subscribe { .. }
    ));
    let Action::Unsubscribe {
        subscription_id,
        hub_id,
        topic,
        ack,
    } = line(
        &mut s,
        r#"{"type":"unsubscribe","id":"u2","subscriptionId":"x"}"#,
    )
    else {
        panic!()
    };
    assert_eq!((&*subscription_id, hub_id.as_str()), ("x", "c1/x"));
    assert_eq!(
        topic,
        stream_topic("obs"),
        "the unsubscribe names its topic"
    );
    assert_eq!(
        &ack[..],
        br#"{"type":"unsubscribed","requestId":"u2","subscriptionId":"x"}"#
    );
    assert!(s.subscription("x").is_none());
}

#[test]
fn duplicate_subscription_id_and_subscription_limit_are_errors() {
    let mut s = Session::new(
        1,
        SessionConfig {
            max_subscriptions: 2,
            ..SessionConfig::default()
        },
    );
    assert!(matches!(
        line(
            &mut s,
            r#"{"type":"subscribe","stream":"a","subscriptionId":"x"}"#
        ),
        Action::Subscribe { .. }
    ));
    assert_eq!(
        reply(line(
            &mut s,
            r#"{"type":"subscribe","id":1,"stream":"a","subscriptionId":"x"}"#
        )),
        r#"{"type":"error","requestId":1,"code":"duplicate_subscription","message":"duplicate subscription `x`"}"#
    );
    assert!(matches!(
        line(&mut s, r#"{"type":"subscribe","stream":"a-1"}"#),
        Action::Subscribe { .. }
    ));
    // At the limit, a subscription id in use is still only a duplicate: that subscribe would
    // add nothing, so it is not beyond the limit (it closed the connection).
    assert_eq!(
        reply(line(
            &mut s,
            r#"{"type":"subscribe","id":3,"stream":"b","subscriptionId":"x"}"#
        )),
        r#"{"type":"error","requestId":3,"code":"duplicate_subscription","message":"duplicate subscription `x`"}"#
    );
    // Past the limit the session asks for the close that docs/protocol.md states: the limit
    // error, answering the command, then the end of the connection.
    assert_eq!(
        line(&mut s, r#"{"type":"subscribe","id":2,"stream":"a"}"#),
        Action::CloseOnLimit {
            request_id: Some(RequestId::Int(2)),
            limit: "max_subscriptions_per_connection",
            message:
                "too many subscriptions: the limit max_subscriptions_per_connection = 2 is reached"
                    .into(),
        }
    );
}

#[test]
fn generated_ids_skip_ids_the_client_chose() {
    let mut s = Session::new(1, SessionConfig::default());
    assert!(matches!(
        line(
            &mut s,
            r#"{"type":"subscribe","stream":"obs","subscriptionId":"obs-1"}"#
        ),
        Action::Subscribe { .. }
    ));
    let Action::Subscribe {
        subscription_id, ..
    } = line(&mut s, r#"{"type":"subscribe","stream":"obs"}"#)
    else {
        panic!()
    };
    assert_eq!(&*subscription_id, "obs-2");
}

#[test]
fn line_over_the_configured_maximum_is_an_error_and_the_connection_stays_usable() {
    let mut s = Session::new(
        1,
        SessionConfig {
            max_line_bytes: 64,
            ..SessionConfig::default()
        },
    );
    let long = format!(r#"{{"type":"ping","id":"r1","pad":"{}"}}"#, "x".repeat(100));
    assert_eq!(
        reply(line(&mut s, &long)),
        format!(
            r#"{{"type":"error","requestId":"r1","code":"limit_exceeded","message":"line of {} bytes exceeds the limit max_message_bytes = 64","limit":"max_message_bytes"}}"#,
            long.len()
        )
    );
    assert_eq!(
        reply(line(&mut s, r#"{"type":"ping","id":"r2"}"#)),
        r#"{"type":"pong","requestId":"r2"}"#
    );
}

#[test]
fn bad_input_gets_an_error_reply_and_the_next_command_works() {
    let mut s = Session::new(1, SessionConfig::default());
    for bad in [
        "{",
        "\u{0}",
        r#"{"type":"nope","id":"q"}"#,
        r#"{"type":"subscribe","stream":5}"#,
        "[]",
        "null",
    ] {
        let r = reply(line(&mut s, bad));
        assert!(r.starts_with(r#"{"type":"error","requestId":"#), "{r}");
        assert!(matches!(
            line(&mut s, r#"{"type":"ping"}"#),
            Action::Reply(_)
        ));
    }
    let mut invalid_utf8 = b"{\"type\":\"ping\",\"id\":\"\xc3\x28\"}".to_vec();
    assert!(
        matches!(s.handle_line(&mut invalid_utf8), Action::Reply(r) if r.starts_with(br#"{"type":"error""#))
    );
}

#[test]
fn ping_gets_pong_and_pong_refreshes_liveness() {
    let mut s = Session::new(1, SessionConfig::default());
    assert_eq!(
        reply(line(&mut s, r#"{"type":"ping","id":9}"#)),
        r#"{"type":"pong","requestId":9}"#
    );
    assert_eq!(
        reply(line(&mut s, r#"{"type":"ping"}"#)),
        r#"{"type":"pong"}"#
    );
    assert_eq!(line(&mut s, r#"{"type":"pong"}"#), Action::Pong);
}

#[test]
fn a_line_too_long_to_frame_closes_the_connection_with_a_final_error() {
    let e = ProtocolError::TooLarge {
        what: "line",
        limit_name: "max_message_bytes",
        size: 20_000_000,
        limit: 16_777_216,
    };
    let bytes = Session::fatal_error(&e);
    assert_eq!(
        &bytes[..],
        br#"{"type":"error","requestId":null,"code":"limit_exceeded","message":"line of at least 20000000 bytes exceeds the limit max_message_bytes = 16777216; closing the connection","limit":"max_message_bytes"}"#
    );
}

/// A stand-in for the hub: topic -> subscribers (connection index, subscription id); publish
/// encodes the message once per topic as an NDJSON chunk and hands the same `Bytes` to every
/// subscriber's outbox.
#[derive(Default)]
struct Topics {
    subs: HashMap<String, Vec<(usize, Arc<str>, String)>>,
}

struct Client {
    session: Session,
    outbox: Outbox,
    read: Vec<u8>,
}

fn run_line(topics: &mut Topics, clients: &mut [Client], who: usize, text: &str, now: Instant) {
    let mut buf = text.as_bytes().to_vec();
    let action = clients[who].session.handle_line(&mut buf);
    match action {
        Action::Subscribe {
            subscription_id,
            hub_id,
            topic,
            reply,
        } => {
            topics
                .subs
                .entry(topic)
                .or_default()
                .push((who, subscription_id, hub_id));
            clients[who].outbox.push_control(reply, now);
        }
        Action::Unsubscribe {
            subscription_id,
            hub_id,
            ack,
            ..
        } => {
            for subs in topics.subs.values_mut() {
                subs.retain(|(_, _, h)| *h != hub_id);
            }
            clients[who].outbox.unsubscribe(&subscription_id, ack, now);
        }
        Action::Publish {
            request_id,
            topics: names,
            message,
            ..
        } => {
            let mut delivered = 0;
            for name in names {
                let mut chunk = BytesMut::from(&message.bytes()[..]);
                chunk.extend_from_slice(b"\n");
                let chunk = chunk.freeze();
                for (c, sub, _) in topics.subs.get(&name).into_iter().flatten() {
                    clients[*c].outbox.push_shared(sub, chunk.clone(), now);
                    delivered += 1;
                }
            }
            let r = powerhub::protocol::reply::published(request_id.as_ref(), delivered);
            clients[who].outbox.push_control(r, now);
        }
        Action::Reply(r) => clients[who].outbox.push_control(r, now),
        Action::Pong => clients[who].outbox.on_pong(now),
        other => panic!("{other:?}"),
    }
    for c in clients.iter_mut() {
        let mut out = Vec::new();
        let n = c.outbox.poll_transmit(&mut ndjson(), &mut out, now);
        for b in &out {
            c.read.extend_from_slice(b);
        }
        c.outbox.on_written(n, now);
    }
}

#[test]
fn device_and_all_device_subscribers_read_the_published_bytes_identically() {
    let now = Instant::now();
    let config = Arc::new(OutboxConfig {
        framing: Framing::Ndjson,
        ..OutboxConfig::default()
    });
    let mut clients: Vec<Client> = (0..3)
        .map(|i| Client {
            session: Session::new(i, SessionConfig::default()),
            outbox: Outbox::new(Arc::clone(&config), Arc::new(PayloadFactory), now).unwrap(),
            read: Vec::new(),
        })
        .collect();
    let mut topics = Topics::default();
    run_line(
        &mut topics,
        &mut clients,
        0,
        r#"{"type":"subscribe","id":"a","stream":"obs"}"#,
        now,
    );
    run_line(
        &mut topics,
        &mut clients,
        1,
        r#"{"type":"subscribe","id":"b","stream":"obs","deviceId":"d1"}"#,
        now,
    );
    let m1 = r#"{"type":"telemetry","stream":"obs","deviceId":"d1","cpu":0.5}"#;
    let m2 = r#"{"type":"telemetry","stream":"obs","deviceId":"d2","cpu":0.7}"#;
    let m3 = r#"{"type":"build_context","stream":"obs"}"#;
    for (i, m) in [m1, m2, m3].iter().enumerate() {
        run_line(
            &mut topics,
            &mut clients,
            2,
            &format!(r#"{{"type":"publish","id":{i},"message":{m}}}"#),
            now,
        );
    }
    let read = |c: &Client| String::from_utf8(c.read.clone()).unwrap();
    assert_eq!(
        read(&clients[0]),
        format!(
            "{}\n{m1}\n{m2}\n{m3}\n",
            r#"{"type":"subscribed","requestId":"a","subscriptionId":"obs-1","stream":"obs"}"#
        )
    );
    assert_eq!(
        read(&clients[1]),
        format!(
            "{}\n{m1}\n",
            r#"{"type":"subscribed","requestId":"b","subscriptionId":"obs-1","stream":"obs","deviceId":"d1"}"#
        )
    );
    assert_eq!(
        read(&clients[2]),
        "{\"type\":\"published\",\"requestId\":0,\"delivered\":2}\n{\"type\":\"published\",\"requestId\":1,\"delivered\":1}\n{\"type\":\"published\",\"requestId\":2,\"delivered\":1}\n"
    );
}

#[test]
fn publish_hands_the_hub_the_verbatim_message_as_json() {
    let mut s = Session::new(1, SessionConfig::default());
    let text = r#"{"type":"publish","id":"p1","message":{"type":"t","stream":"s","n":[1, 2]}}"#;
    match line(&mut s, text) {
        Action::Publish { message, .. } => {
            assert!(message.is_json());
            assert_eq!(
                &message.bytes()[..],
                br#"{"type":"t","stream":"s","n":[1, 2]}"#
            );
        }
        other => panic!("{other:?}"),
    }
    // A line that is not JSON never becomes a message.
    let bad = r#"{"type":"publish","message":{"type":"t","stream":"s","n":[1,}}"#;
    assert!(!matches!(line(&mut s, bad), Action::Publish { .. }));
}

/// `$` streams belong to the server: a client may read `$stats`, never publish to it (a forged
/// stats message would reach every stats reader).
#[test]
fn a_client_never_publishes_to_a_dollar_stream() {
    let mut s = Session::new(1, SessionConfig::default());
    let r = reply(line(
        &mut s,
        r#"{"type":"publish","id":2,"message":{"type":"stats","stream":"$stats","stats":{"subscribers":999999}}}"#,
    ));
    assert!(
        r.contains(r#""code":"invalid_value""#) && r.contains(r#""requestId":2"#),
        "{r}"
    );
    assert!(r.contains("belong to the server"), "{r}");
    assert!(matches!(
        line(&mut s, r#"{"type":"subscribe","id":3,"stream":"$stats"}"#),
        Action::Subscribe { .. }
    ));
}
