//! Push subscriptions over real loopback sockets, on both IO backends.

mod engine_support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use engine_support::*;
use powerhub::runtime::SlowConsumerChoice;

#[test]
fn many_clients_subscribe_and_receive_in_order() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.subscriptions.max_queue = 1024;
        let server = start(config);
        const CLIENTS: usize = 16;
        const MESSAGES: u64 = 2000;
        let received = Arc::new(AtomicU64::new(0));
        let readers = in_order_readers(
            server.addr,
            "prices",
            CLIENTS,
            MESSAGES,
            &received,
            "in order",
        );
        // Published in-process in bursts of 500 (each subscriber queue holds 1024), each burst
        // once the readers have the previous one, so no policy ever has to drop.
        for seq in 0..MESSAGES {
            assert_eq!(publish(&server.engine, "prices", seq, 32), CLIENTS);
            if seq % 500 == 499 {
                let target = (seq + 1) * CLIENTS as u64;
                eventually("readers have the burst", || {
                    received.load(Ordering::Relaxed) >= target
                });
            }
        }
        for r in readers {
            r.join().unwrap();
        }
        assert_eq!(server.engine.hub().stats().dropped, 0);
    });
}

#[test]
fn publish_command_reaches_other_clients_byte_identical() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut sub = Client::connect(server.addr);
        let mut device = Client::connect(server.addr);
        sub.subscribe("obs");
        device.send(r#"{"type":"subscribe","id":1,"stream":"obs","deviceId":"d1"}"#);
        assert_eq!(device.msg()["type"], "subscribed");
        let mut publisher = Client::connect(server.addr);
        let msg = r#"{"type":"telemetry","stream":"obs","deviceId":"d1","v":[1,2,3]}"#;
        publisher.send(&format!(
            r#"{{"type":"publish","id":"p1","message":{msg}}}"#
        ));
        let reply = publisher.msg();
        assert_eq!(reply["type"], "published", "{reply}");
        assert_eq!(sub.line().unwrap(), msg);
        assert_eq!(device.line().unwrap(), msg);
    });
}

#[test]
fn a_publish_without_an_id_gets_no_reply_but_its_error_does() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut sub = Client::connect(server.addr);
        sub.subscribe("obs");
        let mut publisher = Client::connect(server.addr);
        let msg = r#"{"type":"telemetry","stream":"obs","v":1}"#;
        publisher.send(&format!(r#"{{"type":"publish","message":{msg}}}"#));
        assert_eq!(sub.line().unwrap(), msg);
        // The next line the publisher reads answers the ping sent after the publish: nothing
        // answered the publish.
        publisher.send(r#"{"type":"ping","id":"after"}"#);
        let next = publisher.msg();
        assert_eq!(next["type"], "pong", "{next}");
        assert_eq!(next["requestId"], "after", "{next}");
        // A publish that fails is answered, id or not.
        publisher.send(r#"{"type":"publish","message":{"type":"telemetry"}}"#);
        let error = publisher.msg();
        assert_eq!(error["type"], "error", "{error}");
        assert_eq!(error["requestId"], serde_json::Value::Null, "{error}");
        // With an id, the acknowledgement comes back with the subscriber count.
        publisher.send(&format!(r#"{{"type":"publish","id":9,"message":{msg}}}"#));
        let reply = publisher.msg();
        assert_eq!(reply["type"], "published", "{reply}");
        assert_eq!(reply["requestId"], 9, "{reply}");
        assert_eq!(reply["delivered"], 1, "{reply}");
        assert_eq!(sub.line().unwrap(), msg);
    });
}

#[test]
fn stalled_reader_does_not_delay_others_and_costs_bounded_memory() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.backpressure_bytes = 64 << 10;
        config.limits.max_outbox_bytes = 4 << 20;
        config.subscriptions.max_queue = 256;
        let server = start(config);
        let mut stalled = Client::connect(server.addr);
        stalled.subscribe("feed");
        const HEALTHY: usize = 4;
        const MESSAGES: u64 = 6000;
        let received = Arc::new(AtomicU64::new(0));
        let readers = in_order_readers(
            server.addr,
            "feed",
            HEALTHY,
            MESSAGES,
            &received,
            "a healthy reader lost or reordered a message",
        );
        // 6000 x 4 KiB = 24 MiB per subscriber: far more than the stalled socket buffers hold.
        // Paced so that healthy readers never overflow their own queues.
        let mut peak_unsent = 0;
        for seq in 0..MESSAGES {
            publish(&server.engine, "feed", seq, 4096);
            if seq % 100 == 99 {
                let target = (seq + 1) * HEALTHY as u64;
                eventually("healthy readers keep up", || {
                    received.load(Ordering::Relaxed) >= target
                });
                peak_unsent = peak_unsent.max(server.engine.stats().unsent_bytes);
            }
        }
        let _healthy: Vec<Client> = readers.into_iter().map(|r| r.join().unwrap()).collect();
        let stats = server.engine.hub().stats();
        assert_eq!(stats.list.len(), HEALTHY + 1);
        assert!(
            stats.list.iter().all(|s| s.queued <= 256),
            "hub queues bounded by max_queue: {:?}",
            stats.list
        );
        let mut by_drops: Vec<_> = stats.list.iter().map(|s| s.dropped).collect();
        by_drops.sort_unstable();
        assert!(
            by_drops[HEALTHY] > 0,
            "the stalled subscriber's policy dropped messages: {by_drops:?}"
        );
        assert!(
            by_drops[..HEALTHY].iter().all(|&d| d == 0),
            "healthy subscribers lost nothing: {by_drops:?}"
        );
        let bound = (4 << 20) + 64 * 1024;
        assert!(
            peak_unsent <= bound,
            "unsent bytes {peak_unsent} exceed the configured bound {bound}"
        );
        drop(stalled);
    });
}

#[test]
fn client_that_disconnects_mid_write_is_cleaned_up() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut keeper = Client::connect(server.addr);
        keeper.subscribe("bulk");
        let kept = Arc::new(AtomicU64::new(0));
        let keeper = {
            let kept = Arc::clone(&kept);
            std::thread::spawn(move || {
                // The other subscriber gets everything, in order.
                for seq in 0..2000 {
                    assert_eq!(keeper.msg()["seq"], seq);
                    kept.fetch_add(1, Ordering::Relaxed);
                }
                keeper
            })
        };
        let before = server.engine.stats().closed;
        {
            let mut c = Client::connect(server.addr);
            c.subscribe("bulk");
            c.send(r#"{"type":"subscribe","stream":"other"}"#);
            assert_eq!(c.msg()["type"], "subscribed");
            for seq in 0..2000 {
                publish(&server.engine, "bulk", seq, 4096);
                if seq % 64 == 63 {
                    eventually("the keeper keeps up", || {
                        kept.load(Ordering::Relaxed) > seq - 63
                    });
                }
            }
            // Read a little, then drop the socket with megabytes still in flight.
            let _ = c.msg();
        }
        eventually("the dropped connection is closed and counted", || {
            server.engine.stats().closed > before
        });
        eventually("its subscriptions are gone from the hub", || {
            server.engine.hub().stats().subscribers == 1
        });
        assert_eq!(server.engine.stats().subscriptions, 1);
        assert_eq!(server.engine.stats().open_connections, 1);
        let _keeper = keeper.join().unwrap();
    });
}

#[test]
fn graceful_shutdown_delivers_what_was_published_before_it() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        // Room for everything published before the shutdown: no policy drops here.
        config.subscriptions.max_queue = 4096;
        let server = start(config);
        let mut clients: Vec<Client> = (0..4).map(|_| Client::connect(server.addr)).collect();
        for c in &mut clients {
            c.subscribe("final");
        }
        for seq in 0..3000 {
            publish(&server.engine, "final", seq, 256);
        }
        let engine = server.engine;
        let stopper = std::thread::spawn(move || engine.shutdown().unwrap());
        for mut c in clients {
            for seq in 0..3000 {
                assert_eq!(c.msg()["seq"], seq);
            }
            // Then the server says it shuts down and closes the connection.
            loop {
                match c.line() {
                    None => break,
                    Some(l) => assert!(
                        l.contains("\"ping\"") || l.contains("\"code\":\"shutdown\""),
                        "unexpected after the last message: {l}"
                    ),
                }
            }
        }
        stopper.join().unwrap();
    });
}

#[test]
fn max_subscriptions_per_connection_gets_an_error_naming_the_limit_then_close() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.max_subscriptions_per_connection = 2;
        let server = start(config);
        let mut c = Client::connect(server.addr);
        c.subscribe("a");
        c.subscribe("b");
        c.send(r#"{"type":"subscribe","stream":"c"}"#);
        let e = c.msg();
        assert_eq!(e["type"], "error");
        assert_eq!(e["limit"], "max_subscriptions_per_connection", "{e}");
        assert!(c.line().is_none());
        eventually("its subscriptions are released", || {
            server.engine.hub().stats().subscribers == 0
        });
    });
}

#[test]
fn disconnect_policy_closes_a_slow_consumer_and_others_carry_on() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.backpressure_bytes = 16 << 10;
        config.subscriptions.max_queue = 16;
        config.subscriptions.slow_consumer = SlowConsumerChoice::Disconnect;
        let server = start(config);
        let mut stalled = Client::connect(server.addr);
        stalled.subscribe("hot");
        let mut healthy = Client::connect(server.addr);
        healthy.subscribe("hot");
        let received = Arc::new(AtomicU64::new(0));
        let reader = {
            let received = Arc::clone(&received);
            std::thread::spawn(move || {
                for n in 0..3000u64 {
                    let v = healthy.msg();
                    assert_eq!(v["seq"], n, "{v}");
                    received.fetch_add(1, Ordering::Relaxed);
                }
                healthy
            })
        };
        // Paced to the healthy reader (its queue holds 16), 12 MiB in all: the stalled one
        // falls behind, the healthy one never does.
        for seq in 0..3000u64 {
            publish(&server.engine, "hot", seq, 4096);
            if seq % 8 == 7 {
                eventually("the healthy reader keeps up", || {
                    received.load(Ordering::Relaxed) > seq
                });
            }
        }
        let _healthy = reader.join().unwrap();
        eventually("the slow consumer was disconnected", || {
            server.engine.hub().stats().disconnected >= 1
        });
        // The stalled client finds an error naming the policy at the end of what it gets.
        let rest = String::from_utf8_lossy(&stalled.rest()).into_owned();
        assert!(
            rest.contains("slow_consumer"),
            "no slow_consumer error in {} bytes",
            rest.len()
        );
    });
}

#[test]
fn a_backlog_longer_than_one_gather_list_is_delivered_in_order() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.subscriptions.max_queue = 4096;
        config.subscriptions.max_batch = 1;
        let server = start(config);
        let mut c = Client::connect(server.addr);
        c.subscribe("backlog");
        // 3000 separate deliveries while the client does not read: more chunks than one
        // sendmsg gather list (1024) can carry.
        for seq in 0..3000 {
            publish(&server.engine, "backlog", seq, 2048);
        }
        server.engine.hub().flush().unwrap();
        for seq in 0..3000 {
            assert_eq!(c.msg()["seq"], seq);
        }
        assert_eq!(server.engine.hub().stats().dropped, 0);
    });
}

#[test]
fn graceful_shutdown_ends_at_its_deadline_when_a_client_never_reads() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.engine.shutdown_timeout_ms = 200;
        config.limits.backpressure_bytes = 64 << 10;
        let server = start(config);
        let mut stalled = Client::connect(server.addr);
        stalled.subscribe("never-read");
        for seq in 0..3000 {
            publish(&server.engine, "never-read", seq, 8192);
        }
        let engine = server.engine;
        let done = Arc::new(AtomicU64::new(0));
        let stopper = {
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                engine.shutdown().unwrap();
                done.store(1, Ordering::Relaxed);
            })
        };
        eventually("shutdown returns although the client never reads", || {
            done.load(Ordering::Relaxed) == 1
        });
        stopper.join().unwrap();
        drop(stalled);
    });
}
