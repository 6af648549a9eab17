//! The runtime's side of a model split over shards (`inferd serve
//! --shards`): which shard runs which layers ([`ShardPlan`]), and, per
//! worker, the chain of links a batched step goes through
//! ([`ShardChain`]).
//!
//! A step embeds the fed tokens here, sends the hidden states through every
//! shard in layer order (one decode frame for all single-token feeds, one
//! prefill frame per longer feed), then computes the final norm and logits
//! here. The coordinator's own KV pool is only a ledger of positions: the
//! keys and values live on the shards.
//!
//! A failed step fails its sessions' calls and leaves their shard state in
//! doubt, so they are marked stale. A stale session, or any session after a
//! shard came back with a new epoch (its KV is gone), is rebuilt on its
//! next step: released on every shard, then its whole history is fed again
//! as prefill. Byte-exact prefill makes the rebuilt KV the same bits.
//!
//! Files by job: the plan and its start-up probe (`plan.rs`), the counters
//! and failure kinds (`stats.rs`), the links' connections (`links.rs`), a
//! step's fan-out through the shards (`step.rs`), and bringing a session
//! back in step after a failure or a restart (`recovery.rs`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::frame::WireSessionId;
use super::link::ShardLink;
use crate::kv::KvError;
use crate::model::ModelError;

mod links;
mod plan;
mod recovery;
mod stats;
mod step;

pub use plan::{parse_layers, PlanError, PlannedShard, ProbeError, ShardPlan, ShardSpec};
pub use stats::{FailureKind, ShardCounters, ShardFailure, ShardStats, FAILURE_KINDS};

/// How long a step's frames stay valid: a shard refuses (and does not
/// compute) a frame that reaches it later than this.
const STEP_DEADLINE: Duration = Duration::from_secs(30);

/// Why a step failed.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error(transparent)]
    Shard(#[from] ShardFailure),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// What the shards hold of a session, as far as this chain knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// In step with the ledger, in the chain's current lineage.
    InStep(u64),
    /// Possibly something, not known to match: release and rebuild.
    Doubtful,
}

/// A link slot: the link when connected, and what it is owed.
struct LinkSlot {
    link: Option<ShardLink>,
    /// The shard epoch last agreed with.
    epoch: Option<u64>,
    /// No connect before this.
    next_try: Instant,
    last_error: String,
    /// Sessions to release once the link is back (same epoch only).
    owed_release: HashSet<WireSessionId>,
}

/// A worker's links to every shard, in layer order; see the module docs.
pub struct ShardChain {
    plan: Arc<ShardPlan>,
    slots: Vec<LinkSlot>,
    /// Bumped whenever a shard comes back with a new epoch: every session
    /// held before is gone from it.
    lineage: u64,
    held: HashMap<WireSessionId, Held>,
    /// Per session, the hash chain of each full page of its history fed so
    /// far: what shards that keep pages name their pages by.
    chains: HashMap<WireSessionId, Vec<u64>>,
    hidden: Vec<f32>,
    rows: Vec<f32>,
}

impl ShardChain {
    /// Links connect on first use.
    pub fn new(plan: Arc<ShardPlan>) -> ShardChain {
        let now = Instant::now();
        let slots = plan
            .shards
            .iter()
            .map(|_| LinkSlot {
                link: None,
                epoch: None,
                next_try: now,
                last_error: String::new(),
                owed_release: HashSet::new(),
            })
            .collect();
        ShardChain {
            plan,
            slots,
            lineage: 0,
            held: HashMap::new(),
            chains: HashMap::new(),
            hidden: Vec::new(),
            rows: Vec::new(),
        }
    }
}
