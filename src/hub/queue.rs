//! A subscriber's bounded queue and its slow-consumer policy.
//!
//! A FIFO `drop-oldest` subscriber (the default) needs no queue of its own: its queue is always
//! "the last `max_queue` publications of its topic after its cursor". Those subscribers share
//! their topic's [`TopicLog`] and keep only a cursor, so a publication touches none of them, a
//! drain moves the cursor, and subscribers with equal cursors share one batch. Evictions are
//! applied lazily (`normalize`) with exactly the counts the eager policy gives. The drainer
//! releases the log entries every cursor has passed ([`Queue::cursor_floor`]), so the log holds
//! only what some subscriber can still read.
//!
//! FIFO mode uses the lock-free [`Ring`]: publishers push from any thread, the drain lock's
//! holder pops (a drainer, or a fed receiver's feed or its taking of the rest after its end).
//! Under `message_priority` the queue is a small mutexed ordered map keyed by
//! `(Reverse(priority), seq)`: its first entry is the next to deliver (highest priority, oldest
//! among equals) and its last entry is the one furthest from delivery (lowest priority, newest
//! among equals), which is what `drop-oldest` evicts. A mutex is fine there: the map is touched
//! once per publish and once per batch, and the ordering a heap would need is the same cost.

use std::cmp::Reverse;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::message::Message;
use super::options::SlowConsumer;
use super::sealed::SealCell;
use crate::ring::Ring;

/// A message-priority queue: first entry delivered next, last entry evicted first.
type PrioMap = BTreeMap<(Reverse<i32>, u64), Arc<Entry>>;

/// One queued publication, shared by every subscriber queue it sits in.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) seq: u64,
    /// The publication's number within its topic (0, 1, 2, … while the topic exists), assigned
    /// in the order the topic's subscribers queue its publications.
    pub(crate) topic_seq: u64,
    pub(crate) priority: i32,
    pub(crate) message: Message,
    /// How many taps (the shards with subscriptions to the topic) it was handed to: exactly the
    /// number of `Tap::offer` calls made with it (both under one topics lock, in `fan_out`).
    /// The seal's count relies on it: a shard cuts at a publication at most once per offer, so
    /// a shard beyond the count would read a freed seal (see [`sealed`](super::sealed)).
    pub(crate) taps: u32,
    /// The batch a shard sealed on this publication, while other shards may still cut here
    /// (see [`sealed`](super::sealed)).
    pub(crate) sealed: SealCell,
}

impl Entry {
    /// Publication `seq`, number `topic_seq` of its topic, handed to `taps` taps; not sealed.
    pub(crate) fn new(
        seq: u64,
        topic_seq: u64,
        priority: i32,
        message: Message,
        taps: u32,
    ) -> Entry {
        Entry {
            seq,
            topic_seq,
            priority,
            message,
            taps,
            sealed: SealCell::default(),
        }
    }
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

// One `Store` per subscriber, inline in its `Arc`. The FIFO ring is boxed and allocated on the
// first offer: inline, its cache-padded indices would make every subscriber (cursors included)
// 128-byte aligned and several hundred bytes larger, and a subscriber that never receives
// anything should not own `max_queue` slots. The cost is one pointer chase per offer.
#[derive(Debug)]
enum Store {
    /// `max_queue: 0`: nothing is ever buffered.
    Zero,
    /// FIFO drop-oldest: a cursor into the topic's shared log.
    Cursor(Cursor),
    /// FIFO drop-newest or disconnect: a ring of `capacity` slots, allocated on first use.
    Fifo(OnceLock<Box<Ring<Arc<Entry>>>>),
    Prio(Mutex<PrioMap>),
}

/// A bounded queue with a slow-consumer policy.
#[derive(Debug)]
pub(crate) struct Queue {
    store: Store,
    policy: SlowConsumer,
    capacity: usize,
}

/// The recent publications of one topic, shared by its cursor subscribers: at most the last
/// `cap` entries, `cap` being the largest `max_queue` among them, and none that every cursor
/// has passed once the drainer calls [`release_before`](TopicLog::release_before).
#[derive(Debug)]
pub(crate) struct TopicLog {
    /// Unique for the life of the process (an address could be reused by a later topic).
    id: u64,
    inner: Mutex<LogInner>,
    /// Entries ever appended (`base + buf.len()`), readable without the lock.
    head: AtomicU64,
}

#[derive(Debug, Default)]
struct LogInner {
    buf: VecDeque<Arc<Entry>>,
    /// Log index of `buf[0]`.
    base: u64,
    cap: usize,
}

impl Default for TopicLog {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        TopicLog {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            inner: Mutex::default(),
            head: AtomicU64::new(0),
        }
    }
}

impl TopicLog {
    /// Appends a publication, forgetting the oldest beyond `cap`.
    pub(crate) fn append(&self, entry: &Arc<Entry>) {
        let mut log = self.inner.lock();
        if log.cap == 0 {
            return;
        }
        while log.buf.len() >= log.cap {
            log.buf.pop_front();
            log.base += 1;
        }
        log.buf.push_back(Arc::clone(entry));
        // Release: a reader that sees the new head finds the entry under the lock anyway; the
        // head is only a hint for lengths.
        self.head
            .store(log.base + log.buf.len() as u64, Ordering::Release);
    }

    /// Log index one past the newest entry.
    pub(crate) fn head(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    /// Sets how many entries the log keeps (the largest cursor subscriber's `max_queue`).
    pub(crate) fn set_cap(&self, cap: usize) {
        let mut log = self.inner.lock();
        log.cap = cap;
        while log.buf.len() > cap {
            log.buf.pop_front();
            log.base += 1;
        }
    }

    pub(crate) fn cap(&self) -> usize {
        self.inner.lock().cap
    }

    /// Whether the log holds no entry (every cursor is at the head, or released).
    pub(crate) fn holds_nothing(&self) -> bool {
        self.inner.lock().buf.is_empty()
    }

    /// Forgets the entries before log index `floor`: every cursor of the topic has passed them
    /// (see [`Queue::cursor_floor`]), and a new cursor starts at the head.
    pub(crate) fn release_before(&self, floor: u64) {
        let mut log = self.inner.lock();
        let n = floor.saturating_sub(log.base).min(log.buf.len() as u64);
        if n > 0 {
            log.buf.drain(..n as usize);
            log.base += n;
        }
    }

    /// Unique for the life of the process.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Entries the log holds.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().buf.len()
    }
}

#[derive(Debug)]
struct Cursor {
    log: Arc<TopicLog>,
    state: Mutex<CursorState>,
    /// A copy of `state.next`, stored whenever a [`CursorGuard`] lets go, so the drainer can
    /// compute the log's release floor without taking every cursor's lock. Relaxed: nothing is
    /// published through it, and a stale (smaller) value only makes the log keep more.
    next: AtomicU64,
}

impl Cursor {
    /// Locks the state to change it; the guard publishes the cursor position when dropped.
    fn lock(&self) -> CursorGuard<'_> {
        CursorGuard {
            st: self.state.lock(),
            published: &self.next,
        }
    }
}

struct CursorGuard<'a> {
    st: parking_lot::MutexGuard<'a, CursorState>,
    published: &'a AtomicU64,
}

impl std::ops::Deref for CursorGuard<'_> {
    type Target = CursorState;
    fn deref(&self) -> &CursorState {
        &self.st
    }
}

impl std::ops::DerefMut for CursorGuard<'_> {
    fn deref_mut(&mut self) -> &mut CursorState {
        &mut self.st
    }
}

impl Drop for CursorGuard<'_> {
    fn drop(&mut self) {
        // Still under the lock: stores happen in the order the positions were reached, and a
        // position never goes back, so the copy never does either.
        self.published.store(self.st.next, Ordering::Relaxed);
    }
}

#[derive(Debug)]
struct CursorState {
    /// Log index of the next live entry to deliver.
    next: u64,
    /// Retained entries replayed at subscribe, delivered before the live ones.
    prefix: VecDeque<Arc<Entry>>,
}

impl CursorState {
    /// Applies drop-oldest lazily: evicts beyond `cap`, prefix first; returns how many.
    fn normalize(&mut self, head: u64, cap: usize) -> usize {
        let live = head.saturating_sub(self.next) as usize;
        let over = (self.prefix.len() + live).saturating_sub(cap);
        let from_prefix = over.min(self.prefix.len());
        self.prefix.drain(..from_prefix);
        self.next += (over - from_prefix) as u64;
        over
    }

    fn len(&self, head: u64, cap: usize) -> usize {
        (self.prefix.len() + head.saturating_sub(self.next) as usize).min(cap)
    }

    fn overflow(&self, head: u64, cap: usize) -> usize {
        (self.prefix.len() + head.saturating_sub(self.next) as usize).saturating_sub(cap)
    }
}

/// What [`Queue::pop_cursor`] took.
#[derive(Debug)]
pub(crate) enum CursorPop {
    /// Nothing queued.
    Empty,
    /// Replayed retained entries.
    Prefix(Vec<Arc<Entry>>),
    /// `k` log entries from log index `start`; `entries` is `None` when the caller said it
    /// already has that range.
    Range {
        start: u64,
        k: usize,
        entries: Option<Vec<Arc<Entry>>>,
    },
}

impl Queue {
    /// A cursor queue on `log` (FIFO drop-oldest, `capacity >= 1`), starting at its head.
    pub(crate) fn cursor(capacity: usize, log: Arc<TopicLog>) -> Self {
        let next = log.head();
        Queue {
            store: Store::Cursor(Cursor {
                log,
                state: Mutex::new(CursorState {
                    next,
                    prefix: VecDeque::new(),
                }),
                next: AtomicU64::new(next),
            }),
            policy: SlowConsumer::DropOldest,
            capacity,
        }
    }

    /// The queue's capacity (`max_queue`).
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Identifies the topic log of a cursor queue (0 otherwise).
    pub(crate) fn log_id(&self) -> u64 {
        match &self.store {
            Store::Cursor(c) => c.log.id,
            _ => 0,
        }
    }

    /// Whether this is a cursor into the topic log.
    pub(crate) fn is_cursor(&self) -> bool {
        matches!(self.store, Store::Cursor(_))
    }

    /// Commits lazily applied evictions; returns how many entries they dropped, and the
    /// queue's length after.
    pub(crate) fn normalize(&self) -> (usize, usize) {
        match &self.store {
            Store::Cursor(c) => {
                let head = c.log.head();
                let mut st = c.lock();
                let evicted = st.normalize(head, self.capacity);
                (evicted, st.len(head, self.capacity))
            }
            _ => (0, self.len()),
        }
    }

    /// The first log index a cursor queue can still read (`None` for other queues): its cursor,
    /// or `head - max_queue` if that is further, since drop-oldest evicts everything before it
    /// (the prefix goes first, so no live entry older than the last `max_queue` is ever read).
    /// Never decreases: cursors and the head only move forward, so a stale reading is only
    /// smaller. Takes no lock.
    pub(crate) fn cursor_floor(&self) -> Option<u64> {
        match &self.store {
            Store::Cursor(c) => {
                let next = c.next.load(Ordering::Relaxed);
                Some(next.max(c.log.head().saturating_sub(self.capacity as u64)))
            }
            _ => None,
        }
    }

    /// Evictions not yet committed by [`normalize`](Queue::normalize).
    pub(crate) fn overflow(&self) -> usize {
        match &self.store {
            Store::Cursor(c) => c.state.lock().overflow(c.log.head(), self.capacity),
            _ => 0,
        }
    }

    /// Pops up to `max` entries of a cursor queue; returns the evictions it committed first and
    /// what it took. `have(start, k)` says whether the caller already holds that log range (then
    /// the entries are not cloned).
    pub(crate) fn pop_cursor(
        &self,
        max: usize,
        have: impl FnOnce(u64, usize) -> bool,
    ) -> (usize, CursorPop) {
        let Store::Cursor(c) = &self.store else {
            return (0, CursorPop::Empty);
        };
        let mut st = c.lock();
        let head = c.log.head();
        let mut evicted = st.normalize(head, self.capacity);
        if !st.prefix.is_empty() {
            // The replay and the live entries after it are one queue: one batch of up to `max`,
            // the replay first (the realtime-hub spec's "through the same queue").
            let k = max.min(st.prefix.len());
            let mut batch: Vec<Arc<Entry>> = st.prefix.drain(..k).collect();
            let room = max - k;
            let live = head.saturating_sub(st.next) as usize;
            if st.prefix.is_empty() && room > 0 && live > 0 {
                let log = c.log.inner.lock();
                if st.next < log.base {
                    evicted += (log.base - st.next) as usize;
                    st.next = log.base;
                }
                let from = (st.next - log.base) as usize;
                let take = room.min(log.buf.len().saturating_sub(from));
                batch.extend(log.buf.range(from..from + take).cloned());
                st.next += take as u64;
            }
            return (evicted, CursorPop::Prefix(batch));
        }
        let mut k = max.min(head.saturating_sub(st.next) as usize);
        if k == 0 {
            return (evicted, CursorPop::Empty);
        }
        let mut start = st.next;
        if have(start, k) {
            // Another subscriber took this range this pass: no need to touch the log.
            st.next += k as u64;
            return (
                evicted,
                CursorPop::Range {
                    start,
                    k,
                    entries: None,
                },
            );
        }
        let log = c.log.inner.lock();
        if start < log.base {
            // Cannot happen while the log keeps the largest cursor's `max_queue` entries; if it
            // did, what the log forgot is dropped, never read out of bounds.
            evicted += (log.base - start) as usize;
            k = k.saturating_sub((log.base - start) as usize);
            start = log.base;
            if k == 0 {
                st.next = start;
                return (evicted, CursorPop::Empty);
            }
        }
        st.next = start + k as u64;
        let from = (start - log.base) as usize;
        let entries = Some(log.buf.range(from..from + k).cloned().collect());
        (evicted, CursorPop::Range { start, k, entries })
    }

    pub(crate) fn new(capacity: usize, policy: SlowConsumer, message_priority: bool) -> Self {
        let store = if capacity == 0 {
            Store::Zero
        } else if message_priority {
            Store::Prio(Mutex::new(BTreeMap::new()))
        } else {
            Store::Fifo(OnceLock::new())
        };
        Queue {
            store,
            policy,
            capacity,
        }
    }

    /// Offers `entry` under the policy. Older entries evicted to make room (the result's
    /// `evicted`) are added to `dropped`, the subscriber's drop count, before a consumer can
    /// pop what follows them: under the queue's lock where it has one, so that a consumer
    /// that pops the entry after a gap reads a count that includes the gap (a receiver reports
    /// the loss before that entry, see the receiver's `Handed`).
    pub(crate) fn offer(&self, entry: Arc<Entry>, dropped: &AtomicU64) -> Offer {
        // Relaxed: the count is ordered with the pop by the queue's lock (a consumer takes it
        // after this offer let go of it), or, for the ring, read after the pop of the entry
        // offered with the eviction at best effort.
        let count = |n: usize| {
            if n > 0 {
                dropped.fetch_add(n as u64, Ordering::Relaxed);
            }
        };
        match &self.store {
            Store::Cursor(c) => {
                let mut st = c.lock();
                st.prefix.push_back(entry);
                let evicted = st.normalize(c.log.head(), self.capacity);
                count(evicted);
                Offer::Queued { evicted }
            }
            Store::Zero => match self.policy {
                // Nothing queued, so there is no older message to evict: the incoming one goes.
                SlowConsumer::DropOldest | SlowConsumer::DropNewest => Offer::Dropped,
                SlowConsumer::Disconnect => Offer::Disconnect,
            },
            Store::Fifo(ring) => {
                let ring = ring.get_or_init(|| Box::new(Ring::new(self.capacity)));
                match self.policy {
                    SlowConsumer::DropOldest => match ring.force_push(entry) {
                        Some(_evicted) => {
                            count(1);
                            Offer::Queued { evicted: 1 }
                        }
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
                }
            }
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
                count(evicted);
                Offer::Queued { evicted }
            }
        }
    }

    /// Pops up to `max` entries, in delivery order, into `out`.
    pub(crate) fn pop_into(&self, max: usize, out: &mut Vec<Arc<Entry>>) {
        match &self.store {
            Store::Zero => {}
            Store::Cursor(_) => match self.pop_cursor(max, |_, _| false).1 {
                CursorPop::Prefix(v)
                | CursorPop::Range {
                    entries: Some(v), ..
                } => out.extend(v),
                _ => {}
            },
            Store::Fifo(ring) => {
                let Some(ring) = ring.get() else { return };
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

    /// Discards everything queued; returns how many entries there were. Call
    /// [`normalize`](Queue::normalize) first to count lazily applied evictions apart.
    pub(crate) fn clear(&self) -> usize {
        match &self.store {
            Store::Zero => 0,
            Store::Cursor(c) => {
                let mut st = c.lock();
                let head = c.log.head();
                let n = st.len(head, self.capacity);
                st.prefix.clear();
                st.next = head;
                n
            }
            Store::Fifo(ring) => {
                let Some(ring) = ring.get() else { return 0 };
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
            Store::Cursor(c) => c.state.lock().len(c.log.head(), self.capacity),
            Store::Fifo(ring) => ring.get().map_or(0, |r| r.len()),
            Store::Prio(map) => map.lock().len(),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64) -> Arc<Entry> {
        Arc::new(Entry::new(seq, seq, 0, Message::binary(vec![0u8]), 0))
    }

    fn ring_allocated(q: &Queue) -> bool {
        match &q.store {
            Store::Fifo(ring) => ring.get().is_some(),
            _ => panic!("not a FIFO queue"),
        }
    }

    #[test]
    fn log_releases_before_the_slowest_cursor_floor_and_counts_stay_exact() {
        let log = Arc::new(TopicLog::default());
        log.set_cap(8);
        let fast = Queue::cursor(8, Arc::clone(&log));
        let slow = Queue::cursor(4, Arc::clone(&log));
        for seq in 0..6 {
            log.append(&entry(seq));
        }
        let (_, popped) = fast.pop_cursor(6, |_, _| false);
        assert!(matches!(popped, CursorPop::Range { start: 0, k: 6, .. }));
        // The slow cursor never read anything, but drop-oldest keeps only its last 4.
        assert_eq!(fast.cursor_floor(), Some(6));
        assert_eq!(slow.cursor_floor(), Some(2));
        log.release_before(2);
        assert_eq!(log.len(), 4);
        assert_eq!(log.head(), 6);
        // The slow cursor still sees its window, and counts the 2 it lost.
        let (evicted, popped) = slow.pop_cursor(8, |_, _| false);
        assert_eq!(evicted, 2);
        let CursorPop::Range {
            start: 2,
            k: 4,
            entries: Some(v),
        } = popped
        else {
            panic!("{popped:?}");
        };
        assert_eq!(v.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3, 4, 5]);
        log.release_before(6);
        assert_eq!(log.len(), 0);
        // A floor past what the log holds releases only what it holds.
        log.release_before(100);
        log.append(&entry(6));
        assert_eq!((log.len(), log.head()), (1, 7));
        assert_eq!(fast.len(), 1);
    }

    #[test]
    fn fifo_queue_allocates_its_ring_on_first_offer() {
        for policy in [SlowConsumer::DropNewest, SlowConsumer::Disconnect] {
            let q = Queue::new(2, policy, false);
            let dropped = AtomicU64::new(0);
            assert!(!ring_allocated(&q));
            // Reading an untouched queue allocates nothing.
            assert_eq!(q.len(), 0);
            assert_eq!(q.clear(), 0);
            let mut out = Vec::new();
            q.pop_into(8, &mut out);
            assert!(out.is_empty());
            assert!(!ring_allocated(&q));

            assert_eq!(q.offer(entry(1), &dropped), Offer::Queued { evicted: 0 });
            assert!(ring_allocated(&q));
            assert_eq!(q.offer(entry(2), &dropped), Offer::Queued { evicted: 0 });
            let full = if policy == SlowConsumer::DropNewest {
                Offer::Dropped
            } else {
                Offer::Disconnect
            };
            assert_eq!(q.offer(entry(3), &dropped), full);
            q.pop_into(8, &mut out);
            assert_eq!(out.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
        }
    }

    /// A priority queue full under drop-oldest evicts the entry furthest from delivery, and
    /// counts it before it lets go of its lock: a consumer that pops the entry after the gap
    /// reads a drop count that includes it.
    #[test]
    fn an_eviction_is_counted_by_the_offer_that_makes_it() {
        for priority in [false, true] {
            let q = Queue::new(2, SlowConsumer::DropOldest, priority);
            let dropped = AtomicU64::new(0);
            for seq in 1..=3 {
                q.offer(entry(seq), &dropped);
            }
            assert_eq!(
                dropped.load(Ordering::Relaxed),
                1,
                "priority queue: {priority}"
            );
            let mut out = Vec::new();
            q.pop_into(8, &mut out);
            assert_eq!(out.len(), 2);
        }
    }

    #[test]
    fn subscriber_queue_is_small() {
        // A cursor subscriber's queue is inline in every subscription; the ring it does not use
        // must not size it.
        assert!(std::mem::size_of::<Queue>() <= 96);
        assert!(std::mem::align_of::<Queue>() <= 8);
    }
}
