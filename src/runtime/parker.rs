//! The sleep/wake handshake between a shard and the threads that queue work for it.
//!
//! A shard about to block announces it ([`Parker::park_begin`]: store `parked`, then a `SeqCst`
//! fence) and then checks its queue once more; a producer pushes into the queue and then
//! ([`Parker::should_wake`]: a `SeqCst` fence, then a load of `parked`) learns whether it must
//! write the shard's eventfd. This is Dekker's pattern: the two fences are ordered in the single
//! total order of `SeqCst` operations, so either the shard's queue check sees the push, or the
//! producer's load sees `parked` — a message is never left behind a sleeping shard. The `swap` in
//! `should_wake` lets only one producer pay for the eventfd write per sleep. The flag itself
//! publishes nothing, so its loads and stores are `Relaxed`; the fences do the ordering.
//!
//! The model test (`RUSTFLAGS="--cfg loom" cargo test -p powerhub --release --lib
//! runtime::parker`) checks every interleaving of a shard and two producers.

use crate::loom::sync::atomic::{fence, AtomicU64, Ordering};

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct Parker {
    /// 1 while the shard may block in its backend, 0 otherwise.
    parked: AtomicU64,
}

impl Parker {
    /// Shard side, before its last queue check and the blocking wait.
    pub(crate) fn park_begin(&self) {
        self.parked.store(1, Ordering::Relaxed);
        // Pairs with the fence in `should_wake`: orders the store above before the caller's
        // queue check in the total order of SeqCst fences.
        fence(Ordering::SeqCst);
    }

    /// Shard side, after the wait returned.
    pub(crate) fn park_end(&self) {
        self.parked.store(0, Ordering::Relaxed);
    }

    /// Producer side, after pushing into the shard's queue: `true` when the producer must wake
    /// the shard.
    pub(crate) fn should_wake(&self) -> bool {
        // Pairs with the fence in `park_begin`: orders the caller's push before the load below.
        fence(Ordering::SeqCst);
        self.parked.load(Ordering::Relaxed) == 1 && self.parked.swap(0, Ordering::Relaxed) == 1
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::Parker;
    use loom::sync::atomic::{AtomicU64, Ordering};
    use loom::sync::Arc;

    /// A shard that finds its queue empty after `park_begin` and goes to sleep must find a
    /// wake-up pending whenever a producer pushed: no lost wake-up, with two producers.
    #[test]
    fn a_push_is_never_left_behind_a_sleeping_shard() {
        loom::model(|| {
            let parker = Arc::new(Parker::default());
            let queued = Arc::new(AtomicU64::new(0));
            let woken = Arc::new(AtomicU64::new(0));
            let producers: Vec<_> = (0..2)
                .map(|_| {
                    let (parker, queued, woken) = (parker.clone(), queued.clone(), woken.clone());
                    loom::thread::spawn(move || {
                        queued.fetch_add(1, Ordering::Relaxed);
                        if parker.should_wake() {
                            woken.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                })
                .collect();
            parker.park_begin();
            let slept_on_empty = queued.load(Ordering::Relaxed) == 0;
            for p in producers {
                p.join().unwrap();
            }
            if slept_on_empty {
                assert!(
                    woken.load(Ordering::Relaxed) >= 1,
                    "a push happened while the shard slept, and nobody woke it"
                );
            }
            parker.park_end();
        });
    }
}
