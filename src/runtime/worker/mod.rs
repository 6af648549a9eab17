//! One worker thread: it alone owns its shard of sessions (a plain map, no
//! locks) and its compute context, and runs the step loop.
//!
//! Each turn of the loop: with a session store, renew leases and drop the
//! sessions whose lease moved ([`seat`], [`replica`]); take every waiting command;
//! serve eviction requests from other workers; retry creations waiting for
//! a place; start the next queued operation of each idle session (check
//! what needs the session, reserve KV, then mutate); build ONE batch holding a decode token
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
//! commit, invariants), [`generate`] (sampling, stop conditions,
//! events), [`speculate`] (proposed tokens fed with the sampled one,
//! verified and rolled back), [`draft`] (a draft model's proposals),
//! [`seat`] (the session store's leases and writes) and [`replica`]
//! (take-overs and hand-offs between replicas).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TrySendError};

use super::board::EvictionTicket;
use super::notify::NotifySender;
use super::session::{
    count_journal_failure, keep_window, read_spill_at_start, Session, Undo, UndoKind,
};
use super::stats::{Counters, WorkerGauges};
use super::step::{StepError, StepRunner};
use super::{
    AppendReply, CloseReply, EvictionPolicy, ForkReply, GenerateDone, GenerateEvent,
    OverflowPolicy, RuntimeConfig, RuntimeError, SessionId, SessionInfo, Speculation,
    SpeculationCounts, StopReason, Tenant,
};
use crate::durable::{Record, Recovered};
use crate::kv::{KvError, KvPool, SessionKv};
use crate::model::{LogitRows, LogitsWanted, Model, Scratch};
use crate::sampler::{SampleRequest, Sampled, SamplerBackend, SamplerError};
use crate::speculate::PassTimes;
use crate::threads::ThreadPool;
use commands::Reply;
pub(crate) use commands::{AdmittedGenerate, Command, Op};
pub(crate) use draft::DraftRunner;
use fork::Forking;
pub(crate) use seat::ReplicaSeat;
pub(crate) use shared::WorkersState;
use work::*;

mod admission;
mod batch;
mod commands;
mod draft;
mod fork;
mod generate;
mod replica;
mod restore;
mod room;
mod seat;
mod shared;
mod speculate;
#[cfg(test)]
mod tests;
mod work;

pub(crate) struct Worker {
    index: usize,
    model: Arc<Model>,
    kv_pool: Arc<KvPool>,
    cfg: RuntimeConfig,
    shared: Arc<WorkersState>,
    gauges: Arc<WorkerGauges>,
    compute: ThreadPool,
    scratch: Scratch,
    /// The worker's sampler; none when its runner keeps logits on a device
    /// (the runner's sampler there takes every row).
    sampler: Option<SamplerBackend>,
    /// Sessions whose next token this step samples, in one batch.
    to_sample: Vec<SessionId>,
    /// The batch's answers, reused across steps.
    sampled: Vec<Result<Sampled, SamplerError>>,
    /// A lookup's proposal, or a generating session's history and what
    /// follows it for a verification (reused across steps).
    lookup_history: Vec<u32>,
    /// A constrained verification's mask per proposed row, reused.
    row_masks: Vec<Vec<u32>>,
    /// The draft model, when the runtime drafts and the runner verifies.
    draft: Option<DraftRunner>,
    /// Sessions to draft for this step, and the most each may propose.
    to_draft: Vec<(SessionId, usize)>,
    /// What its steps take by the rows they feed, for sizing proposals.
    pass_times: PassTimes,
    /// While the step's proposals are sized: the rows it feeds so far.
    step_rows: usize,
    sessions: HashMap<SessionId, SessionSlot>,
    /// What runs the layers: the model here, or the shards.
    runner: Box<dyn StepRunner>,
    waiting_creates: VecDeque<WaitingCreate>,
    /// The one eviction this worker has asked another for and not seen
    /// answered.
    evict_wait: Option<EvictionTicket>,
    last_sweep: Instant,
    /// Its part in a replica set: the store's connection and the leases
    /// held (`serve --session-store`).
    replica: Option<ReplicaSeat>,
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
        let sampler = if runner.keeps_logits() {
            None
        } else {
            let sampler = cfg
                .sampler
                .backend(model.config.vocab, model.config.context)
                .map_err(|e| RuntimeError::Internal(format!("worker {index}: {e}")))?;
            Some(sampler)
        };
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
            lookup_history: Vec::new(),
            row_masks: Vec::new(),
            draft: None,
            to_draft: Vec::new(),
            pass_times: PassTimes::default(),
            step_rows: 0,
            sessions: HashMap::new(),
            runner,
            waiting_creates: VecDeque::new(),
            evict_wait: None,
            last_sweep: Instant::now(),
            replica: None,
            ns_per_weighted_token: None,
        })
    }

    /// Drafts with `draft` for the Generates that speculate, if the
    /// runner can verify proposals (else it decodes plainly).
    pub(crate) fn with_draft(mut self, draft: DraftRunner) -> Self {
        if self.runner.verifies_proposals() {
            self.draft = Some(draft);
        }
        self
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
            // Leases first: a worker back from a pause learns which of its
            // sessions moved before it answers anything about them.
            self.replica_upkeep();
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
        self.leave_replica_set();
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
            Command::Info { id, caller, reply } if self.not_here(id) => {
                let call = replica::Call {
                    caller,
                    op: Op::Info { reply },
                    deadline: None,
                    arrived: Instant::now(),
                };
                self.call_elsewhere(id, call);
            }
            Command::Enqueue {
                id,
                caller,
                op,
                deadline,
            } if self.not_here(id) => {
                let call = replica::Call {
                    caller,
                    op,
                    deadline,
                    arrived: Instant::now(),
                };
                self.call_elsewhere(id, call);
            }
            Command::Info { id, caller, reply } => {
                let info = match session_for(&mut self.sessions, id, &caller) {
                    Some(slot) => Ok(admission::info(
                        id,
                        &*self.runner,
                        self.cfg.layers.backend(),
                        slot,
                    )),
                    None => Err(RuntimeError::NotFound),
                };
                let _ = reply.send(info);
            }
            Command::Restore(session) => self.restore(*session),
            Command::HandOff(id) => self.hand_off(id),
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

/// How much dearer a prompt token at `depth` is than one at the start of
/// the history, roughly: attention over the positions before it grows with
/// the depth while the weights' share stays fixed. Only sizes chunks, so
/// it need not be exact.
fn depth_weight(depth: usize) -> f64 {
    const DEPTH_OF_EQUAL_COST: f64 = 2048.0;
    1.0 + depth as f64 / DEPTH_OF_EQUAL_COST
}
