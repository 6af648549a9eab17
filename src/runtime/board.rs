//! The eviction board: how a worker that needs KV pages or a session place
//! finds and evicts an idle session owned by ANOTHER worker, without any
//! lock around session state.
//!
//! Each worker publishes the last-use stamp of its least recently used idle
//! session. A requester compares them with its own oldest idle session; when
//! another worker's is older it takes a ticket on that worker's request
//! counter and goes on with its other sessions. The owner, at the start of
//! its next turn, evicts one LRU idle session per open request (checking
//! idleness itself, so a session that is mid-call or has queued work is never
//! touched), republishes its oldest stamp and only then marks the requests
//! answered. A requester that sees its ticket answered therefore also sees
//! the owner's fresh stamp, never the stale one it acted on.

use crate::sync::{AtomicU64, Ordering};

/// Published in place of a stamp by a worker with no idle session.
const NO_IDLE: u64 = u64::MAX;

struct WorkerEntry {
    /// Last-use stamp of the owner's least recently used idle session.
    oldest_idle: AtomicU64,
    /// Eviction requests ever made to the owner.
    asked: AtomicU64,
    /// Requests the owner has dealt with (a prefix of `asked`).
    answered: AtomicU64,
}

/// One entry per worker; shared by all of them.
pub struct EvictionBoard {
    slots: Box<[WorkerEntry]>,
}

/// A requester's claim on one eviction by `worker`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictionTicket {
    pub worker: usize,
    number: u64,
}

/// The requests a worker found open when it looked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenRequests {
    /// How many to serve (one idle session each, while any is left).
    pub count: u64,
    upto: u64,
}

impl EvictionBoard {
    /// A board for `workers` workers, none with an idle session.
    pub fn new(workers: usize) -> Self {
        let slots = (0..workers.max(1))
            .map(|_| WorkerEntry {
                oldest_idle: AtomicU64::new(NO_IDLE),
                asked: AtomicU64::new(0),
                answered: AtomicU64::new(0),
            })
            .collect();
        EvictionBoard { slots }
    }

    /// Number of workers on the board.
    pub fn workers(&self) -> usize {
        self.slots.len()
    }

    fn slot(&self, worker: usize) -> &WorkerEntry {
        &self.slots[worker % self.slots.len()]
    }

    /// Owner: the stamp of its least recently used idle session, if any.
    pub fn publish(&self, worker: usize, oldest_idle: Option<u64>) {
        self.slot(worker)
            .oldest_idle
            .store(oldest_idle.unwrap_or(NO_IDLE), Ordering::Release);
    }

    /// The stamp `worker` last published.
    pub fn oldest_idle(&self, worker: usize) -> Option<u64> {
        let stamp = self.slot(worker).oldest_idle.load(Ordering::Acquire);
        (stamp != NO_IDLE).then_some(stamp)
    }

    /// The worker other than `except` with the oldest idle session, and its
    /// stamp (`except` out of range: every worker counts).
    pub fn best_victim(&self, except: usize) -> Option<(usize, u64)> {
        (0..self.slots.len())
            .filter(|&w| w != except)
            .filter_map(|w| self.oldest_idle(w).map(|s| (w, s)))
            .min_by_key(|&(_, s)| s)
    }

    /// Requester: asks `worker` to evict one idle session.
    pub fn ask(&self, worker: usize) -> EvictionTicket {
        let worker = worker % self.slots.len();
        let number = self.slots[worker].asked.fetch_add(1, Ordering::AcqRel) + 1;
        EvictionTicket { worker, number }
    }

    /// Requester: whether the owner has dealt with the ticket (evicting a
    /// session or finding none idle).
    pub fn is_answered(&self, ticket: EvictionTicket) -> bool {
        self.slot(ticket.worker).answered.load(Ordering::Acquire) >= ticket.number
    }

    /// Owner: the requests made to it and not yet answered.
    pub fn open_requests(&self, worker: usize) -> OpenRequests {
        let slot = self.slot(worker);
        let upto = slot.asked.load(Ordering::Acquire);
        // Only the owner writes `answered`.
        let done = slot.answered.load(Ordering::Relaxed);
        OpenRequests {
            count: upto.saturating_sub(done),
            upto,
        }
    }

    /// Owner: publishes its oldest idle stamp after serving `requests`, then
    /// marks them answered (in that order: see the module comment).
    pub fn answer(&self, worker: usize, requests: OpenRequests, oldest_idle: Option<u64>) {
        self.publish(worker, oldest_idle);
        self.slot(worker)
            .answered
            .fetch_max(requests.upto, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_idle_session_of_another_worker_is_the_victim() {
        let board = EvictionBoard::new(3);
        assert_eq!(board.best_victim(0), None);
        board.publish(0, Some(5));
        board.publish(1, Some(9));
        board.publish(2, Some(7));
        assert_eq!(board.best_victim(0), Some((2, 7)));
        assert_eq!(board.best_victim(1), Some((0, 5)));
        assert_eq!(board.best_victim(usize::MAX), Some((0, 5)));
        board.publish(2, None);
        assert_eq!(board.best_victim(0), Some((1, 9)));
    }

    #[test]
    fn tickets_are_answered_in_order_and_only_once_served() {
        let board = EvictionBoard::new(2);
        let first = board.ask(1);
        let second = board.ask(1);
        assert!(!board.is_answered(first));
        let open = board.open_requests(1);
        assert_eq!(open.count, 2);
        board.answer(1, open, None);
        assert!(board.is_answered(first) && board.is_answered(second));
        assert_eq!(board.open_requests(1).count, 0);
        let third = board.ask(1);
        assert!(!board.is_answered(third));
        assert_eq!(board.open_requests(1).count, 1);
        assert_eq!(board.open_requests(0).count, 0);
    }
}
