//! One worker thread: it alone owns its shard of sessions (a plain map, no
//! locks) and its compute context, and runs the step loop.
//!
//! Each turn of the loop: take every waiting command; serve eviction
//! requests from other workers; retry creations waiting for a place; start
//! the next queued operation of each idle session (validate, reserve KV,
//! then mutate); build ONE batch holding a decode token for every generating
//! session whose stream has room and a prefill chunk for every session with
//! prompt tokens left; run one `Model::forward`; commit, check invariants and
//! emit; publish gauges and the oldest idle session. A session whose reader
//! is slow simply sits out steps; the others go on.
//!
//! When pages or a session place run out, the least recently used idle
//! session over ALL workers is evicted: a local one at once, another
//! worker's by a request on the [`EvictionBoard`]; the operation that needs
//! the room waits in its queue (other sessions go on) until the owner has
//! answered, then tries again.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};

use super::board::{EvictionBoard, EvictionTicket};
use super::notify::NotifySender;
use super::stats::{Counters, WorkerGauges};
use super::step::{StepError, StepFeed, StepRunner};
use super::{
    AppendReply, CloseReply, CreateSession, EvictionPolicy, GenerateDone, GenerateEvent,
    GenerateRequest, OverflowPolicy, RuntimeConfig, RuntimeError, SessionId, SessionInfo,
    StopReason,
};
use crate::kv::{KvError, KvPool, SessionKv};
use crate::model::{LogitRows, LogitsWanted, Model, Scratch};
use crate::sampler::{
    SampleRequest, Sampled, SamplerBackend, SamplerError, SamplingParams, TokenLogprobs,
};
use crate::threads::ThreadPool;

type Reply<T> = NotifySender<Result<T, RuntimeError>>;

/// A message to a worker.
pub(crate) enum Command {
    Create {
        id: SessionId,
        req: CreateSession,
        reply: Reply<SessionId>,
        deadline: Option<Instant>,
    },
    /// An operation that joins the session's FIFO.
    Enqueue {
        id: SessionId,
        op: Op,
        deadline: Option<Instant>,
    },
    Info {
        id: SessionId,
        reply: Reply<SessionInfo>,
    },
    Shutdown,
}

/// An operation that runs in the session's arrival order.
pub(crate) enum Op {
    Append {
        tokens: Vec<u32>,
        reply: Reply<AppendReply>,
    },
    Generate {
        req: Box<GenerateRequest>,
        events: NotifySender<GenerateEvent>,
        cancel: Arc<AtomicBool>,
    },
    Close {
        reply: Reply<CloseReply>,
    },
}

impl Op {
    fn fail(self, err: RuntimeError) {
        // A caller that went away no longer needs the answer.
        match self {
            Op::Append { reply, .. } => drop(reply.send(Err(err))),
            Op::Close { reply } => drop(reply.send(Err(err))),
            Op::Generate { events, .. } => drop(events.try_send(GenerateEvent::Error(err))),
        }
    }
}

/// What every worker shares; all of it is lock-free.
pub(crate) struct WorkersState {
    pub(crate) counters: Counters,
    /// Live sessions over all workers (the session limit).
    pub(crate) live_sessions: AtomicUsize,
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
}

impl WorkersState {
    pub(crate) fn new(wakers: Vec<Sender<()>>) -> Self {
        WorkersState {
            counters: Counters::default(),
            live_sessions: AtomicUsize::new(0),
            board: EvictionBoard::new(wakers.len()),
            idle_pages: wakers.iter().map(|_| AtomicUsize::new(0)).collect(),
            wakers,
            epoch: Instant::now(),
        }
    }
}

struct Queued {
    op: Op,
    deadline: Option<Instant>,
}

/// A CreateSession waiting for another worker to evict a session.
struct WaitingCreate {
    id: SessionId,
    req: CreateSession,
    reply: Reply<SessionId>,
    deadline: Option<Instant>,
    since: Instant,
}

/// A Generate in progress.
struct Generating {
    params: SamplingParams,
    seed_used: u64,
    max_tokens: u32,
    stop_sequences: Vec<Vec<u32>>,
    generated: Vec<u32>,
    events: NotifySender<GenerateEvent>,
    cancel: Arc<AtomicBool>,
    deadline: Option<Instant>,
    started: Instant,
    prefill_duration: Duration,
    /// History tokens computed again before the first sampled token.
    prefill_tokens: u64,
    /// Log-probabilities to report with each token (0: none).
    top_logprobs: usize,
    /// The report for the token sampled and not yet emitted.
    pending_logprobs: Option<TokenLogprobs>,
    /// A window shift in progress: the tokens it dropped, reported as
    /// `Truncated` once the kept window is in (never if the call stops
    /// first and the shift is undone).
    shift_dropped: Option<u64>,
}

enum Work {
    Append {
        reply: Reply<AppendReply>,
        dropped: u64,
        /// Checked before every chunk: past it the append is undone.
        deadline: Option<Instant>,
    },
    Generate(Box<Generating>),
    /// A failed call's truncation gave the session's pages back: its old
    /// history is fed again (bit-identical by INV-3) before anything else
    /// runs on it. Nobody waits for it and nothing cuts it short.
    Restore,
}

/// The operation a session is running: prompt tokens still to feed (after
/// an append or a truncation), then, for a Generate, decoding.
struct Active {
    work: Work,
    pending: Vec<u32>,
    fed: usize,
    prefill_started: Instant,
    /// How to put the session back if the call stops before `pending` is
    /// all in; dropped once it is.
    undo: Option<Undo>,
}

/// The session as it was before a call began to change it, so that a call
/// that fails, expires or is cancelled halfway leaves nothing half-done
/// (the history is append-only to clients, so cutting the KV back is safe).
struct Undo {
    kind: UndoKind,
    next_logits: Vec<f32>,
    truncated: u64,
}

enum UndoKind {
    /// Tokens were only added: cut the history and KV back to this length.
    Shorten(usize),
    /// A truncation re-prefills into fresh pages; the session's own pages
    /// and history wait here until it is done.
    SwapBack { kv: SessionKv, history: Vec<u32> },
    /// A truncation re-prefills into the session's own pages (nothing else
    /// could be had): the old history has to be computed again.
    Recompute { history: Vec<u32> },
}

/// What restarting a session's KV did.
enum Restarted {
    /// Emptied, with the pages for the kept window reserved.
    Now(Undo),
    /// Waiting for another worker's eviction; nothing changed.
    Later,
}

/// How an append starts.
enum Begin {
    /// Nothing to append.
    Empty,
    /// Reserved (and truncated, if it had to be): feed these tokens.
    Prefill {
        pending: Vec<u32>,
        dropped: u64,
        undo: Undo,
    },
    /// Waiting for another worker to evict; nothing changed.
    Later,
}

/// Whether pages or a place were had now, or another worker was asked to
/// evict and the caller should try again on a later turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Got {
    Now,
    Later,
}

/// What making room did.
enum Room {
    /// Something was evicted (or a remote request answered): try again now.
    Retry,
    /// Another worker was asked to evict; try again on a later turn.
    Later,
    /// Nothing idle anywhere may be evicted.
    Nothing,
}

/// What a session short of pages does after one round of making room.
enum Wait {
    /// Something was freed: try again now.
    Retry,
    /// Another worker was asked to evict: try again on a later turn.
    Later,
    /// Nothing more can be freed for it, or it waited long enough.
    GiveUp,
}

/// Why a session left its worker; each reason has a counter.
#[derive(Clone, Copy, Debug)]
enum Removal {
    Ttl,
    Lru,
    Close,
    /// An invariant broke or the forward pass failed.
    Failed,
}

/// A session and its queue.
struct SessionSlot {
    kv: SessionKv,
    history: Vec<u32>,
    next_logits: Vec<f32>,
    /// `digest(next_logits)`, computed on the first GetSessionInfo after the
    /// logits changed (hashing 49k logits costs ~0.2 ms of worker time).
    logits_digest: std::cell::Cell<Option<u64>>,
    label: String,
    eos: Vec<u32>,
    /// INV-1 violations seen on this session (cached positions against
    /// history length).
    inv1_violations: u64,
    /// INV-2 violations seen on this session (a cached length that went
    /// down).
    inv2_violations: u64,
    /// Tokens dropped so far by context-overflow truncation.
    truncated: u64,
    /// Committed KV length after the last mutation; it must never decrease
    /// except through a deliberate truncation, which resets it.
    high_water: usize,
    last_used: Instant,
    active: Option<Active>,
    queue: VecDeque<Queued>,
    /// When the session began waiting for another worker to free pages.
    short_since: Option<Instant>,
    /// What this step feeds for the session.
    feed: Vec<u32>,
    feed_logits: LogitsWanted,
}

impl SessionSlot {
    fn idle(&self) -> bool {
        self.active.is_none() && self.queue.is_empty()
    }
}

pub(crate) struct Worker {
    index: usize,
    model: Arc<Model>,
    kv_pool: Arc<KvPool>,
    cfg: RuntimeConfig,
    shared: Arc<WorkersState>,
    gauges: Arc<WorkerGauges>,
    compute: ThreadPool,
    scratch: Scratch,
    sampler: SamplerBackend,
    /// Sessions whose next token this step samples, in one batch.
    to_sample: Vec<SessionId>,
    /// The batch's answers, reused across steps.
    sampled: Vec<Result<Sampled, SamplerError>>,
    sessions: HashMap<SessionId, SessionSlot>,
    /// What runs the layers: the model here, or the shards.
    runner: Box<dyn StepRunner>,
    waiting_creates: VecDeque<WaitingCreate>,
    /// The one eviction this worker has asked another for and not seen
    /// answered.
    evict_wait: Option<EvictionTicket>,
    last_sweep: Instant,
    /// Nanoseconds one step spends per depth-weighted token (see
    /// [`depth_weight`]), averaged over recent steps: sizes prefill chunks
    /// to the step budget.
    ns_per_weighted_token: Option<f64>,
}

/// How long an idle worker waits for a command before sweeping for TTL.
const IDLE_WAIT: Duration = Duration::from_millis(100);
/// How long a worker whose sessions are all blocked waits before retrying.
const STALLED_WAIT: Duration = Duration::from_millis(1);
/// How long a call waits for other workers to evict before it is
/// `ResourceExhausted` (an owner answers within one of its turns).
const EVICTION_PATIENCE: Duration = Duration::from_secs(2);

fn kv_exhausted(asked: usize, free: usize) -> RuntimeError {
    RuntimeError::ResourceExhausted {
        what: "KV pages".into(),
        asked: asked as u64,
        free: free as u64,
    }
}

fn sessions_exhausted() -> RuntimeError {
    RuntimeError::ResourceExhausted {
        what: "sessions".into(),
        asked: 1,
        free: 0,
    }
}

impl Worker {
    pub(crate) fn new(
        index: usize,
        model: Arc<Model>,
        runner: Box<dyn StepRunner>,
        kv_pool: Arc<KvPool>,
        cfg: RuntimeConfig,
        shared: Arc<WorkersState>,
        gauges: Arc<WorkerGauges>,
    ) -> Result<Self, RuntimeError> {
        let sampler = cfg
            .sampler
            .backend(model.config.vocab, model.config.context)
            .map_err(|e| RuntimeError::Internal(format!("worker {index}: {e}")))?;
        Ok(Worker {
            index,
            model,
            kv_pool,
            cfg,
            shared,
            gauges,
            compute: ThreadPool::new(1),
            scratch: Scratch::default(),
            sampler,
            to_sample: Vec::new(),
            sampled: Vec::new(),
            sessions: HashMap::new(),
            runner,
            waiting_creates: VecDeque::new(),
            evict_wait: None,
            last_sweep: Instant::now(),
            ns_per_weighted_token: None,
        })
    }

    /// The loop: runs until `Shutdown` or until every sender is gone.
    pub(crate) fn run(mut self, commands: Receiver<Command>, wake: Receiver<()>) {
        tracing::debug!(worker = self.index, "worker started");
        let mut wait = IDLE_WAIT;
        loop {
            let timeout = if self.has_work() { wait } else { IDLE_WAIT };
            let first = crossbeam_channel::select! {
                recv(commands) -> got => got.map(Some),
                recv(wake) -> _ => Ok(None),
                default(timeout) => Ok(None),
            };
            let Ok(mut next) = first else {
                break;
            };
            let mut stop = false;
            while let Some(cmd) = next {
                if matches!(cmd, Command::Shutdown) {
                    stop = true;
                    break;
                }
                self.handle(cmd);
                next = commands.try_recv().ok();
            }
            if stop {
                break;
            }
            self.serve_evictions();
            let mut progressed = self.retry_creates();
            progressed |= self.step();
            wait = if progressed {
                Duration::ZERO
            } else {
                STALLED_WAIT
            };
            self.sweep_if_due();
            self.publish();
        }
        self.fail_everything();
        tracing::debug!(worker = self.index, "worker stopped");
    }

    fn has_work(&self) -> bool {
        !self.waiting_creates.is_empty() || self.sessions.values().any(|s| !s.idle())
    }

    fn fail_everything(&mut self) {
        let ids: Vec<SessionId> = self.sessions.keys().copied().collect();
        for id in ids {
            if let Some(mut slot) = self.sessions.remove(&id) {
                if let Some(active) = slot.active.take() {
                    finish_with_error(active, RuntimeError::Unavailable);
                }
                for q in slot.queue.drain(..) {
                    q.op.fail(RuntimeError::Unavailable);
                }
                self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
            }
        }
        for w in self.waiting_creates.drain(..) {
            let _ = w.reply.send(Err(RuntimeError::Unavailable));
        }
        // Whoever waits on this worker's evictions learns there are none.
        let board = &self.shared.board;
        board.answer(self.index, board.open_requests(self.index), None);
        self.publish();
    }

    pub(crate) fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Create {
                id,
                req,
                reply,
                deadline,
            } => {
                let waiting = WaitingCreate {
                    id,
                    req,
                    reply,
                    deadline,
                    since: Instant::now(),
                };
                if let Some(w) = self.try_create(waiting) {
                    self.waiting_creates.push_back(w);
                }
            }
            Command::Info { id, reply } => {
                let _ = reply.send(self.info(id));
            }
            Command::Enqueue { id, op, deadline } => {
                let limit = self.cfg.session_queue;
                let Some(slot) = self.sessions.get_mut(&id) else {
                    return op.fail(RuntimeError::NotFound);
                };
                if slot.queue.len() >= limit {
                    return op.fail(RuntimeError::ResourceExhausted {
                        what: "session wait queue".into(),
                        asked: slot.queue.len() as u64 + 1,
                        free: 0,
                    });
                }
                slot.queue.push_back(Queued { op, deadline });
            }
            Command::Shutdown => {}
        }
    }

    /// Creates the session, or hands the request back to wait for another
    /// worker's eviction. A request whose deadline has passed creates
    /// nothing.
    fn try_create(&mut self, w: WaitingCreate) -> Option<WaitingCreate> {
        if w.deadline.is_some_and(|d| d <= Instant::now()) {
            let _ = w.reply.send(Err(RuntimeError::DeadlineExceeded));
            return None;
        }
        if self.sessions.contains_key(&w.id) {
            let _ = w
                .reply
                .send(Err(RuntimeError::Internal("session id drawn twice".into())));
            return None;
        }
        while !self.claim_session() {
            match self.make_room(None) {
                Room::Retry => {}
                Room::Later if w.since.elapsed() < EVICTION_PATIENCE => return Some(w),
                Room::Later | Room::Nothing => {
                    let _ = w.reply.send(Err(sessions_exhausted()));
                    return None;
                }
            }
        }
        let id = w.id;
        self.sessions.insert(
            id,
            SessionSlot {
                kv: SessionKv::new(Arc::clone(&self.kv_pool)),
                history: Vec::new(),
                next_logits: Vec::new(),
                logits_digest: std::cell::Cell::new(None),
                label: w.req.client_label,
                eos: w.req.eos_token_ids,
                inv1_violations: 0,
                inv2_violations: 0,
                truncated: 0,
                high_water: 0,
                last_used: Instant::now(),
                active: None,
                queue: VecDeque::new(),
                short_since: None,
                feed: Vec::new(),
                feed_logits: LogitsWanted::None,
            },
        );
        self.shared
            .counters
            .sessions_created
            .fetch_add(1, Ordering::Relaxed);
        self.gauges
            .sessions
            .store(self.sessions.len() as u64, Ordering::Relaxed);
        tracing::info!(session = %id, worker = self.index, "session created");
        let _ = w.reply.send(Ok(id));
        None
    }

    /// Retries the creations waiting for a place. Returns whether any ended.
    fn retry_creates(&mut self) -> bool {
        let before = self.waiting_creates.len();
        for _ in 0..before {
            if let Some(w) = self.waiting_creates.pop_front() {
                if let Some(w) = self.try_create(w) {
                    self.waiting_creates.push_back(w);
                }
            }
        }
        self.waiting_creates.len() != before
    }

    /// Takes one place under the session limit, if one is left.
    fn claim_session(&self) -> bool {
        let max = self.cfg.max_sessions;
        self.shared
            .live_sessions
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    fn info(&self, id: SessionId) -> Result<SessionInfo, RuntimeError> {
        let slot = self.sessions.get(&id).ok_or(RuntimeError::NotFound)?;
        let busy = !slot.idle();
        Ok(SessionInfo {
            history_length: slot.history.len() as u64,
            kv_live_bytes: self.runner.kv_live_bytes(&slot.kv),
            inv1_violations: slot.inv1_violations,
            inv2_violations: slot.inv2_violations,
            idle_seconds: if busy {
                0.0
            } else {
                slot.last_used.elapsed().as_secs_f64()
            },
            pages_held: slot.kv.pages_held() as u64,
            client_label: slot.label.clone(),
            eos_token_ids: slot.eos.clone(),
            truncated_token_count: slot.truncated,
            busy,
            logits_digest: slot.logits_digest.get().unwrap_or_else(|| {
                let d = digest(&slot.next_logits);
                slot.logits_digest.set(Some(d));
                d
            }),
        })
    }

    /// Removes a session and frees its KV, counting the reason.
    fn remove(&mut self, id: SessionId, reason: Removal) -> Option<SessionSlot> {
        let mut slot = self.sessions.remove(&id)?;
        if let Err(e) = slot.kv.release() {
            tracing::error!(session = %id, "freeing KV: {e}");
        }
        self.runner.release(id);
        self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
        let c = &self.shared.counters;
        let counter = match reason {
            Removal::Ttl => &c.evicted_ttl,
            Removal::Lru => &c.evicted_lru,
            Removal::Close => &c.evicted_close,
            Removal::Failed => &c.sessions_failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.gauges
            .sessions
            .store(self.sessions.len() as u64, Ordering::Relaxed);
        tracing::info!(session = %id, worker = self.index, reason = ?reason, "session removed");
        Some(slot)
    }

    /// Nanoseconds from the shared epoch to `t`: the board's stamps.
    fn stamp(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.shared.epoch).as_nanos() as u64
    }

    /// The least recently used idle session other than `keep`.
    fn lru_idle(&self, keep: Option<SessionId>) -> Option<(SessionId, Instant)> {
        self.sessions
            .iter()
            .filter(|(id, s)| s.idle() && Some(**id) != keep)
            .min_by_key(|(_, s)| s.last_used)
            .map(|(id, s)| (*id, s.last_used))
    }

    /// Evicts the least recently used idle session other than `keep`.
    fn evict_lru(&mut self, keep: Option<SessionId>) -> bool {
        match self.lru_idle(keep) {
            Some((id, _)) => self.remove(id, Removal::Lru).is_some(),
            None => false,
        }
    }

    /// The KV pages evicting could free for `keep`: those of this worker's
    /// idle sessions (counted now) and of the others' (as last published).
    fn evictable_pages(&self, keep: SessionId) -> usize {
        if self.cfg.eviction == EvictionPolicy::None {
            return 0;
        }
        let local: usize = self
            .sessions
            .iter()
            .filter(|(id, s)| s.idle() && **id != keep)
            .map(|(_, s)| s.kv.pages_held())
            .sum();
        let others: usize = self
            .shared
            .idle_pages
            .iter()
            .enumerate()
            .filter(|(worker, _)| *worker != self.index)
            .map(|(_, pages)| pages.load(Ordering::Relaxed))
            .sum();
        local.saturating_add(others)
    }

    /// Frees room by evicting the least recently used idle session of any
    /// worker (never `keep`), as the eviction policy allows.
    fn make_room(&mut self, keep: Option<SessionId>) -> Room {
        if self.cfg.eviction == EvictionPolicy::None {
            return Room::Nothing;
        }
        if let Some(ticket) = self.evict_wait {
            if !self.shared.board.is_answered(ticket) {
                return Room::Later;
            }
            self.evict_wait = None;
            return Room::Retry;
        }
        let local = self.lru_idle(keep);
        let remote = self.shared.board.best_victim(self.index);
        let ask = match (local, remote) {
            (Some((_, used)), Some((worker, stamp))) => {
                (stamp < self.stamp(used)).then_some(worker)
            }
            (None, Some((worker, _))) => Some(worker),
            _ => None,
        };
        if let Some(worker) = ask {
            self.evict_wait = Some(self.shared.board.ask(worker));
            if let Some(waker) = self.shared.wakers.get(worker) {
                let _ = waker.try_send(());
            }
            return Room::Later;
        }
        match local {
            Some((id, _)) => {
                self.remove(id, Removal::Lru);
                Room::Retry
            }
            None => Room::Nothing,
        }
    }

    /// Serves other workers' eviction requests: one LRU idle session each,
    /// while any is idle; then republishes and marks them answered.
    fn serve_evictions(&mut self) {
        let board = &self.shared.board;
        let open = board.open_requests(self.index);
        if open.count == 0 {
            return;
        }
        for _ in 0..open.count {
            if !self.evict_lru(None) {
                break;
            }
        }
        let oldest = self.lru_idle(None).map(|(_, used)| self.stamp(used));
        self.shared.board.answer(self.index, open, oldest);
    }

    /// Publishes the gauges and this worker's oldest idle session.
    fn publish(&self) {
        let mut kv_bytes = 0;
        let mut history = 0;
        let mut queued = self.waiting_creates.len() as u64;
        let mut oldest: Option<Instant> = None;
        let mut idle_pages = 0;
        for slot in self.sessions.values() {
            kv_bytes += self.runner.kv_live_bytes(&slot.kv);
            history += slot.history.len() as u64;
            queued += slot.queue.len() as u64;
            if slot.idle() {
                idle_pages += slot.kv.pages_held();
                if oldest.is_none_or(|t| slot.last_used < t) {
                    oldest = Some(slot.last_used);
                }
            }
        }
        if let Some(published) = self.shared.idle_pages.get(self.index) {
            published.store(idle_pages, Ordering::Relaxed);
        }
        let g = &self.gauges;
        g.sessions
            .store(self.sessions.len() as u64, Ordering::Relaxed);
        g.kv_live_bytes.store(kv_bytes, Ordering::Relaxed);
        g.history_tokens.store(history, Ordering::Relaxed);
        g.queued_ops.store(queued, Ordering::Relaxed);
        self.shared
            .board
            .publish(self.index, oldest.map(|t| self.stamp(t)));
    }

    /// Whether a session short of pages may go on waiting for another
    /// worker's eviction (starting its clock on the first call).
    fn still_patient(&mut self, id: SessionId) -> bool {
        let Some(slot) = self.sessions.get_mut(&id) else {
            return false;
        };
        let since = *slot.short_since.get_or_insert_with(Instant::now);
        if since.elapsed() < EVICTION_PATIENCE {
            return true;
        }
        slot.short_since = None;
        false
    }

    /// One round of making room for session `id`, within its patience.
    fn room_for(&mut self, id: SessionId) -> Wait {
        match self.make_room(Some(id)) {
            Room::Retry => Wait::Retry,
            Room::Later if self.still_patient(id) => Wait::Later,
            Room::Later | Room::Nothing => {
                self.clear_short(id);
                Wait::GiveUp
            }
        }
    }

    fn clear_short(&mut self, id: SessionId) {
        if let Some(slot) = self.sessions.get_mut(&id) {
            slot.short_since = None;
        }
    }

    /// Reserves KV for `total` positions of `id`, evicting idle sessions
    /// while the pool is short. All or nothing.
    fn reserve(&mut self, id: SessionId, total: usize) -> Result<Got, RuntimeError> {
        loop {
            let slot = self.sessions.get_mut(&id).ok_or(RuntimeError::NotFound)?;
            match slot.kv.reserve(total) {
                Ok(()) => {
                    slot.short_since = None;
                    return Ok(Got::Now);
                }
                Err(KvError::Exhausted { wanted, free }) => {
                    // Decide from the numbers first: evict nothing for a
                    // request that would fail anyway.
                    if free.saturating_add(self.evictable_pages(id)) < wanted {
                        self.clear_short(id);
                        return Err(kv_exhausted(wanted, free));
                    }
                    match self.room_for(id) {
                        Wait::Retry => {}
                        Wait::Later => return Ok(Got::Later),
                        Wait::GiveUp => return Err(kv_exhausted(wanted, free)),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Empties the session into KV with `positions` reserved, for a
    /// truncated history to be re-prefilled (RoPE bakes positions into K, so
    /// the kept window must be recomputed). The [`Undo`] puts the session
    /// back if the call stops before the window is in.
    ///
    /// Validate, reserve, then mutate: fresh pages are reserved NEXT to the
    /// session's own (evicting idle sessions as needed) and swapped in only
    /// once had; the old ones are kept until the window is in. Only when
    /// that cannot be had even by evicting everything idle, but the
    /// session's own pages plus the free ones would do, are its pages given
    /// back and reserved again; with one worker nothing can take them in
    /// between, and if another worker does, the session is removed (counted
    /// as failed) rather than left silently empty. `Err` otherwise means
    /// nothing changed (and nothing was evicted for it); `Later` means
    /// another worker was asked to evict.
    fn restart_kv(&mut self, id: SessionId, positions: usize) -> Result<Restarted, RuntimeError> {
        loop {
            let mut fresh = SessionKv::new(Arc::clone(&self.kv_pool));
            match fresh.reserve(positions) {
                Ok(()) => {
                    let slot = self.sessions.get_mut(&id).ok_or(RuntimeError::NotFound)?;
                    let kv = std::mem::replace(&mut slot.kv, fresh);
                    let undo = Undo {
                        kind: UndoKind::SwapBack {
                            kv,
                            history: std::mem::take(&mut slot.history),
                        },
                        next_logits: std::mem::take(&mut slot.next_logits),
                        truncated: slot.truncated,
                    };
                    slot.logits_digest.set(None);
                    slot.high_water = 0;
                    slot.short_since = None;
                    return Ok(Restarted::Now(undo));
                }
                Err(KvError::Exhausted { wanted, free }) => {
                    let own = self
                        .sessions
                        .get(&id)
                        .ok_or(RuntimeError::NotFound)?
                        .kv
                        .pages_held();
                    let evictable = self.evictable_pages(id);
                    let fresh_can_fit = free.saturating_add(evictable) >= wanted;
                    if !fresh_can_fit && free + own >= wanted {
                        self.clear_short(id);
                        return self.restart_in_place(id, positions, wanted, free);
                    }
                    if !fresh_can_fit && (free + own).saturating_add(evictable) < wanted {
                        self.clear_short(id);
                        return Err(kv_exhausted(wanted, free));
                    }
                    match self.room_for(id) {
                        Wait::Retry => {}
                        Wait::Later => return Ok(Restarted::Later),
                        Wait::GiveUp => return self.restart_in_place(id, positions, wanted, free),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The last resort of [`Worker::restart_kv`]: reuse the session's own
    /// pages when they and the free ones cover `wanted`.
    fn restart_in_place(
        &mut self,
        id: SessionId,
        positions: usize,
        wanted: usize,
        free: usize,
    ) -> Result<Restarted, RuntimeError> {
        let slot = self.sessions.get_mut(&id).ok_or(RuntimeError::NotFound)?;
        if wanted > free + slot.kv.pages_held() {
            return Err(kv_exhausted(wanted, free));
        }
        slot.kv.release()?;
        let undo = Undo {
            kind: UndoKind::Recompute {
                history: std::mem::take(&mut slot.history),
            },
            next_logits: std::mem::take(&mut slot.next_logits),
            truncated: slot.truncated,
        };
        slot.logits_digest.set(None);
        slot.high_water = 0;
        match slot.kv.reserve(positions) {
            Ok(()) => Ok(Restarted::Now(undo)),
            Err(e) => {
                let err = match e {
                    KvError::Exhausted { wanted, free } => kv_exhausted(wanted, free),
                    e => e.into(),
                };
                tracing::warn!(session = %id, "pages taken while truncating: {err}");
                self.fail_session(id, err.clone());
                Err(err)
            }
        }
    }

    /// Puts a session back as `undo` says, after its call stopped halfway.
    /// When its pages were given back for an in-place truncation, the old
    /// history is queued to be fed again as the session's next work.
    fn apply_undo(&mut self, id: SessionId, undo: Undo) -> Result<(), RuntimeError> {
        let slot = self.sessions.get_mut(&id).ok_or(RuntimeError::NotFound)?;
        slot.feed.clear();
        slot.truncated = undo.truncated;
        slot.logits_digest.set(None);
        match undo.kind {
            UndoKind::Shorten(len) => {
                slot.history.truncate(len);
                slot.kv.roll_back_to(len)?;
                slot.next_logits = undo.next_logits;
            }
            UndoKind::SwapBack { kv, history } => {
                let mut partial = std::mem::replace(&mut slot.kv, kv);
                slot.history = history;
                slot.next_logits = undo.next_logits;
                partial.release()?;
            }
            UndoKind::Recompute { history } => {
                slot.kv.release()?;
                slot.history.clear();
                slot.next_logits.clear();
                slot.kv.reserve(history.len()).map_err(|e| match e {
                    KvError::Exhausted { wanted, free } => kv_exhausted(wanted, free),
                    e => e.into(),
                })?;
                slot.active = Some(Active {
                    work: Work::Restore,
                    pending: history,
                    fed: 0,
                    prefill_started: Instant::now(),
                    undo: None,
                });
            }
        }
        // The one deliberate decrease of the committed length (INV-2).
        slot.high_water = slot.kv.len();
        // What the layers hold beyond the pages (the shards' copies) no
        // longer matches.
        self.runner.release(id);
        Ok(())
    }

    /// Stops the session's call (deadline, cancel): undoes a prompt it had
    /// not finished feeding, then answers it.
    fn abandon(&mut self, id: SessionId, end: Result<StopReason, RuntimeError>) {
        let Some(slot) = self.sessions.get_mut(&id) else {
            return;
        };
        slot.last_used = Instant::now();
        let Some(mut active) = slot.active.take() else {
            return;
        };
        let undone = match active.undo.take() {
            Some(undo) => self.apply_undo(id, undo),
            None => Ok(()),
        };
        // A session being restored will hold its old history again.
        let history_length = self.sessions.get(&id).map_or(0, |s| match &s.active {
            Some(Active {
                work: Work::Restore,
                pending,
                ..
            }) => pending.len(),
            _ => s.history.len(),
        }) as u64;
        match active.work {
            Work::Append { reply, .. } => {
                let err = end.err().unwrap_or(RuntimeError::DeadlineExceeded);
                let _ = reply.send(Err(err));
            }
            Work::Generate(gen) => self.end_generate(id, gen, end, history_length),
            Work::Restore => {}
        }
        if let Err(e) = undone {
            tracing::error!(session = %id, "undoing a stopped call: {e}");
            self.fail_session(id, e);
        }
    }

    fn sweep_if_due(&mut self) {
        let every = (self.cfg.idle_ttl / 4).clamp(Duration::from_millis(1), Duration::from_secs(1));
        if self.last_sweep.elapsed() < every {
            return;
        }
        self.last_sweep = Instant::now();
        let ttl = self.cfg.idle_ttl;
        let expired: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.idle() && s.last_used.elapsed() >= ttl)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.remove(id, Removal::Ttl);
        }
    }

    /// One turn: start queued operations, run one batched forward, emit.
    /// Returns whether anything moved.
    pub(crate) fn step(&mut self) -> bool {
        let ids: Vec<SessionId> = self.sessions.keys().copied().collect();
        let mut moved = false;
        for &id in &ids {
            moved |= self.start_next(id);
        }
        for &id in &ids {
            moved |= self.plan(id);
        }
        self.sample_planned();
        moved | self.run_batch()
    }

    /// Samples the next token of every session `plan` queued, as one batch
    /// (one GPU dispatch on the wgpu sampler), and feeds each its token.
    fn sample_planned(&mut self) {
        if self.to_sample.is_empty() {
            return;
        }
        let mut requests = Vec::with_capacity(self.to_sample.len());
        for id in &self.to_sample {
            let Some(slot) = self.sessions.get(id) else {
                continue;
            };
            let Some(Active {
                work: Work::Generate(gen),
                ..
            }) = slot.active.as_ref()
            else {
                continue;
            };
            requests.push((
                *id,
                SampleRequest {
                    logits: &slot.next_logits,
                    params: &gen.params,
                    history: &slot.history,
                    position: slot.history.len() as u64,
                    top_logprobs: gen.top_logprobs,
                },
            ));
        }
        let rows: Vec<SampleRequest<'_>> = requests.iter().map(|(_, r)| *r).collect();
        self.sampler.sample_batch(&rows, &mut self.sampled);
        let ids: Vec<SessionId> = requests.iter().map(|(id, _)| *id).collect();
        drop(rows);
        drop(requests);
        self.to_sample.clear();
        let mut sampled = std::mem::take(&mut self.sampled);
        for (id, result) in ids.into_iter().zip(sampled.iter_mut()) {
            match result {
                Ok(sampled) => {
                    if let Some(slot) = self.sessions.get_mut(&id) {
                        slot.feed.push(sampled.token);
                        slot.feed_logits = LogitsWanted::Last;
                        if let Some(Active {
                            work: Work::Generate(gen),
                            ..
                        }) = slot.active.as_mut()
                        {
                            gen.pending_logprobs = sampled.logprobs.take();
                        }
                    }
                }
                Err(e) => self.finish_generate(id, Err(e.clone().into())),
            }
        }
        self.sampled = sampled;
    }

    /// Starts the session's next queued operation if it is free.
    fn start_next(&mut self, id: SessionId) -> bool {
        let mut moved = false;
        loop {
            let Some(slot) = self.sessions.get_mut(&id) else {
                return moved;
            };
            let now = Instant::now();
            // Expired waiters leave the queue wherever they stand, even
            // behind a running operation.
            let mut i = 0;
            while i < slot.queue.len() {
                if slot.queue[i].deadline.is_some_and(|d| d <= now) {
                    if let Some(q) = slot.queue.remove(i) {
                        q.op.fail(RuntimeError::DeadlineExceeded);
                        // Its wait for room (if it was waiting) ends too.
                        slot.short_since = None;
                        moved = true;
                    }
                } else {
                    i += 1;
                }
            }
            if slot.active.is_some() {
                return moved;
            }
            let Some(queued) = slot.queue.pop_front() else {
                return moved;
            };
            slot.last_used = now;
            match self.begin(id, queued) {
                Some(waiting) => {
                    // Waiting for another worker's eviction: back to the
                    // head of the queue, unchanged.
                    if let Some(slot) = self.sessions.get_mut(&id) {
                        slot.queue.push_front(waiting);
                    }
                    return moved;
                }
                None => moved = true,
            }
        }
    }

    /// Starts (or ends at once) one operation; hands it back when it must
    /// wait for room.
    fn begin(&mut self, id: SessionId, queued: Queued) -> Option<Queued> {
        let Queued { op, deadline } = queued;
        match op {
            Op::Close { reply } => {
                let len = self.sessions.get(&id).map_or(0, |s| s.history.len()) as u64;
                self.remove(id, Removal::Close);
                let _ = reply.send(Ok(CloseReply {
                    final_history_length: len,
                }));
                None
            }
            Op::Append { tokens, reply } => match self.start_append(id, &tokens) {
                Ok(Begin::Later) => Some(Queued {
                    op: Op::Append { tokens, reply },
                    deadline,
                }),
                Ok(Begin::Empty) => {
                    let len = self.sessions.get(&id).map_or(0, |s| s.history.len());
                    let _ = reply.send(Ok(AppendReply {
                        history_length: len as u64,
                        dropped_token_count: 0,
                    }));
                    None
                }
                Ok(Begin::Prefill {
                    pending,
                    dropped,
                    undo,
                }) => {
                    if let Some(slot) = self.sessions.get_mut(&id) {
                        slot.active = Some(Active {
                            work: Work::Append {
                                reply,
                                dropped,
                                deadline,
                            },
                            pending,
                            fed: 0,
                            prefill_started: Instant::now(),
                            undo: Some(undo),
                        });
                    }
                    None
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                    None
                }
            },
            Op::Generate {
                req,
                events,
                cancel,
            } => match self.start_generate(id, &req, &events, &cancel, deadline) {
                Ok(()) => None,
                Err(e) => {
                    let _ = events.try_send(GenerateEvent::Error(e));
                    None
                }
            },
        }
    }

    /// Validates and reserves an append (truncating first if the policy
    /// says so); nothing changes unless it returns `Prefill`.
    fn start_append(&mut self, id: SessionId, tokens: &[u32]) -> Result<Begin, RuntimeError> {
        let vocab = self.model.config.vocab;
        let context = self.model.config.context;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(RuntimeError::invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        if tokens.is_empty() {
            return Ok(Begin::Empty);
        }
        let len = self
            .sessions
            .get(&id)
            .ok_or(RuntimeError::NotFound)?
            .history
            .len();
        if len + tokens.len() <= context {
            if self.reserve(id, len + tokens.len())? == Got::Later {
                return Ok(Begin::Later);
            }
            let slot = self.sessions.get(&id).ok_or(RuntimeError::NotFound)?;
            return Ok(Begin::Prefill {
                pending: tokens.to_vec(),
                dropped: 0,
                undo: Undo {
                    kind: UndoKind::Shorten(len),
                    next_logits: slot.next_logits.clone(),
                    truncated: slot.truncated,
                },
            });
        }
        let OverflowPolicy::Truncate { sink } = self.cfg.overflow else {
            return Err(RuntimeError::invalid(format!(
                "appending {} tokens to a history of {len} exceeds the context of {context}",
                tokens.len()
            )));
        };
        let slot = self.sessions.get(&id).ok_or(RuntimeError::NotFound)?;
        let mut all = slot.history.clone();
        all.extend_from_slice(tokens);
        let kept = keep_window(&all, sink, context);
        let dropped = (all.len() - kept.len()) as u64;
        Ok(match self.restart_kv(id, kept.len())? {
            Restarted::Now(undo) => {
                if let Some(slot) = self.sessions.get_mut(&id) {
                    slot.truncated += dropped;
                }
                Begin::Prefill {
                    pending: kept,
                    dropped,
                    undo,
                }
            }
            Restarted::Later => Begin::Later,
        })
    }

    /// Validates a Generate and makes it the session's active work. The
    /// context is only made room in once it is full (`plan`): `max_tokens`
    /// is a cap, never a reservation.
    fn start_generate(
        &mut self,
        id: SessionId,
        req: &GenerateRequest,
        events: &NotifySender<GenerateEvent>,
        cancel: &Arc<AtomicBool>,
        deadline: Option<Instant>,
    ) -> Result<(), RuntimeError> {
        let vocab = self.model.config.vocab;
        if req.max_tokens == 0 {
            return Err(RuntimeError::invalid("max_tokens must be at least 1"));
        }
        if let Some(bad) = req
            .stop_sequences
            .iter()
            .flatten()
            .find(|&&t| t as usize >= vocab)
        {
            return Err(RuntimeError::invalid(format!(
                "stop sequence token {bad} is outside the vocabulary of {vocab}"
            )));
        }
        if req.stop_sequences.iter().any(|s| s.is_empty()) {
            return Err(RuntimeError::invalid("stop sequences must not be empty"));
        }
        let (params, seed_used) = req.sampling.resolve(vocab)?;
        let slot = self.sessions.get_mut(&id).ok_or(RuntimeError::NotFound)?;
        if slot.history.is_empty() || slot.next_logits.is_empty() {
            return Err(RuntimeError::invalid(
                "cannot generate from an empty history: append tokens first",
            ));
        }
        let started = Instant::now();
        let gen = Generating {
            params,
            seed_used,
            max_tokens: req.max_tokens,
            stop_sequences: req.stop_sequences.clone(),
            generated: Vec::new(),
            events: events.clone(),
            cancel: Arc::clone(cancel),
            deadline,
            started,
            prefill_duration: Duration::ZERO,
            prefill_tokens: 0,
            top_logprobs: req.sampling.top_logprobs as usize,
            pending_logprobs: None,
            shift_dropped: None,
        };
        slot.active = Some(Active {
            work: Work::Generate(Box::new(gen)),
            pending: Vec::new(),
            fed: 0,
            prefill_started: started,
            undo: None,
        });
        Ok(())
    }

    /// Decides what the session feeds this step (a prefill chunk or one
    /// sampled token), or ends its Generate. Returns whether it moved.
    fn plan(&mut self, id: SessionId) -> bool {
        let context = self.model.config.context;
        let Some(slot) = self.sessions.get(&id) else {
            return false;
        };
        let chunk = self.chunk_at(slot.history.len());
        let Some(slot) = self.sessions.get_mut(&id) else {
            return false;
        };
        slot.feed.clear();
        let Some(active) = slot.active.as_mut() else {
            return false;
        };
        // Checked before every prompt chunk and every decode step, so a call
        // stops within one step (undoing a prompt it had not finished).
        if let Some(end) = active.stopped() {
            self.abandon(id, end);
            return true;
        }
        if active.fed < active.pending.len() {
            let end = (active.fed + chunk).min(active.pending.len());
            slot.feed
                .extend_from_slice(&active.pending[active.fed..end]);
            slot.feed_logits = if end == active.pending.len() {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            };
            return true;
        }
        let Work::Generate(gen) = &mut active.work else {
            return false;
        };
        let full = slot.history.len() >= context;
        if full && self.cfg.overflow == OverflowPolicy::Stop {
            self.finish_generate(id, Ok(StopReason::Truncated));
            return true;
        }
        // Room for a token (and its log-probabilities), a `Truncated` when
        // the window shifts, and a terminal event, or the session sits out.
        let room = gen
            .events
            .capacity()
            .map_or(usize::MAX, |c| c.saturating_sub(gen.events.len()));
        if room < 2 + usize::from(full) + usize::from(gen.top_logprobs > 0) {
            return false;
        }
        if full {
            return self.shift_window(id);
        }
        // Pages first: a session waiting for another worker's eviction sits
        // out the step and samples the same token next time.
        let total = slot.history.len() + 1;
        match self.reserve(id, total) {
            Ok(Got::Now) => {}
            Ok(Got::Later) => return false,
            Err(e) => {
                self.finish_generate(id, Err(e));
                return true;
            }
        }
        // The token itself is sampled with the rest of the step's batch.
        self.to_sample.push(id);
        true
    }

    /// The context is full in the middle of a Generate: drop the oldest
    /// tokens after the sink, no more than the rest of the Generate needs
    /// and at most half the window, and re-prefill the kept window before
    /// the next token. `Truncated` is emitted once it is in. Returns
    /// whether the session moved.
    fn shift_window(&mut self, id: SessionId) -> bool {
        let OverflowPolicy::Truncate { sink } = self.cfg.overflow else {
            return false;
        };
        let context = self.model.config.context;
        let Some(slot) = self.sessions.get(&id) else {
            return false;
        };
        let Some(Active {
            work: Work::Generate(gen),
            ..
        }) = slot.active.as_ref()
        else {
            return false;
        };
        let still_wanted = (gen.max_tokens as usize).saturating_sub(gen.generated.len());
        let half_window = (context.saturating_sub(sink) / 2).max(1);
        let shift = still_wanted.clamp(1, half_window);
        let kept = keep_window(&slot.history, sink, context.saturating_sub(shift));
        let dropped = (slot.history.len() - kept.len()) as u64;
        let undo = match self.restart_kv(id, kept.len()) {
            Ok(Restarted::Now(undo)) => undo,
            Ok(Restarted::Later) => return false,
            Err(e) => {
                self.finish_generate(id, Err(e));
                return true;
            }
        };
        let Some(slot) = self.sessions.get_mut(&id) else {
            return true;
        };
        slot.truncated += dropped;
        if let Some(active) = slot.active.as_mut() {
            if let Work::Generate(gen) = &mut active.work {
                gen.shift_dropped = Some(dropped);
                gen.prefill_tokens += kept.len() as u64;
            }
            active.pending = kept;
            active.fed = 0;
            active.prefill_started = Instant::now();
            active.undo = Some(undo);
        }
        true
    }

    /// How many prompt tokens a session at `depth` feeds this step: as many
    /// as fit the step budget by the recent cost per token (attention makes
    /// a token deeper in the history dearer), at most `prefill_chunk`.
    fn chunk_at(&self, depth: usize) -> usize {
        let most = self.cfg.prefill_chunk.max(1);
        let Some(ns) = self.ns_per_weighted_token else {
            return most;
        };
        let budget = self.cfg.prefill_step_budget.as_nanos() as f64;
        let fits = budget / (ns * depth_weight(depth)).max(1.0);
        (fits as usize).clamp(1, most)
    }

    /// Learns the cost per depth-weighted token from a step that took
    /// `elapsed` to feed `feeds` (tokens, depth before them).
    fn learn_step_cost(&mut self, elapsed: Duration, feeds: &[(usize, usize)]) {
        let weighted: f64 = feeds
            .iter()
            .map(|&(tokens, depth)| tokens as f64 * depth_weight(depth + tokens / 2))
            .sum();
        if weighted <= 0.0 {
            return;
        }
        let sample = elapsed.as_nanos() as f64 / weighted;
        self.ns_per_weighted_token = Some(match self.ns_per_weighted_token {
            // Recent steps count most; one odd step moves it only so far.
            Some(ns) => 0.7 * ns + 0.3 * sample,
            None => sample,
        });
    }

    /// Ends the session's Generate with a stop reason or an error.
    fn finish_generate(&mut self, id: SessionId, end: Result<StopReason, RuntimeError>) {
        let Some(slot) = self.sessions.get_mut(&id) else {
            return;
        };
        slot.last_used = Instant::now();
        let history_length = slot.history.len() as u64;
        let Some(active) = slot.active.take() else {
            return;
        };
        let Work::Generate(gen) = active.work else {
            slot.active = Some(active);
            return;
        };
        self.end_generate(id, gen, end, history_length);
    }

    /// Sends a Generate's terminal event.
    fn end_generate(
        &mut self,
        id: SessionId,
        gen: Box<Generating>,
        end: Result<StopReason, RuntimeError>,
        history_length: u64,
    ) {
        if matches!(end, Ok(StopReason::Cancelled)) {
            self.runner.cancel(id);
        }
        let event = match end {
            Ok(stop_reason) => GenerateEvent::Done(GenerateDone {
                stop_reason,
                generated_token_count: gen.generated.len() as u32,
                prefill_duration: gen.prefill_duration,
                prefill_token_count: gen.prefill_tokens,
                total_duration: gen.started.elapsed(),
                seed_used: gen.seed_used,
                history_length,
            }),
            Err(e) => GenerateEvent::Error(e),
        };
        // Room for it was checked before the last token; a gone reader is fine.
        let _ = gen.events.try_send(event);
    }

    /// Runs one forward over every planned feed and applies the results.
    fn run_batch(&mut self) -> bool {
        let mut ids = Vec::new();
        let mut feeds = Vec::new();
        let mut fed = Vec::new();
        for (id, slot) in self.sessions.iter_mut() {
            if !slot.feed.is_empty() {
                ids.push(*id);
                fed.push((slot.feed.len(), slot.history.len()));
                feeds.push(StepFeed {
                    session: *id,
                    history: &slot.history,
                    kv: &mut slot.kv,
                    tokens: &slot.feed,
                    logits: slot.feed_logits,
                });
            }
        }
        if feeds.is_empty() {
            return false;
        }
        let started = Instant::now();
        let result = self
            .runner
            .forward(&mut feeds, &self.compute, &mut self.scratch);
        drop(feeds);
        self.learn_step_cost(started.elapsed(), &fed);
        self.count_step(ids.len());
        match result {
            Ok(rows) => self.commit_batch(ids, &rows),
            Err(StepError::SessionsLost(err)) => {
                tracing::error!(worker = self.index, "batched forward failed: {err}");
                for id in ids {
                    self.fail_session(id, err.clone());
                }
            }
            Err(StepError::NothingCommitted(err)) => {
                for id in ids {
                    self.fail_step(id, err.clone());
                }
            }
        }
        true
    }

    /// The step gauges, after a batch of `sequences` went through.
    fn count_step(&self, sequences: usize) {
        let g = &self.gauges;
        g.steps.fetch_add(1, Ordering::Relaxed);
        g.last_batch_sequences
            .store(sequences as u64, Ordering::Relaxed);
        g.max_batch_sequences
            .fetch_max(sequences as u64, Ordering::Relaxed);
    }

    /// A step that committed nothing failed for `id`: its call fails with
    /// `err`, and whatever the call had fed is undone (remote layers
    /// rebuild the session at its next step). Only a restore of a history
    /// whose pages were given back cannot be undone: that session goes.
    fn fail_step(&mut self, id: SessionId, err: RuntimeError) {
        let Some(slot) = self.sessions.get_mut(&id) else {
            return;
        };
        slot.feed.clear();
        slot.last_used = Instant::now();
        let Some(mut active) = slot.active.take() else {
            return;
        };
        if matches!(active.work, Work::Restore) {
            let removed = match err {
                RuntimeError::Shard { status, message } => RuntimeError::Shard {
                    status,
                    message: format!(
                        "{message}; the session was removed (its history was being fed again)"
                    ),
                },
                other => other,
            };
            return self.fail_session(id, removed);
        }
        if let Some(undo) = active.undo.take() {
            if let Err(e) = self.apply_undo(id, undo) {
                finish_with_error(active, err);
                return self.fail_session(id, e);
            }
        }
        finish_with_error(active, err);
    }

    /// Applies a successful step's results to its sessions.
    fn commit_batch(&mut self, ids: Vec<SessionId>, rows: &LogitRows) {
        let vocab = self.model.config.vocab;
        for (i, id) in ids.into_iter().enumerate() {
            let Some(slot) = self.sessions.get_mut(&id) else {
                continue;
            };
            let fed = std::mem::take(&mut slot.feed);
            slot.history.extend_from_slice(&fed);
            if slot.feed_logits != LogitsWanted::None {
                if let Some(r) = rows.per_sequence.get(i).and_then(|r| r.end.checked_sub(1)) {
                    slot.next_logits.clear();
                    slot.logits_digest.set(None);
                    slot.next_logits
                        .extend_from_slice(&self.scratch.logits[r * vocab..][..vocab]);
                }
            }
            slot.feed = fed;
            if let Err(e) = self.check_invariants(id) {
                self.fail_session(id, e);
                continue;
            }
            self.after_feed(id);
            self.settle_kv(id);
        }
    }

    /// Once a session's call can no longer be undone (its prompt is all in,
    /// or it has none), gives back the KV pages its sliding-window layers
    /// will not read again.
    fn settle_kv(&mut self, id: SessionId) {
        let Some(slot) = self.sessions.get_mut(&id) else {
            return;
        };
        if slot.active.as_ref().is_some_and(|a| a.undo.is_some()) {
            return;
        }
        if let Err(e) = slot.kv.settle() {
            tracing::error!(session = %id, "giving back window pages: {e}");
            self.fail_session(id, e.into());
        }
    }

    /// INV-1 (cached positions = history length, within the pages held) and
    /// INV-2 (the committed length never went down).
    fn check_invariants(&mut self, id: SessionId) -> Result<(), RuntimeError> {
        let Some(slot) = self.sessions.get_mut(&id) else {
            return Err(RuntimeError::NotFound);
        };
        let counters = &self.shared.counters;
        let kv_len = slot.kv.len();
        if kv_len < slot.high_water {
            slot.inv2_violations += 1;
            counters.inv2_violations.fetch_add(1, Ordering::Relaxed);
            return Err(RuntimeError::FailedPrecondition(format!(
                "INV-2: KV length went from {} down to {kv_len}",
                slot.high_water
            )));
        }
        if kv_len != slot.history.len() || kv_len > slot.kv.capacity() {
            slot.inv1_violations += 1;
            counters.inv1_violations.fetch_add(1, Ordering::Relaxed);
            return Err(RuntimeError::FailedPrecondition(format!(
                "INV-1: {kv_len} cached positions for a history of {} ({} reserved)",
                slot.history.len(),
                slot.kv.capacity()
            )));
        }
        slot.high_water = kv_len;
        Ok(())
    }

    /// Removes a session whose call failed, telling every waiter.
    fn fail_session(&mut self, id: SessionId, err: RuntimeError) {
        if let Some(mut slot) = self.remove(id, Removal::Failed) {
            if let Some(active) = slot.active.take() {
                finish_with_error(active, err.clone());
            }
            for q in slot.queue.drain(..) {
                q.op.fail(RuntimeError::NotFound);
            }
        }
    }

    /// Bookkeeping after the session's feed went through the model.
    fn after_feed(&mut self, id: SessionId) {
        let Some(slot) = self.sessions.get_mut(&id) else {
            return;
        };
        let n_fed = slot.feed.len();
        let last = slot.feed.last().copied();
        slot.feed.clear();
        let history_length = slot.history.len() as u64;
        let eos_hit = last.is_some_and(|t| slot.eos.contains(&t));
        let Some(active) = slot.active.as_mut() else {
            return;
        };
        let counters = &self.shared.counters;
        if active.fed < active.pending.len() {
            active.fed += n_fed;
            counters
                .prefill_tokens
                .fetch_add(n_fed as u64, Ordering::Relaxed);
            if active.fed < active.pending.len() {
                return;
            }
            active.pending = Vec::new();
            active.fed = 0;
            // All in: from here on the call's effect stands.
            active.undo = None;
            let took = active.prefill_started.elapsed();
            counters.prefill_duration.observe(took);
            match &mut active.work {
                Work::Append { .. } | Work::Restore => {
                    slot.last_used = Instant::now();
                    if let Some(Active {
                        work: Work::Append { reply, dropped, .. },
                        ..
                    }) = slot.active.take()
                    {
                        let _ = reply.send(Ok(AppendReply {
                            history_length,
                            dropped_token_count: dropped,
                        }));
                    }
                }
                Work::Generate(gen) => {
                    gen.prefill_duration += took;
                    if let Some(dropped) = gen.shift_dropped.take() {
                        // Room for it was checked when the shift began.
                        let _ = gen.events.try_send(GenerateEvent::Truncated {
                            dropped_token_count: dropped,
                        });
                    }
                }
            }
            return;
        }
        let Work::Generate(gen) = &mut active.work else {
            return;
        };
        let Some(token) = last else {
            return;
        };
        gen.generated.push(token);
        counters.tokens_generated.fetch_add(1, Ordering::Relaxed);
        self.gauges.tokens_generated.fetch_add(1, Ordering::Relaxed);
        let second = self.shared.epoch.elapsed().as_secs();
        self.gauges.decode_rate.record(second, 1);
        if let Err(TrySendError::Disconnected(_)) = gen.events.try_send(GenerateEvent::Token(token))
        {
            return self.finish_generate(id, Ok(StopReason::Cancelled));
        }
        if let Some(logprobs) = gen.pending_logprobs.take() {
            if let Err(TrySendError::Disconnected(_)) =
                gen.events.try_send(GenerateEvent::Logprobs(logprobs))
            {
                return self.finish_generate(id, Ok(StopReason::Cancelled));
            }
        }
        let stop = if eos_hit {
            Some(StopReason::Eos)
        } else if let Some(index) = gen
            .stop_sequences
            .iter()
            .position(|s| gen.generated.ends_with(s))
        {
            Some(StopReason::StopSequence {
                index: index as u32,
            })
        } else if gen.generated.len() >= gen.max_tokens as usize {
            Some(StopReason::MaxTokens)
        } else {
            None
        };
        if let Some(stop) = stop {
            self.finish_generate(id, Ok(stop));
        }
    }
}

fn finish_with_error(active: Active, err: RuntimeError) {
    match active.work {
        Work::Append { reply, .. } => drop(reply.send(Err(err))),
        Work::Generate(gen) => drop(gen.events.try_send(GenerateEvent::Error(err))),
        Work::Restore => {}
    }
}

impl Active {
    /// Why the call must stop before its next step, if it must: a cancelled
    /// Generate, or a deadline that passed. A restore never stops.
    fn stopped(&self) -> Option<Result<StopReason, RuntimeError>> {
        let now = Instant::now();
        match &self.work {
            Work::Append { deadline, .. } => deadline
                .is_some_and(|d| d <= now)
                .then_some(Err(RuntimeError::DeadlineExceeded)),
            Work::Generate(gen) => {
                if gen.cancel.load(Ordering::Acquire) {
                    Some(Ok(StopReason::Cancelled))
                } else if gen.deadline.is_some_and(|d| d <= now) {
                    Some(Err(RuntimeError::DeadlineExceeded))
                } else {
                    None
                }
            }
            Work::Restore => None,
        }
    }
}

/// How much dearer a prompt token at `depth` is than one at the start of
/// the history, roughly: attention over the positions before it grows with
/// the depth while the weights' share stays fixed. Only sizes chunks, so
/// it need not be exact.
fn depth_weight(depth: usize) -> f64 {
    const DEPTH_OF_EQUAL_COST: f64 = 2048.0;
    1.0 + depth as f64 / DEPTH_OF_EQUAL_COST
}

/// The first `sink` tokens plus the most recent ones, `keep` in all.
fn keep_window(history: &[u32], sink: usize, keep: usize) -> Vec<u32> {
    if history.len() <= keep {
        return history.to_vec();
    }
    let sink = sink.min(keep);
    let mut kept = history[..sink].to_vec();
    kept.extend_from_slice(&history[history.len() - (keep - sink)..]);
    kept
}

/// FNV-1a over the bits of `values`.
fn digest(values: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in values {
        for b in v.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::super::notify;
    use super::*;
    use crate::gguf::synthetic::SyntheticLlama;
    use crate::gguf::GgufFile;
    use crate::kv::KvPoolConfig;
    use crate::runtime::Layers;

    fn worker() -> Worker {
        worker_with_pages(8)
    }

    /// A worker whose pool holds `pages` pages of 16 positions over every
    /// layer.
    fn worker_with_pages(pages: usize) -> Worker {
        let file = GgufFile::from_bytes(SyntheticLlama::tiny().build()).expect("parses");
        let model = Arc::new(Model::from_gguf(Arc::new(file)).expect("loads"));
        let layout = model.kv_layout(model.config.n_layers, 16);
        let config = KvPoolConfig::anonymous(layout, pages * model.config.n_layers);
        let pool = Arc::new(KvPool::new(config).expect("pool"));
        let (wake, _) = crossbeam_channel::bounded(1);
        let runner = crate::runtime::LocalLayers
            .runner(0, &model, &RuntimeConfig::default())
            .expect("runner");
        Worker::new(
            0,
            model,
            runner,
            pool,
            RuntimeConfig::default(),
            Arc::new(WorkersState::new(vec![wake])),
            Arc::new(WorkerGauges::default()),
        )
        .expect("worker")
    }

    fn new_session(w: &mut Worker) -> SessionId {
        let id = SessionId::random().expect("id");
        let (tx, rx) = notify::channel(1);
        w.handle(Command::Create {
            id,
            req: CreateSession::default(),
            reply: tx,
            deadline: None,
        });
        rx.recv().expect("reply").expect("created")
    }

    fn append(w: &mut Worker, id: SessionId, tokens: &[u32]) -> Result<AppendReply, RuntimeError> {
        let (tx, rx) = notify::channel(1);
        w.handle(Command::Enqueue {
            id,
            op: Op::Append {
                tokens: tokens.to_vec(),
                reply: tx,
            },
            deadline: None,
        });
        for _ in 0..100 {
            if let Ok(r) = rx.try_recv() {
                return r;
            }
            w.step();
        }
        Err(RuntimeError::Internal("no reply".into()))
    }

    #[test]
    fn a_prefill_is_fed_in_chunks_one_step_each() {
        let mut w = worker();
        w.cfg.prefill_chunk = 4;
        let id = new_session(&mut w);
        let (tx, rx) = notify::channel(1);
        w.handle(Command::Enqueue {
            id,
            op: Op::Append {
                tokens: (1..=10).collect(),
                reply: tx,
            },
            deadline: None,
        });
        let mut lengths = Vec::new();
        while rx.is_empty() {
            w.step();
            lengths.push(w.sessions[&id].history.len());
        }
        assert_eq!(lengths, vec![4, 8, 10]);
        assert_eq!(rx.recv().expect("reply").expect("ok").history_length, 10);
    }

    /// History, logits digest and pages of a session: what an undone call
    /// must leave as it found it.
    fn snapshot(w: &Worker, id: SessionId) -> (Vec<u32>, u64, usize, usize) {
        let slot = &w.sessions[&id];
        (
            slot.history.clone(),
            digest(&slot.next_logits),
            slot.kv.len(),
            slot.kv.pages_held(),
        )
    }

    #[test]
    fn an_append_past_its_deadline_is_undone_before_the_next_chunk() {
        let mut w = worker();
        w.cfg.prefill_chunk = 4;
        let id = new_session(&mut w);
        append(&mut w, id, &[1, 2, 3]).expect("append");
        let before = snapshot(&w, id);
        let free = w.kv_pool.free_pages();
        let (tx, rx) = notify::channel(1);
        w.handle(Command::Enqueue {
            id,
            op: Op::Append {
                tokens: (10..40).collect(),
                reply: tx,
            },
            deadline: Some(Instant::now() + Duration::from_millis(50)),
        });
        w.step();
        w.step();
        assert_eq!(w.sessions[&id].history.len(), 11, "two chunks in");
        std::thread::sleep(Duration::from_millis(60));
        w.step();
        assert_eq!(
            rx.try_recv().expect("answered"),
            Err(RuntimeError::DeadlineExceeded)
        );
        assert_eq!(snapshot(&w, id), before);
        assert_eq!(w.kv_pool.free_pages(), free, "the reserved pages are back");
        assert!(w.sessions[&id].idle());
        // The session goes on exactly as one that never saw the call.
        append(&mut w, id, &[4]).expect("append");
        let twin = new_session(&mut w);
        append(&mut w, twin, &[1, 2, 3, 4]).expect("append");
        assert_eq!(snapshot(&w, id).1, snapshot(&w, twin).1);
    }

    /// Runs a Generate of `max_tokens` until its window shift is halfway
    /// through the kept window, then cancels it.
    fn cancel_in_the_middle_of_a_shift(w: &mut Worker, id: SessionId) -> Vec<GenerateEvent> {
        let (events, rx) = notify::channel(64);
        let cancel = Arc::new(AtomicBool::new(false));
        w.handle(Command::Enqueue {
            id,
            op: Op::Generate {
                req: Box::new(GenerateRequest {
                    id,
                    max_tokens: 40,
                    sampling: Default::default(),
                    stop_sequences: Vec::new(),
                }),
                events,
                cancel: Arc::clone(&cancel),
            },
            deadline: None,
        });
        for _ in 0..200 {
            w.step();
            let shifting = w.sessions[&id]
                .active
                .as_ref()
                .is_some_and(|a| a.fed > 0 && a.fed < a.pending.len());
            if shifting {
                break;
            }
        }
        cancel.store(true, Ordering::Release);
        w.step();
        let mut got = Vec::new();
        while let Ok(e) = rx.try_recv() {
            got.push(e);
        }
        got
    }

    /// A worker with room for two windows and a session two tokens short of
    /// the context, fed in chunks of 8.
    fn two_tokens_short_of_the_context() -> (Worker, SessionId, Vec<u32>) {
        let mut w = worker_with_pages(40);
        w.cfg.prefill_chunk = 8;
        let context = w.model.config.context;
        let id = new_session(&mut w);
        let history: Vec<u32> = (0..context as u32 - 2).map(|i| i % 50 + 1).collect();
        append(&mut w, id, &history).expect("append");
        (w, id, history)
    }

    #[test]
    fn a_generate_cancelled_while_its_window_shifts_keeps_the_old_window() {
        let (mut w, id, history) = two_tokens_short_of_the_context();
        let context = w.model.config.context;
        let events = cancel_in_the_middle_of_a_shift(&mut w, id);
        // Two tokens filled the context; the shift never finished, so it
        // was never reported, and the full history is back.
        let tokens: Vec<u32> = events
            .iter()
            .filter_map(|e| match e {
                GenerateEvent::Token(t) => Some(*t),
                _ => None,
            })
            .collect();
        assert_eq!(tokens.len(), 2, "{events:?}");
        assert!(matches!(
            events.last(),
            Some(GenerateEvent::Done(GenerateDone {
                stop_reason: StopReason::Cancelled,
                ..
            }))
        ));
        assert!(!events
            .iter()
            .any(|e| matches!(e, GenerateEvent::Truncated { .. })));
        let slot = &w.sessions[&id];
        assert_eq!(slot.history.len(), context);
        assert_eq!(slot.history[..context - 2], history[..]);
        assert_eq!(slot.kv.len(), context);
        assert_eq!(slot.truncated, 0);
        assert!(slot.idle());
    }

    #[test]
    fn a_cancelled_shift_in_the_sessions_own_pages_feeds_the_old_history_again() {
        let (mut w, id, _) = two_tokens_short_of_the_context();
        let context = w.model.config.context;
        // Take every free page, so the shift has to reuse the session's own.
        let mut hog = SessionKv::new(Arc::clone(&w.kv_pool));
        let free = w.kv_pool.free_pages() / w.model.config.n_layers;
        hog.reserve(free * 16).expect("the rest of the pool");
        cancel_in_the_middle_of_a_shift(&mut w, id);
        // Its old history (with the two tokens) is being fed again.
        for _ in 0..200 {
            if w.sessions[&id].idle() {
                break;
            }
            w.step();
        }
        let restored = snapshot(&w, id);
        assert_eq!(restored.0.len(), context);
        let twin_history = restored.0.clone();
        drop(hog);
        let twin = new_session(&mut w);
        append(&mut w, twin, &twin_history).expect("append");
        assert_eq!(restored.1, snapshot(&w, twin).1, "bit-identical logits");
    }

    #[test]
    fn an_inv2_violation_fails_the_call_and_frees_the_session() {
        let mut w = worker();
        let id = new_session(&mut w);
        append(&mut w, id, &[1, 2, 3]).expect("append");
        let total = w.kv_pool.total_pages();
        assert!(w.kv_pool.free_pages() < total);
        // Pretend the cache once held more than it does now.
        if let Some(slot) = w.sessions.get_mut(&id) {
            slot.high_water = 10;
        }
        let err = append(&mut w, id, &[4]).expect_err("violation");
        assert_eq!(err.code(), super::super::StatusKind::FailedPrecondition);
        assert!(err.to_string().contains("INV-2"), "{err}");
        assert!(!w.sessions.contains_key(&id));
        assert_eq!(w.shared.counters.inv2_violations.load(Ordering::Relaxed), 1);
        assert_eq!(w.shared.counters.sessions_failed.load(Ordering::Relaxed), 1);
        assert_eq!(w.kv_pool.free_pages(), total);
        assert_eq!(w.shared.live_sessions.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn an_inv1_violation_is_caught_after_the_mutation() {
        let mut w = worker();
        let id = new_session(&mut w);
        append(&mut w, id, &[1, 2, 3]).expect("append");
        if let Some(slot) = w.sessions.get_mut(&id) {
            slot.history.push(7);
        }
        let err = append(&mut w, id, &[4]).expect_err("violation");
        assert!(err.to_string().contains("INV-1"), "{err}");
        assert_eq!(w.shared.counters.inv1_violations.load(Ordering::Relaxed), 1);
        assert_eq!(
            append(&mut w, id, &[5]).expect_err("gone"),
            RuntimeError::NotFound
        );
    }

    #[test]
    fn an_eviction_request_takes_the_lru_idle_session_never_a_busy_one() {
        let mut w = worker();
        let old = new_session(&mut w);
        let newer = new_session(&mut w);
        let busy = new_session(&mut w);
        append(&mut w, old, &[1]).expect("append");
        append(&mut w, newer, &[2]).expect("append");
        append(&mut w, busy, &[3]).expect("append");
        let (tx, _rx) = notify::channel(1);
        w.handle(Command::Enqueue {
            id: busy,
            op: Op::Append {
                tokens: vec![4],
                reply: tx,
            },
            deadline: None,
        });
        w.publish();
        let board = Arc::clone(&w.shared);
        let stamp = |id: SessionId, w: &Worker| w.stamp(w.sessions[&id].last_used);
        assert_eq!(board.board.oldest_idle(0), Some(stamp(old, &w)));
        let tickets = [0, 1, 2].map(|_| board.board.ask(0));
        w.serve_evictions();
        assert!(tickets.iter().all(|&t| board.board.is_answered(t)));
        // Two idle sessions for three requests: both go, the busy one stays.
        assert!(w.sessions.contains_key(&busy));
        assert_eq!(w.sessions.len(), 1);
        assert_eq!(w.shared.counters.evicted_lru.load(Ordering::Relaxed), 2);
        assert_eq!(board.board.oldest_idle(0), None);
    }

    #[test]
    fn the_none_policy_makes_no_room() {
        let mut w = worker();
        w.cfg.eviction = EvictionPolicy::None;
        let idle = new_session(&mut w);
        append(&mut w, idle, &[1]).expect("append");
        assert!(matches!(w.make_room(None), Room::Nothing));
        assert!(w.sessions.contains_key(&idle));
        w.cfg.eviction = EvictionPolicy::Lru;
        assert!(matches!(w.make_room(None), Room::Retry));
        assert!(!w.sessions.contains_key(&idle));
    }

    #[test]
    fn keep_window_keeps_the_sink_and_the_most_recent_tokens() {
        let h: Vec<u32> = (0..10).collect();
        assert_eq!(keep_window(&h, 2, 5), vec![0, 1, 7, 8, 9]);
        assert_eq!(keep_window(&h, 0, 3), vec![7, 8, 9]);
        assert_eq!(keep_window(&h, 9, 3), vec![0, 1, 2]);
        assert_eq!(keep_window(&h, 2, 10), h);
    }

    #[test]
    fn digest_sees_every_bit() {
        assert_ne!(digest(&[0.0]), digest(&[-0.0]));
        assert_ne!(digest(&[1.0, 2.0]), digest(&[2.0, 1.0]));
        assert_eq!(digest(&[1.5]), digest(&[1.5]));
    }
}
