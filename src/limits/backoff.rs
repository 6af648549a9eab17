//! Back-off after a failed `accept(2)`.
//!
//! A listener whose accept fails for lack of descriptors or memory
//! (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`) is still readable: the
//! connection stays in the backlog, so retrying at once spins a core and
//! floods the log. Such a failure waits before the next accept, 5 ms at
//! first and twice as long after each further failure, up to 1 s (the
//! delays Go's `net/http` uses); a successful accept starts over. A failure
//! that belongs to one connection (it was reset or aborted before it was
//! taken, or one of the network errors Linux passes on from the new
//! socket, see accept(2)) consumed that connection, so the next accept
//! goes ahead at once.

use std::io;
use std::time::Duration;

/// The first wait after a failure that is not the connection's own.
pub const FIRST_DELAY: Duration = Duration::from_millis(5);
/// The longest wait between two accepts.
pub const MAX_DELAY: Duration = Duration::from_secs(1);

/// The delay to wait after each failed accept; one per listener.
#[derive(Debug, Clone)]
pub struct AcceptBackoff {
    next: Duration,
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        Self::new()
    }
}

impl AcceptBackoff {
    pub fn new() -> Self {
        AcceptBackoff { next: FIRST_DELAY }
    }

    /// An accept succeeded: the next failure waits [`FIRST_DELAY`] again.
    pub fn succeeded(&mut self) {
        self.next = FIRST_DELAY;
    }

    /// How long to wait after `error` before accepting again: nothing for
    /// an error of the connection's own, else the current delay (which
    /// doubles for the next failure, up to [`MAX_DELAY`]).
    pub fn failed(&mut self, error: &io::Error) -> Duration {
        if is_connection_error(error) {
            return Duration::ZERO;
        }
        let wait = self.next;
        self.next = (self.next * 2).min(MAX_DELAY);
        wait
    }
}

/// Whether a failed accept failed for that one connection only, so the
/// listener itself is fine.
pub fn is_connection_error(error: &io::Error) -> bool {
    use io::ErrorKind::*;
    if matches!(
        error.kind(),
        ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted | WouldBlock
    ) {
        return true;
    }
    // What accept(2) says to treat like EAGAIN on Linux: errors already
    // pending on the new socket.
    matches!(
        error.raw_os_error(),
        Some(
            libc::EPROTO
                | libc::ENOPROTOOPT
                | libc::ENETDOWN
                | libc::EHOSTDOWN
                | libc::EHOSTUNREACH
                | libc::ENETUNREACH
                | libc::EOPNOTSUPP
                | libc::EPERM
        )
    )
}

/// Whether a failed accept means the process is out of descriptors or
/// memory (what the budget in [`super::fd_budget`] is there to prevent).
pub fn is_resource_error(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(code: i32) -> io::Error {
        io::Error::from_raw_os_error(code)
    }

    #[test]
    fn resource_errors_wait_longer_each_time_up_to_the_cap() {
        let mut backoff = AcceptBackoff::new();
        let waits: Vec<Duration> = (0..12).map(|_| backoff.failed(&os(libc::EMFILE))).collect();
        assert_eq!(waits[0], FIRST_DELAY);
        assert_eq!(waits[1], FIRST_DELAY * 2);
        assert_eq!(waits[2], FIRST_DELAY * 4);
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert_eq!(*waits.last().expect("waits"), MAX_DELAY);
        assert!(waits.iter().all(|w| *w <= MAX_DELAY));
    }

    #[test]
    fn a_success_starts_over() {
        let mut backoff = AcceptBackoff::new();
        for _ in 0..5 {
            backoff.failed(&os(libc::ENFILE));
        }
        backoff.succeeded();
        assert_eq!(backoff.failed(&os(libc::ENFILE)), FIRST_DELAY);
    }

    #[test]
    fn a_connection_of_its_own_failing_waits_for_nothing() {
        let mut backoff = AcceptBackoff::new();
        backoff.failed(&os(libc::EMFILE));
        for code in [libc::ECONNABORTED, libc::EPROTO, libc::ENETUNREACH] {
            assert_eq!(backoff.failed(&os(code)), Duration::ZERO, "{code}");
        }
        // ... and does not reset the delay a resource failure built up.
        assert_eq!(backoff.failed(&os(libc::EMFILE)), FIRST_DELAY * 2);
        assert!(is_resource_error(&os(libc::EMFILE)));
        assert!(!is_resource_error(&os(libc::ECONNABORTED)));
    }

    #[test]
    fn an_unknown_failure_backs_off_too() {
        let mut backoff = AcceptBackoff::new();
        assert_eq!(backoff.failed(&os(libc::EINVAL)), FIRST_DELAY);
    }
}
