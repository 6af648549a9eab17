//! At most one log line per interval for a failure that can repeat in a
//! loop (a failed accept, a failed poll), with the number of lines left
//! out since the last one written, so a fault that repeats a million times
//! a second costs one line a second, not the disk.
//!
//! One [`LogLimit`] per kind of line: each call site that can log per
//! failure owns one (a `static` or a field) and writes its line only when
//! [`LogLimit::allow`] says so.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines of one kind: at most one per `interval`.
#[derive(Debug)]
pub struct LogLimit {
    interval: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// When the last line was written.
    last: Option<Instant>,
    /// Lines left out since.
    suppressed: u64,
}

impl LogLimit {
    /// At most one line a second.
    pub const fn per_second() -> Self {
        Self::every(Duration::from_secs(1))
    }

    /// At most one line per `interval`.
    pub const fn every(interval: Duration) -> Self {
        LogLimit {
            interval,
            state: Mutex::new(State {
                last: None,
                suppressed: 0,
            }),
        }
    }

    /// `Some(n)` when a line may be written now, `n` being how many were
    /// left out since the last one (to log with it); `None`: leave this one
    /// out.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    fn allow_at(&self, now: Instant) -> Option<u64> {
        // A panic elsewhere while holding the lock left plain numbers.
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let due = state
            .last
            .is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if due {
            state.last = Some(now);
            Some(std::mem::take(&mut state.suppressed))
        } else {
            state.suppressed = state.suppressed.saturating_add(1);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_count_left_out() {
        let limit = LogLimit::per_second();
        let t0 = Instant::now();
        assert_eq!(limit.allow_at(t0), Some(0), "the first line is written");
        for i in 1..=1000 {
            let at = t0 + Duration::from_micros(i * 900);
            assert_eq!(limit.allow_at(at), None, "at {i}");
        }
        assert_eq!(limit.allow_at(t0 + Duration::from_secs(1)), Some(1000));
        assert_eq!(limit.allow_at(t0 + Duration::from_millis(1500)), None);
        assert_eq!(limit.allow_at(t0 + Duration::from_secs(5)), Some(1));
    }

    #[test]
    fn a_quiet_spell_writes_the_next_line_at_once() {
        let limit = LogLimit::every(Duration::from_millis(10));
        let t0 = Instant::now();
        assert_eq!(limit.allow_at(t0), Some(0));
        assert_eq!(limit.allow_at(t0 + Duration::from_secs(60)), Some(0));
    }

    #[test]
    fn a_million_failures_make_a_handful_of_lines() {
        let limit = LogLimit::per_second();
        let t0 = Instant::now();
        // A million failures spread over 3 s: 3 or 4 lines, not a million.
        let written = (0..1_000_000u64)
            .filter(|i| {
                limit
                    .allow_at(t0 + Duration::from_nanos(i * 3_000))
                    .is_some()
            })
            .count();
        assert_eq!(written, 3);
    }
}
