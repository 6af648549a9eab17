//! The [`Runtime`] handle: maps the KV pool, starts the pinned workers,
//! and routes each call to the worker that owns its session. It is the
//! runtime's boundary: every request's arguments are checked here, once,
//! before any worker sees it (a transport only converts).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{bounded, Sender, TrySendError};

use super::notify::NotifySender;
use super::worker::{
    AdmittedGenerate, Command, DraftRunner, Op, ReplicaSeat, Worker, WorkersState,
};
use super::{
    notify, AppendReply, AppendTokens, CloseReply, CreateSession, EvictionPolicy, ForkReply,
    ForkSession, GenerateRequest, GenerateStream, Layers, Pending, ReplicaStats, RuntimeConfig,
    RuntimeError, RuntimeStats, SessionId, SessionInfo, Tenant, WorkerGauges, WorkerStats,
};
use crate::kv::{KvPool, PrefixIndex};
use crate::model::Model;

mod handoff;
mod start;

struct WorkerHandle {
    commands: Sender<Command>,
    gauges: Arc<WorkerGauges>,
    thread: Option<JoinHandle<()>>,
}

/// The running server core. Dropping it stops and joins the workers.
pub struct Runtime {
    workers: Vec<WorkerHandle>,
    kv_page_bytes: u64,
    kv_pool: Arc<KvPool>,
    shared: Arc<WorkersState>,
    next_worker: AtomicUsize,
    draining: AtomicBool,
    cfg: RuntimeConfig,
    /// Tokens in the model's vocabulary: what requests are checked against.
    vocab: usize,
    /// With a session store: the thread hearing other replicas' requests
    /// to let sessions go.
    handoff: Option<handoff::HandoffEar>,
}

impl Runtime {
    /// Bytes one KV page costs: one layer's K and V for a page of
    /// positions, wherever the layers keep them.
    pub fn kv_page_bytes(&self) -> u64 {
        self.kv_page_bytes
    }

    /// Number of worker threads.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// The KV page pool shared by the workers.
    pub fn kv_pool(&self) -> &Arc<KvPool> {
        &self.kv_pool
    }

    /// The configuration in force (after clamping).
    pub fn config(&self) -> &RuntimeConfig {
        &self.cfg
    }

    fn send(&self, worker: usize, cmd: Command) -> Result<(), RuntimeError> {
        if self.draining.load(Ordering::Acquire) {
            return Err(RuntimeError::Unavailable);
        }
        let handle = &self.workers[worker];
        handle.commands.try_send(cmd).map_err(|e| match e {
            TrySendError::Full(_) => RuntimeError::ResourceExhausted {
                what: format!("worker {worker} queue"),
                asked: 1,
                free: 0,
            },
            TrySendError::Disconnected(_) => RuntimeError::Unavailable,
        })
    }

    fn pick_worker(&self) -> usize {
        let n = self.workers.len();
        if self.shared.live_sessions.load(Ordering::Acquire) >= self.cfg.max_sessions {
            // At the limit, the worker holding the oldest idle session can
            // evict it without asking another; failing that, the fullest
            // shard is the likeliest to have one idle by then.
            if self.cfg.eviction == EvictionPolicy::Lru {
                if let Some((worker, _)) = self.shared.board.best_victim(usize::MAX) {
                    return worker;
                }
            }
            return (0..n)
                .max_by_key(|&i| self.workers[i].gauges.sessions.load(Ordering::Relaxed))
                .unwrap_or(0);
        }
        let start = self.next_worker.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|k| (start + k) % n)
            .min_by_key(|&i| self.workers[i].gauges.sessions.load(Ordering::Relaxed))
            .unwrap_or(0)
    }

    /// CreateSession: a fresh, empty session on the least-loaded worker,
    /// owned by `caller`. A request still waiting when `deadline` passes
    /// creates nothing.
    ///
    /// Every call that names a session takes the caller's tenant: the
    /// session's worker answers `NotFound` to a caller the session does not
    /// belong to (CONTRACT §2.10), as for an id it never issued.
    pub fn create_session(
        &self,
        caller: &Tenant,
        req: CreateSession,
        deadline: Option<Instant>,
    ) -> Result<Pending<SessionId>, RuntimeError> {
        self.create(caller, req, deadline, false)
    }

    /// A session that is never journaled, even with a state directory: it
    /// does not survive a restart, and it needs nothing of the disk (the
    /// server's warm-up runs in one, so a full disk does not stop a start).
    pub fn create_transient_session(
        &self,
        caller: &Tenant,
        req: CreateSession,
        deadline: Option<Instant>,
    ) -> Result<Pending<SessionId>, RuntimeError> {
        self.create(caller, req, deadline, true)
    }

    fn create(
        &self,
        caller: &Tenant,
        req: CreateSession,
        deadline: Option<Instant>,
        transient: bool,
    ) -> Result<Pending<SessionId>, RuntimeError> {
        req.validate()?;
        let worker = self.pick_worker();
        let id = self.draw_id(worker)?;
        let (tx, rx) = notify::channel(1);
        self.send(
            worker,
            Command::Create {
                id,
                owner: caller.clone(),
                req,
                reply: tx,
                deadline,
                transient,
            },
        )?;
        Ok(Pending {
            reply: rx,
            deadline,
        })
    }

    /// A fresh session id that worker `worker` owns.
    fn draw_id(&self, worker: usize) -> Result<SessionId, RuntimeError> {
        let n = self.workers.len();
        loop {
            let id = SessionId::random()?;
            if id.worker_index(n) == worker {
                return Ok(id);
            }
        }
    }

    /// ForkSession: runs in the source's queue, after the operations already
    /// waiting there; the fork is made on the source's worker, where its
    /// pages are (any worker could read them, but the source's history and
    /// logits are only consistent between two of its operations, which only
    /// its worker sees). The fork belongs to `caller`, who must be allowed
    /// the source.
    pub fn fork_session(
        &self,
        caller: &Tenant,
        req: ForkSession,
        deadline: Option<Instant>,
    ) -> Result<Pending<ForkReply>, RuntimeError> {
        req.validate()?;
        let worker = req.source.worker_index(self.workers.len());
        let fork = self.draw_id(worker)?;
        self.enqueue(caller, req.source, deadline, |reply| Op::Fork {
            fork,
            owner: caller.clone(),
            at_length: req.at_length,
            client_label: req.client_label,
            reply,
        })
    }

    /// AppendTokens: runs after any operation already queued on the session.
    pub fn append_tokens(
        &self,
        caller: &Tenant,
        req: AppendTokens,
        deadline: Option<Instant>,
    ) -> Result<Pending<AppendReply>, RuntimeError> {
        AppendTokens::check_tokens(&req.tokens, self.vocab)?;
        self.enqueue(caller, req.id, deadline, |reply| Op::Append {
            tokens: req.tokens,
            reply,
        })
    }

    /// Generate: the tokens stream back as [`GenerateEvent`]s.
    pub fn generate(
        &self,
        caller: &Tenant,
        req: GenerateRequest,
        deadline: Option<Instant>,
    ) -> Result<GenerateStream, RuntimeError> {
        let (params, seed_used) = req.admit(self.vocab)?;
        let (tx, rx) = notify::channel(self.cfg.stream_capacity);
        let cancel = Arc::new(AtomicBool::new(false));
        let worker = req.id.worker_index(self.workers.len());
        self.send(
            worker,
            Command::Enqueue {
                id: req.id,
                caller: caller.clone(),
                op: Op::Generate {
                    gen: Box::new(AdmittedGenerate {
                        req,
                        params,
                        seed_used,
                    }),
                    events: tx,
                    cancel: Arc::clone(&cancel),
                },
                deadline,
            },
        )?;
        Ok(GenerateStream {
            events: rx,
            finished: false,
            cancel,
        })
    }

    /// CloseSession: runs after what is already queued, then frees the KV.
    pub fn close_session(
        &self,
        caller: &Tenant,
        id: SessionId,
        deadline: Option<Instant>,
    ) -> Result<Pending<CloseReply>, RuntimeError> {
        self.enqueue(caller, id, deadline, |reply| Op::Close { reply })
    }

    /// The session's committed token history, read in its order: after the
    /// operations already queued on it (the HTTP API's bound sessions).
    pub fn session_history(
        &self,
        caller: &Tenant,
        id: SessionId,
        deadline: Option<Instant>,
    ) -> Result<Pending<Vec<u32>>, RuntimeError> {
        self.enqueue(caller, id, deadline, |reply| Op::History { reply })
    }

    /// Queues the operation `op` makes around its reply channel on session
    /// `id`'s worker, after what is already queued on the session.
    fn enqueue<T>(
        &self,
        caller: &Tenant,
        id: SessionId,
        deadline: Option<Instant>,
        op: impl FnOnce(NotifySender<Result<T, RuntimeError>>) -> Op,
    ) -> Result<Pending<T>, RuntimeError> {
        let (tx, rx) = notify::channel(1);
        self.send(
            id.worker_index(self.workers.len()),
            Command::Enqueue {
                id,
                caller: caller.clone(),
                op: op(tx),
                deadline,
            },
        )?;
        Ok(Pending {
            reply: rx,
            deadline,
        })
    }

    /// GetSessionInfo: answered at once, even while the session is busy.
    pub fn session_info(
        &self,
        caller: &Tenant,
        id: SessionId,
        deadline: Option<Instant>,
    ) -> Result<Pending<SessionInfo>, RuntimeError> {
        let (tx, rx) = notify::channel(1);
        self.send(
            id.worker_index(self.workers.len()),
            Command::Info {
                id,
                caller: caller.clone(),
                reply: tx,
            },
        )?;
        Ok(Pending {
            reply: rx,
            deadline,
        })
    }

    /// Stops taking new requests: every later call is `Unavailable`.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// A snapshot of the counters and gauges (lock-free reads; the
    /// per-worker gauges are as of each worker's last turn).
    pub fn stats(&self) -> RuntimeStats {
        let c = &self.shared.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let now = self.shared.epoch.elapsed().as_secs();
        let prefix = self
            .shared
            .prefix
            .as_ref()
            .map(|index| index.stats())
            .unwrap_or_default();
        let workers: Vec<WorkerStats> = self
            .workers
            .iter()
            .map(|w| {
                let g = &w.gauges;
                let queued_commands = w.commands.len() as u64;
                let queued_ops = load(&g.queued_ops);
                WorkerStats {
                    sessions: load(&g.sessions),
                    queued_commands,
                    queued_ops,
                    queue_depth: queued_commands + queued_ops,
                    last_batch_sequences: load(&g.last_batch_sequences),
                    max_batch_sequences: load(&g.max_batch_sequences),
                    steps: load(&g.steps),
                    tokens_generated: load(&g.tokens_generated),
                    decode_tokens_per_second: g.decode_rate.per_second(now),
                }
            })
            .collect();
        let state = self
            .cfg
            .state
            .as_ref()
            .map(|s| s.budget().stats())
            .unwrap_or_default();
        RuntimeStats {
            sessions_active: self.shared.live_sessions.load(Ordering::Relaxed) as u64,
            sessions_created: load(&c.sessions_created),
            sessions_forked: load(&c.sessions_forked),
            prefix_reused_tokens: load(&c.prefix_reused_tokens),
            sessions_restored: load(&c.sessions_restored),
            restore_kept_tokens: load(&c.restore_kept_tokens),
            restore_pages_rejected: load(&c.restore_pages_rejected),
            restore_digest_mismatches: load(&c.restore_digest_mismatches),
            sessions_spilled: load(&c.sessions_spilled),
            journal_failures: load(&c.journal_failures),
            replica: self.cfg.replica.as_ref().map(|_| ReplicaStats {
                takeovers: load(&c.replica_takeovers),
                takeover_tokens: load(&c.replica_takeover_tokens),
                leases_lost: load(&c.replica_leases_lost),
                handoffs: load(&c.replica_handoffs),
                store_failures: load(&c.replica_store_failures),
            }),
            state_dir_writable: self.cfg.state.as_ref().map(|s| s.health().writable()),
            state_dir_write_failures: self.cfg.state.as_ref().map_or(0, |s| s.health().failures()),
            spilled_now: self.shared.spilled_sessions.load(Ordering::Relaxed) as u64,
            spill_bytes: self.shared.spill_bytes.load(Ordering::Relaxed),
            spill_read_tokens: load(&c.spill_read_tokens),
            restore_refused: load(&c.restore_refused),
            state_bytes: state.used_bytes,
            state_refused_budget: state.refused_budget,
            state_refused_free_space: state.refused_free_space,
            prefix_entries: prefix.entries as u64,
            prefix_cached_pages: prefix.cached_pages as u64,
            kv_used_bytes: self
                .kv_pool
                .total_pages()
                .saturating_sub(self.kv_pool.free_pages()) as u64
                * self.kv_page_bytes,
            sessions_failed: load(&c.sessions_failed),
            evicted_ttl: load(&c.evicted_ttl),
            evicted_lru: load(&c.evicted_lru),
            evicted_close: load(&c.evicted_close),
            inv1_violations: load(&c.inv1_violations),
            inv2_violations: load(&c.inv2_violations),
            tokens_generated: load(&c.tokens_generated),
            speculation_proposed: load(&c.speculation_proposed),
            speculation_accepted: load(&c.speculation_accepted),
            draft_kv_dropped: load(&c.draft_kv_dropped),
            prefill_tokens: load(&c.prefill_tokens),
            prefill_duration: c.prefill_duration.snapshot(),
            kv_live_bytes: self
                .workers
                .iter()
                .map(|w| load(&w.gauges.kv_live_bytes))
                .sum(),
            history_tokens: self
                .workers
                .iter()
                .map(|w| load(&w.gauges.history_tokens))
                .sum(),
            draft_kv_held_bytes: (self.workers.iter())
                .map(|w| load(&w.gauges.draft_kv_held_bytes))
                .sum(),
            draft_kv_pool_bytes: (self.workers.iter())
                .map(|w| load(&w.gauges.draft_kv_pool_bytes))
                .sum(),
            kv_free_pages: self.kv_pool.free_pages() as u64,
            kv_total_pages: self.kv_pool.total_pages() as u64,
            workers,
            shards: self.cfg.layers.shard_stats(),
            logit_rows_read: self.cfg.layers.logit_rows_read(),
            gpu_submissions: self.cfg.layers.gpu_submissions(),
        }
    }

    /// Stops the workers: queued and running calls end with `Unavailable`.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.drain();
        // No more sessions are let go on request: the workers let every
        // one go as they stop.
        self.handoff = None;
        for w in &self.workers {
            // A full queue still sees the disconnect once the sender drops.
            let _ = w.commands.try_send(Command::Shutdown);
        }
        let handles: Vec<_> = self
            .workers
            .iter_mut()
            .filter_map(|w| w.thread.take())
            .collect();
        // Dropping the senders wakes a worker whose queue was full.
        self.workers.iter_mut().for_each(|w| {
            let (dead, _) = bounded(0);
            w.commands = dead;
        });
        for h in handles {
            if h.join().is_err() {
                tracing::error!("a runtime worker panicked");
            }
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop();
    }
}
