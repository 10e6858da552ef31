//! Byte-level mutation of a valid input, for the property tests that feed a parser bytes that
//! are almost right: `tests/protocol_fuzz.rs`, `tests/outbox_classify.rs` and the publish fast
//! path's unit tests (`src/protocol/fast.rs`, through a `#[path]` module).

use proptest::prelude::*;
use proptest::sample::Index;

/// One edit: where (an index into the bytes, or just past them), which byte, and how (0
/// replaces, 1 inserts, 2 removes).
pub(crate) type Edit = (Index, u8, u8);

/// Between `len.start` and `len.end - 1` edits.
pub(crate) fn edits(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec((any::<Index>(), any::<u8>(), 0u8..3), len)
}

/// Applies `edits` in order; an edit past the end that cannot apply there is skipped.
pub(crate) fn apply(bytes: &mut Vec<u8>, edits: &[Edit]) {
    for &(at, byte, how) in edits {
        let i = at.index(bytes.len() + 1);
        match how {
            0 if i < bytes.len() => bytes[i] = byte,
            1 => bytes.insert(i, byte),
            _ if i < bytes.len() => {
                bytes.remove(i);
            }
            _ => {}
        }
    }
}
