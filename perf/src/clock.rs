//! The monotonic clock (`CLOCK_MONOTONIC`), in nanoseconds since this process first read it.
//!
//! Payloads carry a send time read from this clock; the publisher and every subscriber run in
//! this process, so a latency needs no clock translation, and a small epoch keeps the field
//! short (12 digits: 1000 s; a run longer than that wraps it, and readers take the difference
//! modulo the field, see `payload::since`).

use std::sync::OnceLock;

static EPOCH: OnceLock<u64> = OnceLock::new();

/// Nanoseconds since the process's epoch.
pub(crate) fn now_ns() -> u64 {
    let now = monotonic_ns();
    now - *EPOCH.get_or_init(|| now)
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call; CLOCK_MONOTONIC is
    // always supported on Linux, so the call cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Sleep until the clock reaches `deadline_ns`, never spinning: the publisher shares its CPU with
/// the subscribers' readers, and a spinning (or `sched_yield`ing) publisher keeps that CPU busy
/// and makes a woken reader wait for the scheduler. Call [`precise_sleeps`] first on the thread,
/// or a sleep overshoots by the default 50 µs timer slack.
pub(crate) fn wait_until(deadline_ns: u64) {
    loop {
        let now = now_ns();
        if now >= deadline_ns {
            return;
        }
        std::thread::sleep(std::time::Duration::from_nanos(deadline_ns - now));
    }
}

/// Make this thread's sleeps end as close to their deadline as the kernel can (timer slack of
/// 1 ns instead of 50 µs).
pub(crate) fn precise_sleeps() {
    // SAFETY: PR_SET_TIMERSLACK takes an integer argument and touches no memory of ours; a
    // failure leaves the default slack, which only makes sleeps coarser.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
}
