//! Topic batches shared across the owners of a topic's taps: each batch is cut once, by the
//! first owner to fan it out, and encoded once per wire format, whichever owner needs it first.
//!
//! Every interested shard takes a topic's publications from an inbox of its own, when it gets to
//! them, so two shards may hold different runs of the same publications. The first shard to cut
//! a batch that starts with a publication seals it on that publication ([`Entry::sealed`]): the
//! hub-wide numbers of the publications it holds, and then its NDJSON lines and its hub frame,
//! each encoded by the first shard that sends that form. A shard whose run starts with a sealed
//! publication follows the seal when the seal's publications are the first of its run, in the
//! same order; it then sends the very bytes the other shard encoded. Otherwise (its run is
//! shorter than the seal, or holds the publications in another order, which only publishers on
//! several threads cause) it cuts and encodes a batch of its own, unshared.
//!
//! So shards that hold the same publications send the same batches, encoded once per wire
//! format ([`Stats::encoded`](super::Stats::encoded) counts each encode that ran), and the
//! batches a shard follows are never longer than its own cut would be.
//!
//! A seal is set with [`OnceLock::set`]: of two shards that cut the same batch at once, one
//! sets its seal and the other follows it. An encoding is set with [`OnceLock::get_or_init`]:
//! a shard that needs a form another shard is encoding waits for that encode, of at most
//! `subscriptions.max_batch` messages in memory (no IO, no lock of the publish path), which
//! takes no longer than encoding it itself would. Publishers never touch a seal.
//!
//! A seal lives as long as the publication it is set on: a publication kept by the retained log
//! or a library subscriber's queue keeps its batch's encodings too (at most one seal per
//! publication, each at most `subscriptions.max_batch` messages).

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use powerhub_plugin::frame::{self, FrameError};

use super::Entry;

/// A batch of one topic's publications, cut by the first owner to fan them out, with its
/// encodings (see the [module documentation](self)).
#[derive(Debug)]
pub(crate) struct SealedBatch {
    /// The hub-wide numbers ([`Entry::seq`]) of the publications, in batch order.
    seqs: Box<[u64]>,
    /// The batch's JSON messages as NDJSON lines.
    lines: OnceLock<Bytes>,
    /// The batch's JSON messages as one hub frame (`None`: the frame cannot hold them).
    frame: OnceLock<Option<Bytes>>,
}

impl SealedBatch {
    /// The batch that starts `run` (which is not empty): the seal on `run[0]` when its
    /// publications are the first of `run`; else the first `max` publications of `run`, sealed
    /// on `run[0]` unless another owner sealed it first.
    pub(crate) fn cut(run: &[Arc<Entry>], max: usize) -> Arc<SealedBatch> {
        let first = &run[0];
        if let Some(seal) = first.sealed.get().filter(|s| s.starts(run)) {
            return Arc::clone(seal);
        }
        let take = run.len().min(max.max(1));
        let own = Arc::new(SealedBatch {
            seqs: run[..take].iter().map(|e| e.seq).collect(),
            lines: OnceLock::new(),
            frame: OnceLock::new(),
        });
        match first.sealed.set(Arc::clone(&own)) {
            Ok(()) => own,
            // Sealed by another owner, before the read above (with other publications: this
            // batch is not shared) or since (follow its seal if it fits).
            Err(_) => match first.sealed.get() {
                Some(seal) if seal.starts(run) => Arc::clone(seal),
                _ => own,
            },
        }
    }

    /// How many publications the batch holds.
    pub(crate) fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Whether the batch's publications are the first of `run`, in order.
    fn starts(&self, run: &[Arc<Entry>]) -> bool {
        run.len() >= self.seqs.len() && self.seqs.iter().zip(run).all(|(&seq, e)| seq == e.seq)
    }

    /// The batch's JSON messages as NDJSON lines; `batch` holds its publications (the first
    /// [`len`](Self::len) of the run it was cut from). The second value is `true` when this
    /// call encoded them.
    pub(crate) fn lines(&self, batch: &[Arc<Entry>]) -> (Bytes, bool) {
        let mut fresh = false;
        let lines = self.lines.get_or_init(|| {
            fresh = true;
            frame::encode_ndjson_batch(json_texts(batch))
        });
        (lines.clone(), fresh)
    }

    /// The batch's JSON messages as one hub frame, or the reason they do not fit one (said only
    /// to the owner that encoded it; later owners get `Ok(None)`). The `bool` is `true` when
    /// this call encoded it.
    pub(crate) fn frame(&self, batch: &[Arc<Entry>]) -> (Result<Option<Bytes>, FrameError>, bool) {
        let (mut fresh, mut failed) = (false, None);
        let frame = self.frame.get_or_init(|| {
            fresh = true;
            frame::encode_json_batch(json_texts(batch))
                .map_err(|e| failed = Some(e))
                .ok()
        });
        match failed {
            Some(e) => (Err(e), true),
            None => (Ok(frame.clone()), fresh),
        }
    }
}

/// The JSON messages of `batch` (a binary publication has no NDJSON or JSON-frame form).
fn json_texts(batch: &[Arc<Entry>]) -> impl Iterator<Item = &[u8]> + Clone {
    batch
        .iter()
        .filter(|e| e.message.is_json())
        .map(|e| &e.message.bytes()[..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::Message;

    fn entries(seqs: &[u64]) -> Vec<Arc<Entry>> {
        seqs.iter()
            .map(|&seq| {
                Arc::new(Entry {
                    seq,
                    topic_seq: 0,
                    priority: 0,
                    message: Message::json(format!("{{\"n\":{seq}}}")).unwrap(),
                    sealed: OnceLock::new(),
                })
            })
            .collect()
    }

    #[test]
    fn an_owner_holding_the_same_publications_follows_the_seal_and_encodes_nothing() {
        let run = entries(&[1, 2, 3]);
        let a = SealedBatch::cut(&run, 64);
        let (lines_a, encoded_a) = a.lines(&run);
        assert!(encoded_a);
        let b = SealedBatch::cut(&run, 64);
        assert!(Arc::ptr_eq(&a, &b));
        let (lines_b, encoded_b) = b.lines(&run);
        assert!(!encoded_b, "the second owner encoded the batch again");
        assert_eq!(lines_a.as_ptr(), lines_b.as_ptr(), "not the same bytes");
        assert_eq!(&lines_a[..], b"{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n");
    }

    #[test]
    fn a_longer_run_follows_the_seal_and_cuts_the_rest_apart() {
        let run = entries(&[1, 2, 3, 4, 5]);
        let first = SealedBatch::cut(&run[..2], 64);
        let b = SealedBatch::cut(&run, 64);
        assert!(Arc::ptr_eq(&first, &b));
        assert_eq!(b.len(), 2);
        let rest = SealedBatch::cut(&run[2..], 64);
        assert_eq!(rest.len(), 3);
    }

    #[test]
    fn a_shorter_run_or_another_order_gets_a_batch_of_its_own() {
        let run = entries(&[1, 2, 3]);
        let seal = SealedBatch::cut(&run, 64);
        let shorter = SealedBatch::cut(&run[..2], 64);
        assert!(!Arc::ptr_eq(&seal, &shorter));
        assert_eq!(shorter.len(), 2);
        let other = vec![
            Arc::clone(&run[0]),
            Arc::clone(&run[2]),
            Arc::clone(&run[1]),
        ];
        let reordered = SealedBatch::cut(&other, 64);
        assert!(!Arc::ptr_eq(&seal, &reordered));
        let (lines, _) = reordered.lines(&other);
        assert_eq!(&lines[..], b"{\"n\":1}\n{\"n\":3}\n{\"n\":2}\n");
        // The seal on the first publication is still the first owner's.
        assert!(Arc::ptr_eq(run[0].sealed.get().unwrap(), &seal));
    }

    #[test]
    fn a_batch_holds_at_most_max_publications() {
        let run = entries(&[1, 2, 3, 4, 5]);
        let b = SealedBatch::cut(&run, 2);
        assert_eq!(b.len(), 2);
        assert_eq!(SealedBatch::cut(&run, 64).len(), 2, "the seal is followed");
    }

    #[test]
    fn the_frame_is_encoded_once_and_shared() {
        let run = entries(&[7, 8]);
        let b = SealedBatch::cut(&run, 64);
        let (f1, e1) = b.frame(&run);
        let (f2, e2) = b.frame(&run);
        assert!(e1 && !e2);
        let (f1, f2) = (f1.unwrap().unwrap(), f2.unwrap().unwrap());
        assert_eq!(f1.as_ptr(), f2.as_ptr());
        let decoded = frame::decode(&f1).unwrap();
        assert_eq!(decoded.json_messages().unwrap().len(), 2);
    }

    mod model {
        use super::*;
        use proptest::prelude::*;

        /// Shards holding runs of the same publications (each a shuffle of the topic's order,
        /// or that order itself), each cutting its run a batch at a time, in any interleaving.
        /// The publications' count, each shard's run (indices into them), the schedule (a
        /// shard, and how many more publications of its run it holds), the batch bound.
        type Case = (usize, Vec<Vec<usize>>, Vec<(usize, usize)>, usize);

        fn shards() -> impl Strategy<Value = Case> {
            (1usize..12, 1usize..4, 1usize..5).prop_flat_map(|(n, shards, max)| {
                let run = proptest::collection::vec(any::<u8>(), n).prop_map(move |keys| {
                    let mut order: Vec<usize> = (0..n).collect();
                    // Mostly the topic's order (one publisher); else shuffled by the keys.
                    if keys[0] % 3 == 0 {
                        order.sort_by_key(|&i| keys[i]);
                    }
                    order
                });
                (
                    Just(n),
                    proptest::collection::vec(run, shards),
                    proptest::collection::vec((0..shards, 0usize..4), 0..64),
                    Just(max),
                )
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

            /// Against the plain model (each shard sends its run, cut in batches of at most
            /// `max`, each batch's NDJSON lines the concatenation of its messages): every shard
            /// sends its whole run, in its order, in such batches whatever the others did, also
            /// when its run reaches it a few publications at a time (`grow`, then it sends what
            /// it holds); and shards that hold the same whole run send the same batches, each
            /// encoded once.
            #[test]
            fn every_shard_sends_its_run_and_equal_runs_share_each_encode(
                (n, runs, schedule, max) in shards(),
            ) {
                let entries = entries(&(0..n as u64).collect::<Vec<_>>());
                let runs: Vec<Vec<Arc<Entry>>> = runs
                    .iter()
                    .map(|r| r.iter().map(|&i| Arc::clone(&entries[i])).collect())
                    .collect();
                let mut at = vec![0usize; runs.len()];
                let mut held = vec![0usize; runs.len()];
                let mut sent: Vec<Vec<Arc<SealedBatch>>> = vec![Vec::new(); runs.len()];
                let mut encodes = 0;
                let grows = schedule.iter().any(|&(_, grow)| grow > 0);
                let rest = (0..runs.len()).cycle().take(runs.len() * n).map(|s| (s, n));
                for (shard, grow) in schedule.into_iter().chain(rest) {
                    held[shard] = (held[shard] + grow).min(n);
                    let run = &runs[shard][at[shard]..held[shard]];
                    if run.is_empty() {
                        continue;
                    }
                    let batch = SealedBatch::cut(run, max);
                    prop_assert!(batch.len() >= 1 && batch.len() <= max);
                    let (lines, fresh) = batch.lines(&run[..batch.len()]);
                    encodes += usize::from(fresh);
                    let plain: Vec<u8> = run[..batch.len()]
                        .iter()
                        .flat_map(|e| [&e.message.bytes()[..], b"\n"].concat())
                        .collect();
                    prop_assert_eq!(&lines[..], &plain[..]);
                    at[shard] += batch.len();
                    sent[shard].push(batch);
                }
                for (shard, run) in runs.iter().enumerate() {
                    prop_assert_eq!(at[shard], run.len(), "shard {} did not send its run", shard);
                }
                let same = runs.iter().all(|r| r.iter().map(|e| e.seq).eq(runs[0].iter().map(|e| e.seq)));
                if same && !grows {
                    for other in &sent[1..] {
                        prop_assert!(
                            other.len() == sent[0].len()
                                && other.iter().zip(&sent[0]).all(|(a, b)| Arc::ptr_eq(a, b)),
                            "shards holding the same run sent different batches"
                        );
                    }
                    prop_assert_eq!(encodes, sent[0].len(), "a shared batch was encoded twice");
                }
            }
        }
    }
}
