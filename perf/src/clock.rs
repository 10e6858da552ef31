//! The monotonic clock every process on the machine shares (`CLOCK_MONOTONIC`), in nanoseconds.
//!
//! Payloads carry a send time read from this clock, so a subscriber in another thread (or
//! process) can compute a latency without any clock translation.

/// Nanoseconds on `CLOCK_MONOTONIC`.
pub(crate) fn now_ns() -> u64 {
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
