//! Write-once slots made readable by a counter: the lock-free core of the direct receivers' log
//! (see [`super::direct`]).
//!
//! One appender at a time writes publication `pos` into its [`Chunk`]'s slot and then moves the
//! [`Head`] past it; a reader that loads the head may read every slot below it, with no lock and
//! no per-slot flag: the slot is a plain cell, and the head's store is what publishes it. The
//! chunk's header (its first number and its slots' address) is never written after it is made,
//! so the receives that start a run read a line that no append takes away from them.
//!
//! A chunk also lends references to itself in bulk ([`Chunk::lend`]): a reader that hands out
//! one owned reference per slot it reads pays one atomic operation for a run of them, where as
//! many `Arc` clones pay one each.
//!
//! The protocol is checked under loom by this module's tests (`RUSTFLAGS="--cfg loom" cargo test
//! -p powerhub --release --lib hub::slots`), on chunks of one and two slots.

use crossbeam_utils::CachePadded;

use crate::loom::cell::UnsafeCell;
use crate::loom::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use crate::loom::sync::Arc;

/// Write-once slots holding publications `first..first + len`. Aligned to 128 bytes: a
/// reference to one slot is the chunk's address with the slot's index in its low bits (see the
/// direct log's `Held`).
#[repr(align(128))]
pub(crate) struct Chunk<T> {
    first: u64,
    slots: Box<[UnsafeCell<Option<T>>]>,
    /// References lent out and not given back (see [`Chunk::lend`]). On a line of its own: the
    /// readers that lend and the holders that give back do not share it with the header they
    /// read at each run, nor with the slots the appender writes.
    lent: CachePadded<AtomicUsize>,
}

// SAFETY: the cells are the only shared mutable state. Each is written once, by the one appender
// (`Head::publish`'s contract), before the head moves past it, and read only below a head that
// the reader loaded (`Chunk::get`'s contract), so every read happens after the write and no write
// follows a read; the value is then shared by reference between readers, which `T: Sync` allows,
// and moved in from the appender's thread, which `T: Send` allows.
unsafe impl<T: Send + Sync> Sync for Chunk<T> {}

impl<T> Chunk<T> {
    /// `len` empty slots for publications `first..first + len`.
    pub(crate) fn new(first: u64, len: usize) -> Chunk<T> {
        Chunk {
            first,
            slots: (0..len).map(|_| UnsafeCell::new(None)).collect(),
            lent: CachePadded::new(AtomicUsize::new(0)),
        }
    }

    /// Lends `n` references to the chunk, each given back with [`Chunk::give_back`]: one atomic
    /// operation for the `n`.
    ///
    /// While any lent reference is out, the lent references together hold one strong reference
    /// to `this`: the lend that finds none out takes it, and the give-back that brings the count
    /// to zero drops it. Both decisions come from the same counter's modification order, so each
    /// reference taken is dropped once; a lend from zero that races with the give-back to zero
    /// before it holds its own (two strong references for a moment, both counted).
    pub(crate) fn lend(this: &Arc<Self>, n: usize) {
        // Relaxed, as an `Arc` clone's increment: the caller holds a strong reference, so the
        // chunk lives through this, and what a holder reads was published by the head.
        let before = this.lent.fetch_add(n, Ordering::Relaxed);
        if before == 0 {
            // The lent references' strong reference, dropped by the give-back to zero.
            let _ = Arc::into_raw(Arc::clone(this));
        }
        abort_past_max(before);
    }

    /// Lends `n` more references from a holder of a lent one (a clone of it).
    ///
    /// # Safety
    ///
    /// `this` points to a chunk from which the caller holds a lent reference not given back.
    pub(crate) unsafe fn lend_more(this: *const Self, n: usize) {
        // SAFETY: the caller's lent reference keeps the lent references' strong reference, so
        // the chunk lives; the count is at least one, so this is never the lend from zero.
        let lent = unsafe { &(*this).lent };
        // Relaxed: as `lend`.
        let before = lent.fetch_add(n, Ordering::Relaxed);
        debug_assert!(before > 0, "lend_more without a lent reference");
        abort_past_max(before);
    }

    /// Gives back `n` lent references; the last one out drops the strong reference they held
    /// (and with it, when it was the last, the chunk).
    ///
    /// # Safety
    ///
    /// `this` is the address (`Arc::as_ptr`) of a chunk that lent the caller `n` references it
    /// has not given back, and the caller uses none of them afterwards.
    pub(crate) unsafe fn give_back(this: *const Self, n: usize) {
        // SAFETY: the caller's `n` references are out, so the count is at least `n` and the
        // strong reference the lent ones hold is alive until the give-back to zero below.
        let lent = unsafe { &(*this).lent };
        // Release: every holder's reads of the slots happen before the give-back to zero, as an
        // `Arc`'s decrement; the Acquire fence below pairs with it (the decrements form a release
        // sequence).
        if lent.fetch_sub(n, Ordering::Release) == n {
            fence(Ordering::Acquire);
            // SAFETY: the count went from `n` to zero here: the lend that raised it from zero
            // took a strong reference with `Arc::into_raw` from this very address, and no other
            // give-back sees zero from the same raise; this drops that reference once.
            drop(unsafe { Arc::from_raw(this) });
        }
    }

    /// The first publication the chunk holds.
    pub(crate) fn first(&self) -> u64 {
        self.first
    }

    /// The first publication after this chunk.
    pub(crate) fn end(&self) -> u64 {
        self.first + self.slots.len() as u64
    }

    /// Whether publication `pos` belongs in this chunk (written or not).
    pub(crate) fn holds(&self, pos: u64) -> bool {
        pos >= self.first && pos < self.end()
    }

    /// Publication `pos`.
    ///
    /// # Safety
    ///
    /// The chunk holds `pos`, and `pos` is below a value this thread loaded with [`Head::load`]
    /// from the head the chunk is published by, or below a value such a load passed on to it
    /// with acquire-release ordering (a subscription's end, taken from the head).
    ///
    /// # Panics
    ///
    /// When the slot is empty, which the contract rules out.
    #[inline]
    pub(crate) unsafe fn get(&self, pos: u64) -> &T {
        let slot = self.slot(pos);
        // SAFETY: by the contract the head passed `pos`, so the slot's one write happened before
        // the head's store that this thread's load (or the load it learned `pos` from) saw; no
        // write follows. The reference lives as long as the chunk, whose slot no one writes again.
        slot.with(|p| unsafe { (*p).as_ref() })
            .expect("a slot below the head is written")
    }

    /// The cell of publication `pos`.
    ///
    /// # Panics
    ///
    /// When the chunk does not hold `pos`.
    #[inline]
    fn slot(&self, pos: u64) -> &UnsafeCell<Option<T>> {
        pos.checked_sub(self.first)
            .and_then(|off| self.slots.get(off as usize))
            .unwrap_or_else(|| panic!("publication {pos} outside its chunk"))
    }
}

/// Aborts once the lent references pass `isize::MAX`, as an `Arc`'s count does: clones of a
/// lent reference forgotten one by one could otherwise wrap the count (on a 32-bit target) and
/// free the chunk while references to it are out.
fn abort_past_max(before: usize) {
    if before > isize::MAX as usize {
        std::process::abort();
    }
}

/// How many publications are readable: the count an appender moves past each slot it wrote.
pub(crate) struct Head(AtomicU64);

impl Head {
    /// No publication yet.
    pub(crate) fn new() -> Head {
        Head(AtomicU64::new(0))
    }

    /// Publications readable so far. SeqCst: an acquire, pairing with [`Head::publish`]'s store
    /// (the slots below the value are written), and part of the total order that the direct
    /// log's wake-up handshake relies on (see `DirectLog::wait_until`).
    pub(crate) fn load(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    /// Publications readable so far, as a bound check reads it: Relaxed, so no slot may be read
    /// on the strength of this value (a [`load`](Head::load) that showed it written must come
    /// first). A stale value is smaller, never larger.
    #[inline]
    pub(crate) fn peek(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Writes publication `pos` into its slot of `chunk` and makes it readable.
    ///
    /// # Safety
    ///
    /// Appends are serialized (one at a time, under the appender's lock), `pos` is the head's
    /// current value (the next publication), and `chunk` holds `pos`.
    ///
    /// # Panics
    ///
    /// When `chunk` does not hold `pos`.
    pub(crate) unsafe fn publish<T>(&self, chunk: &Chunk<T>, pos: u64, value: T) {
        let slot = chunk.slot(pos);
        // SAFETY: appends are serialized and `pos` is the head's value, so no other thread writes
        // this slot, and none reads it: readers read below a head they loaded, at most `pos`
        // until the store below.
        slot.with_mut(|p| unsafe { *p = Some(value) });
        // SeqCst: a release, so the write above happens before every read by a thread whose
        // load sees `pos + 1` or more; also ordered before the appender's later loads (the
        // direct log's count of waiting receivers).
        self.0.store(pos + 1, Ordering::SeqCst);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::{Chunk, Head};
    use loom::sync::Arc;
    use loom::thread;

    /// A published value: its number, and a witness whose count shows it dropped exactly once.
    type Value = (u64, std::sync::Arc<()>);

    /// Reads every publication below the head as it moves, until `total`; each is checked.
    fn read_all(head: &Head, chunks: &[Arc<Chunk<Value>>], total: u64) {
        let mut pos = 0;
        while pos < total {
            let limit = head.load();
            while pos < limit {
                let chunk = chunks
                    .iter()
                    .find(|c| c.holds(pos))
                    .expect("a chunk for pos");
                // SAFETY: `pos` is below a head this thread loaded, and the chunk holds it.
                let v = unsafe { chunk.get(pos) };
                assert_eq!(v.0, pos, "slot {pos} holds another publication");
                pos += 1;
            }
            thread::yield_now();
        }
    }

    /// One appender publishes two values into a chunk of two slots while a reader reads every
    /// slot below the head it loads: each read finds its value (a read of a slot before its
    /// write would be a race, which loom's cell reports), and every value is dropped once.
    #[test]
    fn a_reader_below_the_head_finds_every_slot_written() {
        loom::model(|| {
            let witness = std::sync::Arc::new(());
            let head = Arc::new(Head::new());
            let chunk = Arc::new(Chunk::<Value>::new(0, 2));
            let appender = {
                let (head, chunk, witness) =
                    (Arc::clone(&head), Arc::clone(&chunk), witness.clone());
                thread::spawn(move || {
                    for pos in 0..2 {
                        // SAFETY: the only appender; `pos` is the head's value; the chunk
                        // holds it.
                        unsafe { head.publish(&chunk, pos, (pos, witness.clone())) };
                    }
                })
            };
            read_all(&head, &[Arc::clone(&chunk)], 2);
            appender.join().unwrap();
            drop(chunk);
            assert_eq!(std::sync::Arc::strong_count(&witness), 1, "a value leaked");
        });
    }

    /// Two chunks of one slot each, the second made by the appender after the first is full,
    /// as the log does: a reader that crosses into the second reads it written, and the chunks
    /// dropped by whichever thread goes last drop each value once.
    #[test]
    fn a_reader_crossing_chunks_finds_the_next_chunk_written() {
        loom::model(|| {
            let witness = std::sync::Arc::new(());
            let head = Arc::new(Head::new());
            let chunks = Arc::new([
                Arc::new(Chunk::<Value>::new(0, 1)),
                Arc::new(Chunk::<Value>::new(1, 1)),
            ]);
            let appender = {
                let (head, chunks, witness) =
                    (Arc::clone(&head), Arc::clone(&chunks), witness.clone());
                thread::spawn(move || {
                    for (pos, chunk) in chunks.iter().enumerate() {
                        let pos = pos as u64;
                        // SAFETY: the only appender; `pos` is the head's value; the chunk
                        // holds it.
                        unsafe { head.publish(chunk, pos, (pos, witness.clone())) };
                    }
                })
            };
            read_all(&head, &chunks[..], 2);
            drop(chunks);
            appender.join().unwrap();
            assert_eq!(std::sync::Arc::strong_count(&witness), 1, "a value leaked");
        });
    }

    /// A published value whose drop writes a cell the holder reads: loom reports a free that
    /// does not happen after every holder's read.
    struct Tracked {
        n: u64,
        cell: loom::cell::UnsafeCell<u64>,
        _witness: std::sync::Arc<()>,
    }

    // SAFETY: the cell is read by holders and written only by the drop, which the lending
    // protocol under test orders after every read (loom checks it).
    unsafe impl Sync for Tracked {}

    impl Drop for Tracked {
        fn drop(&mut self) {
            // SAFETY: checked by loom: no read may race this write.
            self.cell.with_mut(|p| unsafe { *p = 0 });
        }
    }

    /// A chunk lends two references, one to a holder on another thread; the lender gives its
    /// own back and lends again while the holder reads its slot and gives back, after the
    /// lender dropped its strong reference: the give-back to zero and the lend from zero race
    /// in every order, and the chunk (with its value) is freed once, after the holder's read
    /// (loom reports a leaked `Arc`, or a read racing the value's drop).
    #[test]
    fn references_lent_in_bulk_free_the_chunk_once_after_every_holder() {
        loom::model(|| {
            let witness = std::sync::Arc::new(());
            let head = Head::new();
            let chunk = Arc::new(Chunk::<Tracked>::new(0, 1));
            let value = Tracked {
                n: 7,
                cell: loom::cell::UnsafeCell::new(7),
                _witness: witness.clone(),
            };
            // SAFETY: the only appender; the head is 0; the chunk holds 0.
            unsafe { head.publish(&chunk, 0, value) };
            assert_eq!(head.load(), 1);
            Chunk::lend(&chunk, 2);
            // The address as a number: a lent reference is a raw pointer.
            let addr = Arc::as_ptr(&chunk) as usize;
            let holder = thread::spawn(move || {
                let ptr = addr as *const Chunk<Tracked>;
                // SAFETY: the holder's lent reference keeps the chunk; slot 0 is below a head
                // the spawning thread loaded, passed on by the spawn.
                let v = unsafe { (*ptr).get(0) };
                // SAFETY: no write before the drop, which must follow (checked by loom).
                let seen = v.cell.with(|p| unsafe { *p });
                assert_eq!((v.n, seen), (7, 7));
                // SAFETY: one reference lent to this thread, not given back before.
                unsafe { Chunk::give_back(ptr, 1) };
            });
            let ptr = Arc::as_ptr(&chunk);
            // SAFETY: the lender's own lent reference.
            unsafe { Chunk::give_back(ptr, 1) };
            Chunk::lend(&chunk, 1);
            // SAFETY: the reference just lent.
            unsafe { Chunk::give_back(ptr, 1) };
            drop(chunk);
            holder.join().unwrap();
            assert_eq!(
                std::sync::Arc::strong_count(&witness),
                1,
                "the chunk was not freed"
            );
        });
    }
}
