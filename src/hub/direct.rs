//! Receivers that read their topic directly: the FIFO `drop-oldest` [`Receiver`]s (the default)
//! take no part in the drain.
//!
//! A topic with such receivers keeps a [`DirectLog`]: its publications in chunks of [`CHUNK`]
//! write-once slots. The publisher appends (under the topic's order lock, so appends are
//! serialized and numbered); each receiver keeps its own position and holds one chunk by
//! reference, so that receiving a message is a few loads with no lock and no reference count,
//! and moving to the next chunk takes the log's chunk list lock once per [`CHUNK`] messages.
//! The slots and the head that publishes them are [`super::slots`]'s, checked under loom.
//! This is `tokio::sync::broadcast`'s shape (one buffer, a cursor per receiver) with the
//! messages handed out by chunk.
//!
//! The slow-consumer policy is applied lazily, with the counts the eager policy gives: a
//! receiver's queue is its retained replay plus the publications after its position; when a
//! receive finds it longer than `max_queue`, the oldest are dropped (the replay first), counted,
//! and reported as [`Lagged`](super::RecvError::Lagged). The log keeps the chunks that hold the
//! last `max_queue` publications of its largest receiver, so a receiver that never receives pins
//! one chunk, not the topic's history.
//!
//! [`Receiver`]: super::Receiver

use std::cell::Cell;
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Waker;
use std::time::Instant;

use crossbeam_utils::CachePadded;
use parking_lot::{Condvar, Mutex};
use powerhub_plugin::CloseReason;

use super::core::StatsGate;
use super::queue::Entry;
use super::slots::{self, Head};
use super::Message;

/// Messages per chunk.
pub(crate) const CHUNK: usize = 64;

/// [`CHUNK`] write-once slots of the log; slot `i` holds publication `first + i`, written once
/// the log's head passes it.
pub(crate) type Chunk = slots::Chunk<Slot>;

/// A publication in the log: inline when the topic's receivers are its only consumers (the
/// publish allocates nothing of its own), or the entry it shares with the topic's other
/// subscribers, taps or retained log.
pub(crate) enum Slot {
    Own(Entry),
    Shared(Arc<Entry>),
}

impl std::ops::Deref for Slot {
    type Target = Entry;

    #[inline]
    fn deref(&self) -> &Entry {
        match self {
            Slot::Own(e) => e,
            Slot::Shared(e) => e,
        }
    }
}

/// A chunk by strong reference (loom's `Arc` under the model checker: the one [`slots`] lends
/// references of).
type ChunkArc = crate::loom::sync::Arc<Chunk>;

/// What an owned receive holds, in one word: a slot of the log, by a reference its chunk lent
/// ([`slots::Chunk::lend`]), or a publication the receiver got whole (its retained replay), by a
/// strong reference.
///
/// A reader lends a run's worth of references at once, so a receive takes no atomic operation
/// of its own; nor does dropping it, on a thread that drops messages of one chunk in a row (see
/// [`Returns`]). A slot's reference keeps its whole chunk (at most [`CHUNK`] publications) in
/// memory, as long as it is held.
///
/// The word is a chunk's address (chunks are aligned to `2 * CHUNK` bytes) with the slot's index
/// in the bits below, shifted past bit 0; or an `Arc<Entry>`'s address (`Arc::into_raw`, aligned
/// to 8) with bit 0 set. One word, so that a message is moved in one register.
pub(crate) struct Held(NonNull<u8>);

/// Bit 0 set: the word is a whole publication's address.
const WHOLE: usize = 1;
/// The bits of a slot's index (shifted by one).
const INDEX: usize = (2 * CHUNK - 1) & !WHOLE;
const _: () = assert!(std::mem::align_of::<Chunk>() >= 2 * CHUNK);
const _: () = assert!(std::mem::align_of::<Entry>() >= 2);

/// A [`Held`] word taken apart.
enum Parts {
    Slot(*const Chunk, usize),
    Whole(*const Entry),
}

// SAFETY: a `Held` is a counted reference to a publication that is never written again (a slot
// is written once, before the head the lending reader loaded; a whole entry is immutable behind
// its `Arc`), so it is shared as an `&Entry` is, which `Entry: Sync` allows (and a chunk, its
// slots included, is dropped by whichever thread lets go of it last, which `Entry: Send` allows);
// the counts it gives back on drop are atomic, on any thread.
unsafe impl Send for Held {}
// SAFETY: as `Send`: `&Held` only reads the publication.
unsafe impl Sync for Held {}

impl Held {
    /// A slot's word: the caller holds one reference `chunk` lent for it. The address is the
    /// `Arc`'s (`Arc::as_ptr`, whose provenance covers the allocation): the give-back that
    /// drops the lent references' strong reference goes through it, to `Arc::from_raw`.
    #[inline]
    fn slot(chunk: &ChunkArc, pos: u64) -> Held {
        let index = (pos - chunk.first()) as usize;
        debug_assert!(index < CHUNK);
        let p = NonNull::new(ChunkArc::as_ptr(chunk).cast_mut()).expect("an Arc is not null");
        Held(p.cast::<u8>().map_addr(|a| a | index << 1))
    }

    /// A whole publication's word.
    pub(crate) fn whole(e: Arc<Entry>) -> Held {
        let p = NonNull::new(Arc::into_raw(e).cast_mut()).expect("an Arc is not null");
        Held(p.cast::<u8>().map_addr(|a| a | WHOLE))
    }

    #[inline]
    fn parts(&self) -> Parts {
        let p = self.0.as_ptr();
        if p.addr() & WHOLE != 0 {
            Parts::Whole(p.map_addr(|a| a & !WHOLE).cast::<Entry>())
        } else {
            Parts::Slot(
                p.map_addr(|a| a & !INDEX).cast::<Chunk>(),
                (p.addr() & INDEX) >> 1,
            )
        }
    }

    /// The publication.
    #[inline]
    pub(crate) fn entry(&self) -> &Entry {
        match self.parts() {
            // SAFETY: the lent reference keeps the chunk alive; the slot was below a head the
            // lending reader loaded, and this word reached the current thread from that one
            // through a synchronizing hand-over (`Send`), so the slot's one write happens before
            // this read.
            Parts::Slot(chunk, index) => unsafe {
                let chunk = &*chunk;
                chunk.get(chunk.first() + index as u64)
            },
            // SAFETY: the word owns a strong reference to the entry.
            Parts::Whole(e) => unsafe { &*e },
        }
    }

    /// The message, owned: moved out when this was the last reference to a whole publication.
    pub(crate) fn into_message(self) -> Message {
        match self.parts() {
            Parts::Whole(e) => {
                std::mem::forget(self);
                // SAFETY: the word's strong reference, taken over from the forgotten word.
                let e = unsafe { Arc::from_raw(e) };
                match Arc::try_unwrap(e) {
                    Ok(e) => e.message,
                    Err(e) => e.message.clone(),
                }
            }
            Parts::Slot(..) => self.entry().message.clone(),
        }
    }
}

impl Clone for Held {
    fn clone(&self) -> Held {
        match self.parts() {
            // SAFETY: `self` is a lent reference of this chunk, not given back.
            Parts::Slot(chunk, _) => unsafe { Chunk::lend_more(chunk, 1) },
            // SAFETY: `self` owns a strong reference from `Arc::into_raw`.
            Parts::Whole(e) => unsafe { Arc::increment_strong_count(e) },
        }
        Held(self.0)
    }
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        match self.parts() {
            Parts::Slot(chunk, _) => {
                let deferred = RETURNS.try_with(|r| r.give_back(chunk));
                if deferred.is_err() {
                    // The thread's returns are gone (it is exiting): given back now.
                    // SAFETY: one lent reference of this chunk, given back once, here.
                    unsafe { Chunk::give_back(chunk, 1) };
                }
            }
            // SAFETY: the word's strong reference, from `Arc::into_raw`, dropped once.
            Parts::Whole(e) => drop(unsafe { Arc::from_raw(e) }),
        }
    }
}

/// The references this thread gave back to one chunk and not yet to the chunk: consecutive
/// drops of messages of one chunk (what a consumer does, run after run) count here, with no
/// atomic operation, and reach the chunk together, when a message of another chunk is dropped
/// on this thread, when a receiver on this thread finds nothing to receive or waits, or when the
/// thread exits. So a thread holds back at most one chunk (at most [`CHUNK`] publications)
/// from being freed: until one of those, if it stops using the hub (as an epoch-based
/// collector's thread holds its local garbage until it pins again).
struct Returns {
    /// The chunk, while `n > 0` (and then alive: the references counted here are out).
    chunk: Cell<*const Chunk>,
    n: Cell<usize>,
}

thread_local! {
    static RETURNS: Returns = const {
        Returns {
            chunk: Cell::new(std::ptr::null()),
            n: Cell::new(0),
        }
    };
}

impl Returns {
    /// Counts one reference of `chunk` given back (see [`Held`]'s drop).
    #[inline]
    fn give_back(&self, chunk: *const Chunk) {
        // While `n > 0` the chunk counted here is alive, so no other chunk has its address: an
        // equal address is the same chunk.
        if self.chunk.get() == chunk {
            self.n.set(self.n.get() + 1);
        } else {
            self.hand_over(chunk, 1);
        }
    }

    /// Gives what is counted back to its chunk.
    fn flush(&self) {
        self.hand_over(std::ptr::null(), 0);
    }

    /// Counts `n` references of `chunk` from now on, and gives what was counted back to its
    /// chunk. The cells are updated first: the give-back may free a chunk and its messages (and
    /// run their owners' code, which may drop messages on this thread again).
    fn hand_over(&self, chunk: *const Chunk, n: usize) {
        let old = self.chunk.replace(chunk);
        let counted = self.n.replace(n);
        if counted > 0 {
            // SAFETY: `counted` references of `old`, given back on this thread and counted
            // here only, reach the chunk once.
            unsafe { Chunk::give_back(old, counted) };
        }
    }
}

impl Drop for Returns {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Gives the references this thread holds back (see [`Returns`]) to their chunk: a receiver
/// calls it when it finds nothing to receive, and before it waits.
pub(crate) fn flush_returns() {
    let _ = RETURNS.try_with(Returns::flush);
}

/// What a publication writes and a receiver reads to learn of it, on a cache line of its own:
/// the publisher's lock and the chunk list are not on it, so a receiver that polls the head
/// does not take the line the next append locks away from the publisher.
struct HeadLine {
    /// Publications appended (see [`Head`]).
    appended: Head,
    /// Receivers blocked or with a registered waker; publishers take `wake` only when non-zero.
    /// Next to `appended`: the publisher reads it right after its store. SeqCst, as the head's
    /// load and store (see [`DirectLog::wait_until`]).
    waiting: AtomicUsize,
}

/// A direct log's writing end, kept by the topic's publishers under the lock that serializes
/// them (the topic's order lock): the chunk being written and the next publication's number (a
/// copy of the head on the publisher's side, so that an append does not load the line the
/// receivers poll). Empty until the first append, and after the log it was for ended.
#[derive(Default)]
pub(crate) struct Tail(Option<TailAt>);

struct TailAt {
    /// The log it writes (by strong reference: its identity is checked at every append).
    log: Arc<DirectLog>,
    chunk: ChunkArc,
    next: u64,
}

/// A topic's publications for its direct receivers.
pub(crate) struct DirectLog {
    /// The readable chunks, oldest first: those holding the last `cap` publications; the last
    /// is the one being written. Publishers (one at a time: they hold the topic's order lock)
    /// take it once per chunk, to add one (see [`Tail`]); receivers once per chunk, to look
    /// their next one up.
    chunks: Mutex<VecDeque<ChunkArc>>,
    head: CachePadded<HeadLine>,
    /// The largest `max_queue` among the receivers; the chunks kept cover it.
    cap: AtomicUsize,
    /// Wake-ups so far (the epoch), and the wakers registered since the last one.
    wake: Mutex<(u64, Vec<Waker>)>,
    cv: Condvar,
}

impl DirectLog {
    /// A log whose next publication is number `head` (the topic's publications so far, so that
    /// a receiver of a new log and one of an older log agree on nothing: each starts at its own
    /// log's head).
    pub(crate) fn new(cap: usize) -> Arc<DirectLog> {
        Arc::new(DirectLog {
            chunks: Mutex::new(VecDeque::new()),
            head: CachePadded::new(HeadLine {
                appended: Head::new(),
                waiting: AtomicUsize::new(0),
            }),
            cap: AtomicUsize::new(cap),
            wake: Mutex::new((0, Vec::new())),
            cv: Condvar::new(),
        })
    }

    /// Publications appended so far: a new receiver starts here.
    pub(crate) fn head(&self) -> u64 {
        self.head.appended.load()
    }

    /// The head as a bound check reads it (see [`Head::peek`]): never used to read a slot.
    #[inline]
    fn head_peek(&self) -> u64 {
        self.head.appended.peek()
    }

    /// Keeps at least the last `cap` publications (the largest `max_queue`).
    pub(crate) fn set_cap(&self, cap: usize) {
        self.cap.store(cap, Ordering::Relaxed);
    }

    /// Appends a publication at `tail`, the log's writing end as the topic's publishers keep it
    /// (`&mut`: they hold the topic's order lock, which serializes appends). The chunk list's
    /// lock is taken only to start a chunk (one publication in [`CHUNK`]), or when `tail` is
    /// another log's or new.
    pub(crate) fn append(self: &Arc<Self>, tail: &mut Tail, entry: Slot) {
        let gone = match &tail.0 {
            Some(t) if Arc::ptr_eq(&t.log, self) && t.next < t.chunk.end() => None,
            _ => self.start_chunk(tail),
        };
        let t = tail.0.as_mut().expect("the tail was set above");
        // SAFETY: appends are serialized: `tail` is borrowed mutably, and it is this log's
        // (checked above, by strong reference, so not a freed log's address reused); `t.next` is
        // the head's value (it moves with the head, here, and starts from it); `t.chunk` holds
        // it (checked above against its end; it starts at or before the head).
        unsafe { self.head.appended.publish(&t.chunk, t.next, entry) };
        t.next += 1;
        if self.head.waiting.load(Ordering::SeqCst) > 0 {
            self.wake_all();
        }
        // The chunk let go is freed outside the lock (with the last reference to its messages,
        // when no receiver holds it).
        drop(gone);
    }

    /// Points `tail` at the chunk the next publication goes to: the last listed chunk, or a new
    /// one when the last is full (then the chunks past the bound leave the list: the last of
    /// those is returned, to be dropped outside the lock).
    #[cold]
    fn start_chunk(self: &Arc<Self>, tail: &mut Tail) -> Option<ChunkArc> {
        // The head moves only by appends, which the caller serializes: it is the next
        // publication's number.
        let next = self.head();
        let mut chunks = self.chunks.lock();
        let mut gone = None;
        if chunks.back().is_none_or(|c| c.end() <= next) {
            chunks.push_back(ChunkArc::new(Chunk::new(next, CHUNK)));
            // At least one chunk stays: the one being written. One chunk goes per chunk made;
            // more only after the bound shrank, and all but the last of those drop here.
            let keep = self.cap.load(Ordering::Relaxed).div_ceil(CHUNK) + 1;
            while chunks.len() > keep {
                gone = chunks.pop_front();
            }
        }
        let chunk = ChunkArc::clone(chunks.back().expect("a chunk with room"));
        drop(chunks);
        tail.0 = Some(TailAt {
            log: Arc::clone(self),
            chunk,
            next,
        });
        gone
    }

    /// Wakes every waiting receiver (a publication, or a receiver's end).
    pub(crate) fn wake_all(&self) {
        let wakers = {
            let mut w = self.wake.lock();
            self.cv.notify_all();
            w.0 += 1;
            std::mem::take(&mut w.1)
        };
        if !wakers.is_empty() {
            self.head.waiting.fetch_sub(wakers.len(), Ordering::SeqCst);
        }
        for w in wakers {
            w.wake();
        }
    }

    /// The first publication the log still holds (`None` before the first).
    fn oldest(&self) -> Option<u64> {
        self.chunks.lock().front().map(|c| c.first())
    }

    /// The chunk holding `pos`, if it is still (or already) listed.
    fn chunk_of(&self, pos: u64) -> Option<ChunkArc> {
        let chunks = self.chunks.lock();
        let first = chunks.front()?.first();
        let i = pos.checked_sub(first)? / CHUNK as u64;
        chunks.get(i as usize).cloned()
    }

    /// Blocks the calling thread until `ready()` or `deadline`; `false` on the deadline.
    /// The receiver counts itself in `waiting` (SeqCst) before it re-checks, and the publisher
    /// stores `head` (SeqCst) before it loads `waiting`: one of the two sees the other, so no
    /// wake-up is lost.
    pub(crate) fn wait_until(&self, ready: impl Fn() -> bool, deadline: Option<Instant>) -> bool {
        let mut g = self.wake.lock();
        self.head.waiting.fetch_add(1, Ordering::SeqCst);
        let mut in_time = true;
        if !ready() {
            match deadline {
                None => self.cv.wait(&mut g),
                Some(d) => in_time = !self.cv.wait_until(&mut g, d).timed_out(),
            }
        }
        self.head.waiting.fetch_sub(1, Ordering::SeqCst);
        in_time
    }

    /// Registers `waker` for the next publication or end, unless `ready()` already (then
    /// `None`: poll again); returns the epoch it is registered in. `known` is the epoch and
    /// waker of the caller's previous registration: one still pending for the same task is not
    /// repeated, so a task polled often does not pile up wakers. Ordered as
    /// [`wait_until`](DirectLog::wait_until).
    pub(crate) fn register(
        &self,
        waker: &Waker,
        known: Option<&(u64, Waker)>,
        ready: impl Fn() -> bool,
    ) -> Option<u64> {
        let mut g = self.wake.lock();
        self.head.waiting.fetch_add(1, Ordering::SeqCst);
        if ready() {
            self.head.waiting.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        if known.is_some_and(|(epoch, w)| *epoch == g.0 && w.will_wake(waker)) {
            self.head.waiting.fetch_sub(1, Ordering::SeqCst);
        } else {
            g.1.push(waker.clone());
        }
        Some(g.0)
    }
}

/// What a direct receiver shares with the hub: its position (for `stats()`), and its end.
pub(crate) struct DirectCursor {
    pub(crate) log: OnceLock<Arc<DirectLog>>,
    /// The first publication of the log the receiver reads, and its retained replay: set at
    /// subscribe, taken by the receiver.
    pub(crate) start: Mutex<Option<(u64, Vec<Arc<Entry>>)>>,
    /// The next publication to receive (inside a run, the one after the run's first: runs do
    /// not publish their progress, `received` does). Only `stats()` reads it; stored with
    /// Release after `run_end` and `run_base`, loaded with Acquire before them, so that a `pos`
    /// read shows its run.
    pub(crate) pos: AtomicU64,
    /// The `received` count that `pos` stands for inside a run: each receive since moved the
    /// receiver one publication further (a run receives no replayed message), so `stats()`
    /// counts what the run still holds, not what was received of it.
    run_base: AtomicU64,
    /// The end of the run the receiver reads (see `DirectReader::next`): `stats()` counts the
    /// run as being received, not as dropped, until a receive inside it finds the bound passed
    /// and drops the oldest (so `dropped` only grows: it never counts what is then received).
    pub(crate) run_end: AtomicU64,
    /// Replayed messages not yet received.
    pub(crate) replay_left: AtomicUsize,
    pub(crate) cap: usize,
    /// Messages received (Relaxed: the receiver stores its count at each receive), and
    /// how many of them the hub's `delivered` counter has taken in.
    pub(crate) received: AtomicU64,
    pub(crate) folded: AtomicU64,
    /// Why the subscription ended, and the log's head then: what was published before the end
    /// is still received.
    pub(crate) end: OnceLock<(u64, CloseReason)>,
    /// Messages the policy dropped for this receiver (its lags, and at its end what it never
    /// received), and how many of them the hub's `dropped` counter has taken in (at its removal
    /// and its drop, under the hub's [`StatsGate`]).
    pub(crate) dropped: AtomicU64,
    pub(crate) dropped_folded: AtomicU64,
    /// Set once the hub finished removing the subscription (see `mark_removed`).
    removed: std::sync::atomic::AtomicBool,
    /// Odd while the receiver reads the log's head and publishes what it decided from it (a
    /// lag, a run, an end): `stats()` reads the cursor between two even readings of the same
    /// value (see [`DirectCursor::snapshot`]).
    deciding: AtomicU64,
    /// The hub's stats gate, held while the receiver's counts join the hub's at its drop.
    pub(crate) gate: Arc<StatsGate>,
}

/// A direct receiver's counts as `stats()` shows them, read together.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CursorCounts {
    /// Waiting for the receiver (at most its bound).
    pub(crate) queued: usize,
    /// Dropped: by its lags so far, and beyond its bound now.
    pub(crate) dropped: u64,
    /// Of `dropped`, what the hub's counter has not taken in.
    pub(crate) dropped_unfolded: u64,
    /// Received and not taken in by the hub's `delivered` counter yet.
    pub(crate) received_unfolded: u64,
}

impl DirectCursor {
    pub(crate) fn new(cap: usize, gate: Arc<StatsGate>) -> Arc<DirectCursor> {
        Arc::new(DirectCursor {
            dropped: AtomicU64::new(0),
            dropped_folded: AtomicU64::new(0),
            removed: std::sync::atomic::AtomicBool::new(false),
            deciding: AtomicU64::new(0),
            gate,
            log: OnceLock::new(),
            start: Mutex::new(None),
            pos: AtomicU64::new(0),
            run_base: AtomicU64::new(0),
            run_end: AtomicU64::new(0),
            replay_left: AtomicUsize::new(0),
            cap,
            received: AtomicU64::new(0),
            folded: AtomicU64::new(0),
            end: OnceLock::new(),
        })
    }

    /// The receiver's counts, read while it decides nothing (a receive that starts a run or
    /// lags moves its position and its drop count together; read between, they would count a
    /// loss twice or not at all), waiting out a decision in progress.
    ///
    /// The head read here comes before the fence and the second reading of `deciding`; the
    /// receiver's reading of the head comes after its odd store and its fence (see
    /// [`DirectReader::next_slow`]). So when the second reading shows no decision began, the
    /// next decision reads this head or a later one: what this snapshot counted as beyond the
    /// bound, the receiver drops rather than receives in a run (the head's loads and stores
    /// are SeqCst).
    pub(crate) fn snapshot(&self) -> CursorCounts {
        loop {
            // Acquire: pairs with the receiver's Release store that ends a decision.
            let before = self.deciding.load(Ordering::Acquire);
            if before % 2 == 1 {
                std::thread::yield_now();
                continue;
            }
            let dropped = self.dropped.load(Ordering::Relaxed);
            let received = self.received.load(Ordering::Relaxed);
            let (queued, over) = self.backlog_at(Some(received));
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.deciding.load(Ordering::Relaxed) != before {
                continue;
            }
            return CursorCounts {
                queued,
                dropped: dropped + over as u64,
                dropped_unfolded: dropped
                    .saturating_sub(self.dropped_folded.load(Ordering::Relaxed))
                    + over as u64,
                received_unfolded: received.saturating_sub(self.folded.load(Ordering::Relaxed)),
            };
        }
    }

    /// What the hub's counters have not taken in joins them (`delivered`, `dropped`); the
    /// caller holds the hub's [`StatsGate`].
    ///
    /// Two folds may run at once (a remover on another thread, and the receiver's drop): each
    /// moves the folded mark forward only (`fetch_max`) and counts what lies past the mark it
    /// found, so nothing is counted twice.
    pub(crate) fn fold(&self) -> (u64, u64) {
        let received = self.received.load(Ordering::Relaxed);
        let received = received.saturating_sub(self.folded.fetch_max(received, Ordering::Relaxed));
        let dropped = self.dropped.load(Ordering::Relaxed);
        let dropped =
            dropped.saturating_sub(self.dropped_folded.fetch_max(dropped, Ordering::Relaxed));
        (received, dropped)
    }

    /// The hub is done removing the subscription (its end, its fold, its place among the ended
    /// receivers): the receiver's drop may take its last counts.
    pub(crate) fn mark_removed(&self) {
        // Release: pairs with `wait_removed`'s Acquire.
        self.removed.store(true, Ordering::Release);
    }

    /// Waits until [`mark_removed`](Self::mark_removed): a removal started on another thread
    /// (the subscription's `closed` is set first) is finishing, with no lock held that this
    /// thread holds.
    pub(crate) fn wait_removed(&self) {
        while !self.removed.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
    }

    /// Messages waiting for the receiver (at most `max_queue`; the rest of its run is being
    /// received), and those beyond its run and its bound that the policy drops at the next
    /// receive. `received` is the receiver's count (its progress inside its run); without
    /// it, the rest of the receiver's run counts as queued only within the bound (a receiver
    /// that went reads no more of it, and published its exact position).
    fn backlog_at(&self, received: Option<u64>) -> (usize, usize) {
        let Some(log) = self.log.get() else {
            return (0, 0);
        };
        let head = match self.end.get() {
            Some(&(end, _)) => end,
            None => log.head(),
        };
        // Acquire: pairs with the reader's Release stores (`run_end` and `run_base` before
        // `pos`).
        let mut pos = self.pos.load(Ordering::Acquire);
        let in_run = match received {
            Some(received) => {
                let run_end = self.run_end.load(Ordering::Acquire);
                if pos < run_end {
                    // What the run's receives took since its start (none of them replayed).
                    let base = self.run_base.load(Ordering::Relaxed);
                    pos = (pos + received.saturating_sub(base)).min(run_end);
                }
                run_end.saturating_sub(pos) as usize
            }
            None => 0,
        };
        let live = head.saturating_sub(pos) as usize;
        let total = live + self.replay_left.load(Ordering::Relaxed);
        let over = total.saturating_sub(in_run).saturating_sub(self.cap);
        // What the run holds beyond the bound is in flight, not queued: the receive that finds
        // it past the bound drops it then.
        ((total - over).min(self.cap), over)
    }

    /// As the receiver goes (its drop, after [`DirectReader::sync_cursor`]), once its
    /// subscription ended: the messages beyond its bound that it will never receive, which the
    /// policy drops (added to `dropped`). Its position moves past them (the replay first, then
    /// live publications, as a receive would), so they are counted once.
    pub(crate) fn take_overflow(&self) -> u64 {
        let (_, over) = self.backlog_at(None);
        if over > 0 {
            // Relaxed: the reader, the only other writer, is gone; `stats()` reads a statistic.
            let replay = self.replay_left.load(Ordering::Relaxed);
            let from_replay = over.min(replay);
            self.replay_left
                .store(replay - from_replay, Ordering::Relaxed);
            self.pos
                .fetch_add((over - from_replay) as u64, Ordering::Relaxed);
            self.dropped.fetch_add(over as u64, Ordering::Relaxed);
        }
        over as u64
    }

    /// The subscription ended: record where, and wake the receiver.
    pub(crate) fn close(&self, reason: CloseReason) {
        if let Some(log) = self.log.get() {
            let _ = self.end.set((log.head(), reason));
            log.wake_all();
        } else {
            let _ = self.end.set((0, reason));
        }
    }
}

/// What the next receive of a direct receiver is.
pub(crate) enum Next {
    /// A message: [`DirectReader::current`].
    Message,
    Lagged(u64),
    Empty,
    Closed(CloseReason),
}

/// The receiver's side: its position, the chunk it holds, and the replay left.
pub(crate) struct DirectReader {
    pub(crate) cursor: Arc<DirectCursor>,
    log: Arc<DirectLog>,
    replay: VecDeque<Arc<Entry>>,
    /// The entry returned by the last `Message`, when it came from the replay.
    replayed: Option<Arc<Entry>>,
    chunk: Option<ChunkArc>,
    /// References `chunk` lent this reader and it has not handed out yet (see [`Held`]):
    /// given back when the reader leaves the chunk, or goes.
    lent: usize,
    pos: u64,
    /// Positions below this are in `chunk` and written: the next receives take them with no
    /// lookup (the fast path), each checked against the bound.
    run_end: u64,
    /// The receiver's bound (`max_queue`), kept here for that check.
    cap: u64,
    /// The position last stored in the cursor.
    shown: u64,
    /// The cursor's `deciding` as this reader last stored it (it is its only writer).
    deciding: u64,
    /// What a decision let go (a chunk, dropped replay), dropped once it ended.
    retired_chunk: Option<ChunkArc>,
    retired: Vec<Arc<Entry>>,
}

impl DirectReader {
    pub(crate) fn new(cursor: Arc<DirectCursor>) -> DirectReader {
        let log = Arc::clone(cursor.log.get().expect("set at subscribe"));
        let (pos, replay) = cursor
            .start
            .lock()
            .take()
            .unwrap_or((log.head(), Vec::new()));
        DirectReader {
            cap: cursor.cap as u64,
            cursor,
            log,
            replay: replay.into(),
            replayed: None,
            chunk: None,
            lent: 0,
            pos,
            run_end: 0,
            shown: pos,
            deciding: 0,
            retired_chunk: None,
            retired: Vec::new(),
        }
    }

    /// Where the readable publications end: the log's head, or the subscription's end.
    fn limit(&self) -> (u64, Option<CloseReason>) {
        match self.cursor.end.get() {
            Some(&(end, reason)) => (end, Some(reason)),
            None => (self.log.head(), None),
        }
    }

    /// Whether a receive would find something (a message, a loss or the end).
    pub(crate) fn ready(&self) -> bool {
        !self.replay.is_empty() || self.cursor.end.get().is_some() || self.log.head() > self.pos
    }

    pub(crate) fn log(&self) -> &DirectLog {
        &self.log
    }

    /// The message the last [`Next::Message`] was.
    pub(crate) fn current(&self) -> &Entry {
        if let Some(e) = &self.replayed {
            return e;
        }
        let chunk = self.chunk.as_ref().expect("the last receive was a message");
        // SAFETY: `pos - 1` was just received from this chunk: it was below the run's end, which
        // is below the limit, a head this reader loaded or the subscription's end (taken from
        // the head by the closing thread, passed on through the end's `OnceLock`).
        unsafe { chunk.get(self.pos - 1) }
    }

    /// Whether the next receive is inside the current run and its message still within the
    /// bound: no more than `max_queue` published from it on. Past the bound the oldest are
    /// dropped, as the eager policy would have dropped them while the run was read: the slow
    /// receive says how many (`decide`). The head is peeked (Relaxed): the run's messages were
    /// seen written when it was cut, and a stale head only puts the loss off to a later receive
    /// (it is the loss of publications made meanwhile).
    #[inline]
    pub(crate) fn in_run(&self) -> bool {
        self.pos < self.run_end && self.log.head_peek() - self.pos <= self.cap
    }

    /// The next message of the current run, once [`in_run`](Self::in_run) said it is inside
    /// it and within the bound (the check is not repeated: a head that moved since puts the
    /// loss off to the next receive). `None` outside the run.
    #[inline]
    pub(crate) fn next_in_run(&mut self) -> Option<&Entry> {
        if self.pos >= self.run_end {
            return None;
        }
        let chunk = self.chunk.as_ref()?;
        // SAFETY: `pos` is below the run's end: the chunk holds it, and it is below the limit
        // the run was cut at (see `current`).
        let e = unsafe { chunk.get(self.pos) };
        self.pos += 1;
        Some(e)
    }

    /// The next message when it is inside the current run, owned: as
    /// [`next_in_run`](DirectReader::next_in_run), with a reference from the chunk's loan.
    #[inline]
    pub(crate) fn next_owned_in_run(&mut self) -> Option<Held> {
        if !self.in_run() {
            return None;
        }
        let pos = self.pos;
        self.pos += 1;
        Some(self.lend(pos))
    }

    /// The message the last [`Next::Message`] was, owned.
    pub(crate) fn current_owned(&mut self) -> Held {
        match &self.replayed {
            Some(e) => Held::whole(Arc::clone(e)),
            None => self.lend(self.pos - 1),
        }
    }

    /// A reference to received publication `pos` of the current chunk, from the reader's loan;
    /// an empty loan is renewed for every publication the chunk holds from `pos` on (the most
    /// this reader can still receive from it), with one atomic operation.
    #[inline]
    fn lend(&mut self, pos: u64) -> Held {
        let chunk = self
            .chunk
            .as_ref()
            .expect("a received position is in the held chunk");
        if self.lent == 0 {
            let n = (chunk.end() - pos) as usize;
            Chunk::lend(chunk, n);
            self.lent = n;
        }
        self.lent -= 1;
        Held::slot(chunk, pos)
    }

    /// Gives back what the held chunk lent and the reader did not hand out.
    fn give_back_loan(&mut self) {
        if let Some(chunk) = &self.chunk {
            if self.lent > 0 {
                // SAFETY: `lent` references of this chunk are the reader's, unused.
                unsafe { Chunk::give_back(ChunkArc::as_ptr(chunk), self.lent) };
            }
        }
        self.lent = 0;
    }

    /// Publishes the exact position to the cursor (inside a run it lags by what the run
    /// received): for a count taken when the reader goes.
    pub(crate) fn sync_cursor(&self) {
        self.cursor.pos.store(self.pos, Ordering::Relaxed);
        self.cursor
            .replay_left
            .store(self.replay.len(), Ordering::Relaxed);
    }

    /// The next receive (a lag adds the messages the policy drops now to the cursor's
    /// `dropped`).
    ///
    /// Inside a run (see `run_end`) a receive is two comparisons and an increment: the end
    /// and the chunk are looked up once per run, when it starts, and the bound is checked
    /// against the head at each receive ([`in_run`](Self::in_run)), so no message the eager
    /// policy would have dropped is received.
    #[inline]
    pub(crate) fn next(&mut self) -> Next {
        if self.in_run() {
            self.pos += 1;
            return Next::Message;
        }
        self.next_slow()
    }

    /// A receive outside a run: decides from the log's head (a lag, a run, the end), marked
    /// as a decision in progress for `stats()` (see [`DirectCursor::snapshot`]).
    fn next_slow(&mut self) -> Next {
        self.deciding += 1;
        self.cursor.deciding.store(self.deciding, Ordering::Relaxed);
        // SeqCst: the odd store before this decision's reading of the head (see `snapshot`).
        std::sync::atomic::fence(Ordering::SeqCst);
        // A panic must not leave the count odd: `stats()` would wait for it for ever.
        let decided = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.decide()));
        self.deciding += 1;
        // Release: what the decision published is visible to a snapshot that reads this.
        self.cursor.deciding.store(self.deciding, Ordering::Release);
        // What the decision let go is dropped after it: the last reference to a payload may run
        // its owner's code, which may call `stats()`.
        self.retired_chunk = None;
        self.retired.clear();
        match decided {
            Ok(next) => next,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// Publishes the exact position, with the receive count it stands for (see
    /// `DirectCursor::run_base`): receives inside the run go on from here.
    fn show_pos(&self) {
        let received = self.cursor.received.load(Ordering::Relaxed);
        self.cursor.run_base.store(received, Ordering::Relaxed);
        // Release: after the base (see `DirectCursor::pos`).
        self.cursor.pos.store(self.pos, Ordering::Release);
    }

    fn decide(&mut self) -> Next {
        // Runs do not publish their progress; the end of one does (a store only when it moved,
        // so that an idle receiver's check writes nothing).
        if self.shown != self.pos {
            self.shown = self.pos;
            self.show_pos();
        }
        let (limit, end) = self.limit();
        let live = limit.saturating_sub(self.pos);
        let total = live as usize + self.replay.len();
        let cap = self.cursor.cap;
        if total > cap {
            // Drop-oldest, lazily: the replay goes first, then the oldest live publications.
            let mut over = total - cap;
            let missed = over as u64;
            let from_replay = over.min(self.replay.len());
            self.retired.extend(self.replay.drain(..from_replay));
            over -= from_replay;
            self.pos += over as u64;
            self.show_pos();
            self.cursor
                .replay_left
                .store(self.replay.len(), Ordering::Relaxed);
            self.cursor.dropped.fetch_add(missed, Ordering::Relaxed);
            return Next::Lagged(missed);
        }
        if let Some(e) = self.replay.pop_front() {
            self.cursor
                .replay_left
                .store(self.replay.len(), Ordering::Relaxed);
            self.replayed = Some(e);
            return Next::Message;
        }
        self.replayed = None;
        if self.pos >= limit {
            return match end {
                Some(reason) => Next::Closed(reason),
                None => Next::Empty,
            };
        }
        if !self.chunk.as_ref().is_some_and(|c| c.holds(self.pos)) {
            // Never the last reference: the reader still holds the chunk, until it retires.
            self.give_back_loan();
            self.retired_chunk = std::mem::replace(&mut self.chunk, self.log.chunk_of(self.pos));
        }
        let pos = self.pos;
        // `pos` is below the limit (checked above), so a chunk that holds it holds it written.
        match self.chunk.as_ref().filter(|c| c.holds(pos)) {
            Some(c) => {
                // The run: what this chunk holds below the limit (all of it written: the
                // limit is a head, or an end taken from one).
                self.run_end = c.end().min(limit);
                self.pos += 1;
                // The count once this receive is counted (the receiver's own store, read
                // back), which the new position stands for.
                let base = self.cursor.received.load(Ordering::Relaxed) + 1;
                self.cursor.run_base.store(base, Ordering::Relaxed);
                // Release, the end and the base before the position: see `DirectCursor::pos`.
                self.cursor.run_end.store(self.run_end, Ordering::Release);
                self.cursor.pos.store(self.pos, Ordering::Release);
                Next::Message
            }
            // Not found: the log let the chunk go. That happens when the receiver is behind
            // more than the log keeps (its subscription ended and the log now keeps only what
            // the remaining receivers need), or when publishers moved on between the limit read
            // above and the lookup. What it let go is lost to this receiver: said, and skipped.
            None => match self.log.oldest() {
                Some(first) if first > pos => {
                    // Up to the receiver's end: what lies beyond it was never its own.
                    let to = first.min(limit);
                    let missed = to - pos;
                    self.pos = to;
                    self.show_pos();
                    self.cursor.dropped.fetch_add(missed, Ordering::Relaxed);
                    Next::Lagged(missed)
                }
                // The chunk is listed before `head` moves: not reached.
                _ => Next::Empty,
            },
        }
    }
}

impl Drop for DirectReader {
    fn drop(&mut self) {
        self.give_back_loan();
        flush_returns();
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use loom::sync::atomic::{fence, AtomicU64, Ordering};
    use loom::sync::Arc;
    use loom::thread;

    /// The queue bound of the model.
    const CAP: u64 = 1;

    /// What `stats()` reads of a receiver and what the receiver publishes, as
    /// `DirectCursor` and the log's head keep them.
    #[derive(Default)]
    struct Shared {
        head: AtomicU64,
        deciding: AtomicU64,
        dropped: AtomicU64,
        pos: AtomicU64,
        run_end: AtomicU64,
    }

    /// `DirectCursor::snapshot`'s protocol: the receiver's row (`dropped`, its lags plus what
    /// lies beyond its run and its bound), read between two even readings of `deciding`.
    fn snapshot(s: &Shared) -> u64 {
        loop {
            let before = s.deciding.load(Ordering::Acquire);
            if before % 2 == 1 {
                thread::yield_now();
                continue;
            }
            let dropped = s.dropped.load(Ordering::Relaxed);
            let pos = s.pos.load(Ordering::Acquire);
            let run_end = s.run_end.load(Ordering::Acquire);
            let head = s.head.load(Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if s.deciding.load(Ordering::Relaxed) != before {
                thread::yield_now();
                continue;
            }
            let in_run = run_end.saturating_sub(pos);
            return dropped + (head - pos).saturating_sub(in_run).saturating_sub(CAP);
        }
    }

    /// The receiver: `DirectReader::next_slow` twice (a lag, or a run it then reads whole).
    fn receive(s: &Shared) {
        let (mut pos, mut deciding) = (0u64, 0u64);
        for _ in 0..2 {
            deciding += 1;
            s.deciding.store(deciding, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            s.pos.store(pos, Ordering::Relaxed);
            let head = s.head.load(Ordering::SeqCst);
            if head - pos > CAP {
                let missed = head - pos - CAP;
                pos += missed;
                s.pos.store(pos, Ordering::Relaxed);
                s.dropped.fetch_add(missed, Ordering::Relaxed);
            } else if head > pos {
                // A run up to the head read; its first message now, the rest before the next
                // decision (the reader checks the bound at each receive in a run; a receive
                // that finds it passed is a decision of its own, the branch above).
                s.run_end.store(head, Ordering::Release);
                s.pos.store(pos + 1, Ordering::Release);
                pos = head;
            }
            deciding += 1;
            s.deciding.store(deciding, Ordering::Release);
        }
    }

    /// Two publications, two receives and two snapshots in any interleaving: the second
    /// snapshot never shows fewer drops than the first (a message counted as dropped is never
    /// received in a run that started from an older head).
    #[test]
    fn a_snapshot_never_counts_as_dropped_what_a_run_then_receives() {
        loom::model(|| {
            let s = Arc::new(Shared::default());
            let publisher = {
                let s = Arc::clone(&s);
                thread::spawn(move || {
                    s.head.fetch_add(1, Ordering::SeqCst);
                    s.head.fetch_add(1, Ordering::SeqCst);
                    s.head.fetch_add(1, Ordering::SeqCst);
                })
            };
            let receiver = {
                let s = Arc::clone(&s);
                thread::spawn(move || receive(&s))
            };
            let first = snapshot(&s);
            let second = snapshot(&s);
            assert!(second >= first, "dropped went back: {first} -> {second}");
            publisher.join().unwrap();
            receiver.join().unwrap();
            let last = snapshot(&s);
            assert!(last >= second, "dropped went back: {second} -> {last}");
        });
    }
}
