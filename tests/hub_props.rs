//! Property tests: each slow-consumer policy, in FIFO and message-priority mode, against a plain
//! model of a bounded queue. After every step of a random publish/drain sequence the hub's queue
//! length, drop and disconnect counts match the model, every publish returns what the model
//! says, and the messages delivered are exactly the model's, in the model's order.

use std::time::Instant;

use powerhub::hub::{
    Driver, Hub, HubOptions, Message, PublishOptions, SlowConsumer, SubscribeOptions,
};
use powerhub::transport::{SpyMode, SpySink};
use powerhub_plugin::frame;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// Publish a message with this priority (ignored in FIFO mode).
    Publish(i32),
    /// Let the hub send one batch (the spy holds it pending), then complete it.
    Drain,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![3 => (-2i32..3).prop_map(Op::Publish), 1 => Just(Op::Drain)]
}

fn policy() -> impl Strategy<Value = SlowConsumer> {
    prop_oneof![
        Just(SlowConsumer::DropOldest),
        Just(SlowConsumer::DropNewest),
        Just(SlowConsumer::Disconnect)
    ]
}

/// The plain model: a vector of (priority, seq).
#[derive(Debug, Default)]
struct Model {
    queue: Vec<(i32, u64)>,
    cap: usize,
    policy: Option<SlowConsumer>,
    priority_mode: bool,
    dropped: u64,
    disconnected: bool,
    delivered: Vec<u64>,
}

impl Model {
    fn publish(&mut self, priority: i32, seq: u64) -> usize {
        if self.disconnected {
            return 0;
        }
        let priority = if self.priority_mode { priority } else { 0 };
        if self.queue.len() < self.cap {
            self.queue.push((priority, seq));
            return 1;
        }
        match self.policy.unwrap() {
            SlowConsumer::DropOldest if self.cap == 0 => {
                self.dropped += 1;
                0
            }
            SlowConsumer::DropOldest => {
                let victim = if self.priority_mode {
                    // Furthest from delivery: lowest priority, newest among equals.
                    let (i, _) = self
                        .queue
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, (p, s))| (*p, std::cmp::Reverse(*s)))
                        .unwrap();
                    i
                } else {
                    0
                };
                self.queue.remove(victim);
                self.dropped += 1;
                self.queue.push((priority, seq));
                1
            }
            SlowConsumer::DropNewest => {
                self.dropped += 1;
                0
            }
            SlowConsumer::Disconnect => {
                self.dropped += 1 + self.queue.len() as u64;
                self.queue.clear();
                self.disconnected = true;
                0
            }
        }
    }

    fn drain(&mut self, max_batch: usize) {
        if self.priority_mode {
            self.queue.sort_by_key(|(p, s)| (std::cmp::Reverse(*p), *s));
        }
        let n = max_batch.min(self.queue.len());
        self.delivered.extend(self.queue.drain(..n).map(|(_, s)| s));
    }
}

fn check(
    policy: SlowConsumer,
    priority_mode: bool,
    cap: usize,
    max_batch: usize,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let spy = SpySink::new();
    spy.set_mode(SpyMode::Pending);
    let hub = Hub::new(
        spy.clone(),
        HubOptions::default()
            .driver(Driver::Manual)
            .message_priority(priority_mode),
    )
    .unwrap();
    hub.subscribe(
        "t",
        |_| {},
        SubscribeOptions::default()
            .id("s")
            .max_queue(cap)
            .max_batch(max_batch)
            .slow_consumer(policy),
    )
    .unwrap()
    .detach();
    let mut model = Model {
        cap,
        policy: Some(policy),
        priority_mode,
        ..Model::default()
    };
    let mut seq = 0u64;
    for op in ops {
        match op {
            Op::Publish(p) => {
                let mut opts = PublishOptions::default();
                if priority_mode {
                    opts = opts.priority(*p);
                }
                let got = hub
                    .publish("t", Message::to_json(&seq).unwrap(), opts)
                    .unwrap();
                prop_assert_eq!(got, model.publish(*p, seq), "publish #{} returned", seq);
                seq += 1;
            }
            Op::Drain => {
                hub.turn(Instant::now());
                prop_assert!(spy.pending() <= 1, "at most one frame in flight");
                spy.complete_all();
                model.drain(max_batch);
            }
        }
        let s = hub.stats();
        prop_assert_eq!(s.dropped, model.dropped);
        prop_assert_eq!(s.disconnected, u64::from(model.disconnected));
        match s.list.first() {
            Some(sub) => {
                prop_assert!(!model.disconnected);
                prop_assert_eq!(sub.queued, model.queue.len());
                prop_assert_eq!(sub.dropped, model.dropped);
            }
            None => prop_assert!(model.disconnected),
        }
    }
    let delivered: Vec<u64> = spy
        .frames_for("s")
        .iter()
        .flat_map(|f| {
            let d = frame::decode(f).unwrap();
            d.json_messages()
                .unwrap()
                .iter()
                .map(|m| std::str::from_utf8(m).unwrap().parse::<u64>().unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
    prop_assert_eq!(delivered, model.delivered);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn fifo_policies_match_the_model(
        policy in policy(),
        cap in 0usize..6,
        max_batch in 1usize..4,
        ops in proptest::collection::vec(op(), 0..60),
    ) {
        check(policy, false, cap, max_batch, &ops)?;
    }

    #[test]
    fn message_priority_policies_match_the_model(
        policy in policy(),
        cap in 0usize..6,
        max_batch in 1usize..4,
        ops in proptest::collection::vec(op(), 0..60),
    ) {
        check(policy, true, cap, max_batch, &ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Two drop-oldest subscribers of one topic with different `max_queue` and `max_batch`
    /// share the topic's log with diverging cursors; each must still behave exactly like its own
    /// bounded queue. After every drain pass the hub holds a message exactly while some model
    /// queue still does: the shared log keeps nothing both subscribers are done with.
    #[test]
    fn drop_oldest_subscribers_sharing_a_topic_match_their_models(
        caps in (1usize..6, 1usize..9),
        batches in (1usize..4, 1usize..4),
        ops in proptest::collection::vec(op(), 0..80),
    ) {
        let spy = SpySink::new();
        spy.set_mode(SpyMode::Pending);
        let hub = Hub::new(spy.clone(), HubOptions::default().driver(Driver::Manual)).unwrap();
        let ids = ["s0", "s1"];
        let caps = [caps.0, caps.1];
        let batches = [batches.0, batches.1];
        let mut models: Vec<Model> = caps
            .iter()
            .map(|&cap| Model { cap, policy: Some(SlowConsumer::DropOldest), ..Model::default() })
            .collect();
        for k in 0..2 {
            hub.subscribe(
                "t",
                |_| {},
                SubscribeOptions::default().id(ids[k]).max_queue(caps[k]).max_batch(batches[k]),
            )
            .unwrap().detach();
        }
        let mut seq = 0u64;
        let mut bodies = Vec::new();
        for op in &ops {
            match op {
                Op::Publish(_) => {
                    let message = Message::to_json(&seq).unwrap();
                    bodies.push(message.bytes().clone());
                    let got = hub
                        .publish("t", message, PublishOptions::default())
                        .unwrap();
                    let want: usize = models.iter_mut().map(|m| m.publish(0, seq)).sum();
                    prop_assert_eq!(got, want);
                    seq += 1;
                }
                Op::Drain => {
                    hub.turn(Instant::now());
                    spy.complete_all();
                    for k in 0..2 {
                        models[k].drain(batches[k]);
                    }
                    for (n, body) in bodies.iter().enumerate() {
                        let queued = models
                            .iter()
                            .any(|m| m.queue.iter().any(|&(_, q)| q == n as u64));
                        prop_assert_eq!(!body.is_unique(), queued, "message {} held", n);
                    }
                }
            }
            let s = hub.stats();
            for (k, id) in ids.iter().enumerate() {
                let x = s.list.iter().find(|x| x.id == *id).unwrap();
                prop_assert_eq!(x.queued, models[k].queue.len(), "{} queued", id);
                prop_assert_eq!(x.dropped, models[k].dropped, "{} dropped", id);
            }
            prop_assert_eq!(s.dropped, models[0].dropped + models[1].dropped);
        }
        for (k, id) in ids.iter().enumerate() {
            let delivered: Vec<u64> = spy
                .frames_for(id)
                .iter()
                .flat_map(|f| {
                    frame::decode(f)
                        .unwrap()
                        .json_messages()
                        .unwrap()
                        .iter()
                        .map(|m| std::str::from_utf8(m).unwrap().parse::<u64>().unwrap())
                        .collect::<Vec<_>>()
                })
                .collect();
            prop_assert_eq!(&delivered, &models[k].delivered, "{} delivered", id);
        }
    }
}
