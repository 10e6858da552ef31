//! The monotonic clock (`CLOCK_MONOTONIC`), in nanoseconds since this process first read it.
//!
//! Payloads carry a send time read from this clock; the publisher and every subscriber run in
//! this process, so a latency needs no clock translation, and a small epoch keeps the field
//! short (12 digits: 1000 s).

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

/// Sleep (coarsely) or spin until the clock reaches `deadline_ns`.
pub(crate) fn wait_until(deadline_ns: u64) {
    loop {
        let now = now_ns();
        if now >= deadline_ns {
            return;
        }
        let left = deadline_ns - now;
        if left > 200_000 {
            std::thread::sleep(std::time::Duration::from_nanos(left - 100_000));
        } else {
            std::thread::yield_now();
        }
    }
}
