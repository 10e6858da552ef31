//! The outbox's FIFO: a deque kept in blocks of at most [`BLOCK`] items.
//!
//! A stalled reader's queue grows to tens of thousands of items (up to
//! `limits.max_outbox_bytes` of messages). One contiguous `VecDeque` doubles as it grows: each
//! doubling allocates twice the queue and copies all of it on the shard's thread, and the new
//! pages fault in while the copy runs. At 32 MiB of 1 KiB messages those last doublings stalled
//! the shard for milliseconds, and every other connection of the shard waited (in the
//! `slow-consumer` scenario the other subscribers' p99 rose by 50–250 % while two slow readers
//! filled their outboxes). In blocks, a push allocates at most one block and never moves what
//! is queued; an index is found in O(1), since every block but the first and the last is full.

use std::collections::VecDeque;

/// Items per block (every block but the first and the last holds exactly this many).
pub(crate) const BLOCK: usize = 256;

/// A FIFO with `push_front` (for an item put back) and indexing by position.
///
/// The first block is inline: a connection whose queue never passes a block (nearly all of
/// them) allocates what one `VecDeque` would, and no list of blocks.
#[derive(Debug)]
pub(crate) struct Blocks<T> {
    /// The front block: empty only when the queue is (it then keeps its capacity).
    first: VecDeque<T>,
    /// The blocks after the first: all full but the last.
    rest: VecDeque<VecDeque<T>>,
    len: usize,
}

impl<T> Default for Blocks<T> {
    fn default() -> Self {
        Blocks {
            first: VecDeque::new(),
            rest: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> Blocks<T> {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Items the blocks can hold without allocating (for memory accounting, checked on every
    /// write: O(1)). A block between the first and the last is full and holds a block's
    /// capacity (made with it).
    pub(crate) fn capacity(&self) -> usize {
        self.first.capacity()
            + self
                .rest
                .back()
                .map_or(0, |last| last.capacity() + (self.rest.len() - 1) * BLOCK)
    }

    pub(crate) fn push_back(&mut self, item: T) {
        self.len += 1;
        let last = match self.rest.back_mut() {
            Some(last) => last,
            None if self.first.len() < BLOCK => {
                if self.first.capacity() == 0 {
                    // One slot, not the four a first push reserves: most connections are idle
                    // after a reply or two. A busy one doubles from there up to a block.
                    self.first.reserve_exact(1);
                }
                self.first.push_back(item);
                return;
            }
            None => {
                self.rest.push_back(VecDeque::with_capacity(BLOCK));
                self.rest.back_mut().expect("just pushed")
            }
        };
        if last.len() < BLOCK {
            last.push_back(item);
        } else {
            let mut block = VecDeque::with_capacity(BLOCK);
            block.push_back(item);
            self.rest.push_back(block);
        }
    }

    /// Puts `item` first.
    pub(crate) fn push_front(&mut self, item: T) {
        self.len += 1;
        if self.first.len() >= BLOCK {
            // The full first block becomes the first of the rest.
            let full = std::mem::replace(&mut self.first, VecDeque::with_capacity(1));
            self.rest.push_front(full);
        }
        self.first.push_front(item);
    }

    pub(crate) fn pop_front(&mut self) -> Option<T> {
        let item = self.first.pop_front()?;
        self.len -= 1;
        if self.first.is_empty() {
            if let Some(next) = self.rest.pop_front() {
                self.first = next;
            }
        }
        Some(item)
    }

    /// The item at position `index` from the front.
    pub(crate) fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        let Some(rest) = index.checked_sub(self.first.len()) else {
            return self.first.get_mut(index);
        };
        // Every block of the rest but the last is full.
        self.rest.get_mut(rest / BLOCK)?.get_mut(rest % BLOCK)
    }

    /// Empties the queue, keeping the first block's capacity.
    pub(crate) fn clear(&mut self) {
        self.first.clear();
        self.rest = VecDeque::new();
        self.len = 0;
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.first.iter().chain(self.rest.iter().flatten())
    }
}

impl<T> IntoIterator for Blocks<T> {
    type Item = T;
    type IntoIter = std::iter::Chain<
        std::collections::vec_deque::IntoIter<T>,
        std::iter::Flatten<std::collections::vec_deque::IntoIter<VecDeque<T>>>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.first
            .into_iter()
            .chain(self.rest.into_iter().flatten())
    }
}

#[cfg(test)]
mod tests {
    use super::{Blocks, BLOCK};
    use proptest::prelude::*;
    use std::collections::VecDeque;

    #[derive(Debug, Clone)]
    enum Op {
        PushBack,
        PushFront,
        PopFront,
        Set(usize),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => Just(Op::PushBack),
            1 => Just(Op::PushFront),
            5 => Just(Op::PopFront),
            2 => any::<usize>().prop_map(Op::Set),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        /// Against a plain `VecDeque`: every operation's result, the length, each position's
        /// item and the order, after each step, across several blocks.
        #[test]
        fn blocks_behave_as_one_deque(ops in proptest::collection::vec(op(), 1..3 * BLOCK)) {
            let mut blocks = Blocks::new();
            let mut model = VecDeque::new();
            let mut next = 0u32;
            for op in ops {
                match op {
                    Op::PushBack => {
                        blocks.push_back(next);
                        model.push_back(next);
                        next += 1;
                    }
                    Op::PushFront => {
                        blocks.push_front(next);
                        model.push_front(next);
                        next += 1;
                    }
                    Op::PopFront => prop_assert_eq!(blocks.pop_front(), model.pop_front()),
                    Op::Set(i) => {
                        let i = if model.is_empty() { i } else { i % (model.len() + 1) };
                        let got = blocks.get_mut(i).map(|x| { *x += 1_000_000; *x });
                        let want = model.get_mut(i).map(|x| { *x += 1_000_000; *x });
                        prop_assert_eq!(got, want);
                    }
                    Op::Clear => {
                        blocks.clear();
                        model.clear();
                    }
                }
                prop_assert_eq!(blocks.len(), model.len());
                prop_assert_eq!(blocks.is_empty(), model.is_empty());
                prop_assert!(blocks.iter().eq(model.iter()));
                let exact = blocks.first.capacity()
                    + blocks.rest.iter().map(VecDeque::capacity).sum::<usize>();
                prop_assert_eq!(blocks.capacity(), exact);
            }
            prop_assert!(blocks.into_iter().eq(model.into_iter()));
        }
    }

    /// A long queue is many blocks, none holding more than a block's items: growing it never
    /// moves what it holds.
    #[test]
    fn a_long_queue_grows_a_block_at_a_time() {
        let mut blocks = Blocks::new();
        for i in 0..10 * BLOCK + 3 {
            blocks.push_back(i);
        }
        assert_eq!(blocks.rest.len(), 10);
        assert!(blocks.first.capacity() <= BLOCK);
        assert!(blocks.rest.iter().all(|b| b.capacity() == BLOCK));
        let first: *const usize = blocks.get_mut(0).unwrap();
        for i in 0..5 * BLOCK {
            blocks.push_back(i);
        }
        assert_eq!(first, blocks.get_mut(0).unwrap() as *const usize);
    }

    /// An idle connection's first push reserves one slot.
    #[test]
    fn a_first_push_reserves_one_slot() {
        let mut blocks = Blocks::new();
        blocks.push_back(1u8);
        assert_eq!(blocks.capacity(), 1);
        assert_eq!(blocks.pop_front(), Some(1));
        assert_eq!(blocks.capacity(), 1, "the lone block keeps its capacity");
    }
}
