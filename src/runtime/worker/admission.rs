//! Admission and the session FIFO: creating sessions (waiting for a place
//! when the limit is reached), starting each idle session's next queued
//! operation (check what needs the session, reserve, then mutate), session
//! info, removal and the TTL sweep.

use super::*;

impl Worker {
    /// Creates the session, or hands the request back to wait for another
    /// worker's eviction. A request whose deadline has passed creates
    /// nothing.
    pub(super) fn try_create(&mut self, w: WaitingCreate) -> Option<WaitingCreate> {
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
        let kv = SessionKv::new(Arc::clone(&self.kv_pool));
        let mut session = Session::new(kv, w.req.client_label, w.req.eos_token_ids, w.owner);
        let store = self.cfg.state.as_ref().filter(|_| !w.transient);
        if let Some(store) = store {
            if let Err(refusal) = store.admit(0) {
                self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
                let _ = w
                    .reply
                    .send(Err(RuntimeError::StateDirFull(refusal.to_string())));
                return None;
            }
            match store.create(id, session.label(), session.eos(), session.owner(), &[]) {
                Ok(journal) => session.attach_journal(journal),
                Err(e) => {
                    self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
                    tracing::error!(session = %id, "cannot start the session's journal: {e}");
                    count_journal_failure(&self.shared.counters);
                    let _ = w
                        .reply
                        .send(Err(RuntimeError::file("the session's journal", &e)));
                    return None;
                }
            }
        }
        if let Some(seat) = self.replica.as_mut().filter(|_| !w.transient) {
            if let Err(e) = seat.create(id, &session, &[], None, &self.shared.counters) {
                self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
                let _ = w.reply.send(Err(e));
                return None;
            }
        }
        self.add_session(id, SessionSlot::new(session));
        self.shared
            .counters
            .sessions_created
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(session = %id, worker = self.index, "session created");
        let _ = w.reply.send(Ok(id));
        None
    }

    /// The count a session's place is in: live, or spilled.
    pub(super) fn place_counter(&self, slot: &SessionSlot) -> &AtomicUsize {
        if slot.session.is_spilled() {
            &self.shared.spilled_sessions
        } else {
            &self.shared.live_sessions
        }
    }

    /// Adds a session that took its place under the limit.
    pub(super) fn add_session(&mut self, id: SessionId, slot: SessionSlot) {
        self.sessions.insert(id, slot);
        self.gauges
            .sessions
            .store(self.sessions.len() as u64, Ordering::Relaxed);
    }

    /// Retries the creations waiting for a place. Returns whether any ended.
    pub(super) fn retry_creates(&mut self) -> bool {
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

    /// Takes one place among the spilled sessions, if one is left.
    pub(super) fn claim_spilled_place(&self) -> bool {
        self.shared
            .spilled_sessions
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.cfg.max_spilled_sessions).then_some(n + 1)
            })
            .is_ok()
    }

    /// Takes one place under the session limit, if one is left.
    pub(super) fn claim_session(&self) -> bool {
        let max = self.cfg.max_sessions;
        self.shared
            .live_sessions
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    /// Runs `op` on session `id`, taken out of the map for as long as the
    /// operation runs: it is looked up once and passed by reference, and
    /// whatever else the operation does (evicting other sessions for room,
    /// adding a fork) can never touch it. A session the operation removed
    /// does not go back; anything still waiting on it hears `NotFound`.
    /// `None` when there is no session `id`.
    pub(super) fn with_session<R>(
        &mut self,
        id: SessionId,
        op: impl FnOnce(&mut Worker, &mut SessionSlot) -> R,
    ) -> Option<R> {
        let mut slot = self.sessions.remove(&id)?;
        let result = op(self, &mut slot);
        if slot.removed {
            if let Some(active) = slot.active.take() {
                finish_with_error(active, RuntimeError::NotFound);
            }
            for q in slot.queue.drain(..) {
                q.op.fail(RuntimeError::NotFound);
            }
        } else {
            self.sessions.insert(id, slot);
        }
        Some(result)
    }

    /// Removes session `id` (not held by an operation) and frees its KV,
    /// counting the reason. Returns whether it was there.
    pub(super) fn remove(&mut self, id: SessionId, reason: Removal) -> bool {
        self.with_session(id, |w, slot| w.remove_slot(id, slot, reason))
            .is_some()
    }

    /// Removes the session an operation holds: its KV, journal and spill
    /// file go, its place is given back and the reason counted.
    pub(super) fn remove_slot(&mut self, id: SessionId, slot: &mut SessionSlot, reason: Removal) {
        if slot.removed {
            return;
        }
        slot.removed = true;
        if let Err(e) = slot.session.release_kv() {
            tracing::error!(session = %id, "freeing KV: {e}");
        }
        let spilled_bytes = slot.session.discard_files(id, self.cfg.state.as_deref());
        self.shared
            .spill_bytes
            .fetch_sub(spilled_bytes, Ordering::Relaxed);
        self.trim_prefix_cache();
        self.runner.release(id);
        self.place_counter(slot).fetch_sub(1, Ordering::AcqRel);
        if let Some(seat) = self.replica.as_mut() {
            seat.leave(id, reason, slot.session.history());
        }
        let c = &self.shared.counters;
        let counter = match reason {
            Removal::Ttl => Some(&c.evicted_ttl),
            Removal::Lru => Some(&c.evicted_lru),
            Removal::Close => Some(&c.evicted_close),
            Removal::Failed => Some(&c.sessions_failed),
            // Counted when the lease was found lost.
            Removal::Moved => None,
            Removal::HandedOff => Some(&c.replica_handoffs),
        };
        if let Some(counter) = counter {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        self.gauges
            .sessions
            .store(self.sessions.len() as u64, Ordering::Relaxed);
        tracing::info!(session = %id, worker = self.index, reason = ?reason, "session removed");
    }

    /// Starts the session's next queued operation if it is free.
    pub(super) fn start_next(&mut self, id: SessionId, slot: &mut SessionSlot) -> bool {
        let mut moved = false;
        while !slot.removed {
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
            // New durable work is refused while the state directory may
            // not grow, before anything (even bringing a spilled session
            // back) is done for it.
            let journaled = slot.session.is_durable();
            if journaled && slot.queue.front().is_some_and(|q| q.op.grows_state()) {
                if let Some(Err(refusal)) = self.cfg.state.as_ref().map(|s| s.admit(0)) {
                    if let Some(q) = slot.queue.pop_front() {
                        q.op.fail(RuntimeError::StateDirFull(refusal.to_string()));
                    }
                    moved = true;
                    continue;
                }
            }
            // A spilled session is fed its history again before any call
            // but a close.
            let needs_kv = slot
                .queue
                .front()
                .is_some_and(|q| !matches!(q.op, Op::Close { .. } | Op::History { .. }));
            if slot.session.is_spilled() && needs_kv {
                match self.unspill(id, slot) {
                    Ok(Got::Now) => {
                        moved = true;
                        continue;
                    }
                    Ok(Got::Later) => return moved,
                    Err(e) => {
                        if let Some(q) = slot.queue.pop_front() {
                            q.op.fail(e);
                        }
                        moved = true;
                        continue;
                    }
                }
            }
            let Some(queued) = slot.queue.pop_front() else {
                return moved;
            };
            slot.last_used = now;
            match self.begin(id, slot, queued) {
                // Waiting for another worker's eviction: back to the head
                // of the queue, unchanged.
                Some(waiting) => {
                    slot.queue.push_front(waiting);
                    return moved;
                }
                None => moved = true,
            }
        }
        moved
    }

    /// Starts (or ends at once) one operation; hands it back when it must
    /// wait for room.
    pub(super) fn begin(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        queued: Queued,
    ) -> Option<Queued> {
        let Queued { op, deadline } = queued;
        match op {
            Op::Close { reply } => {
                let len = slot.session.history().len() as u64;
                // The store's row goes first: a close it did not take
                // fails, and the session stays.
                if let Some(seat) = self.replica.as_mut() {
                    if let Err(e) = seat.close(id, &self.shared.counters) {
                        let _ = reply.send(Err(e));
                        return None;
                    }
                }
                self.remove_slot(id, slot, Removal::Close);
                let _ = reply.send(Ok(CloseReply {
                    final_history_length: len,
                }));
                None
            }
            Op::History { reply } => {
                let _ = reply.send(Ok(slot.session.history().to_vec()));
                None
            }
            Op::Info { reply } => {
                let backend = self.cfg.layers.backend();
                let _ = reply.send(Ok(info(id, &*self.runner, backend, slot)));
                None
            }
            Op::Append { tokens, reply } => match self.start_append(id, slot, &tokens) {
                Ok(Begin::Later) => Some(Queued {
                    op: Op::Append { tokens, reply },
                    deadline,
                }),
                Ok(Begin::Empty) => {
                    let _ = reply.send(Ok(AppendReply {
                        history_length: slot.session.history().len() as u64,
                        dropped_token_count: 0,
                        reused_token_count: 0,
                    }));
                    None
                }
                Ok(Begin::Prefill {
                    pending,
                    dropped,
                    reused,
                    undo,
                }) => {
                    slot.active = Some(Active {
                        work: Work::Append {
                            reply,
                            dropped,
                            reused,
                            deadline,
                        },
                        pending,
                        fed: 0,
                        prefill_started: Instant::now(),
                        undo: Some(undo),
                    });
                    None
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                    None
                }
            },
            Op::Fork {
                fork,
                owner,
                at_length,
                client_label,
                reply,
            } => match self.prepare_fork(id, slot, at_length) {
                Ok(Forking::Later) => Some(Queued {
                    op: Op::Fork {
                        fork,
                        owner,
                        at_length,
                        client_label,
                        reply,
                    },
                    deadline,
                }),
                Ok(Forking::Ready { kv, at }) => {
                    let asked = fork::Asked {
                        fork,
                        owner,
                        client_label,
                        reply,
                    };
                    self.add_fork(id, slot, asked, kv, at);
                    None
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                    None
                }
            },
            Op::Generate {
                gen,
                events,
                cancel,
            } => {
                // Proposals are verified against plain decoding's samples
                // (a constrained call's under each row's own mask).
                let speculate = gen
                    .req
                    .speculate
                    .unwrap_or(self.cfg.speculation != Speculation::None)
                    && self.runner.verifies_proposals();
                // A server that drafts proposes with its draft model; one
                // that does not, or a call asking for speculation from a
                // server that speculates not at all, by lookup.
                let proposer = speculate.then(|| match &self.draft {
                    Some(_) if self.cfg.speculation == Speculation::Draft => Proposer::Draft,
                    _ => Proposer::Lookup(Box::default()),
                });
                if let Err(e) = start_generate(slot, *gen, proposer, &events, &cancel, deadline) {
                    let _ = events.try_send(GenerateEvent::Error(e));
                }
                None
            }
        }
    }

    /// Reserves an append, its tokens checked at the runtime's boundary
    /// (truncating first if the policy says so); nothing changes unless it
    /// returns `Prefill`.
    pub(super) fn start_append(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        tokens: &[u32],
    ) -> Result<Begin, RuntimeError> {
        let context = self.model.config.context;
        if tokens.is_empty() {
            return Ok(Begin::Empty);
        }
        // The undo keeps the logits on the host.
        slot.session.bring_logits_home(id, &*self.runner)?;
        let len = slot.session.history().len();
        if len + tokens.len() <= context {
            // Pages other sessions computed for these tokens first: only
            // the rest is reserved and fed.
            let mapped = room::map_prefix(&self.shared, id, &mut slot.session, tokens);
            match self.reserve(id, slot, len + tokens.len()) {
                Ok(Got::Now) => {}
                Ok(Got::Later) => {
                    self.unmap_prefix(id, slot, len);
                    return Ok(Begin::Later);
                }
                Err(e) => {
                    self.unmap_prefix(id, slot, len);
                    return Err(e);
                }
            }
            return Ok(Begin::Prefill {
                pending: tokens[mapped..].to_vec(),
                dropped: 0,
                reused: mapped as u64,
                // Back to `len`: below the mapped pages too.
                undo: slot.session.undo_to(len),
            });
        }
        let OverflowPolicy::Truncate { sink } = self.cfg.overflow else {
            return Err(RuntimeError::invalid(format!(
                "appending {} tokens to a history of {len} exceeds the context of {context}",
                tokens.len()
            )));
        };
        let mut all = slot.session.history().to_vec();
        all.extend_from_slice(tokens);
        let kept = keep_window(&all, sink, context);
        let dropped = (all.len() - kept.len()) as u64;
        Ok(match self.restart_kv(id, slot, kept.len())? {
            Restarted::Now(undo) => {
                slot.session.add_truncated(dropped);
                Begin::Prefill {
                    pending: kept,
                    dropped,
                    reused: 0,
                    undo,
                }
            }
            Restarted::Later => Begin::Later,
        })
    }

    pub(super) fn sweep_if_due(&mut self) {
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
}

/// What GetSessionInfo reports of `slot`.
pub(super) fn info(
    id: SessionId,
    runner: &dyn StepRunner,
    backend: &'static str,
    slot: &SessionSlot,
) -> SessionInfo {
    let busy = !slot.idle();
    let idle_seconds = if busy {
        0.0
    } else {
        slot.last_used.elapsed().as_secs_f64()
    };
    let mut info = slot.session.info(
        id,
        runner,
        backend,
        slot.committed_len(),
        busy,
        idle_seconds,
    );
    info.speculation = slot.speculation;
    info
}

/// Makes a Generate (its arguments checked at the runtime's boundary)
/// the session's active work. The
/// context is only made room in once it is full (`plan`): `max_tokens`
/// is a cap, never a reservation.
fn start_generate(
    slot: &mut SessionSlot,
    admitted: AdmittedGenerate,
    proposer: Option<Proposer>,
    events: &NotifySender<GenerateEvent>,
    cancel: &Arc<AtomicBool>,
    deadline: Option<Instant>,
) -> Result<(), RuntimeError> {
    // The arguments were checked at the runtime's boundary; only what
    // needs the session is checked here.
    let AdmittedGenerate {
        req,
        params,
        seed_used,
    } = admitted;
    slot.session.check_can_generate()?;
    let started = Instant::now();
    let gen = Generating {
        params,
        seed_used,
        max_tokens: req.max_tokens,
        stop_sequences: req.stop_sequences,
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
        history_start: slot.session.history().len(),
        rewritten: false,
        before_rewrite: None,
        constraint: req.constraint.as_ref().and_then(|c| c.take()).map(Box::new),
        mask: Vec::new(),
        proposer,
        speculation: SpeculationCounts::default(),
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
