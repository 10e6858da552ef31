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

/// A FIFO with `push_front` (for an item put back), `pop_back` (what a pause takes back to admit
/// under the rules) and indexing by position.
///
/// As small as one `VecDeque` (a connection's state is kept under 512 bytes): no length is
/// stored, every length and capacity is computed from the first and last blocks. A queue that
/// never passes a block (nearly all of them) costs one allocation more than a `VecDeque`: the
/// list, holding one block's header.
#[derive(Debug)]
pub(crate) struct Blocks<T> {
    /// The blocks in order: all full but the first and the last, none empty but a lone first
    /// block (kept for its capacity).
    blocks: VecDeque<VecDeque<T>>,
}

impl<T> Default for Blocks<T> {
    fn default() -> Self {
        Blocks {
            blocks: VecDeque::new(),
        }
    }
}

impl<T> Blocks<T> {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// The length of the blocks from the first and the last (the others are full): O(1).
    fn sum(&self, of: impl Fn(&VecDeque<T>) -> usize) -> usize {
        match (self.blocks.front(), self.blocks.back()) {
            (Some(first), Some(last)) if self.blocks.len() > 1 => {
                of(first) + (self.blocks.len() - 2) * BLOCK + of(last)
            }
            (Some(first), _) => of(first),
            _ => 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.sum(VecDeque::len)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.front().is_none_or(VecDeque::is_empty)
    }

    /// Items the blocks can hold without allocating (for memory accounting, checked on every
    /// write: O(1)). A block between the first and the last is full and holds a block's
    /// capacity (made with it, or grown to it by doubling).
    pub(crate) fn capacity(&self) -> usize {
        self.sum(VecDeque::capacity)
    }

    pub(crate) fn push_back(&mut self, item: T) {
        match self.blocks.back_mut() {
            Some(last) if last.len() < BLOCK => {
                if last.capacity() == 0 {
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
                // One slot, not the four a first push reserves: most connections are idle
                // after a reply or two. A busy one doubles from there up to a block.
                let mut block = VecDeque::new();
                block.reserve_exact(1);
                block.push_back(item);
                self.blocks.reserve_exact(1);
                self.blocks.push_back(block);
            }
        }
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
    }

    pub(crate) fn pop_front(&mut self) -> Option<T> {
        let first = self.blocks.front_mut()?;
        let item = first.pop_front()?;
        if first.is_empty() && self.blocks.len() > 1 {
            self.blocks.pop_front();
        }
        Some(item)
    }

    pub(crate) fn pop_back(&mut self) -> Option<T> {
        let last = self.blocks.back_mut()?;
        let item = last.pop_back()?;
        if last.is_empty() && self.blocks.len() > 1 {
            self.blocks.pop_back();
        }
        Some(item)
    }

    /// The item at position `index` from the front.
    pub(crate) fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        let first = self.blocks.front()?.len();
        let Some(rest) = index.checked_sub(first) else {
            return self.blocks.front_mut()?.get_mut(index);
        };
        // Every block after the first but the last is full.
        self.blocks.get_mut(1 + rest / BLOCK)?.get_mut(rest % BLOCK)
    }

    /// Empties the queue, keeping the first block's capacity.
    pub(crate) fn clear(&mut self) {
        self.blocks.truncate(1);
        if let Some(first) = self.blocks.front_mut() {
            first.clear();
        }
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
        PopBack,
        Set(usize),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => Just(Op::PushBack),
            1 => Just(Op::PushFront),
            5 => Just(Op::PopFront),
            2 => Just(Op::PopBack),
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
                    Op::PopBack => prop_assert_eq!(blocks.pop_back(), model.pop_back()),
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
                let exact: usize = blocks.blocks.iter().map(VecDeque::capacity).sum();
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
        assert_eq!(blocks.blocks.len(), 11);
        assert!(blocks.blocks.iter().all(|b| b.capacity() == BLOCK));
        let first: *const usize = blocks.get_mut(0).unwrap();
        for i in 0..5 * BLOCK {
            blocks.push_back(i);
        }
        assert_eq!(first, blocks.get_mut(0).unwrap() as *const usize);
    }

    /// The queue's handle is as small as a `VecDeque`'s (it sits in every connection's state).
    #[test]
    fn blocks_are_as_small_as_one_deque() {
        assert_eq!(
            std::mem::size_of::<Blocks<[u8; 100]>>(),
            std::mem::size_of::<VecDeque<[u8; 100]>>()
        );
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
