//! A connection's queue of bytes not yet taken by the kernel, and the gather list of the send in
//! flight.

use std::collections::VecDeque;

use bytes::Bytes;

/// Most iovecs handed to one `sendmsg` (Linux's `UIO_MAXIOV` is 1024).
pub(crate) const MAX_IOV: usize = 1024;

/// Outbound bytes of one connection, in order. Chunks are shared `Bytes` (a hub batch frame is
/// queued by reference, never copied); `front_offset` says how much of the first chunk the
/// kernel already took (partial writes resume mid-chunk, never reorder or duplicate).
///
/// The queue is allocated at its first push and freed once the kernel took everything: a
/// connection holds these bytes rarely (handshake replies, pongs, final errors), so an empty
/// queue is one null pointer.
#[derive(Debug, Default)]
pub(crate) struct WriteQueue {
    inner: Option<Box<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    chunks: VecDeque<Bytes>,
    front_offset: usize,
    unsent: usize,
}

impl WriteQueue {
    /// Appends a chunk.
    pub(crate) fn push(&mut self, chunk: Bytes) {
        if !chunk.is_empty() {
            let inner = self.inner.get_or_insert_default();
            inner.unsent += chunk.len();
            inner.chunks.push_back(chunk);
        }
    }

    /// Bytes queued and not yet taken by the kernel (the spec's `writableLength`).
    pub(crate) fn unsent(&self) -> usize {
        self.inner.as_ref().map_or(0, |q| q.unsent)
    }

    /// Whether the kernel took part of the first chunk (a message is half written).
    pub(crate) fn is_partial(&self) -> bool {
        self.inner.as_ref().is_some_and(|q| q.front_offset > 0)
    }

    /// Whether nothing is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.unsent() == 0
    }

    /// Appends to `out` the chunks of the next send (the first one trimmed by the offset
    /// already written), at most `max` of them. Returns the bytes offered.
    pub(crate) fn prepare(&self, out: &mut Vec<Bytes>, max: usize) -> usize {
        let Some(q) = self.inner.as_deref() else {
            return 0;
        };
        let mut offered = 0;
        for (i, chunk) in q.chunks.iter().take(max).enumerate() {
            let c = if i == 0 {
                chunk.slice(q.front_offset..)
            } else {
                chunk.clone()
            };
            offered += c.len();
            out.push(c);
        }
        offered
    }

    /// Drops the first `n` bytes: the kernel took them.
    pub(crate) fn advance(&mut self, mut n: usize) {
        let Some(q) = self.inner.as_deref_mut() else {
            debug_assert_eq!(n, 0);
            return;
        };
        debug_assert!(n <= q.unsent);
        q.unsent -= n.min(q.unsent);
        while n > 0 {
            let Some(front) = q.chunks.front() else {
                break;
            };
            let left = front.len() - q.front_offset;
            if n >= left {
                n -= left;
                q.chunks.pop_front();
                q.front_offset = 0;
            } else {
                q.front_offset += n;
                n = 0;
            }
        }
        if q.unsent == 0 {
            self.inner = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(q: &mut WriteQueue, step: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut inflight = Vec::new();
        while !q.is_empty() {
            inflight.clear();
            let offered = q.prepare(&mut inflight, MAX_IOV);
            let n = step.min(offered);
            let mut left = n;
            for c in &inflight {
                let take = left.min(c.len());
                out.extend_from_slice(&c[..take]);
                left -= take;
            }
            q.advance(n);
        }
        out
    }

    #[test]
    fn partial_writes_resume_mid_chunk_without_reorder_or_duplicate() {
        for step in 1..12 {
            let mut q = WriteQueue::default();
            q.push(Bytes::from_static(b"abc\n"));
            q.push(Bytes::from_static(b"defgh\n"));
            q.push(Bytes::from_static(b"i\n"));
            assert_eq!(q.unsent(), 12);
            assert_eq!(drain(&mut q, step), b"abc\ndefgh\ni\n");
            assert_eq!(q.unsent(), 0);
            assert!(q.inner.is_none(), "an empty queue holds no allocation");
        }
    }
}
