//! A gRPC call's deadline as an `Instant` the runtime can enforce.
//!
//! The runtime must know a call's deadline itself: an append queued behind a
//! busy session whose client already got DEADLINE_EXCEEDED must not run
//! later and change the history. grpcio 0.13 exposes the server-side deadline
//! only as an opaque `Deadline` (a realtime `gpr_timespec` inside), so it is
//! read here through a layout-checked copy.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The C core's `gpr_timespec`, field for field.
#[repr(C)]
#[derive(Clone, Copy)]
struct Timespec {
    tv_sec: i64,
    tv_nsec: i32,
    clock_type: i32,
}

// `grpcio::Deadline` is a struct holding exactly one `gpr_timespec`; with one
// field and the same size, the field sits at offset 0 and the bytes are the
// timespec's. A grpcio that changes this fails to build here.
const _: () = assert!(std::mem::size_of::<grpcio::Deadline>() == std::mem::size_of::<Timespec>());
const _: () = assert!(std::mem::align_of::<grpcio::Deadline>() == std::mem::align_of::<Timespec>());

/// `GPR_CLOCK_REALTIME`: grpcio converts every server deadline to it.
const CLOCK_REALTIME: i32 = 1;

/// Beyond this a deadline is treated as none (the C core's "infinite
/// future" is `i64::MAX` seconds).
const FOREVER: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// The deadline of a call as a monotonic instant; `None` when the client set
/// none (or one too far away to matter).
pub fn call_deadline(deadline: grpcio::Deadline) -> Option<Instant> {
    // SAFETY: size and alignment are asserted equal above and `Deadline` is a
    // plain `Copy` struct of one `gpr_timespec`, so its bytes are a valid
    // `Timespec` (every bit pattern of two integers and an i32 is valid).
    let spec: Timespec = unsafe { std::mem::transmute_copy(&deadline) };
    if spec.clock_type != CLOCK_REALTIME || spec.tv_sec == i64::MAX {
        return None;
    }
    let nanos = u32::try_from(spec.tv_nsec)
        .ok()
        .filter(|&n| n < 1_000_000_000)?;
    let at = UNIX_EPOCH.checked_add(Duration::new(u64::try_from(spec.tv_sec).ok()?, nanos))?;
    let now = Instant::now();
    match at.duration_since(SystemTime::now()) {
        Ok(left) if left >= FOREVER => None,
        Ok(left) => Some(now + left),
        // Already past: an instant now is as good as any earlier one.
        Err(_) => Some(now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_in_two_seconds_reads_as_about_two_seconds_from_now() {
        let at = call_deadline(grpcio::Deadline::from(Duration::from_secs(2))).expect("finite");
        let left = at.saturating_duration_since(Instant::now());
        assert!(
            left > Duration::from_millis(1900) && left <= Duration::from_secs(2),
            "{left:?}"
        );
    }

    #[test]
    fn a_far_deadline_counts_as_none() {
        let far = grpcio::Deadline::from(Duration::from_secs(20 * 365 * 24 * 3600));
        assert_eq!(call_deadline(far), None);
    }
}
