//! Publish rate limits: token buckets of messages and bytes per second, on the caller's clock,
//! of one connection ([`PublishLimiter`], owned by its session) and of one user across its
//! connections ([`UserRate`], shared by the user's sessions on every shard). Both are the same
//! two buckets, each one atomic kept by the generic cell rate algorithm (`SharedBucket`): an
//! uncontended compare-exchange costs a connection's limiter a few nanoseconds per publish.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::loom::sync::atomic::{AtomicU64, Ordering};

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
pub struct PublishLimiter(Buckets);

impl PublishLimiter {
    /// Limits of `messages` per second and `bytes` per second (0: that one is unlimited).
    pub fn new(messages: u64, bytes: u64) -> PublishLimiter {
        PublishLimiter(Buckets::new(
            messages,
            bytes,
            ["publish_messages_per_second", "publish_bytes_per_second"],
        ))
    }

    /// Whether neither limit is set.
    pub fn is_unlimited(&self) -> bool {
        self.0.is_unlimited()
    }

    /// Gives back what [`PublishLimiter::check`] took for a message of `len` bytes (a limit
    /// after this one refused it).
    pub fn give_back(&mut self, len: usize) {
        self.0.give_back(len);
    }

    /// Takes one message of `len` bytes at `now`, or says which limit it would pass (then
    /// nothing is taken).
    ///
    /// # Errors
    ///
    /// The limit the message would pass.
    pub fn check(&mut self, len: usize, now: SystemTime) -> Result<(), RateLimited> {
        self.0.check(len, now)
    }
}

/// A message bucket and a byte bucket, and the config keys that name them in a refusal: what
/// a connection's and a user's limits both are.
#[derive(Debug, Clone)]
struct Buckets {
    messages: SharedBucket,
    bytes: SharedBucket,
    keys: [&'static str; 2],
}

impl Buckets {
    fn new(messages: u64, bytes: u64, keys: [&'static str; 2]) -> Buckets {
        Buckets {
            messages: SharedBucket::new(messages),
            bytes: SharedBucket::new(bytes),
            keys,
        }
    }

    fn is_unlimited(&self) -> bool {
        self.messages.rate == 0 && self.bytes.rate == 0
    }

    /// Whether both buckets are full at `now` (nothing taken still counts).
    fn is_full(&self, now: SystemTime) -> bool {
        let now_ns = epoch_ns(now);
        self.messages.tat.load(Ordering::Relaxed) <= now_ns
            && self.bytes.tat.load(Ordering::Relaxed) <= now_ns
    }

    /// A clock before the Unix epoch counts as the epoch.
    fn check(&self, len: usize, now: SystemTime) -> Result<(), RateLimited> {
        if self.is_unlimited() {
            // An authenticated connection without rate limits still has a limiter: no clock.
            return Ok(());
        }
        let now_ns = epoch_ns(now);
        if !self.messages.take(1, now_ns) {
            return Err(RateLimited {
                limit: self.keys[0],
                rate: self.messages.rate,
            });
        }
        if !self.bytes.take(len as u64, now_ns) {
            self.messages.give_back(1);
            return Err(RateLimited {
                limit: self.keys[1],
                rate: self.bytes.rate,
            });
        }
        Ok(())
    }

    fn give_back(&self, len: usize) {
        self.messages.give_back(1);
        self.bytes.give_back(len as u64);
    }
}

/// Nanoseconds since the Unix epoch at `now` (a clock before it counts as the epoch).
fn epoch_ns(now: SystemTime) -> u64 {
    now.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos().min(u128::from(u64::MAX / 2)) as u64)
}

/// One second, in the nanoseconds [`SharedBucket`] counts in: the burst a bucket allows.
const SECOND_NS: u64 = 1_000_000_000;

/// A token bucket that threads may share, as the generic cell rate algorithm (GCRA) keeps it: one
/// atomic, the theoretical arrival time (`tat`, nanoseconds since the Unix epoch) at which the
/// bucket is full again. Taking `n` tokens moves it `n` emission intervals (`n / rate` s) later,
/// from `now` if it lies in the past; a take is refused when that would put it more than a
/// second (the bucket's capacity) past `now`. A take larger than the whole bucket passes when
/// the bucket is full, and the time it costs is owed: one message larger than a second's byte
/// budget goes through at the average rate. A clock that steps back refills nothing.
///
/// Ordering: `Relaxed` everywhere. The atomic is the bucket's whole state and publishes no other
/// memory; the compare-exchange makes each take one indivisible step on it, so concurrent takes
/// never hand out more than the bucket holds, whatever the order they land in.
#[derive(Debug)]
struct SharedBucket {
    /// Tokens per second; 0 = no limit.
    rate: u64,
    tat: AtomicU64,
}

impl Clone for SharedBucket {
    fn clone(&self) -> SharedBucket {
        SharedBucket {
            rate: self.rate,
            tat: AtomicU64::new(self.tat.load(Ordering::Relaxed)),
        }
    }
}

impl SharedBucket {
    fn new(rate: u64) -> SharedBucket {
        SharedBucket {
            rate,
            tat: AtomicU64::new(0),
        }
    }

    /// `n` tokens' worth of time, in nanoseconds, rounded down (and at least one, so no take is
    /// free): takes adding up to one second's budget then add up to no more than a second,
    /// so a burst of exactly `rate` tokens passes whatever the rate. (Rounded up, three takes
    /// of a rate of 3 cost 1 000 000 002 ns and the third was refused.) The rounding gives at
    /// most a nanosecond per take, well under one token per second below 31 622 tokens per
    /// second.
    fn cost(&self, n: u64) -> u64 {
        let ns = (u128::from(n) * u128::from(SECOND_NS)) / u128::from(self.rate);
        ns.clamp(1, u128::from(u64::MAX / 2)) as u64
    }

    fn take(&self, n: u64, now_ns: u64) -> bool {
        if self.rate == 0 {
            return true;
        }
        let cost = self.cost(n);
        let mut tat = self.tat.load(Ordering::Relaxed);
        loop {
            let full = tat <= now_ns;
            let next = tat.max(now_ns).saturating_add(cost);
            if next - now_ns > SECOND_NS && !(full && cost > SECOND_NS) {
                return false;
            }
            match self
                .tat
                .compare_exchange_weak(tat, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(current) => tat = current,
            }
        }
    }

    fn give_back(&self, n: u64) {
        if self.rate == 0 {
            return;
        }
        let cost = self.cost(n);
        // A lost race only means another take moved the time on: subtract from what is there.
        let _ = self
            .tat
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |tat| {
                Some(tat.saturating_sub(cost))
            });
    }
}

/// A user's publish limits across all its connections (`[auth]
/// publish_messages_per_second_per_user` and `publish_bytes_per_second_per_user`): messages and
/// bytes per second, each a bucket of one second's worth, shared by the user's sessions on every
/// shard without a lock (one compare-exchange per bucket per publish).
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// use powerhub::protocol::UserRate;
///
/// let user = UserRate::new(2, 0);
/// let t = UNIX_EPOCH + Duration::from_secs(1_000);
/// // Two connections of the user share the budget.
/// assert!(user.check(10, t).is_ok());
/// assert!(user.check(10, t).is_ok());
/// assert_eq!(user.check(10, t).unwrap_err().limit, "publish_messages_per_second_per_user");
/// assert!(user.check(10, t + Duration::from_millis(500)).is_ok());
/// ```
#[derive(Debug)]
pub struct UserRate(Buckets);

impl UserRate {
    /// Limits of `messages` per second and `bytes` per second (0: that one is unlimited).
    pub fn new(messages: u64, bytes: u64) -> UserRate {
        UserRate(Buckets::new(
            messages,
            bytes,
            [
                "publish_messages_per_second_per_user",
                "publish_bytes_per_second_per_user",
            ],
        ))
    }

    /// Whether neither limit is set.
    pub fn is_unlimited(&self) -> bool {
        self.0.is_unlimited()
    }

    /// Takes one message of `len` bytes at `now`, or says which limit it would pass (then
    /// nothing is taken). A clock before the Unix epoch counts as the epoch.
    ///
    /// # Errors
    ///
    /// The limit the message would pass.
    pub fn check(&self, len: usize, now: SystemTime) -> Result<(), RateLimited> {
        self.0.check(len, now)
    }

    /// Whether both buckets are full at `now`: what the user published before has no weight
    /// left, so forgetting these limits gives the user nothing.
    ///
    /// ```
    /// use std::time::{Duration, UNIX_EPOCH};
    /// use powerhub::protocol::UserRate;
    ///
    /// let user = UserRate::new(2, 0);
    /// let t = UNIX_EPOCH + Duration::from_secs(1_000);
    /// assert!(user.is_full(t));
    /// user.check(10, t).unwrap();
    /// assert!(!user.is_full(t));
    /// assert!(user.is_full(t + Duration::from_millis(500)));
    /// ```
    pub fn is_full(&self, now: SystemTime) -> bool {
        self.0.is_full(now)
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// Three threads take from a bucket of two messages at one instant: exactly two pass, in
    /// every interleaving; and a refused byte take gives its message back.
    #[test]
    fn concurrent_takes_never_pass_more_than_the_bucket_holds() {
        loom::model(|| {
            let rate = Arc::new(UserRate::new(2, 0));
            let now = UNIX_EPOCH + std::time::Duration::from_secs(10);
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let rate = Arc::clone(&rate);
                    loom::thread::spawn(move || rate.check(1, now).is_ok())
                })
                .collect();
            let mine = rate.check(1, now).is_ok();
            let passed = threads
                .into_iter()
                .map(|t| t.join().unwrap())
                .chain([mine])
                .filter(|ok| *ok)
                .count();
            assert_eq!(passed, 2);
        });
    }
}

#[cfg(all(test, not(loom)))]
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
    fn a_burst_of_exactly_the_rate_passes_for_every_rate() {
        for rate in 1..=2_000u64 {
            let mut l = PublishLimiter::new(rate, 0);
            let passed = (0..rate + 5).filter(|_| l.check(1, at(0)).is_ok()).count();
            assert_eq!(passed as u64, rate, "publish_messages_per_second = {rate}");
            // The byte bucket: messages of 25 bytes at a budget of `rate` of them.
            let mut l = PublishLimiter::new(0, 25 * rate);
            let passed = (0..rate + 5).filter(|_| l.check(25, at(0)).is_ok()).count();
            assert_eq!(
                passed as u64,
                rate,
                "publish_bytes_per_second = {}",
                25 * rate
            );
            let user = UserRate::new(rate, 0);
            let passed = (0..rate + 5)
                .filter(|_| user.check(1, at(0)).is_ok())
                .count();
            assert_eq!(passed as u64, rate, "per user, {rate}");
        }
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
    fn a_users_bucket_is_shared_by_its_connections_and_refills_at_its_rate() {
        let user = std::sync::Arc::new(UserRate::new(100, 0));
        // Two holders of the user's bucket, as two connections, take turns.
        let (a, b) = (std::sync::Arc::clone(&user), std::sync::Arc::clone(&user));
        let passed = (0..150)
            .filter(|i| if i % 2 == 0 { &a } else { &b }.check(1, at(0)).is_ok())
            .count();
        assert_eq!(passed, 100);
        assert!(user.check(1, at(10)).is_ok(), "10 ms refill one message");
        assert!(user.check(1, at(10)).is_err());
        let passed = (0..100_000u64)
            .filter(|i| user.check(1, at(1_000 + i / 10)).is_ok())
            .count();
        assert!((1_090..=1_110).contains(&passed), "{passed}");
        // Threads on many cores: never more than the bucket and the refill.
        let user = std::sync::Arc::new(UserRate::new(1_000, 0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let user = std::sync::Arc::clone(&user);
                std::thread::spawn(move || {
                    (0..1_000).filter(|_| user.check(1, at(0)).is_ok()).count()
                })
            })
            .collect();
        let total: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(total, 1_000);
    }

    #[test]
    fn a_users_byte_limit_gives_the_message_back_and_lets_one_large_message_through() {
        let user = UserRate::new(2, 1_000);
        assert!(user.check(600, at(0)).is_ok());
        let err = user.check(600, at(0)).unwrap_err();
        assert_eq!(
            err,
            RateLimited {
                limit: "publish_bytes_per_second_per_user",
                rate: 1_000
            }
        );
        // The refused message did not use one of the two.
        assert!(user.check(100, at(0)).is_ok());
        assert_eq!(
            user.check(1, at(0)).unwrap_err().limit,
            "publish_messages_per_second_per_user"
        );
        // Full again a second later: one message larger than the byte budget passes.
        assert!(user.check(5_000, at(1_000)).is_ok());
        assert!(user.check(1, at(1_000)).is_err());
        assert!(UserRate::new(0, 0).is_unlimited());
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
