//! What the coordinator counts of its shards, for the status and the
//! metrics: how steps failed, by kind, and the links' reconnects and rebuilds.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

use super::PlannedShard;
use crate::cluster::frame::ErrorKind;
use crate::cluster::link::{LinkError, ShardBackend};
use crate::runtime::{ShardSnapshot, ShardStatsSnapshot};

/// How a step through the shards failed, for the status and the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The connection or stream failed (or the shard is down).
    Transport,
    /// The shard refused the handshake (fingerprint, version, limits).
    Handshake,
    /// A frame was refused by the shard or by us.
    Protocol(ErrorKind),
}

/// Every failure kind, in metric order.
pub const FAILURE_KINDS: [FailureKind; 11] = [
    FailureKind::Transport,
    FailureKind::Handshake,
    FailureKind::Protocol(ErrorKind::Checksum),
    FailureKind::Protocol(ErrorKind::StaleEpoch),
    FailureKind::Protocol(ErrorKind::Sequence),
    FailureKind::Protocol(ErrorKind::TooLarge),
    FailureKind::Protocol(ErrorKind::Malformed),
    FailureKind::Protocol(ErrorKind::UnknownSession),
    FailureKind::Protocol(ErrorKind::Deadline),
    FailureKind::Protocol(ErrorKind::FlowControl),
    FailureKind::Protocol(ErrorKind::Internal),
];

impl FailureKind {
    /// The metric label.
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::Transport => "transport",
            FailureKind::Handshake => "handshake",
            FailureKind::Protocol(kind) => kind.name(),
        }
    }

    pub(super) fn index(self) -> usize {
        FAILURE_KINDS.iter().position(|&k| k == self).unwrap_or(0)
    }

    pub(super) fn of(error: &LinkError) -> FailureKind {
        match error {
            LinkError::Transport { .. } => FailureKind::Transport,
            LinkError::Handshake { .. } => FailureKind::Handshake,
            LinkError::Refused { error, .. } | LinkError::BadReply { error, .. } => {
                FailureKind::Protocol(error.kind)
            }
        }
    }
}

/// A step that did not get through the shards.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("shard {shard}: {message}")]
pub struct ShardFailure {
    /// `ADDR (layers A..B)` of the shard whose link failed.
    pub shard: String,
    pub kind: FailureKind,
    pub message: String,
}

/// Counters of one shard, over every worker's link to it.
#[derive(Debug)]
pub struct ShardCounters {
    pub label: String,
    pub failures: [AtomicU64; FAILURE_KINDS.len()],
    /// Links (re)connected after the first.
    pub reconnects: AtomicU64,
    /// Times a shard answered a handshake with a new epoch (it restarted).
    pub restarts: AtomicU64,
    /// Whether the last contact with the shard succeeded.
    pub up: AtomicBool,
    /// Where it computes, from its last handshake (0: none yet, 1: the CPU,
    /// 2: a GPU).
    backend: AtomicU8,
}

impl ShardCounters {
    /// Records the backend the shard's handshake named.
    pub fn set_backend(&self, backend: ShardBackend) {
        let code = match backend {
            ShardBackend::Cpu => 1,
            ShardBackend::Gpu => 2,
        };
        self.backend.store(code, Ordering::Relaxed);
    }

    /// `cpu`, `gpu`, or `unknown` before a handshake.
    pub fn backend(&self) -> &'static str {
        match self.backend.load(Ordering::Relaxed) {
            1 => ShardBackend::Cpu.name(),
            2 => ShardBackend::Gpu.name(),
            _ => "unknown",
        }
    }
}

/// Counters every worker's chain adds to.
#[derive(Debug)]
pub struct ShardStats {
    pub shards: Vec<ShardCounters>,
    /// Sessions rebuilt on the shards by re-prefilling their history.
    pub rebuilds: AtomicU64,
    /// Tokens fed again by those rebuilds.
    pub rebuilt_tokens: AtomicU64,
    /// Positions of rebuilt sessions every shard kept (shards with a state
    /// directory), not fed again.
    pub resumed_positions: AtomicU64,
}

impl ShardStats {
    pub(super) fn new(shards: &[PlannedShard]) -> Self {
        ShardStats {
            shards: shards
                .iter()
                .map(|s| ShardCounters {
                    label: s.addr.clone(),
                    failures: Default::default(),
                    reconnects: AtomicU64::new(0),
                    restarts: AtomicU64::new(0),
                    up: AtomicBool::new(false),
                    backend: AtomicU8::new(0),
                })
                .collect(),
            rebuilds: AtomicU64::new(0),
            rebuilt_tokens: AtomicU64::new(0),
            resumed_positions: AtomicU64::new(0),
        }
    }
}

impl ShardStats {
    /// Reads every counter (relaxed: each is exact, the set is not a
    /// single instant).
    pub fn snapshot(&self) -> ShardStatsSnapshot {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ShardStatsSnapshot {
            shards: self
                .shards
                .iter()
                .map(|c| ShardSnapshot {
                    shard: c.label.clone(),
                    failures: FAILURE_KINDS
                        .iter()
                        .map(|k| (k.name(), load(&c.failures[k.index()])))
                        .collect(),
                    reconnects: load(&c.reconnects),
                    restarts: load(&c.restarts),
                    up: c.up.load(Ordering::Relaxed),
                    backend: c.backend(),
                })
                .collect(),
            rebuilds: load(&self.rebuilds),
            rebuilt_tokens: load(&self.rebuilt_tokens),
            resumed_positions: load(&self.resumed_positions),
        }
    }
}
