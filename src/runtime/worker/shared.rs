//! What every worker shares with the others: the counters, the session
//! and spill limits' counts, the eviction board, the wakers, the lending
//! group and the shared-prefix index (all lock-free).

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;

use super::super::board::EvictionBoard;
use super::super::stats::Counters;
use crate::kv::PrefixIndex;
use crate::threads::{CoreGroup, Wake};

/// What every worker shares; all of it is lock-free.
pub(crate) struct WorkersState {
    pub(crate) counters: Counters,
    /// Live sessions over all workers (the session limit); spilled ones
    /// are not counted here.
    pub(crate) live_sessions: AtomicUsize,
    /// Sessions spilled over all workers (`max_spilled_sessions`).
    pub(crate) spilled_sessions: AtomicUsize,
    /// Bytes of KV pages spilled sessions hold written out now
    /// (`max_spill_bytes`).
    pub(crate) spill_bytes: AtomicU64,
    pub(crate) board: EvictionBoard,
    /// KV pages held by each worker's idle sessions, as it last published:
    /// what evicting could free, so nothing is evicted for a request that
    /// would fail anyway.
    pub(crate) idle_pages: Vec<AtomicUsize>,
    /// Wakes worker `i` from its wait for commands (a full channel means a
    /// wake is already pending).
    pub(crate) wakers: Vec<Sender<()>>,
    /// Time zero of the board's stamps and the decode-rate seconds.
    pub(crate) epoch: Instant,
    /// The workers that lend each other their cores while they wait for
    /// their own work (`None`: each computes on its own thread alone).
    pub(crate) lending: Option<Arc<CoreGroup>>,
    /// Full pages any session computed, by the tokens before and in them
    /// (`None` where the pool holds no rows: the layers run on shards).
    pub(crate) prefix: Option<PrefixIndex>,
}

impl WorkersState {
    /// State for one worker per waker; with `lend_cores` (and more than
    /// one worker) they lend each other their cores, woken through the same
    /// wakers.
    pub(crate) fn new(wakers: Vec<Sender<()>>, lend_cores: bool) -> Self {
        let lending = (lend_cores && wakers.len() > 1).then(|| {
            CoreGroup::new(
                wakers
                    .iter()
                    .map(|waker| {
                        let waker = waker.clone();
                        Box::new(move || {
                            // A full channel means a wake is already pending.
                            let _ = waker.try_send(());
                        }) as Wake
                    })
                    .collect(),
            )
        });
        WorkersState {
            lending,
            prefix: None,
            counters: Counters::default(),
            live_sessions: AtomicUsize::new(0),
            spilled_sessions: AtomicUsize::new(0),
            spill_bytes: AtomicU64::new(0),
            board: EvictionBoard::new(wakers.len()),
            idle_pages: wakers.iter().map(|_| AtomicUsize::new(0)).collect(),
            wakers,
            epoch: Instant::now(),
        }
    }
}
