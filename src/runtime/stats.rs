//! The runtime's counters and gauges: plain atomics the workers bump and
//! publish, read without locks into a [`RuntimeStats`] snapshot that a
//! metrics endpoint renders (CONTRACT §2.9).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::rate::DecodeRate;

/// Upper bounds (seconds) of the prefill-duration histogram buckets; one
/// more bucket above the last catches everything longer.
pub const PREFILL_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// A fixed-bucket histogram of durations, updated with atomics.
#[derive(Debug, Default)]
pub struct DurationHistogram {
    /// Observations per bucket (not cumulative); the last is above every bound.
    buckets: [AtomicU64; PREFILL_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
    count: AtomicU64,
}

impl DurationHistogram {
    /// Counts one observation.
    pub fn observe(&self, duration: Duration) {
        let seconds = duration.as_secs_f64();
        let index = PREFILL_BUCKETS
            .iter()
            .position(|&bound| seconds <= bound)
            .unwrap_or(PREFILL_BUCKETS.len());
        self.buckets[index].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// A copy of the current numbers.
    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            bounds: PREFILL_BUCKETS.to_vec(),
            counts: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            sum_seconds: self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            count: self.count.load(Ordering::Relaxed),
        }
    }
}

/// A histogram's numbers at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HistogramSnapshot {
    /// Bucket upper bounds in seconds, increasing.
    pub bounds: Vec<f64>,
    /// Observations per bucket, not cumulative: `bounds.len() + 1` entries,
    /// the last for everything above the last bound.
    pub counts: Vec<u64>,
    pub sum_seconds: f64,
    pub count: u64,
}

impl HistogramSnapshot {
    /// `(upper bound, observations at or below it)` per bucket, ending with
    /// `+Inf` (the Prometheus `le` buckets).
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut total = 0;
        self.bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(&self.counts)
            .map(|(bound, &n)| {
                total += n;
                (bound, total)
            })
            .collect()
    }
}

/// Counters shared by all workers.
#[derive(Debug, Default)]
pub struct Counters {
    pub evicted_ttl: AtomicU64,
    pub evicted_lru: AtomicU64,
    pub evicted_close: AtomicU64,
    pub inv1_violations: AtomicU64,
    pub inv2_violations: AtomicU64,
    pub sessions_created: AtomicU64,
    /// Sessions made by ForkSession (not counted in `sessions_created`).
    pub sessions_forked: AtomicU64,
    /// History tokens whose KV was mapped from shared-prefix pages instead
    /// of computed.
    pub prefix_reused_tokens: AtomicU64,
    /// Sessions read back from the state directory at start.
    pub sessions_restored: AtomicU64,
    /// Restored history tokens whose KV was taken back from the kept page
    /// file instead of computed.
    pub restore_kept_tokens: AtomicU64,
    /// Hinted pages of the kept page file that failed their checksum at
    /// start (computed again).
    pub restore_pages_rejected: AtomicU64,
    /// Restored sessions whose logits, once computed, did not hash to the
    /// digest their journal recorded (the KV is not what it was).
    pub restore_digest_mismatches: AtomicU64,
    /// Tokens of spilled sessions whose KV was read back from their spill
    /// file instead of computed.
    pub spill_read_tokens: AtomicU64,
    /// LRU evictions that spilled the session instead of ending it.
    pub sessions_spilled: AtomicU64,
    /// Journal writes that failed (the session went on without one).
    pub journal_failures: AtomicU64,
    /// Journals that were read but found no place or pages.
    pub restore_refused: AtomicU64,
    /// Sessions removed after an invariant violation or a failed step.
    pub sessions_failed: AtomicU64,
    /// Sessions taken over from the replicas' store (a call for a session
    /// this replica did not hold), and the history tokens they brought.
    pub replica_takeovers: AtomicU64,
    pub replica_takeover_tokens: AtomicU64,
    /// Sessions dropped because another replica took their lease.
    pub replica_leases_lost: AtomicU64,
    /// Sessions let go because another replica asked for them.
    pub replica_handoffs: AtomicU64,
    /// Store statements that failed (each write's call undone and failed).
    pub replica_store_failures: AtomicU64,
    pub tokens_generated: AtomicU64,
    /// Tokens speculation proposed (and computed in verification passes).
    pub speculation_proposed: AtomicU64,
    /// Proposed tokens that were the ones sampled, emitted without a pass
    /// of their own.
    pub speculation_accepted: AtomicU64,
    /// Sessions' draft-model KV dropped to make room for another's draft
    /// (fed again when next needed).
    pub draft_kv_dropped: AtomicU64,
    /// Prompt tokens computed (appends and truncation re-prefills).
    pub prefill_tokens: AtomicU64,
    /// How long each append or truncation re-prefill took to compute.
    pub prefill_duration: DurationHistogram,
}

/// One worker's gauges, published by the worker at the end of each turn.
#[derive(Default)]
pub struct WorkerGauges {
    pub sessions: AtomicU64,
    pub last_batch_sequences: AtomicU64,
    pub max_batch_sequences: AtomicU64,
    pub steps: AtomicU64,
    pub tokens_generated: AtomicU64,
    /// Operations waiting in its sessions' queues, plus creations waiting
    /// for a session place.
    pub queued_ops: AtomicU64,
    /// K and V bytes of the committed positions of its sessions.
    pub kv_live_bytes: AtomicU64,
    /// History tokens of its sessions.
    pub history_tokens: AtomicU64,
    /// Bytes of its draft pool's pages its sessions' drafts hold, and of
    /// the whole pool (0 without a draft model).
    pub draft_kv_held_bytes: AtomicU64,
    pub draft_kv_pool_bytes: AtomicU64,
    /// Tokens decoded per second.
    pub decode_rate: DecodeRate,
}

impl std::fmt::Debug for WorkerGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerGauges")
            .field("sessions", &self.sessions)
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

/// A snapshot of the runtime's counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RuntimeStats {
    pub sessions_active: u64,
    pub sessions_created: u64,
    /// Sessions made by ForkSession (not counted in `sessions_created`).
    pub sessions_forked: u64,
    /// History tokens whose KV was mapped from shared-prefix pages.
    pub prefix_reused_tokens: u64,
    /// Sessions read back from the state directory at start.
    pub sessions_restored: u64,
    /// Restored history tokens whose KV was taken back from the page file.
    pub restore_kept_tokens: u64,
    /// Kept pages that failed their checksum at start.
    pub restore_pages_rejected: u64,
    /// Restored sessions whose digest differed from the journaled one.
    pub restore_digest_mismatches: u64,
    /// LRU evictions that spilled the session instead of ending it.
    pub sessions_spilled: u64,
    /// Sessions spilled now (not counted in `sessions_active`).
    pub spilled_now: u64,
    /// Bytes of KV pages spilled sessions hold written out now.
    pub spill_bytes: u64,
    /// Spilled sessions' tokens read back from their spill files.
    pub spill_read_tokens: u64,
    /// Journal writes that failed (each call undone and refused).
    pub journal_failures: u64,
    /// The replicas' store (`None`: none): sessions taken over from it and
    /// their history tokens, leases lost, statements that failed.
    pub replica: Option<ReplicaStats>,
    /// Whether the state directory takes writes now (`None`: no state
    /// directory).
    pub state_dir_writable: Option<bool>,
    /// Writes to the state directory that failed: journal writes and
    /// syncs, and `batch` flushes.
    pub state_dir_write_failures: u64,
    /// Journals not restored: unreadable or untrusted (renamed `*.refused`),
    /// or without a place or pages (left for a later start).
    pub restore_refused: u64,
    /// Bytes of journals, spill files and refused journals in the state
    /// directory (its budget's count; the page file is not in it).
    pub state_bytes: u64,
    /// Durable work refused because the state directory's budget was spent.
    pub state_refused_budget: u64,
    /// Durable work refused because its filesystem was below the floor.
    pub state_refused_free_space: u64,
    /// Pages of positions the shared-prefix index lists.
    pub prefix_entries: u64,
    /// Pool pages only the prefix cache holds.
    pub prefix_cached_pages: u64,
    /// Bytes of the pool's pages in use, each counted once however many
    /// sessions hold it (the per-session `kv_live_bytes` count shared
    /// pages in every holder).
    pub kv_used_bytes: u64,
    /// Sessions removed after an invariant violation or a failed step.
    pub sessions_failed: u64,
    pub evicted_ttl: u64,
    pub evicted_lru: u64,
    /// Sessions ended by CloseSession.
    pub evicted_close: u64,
    pub inv1_violations: u64,
    pub inv2_violations: u64,
    pub tokens_generated: u64,
    /// Tokens speculation proposed, and those accepted.
    pub speculation_proposed: u64,
    pub speculation_accepted: u64,
    /// Sessions' draft-model KV dropped for another's.
    pub draft_kv_dropped: u64,
    /// Prompt tokens computed (appends and truncation re-prefills).
    pub prefill_tokens: u64,
    pub prefill_duration: HistogramSnapshot,
    /// K and V bytes of the committed positions of all live sessions.
    pub kv_live_bytes: u64,
    /// History tokens of all live sessions.
    pub history_tokens: u64,
    /// Draft-model KV bytes the sessions' drafts hold, and the draft pools'
    /// size, over all workers.
    pub draft_kv_held_bytes: u64,
    pub draft_kv_pool_bytes: u64,
    pub kv_free_pages: u64,
    pub kv_total_pages: u64,
    pub workers: Vec<WorkerStats>,
    /// The shards' counters when the runtime coordinates a split model.
    #[cfg(not(loom))]
    pub shards: Option<super::ShardStatsSnapshot>,
    /// Rows of logits read back from the GPU that computed them (`None`
    /// when the layers are not on a GPU).
    pub logit_rows_read: Option<u64>,
    /// Submissions made on that GPU (one per decode step while sessions
    /// sample on the device).
    pub gpu_submissions: Option<u64>,
}

/// One worker's share of a [`RuntimeStats`] snapshot.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerStats {
    pub sessions: u64,
    /// Commands waiting in the worker's channel.
    pub queued_commands: u64,
    /// Operations waiting in its sessions' queues (and creations waiting
    /// for a place).
    pub queued_ops: u64,
    /// `queued_commands + queued_ops`.
    pub queue_depth: u64,
    /// Sequences in the last batched forward step.
    pub last_batch_sequences: u64,
    /// Most sequences ever run in one forward step.
    pub max_batch_sequences: u64,
    pub steps: u64,
    pub tokens_generated: u64,
    /// Tokens decoded per second over the last few whole seconds.
    pub decode_tokens_per_second: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_first_bucket_that_holds_them() {
        let h = DurationHistogram::default();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(1));
        h.observe(Duration::from_millis(30));
        h.observe(Duration::from_secs(60));
        let s = h.snapshot();
        assert_eq!(s.count, 4);
        assert!((s.sum_seconds - 60.0315).abs() < 1e-9, "{}", s.sum_seconds);
        assert_eq!(s.counts[0], 2);
        assert_eq!(s.counts[5], 1);
        assert_eq!(s.counts[PREFILL_BUCKETS.len()], 1);
        let c = s.cumulative();
        assert_eq!(c.len(), PREFILL_BUCKETS.len() + 1);
        assert_eq!(c[0], (0.001, 2));
        assert_eq!(c[4], (0.025, 2));
        assert_eq!(c[5], (0.05, 3));
        assert_eq!(c[c.len() - 1], (f64::INFINITY, 4));
    }
}

/// What a replica's store did, since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplicaStats {
    pub takeovers: u64,
    pub takeover_tokens: u64,
    pub leases_lost: u64,
    pub handoffs: u64,
    pub store_failures: u64,
}
