//! A subscriber's bounded queue and its slow-consumer policy.
//!
//! FIFO mode uses the lock-free [`Ring`]: publishers push from any thread, the drainer pops.
//! Under `message_priority` the queue is a small mutexed ordered map keyed by
//! `(Reverse(priority), seq)`: its first entry is the next to deliver (highest priority, oldest
//! among equals) and its last entry is the one furthest from delivery (lowest priority, newest
//! among equals), which is what `drop-oldest` evicts. A mutex is fine there: the map is touched
//! once per publish and once per batch, and the ordering a heap would need is the same cost.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::message::Message;
use super::options::SlowConsumer;
use crate::ring::Ring;

/// One queued publication, shared by every subscriber queue it sits in.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) seq: u64,
    pub(crate) priority: i32,
    pub(crate) message: Message,
}

/// The result of offering an entry to a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Offer {
    /// Queued; `evicted` older entries were dropped to make room.
    Queued { evicted: usize },
    /// The incoming entry was dropped by the policy.
    Dropped,
    /// The queue is full under `disconnect`: the subscriber must be closed.
    Disconnect,
}

// One `Store` per subscriber, inline in its `Arc`: the ring's cache-padded size is wanted, and
// boxing it would add a pointer chase on every publish.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Store {
    /// `max_queue: 0`: nothing is ever buffered.
    Zero,
    Fifo(Ring<Arc<Entry>>),
    Prio(Mutex<BTreeMap<(Reverse<i32>, u64), Arc<Entry>>>),
}

/// A bounded queue with a slow-consumer policy.
#[derive(Debug)]
pub(crate) struct Queue {
    store: Store,
    policy: SlowConsumer,
    capacity: usize,
}

impl Queue {
    pub(crate) fn new(capacity: usize, policy: SlowConsumer, message_priority: bool) -> Self {
        let store = if capacity == 0 {
            Store::Zero
        } else if message_priority {
            Store::Prio(Mutex::new(BTreeMap::new()))
        } else {
            Store::Fifo(Ring::new(capacity))
        };
        Queue {
            store,
            policy,
            capacity,
        }
    }

    /// Offers `entry` under the policy.
    pub(crate) fn offer(&self, entry: Arc<Entry>) -> Offer {
        match &self.store {
            Store::Zero => match self.policy {
                // Nothing queued, so there is no older message to evict: the incoming one goes.
                SlowConsumer::DropOldest | SlowConsumer::DropNewest => Offer::Dropped,
                SlowConsumer::Disconnect => Offer::Disconnect,
            },
            Store::Fifo(ring) => match self.policy {
                SlowConsumer::DropOldest => match ring.force_push(entry) {
                    Some(_evicted) => Offer::Queued { evicted: 1 },
                    None => Offer::Queued { evicted: 0 },
                },
                SlowConsumer::DropNewest => match ring.push(entry) {
                    Ok(()) => Offer::Queued { evicted: 0 },
                    Err(_) => Offer::Dropped,
                },
                SlowConsumer::Disconnect => match ring.push(entry) {
                    Ok(()) => Offer::Queued { evicted: 0 },
                    Err(_) => Offer::Disconnect,
                },
            },
            Store::Prio(map) => {
                let mut map = map.lock();
                let mut evicted = 0;
                if map.len() >= self.capacity {
                    match self.policy {
                        SlowConsumer::DropOldest => {
                            // Furthest from delivery: lowest priority, newest among equals.
                            map.pop_last();
                            evicted = 1;
                        }
                        SlowConsumer::DropNewest => return Offer::Dropped,
                        SlowConsumer::Disconnect => return Offer::Disconnect,
                    }
                }
                map.insert((Reverse(entry.priority), entry.seq), entry);
                Offer::Queued { evicted }
            }
        }
    }

    /// Pops up to `max` entries, in delivery order, into `out`.
    pub(crate) fn pop_into(&self, max: usize, out: &mut Vec<Arc<Entry>>) {
        match &self.store {
            Store::Zero => {}
            Store::Fifo(ring) => {
                for _ in 0..max {
                    match ring.pop() {
                        Some(e) => out.push(e),
                        None => break,
                    }
                }
            }
            Store::Prio(map) => {
                let mut map = map.lock();
                for _ in 0..max {
                    match map.pop_first() {
                        Some((_, e)) => out.push(e),
                        None => break,
                    }
                }
            }
        }
    }

    /// Discards everything queued; returns how many entries there were.
    pub(crate) fn clear(&self) -> usize {
        match &self.store {
            Store::Zero => 0,
            Store::Fifo(ring) => {
                let mut n = 0;
                while ring.pop().is_some() {
                    n += 1;
                }
                n
            }
            Store::Prio(map) => {
                let mut map = map.lock();
                let n = map.len();
                map.clear();
                n
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        match &self.store {
            Store::Zero => 0,
            Store::Fifo(ring) => ring.len(),
            Store::Prio(map) => map.lock().len(),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
