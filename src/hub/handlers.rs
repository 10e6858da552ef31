//! Where the handlers of a [`Driver::Thread`](super::Driver::Thread) hub run: a small pool of
//! threads with a standby, so that a handler that blocks holds up only its own subscriber.
//!
//! The drain hands each batch whose transport took it to the pool as one job, and the
//! subscriber stays in flight (skipped by the drain, its queue absorbing new messages under its
//! policy) until the job ran: one subscriber's handler runs for one batch at a time, in order,
//! while the handlers of different subscribers may run at once, on different workers.
//!
//! Active workers take jobs as they come (one, while handlers keep up). The standby takes none:
//! it watches the queue, and when the oldest job has waited [`STUCK`] (every active worker is
//! inside a handler that does not return) it becomes active, takes that job and starts a new
//! standby, up to [`MAX_WORKERS`]. So a handler that sleeps 300 ms delays the others by about
//! [`STUCK`], not 300 ms, and handlers that keep up cost one worker, not one per job. Active
//! workers beyond the first leave after [`IDLE_EXIT`] without work.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The most workers a hub's pool starts: handlers blocked beyond it wait for one to return.
pub(crate) const MAX_WORKERS: usize = 64;
/// How long the oldest job waits, with every active worker busy, before the standby takes it.
pub(crate) const STUCK: Duration = Duration::from_millis(1);
/// How long an active worker beyond the first waits for work before it leaves.
pub(crate) const IDLE_EXIT: Duration = Duration::from_secs(10);

struct State<T> {
    /// Jobs, each with when it was queued.
    jobs: VecDeque<(Instant, T)>,
    /// Active workers waiting for a job.
    idle: usize,
    /// Workers alive, the standby included.
    workers: usize,
    /// Whether a standby is alive.
    standby: bool,
    closed: bool,
}

/// A pool running jobs of type `T` with `run`.
pub(crate) struct Pool<T> {
    state: Mutex<State<T>>,
    /// Active workers wait here.
    work_cv: Condvar,
    /// The standby waits here.
    standby_cv: Condvar,
    run: Box<dyn Fn(T) + Send + Sync>,
}

impl<T: Send + 'static> Pool<T> {
    pub(crate) fn new(run: impl Fn(T) + Send + Sync + 'static) -> Arc<Pool<T>> {
        Arc::new(Pool {
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                idle: 0,
                workers: 0,
                standby: false,
                closed: false,
            }),
            work_cv: Condvar::new(),
            standby_cv: Condvar::new(),
            run: Box::new(run),
        })
    }

    /// Queues `jobs` (one lock for all of them) and wakes a worker; the first jobs start the
    /// first worker and the standby.
    pub(crate) fn push_all(self: &Arc<Self>, jobs: impl IntoIterator<Item = T>) {
        let now = Instant::now();
        let mut st = self.state.lock();
        let before = st.jobs.len();
        st.jobs.extend(jobs.into_iter().map(|j| (now, j)));
        let added = st.jobs.len() - before;
        if added == 0 {
            return;
        }
        // One idle worker per job, as far as there are some.
        for _ in 0..added.min(st.idle) {
            self.work_cv.notify_one();
        }
        if before == 0 {
            // The standby starts its watch.
            self.standby_cv.notify_one();
        }
        if st.closed {
            return;
        }
        let active = st.workers == 0;
        // A standby that became active at the worker limit, or that could not start, is
        // replaced once there is room again.
        let standby = !st.standby && st.workers < MAX_WORKERS;
        if active {
            st.workers += 1;
        }
        if standby {
            st.workers += 1;
            st.standby = true;
        }
        drop(st);
        if active {
            self.start(false);
        }
        if standby {
            self.start(true);
        }
    }

    /// Lets the workers leave once the jobs queued so far ran.
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
        self.work_cv.notify_all();
        self.standby_cv.notify_all();
    }

    fn start(self: &Arc<Self>, standby: bool) {
        let pool = Arc::clone(self);
        let started = std::thread::Builder::new()
            .name("powerhub-handlers".into())
            .spawn(move || pool.work(standby));
        if started.is_err() {
            let mut st = self.state.lock();
            st.workers -= 1;
            if standby {
                st.standby = false;
            }
            if st.workers == usize::from(st.standby) {
                // No active worker: run what is queued here (the caller's thread) rather than
                // never.
                while let Some((_, job)) = st.jobs.pop_front() {
                    drop(st);
                    (self.run)(job);
                    st = self.state.lock();
                }
            }
        }
    }

    fn work(self: Arc<Self>, mut standby: bool) {
        let mut st = self.state.lock();
        loop {
            if standby {
                match st.jobs.front().map(|(at, _)| *at + STUCK) {
                    _ if st.closed => {
                        st.workers -= 1;
                        st.standby = false;
                        return;
                    }
                    None => {
                        self.standby_cv.wait(&mut st);
                    }
                    Some(due) if Instant::now() < due => {
                        self.standby_cv.wait_until(&mut st, due);
                    }
                    Some(_) if st.idle > 0 => {
                        // A worker is free: it takes the job, not a new thread.
                        self.work_cv.notify_one();
                        self.standby_cv.wait_for(&mut st, STUCK);
                    }
                    Some(_) => {
                        // Every active worker is held up: this one becomes active and a new
                        // standby takes its place.
                        standby = false;
                        st.standby = false;
                        if st.workers < MAX_WORKERS {
                            st.workers += 1;
                            st.standby = true;
                            drop(st);
                            self.start(true);
                            st = self.state.lock();
                        }
                    }
                }
                continue;
            }
            if let Some((_, job)) = st.jobs.pop_front() {
                drop(st);
                (self.run)(job);
                st = self.state.lock();
                continue;
            }
            if st.closed {
                st.workers -= 1;
                return;
            }
            st.idle += 1;
            let timed_out = self.work_cv.wait_for(&mut st, IDLE_EXIT).timed_out();
            st.idle -= 1;
            // The last active worker stays (the workers besides it and the standby).
            let active = st.workers - usize::from(st.standby);
            if timed_out && st.jobs.is_empty() && active > 1 {
                st.workers -= 1;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocked_job_does_not_hold_up_the_next() {
        let (release_tx, release_rx) = crossbeam_channel::bounded::<()>(0);
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<bool>();
        let pool = Pool::new(move |blocks: bool| {
            if blocks {
                let _ = release_rx.recv();
            }
            let _ = done_tx.send(blocks);
        });
        pool.push_all([true]);
        pool.push_all([false]);
        // The second job ran while the first is still blocked.
        assert_eq!(done_rx.recv_timeout(Duration::from_secs(10)), Ok(false));
        release_tx.send(()).unwrap();
        assert_eq!(done_rx.recv_timeout(Duration::from_secs(10)), Ok(true));
        pool.close();
    }
}
