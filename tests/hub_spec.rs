//! One test per rule of the realtime-hub spec, through the public API, on a spy transport.
//! Timing rules run on a virtual clock with `Driver::Manual`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use powerhub::hub::{
    Codec, Delivery, DeliveryError, Driver, FlushError, Hub, HubConfig, HubOptions, Message,
    OptionsError, PublishError, PublishOptions, SlowConsumer, SubscribeError, SubscribeOptions,
    SubscriberRef,
};
use powerhub::transport::{SpyMode, SpySink};
use powerhub_plugin::frame;
use powerhub_plugin::{CloseReason, SendError};

type Errors = Arc<Mutex<Vec<(DeliveryError, Option<String>)>>>;

fn manual(opts: HubOptions) -> (Hub, SpySink) {
    let spy = SpySink::new();
    let hub = Hub::new(spy.clone(), opts.driver(Driver::Manual)).unwrap();
    (hub, spy)
}

fn with_errors(opts: HubOptions) -> (HubOptions, Errors) {
    let errors: Errors = Arc::default();
    let e = Arc::clone(&errors);
    let opts = opts.on_error(move |err: &DeliveryError, sub: Option<&SubscriberRef>| {
        e.lock()
            .unwrap()
            .push((err.clone(), sub.map(|s| s.id().to_owned())));
    });
    (opts, errors)
}

fn turn(hub: &Hub) {
    hub.turn(Instant::now());
}

fn json(n: impl serde::Serialize) -> Message {
    Message::to_json(&n).unwrap()
}

fn publish(hub: &Hub, topic: &str, n: i64) -> usize {
    hub.publish(topic, json(n), PublishOptions::default())
        .unwrap()
}

fn publish_prio(hub: &Hub, topic: &str, n: i64, priority: i32) -> usize {
    hub.publish(topic, json(n), PublishOptions::default().priority(priority))
        .unwrap()
}

/// The messages of a json frame, as strings.
fn messages(f: &Bytes) -> Vec<String> {
    let d = frame::decode(f).unwrap();
    d.json_messages()
        .unwrap()
        .iter()
        .map(|m| String::from_utf8(m.to_vec()).unwrap())
        .collect()
}

/// Every message a subscriber received, in order.
fn received(spy: &SpySink, id: &str) -> Vec<String> {
    spy.frames_for(id).iter().flat_map(messages).collect()
}

fn nums(range: std::ops::Range<i64>) -> Vec<String> {
    range.map(|n| n.to_string()).collect()
}

fn sub(hub: &Hub, topic: &str, opts: SubscribeOptions) -> powerhub::hub::Subscription {
    hub.subscribe(topic, |_: &Delivery<'_>| {}, opts).unwrap()
}

fn recorder() -> (
    Arc<Mutex<Vec<String>>>,
    impl Fn(&Delivery<'_>) + Send + Sync + 'static,
) {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let s = Arc::clone(&seen);
    (seen, move |d: &Delivery<'_>| {
        s.lock()
            .unwrap()
            .push(String::from_utf8(d.message().bytes().to_vec()).unwrap())
    })
}

// ---- options and validation -------------------------------------------------------------------

#[test]
fn subscribe_defaults_are_max_queue_64_max_batch_32_drop_oldest() {
    let (hub, spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    for i in 0..70 {
        assert_eq!(publish(&hub, "t", i), 1);
    }
    let s = hub.stats();
    assert_eq!(s.list[0].queued, 64);
    assert_eq!(s.dropped, 6, "drop-oldest evicted the 6 oldest");
    turn(&hub);
    let frames = spy.frames_for("a");
    assert_eq!(frames.len(), 2, "64 messages in batches of at most 32");
    assert_eq!(messages(&frames[0]).len(), 32);
    assert_eq!(received(&spy, "a"), nums(6..70));
}

#[test]
fn hub_config_defaults_match_the_options_defaults() {
    let cfg: HubConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(cfg, HubConfig::default());
    assert!(cfg.batch);
    assert_eq!(cfg.batch_delay_ms, 0.0);
    assert_eq!(cfg.codec, Codec::Json);
    assert!(!cfg.message_priority);
}

#[test]
fn unknown_option_is_an_error_naming_it() {
    let err = serde_json::from_str::<HubConfig>(r#"{"batchDelayMs": 5}"#).unwrap_err();
    assert!(
        err.to_string().contains("unknown field `batchDelayMs`"),
        "{err}"
    );
    let err =
        serde_json::from_str::<powerhub::hub::SubscribeConfig>(r#"{"maxQueue": 5}"#).unwrap_err();
    assert!(
        err.to_string().contains("unknown field `maxQueue`"),
        "{err}"
    );
    let err = serde_json::from_str::<HubConfig>(r#"{"codec": "xml"}"#).unwrap_err();
    assert!(err.to_string().contains("xml"), "{err}");
}

#[test]
fn negative_or_nan_batch_delay_is_rejected_naming_the_option() {
    for bad in [-1.0, f64::NAN, f64::INFINITY, 1e12] {
        let mut cfg = HubConfig::default();
        cfg.batch_delay_ms = bad;
        match HubOptions::from_config(&cfg) {
            Err(OptionsError::Invalid { option, .. }) => assert_eq!(option, "batch_delay_ms"),
            other => panic!("{bad}: {other:?}"),
        }
    }
    let mut cfg = HubConfig::default();
    cfg.batch_delay_ms = 0.0;
    assert!(HubOptions::from_config(&cfg).is_ok(), "zero is kept");
    let err = Hub::new(
        SpySink::new(),
        HubOptions::default().batch_delay(Duration::from_secs(3600)),
    )
    .unwrap_err();
    assert!(err.to_string().contains("`batch_delay`"), "{err}");
}

#[test]
fn raw_codec_requires_max_batch_one() {
    let (hub, _spy) = manual(HubOptions::default().codec(Codec::Raw));
    let err = hub
        .subscribe("t", |_| {}, SubscribeOptions::default())
        .unwrap_err();
    assert!(matches!(
        err,
        SubscribeError::RawNeedsMaxBatchOne { max_batch: 32 }
    ));
    assert!(err.to_string().contains("`max_batch: 1`"), "{err}");
    assert!(err.to_string().contains("`codec: raw`"), "{err}");
    // `batch: false` does not rescue the default.
    let (hub2, _spy2) = manual(HubOptions::default().codec(Codec::Raw).batch(false));
    assert!(hub2
        .subscribe("t", |_| {}, SubscribeOptions::default())
        .is_err());
    // A per-subscriber raw codec is checked too; max_batch 1 is accepted.
    let (hub3, _spy3) = manual(HubOptions::default());
    assert!(hub3
        .subscribe("t", |_| {}, SubscribeOptions::default().codec(Codec::Raw))
        .is_err());
    assert!(hub
        .subscribe("t", |_| {}, SubscribeOptions::default().max_batch(1))
        .is_ok());
}

#[test]
fn duplicate_subscriber_id_is_an_error_naming_it() {
    let (hub, _spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default().id("client-42")).detach();
    let err = hub
        .subscribe("u", |_| {}, SubscribeOptions::default().id("client-42"))
        .unwrap_err();
    assert_eq!(err, SubscribeError::DuplicateId("client-42".into()));
    assert!(err.to_string().contains("client-42"));
}

#[test]
fn invalid_subscribe_options_are_errors_naming_the_option() {
    let (hub, _spy) = manual(HubOptions::default());
    let cases = [
        (SubscribeOptions::default().max_batch(0), "max_batch"),
        (
            SubscribeOptions::default().max_queue(usize::MAX),
            "max_queue",
        ),
        (SubscribeOptions::default().id(""), "id"),
    ];
    for (opts, name) in cases {
        match hub.subscribe("t", |_| {}, opts) {
            Err(SubscribeError::InvalidOption { option, .. }) => assert_eq!(option, name),
            other => panic!("{name}: {other:?}"),
        }
    }
}

#[test]
fn generated_ids_are_unique() {
    let (hub, _spy) = manual(HubOptions::default());
    let a = sub(&hub, "t", SubscribeOptions::default());
    let b = sub(&hub, "t", SubscribeOptions::default());
    assert_ne!(a.id(), b.id());
}

// ---- publish ----------------------------------------------------------------------------------

#[test]
fn publish_returns_the_number_of_subscribers_queued_for() {
    let (hub, _spy) = manual(HubOptions::default());
    assert_eq!(publish(&hub, "t", 0), 0);
    sub(&hub, "t", SubscribeOptions::default()).detach();
    sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .max_queue(1)
            .slow_consumer(SlowConsumer::DropNewest),
    )
    .detach();
    sub(&hub, "other", SubscribeOptions::default()).detach();
    assert_eq!(publish(&hub, "t", 1), 2);
    assert_eq!(
        publish(&hub, "t", 2),
        1,
        "the full drop-newest subscriber refused it"
    );
}

#[test]
fn publish_priority_without_message_priority_is_an_error() {
    let (hub, _spy) = manual(HubOptions::default());
    let err = hub
        .publish("t", json(1), PublishOptions::default().priority(3))
        .unwrap_err();
    assert_eq!(err, PublishError::PriorityWithoutMessagePriority);
    assert!(err.to_string().contains("`message_priority: true`"));
    assert_eq!(hub.stats().published, 0);
}

#[test]
fn publish_after_close_returns_zero() {
    let (hub, _spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default()).detach();
    hub.close();
    assert_eq!(publish(&hub, "t", 1), 0);
}

#[test]
fn publish_from_many_threads_never_blocks_on_a_stalled_subscriber() {
    let (hub, spy) = manual(HubOptions::default());
    spy.set_mode_for("stalled", SpyMode::Pending);
    sub(
        &hub,
        "t",
        SubscribeOptions::default().id("stalled").max_queue(8),
    )
    .detach();
    sub(
        &hub,
        "t",
        SubscribeOptions::default().id("healthy").max_queue(4096),
    )
    .detach();
    publish(&hub, "t", -1);
    turn(&hub); // the stalled subscriber now has a send that never completes
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let hub = hub.clone();
            let done = done_tx.clone();
            std::thread::spawn(move || {
                for i in 0..500 {
                    hub.publish("t", json(t * 1000 + i), PublishOptions::default())
                        .unwrap();
                }
                done.send(()).unwrap();
            })
        })
        .collect();
    for _ in 0..4 {
        // Bounded so a publish that blocks fails the test instead of hanging the suite; no
        // timing is asserted.
        done_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a publisher blocked on the stalled subscriber");
    }
    for t in threads {
        t.join().unwrap();
    }
    turn(&hub);
    assert_eq!(received(&spy, "healthy").len(), 2001);
    let s = hub.stats();
    let stalled = s.list.iter().find(|x| x.id == "stalled").unwrap();
    assert!(stalled.in_flight);
    assert_eq!(stalled.queued, 8, "bounded by max_queue");
    assert_eq!(stalled.dropped, 2000 - 8);
}

#[test]
fn a_stalled_subscriber_costs_bounded_memory_evicted_messages_are_released() {
    for policy in [SlowConsumer::DropOldest, SlowConsumer::Disconnect] {
        let (hub, spy) = manual(HubOptions::default());
        spy.set_mode(SpyMode::Pending);
        sub(
            &hub,
            "t",
            SubscribeOptions::default()
                .id("small")
                .max_queue(4)
                .slow_consumer(policy),
        )
        .detach();
        sub(
            &hub,
            "t",
            SubscribeOptions::default().id("large").max_queue(8),
        )
        .detach();
        publish(&hub, "t", -1);
        turn(&hub); // both now have a send that never completes
        let probe = Message::json(String::from("[0]")).unwrap();
        let weak = probe.bytes().clone();
        hub.publish("t", probe, PublishOptions::default()).unwrap();
        assert!(!weak.is_unique(), "the hub holds the queued message itself");
        for i in 1..=8 {
            publish(&hub, "t", i);
        }
        turn(&hub);
        assert!(
            weak.is_unique(),
            "{policy:?}: the hub let go of a message every subscriber evicted"
        );
        for _ in 0..10_000 {
            publish(&hub, "t", 7);
        }
        let s = hub.stats();
        assert!(s.list.iter().all(|x| x.queued <= 8), "{policy:?}: {s:?}");
    }
}

#[test]
fn shared_log_releases_entries_every_subscriber_has_taken() {
    let (hub, spy) = manual(HubOptions::default());
    for id in ["a", "b"] {
        sub(
            &hub,
            "t",
            SubscribeOptions::default().id(id).max_queue(4096),
        )
        .detach();
    }
    // A large message (1 MiB of JSON), then a few small ones: both subscribers take them all.
    let big = format!("\"{}\"", "x".repeat(1 << 20));
    let probe = Message::json(big).unwrap();
    let held = probe.bytes().clone();
    hub.publish("t", probe, PublishOptions::default()).unwrap();
    for i in 0..3 {
        publish(&hub, "t", i);
    }
    assert!(!held.is_unique(), "queued for two subscribers");
    turn(&hub);
    assert_eq!(spy.frames_for("a").len(), 1);
    assert_eq!(spy.frames_for("b").len(), 1);
    assert!(
        held.is_unique(),
        "the topic log still holds a message every subscriber has taken"
    );

    // A stalled subscriber keeps its `max_queue` window, no more, and gets it in order; the
    // others do not make the log keep anything for it beyond that window.
    spy.set_mode_for("stalled", SpyMode::Pending);
    sub(
        &hub,
        "t",
        SubscribeOptions::default().id("stalled").max_queue(4),
    )
    .detach();
    publish(&hub, "t", -1);
    turn(&hub); // its send of [-1] never completes
    let probes: Vec<Bytes> = (0..6)
        .map(|i| {
            let m = Message::json(format!("\"{i}{}\"", "y".repeat(1 << 16))).unwrap();
            let b = m.bytes().clone();
            hub.publish("t", m, PublishOptions::default()).unwrap();
            b
        })
        .collect();
    turn(&hub); // a and b take all six
    assert!(
        probes[..2].iter().all(Bytes::is_unique),
        "entries outside every window are released"
    );
    assert!(
        probes[2..].iter().all(|b| !b.is_unique()),
        "the stalled subscriber's last 4 are kept"
    );
    let s = hub.stats();
    let stalled = s.list.iter().find(|x| x.id == "stalled").unwrap();
    assert_eq!((stalled.queued, stalled.dropped), (4, 2), "{s:?}");
    spy.set_mode_for("stalled", SpyMode::Accept);
    spy.complete_all();
    turn(&hub);
    let got: Vec<String> = received(&spy, "stalled")
        .iter()
        .map(|m| m.chars().take(2).collect())
        .collect();
    assert_eq!(got, ["-1", "\"2", "\"3", "\"4", "\"5"]);
    assert!(
        probes.iter().all(Bytes::is_unique),
        "once the stalled subscriber took its window, the log holds nothing"
    );
    assert_eq!(hub.stats().dropped, 2);

    // When the only subscriber still needing an entry leaves, the entry goes with it.
    spy.set_mode_for("stalled", SpyMode::Pending);
    publish(&hub, "t", -2);
    turn(&hub); // the stalled subscriber's send of [-2] never completes
    let probe = Message::json(format!("\"{}\"", "z".repeat(1 << 16))).unwrap();
    let last = probe.bytes().clone();
    hub.publish("t", probe, PublishOptions::default()).unwrap();
    turn(&hub);
    assert!(
        !last.is_unique(),
        "still in the stalled subscriber's window"
    );
    assert!(hub.unsubscribe("stalled"));
    assert!(
        last.is_unique(),
        "released when the stalled subscriber left"
    );
}

// ---- slow-consumer policies --------------------------------------------------------------------

#[test]
fn drop_oldest_discards_the_head_to_make_room() {
    let (hub, spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default().id("a").max_queue(3)).detach();
    for i in 0..5 {
        assert_eq!(
            publish(&hub, "t", i),
            1,
            "drop-oldest always queues the incoming one"
        );
    }
    turn(&hub);
    assert_eq!(received(&spy, "a"), nums(2..5));
    assert_eq!(hub.stats().dropped, 2);
    assert_eq!(hub.stats().list[0].dropped, 2);
}

#[test]
fn drop_newest_refuses_the_incoming_message() {
    let (hub, spy) = manual(HubOptions::default());
    sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .id("a")
            .max_queue(3)
            .slow_consumer(SlowConsumer::DropNewest),
    )
    .detach();
    let counts: Vec<usize> = (0..5).map(|i| publish(&hub, "t", i)).collect();
    assert_eq!(counts, [1, 1, 1, 0, 0]);
    turn(&hub);
    assert_eq!(received(&spy, "a"), nums(0..3));
    assert_eq!(hub.stats().dropped, 2);
}

#[test]
fn disconnect_closes_with_slow_consumer_and_counts_it() {
    let (hub, spy) = manual(HubOptions::default());
    let s = sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .id("a")
            .max_queue(2)
            .slow_consumer(SlowConsumer::Disconnect),
    );
    sub(&hub, "t", SubscribeOptions::default().id("b")).detach();
    assert_eq!(publish(&hub, "t", 0), 2);
    assert_eq!(publish(&hub, "t", 1), 2);
    assert_eq!(publish(&hub, "t", 2), 1, "a fell behind and was cut loose");
    assert_eq!(
        spy.closes(),
        vec![("a".to_owned(), CloseReason::SlowConsumer)]
    );
    let st = hub.stats();
    assert_eq!(st.disconnected, 1);
    assert_eq!(st.subscribers, 1);
    assert_eq!(
        st.dropped, 3,
        "the refused message and the two it had queued"
    );
    assert!(!s.is_active());
    assert_eq!(publish(&hub, "t", 3), 1);
    turn(&hub);
    assert!(spy.frames_for("a").is_empty());
    assert_eq!(received(&spy, "b"), nums(0..4));
}

#[test]
fn max_queue_zero_drops_the_incoming_message_under_drop_oldest_and_drop_newest() {
    for policy in [SlowConsumer::DropOldest, SlowConsumer::DropNewest] {
        let (hub, spy) = manual(HubOptions::default());
        sub(
            &hub,
            "t",
            SubscribeOptions::default()
                .id("a")
                .max_queue(0)
                .slow_consumer(policy),
        )
        .detach();
        assert_eq!(publish(&hub, "t", 1), 0, "{policy:?}");
        turn(&hub);
        assert!(spy.frames().is_empty());
        assert_eq!(hub.stats().dropped, 1);
        assert!(spy.closes().is_empty());
    }
}

#[test]
fn max_queue_zero_disconnects_on_the_first_message_under_disconnect() {
    let (hub, spy) = manual(HubOptions::default());
    sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .id("a")
            .max_queue(0)
            .slow_consumer(SlowConsumer::Disconnect),
    )
    .detach();
    assert_eq!(publish(&hub, "t", 1), 0);
    assert_eq!(
        spy.closes(),
        vec![("a".to_owned(), CloseReason::SlowConsumer)]
    );
    assert_eq!(hub.stats().disconnected, 1);
}

#[test]
fn drop_oldest_under_message_priority_evicts_lowest_priority_newest_among_equals() {
    let (hub, spy) = manual(HubOptions::default().message_priority(true));
    sub(&hub, "t", SubscribeOptions::default().id("a").max_queue(2)).detach();
    // The spec's example: `noise` loses its slot; `critical` and `also-noise` are delivered.
    hub.publish(
        "t",
        json("critical"),
        PublishOptions::default().priority(10),
    )
    .unwrap();
    hub.publish("t", json("noise"), PublishOptions::default().priority(1))
        .unwrap();
    hub.publish(
        "t",
        json("also-noise"),
        PublishOptions::default().priority(0),
    )
    .unwrap();
    turn(&hub);
    assert_eq!(received(&spy, "a"), ["\"critical\"", "\"also-noise\""]);

    // Among equal priorities the most recently queued goes.
    let (hub, spy) = manual(HubOptions::default().message_priority(true));
    sub(&hub, "t", SubscribeOptions::default().id("a").max_queue(3)).detach();
    publish_prio(&hub, "t", 1, 5);
    publish_prio(&hub, "t", 2, 1);
    publish_prio(&hub, "t", 3, 1);
    publish_prio(&hub, "t", 4, 9);
    turn(&hub);
    assert_eq!(received(&spy, "a"), ["4", "1", "2"]);
    assert_eq!(hub.stats().dropped, 1);
}

#[test]
fn message_priority_delivers_highest_first_ties_by_arrival() {
    let (hub, spy) = manual(HubOptions::default().message_priority(true));
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    publish_prio(&hub, "t", 1, 1);
    publish_prio(&hub, "t", 2, 10);
    publish(&hub, "t", 3); // an omitted priority is 0
    publish_prio(&hub, "t", 4, 0);
    publish_prio(&hub, "t", 5, 10);
    turn(&hub);
    assert_eq!(received(&spy, "a"), ["2", "5", "1", "3", "4"]);
}

#[test]
fn message_priority_does_not_read_ordering_from_the_payload() {
    let (hub, spy) = manual(HubOptions::default().message_priority(true));
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    hub.publish(
        "t",
        Message::json(r#"{"priority":1}"#).unwrap(),
        PublishOptions::default(),
    )
    .unwrap();
    hub.publish(
        "t",
        Message::json(r#"{"priority":99}"#).unwrap(),
        PublishOptions::default(),
    )
    .unwrap();
    turn(&hub);
    assert_eq!(
        received(&spy, "a"),
        [r#"{"priority":1}"#, r#"{"priority":99}"#]
    );
}

#[test]
fn drop_newest_under_message_priority_keeps_what_is_queued() {
    let (hub, spy) = manual(HubOptions::default().message_priority(true));
    sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .id("a")
            .max_queue(1)
            .slow_consumer(SlowConsumer::DropNewest),
    )
    .detach();
    publish_prio(&hub, "t", 1, 0);
    assert_eq!(
        publish_prio(&hub, "t", 2, 100),
        0,
        "a high priority does not evict under drop-newest"
    );
    turn(&hub);
    assert_eq!(received(&spy, "a"), ["1"]);
}

// ---- batching ----------------------------------------------------------------------------------

#[test]
fn one_turn_becomes_one_frame_per_subscriber_batch() {
    let (hub, spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    for i in 0..5 {
        publish(&hub, "t", i);
    }
    turn(&hub);
    let frames = spy.frames();
    assert_eq!(frames.len(), 1);
    assert_eq!(messages(&frames[0].frame), nums(0..5));
    assert_eq!(&frames[0].frame[frame::HEADER_LEN..], b"[0,1,2,3,4]");
}

#[test]
fn batches_are_split_at_max_batch() {
    let (hub, spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default().id("a").max_batch(4)).detach();
    for i in 0..10 {
        publish(&hub, "t", i);
    }
    turn(&hub);
    let sizes: Vec<usize> = spy
        .frames_for("a")
        .iter()
        .map(|f| messages(f).len())
        .collect();
    assert_eq!(sizes, [4, 4, 2]);
    assert_eq!(received(&spy, "a"), nums(0..10));
}

#[test]
fn batch_delay_widens_the_window_on_a_virtual_clock() {
    let (hub, spy) = manual(HubOptions::default().batch_delay(Duration::from_millis(50)));
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    let t0 = Instant::now();
    assert_eq!(hub.poll_timeout(), None);
    publish(&hub, "t", 0);
    hub.turn(t0); // opens the window
    assert_eq!(hub.poll_timeout(), Some(t0 + Duration::from_millis(50)));
    publish(&hub, "t", 1);
    hub.turn(t0 + Duration::from_millis(49));
    assert!(spy.frames().is_empty(), "still inside the window");
    publish(&hub, "t", 2);
    hub.turn(t0 + Duration::from_millis(50));
    let frames = spy.frames();
    assert_eq!(frames.len(), 1, "the burst became one frame");
    assert_eq!(messages(&frames[0].frame), nums(0..3));
    assert_eq!(hub.poll_timeout(), None);
}

#[test]
fn zero_batch_delay_sends_at_the_next_turn() {
    let (hub, spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    let t0 = Instant::now();
    publish(&hub, "t", 0);
    assert!(hub.poll_timeout().is_some_and(|t| t <= Instant::now()));
    hub.turn(t0);
    assert_eq!(spy.frames().len(), 1);
}

#[test]
fn batch_false_sends_only_on_flush() {
    let (hub, spy) = manual(HubOptions::default().batch(false));
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    publish(&hub, "t", 0);
    publish(&hub, "t", 1);
    turn(&hub);
    assert_eq!(hub.poll_timeout(), None);
    assert!(spy.frames().is_empty());
    hub.flush().unwrap();
    assert_eq!(received(&spy, "a"), nums(0..2));
    // The same under the thread driver: nothing is sent until flush.
    let spy = SpySink::new();
    let hub = Hub::new(spy.clone(), HubOptions::default().batch(false)).unwrap();
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    publish(&hub, "t", 0);
    assert_eq!(hub.stats().list[0].queued, 1);
    hub.flush().unwrap();
    assert_eq!(received(&spy, "a"), nums(0..1));
}

#[test]
fn thread_driver_sends_without_a_flush() {
    let (sink, rx) = powerhub::transport::channel(16);
    let hub = Hub::new(sink, HubOptions::default()).unwrap();
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    publish(&hub, "t", 7);
    // Bounded wait so a bug cannot hang the suite; no timing is asserted.
    match rx.recv_timeout(Duration::from_secs(30)).unwrap() {
        powerhub::transport::ChannelEvent::Frame { subscriber, frame } => {
            assert_eq!(subscriber.id(), "a");
            assert_eq!(messages(&frame), ["7"]);
        }
        other => panic!("{other:?}"),
    }
}

/// The spec's batching example under the default driver: five publications in one go, then a
/// flush, are one frame `[0,1,2,3,4]`, even though the drain thread may wake in the middle of
/// the burst (it waits for publications to pause first). A heuristic against the scheduler: a
/// publisher preempted in the middle of its burst may still see it split, so the rule is
/// checked over 100 hubs, allowing five splits (without the pause, 7 to 16 of 100 split in a
/// debug build of this suite; with it, none in five runs).
#[test]
fn a_burst_published_in_one_go_is_one_frame_under_the_default_driver() {
    let mut split = 0;
    for _ in 0..100 {
        let spy = SpySink::new();
        let hub = Hub::new(spy.clone(), HubOptions::default()).unwrap();
        let _s = sub(&hub, "t", SubscribeOptions::default());
        for i in 0..5 {
            publish(&hub, "t", i);
        }
        hub.flush().unwrap();
        let frames = spy.frames();
        assert_eq!(
            frames
                .iter()
                .flat_map(|f| messages(&f.frame))
                .collect::<Vec<_>>(),
            nums(0..5)
        );
        if frames.len() > 1 {
            split += 1;
        }
        hub.close();
    }
    eprintln!("{split} of 100 bursts split");
    assert!(
        split <= 5,
        "{split} of 100 bursts split into several frames"
    );
}

// ---- shared frames -----------------------------------------------------------------------------

#[test]
fn one_frame_per_topic_batch_is_shared_by_every_subscriber() {
    let (hub, spy) = manual(HubOptions::default());
    for i in 0..100 {
        sub(&hub, "t", SubscribeOptions::default().id(format!("s{i}"))).detach();
    }
    for i in 0..3 {
        publish(&hub, "t", i);
    }
    turn(&hub);
    let frames = spy.frames();
    assert_eq!(frames.len(), 100);
    let ptr = frames[0].frame.as_ptr();
    assert!(
        frames.iter().all(|f| f.frame.as_ptr() == ptr),
        "the same buffer reached every send"
    );
    assert_eq!(hub.stats().encoded, 1);
}

#[test]
fn encoded_stays_one_per_flush_whatever_the_subscriber_count() {
    for n in [1, 10, 1000] {
        let (hub, _spy) = manual(HubOptions::default());
        for _ in 0..n {
            sub(&hub, "t", SubscribeOptions::default()).detach();
        }
        for round in 0..3 {
            publish(&hub, "t", round);
            hub.flush().unwrap();
        }
        assert_eq!(hub.stats().encoded, 3, "{n} subscribers");
    }
}

#[test]
fn a_subscriber_in_flight_during_a_turn_later_shares_the_frame_the_others_took() {
    let (hub, spy) = manual(HubOptions::default());
    spy.set_mode_for("slow", SpyMode::Pending);
    sub(&hub, "t", SubscribeOptions::default().id("slow")).detach();
    sub(&hub, "t", SubscribeOptions::default().id("fast")).detach();
    publish(&hub, "t", 0);
    turn(&hub); // slow's send of [0] stays pending
    publish(&hub, "t", 1);
    publish(&hub, "t", 2);
    turn(&hub); // fast takes [1, 2] while slow is in flight
    sub(&hub, "u", SubscribeOptions::default().id("other")).detach();
    publish(&hub, "u", 9);
    turn(&hub); // a turn of another topic between
    spy.set_mode_for("slow", SpyMode::Accept);
    spy.complete_all();
    turn(&hub); // slow takes the same [1, 2]
    assert_eq!(received(&spy, "slow"), nums(0..3));
    assert_eq!(received(&spy, "fast"), nums(0..3));
    assert_eq!(
        spy.frames_for("slow")[1].as_ptr(),
        spy.frames_for("fast")[1].as_ptr(),
        "the frame encoded two turns earlier reached the subscriber that was in flight"
    );
    assert_eq!(hub.stats().encoded, 3, "[0], [1, 2] and u's [9]");
}

#[test]
fn encoded_stays_one_per_batch_when_handlers_run_on_the_pool() {
    // The default driver: handlers run on the handler pool, and a subscriber stays in flight
    // until its handler ran, so the subscribers of one topic take each batch in passes of their
    // own, as their handlers finish. Here each handler waits for the test's go, given one
    // subscriber at a time: every batch after the first is taken in eight passes.
    const WAIT: Duration = Duration::from_secs(10);
    let spy = SpySink::new();
    let hub = Hub::new(spy.clone(), HubOptions::default()).unwrap();
    let mut go = Vec::new();
    for i in 0..8 {
        let (tx, rx) = crossbeam_channel::unbounded::<()>();
        go.push(tx);
        hub.subscribe(
            "t",
            move |_: &Delivery<'_>| {
                let _ = rx.recv_timeout(WAIT);
            },
            SubscribeOptions::default().id(format!("s{i}")).max_batch(1),
        )
        .unwrap()
        .detach();
    }
    for n in 0..3 {
        publish(&hub, "t", n);
    }
    let sent = |i: usize, n: usize| {
        let until = Instant::now() + WAIT;
        while spy.frames_for(&format!("s{i}")).len() < n {
            assert!(Instant::now() < until, "s{i} never got frame {n}");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    for round in 1..3 {
        for (i, tx) in go.iter().enumerate() {
            sent(i, round);
            tx.send(()).unwrap();
            sent(i, round + 1);
        }
    }
    for tx in &go {
        tx.send(()).unwrap();
    }
    hub.flush().unwrap();
    for i in 0..8 {
        assert_eq!(received(&spy, &format!("s{i}")), nums(0..3));
    }
    assert_eq!(hub.stats().encoded, 3, "one encode per batch of one");
    hub.close();
}

#[test]
fn subscribers_whose_queues_differ_get_their_own_frame() {
    let (hub, spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default().id("early")).detach();
    publish(&hub, "t", 0);
    sub(&hub, "t", SubscribeOptions::default().id("late")).detach();
    sub(&hub, "t", SubscribeOptions::default().id("late2")).detach();
    publish(&hub, "t", 1);
    turn(&hub);
    assert_eq!(received(&spy, "early"), nums(0..2));
    assert_eq!(received(&spy, "late"), nums(1..2));
    let late = &spy.frames_for("late")[0];
    let late2 = &spy.frames_for("late2")[0];
    assert_eq!(
        late.as_ptr(),
        late2.as_ptr(),
        "identical batches still share"
    );
    assert_eq!(hub.stats().encoded, 2);
}

#[test]
fn a_codec_override_gets_its_own_shared_frame() {
    let (hub, spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default().id("j1")).detach();
    sub(
        &hub,
        "t",
        SubscribeOptions::default().id("n1").codec(Codec::Ndjson),
    )
    .detach();
    sub(
        &hub,
        "t",
        SubscribeOptions::default().id("n2").codec(Codec::Ndjson),
    )
    .detach();
    publish(&hub, "t", 1);
    publish(&hub, "t", 2);
    turn(&hub);
    assert_eq!(hub.stats().encoded, 2);
    let n1 = &spy.frames_for("n1")[0];
    assert_eq!(&n1[..], b"1\n2\n");
    assert_eq!(n1.as_ptr(), spy.frames_for("n2")[0].as_ptr());
}

#[test]
fn raw_codec_sends_one_message_per_frame() {
    let (hub, spy) = manual(HubOptions::default().codec(Codec::Raw));
    sub(&hub, "t", SubscribeOptions::default().id("a").max_batch(1)).detach();
    hub.publish(
        "t",
        Message::binary(vec![1u8, 2]),
        PublishOptions::default(),
    )
    .unwrap();
    hub.publish("t", Message::binary(vec![3u8]), PublishOptions::default())
        .unwrap();
    turn(&hub);
    let frames = spy.frames_for("a");
    assert_eq!(frames.len(), 2);
    assert_eq!(frame::decode(&frames[0]).unwrap().payload(), &[1, 2]);
    assert_eq!(frame::decode(&frames[1]).unwrap().payload(), &[3]);
}

#[test]
fn encode_failure_is_counted_in_dropped_and_reported_never_requeued() {
    let (opts, errors) = with_errors(HubOptions::default());
    let (hub, spy) = manual(opts);
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    hub.publish("t", Message::binary(vec![0xff]), PublishOptions::default())
        .unwrap();
    let r = hub.flush();
    assert_eq!(r, Ok(()), "flush resolves, it does not spin");
    assert!(spy.frames().is_empty());
    let s = hub.stats();
    assert_eq!(s.dropped, 1);
    assert_eq!(s.list[0].queued, 0, "not requeued");
    let errs = errors.lock().unwrap().clone();
    assert!(
        matches!(&errs[0], (DeliveryError::Encode { codec: "json", messages: 1, .. }, Some(id)) if id == "a")
    );
    hub.flush().unwrap();
    assert_eq!(errors.lock().unwrap().len(), 1);
}

#[test]
fn a_binary_message_under_a_text_codec_is_dropped_alone_and_its_batch_goes_on() {
    for codec in [Codec::Json, Codec::Ndjson] {
        let (opts, errors) = with_errors(HubOptions::default().codec(codec));
        let (hub, spy) = manual(opts);
        for id in ["a", "b"] {
            sub(&hub, "t", SubscribeOptions::default().id(id)).detach();
        }
        hub.publish_json("t", &1).unwrap();
        hub.publish("t", Message::binary(vec![0xff]), PublishOptions::default())
            .unwrap();
        hub.publish_json("t", &3).unwrap();
        hub.flush().unwrap();
        for id in ["a", "b"] {
            let frames = spy.frames_for(id);
            assert_eq!(
                frames.len(),
                1,
                "{codec:?} {id}: one frame of the two JSON messages"
            );
            let texts: Vec<Vec<u8>> = match codec {
                Codec::Json => frame::decode(&frames[0])
                    .unwrap()
                    .json_messages()
                    .unwrap()
                    .into_iter()
                    .map(<[u8]>::to_vec)
                    .collect(),
                _ => frames[0]
                    .split(|&b| b == b'\n')
                    .filter(|l| !l.is_empty())
                    .map(<[u8]>::to_vec)
                    .collect(),
            };
            assert_eq!(texts, [b"1".to_vec(), b"3".to_vec()], "{codec:?} {id}");
        }
        let s = hub.stats();
        assert_eq!(
            s.dropped, 2,
            "{codec:?}: the binary message, once per subscriber"
        );
        assert_eq!(s.delivered, 4, "{codec:?}");
        let errs = errors.lock().unwrap().clone();
        assert_eq!(errs.len(), 2, "{codec:?}: {errs:?}");
        assert!(
            errs.iter()
                .all(|(e, _)| matches!(e, DeliveryError::Encode { messages: 1, .. })),
            "{errs:?}"
        );
    }
}

// ---- delivery ----------------------------------------------------------------------------------

#[test]
fn one_frame_in_flight_per_subscriber() {
    let (hub, spy) = manual(HubOptions::default());
    spy.set_mode(SpyMode::Pending);
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    publish(&hub, "t", 0);
    turn(&hub);
    assert_eq!(spy.sends(), 1);
    publish(&hub, "t", 1);
    publish(&hub, "t", 2);
    turn(&hub);
    assert_eq!(
        spy.sends(),
        1,
        "no second frame while the first is outstanding"
    );
    assert!(hub.stats().list[0].in_flight);
    spy.set_mode(SpyMode::Accept);
    assert!(spy.complete_next(Ok(())));
    assert!(!hub.stats().list[0].in_flight);
    assert!(
        hub.poll_timeout().is_some(),
        "the completion woke the drainer"
    );
    turn(&hub);
    assert_eq!(spy.sends(), 2);
    assert_eq!(
        received(&spy, "a"),
        nums(0..3),
        "work that waited was neither dropped nor reordered"
    );
}

#[test]
fn frames_reach_a_subscriber_in_publish_order() {
    let (hub, spy) = manual(HubOptions::default());
    sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .id("a")
            .max_batch(3)
            .max_queue(1000),
    )
    .detach();
    let mut next = 0;
    for round in 0..20 {
        spy.set_mode(if round % 3 == 0 {
            SpyMode::Pending
        } else {
            SpyMode::Accept
        });
        for _ in 0..(round % 7) {
            publish(&hub, "t", next);
            next += 1;
        }
        turn(&hub);
        if round % 2 == 1 {
            spy.set_mode(SpyMode::Accept);
            spy.complete_all();
        }
    }
    spy.set_mode(SpyMode::Accept);
    spy.complete_all();
    hub.flush().unwrap();
    assert_eq!(received(&spy, "a"), nums(0..next));
}

#[test]
fn handler_runs_after_the_transport_accepted_the_batch() {
    let (hub, spy) = manual(HubOptions::default());
    spy.set_mode(SpyMode::Pending);
    let (seen, handler) = recorder();
    hub.subscribe("t", handler, SubscribeOptions::default().id("a"))
        .unwrap()
        .detach();
    publish(&hub, "t", 1);
    publish(&hub, "t", 2);
    turn(&hub);
    assert_eq!(spy.sends(), 1);
    assert!(
        seen.lock().unwrap().is_empty(),
        "not before the transport took it"
    );
    spy.complete_next(Ok(()));
    assert_eq!(*seen.lock().unwrap(), ["1", "2"]);
}

#[test]
fn handler_is_not_run_for_a_failed_send() {
    let (hub, spy) = manual(HubOptions::default());
    spy.set_mode(SpyMode::Pending);
    let (seen, handler) = recorder();
    hub.subscribe("t", handler, SubscribeOptions::default().id("a"))
        .unwrap()
        .detach();
    publish(&hub, "t", 1);
    turn(&hub);
    spy.complete_next(Err(SendError::Closed));
    assert!(seen.lock().unwrap().is_empty());
    assert!(!hub.stats().list[0].in_flight);
}

#[test]
fn panicking_handler_is_reported_and_isolated() {
    let (opts, errors) = with_errors(HubOptions::default());
    let (hub, spy) = manual(opts);
    hub.subscribe(
        "t",
        |_| panic!("boom"),
        SubscribeOptions::default().id("bad"),
    )
    .unwrap()
    .detach();
    let (seen, handler) = recorder();
    hub.subscribe("t", handler, SubscribeOptions::default().id("good"))
        .unwrap()
        .detach();
    publish(&hub, "t", 1);
    turn(&hub);
    assert_eq!(*seen.lock().unwrap(), ["1"]);
    assert_eq!(spy.frames().len(), 2);
    let errs = errors.lock().unwrap().clone();
    assert!(
        matches!(&errs[..], [(DeliveryError::HandlerPanicked { id, message }, Some(s))] if id == "bad" && message == "boom" && s == "bad")
    );
    publish(&hub, "t", 2);
    turn(&hub);
    assert_eq!(*seen.lock().unwrap(), ["1", "2"], "the hub keeps working");
}

#[test]
fn failing_send_is_reported_and_isolated() {
    let (opts, errors) = with_errors(HubOptions::default());
    let (hub, spy) = manual(opts);
    spy.set_mode_for("bad", SpyMode::Fail("socket reset".into()));
    sub(&hub, "t", SubscribeOptions::default().id("bad")).detach();
    sub(&hub, "t", SubscribeOptions::default().id("good")).detach();
    publish(&hub, "t", 1);
    turn(&hub);
    assert_eq!(received(&spy, "good"), ["1"]);
    let errs = errors.lock().unwrap().clone();
    assert_eq!(errs.len(), 1);
    assert!(
        matches!(&errs[0], (DeliveryError::SendFailed { id, error: SendError::Refused(why) }, _) if id == "bad" && why == "socket reset")
    );
}

#[test]
fn panicking_sink_is_reported_and_isolated() {
    let (opts, errors) = with_errors(HubOptions::default());
    let (hub, spy) = manual(opts);
    spy.set_mode_for("bad", SpyMode::Panic);
    sub(&hub, "t", SubscribeOptions::default().id("bad")).detach();
    sub(&hub, "t", SubscribeOptions::default().id("good")).detach();
    publish(&hub, "t", 1);
    turn(&hub);
    assert_eq!(received(&spy, "good"), ["1"]);
    assert!(
        matches!(&errors.lock().unwrap()[0], (DeliveryError::SinkPanicked { id, .. }, _) if id == "bad")
    );
    assert!(!hub.stats().list.iter().any(|s| s.in_flight));
}

// ---- retained log ------------------------------------------------------------------------------

fn retain(hub: &Hub, topic: &str, n: i64) -> usize {
    hub.publish(topic, json(n), PublishOptions::default().retain(true))
        .unwrap()
}

#[test]
fn retained_messages_are_replayed_in_order_to_a_new_subscriber() {
    let (hub, spy) = manual(HubOptions::default());
    assert_eq!(
        retain(&hub, "t", 0),
        0,
        "publishing with no subscribers is the case retain exists for"
    );
    retain(&hub, "t", 1);
    publish(&hub, "t", 99); // not retained
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    publish(&hub, "t", 2);
    turn(&hub);
    assert_eq!(received(&spy, "a"), ["0", "1", "2"]);
}

#[test]
fn a_retained_publish_racing_the_first_subscribe_goes_out_at_the_next_turn() {
    // The publish finds no topic and makes it; a subscribe may make it first. Either way the
    // message reaches the subscriber at the next turn. A third thread keeps the topics busy to
    // widen the window between the two.
    for i in 0..1000 {
        let (hub, spy) = manual(HubOptions::default());
        let go = std::sync::Barrier::new(3);
        std::thread::scope(|s| {
            s.spawn(|| {
                go.wait();
                sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
            });
            s.spawn(|| {
                go.wait();
                retain(&hub, "t", 1);
            });
            s.spawn(|| {
                go.wait();
                for n in 0..50 {
                    publish(&hub, "other", n);
                }
            });
        });
        turn(&hub);
        assert_eq!(received(&spy, "a"), ["1"], "round {i}: {:?}", hub.stats());
    }
}

#[test]
fn retained_log_keeps_the_last_32_per_topic() {
    let (hub, spy) = manual(HubOptions::default());
    for i in 0..40 {
        retain(&hub, "t", i);
    }
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    turn(&hub);
    assert_eq!(received(&spy, "a"), nums(8..40));
}

#[test]
fn retained_replay_goes_through_the_subscriber_queue_and_policy() {
    let (hub, spy) = manual(HubOptions::default());
    for i in 0..10 {
        retain(&hub, "t", i);
    }
    sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .id("newest")
            .max_queue(4)
            .slow_consumer(SlowConsumer::DropNewest),
    )
    .detach();
    sub(
        &hub,
        "t",
        SubscribeOptions::default().id("oldest").max_queue(4),
    )
    .detach();
    sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .id("cut")
            .max_queue(4)
            .slow_consumer(SlowConsumer::Disconnect),
    )
    .detach();
    turn(&hub);
    assert_eq!(received(&spy, "newest"), nums(0..4));
    assert_eq!(received(&spy, "oldest"), nums(6..10));
    assert!(spy.frames_for("cut").is_empty());
    assert_eq!(
        spy.closes(),
        vec![("cut".to_owned(), CloseReason::SlowConsumer)]
    );
    let s = hub.stats();
    assert_eq!(s.disconnected, 1);
    assert_eq!(
        s.dropped,
        6 + 6 + 5,
        "6 refused, 6 evicted, 4 discarded and 1 refused on disconnect"
    );
}

#[test]
fn a_retained_replay_and_the_live_messages_queued_behind_it_go_out_as_one_batch_for_every_policy() {
    for policy in [
        SlowConsumer::DropOldest,
        SlowConsumer::DropNewest,
        SlowConsumer::Disconnect,
    ] {
        let (hub, spy) = manual(HubOptions::default().batch(false));
        for i in 0..3 {
            retain(&hub, "t", i);
        }
        sub(
            &hub,
            "t",
            SubscribeOptions::default().id("a").slow_consumer(policy),
        )
        .detach();
        for i in 3..6 {
            publish(&hub, "t", i);
        }
        assert_eq!(hub.stats().list[0].queued, 6, "{policy:?}");
        hub.flush().unwrap();
        let frames = spy.frames_for("a");
        assert_eq!(
            frames.len(),
            1,
            "{policy:?}: one frame of what the queue holds"
        );
        assert_eq!(received(&spy, "a"), nums(0..6), "{policy:?}");
    }
    // Up to max_batch: the replay first, then the live ones.
    let (hub, spy) = manual(HubOptions::default().batch(false));
    for i in 0..3 {
        retain(&hub, "t", i);
    }
    sub(&hub, "t", SubscribeOptions::default().id("a").max_batch(4)).detach();
    for i in 3..6 {
        publish(&hub, "t", i);
    }
    hub.flush().unwrap();
    let batches: Vec<Vec<String>> = spy.frames_for("a").iter().map(messages).collect();
    assert_eq!(batches, [nums(0..4), nums(4..6)]);
}

#[test]
fn a_panicking_accounting_callback_is_reported_and_flush_still_succeeds() {
    let (opts, errors) = with_errors(HubOptions::default().batch(false));
    let (hub, spy) = manual(opts);
    sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .id("a")
            .bytes_acknowledged(|_, _| panic!("bad gauge")),
    )
    .detach();
    publish(&hub, "t", 1);
    assert_eq!(
        hub.flush(),
        Ok(()),
        "a bad accounting callback is no delivery failure"
    );
    assert_eq!(received(&spy, "a"), ["1"]);
    assert_eq!(errors.lock().unwrap().len(), 1);
    assert_eq!(hub.shutdown(), Ok(()));
}

#[test]
fn retained_replay_is_not_counted_in_published() {
    let (hub, _spy) = manual(HubOptions::default());
    retain(&hub, "t", 0);
    retain(&hub, "t", 1);
    for _ in 0..5 {
        sub(&hub, "t", SubscribeOptions::default()).detach();
    }
    assert_eq!(hub.stats().published, 2);
}

#[test]
fn retained_log_is_released_when_the_last_subscriber_leaves() {
    let (hub, spy) = manual(HubOptions::default());
    let a = sub(&hub, "t", SubscribeOptions::default().id("a"));
    let b = sub(&hub, "t", SubscribeOptions::default().id("b"));
    retain(&hub, "t", 1);
    assert!(a.unsubscribe());
    sub(&hub, "t", SubscribeOptions::default().id("c")).detach();
    turn(&hub);
    assert_eq!(
        received(&spy, "c"),
        ["1"],
        "one leaving does not destroy the others' history"
    );
    assert!(b.unsubscribe());
    assert!(hub.unsubscribe("c"));
    assert_eq!(hub.stats().topics, 0);
    sub(&hub, "t", SubscribeOptions::default().id("d")).detach();
    turn(&hub);
    assert!(
        spy.frames_for("d").is_empty(),
        "the log went with the last subscriber"
    );
}

#[test]
fn retained_log_is_released_on_close() {
    let (hub, _spy) = manual(HubOptions::default());
    retain(&hub, "t", 1);
    let m = Message::json(String::from("[1]")).unwrap();
    let weak_probe = m.bytes().clone();
    hub.publish("u", m, PublishOptions::default().retain(true))
        .unwrap();
    assert_eq!(hub.stats().topics, 2);
    hub.close();
    assert_eq!(hub.stats().topics, 0);
    assert!(
        weak_probe.is_unique(),
        "the hub no longer holds the retained message"
    );
}

// ---- subscriber priority -------------------------------------------------------------------------

#[test]
fn subscriber_priority_decides_drain_order_ties_by_insertion() {
    let (hub, spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default().id("p0-first")).detach();
    sub(
        &hub,
        "t",
        SubscribeOptions::default().id("p10").priority(10),
    )
    .detach();
    sub(&hub, "t", SubscribeOptions::default().id("p0-second")).detach();
    sub(
        &hub,
        "t",
        SubscribeOptions::default().id("p-5").priority(-5),
    )
    .detach();
    sub(
        &hub,
        "t",
        SubscribeOptions::default().id("p10-second").priority(10),
    )
    .detach();
    publish(&hub, "t", 1);
    turn(&hub);
    let order: Vec<String> = spy.frames().into_iter().map(|f| f.subscriber).collect();
    assert_eq!(order, ["p10", "p10-second", "p0-first", "p0-second", "p-5"]);
    let prios: Vec<i32> = hub.stats().list.iter().map(|s| s.priority).collect();
    assert_eq!(prios, [10, 10, 0, 0, -5], "stats reflect priority back");
}

#[test]
fn subscriber_priority_is_not_weighted_or_decayed_across_turns() {
    let (hub, spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default().id("p0")).detach();
    sub(&hub, "t", SubscribeOptions::default().id("p1").priority(1)).detach();
    for round in 0..10 {
        publish(&hub, "t", round);
        turn(&hub);
    }
    let order: Vec<String> = spy.frames().into_iter().map(|f| f.subscriber).collect();
    let want: Vec<&str> = (0..10).flat_map(|_| ["p1", "p0"]).collect();
    assert_eq!(order, want, "the advantage is permanent, turn after turn");
}

// ---- flush ---------------------------------------------------------------------------------------

#[test]
fn flush_waits_for_sends_in_flight() {
    let (hub, spy) = manual(HubOptions::default());
    spy.set_mode(SpyMode::Pending);
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    publish(&hub, "t", 1);
    turn(&hub); // a send is in flight before flush starts
    publish(&hub, "t", 2);
    let returned = Arc::new(AtomicBool::new(false));
    let flusher = {
        let hub = hub.clone();
        let returned = Arc::clone(&returned);
        std::thread::spawn(move || {
            let r = hub.flush();
            returned.store(true, Ordering::SeqCst);
            r
        })
    };
    // Complete sends as they arrive until both messages went out. A flush that returns early
    // ends the loop (nothing would send the second message) and fails the last assertion.
    let mut completed = 0;
    while completed < 2 {
        if spy.pending() > 0 {
            assert!(
                !returned.load(Ordering::SeqCst),
                "flush returned with a send outstanding"
            );
            spy.complete_next(Ok(()));
            completed += 1;
        } else if flusher.is_finished() {
            break;
        } else {
            std::thread::yield_now();
        }
    }
    flusher.join().unwrap().unwrap();
    assert_eq!(
        received(&spy, "a"),
        ["1", "2"],
        "flush returned before every queue reached the transport"
    );
}

#[test]
fn flush_on_a_closed_hub_is_an_error() {
    let (hub, _spy) = manual(HubOptions::default());
    hub.close();
    assert_eq!(hub.flush(), Err(FlushError::Closed));
}

// ---- stats and presence ----------------------------------------------------------------------------

#[test]
fn stats_count_published_delivered_dropped_disconnected_encoded() {
    let (hub, _spy) = manual(HubOptions::default());
    sub(&hub, "t", SubscribeOptions::default().id("a").max_queue(2)).detach();
    sub(&hub, "t", SubscribeOptions::default().id("b")).detach();
    sub(
        &hub,
        "u",
        SubscribeOptions::default()
            .id("c")
            .max_queue(1)
            .slow_consumer(SlowConsumer::Disconnect),
    )
    .detach();
    for i in 0..3 {
        publish(&hub, "t", i);
    }
    publish(&hub, "u", 0);
    publish(&hub, "u", 1);
    turn(&hub);
    let s = hub.stats();
    assert_eq!(s.subscribers, 2);
    assert_eq!(s.topics, 1);
    assert_eq!(s.published, 5);
    assert_eq!(s.delivered, 2 + 3);
    assert_eq!(s.dropped, 1 + 2);
    assert_eq!(s.disconnected, 1);
    assert_eq!(s.encoded, 2, "a and b hold different batches");
}

#[test]
fn delivered_counts_a_batch_before_its_handler_sees_it() {
    let (hub, _spy) = manual(HubOptions::default());
    let seen = Arc::new(Mutex::new(None));
    let (h, s) = (hub.clone(), Arc::clone(&seen));
    hub.subscribe(
        "t",
        move |_: &Delivery<'_>| {
            *s.lock().unwrap() = Some(h.stats().delivered);
        },
        SubscribeOptions::default().id("a"),
    )
    .unwrap()
    .detach();
    publish(&hub, "t", 1);
    turn(&hub);
    assert_eq!(*seen.lock().unwrap(), Some(1), "offered, so delivered");
    hub.close();
}

#[test]
fn bytes_out_equals_the_sum_of_bytes_sent() {
    let (hub, spy) = manual(HubOptions::default());
    spy.set_mode_for("failing", SpyMode::Fail("no".into()));
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    sub(&hub, "t", SubscribeOptions::default().id("b")).detach();
    sub(&hub, "t", SubscribeOptions::default().id("failing")).detach();
    sub(&hub, "u", SubscribeOptions::default().id("c")).detach();
    publish(&hub, "t", 1);
    publish(&hub, "u", 22);
    turn(&hub);
    let s = hub.stats();
    assert_eq!(
        s.bytes_out,
        s.list.iter().map(|x| x.bytes_sent).sum::<u64>()
    );
    let by_id = |id: &str| s.list.iter().find(|x| x.id == id).unwrap().bytes_sent;
    assert_eq!(by_id("a"), spy.frames_for("a")[0].len() as u64);
    assert_eq!(by_id("a"), by_id("b"), "one shared frame, the same figure");
    assert_eq!(by_id("failing"), 0, "a send that failed produced nothing");
    assert_eq!(
        s.delivered, 4,
        "delivered counts messages offered, failed or not"
    );
    // The two still reconcile after a subscriber leaves and others receive more.
    assert!(hub.unsubscribe("b"));
    publish(&hub, "t", 333);
    turn(&hub);
    let s = hub.stats();
    assert_eq!(
        s.bytes_out,
        s.list.iter().map(|x| x.bytes_sent).sum::<u64>()
    );
    assert!(s.bytes_out > by_id("a") + by_id("c"));
}

#[test]
fn bytes_acknowledged_is_called_with_bytes_sent_per_subscriber() {
    let (hub, spy) = manual(HubOptions::default());
    let calls: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let c = Arc::clone(&calls);
    sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .id("a")
            .bytes_acknowledged(move |n, s| {
                c.lock().unwrap().push((s.id().to_owned(), n));
            }),
    )
    .detach();
    sub(&hub, "t", SubscribeOptions::default().id("b")).detach();
    publish(&hub, "t", 1);
    turn(&hub);
    publish(&hub, "t", 2);
    turn(&hub);
    let len = spy
        .frames_for("a")
        .iter()
        .map(|f| f.len() as u64)
        .collect::<Vec<_>>();
    assert_eq!(
        *calls.lock().unwrap(),
        vec![("a".to_owned(), len[0]), ("a".to_owned(), len[0] + len[1])]
    );
}

#[test]
fn panicking_bytes_acknowledged_is_reported_and_delivery_goes_on() {
    let (opts, errors) = with_errors(HubOptions::default());
    let (hub, _spy) = manual(opts);
    let (seen, handler) = recorder();
    hub.subscribe(
        "t",
        handler,
        SubscribeOptions::default()
            .id("a")
            .bytes_acknowledged(|_, _| panic!("bad gauge")),
    )
    .unwrap()
    .detach();
    publish(&hub, "t", 1);
    turn(&hub);
    assert_eq!(*seen.lock().unwrap(), ["1"]);
    assert!(
        matches!(&errors.lock().unwrap()[0], (DeliveryError::AckCallbackPanicked { id, .. }, _) if id == "a")
    );
}

#[test]
fn presence_is_a_snapshot_the_caller_cannot_mutate() {
    let (hub, _spy) = manual(HubOptions::default());
    sub(
        &hub,
        "room",
        SubscribeOptions::default()
            .id("a")
            .transport(Arc::new("socket-a")),
    )
    .detach();
    sub(&hub, "room", SubscribeOptions::default().id("b")).detach();
    sub(&hub, "lobby", SubscribeOptions::default().id("c")).detach();
    let mut p = hub.presence(Some("room"));
    assert_eq!(
        p.iter().map(|x| x.id.as_str()).collect::<Vec<_>>(),
        ["a", "b"]
    );
    assert_eq!(
        p[0].transport.as_ref().unwrap().downcast_ref::<&str>(),
        Some(&"socket-a")
    );
    p[0].id = "mallory".into();
    p.clear();
    assert_eq!(hub.presence(None).len(), 3);
    assert_eq!(hub.presence(Some("room"))[0].id, "a");
}

#[test]
fn presence_lists_only_live_subscribers_after_unsubscribe_disconnect_and_close() {
    let (hub, _spy) = manual(HubOptions::default());
    sub(&hub, "room", SubscribeOptions::default().id("stays")).detach();
    sub(&hub, "room", SubscribeOptions::default().id("leaves")).detach();
    sub(
        &hub,
        "room",
        SubscribeOptions::default()
            .id("slow")
            .max_queue(1)
            .slow_consumer(SlowConsumer::Disconnect),
    )
    .detach();
    let ids = |hub: &Hub| -> Vec<String> {
        hub.presence(Some("room"))
            .into_iter()
            .map(|p| p.id)
            .collect()
    };
    assert_eq!(ids(&hub), ["stays", "leaves", "slow"]);
    assert!(hub.unsubscribe("leaves"));
    publish(&hub, "room", 1);
    publish(&hub, "room", 2); // past slow's max_queue: disconnected
    assert_eq!(ids(&hub), ["stays"]);
    assert_eq!(hub.get_presence(None).len(), 1);
    hub.close();
    assert!(
        hub.presence(None).is_empty(),
        "a closed hub has no subscribers"
    );
}

#[test]
fn transport_context_reaches_the_sink() {
    #[derive(Debug)]
    struct Ctx(u32);
    #[derive(Debug, Default)]
    struct Seen(Mutex<Vec<u32>>);
    impl powerhub_plugin::Sink for Seen {
        fn send(
            &self,
            sub: &SubscriberRef,
            _f: Bytes,
            _d: powerhub_plugin::Completion,
        ) -> powerhub_plugin::SendOutcome {
            self.0
                .lock()
                .unwrap()
                .push(sub.transport::<Ctx>().unwrap().0);
            powerhub_plugin::SendOutcome::Accepted
        }
    }
    let seen = Arc::new(Seen::default());
    let hub = Hub::new(
        Arc::clone(&seen),
        HubOptions::default().driver(Driver::Manual),
    )
    .unwrap();
    sub(
        &hub,
        "t",
        SubscribeOptions::default().transport(Arc::new(Ctx(42))),
    )
    .detach();
    publish(&hub, "t", 1);
    turn(&hub);
    assert_eq!(*seen.0.lock().unwrap(), [42]);
}

#[test]
fn a_per_subscription_sink_overrides_the_hub_sink() {
    let (hub, hub_spy) = manual(HubOptions::default());
    let own = SpySink::new();
    sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .id("own")
            .sink(Arc::new(own.clone())),
    )
    .detach();
    sub(&hub, "t", SubscribeOptions::default().id("shared")).detach();
    publish(&hub, "t", 1);
    turn(&hub);
    assert_eq!(received(&own, "own"), ["1"]);
    assert!(hub_spy.frames_for("own").is_empty());
    assert_eq!(received(&hub_spy, "shared"), ["1"]);
    hub.close();
    assert_eq!(
        own.closes(),
        vec![("own".to_owned(), CloseReason::HubClosed)]
    );
}

#[test]
fn metrics_hook_is_called_after_a_turn() {
    let seen: Arc<Mutex<Vec<powerhub::hub::TurnMetrics>>> = Arc::default();
    let s = Arc::clone(&seen);
    let (hub, _spy) =
        manual(HubOptions::default().metrics(move |m| s.lock().unwrap().push(m.clone())));
    for _ in 0..3 {
        sub(&hub, "t", SubscribeOptions::default()).detach();
    }
    publish(&hub, "t", 1);
    publish(&hub, "t", 2);
    turn(&hub);
    turn(&hub); // nothing to do: no call
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        (
            seen[0].frames,
            seen[0].messages,
            seen[0].encoded,
            seen[0].published_total
        ),
        (3, 6, 1, 2)
    );
}

// ---- unsubscribe, close, shutdown ----------------------------------------------------------------------

#[test]
fn unsubscribe_by_id_or_handle_calls_the_close_adapter() {
    let (hub, spy) = manual(HubOptions::default());
    let a = sub(&hub, "t", SubscribeOptions::default().id("a"));
    sub(&hub, "t", SubscribeOptions::default().id("b")).detach();
    assert!(a.unsubscribe());
    assert!(!a.unsubscribe());
    assert!(hub.unsubscribe("b"));
    assert!(!hub.unsubscribe("b"));
    assert!(!hub.unsubscribe("nobody"));
    assert_eq!(
        spy.closes(),
        vec![
            ("a".to_owned(), CloseReason::Unsubscribe),
            ("b".to_owned(), CloseReason::Unsubscribe)
        ]
    );
    assert_eq!(publish(&hub, "t", 1), 0);
    // The id is free again.
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
}

#[test]
fn dropping_the_subscription_handle_unsubscribes() {
    let (hub, spy) = manual(HubOptions::default());
    drop(sub(&hub, "t", SubscribeOptions::default().id("a")));
    assert_eq!(publish(&hub, "t", 1), 0);
    assert!(spy
        .closes()
        .iter()
        .any(|(id, r)| id == "a" && *r == CloseReason::Unsubscribe));
    assert!(hub.presence(Some("t")).is_empty());
}

#[test]
fn a_detached_subscription_lives_until_unsubscribed_by_id() {
    let (hub, spy) = manual(HubOptions::default());
    assert_eq!(
        sub(&hub, "t", SubscribeOptions::default().id("a")).detach(),
        "a"
    );
    assert_eq!(publish(&hub, "t", 1), 1);
    turn(&hub);
    assert_eq!(received(&spy, "a"), ["1"]);
    assert!(hub.unsubscribe("a"));
    assert_eq!(publish(&hub, "t", 2), 0);
}

#[test]
fn close_is_not_graceful() {
    let (hub, spy) = manual(HubOptions::default().batch_delay(Duration::from_millis(50)));
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    publish(&hub, "t", 1);
    hub.turn(Instant::now());
    hub.close();
    assert!(spy.frames().is_empty(), "the pending batch was dropped");
    assert_eq!(
        hub.stats().published,
        1,
        "counted as published, never delivered"
    );
    assert_eq!(spy.closes(), vec![("a".to_owned(), CloseReason::HubClosed)]);
    assert_eq!(hub.stats().subscribers, 0);
    hub.close(); // idempotent
    assert_eq!(spy.closes().len(), 1);
}

#[test]
fn shutdown_flushes_then_closes() {
    let (hub, spy) = manual(HubOptions::default().batch_delay(Duration::from_millis(50)));
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    publish(&hub, "t", 1);
    hub.shutdown().unwrap();
    assert_eq!(received(&spy, "a"), ["1"]);
    assert_eq!(spy.closes(), vec![("a".to_owned(), CloseReason::HubClosed)]);
    assert!(hub.is_closed());
}

#[test]
fn shutdown_closes_even_when_a_send_fails_and_the_failure_is_reported_not_returned() {
    let (opts, errors) = with_errors(HubOptions::default());
    let (hub, spy) = manual(opts);
    spy.set_mode(SpyMode::Fail("down".into()));
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    publish(&hub, "t", 1);
    // The failing send was isolated and reported; the queue reached its transport.
    assert_eq!(hub.shutdown(), Ok(()));
    assert_eq!(errors.lock().unwrap().len(), 1);
    assert!(hub.is_closed());
    assert_eq!(spy.closes(), vec![("a".to_owned(), CloseReason::HubClosed)]);
}

#[test]
fn subscribe_after_close_is_an_error() {
    let (hub, _spy) = manual(HubOptions::default());
    hub.close();
    assert_eq!(
        hub.subscribe("t", |_| {}, SubscribeOptions::default())
            .unwrap_err(),
        SubscribeError::Closed
    );
}

#[test]
fn dropping_the_last_hub_clone_closes_it() {
    let spy = SpySink::new();
    let hub = Hub::new(spy.clone(), HubOptions::default()).unwrap();
    let clone = hub.clone();
    let s = sub(&hub, "t", SubscribeOptions::default().id("a"));
    drop(hub);
    assert!(spy.closes().is_empty(), "a clone is still alive");
    drop(clone);
    assert_eq!(spy.closes(), vec![("a".to_owned(), CloseReason::HubClosed)]);
    assert!(!s.is_active());
    assert!(!s.unsubscribe());
}

#[test]
fn handlers_may_publish_back_into_the_hub() {
    let (hub, spy) = manual(HubOptions::default());
    let h = hub.clone();
    let count = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&count);
    hub.subscribe(
        "ping",
        move |_| {
            c.fetch_add(1, Ordering::SeqCst);
            h.publish_json("pong", &1).unwrap();
        },
        SubscribeOptions::default(),
    )
    .unwrap()
    .detach();
    sub(&hub, "pong", SubscribeOptions::default().id("p")).detach();
    publish(&hub, "ping", 0);
    hub.flush().unwrap();
    hub.flush().unwrap();
    assert_eq!(count.load(Ordering::SeqCst), 1);
    assert_eq!(received(&spy, "p"), ["1"]);
}

#[test]
fn handlers_and_close_adapters_may_subscribe_and_unsubscribe() {
    // A handler that unsubscribes itself and subscribes a newcomer, on both drivers.
    for driver in [Driver::Manual, Driver::Thread] {
        let spy = SpySink::new();
        let hub = Hub::new(spy.clone(), HubOptions::default().driver(driver)).unwrap();
        let h = hub.clone();
        hub.subscribe(
            "t",
            move |_| {
                h.unsubscribe("once");
                if let Ok(s) = h.subscribe("t", |_| {}, SubscribeOptions::default().id("late")) {
                    s.detach();
                }
            },
            SubscribeOptions::default().id("once"),
        )
        .unwrap()
        .detach();
        sub(&hub, "t", SubscribeOptions::default().id("other")).detach();
        publish(&hub, "t", 1);
        hub.flush().unwrap();
        publish(&hub, "t", 2);
        hub.flush().unwrap();
        assert_eq!(received(&spy, "once"), ["1"], "{driver:?}");
        assert_eq!(received(&spy, "other"), ["1", "2"], "{driver:?}");
        assert_eq!(received(&spy, "late"), ["2"], "{driver:?}");
        assert!(spy
            .closes()
            .contains(&("once".to_owned(), CloseReason::Unsubscribe)));
        hub.close();
    }
    // A close adapter that publishes, run by a publish that disconnects a slow consumer.
    #[derive(Debug)]
    struct Republish(Mutex<Option<Hub>>, SpySink);
    impl powerhub_plugin::Sink for Republish {
        fn send(
            &self,
            sub: &SubscriberRef,
            frame: Bytes,
            done: powerhub_plugin::Completion,
        ) -> powerhub_plugin::SendOutcome {
            self.1.send(sub, frame, done)
        }
        fn close(&self, sub: &SubscriberRef, reason: CloseReason) {
            self.1.close(sub, reason);
            if let Some(hub) = self.0.lock().unwrap().as_ref() {
                hub.publish_json("gone", &sub.id()).unwrap();
            }
        }
    }
    let spy = SpySink::new();
    let sink = Arc::new(Republish(Mutex::new(None), spy.clone()));
    let hub = Hub::new(
        Arc::clone(&sink),
        HubOptions::default().driver(Driver::Manual),
    )
    .unwrap();
    *sink.0.lock().unwrap() = Some(hub.clone());
    sub(
        &hub,
        "t",
        SubscribeOptions::default()
            .id("slow")
            .max_queue(1)
            .slow_consumer(SlowConsumer::Disconnect),
    )
    .detach();
    sub(&hub, "gone", SubscribeOptions::default().id("watcher")).detach();
    publish(&hub, "t", 1);
    publish(&hub, "t", 2); // disconnects `slow`; its close adapter publishes
    turn(&hub);
    assert_eq!(received(&spy, "watcher"), ["\"slow\""]);
    *sink.0.lock().unwrap() = None; // the sink no longer keeps the hub alive
}

/// A thread-driver hub whose handler on "t" unsubscribes itself, then takes 100 ms to return;
/// one publish; `flush` (once the handler signalled its unsubscribe, if `after_unsubscribe`)
/// must not return before the handler did: what a handler does before it returns belongs to
/// the flush, though its subscription is closed (and has left the hub's list).
fn flush_against_a_handler_that_unsubscribes_itself(after_unsubscribe: bool) {
    let hub = Hub::new(SpySink::new(), HubOptions::default().driver(Driver::Thread)).unwrap();
    let h = hub.clone();
    let (gone_tx, gone_rx) = std::sync::mpsc::sync_channel::<()>(1);
    let returned = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&returned);
    hub.subscribe(
        "t",
        move |_| {
            h.unsubscribe("once");
            let _ = gone_tx.try_send(());
            std::thread::sleep(Duration::from_millis(100));
            r.store(true, Ordering::SeqCst);
        },
        SubscribeOptions::default().id("once"),
    )
    .unwrap()
    .detach();
    publish(&hub, "t", 1);
    if after_unsubscribe {
        gone_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the handler ran");
    }
    hub.flush().unwrap();
    assert!(
        returned.load(Ordering::SeqCst),
        "flush returned while the handler ran"
    );
    hub.close();
}

#[test]
fn a_flush_begun_after_a_handler_unsubscribed_itself_waits_for_it_to_return() {
    flush_against_a_handler_that_unsubscribes_itself(true);
}

#[test]
fn flush_waits_for_a_handler_that_unsubscribed_itself_to_return() {
    flush_against_a_handler_that_unsubscribes_itself(false);
}

#[test]
fn flush_from_inside_a_handler_is_an_error_not_a_deadlock() {
    let (opts, _errors) = with_errors(HubOptions::default());
    let (hub, _spy) = manual(opts);
    let h = hub.clone();
    let got: Arc<Mutex<Option<Result<(), FlushError>>>> = Arc::default();
    let g = Arc::clone(&got);
    hub.subscribe(
        "t",
        move |_| *g.lock().unwrap() = Some(h.flush()),
        SubscribeOptions::default(),
    )
    .unwrap()
    .detach();
    publish(&hub, "t", 1);
    turn(&hub);
    assert_eq!(*got.lock().unwrap(), Some(Err(FlushError::InsideDrain)));
}

#[test]
fn a_pending_send_completed_inside_send_is_finished_once() {
    /// Completes inside `send`, then reports `Pending`: with `Ok` for "ok", with an error
    /// otherwise.
    #[derive(Debug)]
    struct Eager;
    impl powerhub_plugin::Sink for Eager {
        fn send(
            &self,
            sub: &SubscriberRef,
            _f: Bytes,
            done: powerhub_plugin::Completion,
        ) -> powerhub_plugin::SendOutcome {
            if sub.id() == "ok" {
                done.complete(Ok(()));
            } else {
                done.complete(Err(SendError::Refused("late refusal".into())));
            }
            powerhub_plugin::SendOutcome::Pending
        }
    }
    let (opts, errors) = with_errors(HubOptions::default().driver(Driver::Manual));
    let hub = Hub::new(Eager, opts).unwrap();
    let (seen_ok, handler_ok) = recorder();
    let (seen_err, handler_err) = recorder();
    hub.subscribe("t", handler_ok, SubscribeOptions::default().id("ok"))
        .unwrap()
        .detach();
    hub.subscribe("t", handler_err, SubscribeOptions::default().id("err"))
        .unwrap()
        .detach();
    publish(&hub, "t", 1);
    publish(&hub, "t", 2);
    turn(&hub);
    assert_eq!(*seen_ok.lock().unwrap(), ["1", "2"]);
    assert!(seen_err.lock().unwrap().is_empty());
    let errs = errors.lock().unwrap().clone();
    assert!(
        matches!(&errs[..], [(DeliveryError::SendFailed { id, error: SendError::Refused(_) }, _)] if id == "err")
    );
    assert!(hub.stats().list.iter().all(|s| !s.in_flight));
    publish(&hub, "t", 3);
    // The refusal is reported (a second one now); the flush still succeeds.
    hub.flush().unwrap();
    assert_eq!(*seen_ok.lock().unwrap(), ["1", "2", "3"]);
    assert_eq!(errors.lock().unwrap().len(), 2);
}

#[test]
fn a_completion_kept_past_an_accepted_send_is_ignored() {
    #[derive(Debug, Default)]
    struct Keeper(Mutex<Vec<powerhub_plugin::Completion>>);
    impl powerhub_plugin::Sink for Keeper {
        fn send(
            &self,
            _s: &SubscriberRef,
            _f: Bytes,
            done: powerhub_plugin::Completion,
        ) -> powerhub_plugin::SendOutcome {
            self.0.lock().unwrap().push(done);
            powerhub_plugin::SendOutcome::Accepted
        }
    }
    let keeper = Arc::new(Keeper::default());
    let hub = Hub::new(
        Arc::clone(&keeper),
        HubOptions::default().driver(Driver::Manual),
    )
    .unwrap();
    let (seen, handler) = recorder();
    hub.subscribe("t", handler, SubscribeOptions::default())
        .unwrap()
        .detach();
    publish(&hub, "t", 1);
    turn(&hub);
    publish(&hub, "t", 2);
    turn(&hub);
    for done in keeper.0.lock().unwrap().drain(..) {
        done.complete(Err(SendError::Closed));
    }
    assert_eq!(*seen.lock().unwrap(), ["1", "2"], "each batch handled once");
    assert!(!hub.stats().list[0].in_flight);
    hub.flush().unwrap();
}

#[test]
fn concurrent_publishers_keep_each_publishers_order_and_lose_nothing_within_max_queue() {
    let (sink, rx) = powerhub::transport::channel(64);
    let hub = Hub::new(sink, HubOptions::default()).unwrap();
    for id in ["a", "b", "c"] {
        sub(
            &hub,
            "t",
            SubscribeOptions::default().id(id).max_queue(20_000),
        )
        .detach();
    }
    let reader = std::thread::spawn(move || {
        let mut got: std::collections::HashMap<String, Vec<(u64, u64)>> = Default::default();
        for ev in rx {
            if let powerhub::transport::ChannelEvent::Frame { subscriber, frame } = ev {
                for m in messages(&frame) {
                    let v: Vec<u64> = serde_json::from_str(&m).unwrap();
                    got.entry(subscriber.id().to_owned())
                        .or_default()
                        .push((v[0], v[1]));
                }
            }
        }
        got
    });
    let publishers: Vec<_> = (0..4u64)
        .map(|p| {
            let hub = hub.clone();
            std::thread::spawn(move || {
                for n in 0..2000u64 {
                    hub.publish("t", json([p, n]), PublishOptions::default())
                        .unwrap();
                }
            })
        })
        .collect();
    for p in publishers {
        p.join().unwrap();
    }
    hub.shutdown().unwrap();
    let s = hub.stats();
    assert_eq!(s.published, 8000);
    drop(hub);
    let got = reader.join().unwrap();
    for id in ["a", "b", "c"] {
        let msgs = &got[id];
        assert_eq!(msgs.len(), 8000, "{id}");
        for p in 0..4 {
            let seq: Vec<u64> = msgs.iter().filter(|m| m.0 == p).map(|m| m.1).collect();
            assert_eq!(seq, (0..2000).collect::<Vec<_>>(), "{id} publisher {p}");
        }
    }
}

#[test]
fn unsubscribing_or_closing_releases_a_flush_held_by_a_stalled_transport() {
    for close in [false, true] {
        let (hub, spy) = manual(HubOptions::default());
        spy.set_mode(SpyMode::Pending);
        sub(&hub, "t", SubscribeOptions::default().id("stalled")).detach();
        publish(&hub, "t", 1);
        let flusher = {
            let hub = hub.clone();
            std::thread::spawn(move || hub.flush())
        };
        // A flush that returns without sending ends the wait and fails the assertions below.
        while spy.pending() == 0 && !flusher.is_finished() {
            std::thread::yield_now();
        }
        assert_eq!(spy.pending(), 1, "flush handed the frame to the transport");
        if close {
            hub.close();
            assert_eq!(flusher.join().unwrap(), Err(FlushError::Closed));
        } else {
            assert!(hub.unsubscribe("stalled"));
            assert_eq!(flusher.join().unwrap(), Ok(()));
        }
    }
}

#[test]
fn closing_from_a_handler_during_flush_does_not_deadlock() {
    let spy = SpySink::new();
    let hub = Hub::new(spy.clone(), HubOptions::default()).unwrap();
    let h = hub.clone();
    hub.subscribe("t", move |_| h.close(), SubscribeOptions::default().id("a"))
        .unwrap()
        .detach();
    publish(&hub, "t", 1);
    // Whichever thread drains (the hub's, or this one in flush), the close must not wait for it.
    let _ = hub.flush();
    hub.close();
    assert!(hub.is_closed());
    // Whichever close won, this one returns after the adapters were told.
    assert_eq!(spy.closes(), vec![("a".to_owned(), CloseReason::HubClosed)]);
}

/// A transport whose close adapter takes its time: it says when it started, then records the
/// close 200 ms later.
#[derive(Debug, Default)]
struct SlowCloseSink {
    entered: AtomicBool,
    closed: Mutex<Vec<String>>,
}

impl powerhub_plugin::Sink for SlowCloseSink {
    fn send(
        &self,
        _: &SubscriberRef,
        _: powerhub_plugin::Frame,
        _: powerhub_plugin::Completion,
    ) -> powerhub_plugin::SendOutcome {
        powerhub_plugin::SendOutcome::Accepted
    }

    fn close(&self, sub: &SubscriberRef, _: CloseReason) {
        self.entered.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(200));
        self.closed.lock().unwrap().push(sub.id().to_owned());
    }
}

/// `close()` detaches everything and calls the close adapter: a `close()` that loses the race
/// to another thread's returns only once the winner has told every adapter, so a caller never
/// sees a hub that says it is closed while its subscribers are still being closed.
#[test]
fn a_close_that_loses_the_race_returns_after_the_adapters_were_told() {
    let sink = Arc::new(SlowCloseSink::default());
    let hub = Hub::new(Arc::clone(&sink), HubOptions::default()).unwrap();
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    let winner = {
        let hub = hub.clone();
        std::thread::spawn(move || hub.close())
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sink.entered.load(Ordering::SeqCst) {
        assert!(
            Instant::now() < deadline,
            "the first close never reached the adapter"
        );
        std::thread::yield_now();
    }
    hub.close();
    assert_eq!(
        *sink.closed.lock().unwrap(),
        ["a"],
        "returned before the adapter finished"
    );
    winner.join().unwrap();
}

#[test]
fn a_hub_takes_an_arc_dyn_sink() {
    let spy = SpySink::new();
    let sink: Arc<dyn powerhub_plugin::Sink> = Arc::new(spy.clone());
    let hub = Hub::new(sink, HubOptions::default().driver(Driver::Manual)).unwrap();
    sub(&hub, "t", SubscribeOptions::default().id("a")).detach();
    publish(&hub, "t", 1);
    turn(&hub);
    assert_eq!(received(&spy, "a"), ["1"]);
}

/// Driver::Manual: the owner is told once per idle-to-busy change (so an event loop can sleep
/// while the hub is idle), again when a completion leaves queued work behind, and never while
/// work is already pending.
#[test]
fn manual_driver_on_work_fires_once_per_idle_to_busy_change() {
    let wakes = Arc::new(AtomicUsize::new(0));
    let w = Arc::clone(&wakes);
    let (hub, spy) = manual(HubOptions::default().on_work(move || {
        w.fetch_add(1, Ordering::SeqCst);
    }));
    let _a = hub
        .subscribe("t", |_| {}, SubscribeOptions::default().id("a"))
        .unwrap();
    assert_eq!(wakes.load(Ordering::SeqCst), 0, "subscribing is no work");
    hub.publish("t", json(1), PublishOptions::default())
        .unwrap();
    hub.publish("t", json(2), PublishOptions::default())
        .unwrap();
    assert_eq!(
        wakes.load(Ordering::SeqCst),
        1,
        "second publish while pending"
    );
    assert!(hub.poll_timeout().is_some());
    spy.set_mode(SpyMode::Pending);
    turn(&hub);
    assert_eq!(hub.poll_timeout(), None, "the turn took all the work");
    // Published while the send is pending: a wake-up, but the subscriber is in flight.
    hub.publish("t", json(3), PublishOptions::default())
        .unwrap();
    assert_eq!(wakes.load(Ordering::SeqCst), 2);
    turn(&hub);
    assert_eq!(spy.frames().len(), 1, "one send outstanding per subscriber");
    // The completion leaves message 3 queued: the owner hears of it.
    spy.set_mode(SpyMode::Accept);
    assert_eq!(spy.complete_all(), 1);
    assert_eq!(wakes.load(Ordering::SeqCst), 3);
    turn(&hub);
    assert_eq!(spy.frames().len(), 2);
    assert_eq!(hub.poll_timeout(), None);
}

/// The hooks run under `catch_unwind`: an `on_work` hook that panics is stopped there, so the
/// publish, the subscribe that replayed a retained message and the completion that called it
/// finish their work (a subscription returned, a flush woken).
#[test]
fn a_panicking_on_work_hook_leaves_publish_subscribe_and_completions_whole() {
    let (hub, spy) = manual(HubOptions::default().on_work(|| panic!("hook")));
    hub.publish("t", json(0), PublishOptions::default().retain(true))
        .unwrap();
    let _a = sub(&hub, "t", SubscribeOptions::default().id("a"));
    assert_eq!(hub.presence(Some("t")).len(), 1);
    spy.set_mode(SpyMode::Pending);
    assert_eq!(
        hub.publish("t", json(1), PublishOptions::default())
            .unwrap(),
        1
    );
    turn(&hub);
    hub.publish("t", json(2), PublishOptions::default())
        .unwrap();
    spy.set_mode(SpyMode::Accept);
    assert_eq!(spy.complete_all(), 1, "the completion returned");
    hub.flush().unwrap();
    assert_eq!(received(&spy, "a"), nums(0..3));
}

/// The ready list: a turn visits only the topics published to since the last one, so a topic
/// flagged while a pass runs must be visited by the next. Publishers on several topics race the
/// drain thread, and every subscriber receives everything without a flush (the receive
/// timeout only guards against a hang: a lost topic would stall its subscribers forever).
#[test]
fn every_topic_published_to_during_a_turn_is_visited_by_a_later_turn() {
    let (sink, rx) = powerhub::transport::channel(4096);
    let hub = Hub::new(sink, HubOptions::default()).unwrap();
    let topics = ["t0", "t1", "t2", "t3", "t4"];
    let mut _subs = Vec::new();
    for t in topics {
        for k in 0..2 {
            _subs.push(sub(
                &hub,
                t,
                SubscribeOptions::default()
                    .id(format!("{t}-{k}"))
                    .max_queue(20_000),
            ));
        }
    }
    let per_publisher = 3000u64;
    let publishers: Vec<_> = (0..3u64)
        .map(|p| {
            let hub = hub.clone();
            std::thread::spawn(move || {
                for n in 0..per_publisher {
                    let t = topics[((p + n) % 5) as usize];
                    hub.publish(t, json([p, n]), PublishOptions::default())
                        .unwrap();
                }
            })
        })
        .collect();
    let expected = |t: &str| {
        let i = topics.iter().position(|x| *x == t).unwrap() as u64;
        (0..3u64)
            .map(|p| (0..per_publisher).filter(|n| (p + n) % 5 == i).count())
            .sum::<usize>()
    };
    let mut got: std::collections::HashMap<String, usize> = Default::default();
    let total: usize = topics.iter().map(|t| 2 * expected(t)).sum();
    let mut seen = 0;
    while seen < total {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(powerhub::transport::ChannelEvent::Frame { subscriber, frame }) => {
                let n = messages(&frame).len();
                *got.entry(subscriber.id().to_owned()).or_default() += n;
                seen += n;
            }
            Ok(_) => {}
            Err(e) => panic!("stalled after {seen} of {total} deliveries ({e:?}): {got:?}"),
        }
    }
    for p in publishers {
        p.join().unwrap();
    }
    for t in topics {
        for k in 0..2 {
            assert_eq!(got[&format!("{t}-{k}")], expected(t), "{t}-{k}");
        }
    }
}
