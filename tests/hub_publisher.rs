//! A publisher's handle of one topic (`Hub::publisher`): what `Hub::publish` does, in one order
//! with it, whatever the topic's consumers are and however they change while it publishes; the
//! topic kept while the handle lives and let go after; nothing published once the hub closed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use powerhub::hub::{
    Driver, Hub, HubOptions, Message, PublishError, PublishOptions, SubscribeOptions, TryRecvError,
};
use powerhub::transport::SpySink;

const WAIT: Duration = Duration::from_secs(20);

fn json(n: u64) -> Message {
    Message::json(format!("{{\"n\":{n}}}")).unwrap()
}

fn n_of(m: &[u8]) -> u64 {
    let v: serde_json::Value = serde_json::from_slice(m).unwrap();
    v["n"].as_u64().unwrap()
}

/// `count` threads, each publishing `each` messages to "t" through a handle of its own:
/// publisher `p` publishes `p * each`, `p * each + 1`, … in order.
fn spawn_publishers<'scope>(
    s: &'scope std::thread::Scope<'scope, '_>,
    hub: &Hub,
    count: u64,
    each: u64,
) -> Vec<std::thread::ScopedJoinHandle<'scope, ()>> {
    (0..count)
        .map(|p| {
            let publisher = hub.publisher("t");
            s.spawn(move || {
                for i in 0..each {
                    publisher
                        .publish(json(p * each + i), PublishOptions::default())
                        .unwrap();
                }
            })
        })
        .collect()
}

#[test]
fn a_handle_and_publishes_by_name_are_numbered_in_one_order() {
    let hub = Hub::new(SpySink::new(), HubOptions::default()).unwrap();
    let mut rx = hub
        .receiver("t", SubscribeOptions::default().max_queue(1024))
        .unwrap();
    let publisher = hub.publisher("t");
    for n in 0..200u64 {
        let queued = if n % 3 == 0 {
            hub.publish("t", json(n), PublishOptions::default())
        } else {
            publisher.publish(json(n), PublishOptions::default())
        }
        .unwrap();
        assert_eq!(queued, 1, "publication {n} is queued for the one receiver");
    }
    let mut last_seq = None;
    for n in 0..200u64 {
        let m = rx.try_recv().unwrap();
        assert_eq!(n_of(m.message().bytes()), n, "publish order kept");
        assert_eq!(
            m.topic_seq(),
            n,
            "consecutive topic numbers across both paths"
        );
        assert!(last_seq < Some(m.seq()), "hub-wide numbers increase");
        last_seq = Some(m.seq());
    }
    assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty);
    assert_eq!(hub.stats().published, 200);
}

#[test]
fn a_handle_reaches_every_kind_of_subscriber_and_applies_every_option() {
    let spy = SpySink::new();
    let hub = Hub::new(spy.clone(), HubOptions::default().driver(Driver::Manual)).unwrap();
    let publisher = hub.publisher("t");
    // Retained through the handle: a later receiver replays it.
    publisher
        .publish(json(0), PublishOptions::default().retain(true))
        .unwrap();
    let mut rx = hub.receiver("t", SubscribeOptions::default()).unwrap();
    assert_eq!(n_of(rx.try_recv().unwrap().message().bytes()), 0);
    // A transport subscriber joins the receiver: the handle reaches both.
    let _sub = hub
        .subscribe_sink("t", SubscribeOptions::default().id("sink"))
        .unwrap();
    assert_eq!(
        publisher
            .publish(json(1), PublishOptions::default())
            .unwrap(),
        2
    );
    hub.turn(Instant::now());
    assert_eq!(spy.frames_for("sink").len(), 1);
    let m = rx.try_recv().unwrap();
    assert_eq!((n_of(m.message().bytes()), m.topic_seq()), (1, 1));
    // A priority without `message_priority` is refused, as by name.
    assert!(matches!(
        publisher.publish(json(2), PublishOptions::default().priority(1)),
        Err(PublishError::PriorityWithoutMessagePriority)
    ));
    // The transport subscriber leaves: the receiver alone again, on the handle's own path.
    drop(_sub);
    assert_eq!(
        publisher
            .publish(json(3), PublishOptions::default())
            .unwrap(),
        1
    );
    let m = rx.try_recv().unwrap();
    assert_eq!((n_of(m.message().bytes()), m.topic_seq()), (3, 2));
}

#[test]
fn a_handle_keeps_its_topic_while_it_lives_and_lets_it_go_after() {
    let hub = Hub::new(SpySink::new(), HubOptions::default()).unwrap();
    let publisher = hub.publisher("t");
    let other = publisher.clone();
    assert_eq!(hub.stats().topics, 1, "the handle lists its topic");
    assert_eq!(
        publisher
            .publish(json(0), PublishOptions::default())
            .unwrap(),
        0
    );
    {
        let mut rx = hub.receiver("t", SubscribeOptions::default()).unwrap();
        publisher
            .publish(json(1), PublishOptions::default())
            .unwrap();
        assert_eq!(rx.try_recv().unwrap().topic_seq(), 0);
    }
    // The receiver left; the topic stays for the handles, and its numbering with it.
    assert_eq!(hub.stats().topics, 1);
    let mut rx = hub.receiver("t", SubscribeOptions::default()).unwrap();
    other.publish(json(2), PublishOptions::default()).unwrap();
    assert_eq!(rx.try_recv().unwrap().topic_seq(), 1);
    drop(rx);
    drop(publisher);
    assert_eq!(hub.stats().topics, 1, "a clone still holds it");
    drop(other);
    assert_eq!(hub.stats().topics, 0, "the last handle let it go");
    // A new topic of that name numbers from 0 again.
    let mut rx = hub.receiver("t", SubscribeOptions::default()).unwrap();
    hub.publisher("t")
        .publish(json(3), PublishOptions::default())
        .unwrap();
    assert_eq!(rx.try_recv().unwrap().topic_seq(), 0);
}

#[test]
fn handles_dropped_at_once_on_many_threads_leave_no_topic_behind() {
    let hub = Hub::new(SpySink::new(), HubOptions::default()).unwrap();
    for _ in 0..50 {
        let handles: Vec<_> = (0..4).map(|_| hub.publisher("t")).collect();
        std::thread::scope(|s| {
            for h in handles {
                s.spawn(move || drop(h));
            }
        });
        assert_eq!(hub.stats().topics, 0);
    }
}

#[test]
fn after_close_a_handle_publishes_nothing() {
    let hub = Hub::new(SpySink::new(), HubOptions::default()).unwrap();
    let mut rx = hub.receiver("t", SubscribeOptions::default()).unwrap();
    let publisher = hub.publisher("t");
    publisher
        .publish(json(0), PublishOptions::default())
        .unwrap();
    hub.close();
    assert_eq!(
        publisher
            .publish(json(1), PublishOptions::default())
            .unwrap(),
        0
    );
    assert_eq!(
        hub.publisher("u")
            .publish(json(2), PublishOptions::default())
            .unwrap(),
        0
    );
    assert_eq!(n_of(rx.try_recv().unwrap().message().bytes()), 0);
    assert!(matches!(rx.try_recv(), Err(TryRecvError::Closed { .. })));
    assert_eq!(hub.stats().published, 1);
}

/// Handles on several threads publish while receivers join and leave and a transport
/// subscriber comes and goes (so the handles switch between their own path and the path by
/// name): every receiver gets, from where it started, consecutive topic numbers with nothing
/// lost (its queue holds everything), and the numbers it saw are the publications' own.
#[test]
fn handles_on_many_threads_race_subscribes_and_unsubscribes_without_loss_or_reordering() {
    const PUBLISHERS: u64 = 3;
    const EACH: u64 = 20_000;
    let hub = Hub::new(SpySink::new(), HubOptions::default()).unwrap();
    let done = AtomicBool::new(false);
    let opts = || SubscribeOptions::default().max_queue(1 << 16);
    // The whole run's receiver, from the first publication on.
    let mut rx = hub.receiver("t", opts()).unwrap();
    std::thread::scope(|s| {
        spawn_publishers(s, &hub, PUBLISHERS, EACH);
        // Joins and leaves: a receiver reads what it got until it has seen a few, checks the
        // numbering, and goes.
        let (hub2, done2) = (&hub, &done);
        s.spawn(move || {
            while !done2.load(Ordering::Acquire) {
                let mut rx = hub2.receiver("t", opts()).unwrap();
                let mut last: Option<u64> = None;
                let start = Instant::now();
                let mut got = 0u32;
                while got < 50 && start.elapsed() < WAIT && !done2.load(Ordering::Acquire) {
                    match rx.try_recv() {
                        Ok(m) => {
                            if let Some(l) = last {
                                assert_eq!(m.topic_seq(), l + 1, "no gap, no reordering");
                            }
                            last = Some(m.topic_seq());
                            got += 1;
                        }
                        Err(TryRecvError::Empty) => std::thread::yield_now(),
                        Err(e) => panic!("unexpected {e:?}"),
                    }
                }
            }
        });
        s.spawn(move || {
            while !done2.load(Ordering::Acquire) {
                let sub = hub2
                    .subscribe_sink("t", SubscribeOptions::default())
                    .unwrap();
                std::thread::yield_now();
                drop(sub);
            }
        });
        let start = Instant::now();
        let mut seen = 0u64;
        let mut per_publisher = vec![None::<u64>; PUBLISHERS as usize];
        while seen < PUBLISHERS * EACH {
            assert!(start.elapsed() < WAIT, "stalled at {seen}");
            match rx.recv_timeout(WAIT) {
                Ok(m) => {
                    // Every publication, numbered from the first, none skipped or repeated.
                    assert_eq!(
                        m.topic_seq(),
                        seen,
                        "a gap or a repeat in the topic's numbers"
                    );
                    // Each publisher's own messages arrive in its order.
                    let n = n_of(m.message().bytes());
                    let p = (n / EACH) as usize;
                    assert!(per_publisher[p] < Some(n), "publisher {p} reordered");
                    per_publisher[p] = Some(n);
                    seen += 1;
                }
                Err(e) => panic!("unexpected {e:?} after {seen}"),
            }
        }
        assert!(matches!(rx.try_recv(), Err(TryRecvError::Empty)));
        done.store(true, Ordering::Release);
    });
    assert_eq!(hub.stats().published, PUBLISHERS * EACH);
}

#[test]
fn dropping_a_handle_keeps_the_retained_messages_of_its_topic() {
    let hub = Hub::new(SpySink::new(), HubOptions::default()).unwrap();
    // Retained through a handle with no subscriber, then the handle goes.
    let p = hub.publisher("cfg");
    p.publish(json(0), PublishOptions::default().retain(true))
        .unwrap();
    drop(p);
    // Retained by name, then a handle comes and goes.
    hub.publish("other", json(1), PublishOptions::default().retain(true))
        .unwrap();
    drop(hub.publisher("other"));
    for (topic, n) in [("cfg", 0), ("other", 1)] {
        let mut rx = hub.receiver(topic, SubscribeOptions::default()).unwrap();
        let m = rx.try_recv().unwrap();
        assert_eq!(
            n_of(m.message().bytes()),
            n,
            "{topic} replays what it retained"
        );
    }
}

/// realtime-hub.md: "The log is released when the last subscriber on that topic leaves" (a
/// publisher's handle, which keeps the topic, is not a subscriber).
#[test]
fn the_retained_log_goes_with_the_last_subscriber_while_a_handle_is_held() {
    let hub = Hub::new(SpySink::new(), HubOptions::default()).unwrap();
    let p = hub.publisher("t");
    let a = hub.receiver("t", SubscribeOptions::default()).unwrap();
    p.publish(json(0), PublishOptions::default().retain(true))
        .unwrap();
    drop(a);
    let mut c = hub.receiver("t", SubscribeOptions::default()).unwrap();
    assert!(
        matches!(c.try_recv(), Err(TryRecvError::Empty)),
        "the log went with the last subscriber"
    );
    // The handle still publishes, and retains anew.
    p.publish(json(1), PublishOptions::default().retain(true))
        .unwrap();
    assert_eq!(n_of(c.try_recv().unwrap().message().bytes()), 1);
    drop(c);
    let mut d = hub.receiver("t", SubscribeOptions::default()).unwrap();
    assert!(matches!(d.try_recv(), Err(TryRecvError::Empty)));
}

/// Receivers come and go one at a time (so the topic's log ends and a new one starts, with
/// queues of different sizes) while handles on several threads publish: each receiver sees the
/// topic's numbers consecutively from where it started, a gap only where it was told of a loss.
#[test]
fn receivers_coming_and_going_while_handles_publish_see_every_number_or_the_loss() {
    const PUBLISHERS: u64 = 2;
    const EACH: u64 = 50_000;
    let hub = Hub::new(SpySink::new(), HubOptions::default()).unwrap();
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let publishers = spawn_publishers(s, &hub, PUBLISHERS, EACH);
        let (hub, done) = (&hub, &done);
        s.spawn(move || {
            let mut round = 0usize;
            while !done.load(Ordering::Acquire) {
                round += 1;
                let queue = [8, 64, 1 << 12][round % 3];
                let mut rx = hub
                    .receiver("t", SubscribeOptions::default().max_queue(queue))
                    .unwrap();
                let mut expected: Option<u64> = None;
                for _ in 0..200 {
                    match rx.try_recv() {
                        Ok(m) => {
                            if let Some(e) = expected {
                                assert_eq!(m.topic_seq(), e, "a gap nobody was told of");
                            }
                            expected = Some(m.topic_seq() + 1);
                        }
                        Err(TryRecvError::Lagged { missed }) => {
                            if let Some(e) = expected.as_mut() {
                                *e += missed;
                            }
                        }
                        Err(TryRecvError::Empty) => std::thread::yield_now(),
                        Err(e) => panic!("unexpected {e:?}"),
                    }
                }
            }
        });
        for p in publishers {
            p.join().unwrap();
        }
        done.store(true, Ordering::Release);
    });
    assert_eq!(hub.stats().published, PUBLISHERS * EACH);
}

/// `close` while handles publish: a receiver gets exactly the publications that reported it
/// (each `Ok(1)`), then `Closed`.
#[test]
fn a_close_racing_handles_leaves_the_receiver_exactly_what_was_reported_queued() {
    for _ in 0..20 {
        let hub = Hub::new(SpySink::new(), HubOptions::default()).unwrap();
        let mut rx = hub
            .receiver("t", SubscribeOptions::default().max_queue(1 << 20))
            .unwrap();
        let queued: u64 = std::thread::scope(|s| {
            let publishers: Vec<_> = (0..2)
                .map(|_| {
                    let publisher = hub.publisher("t");
                    s.spawn(move || {
                        let mut queued = 0u64;
                        for i in 0.. {
                            match publisher.publish(json(i), PublishOptions::default()) {
                                Ok(0) => break,
                                Ok(n) => queued += n as u64,
                                Err(e) => panic!("{e}"),
                            }
                        }
                        queued
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(2));
            hub.close();
            publishers.into_iter().map(|p| p.join().unwrap()).sum()
        });
        let mut got = 0u64;
        loop {
            match rx.try_recv() {
                Ok(_) => got += 1,
                Err(TryRecvError::Closed { .. }) => break,
                Err(e) => panic!("unexpected {e:?} after {got}"),
            }
        }
        assert_eq!(got, queued, "received exactly what the publishes reported");
    }
}
