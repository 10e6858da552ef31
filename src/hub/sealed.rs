//! Topic batches shared across the owners of a topic's taps: a batch that several shards send
//! is cut once, by the first shard to fan it out, and encoded once per wire format.
//!
//! Every interested shard takes a topic's publications from an inbox of its own, when it gets to
//! them, so two shards may hold different runs of the same publications. When a publication
//! went to more than one shard ([`Entry::taps`]), the first shard to cut a batch that starts
//! with it seals the batch there ([`Entry::sealed`]): the hub-wide numbers of the publications
//! it holds, and then its NDJSON lines and its hub frame, each encoded by the first shard that
//! sends that form. A shard whose run starts with a sealed publication follows the seal when the
//! seal's publications are the first of its run, in the same order, and sends the very bytes
//! the other shard encoded. Otherwise it cuts and encodes a batch of its own, unshared: its run
//! is shorter than the seal (it took its inbox before the sealing shard took the rest), or holds
//! the publications in another order (publishers on several threads), or its previous batch
//! ended elsewhere, so that it never cuts at the sealed publication at all.
//!
//! So shards that take the same publications send the same batches, each encoded once per wire
//! format ([`Stats::encoded`](super::Stats::encoded) counts each encode that ran); shards whose
//! takes drift apart under load share less, down to one encode per shard and batch (what every
//! batch cost before seals). A batch a shard follows is never longer than its own cut would be.
//! A publication that went to one shard only is never sealed (no allocation, no lock).
//!
//! A seal is a pointer on the publication ([`SealCell`]), set, read and cleared without a lock
//! by the shards that cut there (publishers never touch it; the orderings are documented at
//! each step of [`SealedBatch::cut`], and `loom_tests` models them). An encoding is set with
//! [`OnceLock::get_or_init`]: a shard that needs a form another shard is encoding waits for that
//! encode of at most `subscriptions.max_batch` messages in memory (no IO, no lock, no user
//! code). That is usually shorter than encoding it again, but if the encoding shard's thread is
//! preempted the waiting shard waits for it to run again.
//!
//! Each other shard that cuts at a sealed publication counts itself off the seal, and the last
//! one clears it, so the encodings are freed as soon as every shard has used them. A seal that
//! some shard never cuts at stays until the publication itself is freed: until then a
//! publication kept by the retained log, a library subscriber's queue or a [`Received`] the
//! caller holds keeps its batch's encodings too (at most two forms of at most
//! `subscriptions.max_batch` messages per publication; a `Received` of a drop-oldest receiver
//! keeps its chunk of the topic's log, up to 64 publications, each with its own seal).
//!
//! [`Received`]: super::Received

use std::ops::Deref;
use std::ptr;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use powerhub_plugin::frame::{self, FrameError};

use super::Entry;
use crate::loom::cell::UnsafeCell;
use crate::loom::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

/// The seal on a publication: the batch, and how many other shards may still cut there.
#[derive(Debug)]
struct Seal {
    /// Read by each other shard once (`with`), written only by the free (`Drop`): a cell, so
    /// that the model checker sees both accesses and reports a free not ordered after a read.
    batch: UnsafeCell<Arc<SealedBatch>>,
    /// Shards that received the publication and have not cut at it yet (the sealing one
    /// excluded); the one that takes it to zero clears the seal and frees it.
    others: AtomicU32,
}

impl Drop for Seal {
    fn drop(&mut self) {
        // The free is a write of the cell (recorded under loom; nothing otherwise).
        self.batch.with_mut(|_| ());
    }
}

/// A publication's seal: null, or a [`Seal`] leaked from a `Box` by the shard that sealed it,
/// freed by the last other shard to cut there, or with the publication when one never does.
///
/// The seal is read only by the shards counted in its `others`, each once, before it counts
/// itself off: so it is freed only after every read of it (the count's Release/Acquire pair, as
/// an `Arc`'s drop), and a shard that loads the pointer always finds it allocated.
#[derive(Debug)]
pub(crate) struct SealCell(AtomicPtr<Seal>);

impl Default for SealCell {
    fn default() -> SealCell {
        SealCell(AtomicPtr::new(ptr::null_mut()))
    }
}

impl SealCell {
    /// Whether a seal is set (for tests: the answer may be stale as soon as it is returned).
    #[cfg(test)]
    fn is_sealed(&self) -> bool {
        !self.0.load(Ordering::Acquire).is_null()
    }
}

impl Drop for SealCell {
    fn drop(&mut self) {
        // `&mut`: no shard cuts at the publication any more (the last reference to it goes,
        // after theirs, ordered by the publication's `Arc`), so a relaxed load sees the last
        // store.
        let p = self.0.load(Ordering::Relaxed);
        if !p.is_null() {
            // SAFETY: a non-null pointer is a leaked `Box<Seal>` that no shard freed (the one
            // that frees it swaps null in first), and nothing else can read it now.
            drop(unsafe { Box::from_raw(p) });
        }
    }
}

/// A batch of one topic's publications, with its encodings (see the
/// [module documentation](self)).
#[derive(Debug)]
pub(crate) struct SealedBatch {
    /// How many publications the batch holds.
    len: usize,
    /// The hub-wide numbers ([`Entry::seq`]) of the publications, in batch order (empty for a
    /// batch that is not sealed).
    seqs: Box<[u64]>,
    /// The batch's JSON messages as NDJSON lines.
    lines: OnceLock<Bytes>,
    /// The batch's JSON messages as one hub frame (`None`: the frame cannot hold them).
    frame: OnceLock<Option<Bytes>>,
}

/// A batch as [`SealedBatch::cut`] cut it: shared with the other shards, or this shard's alone.
#[derive(Debug)]
pub(crate) enum Cut {
    Shared(Arc<SealedBatch>),
    Alone(SealedBatch),
}

impl Deref for Cut {
    type Target = SealedBatch;

    fn deref(&self) -> &SealedBatch {
        match self {
            Cut::Shared(b) => b,
            Cut::Alone(b) => b,
        }
    }
}

impl SealedBatch {
    fn new(len: usize, seqs: Box<[u64]>) -> SealedBatch {
        SealedBatch {
            len,
            seqs,
            lines: OnceLock::new(),
            frame: OnceLock::new(),
        }
    }

    /// The batch that starts `run` (which is not empty): the seal on `run[0]` when its
    /// publications are the first of `run`; else the first `max` publications of `run`, sealed
    /// on `run[0]` when no other shard sealed it first and the publication went to others.
    pub(crate) fn cut(run: &[Arc<Entry>], max: usize) -> Cut {
        let first = &run[0];
        let take = run.len().min(max.max(1));
        if first.taps < 2 {
            return Cut::Alone(SealedBatch::new(take, Box::default()));
        }
        let cell = &first.sealed.0;
        // Acquire: pairs with the sealing shard's CAS, so the seal's fields are visible.
        let mut p = cell.load(Ordering::Acquire);
        if p.is_null() {
            let batch = Arc::new(SealedBatch::new(
                take,
                run[..take].iter().map(|e| e.seq).collect(),
            ));
            let seal = Box::into_raw(Box::new(Seal {
                batch: UnsafeCell::new(Arc::clone(&batch)),
                others: AtomicU32::new(first.taps - 1),
            }));
            // Release on success: the seal's fields before the pointer, for the shards that
            // load it. Acquire on failure: the winner's seal, which this shard follows.
            match cell.compare_exchange(ptr::null_mut(), seal, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Cut::Shared(batch),
                Err(winner) => {
                    // SAFETY: `seal` was never shared: the exchange failed.
                    drop(unsafe { Box::from_raw(seal) });
                    p = winner;
                }
            }
        }
        // This shard is one of the seal's `others` and will not cut at this publication again:
        // it reads the seal, then counts itself off.
        // SAFETY: `p` is non-null, set by the sealing shard, and freed only once every other
        // shard, this one included, has counted itself off, which this one does below after its
        // last read.
        let seal = unsafe { &*p };
        // SAFETY: the cell is written only when the seal is freed, which is after this read
        // (see above).
        let batch = seal.batch.with(|b| Arc::clone(unsafe { &*b }));
        // AcqRel, as an `Arc`'s drop: each shard's reads of the seal happen before the count
        // reaches zero (Release), and the shard that takes it there frees the seal after all of
        // them (Acquire).
        if seal.others.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last: no shard loads the pointer again. Relaxed: the publication's drop reads
            // the cell through `&mut`, ordered by the `Arc`s that hand the publication over.
            let q = cell.swap(ptr::null_mut(), Ordering::Relaxed);
            debug_assert_eq!(q, p);
            // SAFETY: every other reader counted itself off after its reads (see above), and
            // the cell no longer holds the pointer: this is its only owner.
            drop(unsafe { Box::from_raw(p) });
        }
        if batch.starts(run) {
            Cut::Shared(batch)
        } else {
            Cut::Alone(SealedBatch::new(take, Box::default()))
        }
    }

    /// How many publications the batch holds.
    pub(crate) fn len(&self) -> usize {
        self.len
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
            if batch.iter().all(|e| e.message.is_json_line()) {
                // Lines already (what the push protocol publishes): copied as they are.
                frame::encode_ndjson_lines(batch.iter().map(|e| &e.message.bytes()[..]))
            } else {
                frame::encode_ndjson_batch(json_texts(batch))
            }
        });
        (lines.clone(), fresh)
    }

    /// The batch's JSON messages as one hub frame, or the reason they do not fit one (said only
    /// to the shard that tried to encode it; later ones get `Ok(None)`). The `bool` is `true`
    /// when this call encoded a frame.
    pub(crate) fn frame(&self, batch: &[Arc<Entry>]) -> (Result<Option<Bytes>, FrameError>, bool) {
        let (mut fresh, mut failed) = (false, None);
        let frame = self.frame.get_or_init(|| {
            fresh = true;
            frame::encode_json_batch(json_texts(batch))
                .map_err(|e| failed = Some(e))
                .ok()
        });
        match failed {
            Some(e) => (Err(e), false),
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::hub::Message;

    /// Publications numbered `seqs`, each handed to `taps` shards.
    fn entries(seqs: &[u64], taps: u32) -> Vec<Arc<Entry>> {
        seqs.iter()
            .map(|&seq| {
                Arc::new(Entry::new(
                    seq,
                    0,
                    0,
                    Message::json(format!("{{\"n\":{seq}}}")).unwrap(),
                    taps,
                ))
            })
            .collect()
    }

    fn shared(cut: &Cut) -> &Arc<SealedBatch> {
        match cut {
            Cut::Shared(b) => b,
            Cut::Alone(_) => panic!("the batch is not shared"),
        }
    }

    #[test]
    fn a_shard_holding_the_same_publications_follows_the_seal_and_encodes_nothing() {
        let run = entries(&[1, 2, 3], 2);
        let a = SealedBatch::cut(&run, 64);
        let (lines_a, encoded_a) = a.lines(&run);
        assert!(encoded_a);
        let b = SealedBatch::cut(&run, 64);
        assert!(Arc::ptr_eq(shared(&a), shared(&b)));
        let (lines_b, encoded_b) = b.lines(&run);
        assert!(!encoded_b, "the second shard encoded the batch again");
        assert_eq!(lines_a.as_ptr(), lines_b.as_ptr(), "not the same bytes");
        assert_eq!(&lines_a[..], b"{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n");
    }

    /// Messages the push parser made one line are copied as they are; a batch holding any
    /// other JSON message goes through the encoder, which flattens raw line breaks. Both give
    /// the same lines for the same text.
    #[test]
    fn one_line_messages_are_copied_as_lines_and_others_flattened() {
        let entry = |seq: u64, m: Message| Arc::new(Entry::new(seq, 0, 0, m, 1));
        let lines = |run: &[Arc<Entry>]| SealedBatch::cut(run, 64).lines(run).0;
        let validated = |t: &'static str| Message::json_validated(Bytes::from_static(t.as_bytes()));
        let one_line = vec![
            entry(1, validated(r#"{"n":1}"#)),
            entry(2, validated(r#"{"n": 2}"#)),
        ];
        assert_eq!(&lines(&one_line)[..], b"{\"n\":1}\n{\"n\": 2}\n");
        let mixed = vec![
            entry(3, validated(r#"{"n":1}"#)),
            entry(4, Message::json("{\"n\":\n2}").unwrap()),
        ];
        assert_eq!(&lines(&mixed)[..], b"{\"n\":1}\n{\"n\": 2}\n");
    }

    #[test]
    fn a_longer_run_follows_the_seal_and_cuts_the_rest_apart() {
        let run = entries(&[1, 2, 3, 4, 5], 2);
        let first = SealedBatch::cut(&run[..2], 64);
        let b = SealedBatch::cut(&run, 64);
        assert!(Arc::ptr_eq(shared(&first), shared(&b)));
        assert_eq!(b.len(), 2);
        let rest = SealedBatch::cut(&run[2..], 64);
        assert_eq!(rest.len(), 3);
    }

    #[test]
    fn a_shorter_run_or_another_order_gets_a_batch_of_its_own() {
        let run = entries(&[1, 2, 3], 3);
        let seal = SealedBatch::cut(&run, 64);
        let shorter = SealedBatch::cut(&run[..2], 64);
        assert!(matches!(shorter, Cut::Alone(_)));
        assert_eq!(shorter.len(), 2);
        let other = vec![
            Arc::clone(&run[0]),
            Arc::clone(&run[2]),
            Arc::clone(&run[1]),
        ];
        let reordered = SealedBatch::cut(&other, 64);
        assert!(matches!(reordered, Cut::Alone(_)));
        let (lines, _) = reordered.lines(&other);
        assert_eq!(&lines[..], b"{\"n\":1}\n{\"n\":3}\n{\"n\":2}\n");
        drop(seal);
    }

    #[test]
    fn a_publication_for_one_shard_is_never_sealed() {
        let run = entries(&[1, 2], 1);
        assert!(matches!(SealedBatch::cut(&run, 64), Cut::Alone(_)));
        assert!(!run[0].sealed.is_sealed());
    }

    #[test]
    fn the_seal_is_cleared_once_every_other_shard_cut_there() {
        let run = entries(&[1, 2], 3);
        let a = SealedBatch::cut(&run, 64);
        let (lines, _) = a.lines(&run);
        assert!(run[0].sealed.is_sealed());
        let _b = SealedBatch::cut(&run, 64);
        assert!(run[0].sealed.is_sealed(), "one shard has yet to cut here");
        // The third shard holds a shorter run: it does not follow, but it is done here too.
        let c = SealedBatch::cut(&run[..1], 64);
        assert!(matches!(c, Cut::Alone(_)));
        assert!(
            !run[0].sealed.is_sealed(),
            "the encodings outlive their use"
        );
        drop(a);
        drop(_b);
        assert_eq!(&lines[..], b"{\"n\":1}\n{\"n\":2}\n");
    }

    #[test]
    fn a_batch_holds_at_most_max_publications() {
        let run = entries(&[1, 2, 3, 4, 5], 2);
        let b = SealedBatch::cut(&run, 2);
        assert_eq!(b.len(), 2);
        assert_eq!(SealedBatch::cut(&run, 64).len(), 2, "the seal is followed");
    }

    #[test]
    fn the_frame_is_encoded_once_and_shared() {
        let run = entries(&[7, 8], 2);
        let b = SealedBatch::cut(&run, 64);
        let (f1, e1) = b.frame(&run);
        let (f2, e2) = SealedBatch::cut(&run, 64).frame(&run);
        assert!(e1 && !e2);
        let (f1, f2) = (f1.unwrap().unwrap(), f2.unwrap().unwrap());
        assert_eq!(f1.as_ptr(), f2.as_ptr());
        let decoded = frame::decode(&f1).unwrap();
        assert_eq!(decoded.json_messages().unwrap().len(), 2);
    }

    /// Two threads cut the same run at once, many times: both send one batch, encoded once.
    #[test]
    fn two_shards_cutting_at_once_share_one_batch_and_one_encode() {
        for round in 0..500u64 {
            let run = Arc::new(entries(&[round, round + 1], 2));
            let start = Arc::new(std::sync::Barrier::new(2));
            let shards: Vec<_> = (0..2)
                .map(|_| {
                    let (run, start) = (Arc::clone(&run), Arc::clone(&start));
                    std::thread::spawn(move || {
                        start.wait();
                        let cut = SealedBatch::cut(&run, 64);
                        let (lines, fresh) = cut.lines(&run);
                        (Arc::clone(shared(&cut)), lines, fresh)
                    })
                })
                .collect();
            let [(a, la, fa), (b, lb, fb)]: [_; 2] = shards
                .into_iter()
                .map(|s| s.join().unwrap())
                .collect::<Vec<_>>()
                .try_into()
                .unwrap();
            assert!(Arc::ptr_eq(&a, &b), "round {round}: two batches");
            assert_eq!(la.as_ptr(), lb.as_ptr());
            assert!(
                fa != fb,
                "round {round}: encoded {} times",
                u8::from(fa) + u8::from(fb)
            );
            assert!(!run[0].sealed.is_sealed());
        }
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
                    // Half the cases hold their whole run from the start (the shards then
                    // share every batch); the rest receive it a few publications at a time.
                    prop_oneof![
                        Just(Vec::new()),
                        proptest::collection::vec((0..shards, 0usize..4), 0..64),
                    ],
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
                let taps = runs.len() as u32;
                let entries = entries(&(0..n as u64).collect::<Vec<_>>(), taps);
                let runs: Vec<Vec<Arc<Entry>>> = runs
                    .iter()
                    .map(|r| r.iter().map(|&i| Arc::clone(&entries[i])).collect())
                    .collect();
                let mut at = vec![0usize; runs.len()];
                let mut held = vec![0usize; runs.len()];
                let mut sent: Vec<Vec<Cut>> = (0..runs.len()).map(|_| Vec::new()).collect();
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
                                && other.iter().zip(&sent[0]).all(|(a, b)| match (a, b) {
                                    (Cut::Shared(a), Cut::Shared(b)) => Arc::ptr_eq(a, b),
                                    _ => taps == 1,
                                }),
                            "shards holding the same run sent different batches"
                        );
                    }
                    prop_assert_eq!(encodes, sent[0].len(), "a shared batch was encoded twice");
                }
                // Every shard cut at every publication a seal starts at: no seal is left.
                if same && !grows {
                    prop_assert!(entries.iter().all(|e| !e.sealed.is_sealed()), "a seal outlived its use");
                }
            }
        }
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::hub::Message;
    use loom::thread;

    /// One publication handed to `taps` shards.
    fn run(taps: u32) -> Arc<Vec<Arc<Entry>>> {
        Arc::new(vec![Arc::new(Entry::new(
            1,
            0,
            0,
            Message::json("{}").unwrap(),
            taps,
        ))])
    }

    fn shared(cut: Cut) -> Arc<SealedBatch> {
        match cut {
            Cut::Shared(b) => b,
            Cut::Alone(_) => panic!("the batch is not shared"),
        }
    }

    /// Three shards cut the same run at once: one seals, the other two follow that seal (one
    /// batch for all), and the last of them frees the seal, once, leaving the cell empty. A
    /// seal freed early would be read after its free (a crash or a wrong batch); one never
    /// freed would keep a reference to the batch.
    #[test]
    fn shards_cutting_at_once_share_one_seal_that_the_last_frees_once() {
        loom::model(|| {
            let run = run(3);
            let shards: Vec<_> = (0..2)
                .map(|_| {
                    let run = Arc::clone(&run);
                    thread::spawn(move || shared(SealedBatch::cut(&run, 64)))
                })
                .collect();
            let mine = shared(SealedBatch::cut(&run, 64));
            let others: Vec<_> = shards.into_iter().map(|s| s.join().unwrap()).collect();
            for other in &others {
                assert!(Arc::ptr_eq(other, &mine), "two batches");
            }
            assert!(
                !run[0].sealed.is_sealed(),
                "the seal outlived the last shard"
            );
            drop(others);
            assert_eq!(Arc::strong_count(&mine), 1, "the seal was not freed");
        });
    }

    /// Of three shards, two cut (at once): the seal stays for the third, and goes with the
    /// publication.
    #[test]
    fn a_seal_some_shard_never_cuts_at_goes_with_the_publication() {
        loom::model(|| {
            let run = run(3);
            let other = {
                let run = Arc::clone(&run);
                thread::spawn(move || shared(SealedBatch::cut(&run, 64)))
            };
            let mine = shared(SealedBatch::cut(&run, 64));
            let other = other.join().unwrap();
            assert!(Arc::ptr_eq(&other, &mine), "two batches");
            assert!(
                run[0].sealed.is_sealed(),
                "cleared with a shard still to cut"
            );
            drop(other);
            drop(run);
            assert_eq!(Arc::strong_count(&mine), 1, "the seal was not freed");
        });
    }
}
