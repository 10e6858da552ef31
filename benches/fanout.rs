// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

//! In-process fan-out: deliveries per second to 1, 100 and 10 000 subscribers, end to end
//! (publish and drain), for the hub (handlers, and a `Receiver` per subscriber) against
//! `tokio::sync::broadcast` and a channel per subscriber (`crossbeam-channel`, `flume`).
//!
//! Every system delivers the same `MESSAGES` messages (64-byte JSON payloads) to every
//! subscriber per iteration, and every subscriber consumes each one. The hub runs on
//! `Driver::Manual` (publish, then one turn on the same thread, as a runtime shard drives it);
//! its sink takes each frame and its handler runs once per message. Two hub rows:
//! `hub/one-turn` publishes the burst and drains once (one shared frame per subscriber);
//! `hub/turn-per-message` drains after every publish (one frame per message per subscriber).
//!
//! `fanout-among-idle` publishes one message to a topic with one subscriber while 0, 1 000 or
//! 50 000 subscribers of other topics have nothing to do: a turn visits the topics published
//! to, so its cost should not grow with the idle ones.
//!
//! Run: `cargo bench --bench fanout -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use powerhub::hub::{Driver, Hub, HubOptions, Message, PublishOptions, SubscribeOptions};
use powerhub_plugin::{Completion, Frame, SendOutcome, Sink, SubscriberRef};

const MESSAGES: usize = 32;
const SIZES: [usize; 3] = [1, 100, 10_000];

/// A transport that takes every frame at once and counts its bytes.
#[derive(Debug, Default)]
struct Counting(AtomicU64);

impl Sink for Counting {
    fn send(&self, _sub: &SubscriberRef, frame: Frame, _done: Completion) -> SendOutcome {
        self.0.fetch_add(frame.len() as u64, Ordering::Relaxed);
        SendOutcome::Accepted
    }
}

fn payload() -> Message {
    let text = format!("{{\"seq\":1,\"pad\":\"{}\"}}", "x".repeat(64 - 20));
    Message::json(text).unwrap()
}

fn hub_with(n: usize) -> (Hub, Arc<Counting>) {
    let sink = Arc::new(Counting::default());
    let hub = Hub::new(
        Arc::clone(&sink),
        HubOptions::default().driver(Driver::Manual),
    )
    .unwrap();
    for i in 0..n {
        // The consumer: one handler call per delivered message.
        hub.subscribe(
            "t",
            |d| {
                black_box(d.message());
            },
            SubscribeOptions::default().id(format!("s{i}")),
        )
        .unwrap()
        .detach();
    }
    // Check the path end to end once before measuring it.
    hub.publish("t", payload(), PublishOptions::default())
        .unwrap();
    hub.turn(Instant::now());
    assert!(
        sink.0.load(Ordering::Relaxed) > 0,
        "frames reached the transport"
    );
    (hub, sink)
}

fn fanout(c: &mut Criterion) {
    let mut group = c.benchmark_group("fanout");
    let msg = payload();
    for n in SIZES {
        group.throughput(Throughput::Elements((n * MESSAGES) as u64));
        if n >= 10_000 {
            group.sample_size(10);
        } else {
            group.sample_size(30);
        }

        let (hub, _sink) = hub_with(n);
        group.bench_with_input(BenchmarkId::new("hub/one-turn", n), &n, |b, _| {
            b.iter(|| {
                for _ in 0..MESSAGES {
                    hub.publish("t", msg.clone(), PublishOptions::default())
                        .unwrap();
                }
                hub.turn(Instant::now());
            })
        });
        drop(hub);

        let (hub, _sink) = hub_with(n);
        group.bench_with_input(BenchmarkId::new("hub/turn-per-message", n), &n, |b, _| {
            b.iter(|| {
                for _ in 0..MESSAGES {
                    hub.publish("t", msg.clone(), PublishOptions::default())
                        .unwrap();
                    hub.turn(Instant::now());
                }
            })
        });
        drop(hub);

        // A receiver per subscriber (drop-oldest: each reads the topic itself), consumed with
        // an owned message per receive (as broadcast's) and borrowed; published through the
        // topic's `Publisher` (as broadcast's `Sender`), and by name.
        let hub = Hub::new(Counting::default(), HubOptions::default()).unwrap();
        let mut rxs: Vec<_> = (0..n)
            .map(|_| hub.receiver("t", SubscribeOptions::default()).unwrap())
            .collect();
        let publisher = hub.publisher("t");
        for (name, borrowed, by_name) in [
            ("hub/receivers", false, false),
            ("hub/receivers-borrowed", true, false),
            ("hub/receivers-by-name", false, true),
        ] {
            group.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| {
                    for _ in 0..MESSAGES {
                        if by_name {
                            hub.publish("t", msg.clone(), PublishOptions::default())
                        } else {
                            publisher.publish(msg.clone(), PublishOptions::default())
                        }
                        .unwrap();
                    }
                    for rx in rxs.iter_mut() {
                        for _ in 0..MESSAGES {
                            if borrowed {
                                black_box(rx.try_recv_ref().unwrap().message());
                            } else {
                                black_box(rx.try_recv().unwrap());
                            }
                        }
                    }
                })
            });
        }
        drop((rxs, publisher));
        drop(hub);

        let bytes: Bytes = msg.bytes().clone();
        let (tx, _) = tokio::sync::broadcast::channel::<Bytes>(MESSAGES);
        let mut rxs: Vec<_> = (0..n).map(|_| tx.subscribe()).collect();
        group.bench_with_input(BenchmarkId::new("tokio-broadcast", n), &n, |b, _| {
            b.iter(|| {
                for _ in 0..MESSAGES {
                    tx.send(bytes.clone()).unwrap();
                }
                for rx in rxs.iter_mut() {
                    for _ in 0..MESSAGES {
                        black_box(rx.try_recv().unwrap());
                    }
                }
            })
        });
        drop(rxs);

        let (ftxs, frxs): (Vec<_>, Vec<_>) = (0..n).map(|_| flume::bounded::<Bytes>(64)).unzip();
        group.bench_with_input(BenchmarkId::new("flume-per-subscriber", n), &n, |b, _| {
            b.iter(|| {
                for _ in 0..MESSAGES {
                    for tx in &ftxs {
                        tx.try_send(bytes.clone()).unwrap();
                    }
                }
                for rx in &frxs {
                    for _ in 0..MESSAGES {
                        black_box(rx.try_recv().unwrap());
                    }
                }
            })
        });
        drop((ftxs, frxs));

        let (txs, rxs): (Vec<_>, Vec<_>) = (0..n)
            .map(|_| crossbeam_channel::bounded::<Bytes>(64))
            .unzip();
        group.bench_with_input(
            BenchmarkId::new("crossbeam-per-subscriber", n),
            &n,
            |b, _| {
                b.iter(|| {
                    for _ in 0..MESSAGES {
                        for tx in &txs {
                            tx.try_send(bytes.clone()).unwrap();
                        }
                    }
                    for rx in &rxs {
                        for _ in 0..MESSAGES {
                            black_box(rx.try_recv().unwrap());
                        }
                    }
                })
            },
        );
    }
    group.finish();
}

fn fanout_among_idle(c: &mut Criterion) {
    let mut group = c.benchmark_group("fanout-among-idle");
    let msg = payload();
    for idle in [0usize, 1_000, 50_000] {
        let (hub, _sink) = hub_with(1);
        for i in 0..idle {
            // One device topic each, as push connections subscribe to `stream/device`.
            hub.subscribe(
                &format!("idle/{i}"),
                |_| {},
                SubscribeOptions::default().id(format!("idle-{i}")),
            )
            .unwrap()
            .detach();
        }
        group.throughput(Throughput::Elements(1));
        group.bench_with_input(
            BenchmarkId::new("hub/publish-and-turn", idle),
            &idle,
            |b, _| {
                b.iter(|| {
                    hub.publish("t", msg.clone(), PublishOptions::default())
                        .unwrap();
                    hub.turn(Instant::now());
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, fanout, fanout_among_idle);
criterion_main!(benches);
