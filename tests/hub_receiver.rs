//! A receiver per subscriber (`Hub::receiver`): blocking, timed and async receives, losses seen
//! as `Lagged` where they happened, the end seen as `Closed` with its reason, a slow consumer
//! that lags only itself, unsubscribe on drop, and a flush bounded by `flush_timeout`.

use std::time::{Duration, Instant};

use powerhub::hub::{
    Driver, FlushError, Hub, HubOptions, Message, PublishOptions, RecvError, RecvTimeoutError,
    SlowConsumer, SubscribeOptions, TryRecvError,
};
use powerhub::plugin::CloseReason;
use powerhub::transport::SpySink;

const WAIT: Duration = Duration::from_secs(20);

fn json(n: u64) -> Message {
    Message::json(format!("{{\"n\":{n}}}")).unwrap()
}

fn publish(hub: &Hub, topic: &str, n: u64) {
    hub.publish(topic, json(n), PublishOptions::default())
        .unwrap();
}

fn n_of(m: &powerhub::hub::Received) -> u64 {
    let v: serde_json::Value = serde_json::from_slice(m.message().bytes()).unwrap();
    v["n"].as_u64().unwrap()
}

/// A hub on its own drain thread (the default driver).
fn threaded() -> Hub {
    Hub::new(SpySink::new(), HubOptions::default()).unwrap()
}

fn manual() -> Hub {
    Hub::new(SpySink::new(), HubOptions::default().driver(Driver::Manual)).unwrap()
}

fn turn(hub: &Hub) {
    hub.turn(Instant::now());
}

#[test]
fn a_receiver_gets_every_message_in_order_with_consecutive_topic_numbers() {
    let hub = threaded();
    // A queue as long as the stream: the receiver may fall behind, and loses nothing.
    let mut rx = hub
        .receiver(
            "t",
            SubscribeOptions::default().max_batch(8).max_queue(16_384),
        )
        .unwrap();
    let publisher = {
        let hub = hub.clone();
        std::thread::spawn(move || {
            for n in 0..10_000 {
                publish(&hub, "t", n);
            }
        })
    };
    for n in 0..10_000 {
        let m = rx.recv_timeout(WAIT).unwrap();
        assert_eq!((n_of(&m), m.topic_seq()), (n, n));
    }
    publisher.join().unwrap();
    assert_eq!(
        rx.try_recv().unwrap_err(),
        TryRecvError::Empty,
        "nothing more"
    );
}

#[test]
fn under_drop_oldest_a_receive_says_how_many_were_dropped_before_the_messages_after_the_gap() {
    let hub = manual();
    let mut rx = hub
        .receiver("t", SubscribeOptions::default().max_queue(3).max_batch(1))
        .unwrap();
    publish(&hub, "t", 0);
    assert_eq!(n_of(&rx.recv().unwrap()), 0);
    for n in 1..10 {
        publish(&hub, "t", n);
    }
    // 1..=6 were dropped (the queue keeps the newest three: 7, 8, 9).
    assert_eq!(rx.recv().unwrap_err(), RecvError::Lagged { missed: 6 });
    let mut rest = Vec::new();
    while rest.len() < 3 {
        match rx.try_recv() {
            Ok(m) => rest.push(m.topic_seq()),
            Err(TryRecvError::Empty) => turn(&hub),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(rest, [7, 8, 9], "the numbers show the gap too");
    assert_eq!(hub.stats().list[0].dropped, 6, "the hub's stats agree");
}

/// `dropped` is a counter to alert on: it never goes back. A drop-oldest receiver reading a run
/// (the messages of one chunk it started on) while more are published past its bound: the
/// run's messages now beyond the bound are dropped as the eager queue would have dropped them
/// (realtime-hub.md: "discard the oldest queued message to make room for the new one"), and
/// the count only grows as the receiver reads on.
#[test]
fn the_dropped_count_never_goes_back_while_a_drop_oldest_receiver_reads_a_run() {
    let hub = manual();
    let mut rx = hub
        .receiver("t", SubscribeOptions::default().id("r").max_queue(3))
        .unwrap();
    for n in 0..5 {
        publish(&hub, "t", n);
    }
    assert_eq!(
        rx.try_recv().unwrap_err(),
        TryRecvError::Lagged { missed: 2 }
    );
    assert_eq!(rx.try_recv().unwrap().topic_seq(), 2, "a run starts");
    for n in 5..10 {
        publish(&hub, "t", n);
    }
    let mut shown = vec![hub.stats().dropped];
    let mut got = Vec::new();
    loop {
        match rx.try_recv() {
            Ok(m) => got.push(m.topic_seq()),
            Err(TryRecvError::Lagged { missed }) => got.push(1000 + missed),
            Err(TryRecvError::Empty) => break,
            Err(e) => panic!("{e}"),
        }
        shown.push(hub.stats().dropped);
    }
    // The queue of three holds 7, 8 and 9: the run's 3 and 4 went with 5 and 6.
    assert_eq!(got, [1004, 7, 8, 9]);
    assert!(
        shown.windows(2).all(|w| w[0] <= w[1]),
        "dropped went back: {shown:?}"
    );
    assert_eq!(shown.last(), Some(&6));
}

#[test]
fn under_drop_newest_the_lag_is_the_refused_messages() {
    let hub = manual();
    let mut rx = hub
        .receiver(
            "t",
            SubscribeOptions::default()
                .max_queue(2)
                .max_batch(1)
                .slow_consumer(SlowConsumer::DropNewest),
        )
        .unwrap();
    publish(&hub, "t", 0);
    turn(&hub); // 0 handed over
    for n in 1..6 {
        publish(&hub, "t", n); // 1, 2 queued; 3, 4, 5 refused
    }
    let mut got = Vec::new();
    let deadline = Instant::now() + WAIT;
    while got.len() < 4 && Instant::now() < deadline {
        match rx.try_recv() {
            Ok(m) => got.push(format!("{}", m.topic_seq())),
            Err(TryRecvError::Lagged { missed }) => got.push(format!("lagged {missed}")),
            Err(TryRecvError::Empty) => turn(&hub),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(got, ["0", "1", "2", "lagged 3"]);
}

#[test]
fn under_disconnect_the_handed_over_messages_come_then_closed_with_the_reason() {
    let hub = manual();
    let mut rx = hub
        .receiver(
            "t",
            SubscribeOptions::default()
                .max_queue(2)
                .max_batch(1)
                .slow_consumer(SlowConsumer::Disconnect),
        )
        .unwrap();
    publish(&hub, "t", 0);
    turn(&hub);
    for n in 1..5 {
        publish(&hub, "t", n);
    }
    assert_eq!(n_of(&rx.recv().unwrap()), 0);
    assert_eq!(
        rx.recv().unwrap_err(),
        RecvError::Closed {
            reason: CloseReason::SlowConsumer
        }
    );
    assert!(!rx.subscription().is_active());
    assert_eq!(hub.stats().disconnected, 1);
}

#[test]
fn unsubscribe_and_close_end_a_receiver_with_their_reason() {
    let hub = manual();
    let mut a = hub.receiver("t", SubscribeOptions::default()).unwrap();
    let mut b = hub.receiver("t", SubscribeOptions::default()).unwrap();
    publish(&hub, "t", 1);
    turn(&hub);
    assert!(a.subscription().unsubscribe());
    assert_eq!(
        n_of(&a.recv().unwrap()),
        1,
        "what was handed over still comes"
    );
    assert_eq!(
        a.recv().unwrap_err(),
        RecvError::Closed {
            reason: CloseReason::Unsubscribe
        }
    );
    hub.close();
    assert_eq!(n_of(&b.recv().unwrap()), 1);
    assert_eq!(
        b.recv_timeout(WAIT).unwrap_err(),
        RecvTimeoutError::Closed {
            reason: CloseReason::HubClosed
        }
    );
}

#[test]
fn a_receiver_that_does_not_receive_lags_only_itself() {
    let hub = threaded();
    let stalled = hub
        .receiver("slow", SubscribeOptions::default().max_queue(16))
        .unwrap();
    let mut fast = hub.receiver("fast", SubscribeOptions::default()).unwrap();
    for n in 0..5_000 {
        publish(&hub, "slow", n);
        publish(&hub, "fast", n);
        // Every message of the other topic arrives while the stalled receiver takes nothing.
        assert_eq!(n_of(&fast.recv_timeout(WAIT).unwrap()), n);
    }
    let s = hub.stats();
    let row = s.list.iter().find(|r| r.topic == "slow").unwrap();
    assert!(
        row.dropped > 4_900,
        "the stalled one's own policy dropped: {row:?}"
    );
    drop(stalled);
}

#[test]
fn dropping_a_receiver_unsubscribes() {
    let hub = manual();
    let rx = hub.receiver("t", SubscribeOptions::default()).unwrap();
    assert_eq!(hub.stats().subscribers, 1);
    drop(rx);
    assert_eq!(hub.stats().subscribers, 0);
    assert_eq!(
        hub.publish("t", json(1), PublishOptions::default())
            .unwrap(),
        0
    );
}

#[test]
fn a_dropped_receiver_frees_its_subscriber_under_every_policy() {
    // The subscriber's transport context is held by the subscriber only: once the receiver
    // and the hub are gone, nothing may hold it (a reference cycle between the subscriber and
    // its channel would keep it, and the hub's allocation, forever).
    for policy in [
        SlowConsumer::DropOldest,
        SlowConsumer::DropNewest,
        SlowConsumer::Disconnect,
    ] {
        for unsubscribe_first in [true, false] {
            let context = std::sync::Arc::new(());
            let hub = manual();
            let opts = SubscribeOptions::default()
                .slow_consumer(policy)
                .transport(context.clone());
            let mut rx = hub.receiver("t", opts).unwrap();
            publish(&hub, "t", 1);
            turn(&hub);
            assert!(rx.try_recv().is_ok(), "{policy:?}");
            publish(&hub, "t", 2);
            turn(&hub);
            if unsubscribe_first {
                drop(rx);
                drop(hub);
            } else {
                drop(hub);
                drop(rx);
            }
            assert_eq!(
                std::sync::Arc::strong_count(&context),
                1,
                "{policy:?}: the subscriber outlived its receiver and its hub"
            );
        }
    }
}

#[test]
fn recv_timeout_times_out_when_nothing_comes() {
    let hub = manual();
    let mut rx = hub.receiver("t", SubscribeOptions::default()).unwrap();
    assert_eq!(
        rx.recv_timeout(Duration::from_millis(20)).unwrap_err(),
        RecvTimeoutError::Timeout
    );
}

#[test]
fn the_async_receive_and_the_stream_work_on_any_executor() {
    use futures_util::StreamExt;
    let hub = threaded();
    let mut rx = hub
        .receiver("t", SubscribeOptions::default().max_queue(4_096))
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let publisher = {
        let hub = hub.clone();
        std::thread::spawn(move || {
            for n in 0..1_000 {
                publish(&hub, "t", n);
            }
            hub
        })
    };
    rt.block_on(async {
        for n in 0..500 {
            assert_eq!(n_of(&rx.recv_async().await.unwrap()), n);
        }
        let mut n = 500;
        while n < 1_000 {
            let m = rx.next().await.expect("open").unwrap();
            assert_eq!(n_of(&m), n);
            n += 1;
        }
    });
    drop(publisher.join().unwrap());
    hub.close();
    let end = rt.block_on(async { rx.next().await });
    assert!(
        end.is_none(),
        "the stream ends when the subscription closes"
    );
}

/// A flush does not wait for a receiver's consumer: on the consumer's own thread it returns
/// (it waited for ever), and the consumer then receives everything, in order.
#[test]
fn a_flush_on_the_consumers_own_thread_returns_while_a_fed_receiver_holds_messages() {
    let (hub, mut rx) = fed_with_two_published();
    publish(&hub, "t", 2);
    assert_eq!(hub.flush_timeout(WAIT), Ok(()));
    assert_eq!(hub.flush(), Ok(()));
    let got: Vec<u64> = (0..3).map(|_| n_of(&rx.recv().unwrap())).collect();
    assert_eq!(got, [0, 1, 2]);
    assert_eq!(
        rx.recv_timeout(Duration::from_millis(20)).unwrap_err(),
        RecvTimeoutError::Timeout
    );
    assert_eq!(hub.stats().delivered, 3);
}

/// A shutdown (or an unsubscribe) leaves a fed receiver what it was not handed yet: the batch
/// handed over, the one held for the consumer, then the rest of its queue, then `Closed`.
#[test]
fn a_fed_receiver_receives_what_its_queue_held_at_the_end_then_closed() {
    for end in ["shutdown", "unsubscribe"] {
        let (hub, mut rx) = fed_with_two_published();
        publish(&hub, "t", 2);
        publish(&hub, "t", 3);
        let reason = if end == "shutdown" {
            assert_eq!(hub.shutdown_timeout(WAIT), Ok(()));
            assert!(hub.is_closed());
            CloseReason::HubClosed
        } else {
            assert!(rx.subscription().unsubscribe());
            publish(&hub, "t", 4); // after the end: not for `rx`
            CloseReason::Unsubscribe
        };
        let mut got = Vec::new();
        let closed = loop {
            match rx.recv() {
                Ok(m) => got.push(n_of(&m)),
                Err(e) => break e,
            }
        };
        assert_eq!(got, [0, 1, 2, 3], "{end}");
        assert_eq!(closed, RecvError::Closed { reason }, "{end}");
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Closed { reason });
        if end == "unsubscribe" {
            assert_eq!(
                hub.stats().delivered,
                4,
                "{end}: the rest counted as it was taken"
            );
        }
    }
}

/// The end races a consumer that keeps receiving and a drain that keeps handing batches over:
/// whatever the interleaving, the consumer gets every publication before the end exactly once,
/// in order, then `Closed`.
#[test]
fn a_fed_receiver_ended_while_its_consumer_receives_gets_everything_in_order() {
    const N: u64 = 5_000;
    for round in 0..20 {
        let hub = threaded();
        let mut rx = hub
            .receiver("t", fed().max_queue(N as usize).max_batch(7))
            .unwrap();
        let consumer = std::thread::spawn(move || {
            let mut got = Vec::new();
            loop {
                match rx.recv() {
                    Ok(m) => got.push(n_of(&m)),
                    Err(RecvError::Closed { .. }) => return got,
                    Err(e) => panic!("{e}"),
                }
            }
        });
        for n in 0..N {
            publish(&hub, "t", n);
        }
        if round % 2 == 0 {
            hub.close();
        } else {
            assert!(hub.unsubscribe(&hub.stats().list[0].id));
        }
        let got = consumer.join().unwrap();
        assert_eq!(got, (0..N).collect::<Vec<u64>>(), "round {round}");
    }
}

/// `flush_async` does not wait for a receiver's consumer either.
#[test]
fn flush_async_does_not_wait_for_a_fed_receivers_consumer() {
    let (hub, mut rx) = fed_with_two_published();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(WAIT, hub.flush_async())
            .await
            .expect("the flush does not wait for the consumer")
            .unwrap();
        assert_eq!(n_of(&rx.recv_async().await.unwrap()), 0);
        assert_eq!(n_of(&rx.recv_async().await.unwrap()), 1);
    });
    rt.block_on(hub.shutdown_async()).unwrap();
    assert!(hub.is_closed());
}

/// Options of a receiver the drain feeds (any policy but drop-oldest).
fn fed() -> SubscribeOptions {
    SubscribeOptions::default().slow_consumer(SlowConsumer::DropNewest)
}

/// A drop-newest receiver (fed by the drain, one batch of one at a time) and two publications:
/// 0 is handed over, 1 waits for the consumer, as a send waits for a transport.
fn fed_with_two_published() -> (Hub, powerhub::hub::Receiver) {
    let hub = Hub::new(SpySink::new(), HubOptions::default().batch(false)).unwrap();
    let rx = hub.receiver("t", fed().max_batch(1)).unwrap();
    publish(&hub, "t", 0);
    publish(&hub, "t", 1);
    (hub, rx)
}

#[test]
fn a_drop_oldest_receiver_reads_its_topic_itself_and_flush_does_not_wait_for_it() {
    let hub = threaded();
    let mut rx = hub
        .receiver("t", SubscribeOptions::default().max_queue(8))
        .unwrap();
    for n in 0..5 {
        publish(&hub, "t", n);
    }
    // Nothing for the drain: the receiver's queue is its place in the topic.
    hub.flush_timeout(Duration::from_millis(50)).unwrap();
    let stats = hub.stats();
    assert_eq!(stats.list[0].queued, 5);
    for n in 0..5 {
        assert_eq!(n_of(&rx.try_recv().unwrap()), n);
    }
    assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty);
    assert_eq!(hub.stats().list[0].queued, 0);
    assert_eq!(hub.stats().delivered, 5);
}

#[test]
fn a_receiver_gets_the_retained_log_first_under_its_own_queue_bound() {
    let hub = threaded();
    for n in 0..5 {
        hub.publish("t", json(n), PublishOptions::default().retain(true))
            .unwrap();
    }
    let mut rx = hub
        .receiver("t", SubscribeOptions::default().max_queue(4))
        .unwrap();
    publish(&hub, "t", 5);
    // Six queued for a queue of four: the two oldest (replayed 0 and 1) are dropped.
    assert_eq!(
        rx.try_recv().unwrap_err(),
        TryRecvError::Lagged { missed: 2 }
    );
    let got: Vec<u64> = (0..4).map(|_| n_of(&rx.try_recv().unwrap())).collect();
    assert_eq!(got, [2, 3, 4, 5]);
    assert_eq!(hub.stats().list[0].dropped, 2);
}

#[test]
fn messages_published_before_the_end_are_received_then_closed() {
    let hub = threaded();
    let mut rx = hub.receiver("t", SubscribeOptions::default()).unwrap();
    let _other = hub.receiver("t", SubscribeOptions::default()).unwrap();
    publish(&hub, "t", 0);
    publish(&hub, "t", 1);
    assert!(rx.subscription().unsubscribe());
    publish(&hub, "t", 2); // after the end: not for `rx`
    assert_eq!(n_of(&rx.recv().unwrap()), 0);
    assert_eq!(n_of(&rx.recv().unwrap()), 1);
    assert_eq!(
        rx.recv().unwrap_err(),
        RecvError::Closed {
            reason: CloseReason::Unsubscribe
        }
    );
}

#[test]
fn a_blocked_receive_wakes_for_a_publication_from_another_thread() {
    let hub = threaded();
    // Queues that hold the whole stream: a consumer descheduled for a while loses nothing.
    let mut rxs: Vec<_> = (0..4)
        .map(|_| {
            hub.receiver("t", SubscribeOptions::default().max_queue(1000))
                .unwrap()
        })
        .collect();
    let consumers: Vec<_> = rxs
        .drain(..)
        .map(|mut rx| {
            std::thread::spawn(move || {
                (0..100)
                    .map(|_| n_of(&rx.recv().unwrap()))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for n in 0..100 {
        publish(&hub, "t", n);
        if n % 10 == 0 {
            std::thread::yield_now();
        }
    }
    for c in consumers {
        assert_eq!(c.join().unwrap(), (0..100).collect::<Vec<u64>>());
    }
}

#[test]
fn an_ended_receiver_behind_what_the_log_keeps_hears_the_loss_then_closed() {
    let hub = threaded();
    let mut behind = hub
        .receiver("t", SubscribeOptions::default().max_queue(1000))
        .unwrap();
    let _small = hub
        .receiver("t", SubscribeOptions::default().max_queue(10))
        .unwrap();
    for n in 0..300 {
        publish(&hub, "t", n);
    }
    assert!(behind.subscription().unsubscribe());
    // The log now keeps only what the remaining receiver needs.
    for n in 300..500 {
        publish(&hub, "t", n);
    }
    let (mut received, mut missed) = (0u64, 0u64);
    loop {
        match behind.recv_timeout(WAIT) {
            Ok(m) => {
                assert!(n_of(&m) < 300, "nothing published after the end");
                received += 1;
            }
            Err(RecvTimeoutError::Lagged { missed: k }) => missed += k,
            Err(RecvTimeoutError::Closed { reason }) => {
                assert_eq!(reason, CloseReason::Unsubscribe);
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(received + missed, 300);
    assert!(missed > 0);
}

/// `dropped` is a counter to alert on: it never goes back. What a default (drop-oldest)
/// receiver's bound dropped counts as dropped in `stats()` before the receiver hears of it,
/// and still after its subscription ends, whether the receiver is dropped (what it never
/// received past its bound is committed then), unsubscribed by id or closed with the hub (it
/// counts until the receiver hears the loss as `Lagged`, and once).
#[test]
fn a_receivers_drops_stay_counted_after_its_subscription_ends() {
    for end in ["drop", "unsubscribe", "close"] {
        let hub = threaded();
        let opts = SubscribeOptions::default().id("r").max_queue(2);
        let mut rx = Some(hub.receiver("t", opts).unwrap());
        for n in 0..10 {
            publish(&hub, "t", n);
        }
        assert_eq!(hub.stats().dropped, 8, "{end}: before the end");
        match end {
            "drop" => drop(rx.take()),
            "unsubscribe" => assert!(hub.unsubscribe("r")),
            _ => hub.close(),
        }
        assert_eq!(hub.stats().dropped, 8, "{end}: after the end");
        if let Some(mut rx) = rx {
            assert_eq!(
                rx.try_recv().unwrap_err(),
                TryRecvError::Lagged { missed: 8 }
            );
            assert_eq!(hub.stats().dropped, 8, "{end}: heard, counted once");
            assert_eq!(n_of(&rx.try_recv().unwrap()), 8);
            assert_eq!(n_of(&rx.try_recv().unwrap()), 9);
            assert!(matches!(rx.try_recv(), Err(TryRecvError::Closed { .. })));
            if end == "unsubscribe" {
                // (A closed hub's `delivered` is not read here: its subscribers are gone.)
                assert_eq!(hub.stats().delivered, 2, "{end}: received after its end");
            }
            drop(rx);
            assert_eq!(hub.stats().dropped, 8, "{end}: after its drop");
        }
    }
}

/// A receiver dropped in the middle of a chunk it was reading commits only what its bound
/// really dropped (none here: two received, two waiting, a bound of two).
#[test]
fn a_receiver_dropped_mid_run_commits_no_drop_it_did_not_make() {
    let hub = threaded();
    let mut rx = hub
        .receiver("t", SubscribeOptions::default().max_queue(2))
        .unwrap();
    publish(&hub, "t", 0);
    publish(&hub, "t", 1);
    assert_eq!(n_of(&rx.try_recv().unwrap()), 0);
    assert_eq!(n_of(&rx.try_recv().unwrap()), 1);
    publish(&hub, "t", 2);
    publish(&hub, "t", 3);
    drop(rx);
    assert_eq!(hub.stats().dropped, 0);
}

/// A hub whose one sink subscriber `a` has a send of one message pending in its transport.
fn one_send_pending() -> (Hub, SpySink) {
    let spy = SpySink::new();
    spy.set_mode(powerhub::transport::SpyMode::Pending);
    let hub = Hub::new(spy.clone(), HubOptions::default()).unwrap();
    hub.subscribe_sink("t", SubscribeOptions::default().id("a"))
        .unwrap()
        .detach();
    publish(&hub, "t", 1);
    (hub, spy)
}

/// A `flush_async` given up on does not keep the hub open: dropping the last `Hub` handle still
/// closes it (the close adapters are told), and the abandoned flush ends with `Closed`.
#[test]
fn an_abandoned_flush_async_does_not_keep_the_hub_open() {
    let (hub, spy) = one_send_pending();
    let task = hub.flush_async();
    drop(hub);
    assert_eq!(spy.closes(), vec![("a".to_owned(), CloseReason::HubClosed)]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert_eq!(rt.block_on(task), Err(FlushError::Closed));
}

/// `shutdown_async` stays graceful when the caller drops its handles: it flushes (the send in
/// flight completes), then closes.
#[test]
fn shutdown_async_flushes_then_closes_even_when_the_caller_drops_its_handle() {
    let (hub, spy) = one_send_pending();
    let shutdown = hub.shutdown_async();
    drop(hub);
    assert!(spy.closes().is_empty(), "not closed while the flush waits");
    let deadline = Instant::now() + WAIT;
    while spy.pending() == 0 {
        assert!(Instant::now() < deadline, "the send never started");
        std::thread::yield_now();
    }
    spy.complete_all();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert_eq!(rt.block_on(shutdown), Ok(()));
    assert_eq!(spy.closes(), vec![("a".to_owned(), CloseReason::HubClosed)]);
}

/// Losses are said where they are, with the hub's drain thread and two publishers racing a slow
/// drop-newest receiver: every `Lagged` is the gap in topic numbers just before the next message
/// (not early, and not before a message that follows its predecessor). A drop said while a
/// batch was between the queue and the hand-off, or said at the end and then again at the next
/// message's gap, breaks it.
#[test]
fn a_drop_newest_receiver_says_each_loss_just_before_the_gap_with_two_publishers() {
    const M: u64 = 20_000;
    for _ in 0..3 {
        let hub = threaded();
        let mut rx = hub
            .receiver(
                "t",
                SubscribeOptions::default()
                    .max_queue(16)
                    .max_batch(4)
                    .slow_consumer(SlowConsumer::DropNewest),
            )
            .unwrap();
        let consumer = std::thread::spawn(move || {
            let (mut received, mut missed, mut said, mut next) = (0u64, 0u64, 0u64, 0u64);
            while received + missed < M {
                match rx.recv_timeout(WAIT) {
                    Ok(m) => {
                        received += 1;
                        let gap = m.topic_seq() - next;
                        assert_eq!(
                            gap,
                            said,
                            "message {} after a loss said as {said}",
                            m.topic_seq()
                        );
                        said = 0;
                        next = m.topic_seq() + 1;
                        if received % 32 == 0 {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                    Err(RecvTimeoutError::Lagged { missed: n }) => {
                        missed += n;
                        said += n;
                    }
                    Err(e) => panic!("{e} after {received} received and {missed} missed"),
                }
            }
            (received, missed)
        });
        let publishers: Vec<_> = (0..2)
            .map(|_| {
                let hub = hub.clone();
                std::thread::spawn(move || {
                    for n in 0..M / 2 {
                        publish(&hub, "t", n);
                    }
                })
            })
            .collect();
        for p in publishers {
            p.join().unwrap();
        }
        // Every publication is received or said lost.
        let (_, missed) = consumer.join().unwrap();
        assert_eq!(hub.stats().dropped, missed);
    }
}

/// Asserts that `dropped` and `delivered` are at least the `last` ones seen.
fn assert_totals_grow(last: (u64, u64), s: &powerhub::hub::Stats) {
    assert!(
        s.dropped >= last.0 && s.delivered >= last.1,
        "went back: dropped {} -> {}, delivered {} -> {}",
        last.0,
        s.dropped,
        last.1,
        s.delivered
    );
}

/// The counters to alert on never go back and never count a message twice, read from another
/// thread while they move: a drop-oldest receiver lags (its position moves past what it lost)
/// and a drop-oldest handler subscriber's queue overflows (its evictions are committed by the
/// drain) while one thread publishes and another polls `stats()`. Each snapshot: `dropped`,
/// `delivered` and every row's `dropped` at least the previous one's, and `dropped +
/// delivered` at most what the two subscribers were offered. A stress test: the old code failed
/// it in most runs.
#[test]
fn stats_never_go_back_nor_count_twice_while_counts_move_on_other_threads() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    const MESSAGES: u64 = 20_000;
    let hub = threaded();
    let mut rx = hub
        .receiver("t", SubscribeOptions::default().id("r").max_queue(16))
        .unwrap();
    let _handled = hub
        .subscribe(
            "t",
            |_| std::thread::sleep(Duration::from_micros(20)),
            SubscribeOptions::default()
                .id("h")
                .max_queue(8)
                .max_batch(4),
        )
        .unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let consumer = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let mut missed = 0;
            let mut n = 0u64;
            loop {
                match rx.try_recv() {
                    Ok(_) => {
                        n += 1;
                        if n % 64 == 0 {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                    Err(TryRecvError::Lagged { missed: k }) => missed += k,
                    Err(TryRecvError::Empty) if done.load(Ordering::Acquire) => break,
                    Err(TryRecvError::Empty) => std::thread::yield_now(),
                    Err(e) => panic!("{e}"),
                }
            }
            (rx, missed)
        })
    };
    let poller = {
        let hub = hub.clone();
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let mut last = (0u64, 0u64, [0u64; 2]);
            let mut snapshots = 0;
            while !done.load(Ordering::Acquire) {
                let s = hub.stats();
                let row = |id: &str| s.list.iter().find(|r| r.id == id).map_or(0, |r| r.dropped);
                let rows = [row("r"), row("h")];
                assert_totals_grow((last.0, last.1), &s);
                assert!(
                    rows[0] >= last.2[0] && rows[1] >= last.2[1],
                    "a row went back: {:?} -> {rows:?}",
                    last.2
                );
                assert!(
                    s.dropped + s.delivered <= 2 * s.published,
                    "counted twice: dropped {} + delivered {} > 2 × published {}",
                    s.dropped,
                    s.delivered,
                    s.published
                );
                last = (s.dropped, s.delivered, rows);
                snapshots += 1;
            }
            snapshots
        })
    };
    for n in 0..MESSAGES {
        publish(&hub, "t", n);
        if n % 256 == 0 {
            std::thread::yield_now();
        }
    }
    std::thread::sleep(Duration::from_millis(50));
    done.store(true, Ordering::Release);
    let snapshots = poller.join().expect("the poller's assertions");
    let (_rx, missed) = consumer.join().unwrap();
    assert!(snapshots > 10, "{snapshots} snapshots");
    assert!(missed > 0, "the receiver was meant to lag");
}

/// A receiver dropped on one thread while another thread unsubscribes it by id: whichever
/// finishes the removal, what it received is counted once in `delivered` (two folds racing
/// counted it twice), many times over.
#[test]
fn a_receiver_dropped_while_another_thread_unsubscribes_it_is_counted_once() {
    let hub = threaded();
    let mut received = 0u64;
    for round in 0..300u64 {
        let id = format!("r{round}");
        let mut rx = hub
            .receiver("t", SubscribeOptions::default().id(id.as_str()))
            .unwrap();
        for n in 0..10 {
            publish(&hub, "t", n);
        }
        for _ in 0..(round % 10) {
            rx.try_recv().unwrap();
            received += 1;
        }
        let remover = {
            let hub = hub.clone();
            std::thread::spawn(move || hub.unsubscribe(&id))
        };
        drop(rx);
        remover.join().unwrap();
    }
    let s = hub.stats();
    assert_eq!(s.delivered, received, "each receive counted once");
    assert_eq!(s.dropped, 0);
}

/// Closing the hub keeps what the drop-oldest queues dropped: evictions not yet committed by a
/// drain are committed as their subscribers leave, so `dropped` does not fall back to what the
/// drains had committed (it fell to 0).
#[test]
fn closing_the_hub_keeps_the_drops_no_drain_committed_yet() {
    let hub = manual();
    let _handled = hub
        .subscribe(
            "t",
            |_| {},
            SubscribeOptions::default().id("h").max_queue(4),
        )
        .unwrap();
    let _sink = hub
        .subscribe_sink("t", SubscribeOptions::default().id("s").max_queue(4))
        .unwrap();
    for n in 0..100 {
        publish(&hub, "t", n);
    }
    let before = hub.stats().dropped;
    assert_eq!(before, 2 * 96);
    hub.close();
    assert_eq!(
        hub.stats().dropped,
        before,
        "dropped went back across close"
    );
}

/// Handler subscribers with small queues come and go (dropped, or unsubscribed by id from
/// another thread at the same moment) while two threads publish and one polls `stats()`: the
/// totals never go back (a subscriber that left `ids` before its evictions were committed was
/// counted nowhere for a moment).
#[test]
fn stats_never_go_back_while_overflowing_handler_subscribers_come_and_go() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let hub = threaded();
    let done = Arc::new(AtomicBool::new(false));
    let publishers: Vec<_> = (0..2)
        .map(|_| {
            let (hub, done) = (hub.clone(), Arc::clone(&done));
            std::thread::spawn(move || {
                let mut n = 0;
                while !done.load(Ordering::Relaxed) {
                    publish(&hub, "t", n);
                    n += 1;
                }
            })
        })
        .collect();
    let poller = {
        let (hub, done) = (hub.clone(), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut last = (0u64, 0u64);
            while !done.load(Ordering::Relaxed) {
                let s = hub.stats();
                assert_totals_grow((last.0, last.1), &s);
                last = (s.dropped, s.delivered);
            }
        })
    };
    for round in 0..60 {
        let id = format!("h{round}");
        let sub = hub
            .subscribe(
                "t",
                |_| std::thread::sleep(Duration::from_micros(200)),
                SubscribeOptions::default().id(id.as_str()).max_queue(2),
            )
            .unwrap();
        std::thread::sleep(Duration::from_millis(3));
        if round % 2 == 0 {
            let remover = {
                let hub = hub.clone();
                std::thread::spawn(move || hub.unsubscribe(&id))
            };
            drop(sub);
            remover.join().unwrap();
        } else {
            drop(sub);
        }
    }
    done.store(true, Ordering::Relaxed);
    poller.join().expect("the poller's assertions");
    for p in publishers {
        p.join().unwrap();
    }
}

/// A payload whose owner counts how many of it are alive.
fn witnessed(n: u64, alive: &std::sync::Arc<()>) -> Message {
    // The second field is the count itself: alive while the payload is.
    struct Owned(String, #[allow(dead_code)] std::sync::Arc<()>);
    impl AsRef<[u8]> for Owned {
        fn as_ref(&self) -> &[u8] {
            self.0.as_bytes()
        }
    }
    let body = bytes::Bytes::from_owner(Owned(format!("{{\"n\":{n}}}"), alive.clone()));
    Message::json(body).unwrap()
}

#[test]
fn a_received_message_is_one_word_and_moves_between_threads() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<powerhub::hub::Received>();
    assert_eq!(
        std::mem::size_of::<powerhub::hub::Received>(),
        std::mem::size_of::<usize>()
    );
    assert_eq!(
        std::mem::size_of::<Option<powerhub::hub::Received>>(),
        std::mem::size_of::<usize>()
    );
}

#[test]
fn a_kept_message_outlives_the_log_that_let_its_chunk_go_and_is_freed_once_every_copy_is_dropped() {
    let alive = std::sync::Arc::new(());
    let hub = manual();
    let mut rx = hub
        .receiver("t", SubscribeOptions::default().max_queue(4))
        .unwrap();
    hub.publish("t", witnessed(0, &alive), PublishOptions::default())
        .unwrap();
    let kept = rx.try_recv().unwrap();
    // A copy on another thread, dropped there (while the thread runs, then at its exit).
    let copy = kept.clone();
    let elsewhere = std::thread::spawn(move || {
        assert_eq!(n_of(&copy), 0);
        drop(copy);
    });
    // Far more than the log keeps for a queue of 4: the chunk of message 0 leaves the log.
    for n in 1..1_000 {
        publish(&hub, "t", n);
        while let Ok(m) = rx.try_recv() {
            assert!(n_of(&m) >= 1);
        }
    }
    elsewhere.join().unwrap();
    assert_eq!((n_of(&kept), kept.topic_seq()), (0, 0));
    assert!(std::sync::Arc::strong_count(&alive) > 1, "freed while held");
    // Owned out, then every reference dropped: what this thread's drops held back reaches the
    // chunk at the receiver's next empty receive.
    let message = kept.clone().into_message();
    drop(kept);
    assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty);
    assert_eq!(&message.bytes()[..], br#"{"n":0}"#);
    assert!(
        std::sync::Arc::strong_count(&alive) > 1,
        "the owned message is the payload"
    );
    drop(message);
    assert_eq!(
        std::sync::Arc::strong_count(&alive),
        1,
        "the payload outlived every reference to it"
    );
    drop(rx);
}

#[test]
fn messages_received_on_a_thread_that_exits_are_freed_with_it() {
    let alive = std::sync::Arc::new(());
    let hub = manual();
    let mut rx = hub
        .receiver("t", SubscribeOptions::default().max_queue(4))
        .unwrap();
    for n in 0..100 {
        hub.publish("t", witnessed(n, &alive), PublishOptions::default())
            .unwrap();
    }
    let consumer = std::thread::spawn(move || {
        let mut got = 0;
        loop {
            match rx.try_recv() {
                Ok(m) => got += u64::from(n_of(&m) >= 96),
                Err(TryRecvError::Lagged { .. }) => {}
                Err(e) => panic!("{e:?}"),
            }
            if got == 4 {
                // The last message dropped, with no receive after it: held back by this
                // thread until it exits. The receiver stays alive past the thread's end.
                return rx;
            }
        }
    });
    let rx = consumer.join().unwrap();
    // The log still holds the last chunk; what the thread held back went with the thread.
    drop(hub);
    drop(rx);
    assert_eq!(std::sync::Arc::strong_count(&alive), 1, "a payload leaked");
}

/// Publishers racing on one topic: a publication's hub-wide number (`seq`) is taken in the same
/// order as its topic number, so both increase in what a subscriber receives, and equal
/// priorities stay in topic order under `message_priority` (which breaks ties by `seq`).
#[test]
fn publishers_racing_on_one_topic_are_numbered_alike_in_the_hub_and_the_topic() {
    for message_priority in [false, true] {
        let hub = Hub::new(
            SpySink::new(),
            HubOptions::default().message_priority(message_priority),
        )
        .unwrap();
        let mut rx = hub
            .receiver("t", SubscribeOptions::default().max_queue(64))
            .unwrap();
        const PER: u64 = 20_000;
        let publishers: Vec<_> = (0..2)
            .map(|_| {
                let hub = hub.clone();
                std::thread::spawn(move || {
                    for i in 0..PER {
                        publish(&hub, "t", i);
                    }
                })
            })
            .collect();
        let mut last: Option<(u64, u64)> = None;
        let (mut got, mut lagged) = (0, 0);
        while got + lagged < 2 * PER {
            match rx.recv_timeout(WAIT) {
                Ok(m) => {
                    let now = (m.topic_seq(), m.seq());
                    if let Some(before) = last {
                        assert!(
                            now.0 > before.0 && now.1 > before.1,
                            "message_priority {message_priority}: (topic_seq, seq) {now:?} after {before:?}"
                        );
                    }
                    last = Some(now);
                    got += 1;
                }
                Err(RecvTimeoutError::Lagged { missed }) => lagged += missed,
                Err(e) => panic!("{e:?}"),
            }
        }
        for p in publishers {
            p.join().unwrap();
        }
    }
}

/// A loss is reported where it is, never before messages published ahead of it: also when the
/// drain took the batch before the gap while the publisher went on dropping (a batch's drop
/// count is read when it is handed over, so it can count later drops).
#[test]
fn a_loss_is_never_reported_before_the_messages_ahead_of_it() {
    for message_priority in [false, true] {
        for policy in [SlowConsumer::DropOldest, SlowConsumer::DropNewest] {
            for _ in 0..20 {
                let hub = Hub::new(
                    SpySink::new(),
                    HubOptions::default().message_priority(message_priority),
                )
                .unwrap();
                let options = SubscribeOptions::default()
                    .max_queue(3)
                    .max_batch(2)
                    .slow_consumer(policy);
                let mut rx = hub.receiver("t", options).unwrap();
                for i in 0..20 {
                    publish(&hub, "t", i);
                }
                let (mut next, mut accounted) = (0, 0);
                let mut lag = 0;
                let mut seen = Vec::new();
                while accounted < 20 {
                    match rx.recv_timeout(WAIT) {
                        Ok(m) => {
                            let n = m.topic_seq();
                            seen.push(n.to_string());
                            assert!(
                                n >= next + lag,
                                "{policy:?}, message_priority {message_priority}: a loss of \
                                 {lag} reported before {n}, expected at {next} or later: {seen:?}"
                            );
                            next = n + 1;
                            lag = 0;
                            accounted += 1;
                        }
                        Err(RecvTimeoutError::Lagged { missed }) => {
                            seen.push(format!("L{missed}"));
                            lag += missed;
                            accounted += missed;
                        }
                        Err(e) => panic!("{e:?} after {seen:?}"),
                    }
                }
                assert_eq!(accounted, 20, "{seen:?}");
            }
        }
    }
}

/// `topic_seq` numbers the publications the topic kept for someone: one made while the topic
/// holds only a retained log (no subscriber, not retained) takes no number, so the receiver
/// that subscribes later sees its replay without a gap.
#[test]
fn a_publication_that_reaches_nobody_takes_no_topic_number() {
    let hub = Hub::new(SpySink::new(), HubOptions::default().driver(Driver::Manual)).unwrap();
    let retained = PublishOptions::default().retain(true);
    hub.publish("t", Message::to_json(&"a").unwrap(), retained)
        .unwrap();
    hub.publish_json("t", &"nobody").unwrap();
    hub.publish("t", Message::to_json(&"b").unwrap(), retained)
        .unwrap();
    let mut rx = hub.receiver("t", SubscribeOptions::default()).unwrap();
    hub.publish_json("t", &"c").unwrap();
    let seqs: Vec<u64> = (0..3).map(|_| rx.try_recv().unwrap().topic_seq()).collect();
    assert_eq!(seqs, [0, 1, 2]);
}

/// `delivered` counts each message a receiver received as it is received, whichever receive
/// took it (inside a run of the topic's log or at its start): after n receives it says n.
#[test]
fn delivered_counts_every_receive_at_once() {
    let hub = manual();
    let mut rx = hub.receiver("t", SubscribeOptions::default()).unwrap();
    for n in 0..6 {
        publish(&hub, "t", n);
    }
    assert_eq!(hub.stats().delivered, 0, "waiting is not delivered");
    assert_eq!(hub.stats().list[0].queued, 6);
    n_of(&rx.recv().unwrap());
    assert_eq!(hub.stats().delivered, 1);
    rx.try_recv().unwrap();
    assert_eq!(hub.stats().delivered, 2);
    rx.try_recv_ref().unwrap();
    assert_eq!(hub.stats().delivered, 3);
    rx.recv_ref().unwrap();
    rx.recv_timeout(WAIT).unwrap();
    assert_eq!(hub.stats().delivered, 5);
    rx.try_recv().unwrap();
    assert_eq!(hub.stats().delivered, 6);
    assert!(matches!(rx.try_recv(), Err(TryRecvError::Empty)));
    assert_eq!(hub.stats().delivered, 6);
}

/// A receiver takes messages, never an encoded frame: on a `raw`-codec hub it needs no
/// `max_batch(1)` (that bound is for subscribers sent one-message frames), whatever its policy.
#[test]
fn a_receiver_on_a_raw_codec_hub_needs_no_max_batch_of_one() {
    let hub = Hub::new(
        SpySink::new(),
        HubOptions::default().codec(powerhub::hub::Codec::Raw),
    )
    .unwrap();
    let mut direct = hub.receiver("t", SubscribeOptions::default()).unwrap();
    let mut fed = hub.receiver("t", fed()).unwrap();
    for n in 0..3u8 {
        hub.publish("t", Message::binary(vec![n]), PublishOptions::default())
            .unwrap();
    }
    for rx in [&mut direct, &mut fed] {
        let got: Vec<u8> = (0..3)
            .map(|_| rx.recv().unwrap().message().bytes()[0])
            .collect();
        assert_eq!(got, [0, 1, 2]);
    }
    // A sink subscriber is still held to it.
    assert!(matches!(
        hub.subscribe_sink("t", SubscribeOptions::default()),
        Err(powerhub::hub::SubscribeError::RawNeedsMaxBatchOne { max_batch: 32 })
    ));
}

/// A receive never waits out another subscriber's work: while a turn holds the drain (here a
/// handler that waits for the receiving thread), a fed receiver that would take its next batch
/// itself says `Empty` instead of blocking (it blocked, and the two threads waited for each
/// other), and takes it once the drain is free.
#[test]
fn a_receive_does_not_wait_for_a_drain_busy_with_another_subscriber() {
    let hub = manual();
    let (entered_tx, entered) = std::sync::mpsc::channel::<()>();
    let (go_tx, go) = std::sync::mpsc::channel::<()>();
    let go = std::sync::Mutex::new(go);
    hub.subscribe(
        "h",
        move |_| {
            entered_tx.send(()).unwrap();
            go.lock().unwrap().recv().unwrap();
        },
        SubscribeOptions::default(),
    )
    .unwrap()
    .detach();
    let mut rx = hub.receiver("r", fed().max_batch(1)).unwrap();
    publish(&hub, "h", 0);
    let turner = {
        let hub = hub.clone();
        std::thread::spawn(move || hub.turn(Instant::now()))
    };
    entered.recv_timeout(WAIT).expect("the handler runs");
    publish(&hub, "r", 1);
    let (done_tx, done) = std::sync::mpsc::channel();
    let receiver = std::thread::spawn(move || {
        let first = rx.try_recv().map(|m| n_of(&m));
        done_tx.send(first).unwrap();
        rx
    });
    let first = done
        .recv_timeout(WAIT)
        .expect("try_recv returned while the drain was busy");
    assert_eq!(first, Err(TryRecvError::Empty));
    go_tx.send(()).unwrap();
    turner.join().unwrap();
    let mut rx = receiver.join().unwrap();
    assert_eq!(n_of(&rx.recv_timeout(WAIT).unwrap()), 1);
}

/// Runs `recv` on a thread of its own, started before anything is published, and gives its
/// result (`None` if it is still blocked after `WAIT`).
fn blocked_recv(
    mut rx: powerhub::hub::Receiver,
    publish: impl FnOnce(),
) -> Option<Result<u64, RecvError>> {
    let (tx, done) = crossbeam_channel::bounded(1);
    let (started_tx, started) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        started_tx.send(()).unwrap();
        let _ = tx.send(rx.recv().map(|m| n_of(&m)));
    });
    started.recv().unwrap();
    // Give the receive time to block first (the rule holds either way; this exercises the
    // wake-up of a waiting receive).
    std::thread::sleep(Duration::from_millis(20));
    publish();
    done.recv_timeout(WAIT).ok()
}

#[test]
fn under_batch_false_a_blocked_recv_takes_a_publication_without_a_flush() {
    for policy in [SlowConsumer::DropNewest, SlowConsumer::Disconnect] {
        let hub = Hub::new(SpySink::new(), HubOptions::default().batch(false)).unwrap();
        let rx = hub
            .receiver("t", SubscribeOptions::default().slow_consumer(policy))
            .unwrap();
        let got = blocked_recv(rx, || publish(&hub, "t", 7));
        assert_eq!(got, Some(Ok(7)), "{policy:?}: recv stayed blocked");
        hub.close();
    }
}

#[test]
fn under_max_queue_zero_a_blocked_recv_reports_the_dropped_publication_as_a_lag() {
    let hub = threaded();
    let rx = hub
        .receiver(
            "t",
            SubscribeOptions::default()
                .max_queue(0)
                .slow_consumer(SlowConsumer::DropNewest),
        )
        .unwrap();
    let got = blocked_recv(rx, || publish(&hub, "t", 7));
    assert_eq!(
        got,
        Some(Err(RecvError::Lagged { missed: 1 })),
        "recv stayed blocked"
    );
    hub.close();
}

#[test]
fn a_drop_oldest_receivers_queued_is_what_it_has_left_to_receive() {
    // Inside a run (the messages of one chunk of the log) a receive publishes no position:
    // `stats()` must still count only what is left, and `delivered` plus `queued` stay the
    // messages published.
    for driver in [Driver::Manual, Driver::Thread] {
        let hub = Hub::new(SpySink::new(), HubOptions::default().driver(driver)).unwrap();
        let mut rx = hub
            .receiver("t", SubscribeOptions::default().id("r"))
            .unwrap();
        for n in 0..50 {
            publish(&hub, "t", n);
        }
        for k in 1..=50u64 {
            assert_eq!(n_of(&rx.try_recv().unwrap()), k - 1);
            let s = hub.stats();
            let row = s.list.iter().find(|r| r.id == "r").unwrap();
            assert_eq!(
                (row.queued, s.delivered),
                (50 - k as usize, k),
                "{driver:?}: after {k} receives"
            );
        }
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty);
        assert_eq!(hub.stats().list[0].queued, 0);
    }
    // A lag in the middle of a run: the receives after it go on from the new position.
    let hub = manual();
    let mut rx = hub
        .receiver("t", SubscribeOptions::default().id("r").max_queue(4))
        .unwrap();
    let queued = |hub: &Hub| hub.stats().list[0].queued;
    for n in 0..10 {
        publish(&hub, "t", n);
    }
    assert_eq!(
        rx.try_recv().unwrap_err(),
        TryRecvError::Lagged { missed: 6 }
    );
    assert_eq!(n_of(&rx.try_recv().unwrap()), 6);
    assert_eq!(n_of(&rx.try_recv().unwrap()), 7);
    assert_eq!(queued(&hub), 2);
    for n in 10..13 {
        publish(&hub, "t", n);
    }
    assert_eq!(
        rx.try_recv().unwrap_err(),
        TryRecvError::Lagged { missed: 1 }
    );
    assert_eq!(queued(&hub), 4, "9 to 12");
    assert_eq!(n_of(&rx.try_recv().unwrap()), 9);
    assert_eq!(queued(&hub), 3);
    assert_eq!(n_of(&rx.try_recv().unwrap()), 10);
    assert_eq!(queued(&hub), 2);
}

#[test]
fn a_drop_newest_receiver_hears_of_the_refused_tail_before_the_end() {
    // The last publications were refused (the queue was full until the end): the receiver
    // takes what was queued, then the loss, then why it ended; as it does while open.
    for end_by_close in [true, false] {
        let hub = manual();
        let mut rx = hub
            .receiver(
                "t",
                SubscribeOptions::default()
                    .id("n")
                    .max_queue(3)
                    .slow_consumer(SlowConsumer::DropNewest),
            )
            .unwrap();
        for n in 0..5 {
            publish(&hub, "t", n);
        }
        assert_eq!(hub.stats().dropped, 2);
        let reason = if end_by_close {
            hub.close();
            CloseReason::HubClosed
        } else {
            assert!(hub.unsubscribe("n"));
            CloseReason::Unsubscribe
        };
        let mut got = Vec::new();
        loop {
            match rx.try_recv() {
                Ok(m) => got.push(format!("{}", n_of(&m))),
                Err(TryRecvError::Lagged { missed }) => got.push(format!("lagged {missed}")),
                Err(TryRecvError::Closed { reason: r }) => {
                    assert_eq!(r, reason);
                    break;
                }
                Err(e) => panic!("{e:?} after the end: {got:?}"),
            }
        }
        assert_eq!(got, ["0", "1", "2", "lagged 2"], "{reason:?}");
        assert_eq!(
            rx.try_recv().unwrap_err(),
            TryRecvError::Closed { reason },
            "the end repeats, the loss is said once"
        );
    }
}

/// "A receive that would pass messages the policy dropped returns `Lagged` with their count
/// first, then the messages after the gap" (the receiver's docs), with a publisher on another
/// thread racing a consumer that falls behind now and then: between two messages, the gap in
/// their topic numbers is exactly what was reported as `Lagged` between them, for every kind of
/// receiver (a loss counted after the message behind it was handed over was once reported one
/// message late by a priority receiver).
#[test]
fn each_lagged_comes_right_before_the_gap_it_counts_under_a_concurrent_publisher() {
    let kinds = [
        ("drop-oldest", false, SlowConsumer::DropOldest),
        ("drop-newest", false, SlowConsumer::DropNewest),
        ("priority drop-oldest", true, SlowConsumer::DropOldest),
        ("priority drop-newest", true, SlowConsumer::DropNewest),
    ];
    for (kind, priority, policy) in kinds {
        let hub = Hub::new(
            SpySink::new(),
            HubOptions::default().message_priority(priority),
        )
        .unwrap();
        let mut rx = hub
            .receiver(
                "t",
                SubscribeOptions::default()
                    .max_queue(16)
                    .slow_consumer(policy),
            )
            .unwrap();
        const N: u64 = 20_000;
        let publisher = {
            let p = hub.publisher("t");
            std::thread::spawn(move || {
                for n in 0..N {
                    p.publish(json(n), PublishOptions::default()).unwrap();
                }
            })
        };
        let (mut last, mut lagged, mut received) = (None::<u64>, 0u64, 0u64);
        let mut total_lagged = 0;
        let mut received_at = 0u64;
        loop {
            received_at += 1;
            if received_at % 97 == 0 {
                std::thread::sleep(Duration::from_micros(300));
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(m) => {
                    let seq = m.topic_seq();
                    let gap = last.map_or(seq, |l| seq - l - 1);
                    assert_eq!(
                        gap, lagged,
                        "{kind}: topic number {seq} after {last:?}: Lagged said {lagged}"
                    );
                    (last, lagged) = (Some(seq), 0);
                    received += 1;
                }
                Err(RecvTimeoutError::Lagged { missed }) => {
                    lagged += missed;
                    total_lagged += missed;
                }
                Err(RecvTimeoutError::Timeout) if publisher.is_finished() => hub.close(),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Closed { .. }) => break,
                Err(e) => panic!("{kind}: {e}"),
            }
        }
        publisher.join().unwrap();
        assert_eq!(
            received + total_lagged,
            N,
            "{kind}: every publication accounted for"
        );
    }
}
