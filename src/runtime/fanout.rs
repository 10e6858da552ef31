//! Where fan-out runs: each shard fans a topic's publications out to the subscriptions of its
//! own connections, on its own thread, straight into their outboxes.
//!
//! The hub keeps, per topic, one [`Tap`] per interested shard (attached on the shard's first
//! subscription to the topic, detached after its last). A publish from any thread hands the
//! entry to each tap of the topic: the tap appends it, tagged with the topic's slot in the
//! shard's table, to the shard's one inbox (a lock-free [`SegQueue`](crossbeam_queue::SegQueue)) and, when the shard's
//! inbox was not listed yet, lists it and wakes the shard. So a publish costs O(1) plus
//! O(interested shards), takes only the hub's topics read lock (which no fan-out holds) and
//! never blocks.
//!
//! The shard, between IO waits, takes its inbox in the order the publications reached it, cuts
//! each run of one topic's publications into batches of at most `subscriptions.max_batch`, and
//! hands each batch's encoding (the NDJSON lines, or the hub's binary frame) to every local
//! subscriber's [`Outbox`](crate::outbox::Outbox), the only queue of a push subscription, as
//! the same `Bytes`. One inbox per shard, not one per topic, keeps a connection's deliveries in
//! the order they were published across all its subscriptions: what one publisher publishes to
//! topics `A` and `B` in turn reaches a subscriber of both in that order. A batch is cut and
//! encoded once for every shard that takes the same publications: the first shard to reach a
//! publication seals the batch that starts there, and the others follow the seal and send its
//! encodings ([`SealedBatch`](crate::hub::SealedBatch)). There is no per-delivery message
//! between threads, no completion, and no queue with rules other than the push-stream spec's.
//!
//! A topic's slot is reused after the topic leaves the shard's table; each tenant of a slot
//! has a generation of its own, so an entry still in the inbox for the previous tenant is
//! dropped, not delivered to the next.
//!
//! # The listing handshake
//!
//! The inbox is listed with its shard at most once until the shard takes it ([`DirtyFlag`]):
//!
//! - publisher: push the entry into the inbox, then `mark` (a `swap(true)`, release): if it
//!   read `false`, wake the shard;
//! - shard: `take` (a `swap(false)`, acquire), then drain the inbox; before it sleeps, it looks
//!   at the inbox and at the flag ([`DirtyFlag::is_listed`]) and does not sleep if either shows
//!   work.
//!
//! The two swaps are read-modify-writes of one flag, so they are totally ordered and each reads
//! the value the one before it wrote. A `mark` that reads `true` comes before the `take` that
//! will clear it; that `take` reads from the `mark` (or a later one), so the entry pushed before
//! the `mark` is visible to the drain after the `take`. A `mark` after the `take` reads `false`
//! and wakes the shard again. A `mark` that lands while the shard drains (its wake-up finds the
//! shard awake) leaves the flag set after the drain took its entry: the shard sees the flag
//! before it sleeps and drains again, so the next publisher, whose `mark` reads `true` and wakes
//! nobody, is not left waiting. No entry is left in an inbox that nobody will drain; the model
//! in this module's loom tests checks it with two publishers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering as StdOrdering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::shard::{ConnKey, ShardHandle};
use super::Shared;
use crate::hub::{Entry, Tap, TapMember};
use crate::loom::sync::atomic::{AtomicBool, Ordering};

/// Whether a shard's inbox is listed (see the [module documentation](self)).
#[derive(Debug, Default)]
pub(crate) struct DirtyFlag(AtomicBool);

impl DirtyFlag {
    /// Publisher side, after queuing: `true` when the caller must wake the shard.
    pub(crate) fn mark(&self) -> bool {
        // Release: the entry queued before is visible to the `take` that reads this write.
        // Acquire: a `mark` that reads `false` follows the `take` that wrote it.
        !self.0.swap(true, Ordering::AcqRel)
    }

    /// Shard side, before draining: clears the listing; `true` if the inbox was listed.
    pub(crate) fn take(&self) -> bool {
        // Acquire: pairs with `mark`'s release (the entries queued before it are visible).
        // Release: orders the drain's reads after the clear for later `mark`s' acquires.
        self.0.swap(false, Ordering::AcqRel)
    }

    /// Shard side, after announcing it may sleep: whether the inbox is listed. A listing the
    /// shard has not taken is work, even with the inbox empty (its entry was drained with an
    /// earlier one): the next publisher's `mark` reads `true` and wakes nobody, so the shard
    /// must not sleep on it. `SeqCst`: read after the parker's fence (see [`super::parker`]).
    pub(crate) fn is_listed(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Publications for a shard's topic, as they wait in the shard's inbox: the topic's slot in
/// the shard's [`Fanout`] table and that slot's tenant, and what was published.
#[derive(Debug)]
pub(crate) struct Tapped {
    pub(crate) slot: u32,
    pub(crate) generation: u32,
    pub(crate) publications: Publications,
}

/// What one record of a shard's inbox carries.
#[derive(Debug)]
pub(crate) enum Publications {
    /// One publication.
    One(Arc<Entry>),
    /// A run of one publisher's publications, in order (one record, not one per publication).
    Run(Vec<Arc<Entry>>),
    /// The hub closed: no publication follows.
    Closed,
}

impl Publications {
    /// Moves the publications (none for [`Publications::Closed`]) to the end of `out`, leaving
    /// `Closed` in their place.
    pub(crate) fn take_into(&mut self, out: &mut Vec<Arc<Entry>>) {
        match std::mem::replace(self, Publications::Closed) {
            Publications::One(entry) => out.push(entry),
            Publications::Run(entries) => out.extend(entries),
            Publications::Closed => {}
        }
    }
}

/// A shard's interest in one hub topic, shared between the hub's publishers and the shard.
pub(crate) struct TopicTap {
    /// The topic's slot in its shard's [`Fanout`] table, and the slot's tenant.
    slot: u32,
    generation: u32,
    shard: Arc<ShardHandle>,
    /// Local subscriptions (what a publish counts as delivered to). `Relaxed`: a count.
    count: AtomicUsize,
    /// The local subscriptions' hub ids and transport contexts, for stats and presence (changed
    /// on subscribe and unsubscribe only; never on the publish path).
    members: Mutex<Vec<TapMember>>,
}

impl TopicTap {
    fn hand(&self, publications: Publications) {
        self.shard.tap(Tapped {
            slot: self.slot,
            generation: self.generation,
            publications,
        });
    }
}

impl Tap for TopicTap {
    fn offer(&self, entry: Arc<Entry>) {
        self.hand(Publications::One(entry));
    }

    fn offer_run(&self, entries: Vec<Arc<Entry>>) {
        self.hand(Publications::Run(entries));
    }

    fn subscribers(&self) -> usize {
        self.count.load(StdOrdering::Relaxed)
    }

    fn members(&self, out: &mut Vec<TapMember>) {
        out.extend(self.members.lock().iter().cloned());
    }

    fn hub_closed(&self) {
        self.hand(Publications::Closed);
    }
}

/// One push subscription of a local connection.
#[derive(Debug, Clone)]
pub(crate) struct LocalSub {
    pub(crate) conn: ConnKey,
    /// The subscription id the client sees.
    pub(crate) id: Arc<str>,
    /// The hub subscriber id (stats, presence).
    pub(crate) hub_id: Arc<str>,
    /// The connection's wire form is the hub's binary frame.
    pub(crate) hub_frames: bool,
    /// Another subscription of its connection to this topic takes lines too: the fan-out
    /// interleaves their deliveries message by message (the connection's FIFO), instead of
    /// queueing one subscription's batch after the other's. Kept by [`Fanout`].
    pub(crate) repeated: bool,
    /// Bytes fanned out to it (its stats row's `bytes_sent`): written by the shard thread
    /// only (a load and a store, no read-modify-write), read by `stats()`.
    pub(crate) bytes_sent: Arc<AtomicU64>,
}

impl LocalSub {
    /// Counts `n` more bytes handed to the subscription's outbox.
    pub(crate) fn count_sent(&self, n: usize) {
        // Relaxed: a statistic; this thread is its only writer.
        let total = self.bytes_sent.load(StdOrdering::Relaxed) + n as u64;
        self.bytes_sent.store(total, StdOrdering::Relaxed);
    }
}

/// A topic some local connection subscribes to.
pub(crate) struct LocalTopic {
    pub(crate) name: Arc<str>,
    /// The slot's tenant (see [`Tapped`]).
    pub(crate) generation: u32,
    pub(crate) tap: Arc<TopicTap>,
    pub(crate) subs: Vec<LocalSub>,
    /// How many of `subs` want the hub's binary frame (the rest want NDJSON lines).
    pub(crate) hub_frame_subs: usize,
    /// How many of `subs` are [`LocalSub::repeated`] (nearly always none).
    pub(crate) repeated: usize,
}

/// A shard's topics: the subscriptions of its connections by topic (shard thread only).
pub(crate) struct Fanout {
    topics: Vec<Option<LocalTopic>>,
    index: HashMap<Arc<str>, u32>,
    free: Vec<u32>,
    /// The next slot tenant's generation.
    generation: u32,
    /// The engine (its hub, and its count of push subscriptions, `EngineStats::subscriptions`,
    /// kept here where subscriptions are added and removed).
    shared: Arc<Shared>,
    /// The shard whose table this is (the taps list topics with it).
    shard: Arc<ShardHandle>,
}

impl Fanout {
    /// The empty table of `shard`.
    pub(crate) fn new(shared: Arc<Shared>, shard: Arc<ShardHandle>) -> Fanout {
        Fanout {
            topics: Vec::new(),
            index: HashMap::new(),
            free: Vec::new(),
            generation: 0,
            shared,
            shard,
        }
    }

    /// The slot of `topic`, if a local connection subscribes to it.
    pub(crate) fn slot_of(&self, topic: &str) -> Option<u32> {
        self.index.get(topic).copied()
    }

    /// The topic in `slot`, if `generation` is its tenant.
    pub(crate) fn topic(&self, slot: u32, generation: u32) -> Option<&LocalTopic> {
        self.topics
            .get(slot as usize)?
            .as_ref()
            .filter(|t| t.generation == generation)
    }

    /// Adds a subscription (attaching the shard's tap to the hub topic on its first one).
    /// `also_subscribed`: its connection already has a subscription to `topic` (the caller
    /// knows from the connection's own, a few at most, rather than from the topic's, which may
    /// be many). `false` when the hub is closed.
    pub(crate) fn subscribe(
        &mut self,
        topic: &str,
        mut sub: LocalSub,
        transport: Arc<dyn std::any::Any + Send + Sync>,
        also_subscribed: bool,
    ) -> bool {
        let slot = match self.slot_of(topic) {
            Some(slot) => slot,
            None => {
                let slot = self.free.pop().unwrap_or_else(|| {
                    self.topics.push(None);
                    (self.topics.len() - 1) as u32
                });
                let generation = self.generation;
                self.generation = self.generation.wrapping_add(1);
                let tap = Arc::new(TopicTap {
                    slot,
                    generation,
                    shard: Arc::clone(&self.shard),
                    count: AtomicUsize::new(0),
                    members: Mutex::new(Vec::new()),
                });
                let as_tap: Arc<dyn Tap> = Arc::clone(&tap) as Arc<dyn Tap>;
                if !self.shared.hub.attach_tap(topic, as_tap) {
                    self.free.push(slot);
                    return false;
                }
                let name: Arc<str> = Arc::from(topic);
                self.index.insert(Arc::clone(&name), slot);
                self.topics[slot as usize] = Some(LocalTopic {
                    name,
                    generation,
                    tap,
                    subs: Vec::new(),
                    hub_frame_subs: 0,
                    repeated: 0,
                });
                slot
            }
        };
        let t = self.topics[slot as usize]
            .as_mut()
            .expect("indexed slots are occupied");
        t.tap.members.lock().push(TapMember {
            id: Arc::clone(&sub.hub_id),
            transport,
            bytes_sent: Arc::clone(&sub.bytes_sent),
        });
        t.tap.count.fetch_add(1, StdOrdering::Relaxed);
        t.hub_frame_subs += usize::from(sub.hub_frames);
        if also_subscribed && !sub.hub_frames {
            // The connection's other subscriptions to the topic interleave with this one.
            for other in t
                .subs
                .iter_mut()
                .filter(|s| s.conn == sub.conn && !s.repeated)
            {
                other.repeated = true;
                t.repeated += 1;
            }
            sub.repeated = true;
            t.repeated += 1;
        }
        t.subs.push(sub);
        self.shared
            .counters_of(self.shard.index)
            .subscriptions
            .fetch_add(1, StdOrdering::Relaxed);
        true
    }

    /// Removes subscription `id` of connection `conn` from `topic` (detaching the tap after the
    /// topic's last one); `false` if it was not there.
    pub(crate) fn unsubscribe(&mut self, topic: &str, conn: ConnKey, id: &str) -> bool {
        let Some(slot) = self.slot_of(topic) else {
            return false;
        };
        let Some(t) = self.topics[slot as usize].as_mut() else {
            return false;
        };
        let Some(at) = t.subs.iter().position(|s| s.conn == conn && &*s.id == id) else {
            return false;
        };
        let sub = t.subs.swap_remove(at);
        t.hub_frame_subs -= usize::from(sub.hub_frames);
        if sub.repeated {
            t.repeated -= 1;
            let mut left = t.subs.iter_mut().filter(|s| s.conn == conn);
            if let (Some(last), None) = (left.next(), left.next()) {
                // The connection's only subscription to the topic now.
                last.repeated = false;
                t.repeated -= 1;
            }
        }
        t.tap.count.fetch_sub(1, StdOrdering::Relaxed);
        self.shared
            .counters_of(self.shard.index)
            .subscriptions
            .fetch_sub(1, StdOrdering::Relaxed);
        t.tap
            .members
            .lock()
            .retain(|m| !Arc::ptr_eq(&m.id, &sub.hub_id));
        if t.subs.is_empty() {
            self.remove_topic(slot);
        }
        true
    }

    /// Detaches and forgets the topic in `slot` with its subscriptions (what the shard's inbox
    /// still holds for it is dropped when taken: the slot's next tenant has another generation).
    pub(crate) fn remove_topic(&mut self, slot: u32) {
        let Some(t) = self.topics.get_mut(slot as usize).and_then(Option::take) else {
            return;
        };
        self.shared
            .counters_of(self.shard.index)
            .subscriptions
            .fetch_sub(t.subs.len(), StdOrdering::Relaxed);
        let tap: Arc<dyn Tap> = t.tap;
        self.shared.hub.detach_tap(&t.name, &tap);
        self.index.remove(&t.name);
        self.free.push(slot);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::DirtyFlag;
    use loom::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
    use loom::sync::{Arc, Mutex};
    use std::collections::VecDeque;

    /// Two publishers each queue an entry, mark the inbox and, when the mark says so, wake the
    /// shard if it announced it may sleep (the parker's `should_wake`). The shard takes the
    /// listing and drains, announces it may sleep, and looks at the inbox and the flag as the
    /// shard loop does: if either shows work it drains again, else it sleeps. At the end either
    /// every entry was drained, or the shard sleeps and a publisher woke it: an entry never
    /// waits in an inbox nobody will drain.
    #[test]
    fn an_entry_is_never_left_in_an_inbox_with_the_shard_asleep_and_unwoken() {
        loom::model(|| {
            let flag = Arc::new(DirtyFlag::default());
            // The inbox stands for the SegQueue (linearizable: modelled with a lock); `asleep`
            // for the parker's `parked` word, with its fences (`park_begin`, `should_wake`).
            let inbox = Arc::new(Mutex::new(VecDeque::new()));
            let asleep = Arc::new(AtomicBool::new(false));
            let woken = Arc::new(AtomicUsize::new(0));
            let publishers: Vec<_> = (0..2u64)
                .map(|n| {
                    let (flag, inbox, asleep, woken) = (
                        Arc::clone(&flag),
                        Arc::clone(&inbox),
                        Arc::clone(&asleep),
                        Arc::clone(&woken),
                    );
                    loom::thread::spawn(move || {
                        inbox.lock().unwrap().push_back(n);
                        if flag.mark() {
                            fence(Ordering::SeqCst);
                            if asleep.load(Ordering::Relaxed) {
                                woken.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    })
                })
                .collect();
            let mut drained = Vec::new();
            let mut slept = false;
            for _ in 0..3 {
                flag.take();
                drained.extend(inbox.lock().unwrap().drain(..));
                asleep.store(true, Ordering::Relaxed);
                fence(Ordering::SeqCst);
                if flag.is_listed() || !inbox.lock().unwrap().is_empty() {
                    asleep.store(false, Ordering::Relaxed);
                    continue;
                }
                slept = true;
                break;
            }
            for p in publishers {
                p.join().unwrap();
            }
            let left = inbox.lock().unwrap().len();
            assert!(
                left == 0 || !slept || woken.load(Ordering::SeqCst) > 0,
                "{left} entries wait while the shard sleeps and nobody woke it (drained {drained:?})"
            );
        });
    }
}
