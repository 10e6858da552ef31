//! The engine's fan-out to push subscriptions, through the real dispatch on real sockets: every
//! subscriber of a topic reads the published bytes, identical; a topic batch is encoded once per
//! wire format for all its subscribers, on every shard (`stats().encoded`); an unsubscribed
//! subscription receives nothing more. (That a healthy NDJSON connection writes the shared encode itself, the same
//! buffer, is the outbox's: see its documentation example.)

mod engine_support;

use engine_support::*;

fn one_shard(backend: powerhub::runtime::BackendChoice) -> Server {
    let mut config = base_config(backend);
    config.engine.shards = 1;
    start(config)
}

#[test]
fn push_subscribers_of_a_topic_read_one_shared_encode_per_batch() {
    on_both_backends(|backend| {
        let server = one_shard(backend);
        let mut subs: Vec<Client> = (0..3).map(|_| Client::connect(server.addr)).collect();
        subs[0].send(r#"{"type":"subscribe","id":"a","stream":"obs"}"#);
        subs[1].send(r#"{"type":"subscribe","id":"b","stream":"obs"}"#);
        subs[2].send(r#"{"type":"subscribe","id":"c","stream":"obs","deviceId":"d1"}"#);
        let replies: Vec<String> = subs.iter_mut().map(|c| c.line().unwrap()).collect();
        assert_eq!(
            replies,
            [
                r#"{"type":"subscribed","requestId":"a","subscriptionId":"obs-1","stream":"obs"}"#,
                r#"{"type":"subscribed","requestId":"b","subscriptionId":"obs-1","stream":"obs"}"#,
                r#"{"type":"subscribed","requestId":"c","subscriptionId":"obs-1","stream":"obs","deviceId":"d1"}"#,
            ]
        );
        let encoded_before = server.engine.hub().stats().encoded;
        let m1 = r#"{"type":"screenshot_update","stream":"obs","deviceId":"d1","deviceSessionUuid":null,"captureSequence":1, "png":"AAAA"}"#;
        let m2 = r#"{"type":"device_lifecycle","stream":"obs","deviceId":"d2","state":"online"}"#;
        let mut publisher = Client::connect(server.addr);
        // One write: both publishes are read, and fanned out, in the order they were published.
        publisher.send_raw(
            format!(
                "{{\"type\":\"publish\",\"id\":1,\"message\":{m1}}}\n{{\"type\":\"publish\",\"id\":2,\"message\":{m2}}}\n"
            )
            .as_bytes(),
        );
        assert_eq!(
            publisher.line().unwrap(),
            r#"{"type":"published","requestId":1,"delivered":3}"#
        );
        assert_eq!(
            publisher.line().unwrap(),
            r#"{"type":"published","requestId":2,"delivered":2}"#
        );
        for c in &mut subs[..2] {
            assert_eq!(c.line().unwrap(), m1, "the published bytes, as written");
            assert_eq!(c.line().unwrap(), m2);
        }
        assert_eq!(subs[2].line().unwrap(), m1);
        let stats = server.engine.hub().stats();
        // The publications reach the shard in the order obs (m1), obs/d1 (m1), obs (m2): three
        // runs of one topic each (a connection subscribed to obs and obs/d1 must read them in
        // that order), each batch encoded once for all its subscribers.
        assert_eq!(
            stats.encoded - encoded_before,
            3,
            "one encode per batch: obs [m1], obs/d1 [m1], obs [m2]"
        );
        // Each push subscription's row counts the bytes fanned out to it (its lines), and
        // `bytes_out` is their sum.
        let line = |m: &str| m.len() as u64 + 1;
        let mut sent: Vec<(String, u64)> = stats
            .list
            .iter()
            .map(|s| (s.topic.clone(), s.bytes_sent))
            .collect();
        sent.sort();
        let both = line(m1) + line(m2);
        assert_eq!(
            sent,
            [
                ("obs".to_owned(), both),
                ("obs".to_owned(), both),
                ("obs/d1".to_owned(), line(m1))
            ]
        );
        assert_eq!(stats.bytes_out, 2 * both + line(m1));
    });
}

/// Reads one hub frame's JSON messages, as text.
fn frame_texts(s: &mut std::net::TcpStream) -> Vec<String> {
    frame_messages(s)
        .into_iter()
        .map(|m| String::from_utf8(m).unwrap())
        .collect()
}

#[test]
fn every_shard_sends_the_one_encode_of_a_topic_batch_per_wire_format() {
    use powerhub::plugin::frame;
    use powerhub::runtime::{ListenAddr, ListenerConfig};
    use std::io::Write;
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.engine.shards = 2;
        config
            .listeners
            .push(ListenerConfig::tcp("frame", "127.0.0.1:0"));
        let server = start(config);
        let ListenAddr::Tcp(frame_addr) = server.engine.listeners()[1].addr.clone() else {
            unreachable!()
        };
        // Connections go to the shards in turn: two NDJSON and two frame subscribers on each.
        let mut lines: Vec<Client> = Vec::new();
        let mut frames: Vec<std::net::TcpStream> = Vec::new();
        for _ in 0..2 {
            for _ in 0..2 {
                let mut c = Client::connect(server.addr);
                c.subscribe("shared");
                lines.push(c);
            }
            for _ in 0..2 {
                let mut f = std::net::TcpStream::connect(frame_addr).unwrap();
                f.set_read_timeout(Some(WAIT)).unwrap();
                let cmd = frame::encode_json_batch([
                    &br#"{"type":"subscribe","id":"f","stream":"shared"}"#[..],
                ])
                .unwrap();
                f.write_all(&cmd).unwrap();
                assert!(frame_texts(&mut f)[0].contains(r#""type":"subscribed""#));
                frames.push(f);
            }
        }
        let per_shard: Vec<usize> = server
            .engine
            .stats()
            .shards
            .iter()
            .map(|s| s.subscriptions)
            .collect();
        assert_eq!(per_shard, [4, 4], "subscriptions per shard");
        for seq in 0..20 {
            let before = server.engine.hub().stats().encoded;
            // Each publication is read by every subscriber before the next: every shard fans
            // out the same one-message batch.
            assert_eq!(publish(&server.engine, "shared", seq, 8), 8);
            let sent = message("shared", seq, 8);
            for c in &mut lines {
                assert_eq!(c.line().unwrap(), sent);
            }
            for f in &mut frames {
                assert_eq!(frame_texts(f), std::slice::from_ref(&sent));
            }
            let encoded = server.engine.hub().stats().encoded - before;
            assert_eq!(
                encoded, 2,
                "publication {seq}: one NDJSON encode and one hub frame for both shards"
            );
        }
    });
}

/// Two threads publish to one topic at once, so the two shards may take the publications in
/// different interleavings (and cut batches that cannot be shared): every subscriber, on either
/// shard, still reads each publisher's messages all and in order.
#[test]
fn two_publishers_reach_subscribers_on_every_shard_each_in_its_order() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.engine.shards = 2;
        let server = start(config);
        const PER_PUBLISHER: u64 = 3000;
        let readers: Vec<_> = (0..4)
            .map(|_| {
                let mut c = Client::connect(server.addr);
                c.subscribe("mix");
                std::thread::spawn(move || {
                    let mut next = [0u64; 2];
                    for _ in 0..2 * PER_PUBLISHER {
                        let v = c.msg();
                        let p = v["p"].as_u64().expect("p") as usize;
                        assert_eq!(v["seq"], next[p], "publisher {p}: {v}");
                        next[p] += 1;
                    }
                    next
                })
            })
            .collect();
        std::thread::scope(|s| {
            for p in 0..2 {
                let hub = server.engine.hub();
                s.spawn(move || {
                    for seq in 0..PER_PUBLISHER {
                        let m = format!(r#"{{"type":"tick","stream":"mix","p":{p},"seq":{seq}}}"#);
                        let m = powerhub::hub::Message::json(m).unwrap();
                        hub.publish("mix", m, powerhub::hub::PublishOptions::default())
                            .unwrap();
                    }
                });
            }
        });
        for r in readers {
            assert_eq!(r.join().unwrap(), [PER_PUBLISHER; 2]);
        }
    });
}

/// One publisher alternates between two streams and a device topic; a client subscribed to
/// all three reads every message in the order it was published, across its subscriptions (as a
/// subscriber of several subjects reads one publisher in order on NATS or Redis). A client
/// writes its publishes too, 50 per write, for the same order from a connection.
#[test]
fn a_connection_reads_its_subscriptions_in_publish_order_across_topics() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut reader = Client::connect(server.addr);
        for stream in ["oa", "ob"] {
            reader.subscribe(stream);
        }
        reader.send(r#"{"type":"subscribe","id":"d","stream":"oc","deviceId":"d1"}"#);
        assert_eq!(reader.msg()["type"], "subscribed");
        let topics = ["oa", "ob", "oc/d1"];
        const IN_PROCESS: u64 = 3000;
        for seq in 0..IN_PROCESS {
            let topic = topics[(seq % 3) as usize];
            let stream = topic.split('/').next().unwrap();
            let m = format!(r#"{{"type":"tick","stream":"{stream}","seq":{seq}}}"#);
            let m = powerhub::hub::Message::json(m).unwrap();
            server
                .engine
                .hub()
                .publish(topic, m, powerhub::hub::PublishOptions::default())
                .unwrap();
        }
        for seq in 0..IN_PROCESS {
            assert_eq!(reader.msg()["seq"], seq, "in-process publishes");
        }
        let mut publisher = Client::connect(server.addr);
        const WRITES: u64 = 20;
        for w in 0..WRITES {
            let mut lines = String::new();
            for k in 0..50 {
                let seq = w * 50 + k;
                let stream = ["oa", "ob"][(seq % 2) as usize];
                lines.push_str(&format!(
                    r#"{{"type":"publish","message":{{"type":"tick","stream":"{stream}","seq":{seq}}}}}"#
                ));
                lines.push('\n');
            }
            publisher.send_raw(lines.as_bytes());
        }
        for seq in 0..WRITES * 50 {
            assert_eq!(reader.msg()["seq"], seq, "publishes from a connection");
        }
    });
}

#[test]
fn unsubscribed_push_subscription_receives_nothing_more() {
    on_both_backends(|backend| {
        let server = one_shard(backend);
        let mut c = Client::connect(server.addr);
        c.send(r#"{"type":"subscribe","id":"a","stream":"obs","subscriptionId":"x"}"#);
        assert_eq!(
            c.line().unwrap(),
            r#"{"type":"subscribed","requestId":"a","subscriptionId":"x","stream":"obs"}"#
        );
        c.send(r#"{"type":"unsubscribe","id":"u","subscriptionId":"x"}"#);
        assert_eq!(
            c.line().unwrap(),
            r#"{"type":"unsubscribed","requestId":"u","subscriptionId":"x"}"#
        );
        let mut publisher = Client::connect(server.addr);
        publisher.send(r#"{"type":"publish","id":"p","message":{"type":"t","stream":"obs"}}"#);
        assert_eq!(
            publisher.line().unwrap(),
            r#"{"type":"published","requestId":"p","delivered":0}"#
        );
        // A ping answered after the publish: nothing of it came before the pong.
        c.send(r#"{"type":"ping","id":"after"}"#);
        assert_eq!(
            c.msg()["type"],
            "pong",
            "the unsubscribed connection got nothing of the publish"
        );
    });
}
