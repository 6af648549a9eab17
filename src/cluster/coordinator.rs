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

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use grpcio::Environment;

use super::fingerprint::Fingerprint;
use super::frame::{unix_nanos, ErrorKind, Run, WireSessionId};
use super::link::{LinkError, LinkOptions, ShardCapacity, ShardLink};
use super::payload::Encoding;
use crate::durable::{extend_page_chain, page_chain};
use crate::kv::KvError;
use crate::model::{LogitRows, Model, ModelError, Scratch};
use crate::runtime::StepFeed;
use crate::runtime::{ShardSnapshot, ShardStatsSnapshot};
use crate::threads::ThreadPool;

/// How long a step's frames stay valid: a shard refuses (and does not
/// compute) a frame that reaches it later than this.
const STEP_DEADLINE: Duration = Duration::from_secs(30);
/// A handshake that takes longer than this counts as a failed connect.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);
/// After a connect refused at once, steps fail at once for this long
/// before the next try; after one that hung (an unreachable host), for
/// [`SLOW_RECONNECT_BACKOFF`], so that steps do not each wait out a
/// handshake timeout.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(200);
const SLOW_RECONNECT_BACKOFF: Duration = Duration::from_secs(2);

/// `A..B` with A < B: layers A to B-1.
pub fn parse_layers(text: &str) -> Result<Range<usize>, String> {
    let (a, b) = text
        .split_once("..")
        .ok_or_else(|| format!("{text:?} is not a range like 0..15"))?;
    let start: usize = a
        .trim()
        .parse()
        .map_err(|_| format!("{a:?} is not a layer number"))?;
    let end: usize = b
        .trim()
        .parse()
        .map_err(|_| format!("{b:?} is not a layer number"))?;
    if start >= end {
        return Err(format!("{text}: the range is empty (it is half-open)"));
    }
    Ok(start..end)
}

/// One `--shards` entry: `ADDR`, or `ADDR=A..B` to name the layer range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    pub addr: String,
    pub layers: Option<Range<usize>>,
}

impl ShardSpec {
    /// Parses one entry.
    pub fn parse(text: &str) -> Result<ShardSpec, String> {
        let text = text.trim();
        let (addr, layers) = match text.split_once('=') {
            Some((addr, range)) => (addr.trim(), Some(parse_layers(range)?)),
            None => (text, None),
        };
        if addr.is_empty() {
            return Err(format!("{text:?}: a shard needs an address (HOST:PORT)"));
        }
        Ok(ShardSpec {
            addr: addr.to_owned(),
            layers,
        })
    }

    /// Parses a comma-separated list.
    pub fn parse_list(text: &str) -> Result<Vec<ShardSpec>, String> {
        text.split(',')
            .filter(|s| !s.trim().is_empty())
            .map(ShardSpec::parse)
            .collect()
    }
}

/// Why a list of shards cannot run the model.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("no shards listed")]
    Empty,
    #[error("{shards} shards for a model of {layers} layers: each shard needs at least one")]
    TooMany { shards: usize, layers: usize },
    #[error("either every shard names its layers (ADDR=A..B) or none does")]
    Mixed,
    #[error(
        "the shards' layers must run 0..{layers} in order without gaps; \
         shard {index} starts at {start}, expected {expected}"
    )]
    Gap {
        index: usize,
        start: usize,
        expected: usize,
        layers: usize,
    },
    #[error("the last shard ends at layer {end}, the model has {layers}")]
    Short { end: usize, layers: usize },
}

/// Why the shards cannot be used at start-up.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The shard refused the handshake, or stayed unreachable (the
    /// error names it).
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error("shard {shard} did not say how much KV it holds")]
    NoCapacity { shard: String },
    #[error(
        "shard {shard} pages {theirs} positions, another {others}: every shard must page alike"
    )]
    PagingDiffers {
        shard: String,
        theirs: u32,
        others: u32,
    },
}

/// A shard and what it must serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedShard {
    pub addr: String,
    pub fingerprint: Fingerprint,
}

impl PlannedShard {
    /// `ADDR (layers A..B)`, for messages and metric labels.
    pub fn label(&self) -> String {
        format!(
            "{} (layers {}..{})",
            self.addr, self.fingerprint.layer_begin, self.fingerprint.layer_end
        )
    }
}

/// Which shard runs which layers, the terms every link asks for, the
/// coordinator's epoch, the counters every worker adds to, and the gRPC
/// completion queues every link shares.
pub struct ShardPlan {
    shards: Vec<PlannedShard>,
    options: LinkOptions,
    coordinator_epoch: u64,
    stats: Arc<ShardStats>,
    env: Arc<Environment>,
}

impl std::fmt::Debug for ShardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardPlan")
            .field("shards", &self.shards)
            .field("options", &self.options)
            .field("coordinator_epoch", &self.coordinator_epoch)
            .finish_non_exhaustive()
    }
}

impl ShardPlan {
    /// Places `specs` over the model's layers: ranges as named, or, when
    /// none is named, split as evenly as whole layers allow, in list order
    /// (shard `i` of `k` runs `i*n/k .. (i+1)*n/k`).
    pub fn new(
        n_layers: usize,
        hidden_size: usize,
        gguf_sha256: [u8; 32],
        specs: &[ShardSpec],
        encoding: Encoding,
    ) -> Result<ShardPlan, PlanError> {
        let n = n_layers;
        let k = specs.len();
        if k == 0 {
            return Err(PlanError::Empty);
        }
        if k > n {
            return Err(PlanError::TooMany {
                shards: k,
                layers: n,
            });
        }
        let named = specs.iter().filter(|s| s.layers.is_some()).count();
        let ranges: Vec<Range<usize>> = if named == 0 {
            (0..k).map(|i| i * n / k..(i + 1) * n / k).collect()
        } else if named == k {
            specs.iter().filter_map(|s| s.layers.clone()).collect()
        } else {
            return Err(PlanError::Mixed);
        };
        let mut expected = 0;
        for (index, r) in ranges.iter().enumerate() {
            if r.start != expected || r.end <= r.start {
                return Err(PlanError::Gap {
                    index,
                    start: r.start,
                    expected,
                    layers: n,
                });
            }
            expected = r.end;
        }
        if expected != n {
            return Err(PlanError::Short {
                end: expected,
                layers: n,
            });
        }
        let shards: Vec<PlannedShard> = specs
            .iter()
            .zip(ranges)
            .map(|(spec, r)| PlannedShard {
                addr: spec.addr.clone(),
                fingerprint: Fingerprint {
                    gguf_sha256,
                    layer_begin: r.start as u32,
                    layer_end: r.end as u32,
                    layer_count: n as u32,
                    hidden_size: hidden_size as u32,
                },
            })
            .collect();
        let stats = Arc::new(ShardStats::new(&shards));
        Ok(ShardPlan {
            shards,
            options: LinkOptions {
                encoding,
                handshake_timeout: HANDSHAKE_TIMEOUT,
                ..LinkOptions::default()
            },
            coordinator_epoch: super::shard::random_epoch(),
            stats,
            // The workers block on their links; these threads only move
            // bytes.
            env: Arc::new(Environment::new(2)),
        })
    }

    pub fn shards(&self) -> &[PlannedShard] {
        &self.shards
    }

    pub fn encoding(&self) -> Encoding {
        self.options.encoding
    }

    pub fn coordinator_epoch(&self) -> u64 {
        self.coordinator_epoch
    }

    pub fn stats(&self) -> &Arc<ShardStats> {
        &self.stats
    }

    /// Handshakes with every shard once (each must serve its fingerprint)
    /// and returns what all of them can hold: the fewest pages and
    /// sessions. Shards must agree on positions per page. A shard that
    /// cannot be reached yet (hosts start in any order) is tried again for
    /// up to `wait`; a shard that refuses the handshake fails at once.
    pub fn probe(&self, wait: Duration) -> Result<ShardCapacity, ProbeError> {
        let give_up = Instant::now() + wait;
        let mut least: Option<ShardCapacity> = None;
        for (shard, counters) in self.shards.iter().zip(&self.stats.shards) {
            let mut next_warning = Instant::now();
            let link = loop {
                let connected = ShardLink::connect_in(
                    &self.env,
                    &shard.addr,
                    &shard.fingerprint,
                    self.coordinator_epoch,
                    &self.options,
                );
                match connected {
                    Ok(link) => break link,
                    Err(e @ LinkError::Transport { .. }) if Instant::now() < give_up => {
                        if Instant::now() >= next_warning {
                            tracing::warn!(shard = %shard.label(), error = %e, "waiting for the shard");
                            next_warning = Instant::now() + Duration::from_secs(5);
                        }
                        std::thread::sleep(Duration::from_millis(250));
                    }
                    Err(e) => return Err(ProbeError::Link(e)),
                }
            };
            counters.up.store(true, Ordering::Relaxed);
            let c = link.capacity();
            if c.kv_pages == 0 || c.page_positions == 0 {
                return Err(ProbeError::NoCapacity {
                    shard: shard.label(),
                });
            }
            least = Some(match least {
                None => c,
                Some(l) if l.page_positions != c.page_positions => {
                    return Err(ProbeError::PagingDiffers {
                        shard: shard.label(),
                        theirs: c.page_positions,
                        others: l.page_positions,
                    })
                }
                Some(l) => ShardCapacity {
                    kv_pages: l.kv_pages.min(c.kv_pages),
                    page_positions: l.page_positions,
                    max_sessions: match (l.max_sessions, c.max_sessions) {
                        (0, m) | (m, 0) => m,
                        (a, b) => a.min(b),
                    },
                    max_frame_rows: match (l.max_frame_rows, c.max_frame_rows) {
                        (0, m) | (m, 0) => m,
                        (a, b) => a.min(b),
                    },
                    keeps_pages: l.keeps_pages && c.keeps_pages,
                },
            });
        }
        least.ok_or(ProbeError::Plan(PlanError::Empty))
    }
}

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

    fn index(self) -> usize {
        FAILURE_KINDS.iter().position(|&k| k == self).unwrap_or(0)
    }

    fn of(error: &LinkError) -> FailureKind {
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
    fn new(shards: &[PlannedShard]) -> Self {
        ShardStats {
            shards: shards
                .iter()
                .map(|s| ShardCounters {
                    label: s.addr.clone(),
                    failures: Default::default(),
                    reconnects: AtomicU64::new(0),
                    restarts: AtomicU64::new(0),
                    up: AtomicBool::new(false),
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
                })
                .collect(),
            rebuilds: load(&self.rebuilds),
            rebuilt_tokens: load(&self.rebuilt_tokens),
            resumed_positions: load(&self.resumed_positions),
        }
    }
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

    fn failure(&mut self, index: usize, error: &LinkError) -> ShardFailure {
        let kind = FailureKind::of(error);
        let counters = &self.plan.stats.shards[index];
        counters.failures[kind.index()].fetch_add(1, Ordering::Relaxed);
        let broken = match kind {
            FailureKind::Transport | FailureKind::Handshake => true,
            FailureKind::Protocol(k) => {
                matches!(error, LinkError::BadReply { .. })
                    || matches!(k, ErrorKind::StaleEpoch | ErrorKind::Sequence)
            }
        };
        if broken {
            counters.up.store(false, Ordering::Relaxed);
            let slot = &mut self.slots[index];
            slot.link = None;
            slot.last_error = error.to_string();
        }
        let shard = self.plan.shards[index].label();
        tracing::warn!(%shard, kind = kind.name(), %error, "shard step failed");
        ShardFailure {
            shard,
            kind,
            message: error.to_string(),
        }
    }

    /// Connects every link that is down (a shard whose epoch changed has
    /// lost every session: the lineage moves on).
    fn connect_all(&mut self) -> Result<(), ShardFailure> {
        for index in 0..self.slots.len() {
            if self.slots[index].link.is_some() {
                continue;
            }
            let shard = &self.plan.shards[index];
            let now = Instant::now();
            if now < self.slots[index].next_try {
                return Err(ShardFailure {
                    shard: shard.label(),
                    kind: FailureKind::Transport,
                    message: format!(
                        "the shard is unreachable ({}); next try in {} ms",
                        self.slots[index].last_error,
                        (self.slots[index].next_try - now).as_millis()
                    ),
                });
            }
            let connected = ShardLink::connect_in(
                &self.plan.env,
                &shard.addr,
                &shard.fingerprint,
                self.plan.coordinator_epoch,
                &self.plan.options,
            );
            let mut link = match connected {
                Ok(link) => link,
                Err(e) => {
                    let waited = now.elapsed();
                    self.slots[index].next_try = Instant::now()
                        + if waited < Duration::from_millis(500) {
                            RECONNECT_BACKOFF
                        } else {
                            SLOW_RECONNECT_BACKOFF
                        };
                    return Err(self.failure(index, &e));
                }
            };
            let counters = &self.plan.stats.shards[index];
            let epoch = link.epochs().shard;
            let slot = &mut self.slots[index];
            match slot.epoch {
                Some(old) if old != epoch => {
                    counters.restarts.fetch_add(1, Ordering::Relaxed);
                    counters.reconnects.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(shard = %shard.label(), "the shard restarted: its sessions will be rebuilt");
                    self.lineage += 1;
                    // Only this shard lost everything; the others still
                    // hold what they are owed releases for.
                    slot.owed_release.clear();
                }
                Some(_) => {
                    counters.reconnects.fetch_add(1, Ordering::Relaxed);
                    let owed: Vec<WireSessionId> = slot.owed_release.iter().copied().collect();
                    if !owed.is_empty() {
                        if let Err(e) = link.release(&owed) {
                            return Err(self.failure(index, &e));
                        }
                        slot.owed_release.clear();
                    }
                }
                None => {}
            }
            counters.up.store(true, Ordering::Relaxed);
            let slot = &mut self.slots[index];
            slot.epoch = Some(epoch);
            slot.link = Some(link);
        }
        Ok(())
    }

    /// Frees sessions on every shard: now where the link is up, when it
    /// comes back otherwise.
    pub fn release(&mut self, sessions: &[WireSessionId]) {
        for id in sessions {
            self.held.remove(id);
            self.chains.remove(id);
        }
        for index in 0..self.slots.len() {
            let sent = match self.slots[index].link.as_mut() {
                Some(link) => link.release(sessions).map_err(Some),
                None => Err(None),
            };
            match sent {
                Ok(()) => {}
                Err(error) => {
                    if let Some(e) = error {
                        self.failure(index, &e);
                    }
                    self.slots[index]
                        .owed_release
                        .extend(sessions.iter().copied());
                }
            }
        }
    }

    /// For a session the coordinator restored from its journal: when every
    /// shard keeps pages, has each keep what matches `history` without its
    /// last token (which is fed again for its logits), and returns the
    /// positions every shard now holds; 0 when a shard keeps no pages or
    /// cannot be reached (the whole history is then fed as before).
    pub fn resume(&mut self, id: WireSessionId, history: &[u32]) -> usize {
        let Some(head) = history.len().checked_sub(1) else {
            return 0;
        };
        if self.connect_all().is_err() || !self.keeping_pages().all(|k| k) {
            return 0;
        }
        let deadline = unix_nanos(SystemTime::now() + STEP_DEADLINE);
        match self.resume_everywhere(id, &history[..head], deadline) {
            Ok(kept) => {
                self.held.insert(id, Held::InStep(self.lineage));
                self.plan
                    .stats
                    .resumed_positions
                    .fetch_add(kept as u64, Ordering::Relaxed);
                tracing::info!(
                    kept,
                    tokens = history.len(),
                    "restored session resumed on the shards"
                );
                kept
            }
            Err(failure) => {
                tracing::warn!(%failure, "resuming a restored session on the shards; feeding it whole");
                self.held.insert(id, Held::Doubtful);
                0
            }
        }
    }

    /// Tells every shard the sessions' generations were cancelled.
    pub fn cancel(&mut self, sessions: &[WireSessionId]) {
        for index in 0..self.slots.len() {
            if let Some(Err(e)) = self.slots[index]
                .link
                .as_mut()
                .map(|link| link.cancel(sessions))
            {
                self.failure(index, &e);
            }
        }
    }

    /// Runs `rows` hidden states (`runs` in order) through every shard, in
    /// frames of at most the rows every connected shard accepts.
    fn through_shards(
        &mut self,
        runs: &[Run],
        deadline: u64,
        hidden: &mut [f32],
    ) -> Result<(), ShardFailure> {
        let max_rows = self
            .slots
            .iter()
            .filter_map(|s| s.link.as_ref())
            .map(|l| match l.capacity().max_frame_rows {
                0 => usize::MAX,
                n => n as usize,
            })
            .min()
            .unwrap_or(usize::MAX);
        let h = hidden.len() / runs.iter().map(|r| r.rows as usize).sum::<usize>().max(1);
        let page = self.page_positions();
        let chained = self.keeping_pages().any(|k| k);
        for (piece, rows) in frame_pieces(runs, max_rows) {
            let hidden = &mut hidden[rows.start * h..rows.end * h];
            let chains: Vec<Vec<u64>> = if chained {
                piece
                    .iter()
                    .map(|run| self.page_chains(run, page))
                    .collect()
            } else {
                Vec::new()
            };
            for index in 0..self.slots.len() {
                let Some(link) = self.slots[index].link.as_mut() else {
                    return Err(self.link_down(index));
                };
                if let Err(e) = link.forward_chained(&piece, &chains, hidden, deadline) {
                    return Err(self.failure(index, &e));
                }
            }
        }
        Ok(())
    }

    fn link_down(&self, index: usize) -> ShardFailure {
        ShardFailure {
            shard: self.plan.shards[index].label(),
            kind: FailureKind::Transport,
            message: "the link is down".into(),
        }
    }

    /// Whether each shard keeps pages (a link that is down counts as one
    /// that does not).
    fn keeping_pages(&self) -> impl Iterator<Item = bool> + '_ {
        self.slots
            .iter()
            .map(|s| s.link.as_ref().is_some_and(|l| l.capacity().keeps_pages))
    }

    /// Positions per page, as the shards agreed at the handshake.
    fn page_positions(&self) -> usize {
        self.slots
            .iter()
            .filter_map(|s| s.link.as_ref())
            .map(|l| l.capacity().page_positions as usize)
            .next()
            .unwrap_or(1)
            .max(1)
    }

    /// The chains of the pages `run` fills, from the session's chain.
    fn page_chains(&self, run: &Run, page: usize) -> Vec<u64> {
        let start = run.position as usize;
        let blocks = start / page..(start + run.rows as usize) / page;
        self.chains
            .get(&run.session)
            .and_then(|chain| chain.get(blocks))
            .map(<[u64]>::to_vec)
            .unwrap_or_default()
    }

    /// Asks every shard to keep what it holds of `id` that matches
    /// `history`, then each that kept more than the least to keep only
    /// that, and returns the least: the positions every shard now holds.
    fn resume_everywhere(
        &mut self,
        id: WireSessionId,
        history: &[u32],
        deadline: u64,
    ) -> Result<usize, ShardFailure> {
        let page = self.page_positions();
        let chain = page_chain(history, page, history.len() / page);
        let length = history.len() as u64;
        let mut kept = Vec::with_capacity(self.slots.len());
        for index in 0..self.slots.len() {
            let Some(link) = self.slots[index].link.as_mut() else {
                return Err(self.link_down(index));
            };
            match link.resume(id, length, &chain, deadline) {
                Ok(k) => kept.push(k),
                Err(e) => return Err(self.failure(index, &e)),
            }
        }
        let least = kept.iter().copied().min().unwrap_or(0);
        let blocks = least as usize / page;
        for (index, &k) in kept.iter().enumerate() {
            if k == least {
                continue;
            }
            let Some(link) = self.slots[index].link.as_mut() else {
                return Err(self.link_down(index));
            };
            match link.resume(id, least, &chain[..blocks], deadline) {
                Ok(again) if again == least => {}
                Ok(again) => {
                    return Err(ShardFailure {
                        shard: self.plan.shards[index].label(),
                        kind: FailureKind::Protocol(ErrorKind::Internal),
                        message: format!(
                        "asked to keep {least} of the {k} positions it had kept, it kept {again}"
                    ),
                    })
                }
                Err(e) => return Err(self.failure(index, &e)),
            }
        }
        self.chains.insert(id, chain);
        Ok(least as usize)
    }

    /// Brings a session's KV on every shard in step with its history: when
    /// every shard keeps pages, each keeps what matches the history
    /// (Resume) and only the positions after what all of them kept are fed
    /// again; otherwise it is released everywhere and fed again whole.
    fn rebuild(
        &mut self,
        model: &Model,
        id: WireSessionId,
        history: &[u32],
        chunk: usize,
        deadline: u64,
    ) -> Result<(), ChainError> {
        let start = if self.keeping_pages().all(|k| k) {
            self.resume_everywhere(id, history, deadline)?
        } else {
            for index in 0..self.slots.len() {
                if let Some(Err(e)) = self.slots[index]
                    .link
                    .as_mut()
                    .map(|link| link.release(&[id]))
                {
                    return Err(self.failure(index, &e).into());
                }
            }
            if self.keeping_pages().any(|k| k) {
                let page = self.page_positions();
                let chain = page_chain(history, page, history.len() / page);
                self.chains.insert(id, chain);
            }
            0
        };
        let h = model.config.hidden;
        let mut rows = std::mem::take(&mut self.rows);
        let mut position = start as u64;
        for part in history[start..].chunks(chunk.max(1)) {
            rows.clear();
            rows.resize(part.len() * h, 0.0);
            model.embed(part, &mut rows)?;
            let result = self.through_shards(
                &[Run {
                    session: id,
                    position,
                    rows: part.len() as u32,
                }],
                deadline,
                &mut rows,
            );
            if let Err(e) = result {
                self.rows = rows;
                return Err(e.into());
            }
            position += part.len() as u64;
        }
        self.rows = rows;
        let stats = &self.plan.stats;
        stats.rebuilds.fetch_add(1, Ordering::Relaxed);
        stats
            .rebuilt_tokens
            .fetch_add((history.len() - start) as u64, Ordering::Relaxed);
        stats
            .resumed_positions
            .fetch_add(start as u64, Ordering::Relaxed);
        tracing::info!(
            fed = history.len() - start,
            kept = start,
            "session rebuilt on the shards"
        );
        Ok(())
    }

    /// One batched step: like [`Model::forward`], with the layers run by
    /// the shards. On success every ledger is committed and the logits are
    /// in `scratch.logits`; on failure no ledger moved and every feed's
    /// session is marked for a rebuild.
    pub fn forward(
        &mut self,
        model: &Model,
        feeds: &mut [StepFeed<'_>],
        pool: &ThreadPool,
        scratch: &mut Scratch,
        prefill_chunk: usize,
    ) -> Result<LogitRows, ChainError> {
        let connected: Vec<bool> = self.slots.iter().map(|s| s.link.is_some()).collect();
        let mut result = self.try_forward(model, feeds, pool, scratch, prefill_chunk);
        // A stream that died while idle (its shard restarted, say) is only
        // found out by using it: connect again and run the step once more,
        // rebuilding its sessions, rather than fail a call a live shard
        // could answer.
        if let Err(ChainError::Shard(failure)) = &result {
            let went_stale = failure.kind == FailureKind::Transport
                && self
                    .slots
                    .iter()
                    .zip(&connected)
                    .any(|(slot, &was)| was && slot.link.is_none());
            if went_stale {
                for f in feeds.iter() {
                    self.held.insert(f.session.bytes(), Held::Doubtful);
                }
                result = self.try_forward(model, feeds, pool, scratch, prefill_chunk);
            }
        }
        let held = match &result {
            Ok(_) => Held::InStep(self.lineage),
            Err(_) => Held::Doubtful,
        };
        for f in feeds.iter() {
            self.held.insert(f.session.bytes(), held);
        }
        result
    }

    fn try_forward(
        &mut self,
        model: &Model,
        feeds: &mut [StepFeed<'_>],
        pool: &ThreadPool,
        scratch: &mut Scratch,
        prefill_chunk: usize,
    ) -> Result<LogitRows, ChainError> {
        for f in feeds.iter_mut() {
            f.kv.reserve(f.kv.len() + f.tokens.len())?;
        }
        self.connect_all()?;
        let deadline = unix_nanos(SystemTime::now() + STEP_DEADLINE);
        for f in feeds.iter() {
            let len = f.kv.len();
            match (self.held.get(&f.session.bytes()).copied(), len) {
                (None, 0) => {}
                (Some(Held::InStep(l)), n) if l == self.lineage && n > 0 => {}
                // The ledger restarted (a truncation): so do the shards.
                (Some(_), 0) => self.release(&[f.session.bytes()]),
                (_, n) => self.rebuild(
                    model,
                    f.session.bytes(),
                    &f.history[..n],
                    prefill_chunk,
                    deadline,
                )?,
            }
        }
        if self.keeping_pages().any(|k| k) {
            let page = self.page_positions();
            for f in feeds.iter() {
                let n = f.kv.len();
                let chain = self.chains.entry(f.session.bytes()).or_default();
                // Blocks past the committed length may be from a step that
                // failed: hashed again from the history and the new tokens.
                chain.truncate(n / page);
                let from = chain.len() * page;
                let mut rest = f.history[from..n].to_vec();
                rest.extend_from_slice(f.tokens);
                extend_page_chain(chain, &rest, page);
            }
        }
        let h = model.config.hidden;
        let total: usize = feeds.iter().map(|f| f.tokens.len()).sum();
        let mut hidden = std::mem::take(&mut self.hidden);
        hidden.clear();
        hidden.resize(total * h, 0.0);
        let mut offsets = Vec::with_capacity(feeds.len());
        let mut at = 0;
        for f in feeds.iter() {
            offsets.push(at);
            if let Err(e) = model.embed(f.tokens, &mut hidden[at * h..(at + f.tokens.len()) * h]) {
                self.hidden = hidden;
                return Err(e.into());
            }
            at += f.tokens.len();
        }
        let result = self.run_groups(feeds, &offsets, deadline, h, &mut hidden);
        if let Err(e) = result {
            self.hidden = hidden;
            return Err(e.into());
        }
        // Final norm and logits for the rows each feed wants.
        let mut wanted = std::mem::take(&mut self.rows);
        wanted.clear();
        let mut per_sequence = Vec::with_capacity(feeds.len());
        let mut n_rows = 0;
        for (f, &offset) in feeds.iter().zip(&offsets) {
            let rows = f.logits.rows(f.tokens.len());
            wanted.extend_from_slice(&hidden[(offset + rows.start) * h..(offset + rows.end) * h]);
            per_sequence.push(n_rows..n_rows + rows.len());
            n_rows += rows.len();
        }
        let mut logits = std::mem::take(&mut scratch.logits);
        model.logits_from_hidden(pool, &wanted, &mut logits, scratch);
        scratch.logits = logits;
        self.rows = wanted;
        self.hidden = hidden;
        for f in feeds.iter_mut() {
            f.kv.commit(f.kv.len() + f.tokens.len())?;
        }
        Ok(LogitRows { per_sequence })
    }

    /// Sends the step's hidden states through the shards: every
    /// single-token feed in one decode frame, each longer feed in a
    /// prefill frame of its own.
    fn run_groups(
        &mut self,
        feeds: &[StepFeed<'_>],
        offsets: &[usize],
        deadline: u64,
        h: usize,
        hidden: &mut [f32],
    ) -> Result<(), ShardFailure> {
        let decoding: Vec<usize> = (0..feeds.len())
            .filter(|&i| feeds[i].tokens.len() == 1)
            .collect();
        if !decoding.is_empty() {
            let runs: Vec<Run> = decoding
                .iter()
                .map(|&i| Run {
                    session: feeds[i].session.bytes(),
                    position: feeds[i].kv.len() as u64,
                    rows: 1,
                })
                .collect();
            let mut rows = std::mem::take(&mut self.rows);
            rows.clear();
            for &i in &decoding {
                rows.extend_from_slice(&hidden[offsets[i] * h..(offsets[i] + 1) * h]);
            }
            let result = self.through_shards(&runs, deadline, &mut rows);
            if result.is_ok() {
                for (&i, row) in decoding.iter().zip(rows.chunks_exact(h)) {
                    hidden[offsets[i] * h..(offsets[i] + 1) * h].copy_from_slice(row);
                }
            }
            self.rows = rows;
            result?;
        }
        for (f, &offset) in feeds.iter().zip(offsets) {
            if f.tokens.len() < 2 {
                continue;
            }
            let run = [Run {
                session: f.session.bytes(),
                position: f.kv.len() as u64,
                rows: f.tokens.len() as u32,
            }];
            self.through_shards(
                &run,
                deadline,
                &mut hidden[offset * h..(offset + f.tokens.len()) * h],
            )?;
        }
        Ok(())
    }
}

/// The runs of one frame, and the rows of the step's hidden states they cover.
type FramePiece = (Vec<Run>, Range<usize>);

/// Splits `runs` (rows in order) into frames of at most `max_rows` rows:
/// a long run into consecutive pieces, a decode batch into smaller
/// batches. Each piece comes with the rows it covers.
fn frame_pieces(runs: &[Run], max_rows: usize) -> Vec<FramePiece> {
    let max_rows = max_rows.clamp(1, u32::MAX as usize);
    let mut pieces = Vec::new();
    let mut current: Vec<Run> = Vec::new();
    let (mut start, mut at) = (0usize, 0usize);
    for run in runs {
        let mut done = 0usize;
        while done < run.rows as usize {
            let filled = at - start;
            if filled == max_rows {
                pieces.push((std::mem::take(&mut current), start..at));
                start = at;
            }
            let n = (run.rows as usize - done).min(max_rows - (at - start));
            current.push(Run {
                session: run.session,
                position: run.position + done as u64,
                rows: n as u32,
            });
            done += n;
            at += n;
        }
    }
    if !current.is_empty() {
        pieces.push((current, start..at));
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_keep_to_the_agreed_rows() {
        let (a, b, c) = ([1u8; 16], [2u8; 16], [3u8; 16]);
        let run = |session, position, rows| Run {
            session,
            position,
            rows,
        };
        // A long prefill run becomes consecutive pieces.
        let pieces = frame_pieces(&[run(a, 10, 5)], 2);
        assert_eq!(
            pieces,
            vec![
                (vec![run(a, 10, 2)], 0..2),
                (vec![run(a, 12, 2)], 2..4),
                (vec![run(a, 14, 1)], 4..5)
            ]
        );
        // A decode batch becomes smaller batches.
        let pieces = frame_pieces(&[run(a, 3, 1), run(b, 7, 1), run(c, 0, 1)], 2);
        assert_eq!(
            pieces,
            vec![
                (vec![run(a, 3, 1), run(b, 7, 1)], 0..2),
                (vec![run(c, 0, 1)], 2..3)
            ]
        );
        // Within the bound nothing changes.
        assert_eq!(
            frame_pieces(&[run(a, 0, 64)], usize::MAX),
            vec![(vec![run(a, 0, 64)], 0..64)]
        );
    }

    #[test]
    fn shard_entries_name_an_address_and_maybe_a_range() {
        assert_eq!(
            ShardSpec::parse("10.0.0.2:7000"),
            Ok(ShardSpec {
                addr: "10.0.0.2:7000".into(),
                layers: None
            })
        );
        assert_eq!(
            ShardSpec::parse(" h:1=0..15 "),
            Ok(ShardSpec {
                addr: "h:1".into(),
                layers: Some(0..15)
            })
        );
        assert!(ShardSpec::parse("=0..3").is_err());
        assert!(ShardSpec::parse("h:1=3..3").is_err());
        assert_eq!(ShardSpec::parse_list("a:1, b:2,").map(|l| l.len()), Ok(2));
    }

    #[test]
    fn layer_ranges_are_half_open_and_non_empty() {
        assert_eq!(parse_layers("0..15"), Ok(0..15));
        assert_eq!(parse_layers(" 3 .. 4"), Ok(3..4));
        assert!(parse_layers("5..5").is_err());
        assert!(parse_layers("7..2").is_err());
        assert!(parse_layers("a..2").is_err());
        assert!(parse_layers("12").is_err());
    }

    fn plan(specs: &str, layers: usize) -> Result<Vec<(u32, u32)>, PlanError> {
        let specs = ShardSpec::parse_list(specs).expect("parses");
        ShardPlan::new(layers, 8, [0; 32], &specs, Encoding::F32).map(|p| {
            p.shards()
                .iter()
                .map(|s| (s.fingerprint.layer_begin, s.fingerprint.layer_end))
                .collect()
        })
    }

    #[test]
    fn unnamed_ranges_split_the_layers_evenly_in_order() {
        assert_eq!(plan("a:1,b:1", 30), Ok(vec![(0, 15), (15, 30)]));
        assert_eq!(
            plan("a:1,b:1,c:1", 30),
            Ok(vec![(0, 10), (10, 20), (20, 30)])
        );
        assert_eq!(plan("a:1,b:1,c:1", 4), Ok(vec![(0, 1), (1, 2), (2, 4)]));
        assert_eq!(plan("a:1", 4), Ok(vec![(0, 4)]));
    }

    #[test]
    fn named_ranges_must_tile_the_model() {
        assert_eq!(plan("a:1=0..3,b:1=3..30", 30), Ok(vec![(0, 3), (3, 30)]));
        assert!(matches!(
            plan("a:1=0..3,b:1=4..30", 30),
            Err(PlanError::Gap { index: 1, .. })
        ));
        assert!(matches!(
            plan("a:1=1..30", 30),
            Err(PlanError::Gap { index: 0, .. })
        ));
        assert_eq!(
            plan("a:1=0..29", 30),
            Err(PlanError::Short {
                end: 29,
                layers: 30
            })
        );
        assert_eq!(plan("a:1=0..3,b:1", 30), Err(PlanError::Mixed));
        assert_eq!(plan("", 30), Err(PlanError::Empty));
        assert!(matches!(
            plan("a:1,b:1,c:1", 2),
            Err(PlanError::TooMany { .. })
        ));
    }
}
