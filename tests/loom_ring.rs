//! Model checks of `powerhub::ring::Ring` under loom.
//!
//! Run with:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p powerhub --release --test loom_ring
//! ```
//!
//! Every model uses a ring of capacity 1 to 3 so that full, empty and wrap-around are reached in
//! a handful of operations. Values carry an id and a clone of a witness `Arc`: at the end of each
//! execution every id must be accounted for exactly once (popped, evicted, refused or still
//! queued) and, once everything is dropped, the witness must be back to one strong reference, so
//! a leaked or doubly dropped value fails the model.
//!
//! The preemption bound is 2. Waiting in the ring (for a slot that another thread claimed but
//! has not published or released yet) spins with `yield_now` under loom. When two threads wait
//! on a third that is preempted, loom can hand the CPU back and forth between the two waiters
//! forever and stops with "Model exceeded maximum number of branches"; from a bound of 3, the
//! two-producers model reaches that state. This is a limit of checking spin-waits, not a lost
//! wake-up: the stalled thread is runnable and finishes as soon as it is scheduled.
#![cfg(loom)]

use loom::sync::Arc as LoomArc;
use loom::thread;
use powerhub::ring::{Full, Ring};
use std::sync::Arc;

/// A queued value: an id, and a reference that counts how many values are alive.
#[derive(Debug)]
struct Item {
    id: u32,
    _alive: Arc<()>,
}

fn item(id: u32, witness: &Arc<()>) -> Item {
    Item {
        id,
        _alive: Arc::clone(witness),
    }
}

fn ids(items: &[Item]) -> Vec<u32> {
    items.iter().map(|i| i.id).collect()
}

fn drain(ring: &Ring<Item>) -> Vec<Item> {
    std::iter::from_fn(|| ring.pop()).collect()
}

/// Pushes, yielding to the other threads while the ring is full.
fn push_waiting(ring: &Ring<Item>, mut value: Item) {
    loop {
        match ring.push(value) {
            Ok(()) => return,
            Err(Full(back)) => {
                value = back;
                thread::yield_now();
            }
        }
    }
}

/// Pops, yielding to the other threads while the ring is empty.
fn pop_waiting(ring: &Ring<Item>) -> Item {
    loop {
        if let Some(value) = ring.pop() {
            return value;
        }
        thread::yield_now();
    }
}

/// Asserts that `seen` holds each of `expected` exactly once.
fn assert_exactly_once(mut seen: Vec<u32>, expected: &[u32]) {
    seen.sort_unstable();
    let mut expected = expected.to_vec();
    expected.sort_unstable();
    assert_eq!(seen, expected, "a value was lost or duplicated");
}

/// Asserts that `order` keeps each producer's ids (given as ranges) increasing.
fn assert_fifo_per_producer(order: &[u32], producers: &[std::ops::Range<u32>]) {
    for range in producers {
        let mine: Vec<u32> = order
            .iter()
            .copied()
            .filter(|id| range.contains(id))
            .collect();
        assert!(
            mine.windows(2).all(|w| w[0] < w[1]),
            "producer order broken: {order:?}"
        );
    }
}

#[test]
fn concurrent_publish_and_drain_wraps_around() {
    loom::model(|| {
        let witness = Arc::new(());
        let ring = LoomArc::new(Ring::new(2));

        let producer = {
            let ring = LoomArc::clone(&ring);
            let witness = Arc::clone(&witness);
            thread::spawn(move || {
                // Three values through two slots: the third push reuses slot 0 in lap 1.
                for id in 0..3 {
                    push_waiting(&ring, item(id, &witness));
                }
            })
        };
        let got: Vec<Item> = (0..3).map(|_| pop_waiting(&ring)).collect();
        producer.join().unwrap();

        assert_eq!(ids(&got), [0, 1, 2]);
        assert!(ring.is_empty());
        drop(got);
        drop(ring);
        assert_eq!(Arc::strong_count(&witness), 1, "leak or double drop");
    });
}

#[test]
fn force_push_on_full_ring_races_pop() {
    loom::model(|| {
        let witness = Arc::new(());
        let ring = LoomArc::new(Ring::new(2));
        ring.push(item(0, &witness)).unwrap();
        ring.push(item(1, &witness)).unwrap();

        let pusher = {
            let ring = LoomArc::clone(&ring);
            let witness = Arc::clone(&witness);
            thread::spawn(move || ring.force_push(item(2, &witness)))
        };
        let popped = ring.pop().expect("the ring is never empty here");
        let evicted = pusher.join().unwrap();
        let rest = drain(&ring);

        // Whoever claims the head first takes 0; the other gets 1 or finds room.
        match &evicted {
            Some(old) => {
                assert_eq!(old.id, 0);
                assert_eq!(popped.id, 1);
                assert_eq!(ids(&rest), [2]);
            }
            None => {
                assert_eq!(popped.id, 0);
                assert_eq!(ids(&rest), [1, 2]);
            }
        }
        drop((popped, evicted, rest));
        drop(ring);
        assert_eq!(Arc::strong_count(&witness), 1, "leak or double drop");
    });
}

#[test]
fn overwrites_race_each_other_on_a_full_ring() {
    loom::model(|| {
        let witness = Arc::new(());
        let ring = LoomArc::new(Ring::new(2));
        ring.push(item(0, &witness)).unwrap();
        ring.push(item(1, &witness)).unwrap();

        let pushers: Vec<_> = [10, 20]
            .into_iter()
            .map(|id| {
                let ring = LoomArc::clone(&ring);
                let witness = Arc::clone(&witness);
                thread::spawn(move || ring.force_push(item(id, &witness)))
            })
            .collect();
        let evicted: Vec<Item> = pushers
            .into_iter()
            .map(|p| p.join().unwrap().expect("the ring was full"))
            .collect();
        let rest = drain(&ring);

        // Each overwrite evicted one of the two oldest values, never the same one twice.
        assert_exactly_once(ids(&evicted), &[0, 1]);
        assert_exactly_once(ids(&rest), &[10, 20]);

        drop((evicted, rest));
        drop(ring);
        assert_eq!(Arc::strong_count(&witness), 1, "leak or double drop");
    });
}

#[test]
fn overwrites_under_contention_with_a_concurrent_pop() {
    // One value queued: the first overwrite fills the ring, the second evicts, while the
    // consumer pops. (With the ring full from the start, a pop stalled between its claim and its
    // release leaves both overwriters spinning on the slot it still reads; loom then explores
    // the two spinners handing the CPU to each other forever, which the previous model covers
    // without the pop.)
    loom::model(|| {
        let witness = Arc::new(());
        let ring = LoomArc::new(Ring::new(2));
        ring.push(item(0, &witness)).unwrap();

        let pushers: Vec<_> = [10, 20]
            .into_iter()
            .map(|id| {
                let ring = LoomArc::clone(&ring);
                let witness = Arc::clone(&witness);
                thread::spawn(move || ring.force_push(item(id, &witness)))
            })
            .collect();
        let popped = ring.pop();
        let evicted: Vec<Item> = pushers
            .into_iter()
            .filter_map(|p| p.join().unwrap())
            .collect();
        let rest = drain(&ring);

        // Only the first value is ever old enough to be evicted, and the pop finds a newer
        // value only once that one left the ring.
        assert!(
            ids(&evicted).iter().all(|&id| id == 0),
            "evicted {:?}",
            ids(&evicted)
        );
        if popped.as_ref().is_some_and(|i| i.id != 0) {
            assert_eq!(ids(&evicted), [0]);
        }
        assert!(rest.len() <= 2);
        let mut all = ids(&evicted);
        all.extend(popped.as_ref().map(|i| i.id));
        all.extend(ids(&rest));
        assert_exactly_once(all, &[0, 10, 20]);

        drop((popped, evicted, rest));
        drop(ring);
        assert_eq!(Arc::strong_count(&witness), 1, "leak or double drop");
    });
}

#[test]
fn two_producers_one_consumer() {
    loom::model(|| {
        let witness = Arc::new(());
        let ring = LoomArc::new(Ring::new(2));

        // Producer A: drop-newest, keeps what was refused. Producer B: drop-oldest.
        let a = {
            let ring = LoomArc::clone(&ring);
            let witness = Arc::clone(&witness);
            thread::spawn(move || {
                let mut refused = Vec::new();
                for id in [0, 1] {
                    if let Err(Full(back)) = ring.push(item(id, &witness)) {
                        refused.push(back);
                    }
                }
                refused
            })
        };
        let b = {
            let ring = LoomArc::clone(&ring);
            let witness = Arc::clone(&witness);
            thread::spawn(move || ring.force_push(item(10, &witness)))
        };
        let mut order = Vec::new();
        order.extend(ring.pop());
        order.extend(ring.pop());
        let refused = a.join().unwrap();
        let evicted = b.join().unwrap();
        order.extend(drain(&ring));

        let mut all = ids(&order);
        all.extend(ids(&refused));
        all.extend(evicted.as_ref().map(|i| i.id));
        assert_exactly_once(all, &[0, 1, 10]);
        assert_fifo_per_producer(&ids(&order), &[0..2, 10..11]);

        drop((order, refused, evicted));
        drop(ring);
        assert_eq!(Arc::strong_count(&witness), 1, "leak or double drop");
    });
}

#[test]
fn push_on_full_ring_races_pop() {
    loom::model(|| {
        let witness = Arc::new(());
        let ring = LoomArc::new(Ring::new(1));
        ring.push(item(0, &witness)).unwrap();

        let pusher = {
            let ring = LoomArc::clone(&ring);
            let witness = Arc::clone(&witness);
            thread::spawn(move || ring.push(item(1, &witness)))
        };
        let popped = ring.pop().expect("the ring is never empty here");
        let pushed = pusher.join().unwrap();
        let rest = drain(&ring);

        assert_eq!(popped.id, 0);
        match &pushed {
            Ok(()) => assert_eq!(ids(&rest), [1]),
            Err(Full(back)) => {
                assert_eq!(back.id, 1);
                assert!(rest.is_empty());
            }
        }
        drop((popped, pushed, rest));
        drop(ring);
        assert_eq!(Arc::strong_count(&witness), 1, "leak or double drop");
    });
}

#[test]
fn drop_releases_values_left_by_concurrent_producers() {
    loom::model(|| {
        let witness = Arc::new(());
        let ring = LoomArc::new(Ring::new(3));

        let producers: Vec<_> = [0, 10]
            .into_iter()
            .map(|base| {
                let ring = LoomArc::clone(&ring);
                let witness = Arc::clone(&witness);
                thread::spawn(move || {
                    for id in base..base + 2 {
                        drop(ring.force_push(item(id, &witness)));
                    }
                })
            })
            .collect();
        // The consumer takes one value while the producers wrap the ring around.
        let popped = ring.pop();
        for p in producers {
            p.join().unwrap();
        }
        // Four values into three slots, one pop somewhere in between: two or three remain.
        assert!((2..=3).contains(&ring.len()), "len {}", ring.len());
        drop(popped);
        // The values still queued are released by the ring's Drop, once each.
        drop(ring);
        assert_eq!(Arc::strong_count(&witness), 1, "leak or double drop");
    });
}
