//! Bounded lock-free per-subscriber rings.
//!
//! Every subscriber owns one [`Ring`]: publishing threads (any number of them) push into it, and
//! the thread that drains the subscriber pops from it. When the ring is full the caller picks the
//! policy: [`Ring::push`] refuses the new value and hands it back (drop-newest), while
//! [`Ring::force_push`] evicts the oldest queued value and returns it (drop-oldest). Nothing ever
//! blocks on a lock, and memory is fixed at construction.
//!
//! # The algorithm
//!
//! This is Dmitry Vyukov's bounded multi-producer multi-consumer array queue ("Bounded MPMC
//! queue", 1024cores, 2010), the same algorithm `crossbeam_queue::ArrayQueue` is built on, with
//! the drop-oldest overwrite that crossbeam added on top of it.
//!
//! The buffer is an array of `capacity` slots. Two counters, `head` (next value to pop) and
//! `tail` (next place to push), never wrap back to zero: they are *positions* that keep counting
//! laps around the array. A position packs two numbers into one `u64`:
//!
//! ```text
//!   position = lap * LAP + index        LAP = (capacity + 1).next_power_of_two()
//!              ^^^^^^^^^   ^^^^^
//!              high bits   low bits: slot index, always < capacity < LAP
//! ```
//!
//! `LAP` is a power of two strictly greater than `capacity`, so the index lives in the low bits,
//! `position & (LAP - 1)`, and stepping past the last index jumps to index 0 of the next lap
//! (`lap_bits + LAP`) instead of carrying into the lap bits by accident. Because `head` and
//! `tail` count laps, "empty" (`head == tail`) and "full" (`head + LAP == tail`) are different
//! values, which a bare index could not tell apart.
//!
//! Each slot also carries a *stamp*, a position that says whose turn it is on that slot:
//!
//! | slot stamp | meaning |
//! | --- | --- |
//! | `p` | empty; the pusher holding position `p` may write it |
//! | `p + 1` | holds the value pushed at position `p`; the popper holding `head == p` may read it |
//! | `p + LAP` | read and released; free for the pusher of the same index one lap later |
//!
//! A pusher reads `tail = p`; if the slot's stamp is `p` it claims the position with a CAS on
//! `tail`, writes the value, and only then stores stamp `p + 1`. A popper reads `head = p`; if the
//! stamp is `p + 1` it claims with a CAS on `head`, reads the value, and stores stamp `p + LAP`.
//! The CAS decides *who* owns a slot; the stamp says *when* the owner finished with it. A stamp one
//! lap behind (`stamp + LAP == tail + 1`) means the slot still holds last lap's value: the ring
//! is full if `head` confirms it. A stamp equal to `head` means nothing was pushed there yet: the
//! ring is empty if `tail` confirms it.
//!
//! `force_push` on a full ring steals the oldest value: it claims `head`'s position with the same
//! CAS a popper uses (so a racing [`Ring::pop`] and the overwrite can never both take that
//! value), moves `tail` forward, swaps its value into the slot, and publishes the slot with the
//! stamp of its own position. `force_push` and `pop` are therefore linearizable: every value
//! pushed is returned exactly once, by `pop`, by `force_push` as the evicted value, or by `Drop`.
//!
//! # Progress
//!
//! Claiming is lock-free (a CAS fails only because another thread's CAS succeeded). Between a
//! claim and the stamp store that publishes it, a thread that wants the *same* slot waits for
//! that owner: this window is a single write of `T`, the price every array queue of this family
//! pays. Waiting spins, then yields.
//!
//! # Why this ring and not `crossbeam_queue::ArrayQueue`
//!
//! The benchmark `benches/ring.rs` compares this ring with `crossbeam_queue::ArrayQueue` and
//! `crossbeam_channel::bounded`: one thread pushing and popping, overwriting into a full ring, and
//! moving values from one or two producer threads to a consumer. Being the same algorithm, the
//! ring measures on par with `ArrayQueue` (within the run-to-run noise of the cross-thread
//! figures) and ahead of the channel. It is kept because its atomics and cells go through the
//! crate's loom facade, so the exact code the hub runs is model-checked (`tests/loom_ring.rs`);
//! `ArrayQueue`'s std atomics are invisible to loom.
//!
//! # Why no single-consumer variant
//!
//! Each ring has a single drainer, yet `pop` still claims `head` with a CAS: `force_push` moves
//! `head` from the publishing threads, so `head` has several writers whenever drop-oldest is in
//! use, and a single-consumer pop that plain-stores `head` would race with that eviction. Making
//! the consumer the only writer of `head` would need publishers to overwrite a slot the consumer
//! may be reading, which for a non-`Copy` `T` cannot be done without torn reads. An uncontended
//! push plus pop costs about as much as the channel's and `ArrayQueue`'s (tens of nanoseconds,
//! see the benchmark), most of it the two CASes; a split single-producer ring (rtrb's shape)
//! would not fit either, since any number of threads publish to one subscriber.

use std::fmt;
use std::mem::{self, MaybeUninit};

use crossbeam_utils::CachePadded;

use crate::loom::cell::UnsafeCell;
use crate::loom::hint::Backoff;
use crate::loom::sync::atomic::{fence, AtomicU64, Ordering};

/// The ring was full: [`Ring::push`] hands the value back.
///
/// # Examples
///
/// ```
/// use powerhub::ring::{Full, Ring};
///
/// let ring = Ring::new(1);
/// ring.push("first").unwrap();
/// let Full(refused) = ring.push("second").unwrap_err();
/// assert_eq!(refused, "second");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Full<T>(pub T);

impl<T> Full<T> {
    /// The value that was not queued.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> fmt::Debug for Full<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Full(..)")
    }
}

impl<T> fmt::Display for Full<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ring is full: the value was handed back")
    }
}

impl<T> std::error::Error for Full<T> {}

/// A ring capacity that cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CapacityError {
    /// `capacity` was 0; a ring holds at least one value.
    #[error("ring capacity must be at least 1, got 0")]
    Zero,
    /// `capacity` does not fit the lap/index encoding of positions.
    #[error("ring capacity {0} is too large (at most 2^62)")]
    TooLarge(usize),
}

/// Largest capacity accepted: leaves at least one bit of lap counter above the index bits, and
/// many more in practice (memory runs out long before).
const MAX_CAPACITY: u64 = 1 << 62;

/// One cell of the buffer.
struct Slot<T> {
    /// Whose turn it is on this slot, as a position (see the module docs' stamp table).
    stamp: AtomicU64,
    /// Initialised exactly when `stamp == p + 1` for the position `p` that last wrote it.
    value: UnsafeCell<MaybeUninit<T>>,
}

/// A bounded multi-producer queue with a drop-oldest overwrite, one per subscriber.
///
/// Any number of threads may call [`push`](Ring::push), [`force_push`](Ring::force_push) and
/// [`pop`](Ring::pop) concurrently through a shared reference (put the ring in an `Arc`).
/// Values come out in the order their pushes claimed a position.
///
/// # Examples
///
/// ```
/// use powerhub::ring::{Full, Ring};
/// use std::sync::Arc;
///
/// let ring = Arc::new(Ring::new(2));
///
/// let publisher = {
///     let ring = Arc::clone(&ring);
///     std::thread::spawn(move || {
///         ring.push(1).unwrap();
///         ring.push(2).unwrap();
///         // Full: drop-newest hands the value back...
///         assert_eq!(ring.push(3), Err(Full(3)));
///         // ...drop-oldest evicts the oldest instead.
///         assert_eq!(ring.force_push(3), Some(1));
///     })
/// };
/// publisher.join().unwrap();
///
/// assert_eq!(ring.len(), 2);
/// assert_eq!(ring.pop(), Some(2));
/// assert_eq!(ring.pop(), Some(3));
/// assert_eq!(ring.pop(), None);
/// ```
pub struct Ring<T> {
    /// Position of the next value to pop. Written by poppers and by evicting `force_push`.
    head: CachePadded<AtomicU64>,
    /// Position of the next push. Written by pushers.
    tail: CachePadded<AtomicU64>,
    /// `capacity` slots; slot `i` starts with stamp `i` (empty, lap 0).
    slots: Box<[Slot<T>]>,
    /// Number of slots, as a position-sized integer.
    capacity: u64,
    /// One lap in position units: the smallest power of two above `capacity`.
    lap: u64,
}

// SAFETY: a `Ring<T>` owns its values; sending the ring sends them, which `T: Send` allows.
unsafe impl<T: Send> Send for Ring<T> {}

// SAFETY: through `&Ring<T>` threads only move whole `T`s in (push) and out (pop, force_push's
// eviction); no `&T` is ever handed out, so `T: Sync` is not needed. Each slot's value is
// accessed by one thread at a time: the CAS on `tail` or `head` gives exclusive ownership of a
// position, and the Release/Acquire pair on the slot's stamp orders the owner's access before the
// next owner's (see the comments in `enqueue` and `pop`).
unsafe impl<T: Send> Sync for Ring<T> {}

/// What `enqueue` did with the value.
enum Enqueued<T> {
    /// Queued.
    Stored,
    /// Ring full and overwrite not asked for: the new value, handed back.
    Refused(T),
    /// Ring full and overwrite asked for: queued, the oldest value evicted and returned.
    Evicted(T),
}

impl<T> Ring<T> {
    /// A ring holding at most `capacity` values.
    ///
    /// # Panics
    ///
    /// If `capacity` is 0 or above 2^62; [`Ring::try_new`] returns the error instead.
    ///
    /// # Examples
    ///
    /// ```
    /// let ring = powerhub::ring::Ring::<u32>::new(8);
    /// assert_eq!(ring.capacity(), 8);
    /// assert!(ring.is_empty());
    /// ```
    pub fn new(capacity: usize) -> Self {
        match Self::try_new(capacity) {
            Ok(ring) => ring,
            Err(e) => panic!("{e}"),
        }
    }

    /// A ring holding at most `capacity` values, or the reason it cannot be built.
    ///
    /// # Examples
    ///
    /// ```
    /// use powerhub::ring::{CapacityError, Ring};
    ///
    /// assert_eq!(Ring::<u8>::try_new(0).unwrap_err(), CapacityError::Zero);
    /// assert!(Ring::<u8>::try_new(1).is_ok());
    /// ```
    pub fn try_new(capacity: usize) -> Result<Self, CapacityError> {
        if capacity == 0 {
            return Err(CapacityError::Zero);
        }
        let cap = u64::try_from(capacity).map_err(|_| CapacityError::TooLarge(capacity))?;
        if cap > MAX_CAPACITY {
            return Err(CapacityError::TooLarge(capacity));
        }
        // Strictly above `cap`, so index `cap - 1` plus one never reaches the lap bits.
        let lap = (cap + 1).next_power_of_two();
        let slots = (0..cap)
            .map(|i| Slot {
                stamp: AtomicU64::new(i),
                value: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        Ok(Ring {
            head: CachePadded::new(AtomicU64::new(0)),
            tail: CachePadded::new(AtomicU64::new(0)),
            slots,
            capacity: cap,
            lap,
        })
    }

    /// Queues `value`, or hands it back in [`Full`] when the ring is full (drop-newest).
    ///
    /// # Examples
    ///
    /// ```
    /// use powerhub::ring::{Full, Ring};
    ///
    /// let ring = Ring::new(1);
    /// assert_eq!(ring.push('a'), Ok(()));
    /// assert_eq!(ring.push('b'), Err(Full('b')));
    /// ```
    pub fn push(&self, value: T) -> Result<(), Full<T>> {
        match self.enqueue(value, false) {
            Enqueued::Stored => Ok(()),
            Enqueued::Refused(value) => Err(Full(value)),
            Enqueued::Evicted(_) => unreachable!("push never overwrites"),
        }
    }

    /// Queues `value`; when the ring is full, evicts the oldest value and returns it
    /// (drop-oldest).
    ///
    /// # Examples
    ///
    /// ```
    /// use powerhub::ring::Ring;
    ///
    /// let ring = Ring::new(2);
    /// assert_eq!(ring.force_push(1), None);
    /// assert_eq!(ring.force_push(2), None);
    /// assert_eq!(ring.force_push(3), Some(1));
    /// assert_eq!(ring.pop(), Some(2));
    /// ```
    pub fn force_push(&self, value: T) -> Option<T> {
        match self.enqueue(value, true) {
            Enqueued::Stored => None,
            Enqueued::Evicted(old) => Some(old),
            Enqueued::Refused(_) => unreachable!("force_push always stores"),
        }
    }

    /// Takes the oldest value, or `None` when the ring is empty.
    ///
    /// # Examples
    ///
    /// ```
    /// use powerhub::ring::Ring;
    ///
    /// let ring = Ring::new(4);
    /// ring.push("x").unwrap();
    /// assert_eq!(ring.pop(), Some("x"));
    /// assert_eq!(ring.pop(), None);
    /// ```
    pub fn pop(&self) -> Option<T> {
        let backoff = Backoff::new();
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[self.index(head)];
            // Acquire: pairs with the Release stamp store at the end of `enqueue` (stamp
            // `head + 1`), so the pusher's write of the value happens before our read below.
            let stamp = slot.stamp.load(Ordering::Acquire);

            if stamp == head.wrapping_add(1) {
                // The slot holds the value for `head`: claim it.
                let next = self.advance(head);
                // SeqCst: claims on `head` and `tail` and the fences in the empty/full checks
                // are all SeqCst, so they have one total order; an empty check that reads an old
                // `tail` after its fence cannot miss a push that was already claimed before.
                match self.head.compare_exchange_weak(
                    head,
                    next,
                    Ordering::SeqCst,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // SAFETY: the successful CAS made this thread the only owner of position
                        // `head`: other poppers and evicting pushers CAS the same `head` and lost,
                        // and no pusher may write until we store the next-lap stamp below. The
                        // value was initialised by the pusher of `head`, made visible by the
                        // Acquire load of `stamp == head + 1` above; reading moves it out, and
                        // the slot is considered uninitialised from here on.
                        let value = slot.value.with(|p| unsafe { (*p).assume_init_read() });
                        // Release: publishes "we are done reading" to the next lap's pusher,
                        // whose Acquire load of stamp `head + LAP` in `enqueue` then orders its
                        // write of the slot after our read.
                        slot.stamp
                            .store(head.wrapping_add(self.lap), Ordering::Release);
                        return Some(value);
                    }
                    Err(current) => {
                        head = current;
                        backoff.spin();
                    }
                }
            } else if stamp == head {
                // Nothing was published at `head` yet. Empty only if no push claimed it either.
                // SeqCst fence: orders our Relaxed `tail` load after every claim that precedes
                // it in the SeqCst total order (see the CAS above).
                fence(Ordering::SeqCst);
                let tail = self.tail.load(Ordering::Relaxed);
                if tail == head {
                    return None;
                }
                // A push claimed `head` and is still writing: wait for its stamp.
                backoff.spin();
                head = self.head.load(Ordering::Relaxed);
            } else {
                // Our `head` is stale (another popper or an eviction moved it) or a claimed slot
                // is mid-write: reload.
                backoff.snooze();
                head = self.head.load(Ordering::Relaxed);
            }
        }
    }

    /// Number of values queued at some instant during the call.
    ///
    /// # Examples
    ///
    /// ```
    /// let ring = powerhub::ring::Ring::new(3);
    /// ring.push(1).unwrap();
    /// ring.push(2).unwrap();
    /// assert_eq!(ring.len(), 2);
    /// ```
    pub fn len(&self) -> usize {
        loop {
            // SeqCst loads: read `tail`, `head`, `tail` again in one total order with the claims;
            // if `tail` did not move in between, (head, tail) is a snapshot of one instant.
            let tail = self.tail.load(Ordering::SeqCst);
            let head = self.head.load(Ordering::SeqCst);
            if self.tail.load(Ordering::SeqCst) == tail {
                return self.distance(head, tail);
            }
        }
    }

    /// Whether the ring held no value at some instant during the call.
    pub fn is_empty(&self) -> bool {
        // SeqCst: see `len`. Equal positions mean empty; a full ring differs by one lap.
        let head = self.head.load(Ordering::SeqCst);
        let tail = self.tail.load(Ordering::SeqCst);
        head == tail
    }

    /// Whether the ring held `capacity` values at some instant during the call.
    pub fn is_full(&self) -> bool {
        // SeqCst: see `len`. Load `tail` first: `head` only grows, so `head + LAP == tail` then
        // means full at the moment of the `head` load.
        let tail = self.tail.load(Ordering::SeqCst);
        let head = self.head.load(Ordering::SeqCst);
        head.wrapping_add(self.lap) == tail
    }

    /// The capacity given at construction.
    pub fn capacity(&self) -> usize {
        // Lossless: built from a `usize`.
        self.capacity as usize
    }

    /// Slot index of a position.
    #[inline(always)]
    fn index(&self, position: u64) -> usize {
        (position & (self.lap - 1)) as usize
    }

    /// The position after `position`: the next index, or index 0 of the next lap.
    #[inline(always)]
    fn advance(&self, position: u64) -> u64 {
        if (position & (self.lap - 1)) + 1 < self.capacity {
            position + 1
        } else {
            (position & !(self.lap - 1)).wrapping_add(self.lap)
        }
    }

    /// Number of values between `head` and `tail`, which must be a consistent snapshot.
    fn distance(&self, head: u64, tail: u64) -> usize {
        let (h, t) = (self.index(head), self.index(tail));
        let cap = self.capacity();
        if h < t {
            t - h
        } else if h > t {
            cap - h + t
        } else if head == tail {
            0
        } else {
            cap
        }
    }

    /// Shared body of `push` and `force_push`.
    fn enqueue(&self, value: T, overwrite: bool) -> Enqueued<T> {
        let backoff = Backoff::new();
        let mut tail = self.tail.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[self.index(tail)];
            let next = self.advance(tail);
            // Acquire: pairs with the popper's Release store of stamp `tail` (slot freed one lap
            // ago), ordering its read of the old value before our write. On the full path it
            // pairs with the previous pusher's Release of `tail + 1 - LAP`, so an eviction reads
            // a fully written old value.
            let stamp = slot.stamp.load(Ordering::Acquire);

            if stamp == tail {
                // The slot is free for position `tail`: claim it. SeqCst for the total order
                // with the empty/full checks (see `pop`).
                match self.tail.compare_exchange_weak(
                    tail,
                    next,
                    Ordering::SeqCst,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // SAFETY: the CAS made this thread the only owner of position `tail`;
                        // no popper reads the slot before the stamp says `tail + 1`, and the
                        // Acquire load above ordered the previous lap's read before this write.
                        // The slot holds no initialised value (stamp `tail` = freed), so
                        // overwriting leaks nothing.
                        slot.value
                            .with_mut(|p| unsafe { p.write(MaybeUninit::new(value)) });
                        // Release: publishes the value to the popper's Acquire load of the
                        // stamp in `pop` (and to an evicting pusher's Acquire load above).
                        slot.stamp.store(tail.wrapping_add(1), Ordering::Release);
                        return Enqueued::Stored;
                    }
                    Err(current) => {
                        tail = current;
                        backoff.spin();
                    }
                }
            } else if stamp.wrapping_add(self.lap) == tail.wrapping_add(1) {
                // The slot still holds the value pushed one lap ago. Full only if `head` has not
                // moved past it. SeqCst fence: orders the `head` load below after every claim
                // preceding it in the total order (see `pop`).
                fence(Ordering::SeqCst);
                let oldest = tail.wrapping_sub(self.lap);
                if !overwrite {
                    if self.head.load(Ordering::Relaxed) == oldest {
                        return Enqueued::Refused(value);
                    }
                } else if self
                    .head
                    .compare_exchange_weak(
                        oldest,
                        self.advance(oldest),
                        Ordering::SeqCst,
                        Ordering::Relaxed,
                    )
                    .is_ok()
                {
                    // We claimed the oldest value exactly as a popper would; no popper or other
                    // evicting pusher can own it now. While its stamp still reads one lap old, no
                    // pusher can claim `tail` either, so this thread alone moves `tail` forward.
                    // SeqCst: part of the total order the empty/full checks rely on.
                    self.tail.store(next, Ordering::SeqCst);
                    // SAFETY: this thread owns the slot through the `head` CAS (for the old
                    // value) and, as argued above, is the only one moving `tail` past it (for the
                    // new one). The old value was initialised by the previous lap's pusher and
                    // made visible by the Acquire stamp load; `replace` moves it out and the new
                    // value in, so each is owned exactly once.
                    let old = slot.value.with_mut(|p| unsafe {
                        std::ptr::replace(p, MaybeUninit::new(value)).assume_init()
                    });
                    // Release: publishes the new value to the popper of position `tail`.
                    slot.stamp.store(tail.wrapping_add(1), Ordering::Release);
                    return Enqueued::Evicted(old);
                }
                // Not full after all (a pop moved `head`), or lost the eviction race.
                backoff.spin();
                tail = self.tail.load(Ordering::Relaxed);
            } else {
                // Our `tail` is stale, or the slot's previous owner has not published yet.
                backoff.snooze();
                tail = self.tail.load(Ordering::Relaxed);
            }
        }
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        if !mem::needs_drop::<T>() {
            return;
        }
        // `&mut self`: no other thread can touch the ring, every claim was published, so the
        // values live exactly at positions `head .. tail`.
        let head = self.head.load(Ordering::Relaxed);
        let tail = self.tail.load(Ordering::Relaxed);
        let len = self.distance(head, tail);
        let mut index = self.index(head);
        for _ in 0..len {
            // SAFETY: the slots from `head`'s index up to `len` values later (wrapping) hold the
            // initialised values not yet popped; each is dropped once, and the ring is never
            // used again.
            self.slots[index]
                .value
                .with_mut(|p| unsafe { (*p).assume_init_drop() });
            index += 1;
            if index == self.slots.len() {
                index = 0;
            }
        }
    }
}

impl<T> fmt::Debug for Ring<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ring")
            .field("len", &self.len())
            .field("capacity", &self.capacity())
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn full_hands_the_value_back() {
        let ring = Ring::new(2);
        ring.push(String::from("a")).unwrap();
        ring.push(String::from("b")).unwrap();
        let Full(back) = ring.push(String::from("c")).unwrap_err();
        assert_eq!(back, "c");
        assert_eq!(ring.len(), 2);
        assert_eq!(ring.pop().as_deref(), Some("a"));
    }

    #[test]
    fn capacity_one_push_pop_and_overwrite() {
        let ring = Ring::new(1);
        assert_eq!(ring.capacity(), 1);
        assert!(ring.is_empty());
        assert_eq!(ring.push(1), Ok(()));
        assert!(ring.is_full());
        assert_eq!(ring.push(2), Err(Full(2)));
        assert_eq!(ring.force_push(3), Some(1));
        assert_eq!(ring.force_push(4), Some(3));
        assert_eq!(ring.len(), 1);
        assert_eq!(ring.pop(), Some(4));
        assert_eq!(ring.pop(), None);
        // Many laps through the single slot.
        for i in 0..1000 {
            assert_eq!(ring.push(i), Ok(()));
            assert_eq!(ring.pop(), Some(i));
        }
    }

    #[test]
    fn zero_capacity_is_an_error() {
        assert_eq!(Ring::<u8>::try_new(0).unwrap_err(), CapacityError::Zero);
        assert!(Ring::<u8>::try_new(usize::MAX).is_err());
    }

    #[test]
    #[should_panic(expected = "at least 1")]
    fn zero_capacity_panics_in_new() {
        let _ = Ring::<u8>::new(0);
    }

    #[test]
    fn drop_drops_remaining_values_exactly_once() {
        let witness = Arc::new(());
        for cap in 1..6 {
            for queued in 0..=cap {
                for popped_first in 0..=cap {
                    let ring = Ring::new(cap);
                    // Move head and tail around the ring before the final fill.
                    for _ in 0..popped_first {
                        ring.push(Arc::clone(&witness)).unwrap();
                    }
                    for _ in 0..popped_first {
                        drop(ring.pop());
                    }
                    for _ in 0..queued {
                        ring.push(Arc::clone(&witness)).unwrap();
                    }
                    assert_eq!(Arc::strong_count(&witness), 1 + queued);
                    drop(ring);
                    assert_eq!(Arc::strong_count(&witness), 1);
                }
            }
        }
    }

    #[test]
    fn drop_after_overwrites_drops_exactly_once() {
        let witness = Arc::new(());
        let ring = Ring::new(3);
        for _ in 0..10 {
            drop(ring.force_push(Arc::clone(&witness)));
        }
        assert_eq!(Arc::strong_count(&witness), 4);
        drop(ring);
        assert_eq!(Arc::strong_count(&witness), 1);
    }

    #[test]
    fn evicted_and_refused_values_are_not_dropped_by_the_ring() {
        let witness = Arc::new(());
        let ring = Ring::new(1);
        ring.push(Arc::clone(&witness)).unwrap();
        let refused = ring.push(Arc::clone(&witness)).unwrap_err().into_inner();
        let evicted = ring.force_push(Arc::clone(&witness)).unwrap();
        assert_eq!(Arc::strong_count(&witness), 4);
        drop((refused, evicted));
        assert_eq!(Arc::strong_count(&witness), 2);
    }

    #[test]
    fn len_counts_across_wrap_around() {
        let ring = Ring::new(3);
        for round in 0..10 {
            ring.push(round).unwrap();
            ring.push(round).unwrap();
            assert_eq!(ring.len(), 2);
            ring.pop().unwrap();
            assert_eq!(ring.len(), 1);
            ring.pop().unwrap();
            assert_eq!(ring.len(), 0);
        }
    }

    #[test]
    fn ring_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Ring<String>>();
        assert_send_sync::<Ring<std::cell::Cell<u8>>>();
    }

    #[test]
    fn full_is_an_error_with_a_message() {
        let e: Box<dyn std::error::Error> = Box::new(Full(7));
        assert_eq!(e.to_string(), "ring is full: the value was handed back");
    }
}
