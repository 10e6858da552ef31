//! Concurrency primitives behind one door, so the model checker can replace them.
//!
//! Lock-free code in this crate takes its atomics, its `UnsafeCell` and its spin-wait from this
//! module, never from `std` directly. A normal build re-exports the standard types; a build with
//! `RUSTFLAGS="--cfg loom"` swaps in [loom](https://docs.rs/loom)'s instrumented types, and the
//! tests under `tests/loom_*.rs` then explore every interleaving (up to a preemption bound) of the
//! code unchanged.
//!
//! The cell type always offers loom's closure-based access, `with(|ptr| ..)` for reads and
//! `with_mut(|ptr| ..)` for writes, so that under loom every access to the shared memory is
//! recorded and a data race is reported instead of silently happening.

#[cfg(not(loom))]
mod imp {
    pub(crate) mod sync {
        pub(crate) mod atomic {
            pub(crate) use std::sync::atomic::{
                fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
            };
        }
        pub(crate) use std::sync::Arc;
    }

    pub(crate) mod cell {
        /// `std::cell::UnsafeCell` with loom's closure-based access API.
        #[derive(Debug)]
        pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

        impl<T> UnsafeCell<T> {
            /// Wraps `value`.
            pub(crate) const fn new(value: T) -> Self {
                UnsafeCell(std::cell::UnsafeCell::new(value))
            }

            /// Gives `f` a read pointer to the contents. Dereferencing it is the caller's
            /// responsibility (no concurrent writer).
            #[inline(always)]
            pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
                f(self.0.get())
            }

            /// Gives `f` a write pointer to the contents. Dereferencing it is the caller's
            /// responsibility (no concurrent reader or writer).
            #[inline(always)]
            pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
                f(self.0.get())
            }
        }
    }

    pub(crate) mod hint {
        /// Exponential spin-then-yield backoff for contended retry loops.
        #[derive(Debug)]
        pub(crate) struct Backoff(crossbeam_utils::Backoff);

        impl Backoff {
            /// A fresh backoff, starting with the shortest wait.
            #[inline]
            pub(crate) fn new() -> Self {
                Backoff(crossbeam_utils::Backoff::new())
            }

            /// Waits a little after losing a race that another thread already won: the state
            /// changed, retrying right away is useful.
            #[inline]
            pub(crate) fn spin(&self) {
                self.0.spin();
            }

            /// Waits for another thread to finish something it started (a claimed slot not yet
            /// published): spins briefly, then yields the CPU.
            #[inline]
            pub(crate) fn snooze(&self) {
                self.0.snooze();
            }
        }
    }
}

#[cfg(loom)]
mod imp {
    pub(crate) mod sync {
        pub(crate) mod atomic {
            pub(crate) use ::loom::sync::atomic::{
                fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
            };
        }
        pub(crate) use ::loom::sync::Arc;
    }

    pub(crate) mod cell {
        pub(crate) use ::loom::cell::UnsafeCell;
    }

    pub(crate) mod hint {
        /// Under loom every wait must hand control back to the scheduler, or a model that waits
        /// for another thread would never terminate.
        #[derive(Debug)]
        pub(crate) struct Backoff(());

        impl Backoff {
            pub(crate) fn new() -> Self {
                Backoff(())
            }

            pub(crate) fn spin(&self) {
                ::loom::thread::yield_now();
            }

            pub(crate) fn snooze(&self) {
                ::loom::thread::yield_now();
            }
        }
    }
}

pub(crate) use imp::*;
