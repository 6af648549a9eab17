//! A lock-free decode-rate window: one worker counts the tokens it decodes
//! into per-second buckets; any thread reads the tokens of recent whole
//! seconds. Buckets are reused round-robin, so a reader checks the bucket's
//! second before and after reading its count and skips a bucket that was
//! being recycled under it (a seqlock with the second as the sequence).

use crate::sync::{AtomicU64, Ordering};

/// Marks a bucket being recycled (or never used).
const RECYCLING: u64 = u64::MAX;

/// Seconds the rate is averaged over.
pub const RATE_WINDOW_SECS: u64 = 10;

/// Buckets kept: the window, the second being counted, and one spare so the
/// writer never recycles a bucket a reader of the window still wants.
/// Seconds `s` and `s + RATE_BUCKETS` share a bucket.
pub const RATE_BUCKETS: usize = RATE_WINDOW_SECS as usize + 2;
const BUCKETS: usize = RATE_BUCKETS;

struct Bucket {
    second: AtomicU64,
    tokens: AtomicU64,
}

/// Per-second token counts of the last few seconds, for one writer.
pub struct DecodeRate {
    buckets: Box<[Bucket]>,
}

impl Default for DecodeRate {
    fn default() -> Self {
        Self::new()
    }
}

impl DecodeRate {
    /// No tokens counted yet.
    pub fn new() -> Self {
        let buckets = (0..BUCKETS)
            .map(|_| Bucket {
                second: AtomicU64::new(RECYCLING),
                tokens: AtomicU64::new(0),
            })
            .collect();
        DecodeRate { buckets }
    }

    fn bucket(&self, second: u64) -> &Bucket {
        &self.buckets[(second % self.buckets.len() as u64) as usize]
    }

    /// Writer (one thread only): `tokens` more decoded during `second`.
    pub fn record(&self, second: u64, tokens: u64) {
        let bucket = self.bucket(second);
        // Only this thread stores `second`, so it reads back its own store.
        if bucket.second.load(Ordering::Relaxed) != second {
            bucket.second.store(RECYCLING, Ordering::Relaxed);
            // A reader that sees the zero (or anything after it) is ordered
            // after the RECYCLING store and so rereads a changed second.
            bucket.tokens.store(0, Ordering::Release);
            bucket.second.store(second, Ordering::Release);
        }
        bucket.tokens.fetch_add(tokens, Ordering::Release);
    }

    /// Tokens counted in the seconds `from..to`, as far back as the buckets
    /// reach; a bucket recycled while being read counts as empty.
    pub fn tokens_between(&self, from: u64, to: u64) -> u64 {
        (from..to)
            .map(|second| {
                let bucket = self.bucket(second);
                let before = bucket.second.load(Ordering::Acquire);
                let tokens = bucket.tokens.load(Ordering::Acquire);
                let after = bucket.second.load(Ordering::Acquire);
                if before == second && after == second {
                    tokens
                } else {
                    0
                }
            })
            .sum()
    }

    /// The reader without its second look at the bucket's second: the race
    /// the recheck exists for, kept so the loom tests can show it is real.
    #[cfg(loom)]
    pub fn tokens_between_without_recheck(&self, from: u64, to: u64) -> u64 {
        (from..to)
            .map(|second| {
                let bucket = self.bucket(second);
                let before = bucket.second.load(Ordering::Acquire);
                let tokens = bucket.tokens.load(Ordering::Acquire);
                if before == second {
                    tokens
                } else {
                    0
                }
            })
            .sum()
    }

    /// Tokens per second over the last [`RATE_WINDOW_SECS`] whole seconds
    /// before `now` (fewer right after start).
    pub fn per_second(&self, now: u64) -> f64 {
        let span = now.min(RATE_WINDOW_SECS);
        if span == 0 {
            return 0.0;
        }
        self.tokens_between(now - span, now) as f64 / span as f64
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_rate_averages_whole_seconds_of_the_window() {
        let rate = DecodeRate::new();
        for second in 0..30 {
            rate.record(second, second);
        }
        // Seconds 20..30 hold 20 + 21 + ... + 29 = 245 tokens.
        assert_eq!(rate.tokens_between(20, 30), 245);
        assert_eq!(rate.per_second(30), 24.5);
        // The second still being counted is left out.
        rate.record(30, 1000);
        assert_eq!(rate.per_second(30), 24.5);
        assert_eq!(rate.per_second(31), (245 - 20 + 1000) as f64 / 10.0);
    }

    #[test]
    fn recycled_buckets_do_not_leak_old_seconds() {
        let rate = DecodeRate::new();
        rate.record(1, 7);
        let later = 1 + BUCKETS as u64;
        rate.record(later, 3);
        assert_eq!(rate.tokens_between(1, 2), 0);
        assert_eq!(rate.tokens_between(later, later + 1), 3);
        assert_eq!(rate.per_second(0), 0.0);
        assert_eq!(rate.per_second(2), 0.0);
    }
}
