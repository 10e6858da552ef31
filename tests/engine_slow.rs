//! Slow consumers on a shard shared with healthy ones: the healthy readers receive everything,
//! in order, and are never counted as dropped or disconnected, under every slow-consumer policy
//! and on both IO backends. A push subscription's only queue is its connection's outbox, where
//! the push-stream spec's rules hold (these messages are lossless): a stalled reader is closed
//! with an error naming `max_outbox_bytes` under `drop-oldest` and `drop-newest`, or named a
//! slow consumer past `backpressure_bytes` under `disconnect`; nothing is dropped silently.

mod engine_support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use engine_support::*;
use powerhub::runtime::{Config, SlowConsumerChoice};

const HEALTHY: usize = 4;
const MESSAGES: u64 = 3000;
/// 3000 × 4 KiB = 12 MiB per subscriber: far more than the stalled reader's socket buffers and
/// outbox (`max_outbox_bytes`) hold together, so its limit or policy acts.
const PAD: usize = 4096;
/// Messages published between waits for the healthy readers: well under `max_queue`, so a
/// healthy reader is never more than a burst behind.
const BURST: u64 = 64;

/// One stalled reader and `HEALTHY` readers, all on the one shard; returns the server, the
/// hub's final statistics and the stalled client (still open unless its policy closed it).
fn run(policy: SlowConsumerChoice, mut config: Config) -> (Server, powerhub::hub::Stats, Client) {
    config.engine.shards = 1;
    config.subscriptions.slow_consumer = policy;
    let max_queue = config.subscriptions.max_queue;
    let server = start(config);
    let mut stalled = Client::connect(server.addr);
    stalled.subscribe("feed");
    let received = Arc::new(AtomicU64::new(0));
    let context = format!("a healthy reader lost or reordered a message under {policy:?}");
    let readers = in_order_readers(server.addr, "feed", HEALTHY, MESSAGES, &received, &context);
    assert!(BURST < max_queue as u64, "bursts fit the hub queue");
    for seq in 0..MESSAGES {
        publish(&server.engine, "feed", seq, PAD);
        if seq % BURST == BURST - 1 {
            let target = (seq + 1) * HEALTHY as u64;
            eventually("healthy readers keep up", || {
                received.load(Ordering::Relaxed) >= target
            });
        }
    }
    let _healthy: Vec<Client> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    if policy == SlowConsumerChoice::Disconnect {
        eventually("the stalled subscriber was disconnected", || {
            server.engine.hub().stats().disconnected >= 1
        });
    }
    let stats = server.engine.hub().stats();
    (server, stats, stalled)
}

fn config(backend: powerhub::runtime::BackendChoice) -> Config {
    let mut config = base_config(backend);
    // Small bounds, so the stalled reader's policy acts within a short run.
    config.limits.backpressure_bytes = 256 << 10;
    config.limits.max_outbox_bytes = 4 << 20;
    config.subscriptions.max_queue = 256;
    config
}

#[test]
fn healthy_readers_on_a_stalled_readers_shard_lose_nothing_under_drop_oldest() {
    on_both_backends(|backend| {
        let (_server, stats, stalled) = run(SlowConsumerChoice::DropOldest, config(backend));
        assert_only_the_stalled_one_closed_at_the_outbox_limit(&stats, stalled);
    });
}

#[test]
fn healthy_readers_on_a_stalled_readers_shard_lose_nothing_under_drop_newest() {
    on_both_backends(|backend| {
        let (_server, stats, stalled) = run(SlowConsumerChoice::DropNewest, config(backend));
        assert_only_the_stalled_one_closed_at_the_outbox_limit(&stats, stalled);
    });
}

#[test]
fn healthy_readers_on_a_stalled_readers_shard_stay_connected_under_disconnect() {
    on_both_backends(|backend| {
        let (_server, stats, mut stalled) = run(SlowConsumerChoice::Disconnect, config(backend));
        assert_eq!(
            stats.disconnected, 1,
            "only the stalled subscriber was disconnected"
        );
        assert_eq!(
            stats.list.len(),
            HEALTHY,
            "every healthy subscription is still live: {:?}",
            stats.list
        );
        assert!(
            stats.list.iter().all(|s| s.dropped == 0),
            "healthy subscribers lost nothing: {:?}",
            stats.list
        );
        let rest = String::from_utf8_lossy(&stalled.rest()).into_owned();
        assert!(
            rest.contains("slow_consumer"),
            "the stalled one got the policy's error"
        );
    });
}

/// The default sizing absorbs a healthy reader briefly behind (docs/config.md): the hub queue
/// covers at least 100 ms of a 24 000 msg/s stream, and the outbox at least 100 ms of it at
/// 1 KiB a message, before a subscription's policy treats it as slow.
#[test]
fn default_sizing_absorbs_a_reader_100_ms_behind_at_24k_messages_a_second() {
    let defaults = Config::default();
    let (rate, size) = (24_000usize, 1024usize);
    assert!(
        defaults.subscriptions.max_queue >= rate / 10,
        "max_queue = {} is under 100 ms of the stream",
        defaults.subscriptions.max_queue
    );
    assert!(
        defaults.limits.backpressure_bytes >= rate * size / 10,
        "backpressure_bytes = {} is under 100 ms of the stream",
        defaults.limits.backpressure_bytes
    );
}

fn assert_only_the_stalled_one_closed_at_the_outbox_limit(
    stats: &powerhub::hub::Stats,
    mut stalled: Client,
) {
    let rest = String::from_utf8_lossy(&stalled.rest()).into_owned();
    assert!(
        rest.contains(r#""limit":"max_outbox_bytes""#),
        "the stalled reader is told which limit closed it"
    );
    assert_eq!(
        stats.list.len(),
        HEALTHY,
        "every healthy subscription is live: {:?}",
        stats.list
    );
    assert_eq!(
        stats.disconnected, 0,
        "nobody disconnected as a slow consumer"
    );
    assert_eq!(stats.dropped, 0, "nothing was dropped silently");
}
