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
#[derive(Debug)]
pub(crate) struct Blocks<T> {
    /// Never empty blocks, but for a lone first block kept for its capacity.
    blocks: VecDeque<VecDeque<T>>,
    len: usize,
}

impl<T> Default for Blocks<T> {
    fn default() -> Self {
        Blocks {
            blocks: VecDeque::new(),
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

    /// Items the blocks can hold without allocating (for memory accounting).
    pub(crate) fn capacity(&self) -> usize {
        self.blocks.iter().map(VecDeque::capacity).sum()
    }

    pub(crate) fn push_back(&mut self, item: T) {
        match self.blocks.back_mut() {
            Some(last) if last.len() < BLOCK => {
                if last.capacity() == 0 {
                    // One slot, not the four a first push reserves: most connections are idle
                    // after a reply or two. A busy one doubles from there up to a block.
                    last.reserve_exact(1);
                }
                last.push_back(item);
            }
            Some(_) => {
                let mut block = VecDeque::with_capacity(BLOCK);
                block.push_back(item);
                self.blocks.push_back(block);
            }
            None => {
                let mut block = VecDeque::new();
                block.reserve_exact(1);
                block.push_back(item);
                self.blocks.push_back(block);
            }
        }
        self.len += 1;
    }

    /// Puts `item` first.
    pub(crate) fn push_front(&mut self, item: T) {
        match self.blocks.front_mut() {
            Some(first) if first.len() < BLOCK => first.push_front(item),
            _ => {
                let mut block = VecDeque::with_capacity(1);
                block.push_front(item);
                self.blocks.push_front(block);
            }
        }
        self.len += 1;
    }

    pub(crate) fn pop_front(&mut self) -> Option<T> {
        let first = self.blocks.front_mut()?;
        let item = first.pop_front()?;
        self.len -= 1;
        if first.is_empty() && self.blocks.len() > 1 {
            self.blocks.pop_front();
        }
        Some(item)
    }

    /// The item at position `index` from the front.
    pub(crate) fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        if index >= self.len {
            return None;
        }
        let first = self.blocks.front()?.len();
        if index < first {
            return self.blocks.front_mut()?.get_mut(index);
        }
        // Every block after the first but the last is full.
        let rest = index - first;
        self.blocks.get_mut(1 + rest / BLOCK)?.get_mut(rest % BLOCK)
    }

    /// Empties the queue, keeping the first block's capacity.
    pub(crate) fn clear(&mut self) {
        self.blocks.truncate(1);
        if let Some(first) = self.blocks.front_mut() {
            first.clear();
        }
        self.len = 0;
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.blocks.iter().flatten()
    }
}

impl<T> IntoIterator for Blocks<T> {
    type Item = T;
    type IntoIter = std::iter::Flatten<std::collections::vec_deque::IntoIter<VecDeque<T>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.blocks.into_iter().flatten()
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
        assert_eq!(blocks.blocks.len(), 11);
        assert!(blocks.blocks.iter().all(|b| b.capacity() < 2 * BLOCK));
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
