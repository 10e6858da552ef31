//! Write-once slots made readable by a counter: the lock-free core of the direct receivers' log
//! (see [`super::direct`]).
//!
//! One appender at a time writes publication `pos` into its [`Chunk`]'s slot and then moves the
//! [`Head`] past it; a reader that loads the head may read every slot below it, with no lock and
//! no per-slot flag: the slot is a plain cell, and the head's store is what publishes it. The
//! chunk's header (its first number and its slots' address) is never written after it is made,
//! so the receives that start a run read a line that no append takes away from them.
//!
//! The protocol is checked under loom by this module's tests (`RUSTFLAGS="--cfg loom" cargo test
//! -p powerhub --release --lib hub::slots`), on chunks of one and two slots.

use crate::loom::cell::UnsafeCell;
use crate::loom::sync::atomic::{AtomicU64, Ordering};

/// Write-once slots holding publications `first..first + len`.
pub(crate) struct Chunk<T> {
    first: u64,
    slots: Box<[UnsafeCell<Option<T>>]>,
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
    fn slot(&self, pos: u64) -> &UnsafeCell<Option<T>> {
        pos.checked_sub(self.first)
            .and_then(|off| self.slots.get(off as usize))
            .unwrap_or_else(|| panic!("publication {pos} outside its chunk"))
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
}
