//! The step interface: what a worker needs from whatever runs the model's
//! layers for its sessions. The runtime owns the sessions, their queues,
//! admission, eviction and sampling; a [`Layers`] sizes the KV accounting
//! and hands each worker a [`StepRunner`] that turns a batch of feeds into
//! logits. [`LocalLayers`](super::LocalLayers) runs them in this process;
//! the shard chain (`inferd serve --shards`) runs them on other hosts.
//! `inferd serve` picks one and puts it in [`RuntimeConfig::layers`].

use std::fmt;
use std::sync::Arc;

use super::{RuntimeConfig, RuntimeError, SessionId};
use crate::kv::{KvPool, SessionKv};
use crate::model::{LogitRows, LogitsWanted, Model, Scratch};
use crate::sampler::{RowRequest, SampleRequest, Sampled, SamplerError};
use crate::threads::ThreadPool;

/// One session's share of a batched step.
pub struct StepFeed<'a> {
    pub session: SessionId,
    /// The committed history (as long as `kv`).
    pub history: &'a [u32],
    /// The session's positions; a successful step commits `tokens` to it.
    pub kv: &'a mut SessionKv,
    pub tokens: &'a [u32],
    pub logits: LogitsWanted,
    /// The last row will be sampled where it is: layers that
    /// [keep logits](StepRunner::keeps_logits) hold it instead of
    /// returning it.
    pub keep_logits: bool,
}

/// Why a step failed, and what it left behind.
#[derive(Debug)]
pub enum StepError {
    /// The sessions' state can no longer be trusted: they are removed and
    /// their calls fail with the error.
    SessionsLost(RuntimeError),
    /// Nothing was committed: every session is as it was before the step,
    /// its call fails with the error and what the call had fed is undone.
    NothingCommitted(RuntimeError),
}

/// Runs batched forward steps for one worker's sessions (one per worker,
/// used only by its thread).
pub trait StepRunner: Send {
    /// Feeds every `feeds[i].tokens` after its session's committed
    /// positions. On success each feed's KV length grew by its tokens and
    /// the rows each feed asked for are in `scratch.logits`, laid out as
    /// the returned [`LogitRows`] says.
    fn forward(
        &mut self,
        feeds: &mut [StepFeed<'_>],
        pool: &ThreadPool,
        scratch: &mut Scratch,
    ) -> Result<LogitRows, StepError>;

    /// The session is gone, or its positions were rewritten (a rollback or
    /// a truncation): forget whatever is held for it beyond `kv`.
    fn release(&mut self, _session: SessionId) {}

    /// The session's Generate was cancelled by its client.
    fn cancel(&mut self, _session: SessionId) {}

    /// A session restored at start is about to be fed its whole `history`
    /// again: how many of its first positions the layers still hold (in
    /// step with it, kept by shards with a state directory), which the
    /// caller commits instead of feeding. Less than the history, so that
    /// its last token is fed and its logits computed; 0 by default.
    fn resume(&mut self, _session: SessionId, _history: &[u32]) -> usize {
        0
    }

    /// Whether `forward` holds the last row of a feed marked `keep_logits`
    /// (as the session's next logits, where it was computed) instead of
    /// returning it in the scratch logits; then [`StepRunner::sample_kept`]
    /// samples it and [`StepRunner::kept_logits`] copies it out.
    fn keeps_logits(&self) -> bool {
        false
    }

    /// Whether `forward` computes every row of a feed that asks for all of
    /// them (`LogitsWanted::All`) into the scratch logits, and takes a
    /// session's KV cut back afterwards (`SessionKv::roll_back_to`) with
    /// nothing else to forget: what speculative decoding needs to verify
    /// proposed tokens. The layers in this process do; shards hold KV of
    /// their own, and a GPU keeps its logits.
    fn verifies_proposals(&self) -> bool {
        false
    }

    /// A copy of the session's kept logits.
    fn kept_logits(&self, session: SessionId) -> Result<Vec<f32>, RuntimeError> {
        Err(RuntimeError::Internal(format!(
            "the layers keep no logits (asked for session {session})"
        )))
    }

    /// Samples each row from its session's kept logits; `out[i]` answers
    /// `rows[i]`.
    fn sample_kept(
        &mut self,
        rows: &[(SessionId, RowRequest<'_>)],
        out: &mut Vec<Result<Sampled, SamplerError>>,
    ) {
        out.clear();
        out.extend(rows.iter().map(|_| {
            Err(SamplerError::Device {
                message: "the layers keep no logits".into(),
            })
        }));
    }

    /// Samples rows whose logits are on the host with the sampler that
    /// samples the kept ones, so that a worker whose runner keeps logits
    /// builds no sampler of its own; `out[i]` answers `rows[i]`.
    fn sample_host(
        &mut self,
        rows: &[SampleRequest<'_>],
        out: &mut Vec<Result<Sampled, SamplerError>>,
    ) {
        out.clear();
        out.extend(rows.iter().map(|_| {
            Err(SamplerError::Device {
                message: "the layers keep no logits and hold no sampler".into(),
            })
        }));
    }

    /// Bytes of K and V the session's committed positions hold, wherever
    /// they are.
    fn kv_live_bytes(&self, kv: &SessionKv) -> u64 {
        kv.live_bytes()
    }
}

/// Where the layers run: sizes the KV accounting once at start and builds
/// each worker's [`StepRunner`].
pub trait Layers: Send + Sync {
    /// The pool every session's positions are accounted in. It may lower
    /// `cfg`'s limits (page size, session count) to what the layers hold.
    fn kv_pool(&self, model: &Model, cfg: &mut RuntimeConfig) -> Result<KvPool, RuntimeError>;

    /// Bytes of K and V one page of that pool stands for.
    fn kv_page_bytes(&self, model: &Model, pool: &KvPool) -> u64 {
        let _ = model;
        pool.page_bytes() as u64
    }

    /// Worker `worker`'s runner.
    fn runner(
        &self,
        worker: usize,
        model: &Arc<Model>,
        cfg: &RuntimeConfig,
    ) -> Result<Box<dyn StepRunner>, RuntimeError>;

    /// Counters of remote layers, for `/metrics`; `None` when local.
    fn shard_stats(&self) -> Option<ShardStatsSnapshot> {
        None
    }

    /// Rows of logits read back from the device that computed them;
    /// `None` when the layers are not on a device.
    fn logit_rows_read(&self) -> Option<u64> {
        None
    }

    /// Submissions made on the layers' device; `None` when not on one.
    fn gpu_submissions(&self) -> Option<u64> {
        None
    }

    /// A short description for logs and `serve --check`.
    fn describe(&self) -> String;

    /// Where the layers are computed: "cpu", "gpu" or "shards".
    fn backend(&self) -> &'static str {
        "cpu"
    }
}

impl fmt::Debug for dyn Layers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// One shard's counters at a moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardSnapshot {
    /// The shard's address.
    pub shard: String,
    /// Failures by kind (every kind, zeros included).
    pub failures: Vec<(&'static str, u64)>,
    pub reconnects: u64,
    pub restarts: u64,
    pub up: bool,
    /// Where it computes (`cpu`, `gpu`; `unknown` before a handshake).
    pub backend: &'static str,
}

/// Every shard's counters at a moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardStatsSnapshot {
    pub shards: Vec<ShardSnapshot>,
    pub rebuilds: u64,
    pub rebuilt_tokens: u64,
    pub resumed_positions: u64,
}
