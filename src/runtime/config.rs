//! The runtime's configuration: workers, KV budget, limits, what makes
//! room, the sampler, where the layers run and how Generates speculate.

#[cfg(not(loom))]
use std::sync::Arc;
use std::time::Duration;

#[cfg(not(loom))]
use super::{Layers, LocalLayers};
use crate::kv::DEFAULT_PAGE_POSITIONS;
use crate::sampler::SelectedSampler;

/// What to do when a history would outgrow the model's context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverflowPolicy {
    /// Keep the first `sink` tokens and the most recent window, re-prefilled
    /// into fresh KV, and report how many were dropped.
    Truncate { sink: usize },
    /// Refuse to grow: an Append is an `InvalidArgument`, a Generate ends
    /// with [`StopReason::Truncated`] when the context is full.
    Stop,
}

/// What to do when the KV pool is empty or the session limit is reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Evict the least recently used idle session, on any worker.
    #[default]
    Lru,
    /// Never evict: the call is `ResourceExhausted`.
    None,
}

/// How a runtime is sized.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Worker threads, each owning a shard of the sessions.
    pub workers: usize,
    /// Pin worker `i` to core `i` (modulo the cores seen at start).
    pub pin_cores: bool,
    /// A worker waiting for its own work takes tasks of another worker's
    /// forward pass, so one busy session can use the idle workers' cores
    /// (`threads::CoreGroup`); results are the same bits either way.
    pub lend_cores: bool,
    /// KV memory budget in bytes, rounded down to whole pages (at least one).
    pub kv_bytes: u64,
    /// Positions per KV page.
    pub page_positions: usize,
    /// Most prompt tokens one session feeds per worker step.
    pub prefill_chunk: usize,
    /// About how long one worker step may take: a long prompt, or one deep
    /// in a long history (where attention dominates), is fed in chunks
    /// small enough that the worker gets back to its other sessions' calls
    /// (and checks deadlines) this often. Never below one token a step.
    pub prefill_step_budget: Duration,
    /// Most live sessions over all workers.
    pub max_sessions: usize,
    /// With a state directory, an LRU eviction spills the session (its KV
    /// given back, its history kept, to be fed again by its next call)
    /// instead of ending it, while fewer than this many are spilled.
    pub max_spilled_sessions: usize,
    /// Bytes of KV pages spilled sessions may have written out to the state
    /// directory in all; a session spilled beyond it keeps only its history
    /// (computed again when called).
    pub max_spill_bytes: u64,
    /// Pool pages (one layer's page each) of shared-prefix pages kept after
    /// the last session holding them let go, for a later session with the
    /// same history prefix; they give way when the pool is short.
    pub prefix_cache_pages: usize,
    /// A session idle this long is evicted.
    pub idle_ttl: Duration,
    pub overflow: OverflowPolicy,
    /// Whether a full pool or session limit evicts idle sessions.
    pub eviction: EvictionPolicy,
    /// Commands waiting for one worker; a full queue is `ResourceExhausted`.
    pub worker_queue: usize,
    /// Appends and Generates waiting behind a busy session.
    pub session_queue: usize,
    /// Events buffered per Generate stream (at least 4).
    pub stream_capacity: usize,
    /// The sampler every worker uses, resolved once at start-up (the CPU
    /// reference by default; `SelectedSampler::resolve` picks a GPU).
    pub sampler: SelectedSampler,
    /// Where the layers run: [`LocalLayers`] (this process) unless
    /// `serve --shards` hands the runtime a chain of shards.
    #[cfg(not(loom))]
    pub layers: Arc<dyn Layers>,
    /// The state directory's journals (`serve --state-dir`): sessions are
    /// journaled as calls complete and restored at start. `None`: sessions
    /// live as long as the process.
    #[cfg(not(loom))]
    pub state: Option<Arc<crate::durable::SessionStore>>,
    /// The replicas' session store (`serve --session-store`): every
    /// session's history is written there before its call is answered,
    /// and a call for a session this replica does not hold takes it over
    /// from there. Not with `state`.
    #[cfg(not(loom))]
    pub replica: Option<ReplicaConfig>,
    /// How a Generate that does not say otherwise speculates
    /// (`GenerateRequest::speculate`): tokens stay plain decoding's either
    /// way.
    pub speculation: Speculation,
    /// The draft model of [`Speculation::Draft`] (the main model's
    /// vocabulary, token for token: the caller checks). Its KV comes out
    /// of `kv_bytes`: each worker keeps a pool of draft pages sized so the
    /// draft holds as many positions as the main model.
    #[cfg(not(loom))]
    pub draft_model: Option<Arc<crate::model::Model>>,
    /// Tokens a draft proposes every step instead of the length its
    /// acceptance and costs say pays (`None`: sized that way).
    pub draft_tokens: Option<usize>,
}

/// Where the replicas keep their sessions, and this replica's part.
#[cfg(not(loom))]
#[derive(Clone)]
pub struct ReplicaConfig {
    /// The PostgreSQL URL (it may hold a password: never logged).
    pub url: String,
    /// This replica's name in the store's leases: stable across restarts
    /// so that a replica started again takes its sessions back at once.
    pub replica: String,
    /// How long a lease lasts unless renewed: how long a dead replica's
    /// sessions wait before another may take them over.
    pub lease: Duration,
    /// The SHA-256 of the model file served: the store's sessions made
    /// with another are not taken (`None`: not checked).
    pub model_sha256: Option<[u8; 32]>,
}

#[cfg(not(loom))]
impl std::fmt::Debug for ReplicaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaConfig")
            .field("replica", &self.replica)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// Speculative decoding in the workers: several tokens verified in one
/// forward pass, each accepted only where it is the token plain decoding
/// samples there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Speculation {
    /// Plain decoding: one token a step.
    None,
    /// Prompt lookup: what followed the last tokens where they occurred
    /// before in the session's history (`crate::speculate`).
    #[default]
    Lookup,
    /// A smaller model of the same vocabulary proposes its greedy
    /// continuation ([`RuntimeConfig::draft_model`]); without a draft
    /// model, or with layers that cannot verify, plain decoding.
    Draft,
}

#[cfg(not(loom))]
impl RuntimeConfig {
    /// The part of `kv_bytes` the draft model's KV takes when the runtime
    /// drafts: the share that holds as many positions as the main
    /// model's rest does.
    pub fn draft_kv_bytes(&self, main: &crate::model::Model) -> Option<u64> {
        let draft = self.draft_model.as_ref()?;
        if self.speculation != Speculation::Draft {
            return None;
        }
        let per_position = |m: &crate::model::Model| {
            m.kv_layout(m.config.n_layers, self.page_positions)
                .bytes_per_position() as u128
        };
        let (main, draft) = (per_position(main), per_position(draft));
        Some((u128::from(self.kv_bytes) * draft / (main + draft).max(1)) as u64)
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            pin_cores: true,
            lend_cores: true,
            kv_bytes: 256 << 20,
            page_positions: DEFAULT_PAGE_POSITIONS,
            prefill_chunk: 64,
            prefill_step_budget: Duration::from_millis(200),
            max_sessions: 1024,
            max_spilled_sessions: 4096,
            max_spill_bytes: 16 << 30,
            prefix_cache_pages: 0,
            idle_ttl: Duration::from_secs(1800),
            overflow: OverflowPolicy::Truncate { sink: 4 },
            speculation: Speculation::default(),
            eviction: EvictionPolicy::Lru,
            worker_queue: 1024,
            session_queue: 8,
            stream_capacity: 32,
            sampler: SelectedSampler::Cpu,
            #[cfg(not(loom))]
            layers: Arc::new(LocalLayers),
            #[cfg(not(loom))]
            state: None,
            #[cfg(not(loom))]
            replica: None,
            #[cfg(not(loom))]
            draft_model: None,
            draft_tokens: None,
        }
    }
}
