//! Model-checked tests of the runtime's cross-worker structures: the
//! eviction board's request/answer handshake and the decode-rate window's
//! recycled buckets.

use inferd::runtime::{DecodeRate, EvictionBoard, EvictionTicket, RATE_BUCKETS};
use loom::sync::Arc;
use loom::thread;

/// The owner (worker 0) serves whatever requests are open: one idle
/// session evicted per request while any is left, then answers.
fn serve(board: &EvictionBoard, idle: &mut u32, evicted: &mut u32) {
    let open = board.open_requests(0);
    if open.count == 0 {
        return;
    }
    for _ in 0..open.count {
        if *idle > 0 {
            *idle -= 1;
            *evicted += 1;
        }
    }
    board.answer(0, open, (*idle > 0).then_some(10));
}

/// A requester (worker `me`) asks for worker 0's idle session if the board
/// shows one; once its ticket is answered it must see the owner's fresh
/// stamp (none idle), never the stale one it acted on.
fn request(board: &EvictionBoard, me: usize) -> Option<EvictionTicket> {
    let (victim, stamp) = board.best_victim(me)?;
    assert_eq!((victim, stamp), (0, 10));
    let ticket = board.ask(victim);
    for _ in 0..2 {
        if board.is_answered(ticket) {
            assert_eq!(board.oldest_idle(0), None, "stale board after answer");
            break;
        }
        thread::yield_now();
    }
    Some(ticket)
}

/// Worker 0 owns one idle session (stamp 10) and serves the requests of
/// `requesters` other workers concurrently, then once more after them.
fn eviction_round(requesters: usize) {
    let board = Arc::new(EvictionBoard::new(requesters + 1));
    board.publish(0, Some(10));
    let handles: Vec<_> = (1..=requesters)
        .map(|me| {
            let board = Arc::clone(&board);
            thread::spawn(move || request(&board, me))
        })
        .collect();
    let (mut idle, mut evicted) = (1, 0);
    serve(&board, &mut idle, &mut evicted);
    let tickets: Vec<_> = handles
        .into_iter()
        .filter_map(|h| h.join().unwrap_or_else(|_| panic!("requester panicked")))
        .collect();
    serve(&board, &mut idle, &mut evicted);
    // Every ticket is answered once the owner has looked after the asks.
    for t in &tickets {
        assert!(board.is_answered(*t), "ticket {t:?} lost");
    }
    assert_eq!(board.open_requests(0).count, 0);
    // Never more evictions than asked for, nor than were idle.
    assert_eq!(evicted, u32::from(!tickets.is_empty()));
    assert_eq!(board.oldest_idle(0), None);
}

#[test]
fn an_answered_request_sees_the_owners_fresh_board() {
    loom::model(|| eviction_round(1));
}

#[test]
fn racing_requesters_are_all_answered_and_evict_no_more_than_idle() {
    let mut builder = loom::model::Builder::new();
    // Two requesters and the owner: two preemptions cover every pairwise
    // race on the request counter.
    builder.preemption_bound = Some(2);
    builder.check(|| eviction_round(2));
}

/// A reader racing the writer recycling a bucket for a later second
/// reports, for each second, either nothing or that second's own count.
fn recycle_race(read: fn(&DecodeRate, u64, u64) -> u64) {
    loom::model(move || {
        let rate = Arc::new(DecodeRate::new());
        rate.record(1, 5);
        let later = 1 + RATE_BUCKETS as u64;
        let writer = {
            let rate = Arc::clone(&rate);
            thread::spawn(move || rate.record(later, 7))
        };
        let old = read(&rate, 1, 2);
        assert!(old == 0 || old == 5, "second 1 read as {old}");
        let new = read(&rate, later, later + 1);
        assert!(new == 0 || new == 7, "second {later} read as {new}");
        writer.join().unwrap_or_else(|_| panic!("writer panicked"));
        assert_eq!(read(&rate, 1, 2), 0);
        assert_eq!(read(&rate, later, later + 1), 7);
    });
}

#[test]
fn a_recycled_rate_bucket_is_never_read_torn() {
    recycle_race(DecodeRate::tokens_between);
}

#[test]
#[should_panic(expected = "second 1 read as 7")]
fn the_checker_finds_torn_reads_without_the_recheck() {
    recycle_race(DecodeRate::tokens_between_without_recheck);
}
