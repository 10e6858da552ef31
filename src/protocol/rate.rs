//! Publish rate limits of one connection: token buckets of messages and bytes per second, on
//! the caller's clock.

use std::time::SystemTime;

/// A token bucket holding up to one second of its rate, refilled continuously. Counts in
/// millionths of a token, so that small rates refill smoothly with integer arithmetic.
#[derive(Debug, Clone)]
struct Bucket {
    /// Tokens per second; 0 = no limit.
    rate: u64,
    /// Millionths of a token available.
    micros: u64,
    last: Option<SystemTime>,
}

impl Bucket {
    fn new(rate: u64) -> Bucket {
        Bucket {
            rate,
            micros: rate.saturating_mul(1_000_000),
            last: None,
        }
    }

    fn refill(&mut self, now: SystemTime) {
        let capacity = self.rate.saturating_mul(1_000_000);
        if let Some(last) = self.last {
            // A clock that steps back refills nothing.
            let elapsed = now.duration_since(last).unwrap_or_default();
            // rate tokens per second = rate millionths per microsecond.
            let add =
                (elapsed.as_micros().min(u128::from(u64::MAX)) as u64).saturating_mul(self.rate);
            self.micros = self.micros.saturating_add(add).min(capacity);
        }
        if self.last.is_none_or(|last| now > last) {
            self.last = Some(now);
        }
    }

    /// Whether `n` tokens are available (then taken). A request larger than the whole bucket
    /// passes when the bucket is full, so one message larger than a second's byte budget still
    /// goes through at the average rate.
    fn take(&mut self, n: u64, now: SystemTime) -> bool {
        if self.rate == 0 {
            return true;
        }
        self.refill(now);
        let capacity = self.rate.saturating_mul(1_000_000);
        let want = n.saturating_mul(1_000_000).min(capacity);
        if self.micros >= want {
            self.micros -= want;
            true
        } else {
            false
        }
    }

    fn give_back(&mut self, n: u64) {
        let capacity = self.rate.saturating_mul(1_000_000);
        self.micros = self
            .micros
            .saturating_add(n.saturating_mul(1_000_000))
            .min(capacity);
    }
}

/// A refused publish: which limit, at what rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimited {
    /// The config key: `publish_messages_per_second` or `publish_bytes_per_second`.
    pub limit: &'static str,
    /// Its value.
    pub rate: u64,
}

/// A connection's publish limits: messages per second and bytes per second, each a bucket of one
/// second's worth, so a burst of up to one second's budget passes at once.
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// use powerhub::protocol::PublishLimiter;
///
/// let mut limiter = PublishLimiter::new(2, 0);
/// let t = UNIX_EPOCH + Duration::from_secs(1_000);
/// assert!(limiter.check(10, t).is_ok());
/// assert!(limiter.check(10, t).is_ok());
/// assert_eq!(limiter.check(10, t).unwrap_err().limit, "publish_messages_per_second");
/// // Half a second later one more message is allowed.
/// assert!(limiter.check(10, t + Duration::from_millis(500)).is_ok());
/// ```
#[derive(Debug, Clone)]
pub struct PublishLimiter {
    messages: Bucket,
    bytes: Bucket,
}

impl PublishLimiter {
    /// Limits of `messages` per second and `bytes` per second (0: that one is unlimited).
    pub fn new(messages: u64, bytes: u64) -> PublishLimiter {
        PublishLimiter {
            messages: Bucket::new(messages),
            bytes: Bucket::new(bytes),
        }
    }

    /// Whether neither limit is set.
    pub fn is_unlimited(&self) -> bool {
        self.messages.rate == 0 && self.bytes.rate == 0
    }

    /// Takes one message of `len` bytes at `now`, or says which limit it would pass (then
    /// nothing is taken).
    ///
    /// # Errors
    ///
    /// The limit the message would pass.
    pub fn check(&mut self, len: usize, now: SystemTime) -> Result<(), RateLimited> {
        if !self.messages.take(1, now) {
            return Err(RateLimited {
                limit: "publish_messages_per_second",
                rate: self.messages.rate,
            });
        }
        if !self.bytes.take(len as u64, now) {
            self.messages.give_back(1);
            return Err(RateLimited {
                limit: "publish_bytes_per_second",
                rate: self.bytes.rate,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn at(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(1_000_000 + ms)
    }

    #[test]
    fn a_burst_of_one_seconds_budget_passes_then_the_average_rate() {
        let mut l = PublishLimiter::new(100, 0);
        let passed = (0..150).filter(|_| l.check(1, at(0)).is_ok()).count();
        assert_eq!(passed, 100);
        // 10 ms refill one message.
        assert!(l.check(1, at(10)).is_ok());
        assert!(l.check(1, at(10)).is_err());
        // Over ten seconds: the full bucket (100, refilled since), then 100 per second,
        // however often they are asked.
        let passed = (0..100_000u64)
            .filter(|i| l.check(1, at(1_000 + i / 10)).is_ok())
            .count();
        assert!((1_090..=1_110).contains(&passed), "{passed}");
    }

    #[test]
    fn the_byte_limit_counts_bytes_and_a_refusal_takes_nothing() {
        let mut l = PublishLimiter::new(1_000, 1_000);
        assert!(l.check(600, at(0)).is_ok());
        let err = l.check(600, at(0)).unwrap_err();
        assert_eq!(
            err,
            RateLimited {
                limit: "publish_bytes_per_second",
                rate: 1_000
            }
        );
        assert!(
            l.check(400, at(0)).is_ok(),
            "the refused 600 bytes were not taken"
        );
        // One message larger than a second's budget passes once the bucket is full.
        assert!(l.check(5_000, at(1_000)).is_ok());
        assert!(l.check(1, at(1_000)).is_err());
    }

    #[test]
    fn a_clock_that_steps_back_refills_nothing_and_no_limit_is_no_limit() {
        let mut l = PublishLimiter::new(1, 0);
        assert!(l.check(1, at(5_000)).is_ok());
        assert!(l.check(1, at(0)).is_err());
        assert!(l.check(1, at(5_999)).is_err());
        assert!(l.check(1, at(6_000)).is_ok());
        let mut free = PublishLimiter::new(0, 0);
        assert!(free.is_unlimited());
        assert!((0..10_000).all(|_| free.check(1 << 20, at(0)).is_ok()));
    }
}
