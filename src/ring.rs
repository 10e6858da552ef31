//! Bounded lock-free per-subscriber rings.
//!
//! Placeholder backed by `crossbeam_queue::ArrayQueue` until the own ring lands; the API is the
//! one the hub uses.

use crossbeam_queue::ArrayQueue;

/// A bounded multi-producer queue with a drop-oldest overwrite.
#[derive(Debug)]
pub struct Ring<T> {
    inner: ArrayQueue<T>,
}

/// The ring was full; the value is handed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full<T>(pub T);

impl<T> Ring<T> {
    /// A ring holding at most `capacity` values (`capacity >= 1`).
    pub fn new(capacity: usize) -> Self {
        Ring { inner: ArrayQueue::new(capacity) }
    }
    /// Pushes `value`, or hands it back when the ring is full (drop-newest).
    pub fn push(&self, value: T) -> Result<(), Full<T>> {
        self.inner.push(value).map_err(Full)
    }
    /// Pushes `value`, evicting and returning the oldest value when full (drop-oldest).
    pub fn force_push(&self, value: T) -> Option<T> {
        self.inner.force_push(value)
    }
    /// Pops the oldest value.
    pub fn pop(&self) -> Option<T> {
        self.inner.pop()
    }
    /// Number of values queued.
    pub fn len(&self) -> usize {
        self.inner.len()
    }
    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }
    /// The capacity given at construction.
    pub fn capacity(&self) -> usize {
        self.inner.capacity()
    }
}
