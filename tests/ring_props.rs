//! `Ring` against a plain model, and under real threads.
#![cfg(not(loom))]

use powerhub::ring::{Full, Ring};
use proptest::prelude::*;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

#[derive(Debug, Clone)]
enum Op {
    Push(u32),
    ForcePush(u32),
    Pop,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        any::<u32>().prop_map(Op::Push),
        any::<u32>().prop_map(Op::ForcePush),
        Just(Op::Pop),
    ]
}

/// The model: a `VecDeque` that never grows beyond `capacity`.
struct Model {
    queue: VecDeque<u32>,
    capacity: usize,
}

impl Model {
    fn push(&mut self, v: u32) -> Result<(), Full<u32>> {
        if self.queue.len() == self.capacity {
            return Err(Full(v));
        }
        self.queue.push_back(v);
        Ok(())
    }

    fn force_push(&mut self, v: u32) -> Option<u32> {
        let evicted = if self.queue.len() == self.capacity {
            self.queue.pop_front()
        } else {
            None
        };
        self.queue.push_back(v);
        evicted
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn ring_matches_a_bounded_vecdeque(capacity in 1usize..9, ops in prop::collection::vec(op(), 0..200)) {
        let ring = Ring::new(capacity);
        let mut model = Model { queue: VecDeque::new(), capacity };
        for op in ops {
            match op {
                Op::Push(v) => prop_assert_eq!(ring.push(v), model.push(v)),
                Op::ForcePush(v) => prop_assert_eq!(ring.force_push(v), model.force_push(v)),
                Op::Pop => prop_assert_eq!(ring.pop(), model.queue.pop_front()),
            }
            prop_assert_eq!(ring.len(), model.queue.len());
            prop_assert_eq!(ring.is_empty(), model.queue.is_empty());
            prop_assert_eq!(ring.is_full(), model.queue.len() == capacity);
            prop_assert_eq!(ring.capacity(), capacity);
        }
        let rest: Vec<u32> = std::iter::from_fn(|| ring.pop()).collect();
        prop_assert_eq!(rest, Vec::from(model.queue));
    }
}

/// Producer `p` sends `p * PER_PRODUCER + i`: the id says who sent it and in which order.
const PER_PRODUCER: u64 = 100_000;

/// Several producers (some drop-newest, some drop-oldest) and one consumer hammer a small ring;
/// every value must come out exactly once (popped, evicted, refused or left queued), and each
/// producer's values must be popped in the order they were pushed.
#[test]
fn stress_producers_and_one_consumer_lose_and_duplicate_nothing() {
    for capacity in [1, 2, 3, 64] {
        stress(capacity, 3, 20_000);
    }
}

fn stress(capacity: usize, producers: u64, per_producer: u64) {
    let ring = Arc::new(Ring::<u64>::new(capacity));
    let start = Arc::new(Barrier::new(producers as usize + 1));
    let done = Arc::new(AtomicBool::new(false));

    let handles: Vec<_> = (0..producers)
        .map(|p| {
            let ring = Arc::clone(&ring);
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                let mut not_queued = Vec::new();
                start.wait();
                for i in 0..per_producer {
                    let v = p * PER_PRODUCER + i;
                    // Even producers drop the newest value, odd ones the oldest.
                    if p % 2 == 0 {
                        if let Err(Full(back)) = ring.push(v) {
                            not_queued.push(back);
                        }
                    } else if let Some(old) = ring.force_push(v) {
                        not_queued.push(old);
                    }
                }
                not_queued
            })
        })
        .collect();

    let consumer = {
        let ring = Arc::clone(&ring);
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let mut popped = Vec::new();
            // Stops once the producers are done and the ring is drained: bounded by the number
            // of values pushed.
            loop {
                match ring.pop() {
                    Some(v) => popped.push(v),
                    None if done.load(Ordering::Acquire) => break,
                    None => std::hint::spin_loop(),
                }
            }
            popped.extend(std::iter::from_fn(|| ring.pop()));
            popped
        })
    };

    start.wait();
    let mut seen: Vec<u64> = Vec::new();
    for h in handles {
        seen.extend(h.join().unwrap());
    }
    done.store(true, Ordering::Release);
    let popped = consumer.join().unwrap();
    assert!(ring.is_empty());

    // Each producer's popped values keep their push order.
    for p in 0..producers {
        let mine: Vec<u64> = popped
            .iter()
            .copied()
            .filter(|v| v / PER_PRODUCER == p)
            .collect();
        assert!(
            mine.windows(2).all(|w| w[0] < w[1]),
            "capacity {capacity}: producer {p} reordered"
        );
    }

    seen.extend(&popped);
    seen.sort_unstable();
    let expected: Vec<u64> = (0..producers)
        .flat_map(|p| (0..per_producer).map(move |i| p * PER_PRODUCER + i))
        .collect();
    assert_eq!(seen.len(), expected.len(), "capacity {capacity}: count");
    assert!(seen == expected, "capacity {capacity}: lost or duplicated");
}
