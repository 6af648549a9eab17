//! The file-descriptor budget of `inferd serve` (see
//! [`crate::limits::fd_budget`]): what its settings let it hold open at
//! once, part by part, each named with the flag that lowers it.

use super::serve::Settings;
use crate::limits::FdBudget;

/// What the process holds whatever its settings: standard streams, the
/// model file while it is mapped, the state directory's lock and the page
/// file while they are opened, the tokio and gRPC event loops and their
/// wake-up descriptors, the signal pipe, a GPU driver's device files. A
/// server with every listener on and no client holds about 40 (measured on
/// Linux); the rest is headroom.
pub const PROCESS_RESERVE: u64 = 64;
/// Descriptors each gRPC completion queue's event loop holds.
pub const PER_COMPLETION_QUEUE: u64 = 4;
/// Files a worker opens for a moment with a state directory: a spill file
/// being written or read, a journal being rewritten (`*.new`), the
/// directory being synced.
pub const PER_WORKER_WITH_STATE: u64 = 3;

impl Settings {
    /// The descriptors these settings may hold open at once.
    pub fn fd_budget(&self) -> FdBudget {
        let mut budget = FdBudget::default();
        budget.add("reserved for the process", PROCESS_RESERVE, None);
        let queues = self
            .completion_queues
            .unwrap_or_else(crate::server::default_completion_queues) as u64;
        budget.add(
            "for the gRPC completion queues",
            queues * PER_COMPLETION_QUEUE,
            Some("--completion-queues"),
        );
        budget.add(
            "gRPC connections and listener",
            self.grpc_connections as u64 + 1,
            Some("--grpc-connections"),
        );
        if self.http_listen.is_some() {
            budget.add(
                "HTTP connections and listener",
                self.http_limits.max_connections as u64 + 1,
                Some("--http-max-connections"),
            );
        }
        if self.metrics_listen.is_some() {
            // Its connections, its listener and its wake-up socket pair.
            budget.add(
                "metrics connections and listener",
                crate::metrics::MAX_CONNECTIONS as u64 + 3,
                None,
            );
        }
        if !self.shards.is_empty() {
            budget.add(
                "shard connections",
                self.shards.len() as u64,
                Some("--shards"),
            );
        }
        if self.state_dir.is_some() {
            // Every durable session keeps its journal open, spilled or not.
            budget.add(
                "journals of live sessions",
                self.max_sessions as u64,
                Some("--max-sessions"),
            );
            budget.add(
                "journals of spilled sessions",
                self.max_spilled_sessions as u64,
                Some("--max-spilled-sessions"),
            );
            budget.add(
                "spill and rewrite files of the workers",
                self.workers as u64 * PER_WORKER_WITH_STATE,
                Some("--workers"),
            );
        }
        budget
    }
}
