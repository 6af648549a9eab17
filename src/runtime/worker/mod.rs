//! One worker thread: it alone owns its shard of sessions (a plain map, no
//! locks) and its compute context, and runs the step loop.
//!
//! Each turn of the loop: take every waiting command; serve eviction
//! requests from other workers; retry creations waiting for a place; start
//! the next queued operation of each idle session (check what needs the
//! session, reserve KV, then mutate); build ONE batch holding a decode token
//! for every generating session whose stream has room and a prefill chunk
//! for every session with prompt tokens left; run one forward through the
//! worker's [`StepRunner`] (the model here, or the shards); commit, check
//! invariants and emit; publish gauges and the oldest idle session. A
//! session whose reader is slow simply sits out steps; the others go on.
//!
//! When pages or a session place run out, the least recently used idle
//! session over ALL workers is evicted: a local one at once, another
//! worker's by a request on the [`EvictionBoard`]; the operation that needs
//! the room waits in its queue (other sessions go on) until the owner has
//! answered, then tries again.
//!
//! The rooms: [`admission`] (creation, the session FIFO, removal, TTL),
//! [`room`] (pages, eviction, truncation, undo), [`batch`] (plan, forward,
//! commit, invariants) and [`generate`] (sampling, stop conditions,
//! events).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};

use super::board::{EvictionBoard, EvictionTicket};
use super::notify::NotifySender;
use super::session::{
    count_journal_failure, keep_window, read_spill_at_start, Session, Undo, UndoKind,
};
use super::stats::{Counters, WorkerGauges};
use super::step::{StepError, StepRunner};
use super::{
    AppendReply, CloseReply, CreateSession, EvictionPolicy, ForkReply, GenerateDone, GenerateEvent,
    GenerateRequest, OverflowPolicy, RuntimeConfig, RuntimeError, SessionId, SessionInfo,
    StopReason, Tenant,
};
use crate::durable::{Record, Recovered};
use crate::kv::{KvError, KvPool, PrefixIndex, SessionKv};
use crate::model::{LogitRows, LogitsWanted, Model, Scratch};
use crate::sampler::{
    CheckedParams, SampleRequest, Sampled, SamplerBackend, SamplerError, TokenLogprobs,
};
use crate::threads::{CoreGroup, ThreadPool, Wake};
use fork::Forking;

mod admission;
mod batch;
mod fork;
mod generate;
mod room;
#[cfg(test)]
mod tests;

type Reply<T> = NotifySender<Result<T, RuntimeError>>;

/// A message to a worker. Every command that names an existing session
/// carries the caller's tenant, and the worker finds the session only
/// through [`session_for`], which checks it.
pub(crate) enum Command {
    Create {
        id: SessionId,
        /// Who the new session belongs to.
        owner: Tenant,
        req: CreateSession,
        reply: Reply<SessionId>,
        deadline: Option<Instant>,
        /// Never journaled, whatever the state directory (the server's
        /// warm-up session).
        transient: bool,
    },
    /// An operation that joins the session's FIFO.
    Enqueue {
        id: SessionId,
        caller: Tenant,
        op: Op,
        deadline: Option<Instant>,
    },
    Info {
        id: SessionId,
        caller: Tenant,
        reply: Reply<SessionInfo>,
    },
    /// A session read back from the state directory: add it and feed its
    /// history again.
    Restore(Box<Recovered>),
    Shutdown,
}

/// An operation that runs in the session's arrival order.
pub(crate) enum Op {
    Append {
        tokens: Vec<u32>,
        reply: Reply<AppendReply>,
    },
    Generate {
        gen: Box<AdmittedGenerate>,
        events: NotifySender<GenerateEvent>,
        cancel: Arc<AtomicBool>,
    },
    /// The committed history, in the session's order (after what is queued
    /// before it).
    History {
        reply: Reply<Vec<u32>>,
    },
    Close {
        reply: Reply<CloseReply>,
    },
    /// Make session `fork` (drawn for this worker) from this one's first
    /// `at_length` tokens.
    Fork {
        fork: SessionId,
        /// Who the fork belongs to: the caller.
        owner: Tenant,
        at_length: Option<u64>,
        client_label: Option<String>,
        reply: Reply<ForkReply>,
    },
}

impl Op {
    /// Whether the op writes a session's journal (or starts one): new
    /// durable work, which the state directory's limits may refuse.
    fn grows_state(&self) -> bool {
        match self {
            Op::Append { tokens, .. } => !tokens.is_empty(),
            Op::Generate { .. } | Op::Fork { .. } => true,
            Op::History { .. } | Op::Close { .. } => false,
        }
    }

    fn fail(self, err: RuntimeError) {
        // A caller that went away no longer needs the answer.
        match self {
            Op::Append { reply, .. } => drop(reply.send(Err(err))),
            Op::Close { reply } => drop(reply.send(Err(err))),
            Op::History { reply } => drop(reply.send(Err(err))),
            Op::Fork { reply, .. } => drop(reply.send(Err(err))),
            Op::Generate { events, .. } => drop(events.try_send(GenerateEvent::Error(err))),
        }
    }
}

/// A Generate the runtime's boundary accepted: the request, and the
/// sampler parameters checked there once for the whole call.
pub(crate) struct AdmittedGenerate {
    pub(crate) req: GenerateRequest,
    pub(crate) params: CheckedParams,
    pub(crate) seed_used: u64,
}

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

struct Queued {
    op: Op,
    deadline: Option<Instant>,
}

/// A CreateSession waiting for another worker to evict a session.
struct WaitingCreate {
    id: SessionId,
    owner: Tenant,
    req: CreateSession,
    reply: Reply<SessionId>,
    deadline: Option<Instant>,
    since: Instant,
    transient: bool,
}

/// A Generate in progress.
struct Generating {
    params: CheckedParams,
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
    /// The history's length when the call began, and whether a window
    /// shift rewrote it since: what the journal records at the end.
    history_start: usize,
    rewritten: bool,
    /// The history (and truncation count) before the call, kept from its
    /// first window shift on.
    before_rewrite: Option<(Vec<u32>, u64)>,
}

enum Work {
    Append {
        reply: Reply<AppendReply>,
        dropped: u64,
        reused: u64,
        /// Checked before every chunk: past it the append is undone.
        deadline: Option<Instant>,
    },
    Generate(Box<Generating>),
    /// A failed call's truncation gave the session's pages back: its old
    /// history is fed again (bit-identical by INV-3) before anything else
    /// runs on it. Nobody waits for it and nothing cuts it short.
    Restore,
    /// A fork short of its source's end feeds its last token again for the
    /// logits after it; the fork is answered once that is in. Nothing cuts
    /// it short (one token); if the step fails, the fork is removed.
    Fork {
        fork: SessionId,
        reply: Reply<ForkReply>,
    },
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
        /// Tokens mapped from shared pages rather than fed.
        reused: u64,
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

/// A session as its worker schedules it: the session itself, the
/// operation running on it and the ones queued behind, and what this step
/// feeds it.
struct SessionSlot {
    session: Session,
    last_used: Instant,
    active: Option<Active>,
    queue: VecDeque<Queued>,
    /// When the session began waiting for another worker to free pages.
    short_since: Option<Instant>,
    /// What this step feeds for the session.
    feed: Vec<u32>,
    feed_logits: LogitsWanted,
    /// Removed during the operation that holds it (see
    /// [`Worker::with_session`]): it does not go back into the map.
    removed: bool,
}

impl SessionSlot {
    fn new(session: Session) -> Self {
        SessionSlot {
            session,
            last_used: Instant::now(),
            active: None,
            queue: VecDeque::new(),
            short_since: None,
            feed: Vec::new(),
            feed_logits: LogitsWanted::None,
            removed: false,
        }
    }

    /// The committed history's length: a history being fed again (a
    /// restore) counts whole, fed or not.
    fn committed_len(&self) -> usize {
        match &self.active {
            Some(Active {
                work: Work::Restore,
                pending,
                fed,
                ..
            }) => self.session.history().len() + pending.len() - fed,
            _ => self.session.history().len(),
        }
    }

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
        let compute = match &shared.lending {
            Some(group) => group.pool(index),
            None => ThreadPool::new(1),
        };
        Ok(Worker {
            index,
            model,
            kv_pool,
            cfg,
            shared,
            gauges,
            compute,
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
            let Ok(mut next) = self.wait_for_command(&commands, &wake, timeout) else {
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

    /// The next command, or `None` when woken or after `timeout`. While it
    /// waits, the worker lends its core to the other workers' forward
    /// passes (when the runtime lends cores), and leaves their work between
    /// two tasks as soon as a command or a wake arrives.
    fn wait_for_command(
        &self,
        commands: &Receiver<Command>,
        wake: &Receiver<()>,
        timeout: Duration,
    ) -> Result<Option<Command>, crossbeam_channel::RecvError> {
        let select = |timeout: Duration| {
            crossbeam_channel::select! {
                recv(commands) -> got => got.map(Some),
                recv(wake) -> _ => Ok(None),
                default(timeout) => Ok(None),
            }
        };
        let Some(group) = self
            .shared
            .lending
            .as_deref()
            .filter(|_| !timeout.is_zero())
        else {
            return select(timeout);
        };
        let until = Instant::now() + timeout;
        let ready = || !commands.is_empty() || !wake.is_empty();
        group.help(self.index, until, &ready);
        let left = until.saturating_duration_since(Instant::now());
        // Waiting work is taken at once, even while other regions are open.
        if left.is_zero() || ready() {
            return select(Duration::ZERO);
        }
        // A region opened meanwhile: take a turn (nothing to do) and help.
        group.block(self.index, || select(left)).unwrap_or(Ok(None))
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
                self.place_counter(&slot).fetch_sub(1, Ordering::AcqRel);
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
                owner,
                req,
                reply,
                deadline,
                transient,
            } => {
                let waiting = WaitingCreate {
                    id,
                    owner,
                    req,
                    reply,
                    deadline,
                    since: Instant::now(),
                    transient,
                };
                if let Some(w) = self.try_create(waiting) {
                    self.waiting_creates.push_back(w);
                }
            }
            Command::Info { id, caller, reply } => {
                let info = match session_for(&mut self.sessions, id, &caller) {
                    Some(slot) => Ok(admission::info(&*self.runner, slot)),
                    None => Err(RuntimeError::NotFound),
                };
                let _ = reply.send(info);
            }
            Command::Restore(session) => self.restore(*session),
            Command::Enqueue {
                id,
                caller,
                op,
                deadline,
            } => {
                let limit = self.cfg.session_queue;
                let Some(slot) = session_for(&mut self.sessions, id, &caller) else {
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
}

/// The session `id` names, if `caller` may use it: the one way a command
/// finds an existing session. A session of another tenant is `None`, like
/// one that does not exist, so the answer cannot tell the two apart.
fn session_for<'a>(
    sessions: &'a mut HashMap<SessionId, SessionSlot>,
    id: SessionId,
    caller: &Tenant,
) -> Option<&'a mut SessionSlot> {
    sessions
        .get_mut(&id)
        .filter(|slot| caller.may_use(slot.session.owner()))
}

fn finish_with_error(active: Active, err: RuntimeError) {
    match active.work {
        Work::Append { reply, .. } => drop(reply.send(Err(err))),
        Work::Generate(gen) => drop(gen.events.try_send(GenerateEvent::Error(err))),
        Work::Fork { reply, .. } => drop(reply.send(Err(err))),
        Work::Restore => {}
    }
}

impl Active {
    /// Feeding `history` again into a session whose KV it no longer has.
    fn restore(history: Vec<u32>) -> Active {
        Active {
            work: Work::Restore,
            pending: history,
            fed: 0,
            prefill_started: Instant::now(),
            undo: None,
        }
    }

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
            Work::Restore | Work::Fork { .. } => None,
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
