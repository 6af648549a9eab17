//! A worker's part in a replica set (`serve --session-store`, CONTRACT
//! §2.14): its own connection to the store, the leases of the sessions it
//! holds, and the store's side of each change.
//!
//! Every change of a held session's history is written to the store, fenced
//! by the session's lease, before the call that made it is answered; a write
//! that does not land undoes the call as a failed journal write does. The
//! leases are renewed every third of their length; one another replica took
//! (this one paused or cut off past its lease) drops the session here, and
//! so does every held lease once the store has been out of reach for a
//! whole lease. A call for a session this worker does not hold takes it over
//! from the store: the lease is taken (a live holder asked to hand the
//! session over, a dead or paused one's lease waited out, within the call's
//! deadline), and the session joins as a spilled one
//! holding the stored history, fed again by its first call that needs KV
//! (shared prefix pages mapped), so the call runs after everything the store
//! has.

use std::collections::HashSet;

use super::*;
use crate::replica::{Lease, NewSession, Store, StoreError};

/// The store, and what this worker holds of it.
pub(crate) struct ReplicaSeat {
    store: Store,
    lease: Duration,
    held: HashMap<SessionId, Lease>,
    /// Sessions whose lease no longer holds: dropped on the worker's next
    /// turn, and never written for again.
    lost: HashSet<SessionId>,
    /// Held sessions whose last write failed without an answer: it may
    /// have been committed although the call was undone here, so the next
    /// write sets the whole history (as a failed sync rewrites a journal
    /// whole), and the session is not let go before that.
    unsure: HashSet<SessionId>,
    last_renewal: Instant,
    /// Until when every held lease surely holds: the start of the last
    /// renewal that landed, plus the lease.
    held_until: Instant,
    /// Calls for sessions another replica holds, waiting for its lease to
    /// run out, in arrival order per session.
    waiting: HashMap<SessionId, WaitingTake>,
    /// Whether this worker also deletes the store's orphans idle past the
    /// TTL (one worker per replica does), and when it last did.
    sweeps: bool,
    last_sweep: Instant,
}

/// A call for a session that is not here: an operation for its FIFO (a
/// GetSessionInfo too, as [`Op::Info`], so that it answers once the
/// session's KV is back, with its logits digest).
pub(super) struct Call {
    pub(super) caller: Tenant,
    pub(super) op: Op,
    pub(super) deadline: Option<Instant>,
    /// When it reached this worker: it waits for a session held elsewhere
    /// at most two leases from then.
    pub(super) arrived: Instant,
}

impl Call {
    fn fail(self, err: RuntimeError) {
        self.op.fail(err)
    }

    fn into_command(self, id: SessionId) -> Command {
        Command::Enqueue {
            id,
            caller: self.caller,
            op: self.op,
            deadline: self.deadline,
        }
    }
}

/// Calls waiting for another replica's lease on their session to end.
struct WaitingTake {
    calls: VecDeque<Call>,
    retry_at: Instant,
    wait: Wait,
}

/// The wait of calls for a session held elsewhere.
#[derive(Clone, Copy)]
struct Wait {
    /// When the holder was last asked to let the session go.
    asked_at: Option<Instant>,
}

/// How often a session held elsewhere is tried again.
const TAKE_RETRY: Duration = Duration::from_millis(100);
/// How often its holder is asked again to let it go (it lets go only when
/// nothing runs or waits on the session there).
const ASK_AGAIN: Duration = Duration::from_millis(500);

impl ReplicaSeat {
    pub(crate) fn new(store: Store, lease: Duration, sweeps: bool) -> Self {
        let now = Instant::now();
        ReplicaSeat {
            store,
            lease,
            held: HashMap::new(),
            lost: HashSet::new(),
            unsure: HashSet::new(),
            last_renewal: now,
            held_until: now + lease,
            waiting: HashMap::new(),
            sweeps,
            last_sweep: now,
        }
    }

    /// The store's answer to a write as the call sees it; a lease that no
    /// longer holds marks the session lost.
    fn failed(&mut self, id: SessionId, err: StoreError, counters: &Counters) -> RuntimeError {
        match err {
            // Not found: deleted by another replica after taking it over.
            StoreError::Fenced { .. } | StoreError::NotFound(_) => {
                self.lose(id, counters);
                RuntimeError::Moved(err.to_string())
            }
            other => {
                counters
                    .replica_store_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::error!(session = %id, "session store write failed, the call is undone: {other}");
                RuntimeError::NotDurable(other.to_string())
            }
        }
    }

    fn lose(&mut self, id: SessionId, counters: &Counters) {
        if self.held.remove(&id).is_some() {
            counters.replica_leases_lost.fetch_add(1, Ordering::Relaxed);
        }
        self.lost.insert(id);
    }

    /// Writes a new session (`history` empty, or a fork's, made from
    /// held session `source` while its lease holds) under a new lease.
    pub(super) fn create(
        &mut self,
        id: SessionId,
        session: &Session,
        history: &[u32],
        source: Option<SessionId>,
        counters: &Counters,
    ) -> Result<(), RuntimeError> {
        if let Some(source) = source.filter(|s| self.lost.contains(s)) {
            return Err(RuntimeError::Moved(format!(
                "session {source}: this replica's lease on it ended"
            )));
        }
        let source_key = source.map(|s| s.to_string());
        let fenced_by = source.and_then(|s| self.held.get(&s).copied());
        let row = NewSession {
            label: session.label(),
            eos: session.eos(),
            tenant: session.owner().identity(),
            history,
            source: source_key.as_deref().zip(fenced_by),
        };
        match self.store.create(&id.to_string(), &row) {
            Ok(lease) => {
                self.held.insert(id, lease);
                Ok(())
            }
            Err(StoreError::Exists(_)) => Err(RuntimeError::Internal(format!(
                "session id {id} drawn twice across the replicas"
            ))),
            Err(e @ StoreError::Fenced { .. }) => {
                let source = source.expect("only a fork is fenced at its creation");
                Err(self.failed(source, e, counters))
            }
            // The new session is not here: a row written without an answer
            // is nobody's, and the idle sweep deletes it.
            Err(e) => Err(self.failed(id, e, counters)),
        }
    }

    /// Writes a change of a held session's history (`Append` or `Reset`;
    /// `history`: the session's history with it). A session created
    /// transient (never in the store) writes nothing.
    pub(super) fn keep(
        &mut self,
        id: SessionId,
        record: &Record,
        history: &[u32],
        counters: &Counters,
    ) -> Result<(), RuntimeError> {
        if self.lost.contains(&id) {
            return Err(RuntimeError::Moved(format!(
                "session {id}: this replica's lease on it ended"
            )));
        }
        let Some(&lease) = self.held.get(&id) else {
            return Ok(());
        };
        let key = id.to_string();
        let written = match record {
            _ if self.unsure.contains(&id) => self.store.set_history(&key, lease, history),
            Record::Append(tokens) => self.store.append(&key, lease, tokens),
            Record::Reset(history) => self.store.set_history(&key, lease, history),
            Record::Pages(_) | Record::Digest(_) => return Ok(()),
        };
        self.settled(id, written)
            .map_err(|e| self.failed(id, e, counters))
    }

    /// Notes what a write of held session `id` left the store knowing: an
    /// answered write settles it, one without an answer leaves it unsure.
    fn settled<T>(
        &mut self,
        id: SessionId,
        written: Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        match &written {
            Ok(_) => {
                self.unsure.remove(&id);
            }
            Err(StoreError::Unavailable(_)) => {
                self.unsure.insert(id);
            }
            Err(_) => {}
        }
        written
    }

    /// Makes the store hold `history` for unsure session `id` (its last
    /// write went unanswered); nothing to do for a settled one.
    pub(super) fn resync(
        &mut self,
        id: SessionId,
        history: &[u32],
        counters: &Counters,
    ) -> Result<(), RuntimeError> {
        let Some(&lease) = self.held.get(&id).filter(|_| self.unsure.contains(&id)) else {
            return Ok(());
        };
        let written = self.store.set_history(&id.to_string(), lease, history);
        self.settled(id, written)
            .map_err(|e| self.failed(id, e, counters))
    }

    /// Unsure sessions, to be settled when the store answers again.
    pub(super) fn unsure(&self) -> Vec<SessionId> {
        self.unsure.iter().copied().collect()
    }

    /// Deletes a held session's row (CloseSession): the call fails, and the
    /// session stays, when the store does not take it (if the delete was
    /// committed all the same, the session's next write finds it gone).
    pub(super) fn close(&mut self, id: SessionId, counters: &Counters) -> Result<(), RuntimeError> {
        let Some(&lease) = self.held.get(&id) else {
            return Ok(());
        };
        let closed = self.store.close(&id.to_string(), lease);
        self.settled(id, closed)
            .map_err(|e| self.failed(id, e, counters))?;
        self.held.remove(&id);
        Ok(())
    }

    /// The session leaves this worker for `reason`: its row goes with it
    /// when the session ends (TTL, a failure), and stays, let go for any
    /// replica to take at once, when only its KV goes (an LRU eviction).
    /// Errors are logged: a row left behind is deleted by the store's idle
    /// sweep, a lease left behind runs out.
    /// An unsure session (`history`: what it holds) is set right first,
    /// or, when the store does not take that either, its lease is left to
    /// run out.
    pub(super) fn leave(&mut self, id: SessionId, reason: Removal, history: &[u32]) {
        self.lost.remove(&id);
        let unsure = self.unsure.remove(&id);
        let Some(lease) = self.held.remove(&id) else {
            return;
        };
        let key = id.to_string();
        let result = match reason {
            Removal::Ttl | Removal::Failed | Removal::Close => self.store.close(&key, lease),
            Removal::Lru | Removal::HandedOff => {
                let set_right = match unsure {
                    true => self.store.set_history(&key, lease, history),
                    false => Ok(()),
                };
                set_right.and_then(|()| self.store.release(&key, lease))
            }
            Removal::Moved => Ok(()),
        };
        if let Err(e) = result {
            tracing::warn!(session = %id, ?reason, "session store: {e}");
        }
    }

    /// Lets every held session go (the worker stops): another replica may
    /// take each at once.
    fn release_all(&mut self) {
        for (id, lease) in std::mem::take(&mut self.held) {
            if let Err(e) = self.store.release(&id.to_string(), lease) {
                // The store is out of reach: the other leases run out too,
                // without a wait for each.
                tracing::warn!(session = %id, "letting the session go: {e}");
                return;
            }
        }
    }

    /// Renews the held leases when a third of a lease has passed since
    /// the last renewal; marks lost those another replica took, or all of
    /// them once the store has been out of reach for a whole lease.
    fn renew_if_due(&mut self, counters: &Counters) {
        if self.last_renewal.elapsed() < self.lease / 3 {
            return;
        }
        let started = Instant::now();
        self.last_renewal = started;
        if self.held.is_empty() {
            self.held_until = started + self.lease;
            return;
        }
        let held: Vec<(String, i64)> = self
            .held
            .iter()
            .map(|(id, lease)| (id.to_string(), lease.epoch))
            .collect();
        match self.store.renew(&held) {
            Ok(lost) => {
                self.held_until = started + self.lease;
                for id in lost.iter().filter_map(|key| SessionId::parse(key).ok()) {
                    tracing::warn!(session = %id, "another replica took the session over");
                    self.lose(id, counters);
                }
            }
            Err(e) => {
                counters
                    .replica_store_failures
                    .fetch_add(1, Ordering::Relaxed);
                // Now, not when the renewal started: it may have waited for
                // the database for seconds.
                if Instant::now() >= self.held_until {
                    tracing::error!(
                        sessions = self.held.len(),
                        "the session store was out of reach for a whole lease: \
                         dropping the sessions held here ({e})"
                    );
                    let ids: Vec<SessionId> = self.held.keys().copied().collect();
                    for id in ids {
                        self.lose(id, counters);
                    }
                } else {
                    tracing::warn!("renewing leases: {e}");
                }
            }
        }
    }

    /// Deletes the store's sessions that nobody holds and that have not
    /// changed for `idle_ttl`, every quarter of it (at most every second).
    fn sweep_if_due(&mut self, idle_ttl: Duration) {
        let every = (idle_ttl / 4).max(Duration::from_secs(1));
        if !self.sweeps || self.last_sweep.elapsed() < every {
            return;
        }
        self.last_sweep = Instant::now();
        match self.store.sweep_idle(idle_ttl) {
            Ok(0) => {}
            Ok(n) => tracing::info!(sessions = n, "idle sessions no replica held deleted"),
            Err(e) => tracing::warn!("sweeping idle sessions: {e}"),
        }
    }
}

impl Worker {
    /// Takes part in a replica set through `seat`.
    pub(crate) fn with_replica(mut self, seat: ReplicaSeat) -> Self {
        self.replica = Some(seat);
        self
    }

    /// Whether a call for session `id` goes to the store: a replica's
    /// worker that does not hold it.
    pub(super) fn not_here(&self, id: SessionId) -> bool {
        self.replica.is_some() && !self.sessions.contains_key(&id)
    }

    /// A call for a session this worker does not hold: behind the calls
    /// already waiting for it, or taken over now.
    pub(super) fn call_elsewhere(&mut self, id: SessionId, call: Call) {
        let Some(seat) = self.replica.as_mut() else {
            return call.fail(RuntimeError::NotFound);
        };
        if let Some(waiting) = seat.waiting.get_mut(&id) {
            let limit = self.cfg.session_queue;
            if waiting.calls.len() >= limit {
                return call.fail(RuntimeError::ResourceExhausted {
                    what: "session wait queue".into(),
                    asked: waiting.calls.len() as u64 + 1,
                    free: 0,
                });
            }
            waiting.calls.push_back(call);
            return;
        }
        self.take_over(id, VecDeque::from([call]), None);
    }

    /// Takes session `id` over from the store for `calls` (in order), or
    /// waits for its owner's lease to end (`wait`: how long they have
    /// waited so far), or fails them.
    fn take_over(&mut self, id: SessionId, calls: VecDeque<Call>, wait: Option<Wait>) {
        let now = Instant::now();
        let mut live = VecDeque::with_capacity(calls.len());
        for call in calls {
            if call.deadline.is_some_and(|d| d <= now) {
                call.fail(RuntimeError::DeadlineExceeded);
            } else {
                live.push_back(call);
            }
        }
        while let Some(call) = live.pop_front() {
            if self.sessions.contains_key(&id) {
                self.handle(call.into_command(id));
                continue;
            }
            let Some(seat) = self.replica.as_mut() else {
                return call.fail(RuntimeError::NotFound);
            };
            let caller = call.caller.identity().map(str::to_owned);
            match seat.store.take(&id.to_string(), caller.as_deref()) {
                Ok((lease, row)) => {
                    if let Err(e) = self.adopt(id, lease, row) {
                        call.fail(e);
                        continue;
                    }
                    self.handle(call.into_command(id));
                }
                Err(StoreError::HeldElsewhere { left, owner, .. }) => {
                    tracing::debug!(session = %id, %owner, ?left, "waiting for another replica's lease");
                    live.push_front(call);
                    let seat = self.replica.as_mut().expect("checked above");
                    let mut wait = wait.unwrap_or(Wait { asked_at: None });
                    if wait
                        .asked_at
                        .is_none_or(|at| now.duration_since(at) >= ASK_AGAIN)
                    {
                        if let Err(e) = seat.store.ask_handoff(&id.to_string(), &owner) {
                            tracing::debug!(session = %id, "asking {owner} for the session: {e}");
                        }
                        wait.asked_at = Some(now);
                    }
                    seat.waiting.insert(
                        id,
                        WaitingTake {
                            calls: live,
                            retry_at: now + left.clamp(Duration::from_millis(10), TAKE_RETRY),
                            wait,
                        },
                    );
                    return;
                }
                Err(StoreError::NotFound(_)) => call.fail(RuntimeError::NotFound),
                Err(e) => {
                    self.shared
                        .counters
                        .replica_store_failures
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(session = %id, "taking the session over: {e}");
                    call.fail(RuntimeError::NotDurable(e.to_string()));
                }
            }
        }
    }

    /// Adds a session taken over from the store: spilled, holding the
    /// stored history, fed again when a call needs its KV.
    fn adopt(
        &mut self,
        id: SessionId,
        lease: Lease,
        row: crate::replica::SessionRow,
    ) -> Result<(), RuntimeError> {
        let owner = match row.tenant.as_deref().map(Tenant::new).transpose() {
            Ok(owner) => owner.unwrap_or_default(),
            Err(e) => return Err(RuntimeError::Internal(format!("stored session {id}: {e}"))),
        };
        let (vocab, context) = (self.model.config.vocab, self.model.config.context);
        let misfit = match row.history.iter().find(|&&t| t as usize >= vocab) {
            Some(token) => Some(format!(
                "token {token} is outside the vocabulary of {vocab}"
            )),
            None => (row.history.len() > context).then(|| {
                format!(
                    "{} tokens exceed the context of {context}",
                    row.history.len()
                )
            }),
        };
        let placed = misfit.is_none() && self.claim_spilled_place();
        let seat = self.replica.as_mut().expect("a replica's worker");
        if let Some(misfit) = misfit {
            // Replicas of another model share this store: let it go for them.
            if let Err(e) = seat.store.release(&id.to_string(), lease) {
                tracing::warn!(session = %id, "letting the session go: {e}");
            }
            return Err(RuntimeError::Internal(format!(
                "stored session {id} does not fit this replica's model: {misfit}"
            )));
        }
        if !placed {
            // Let go again at once: another replica may have room.
            if let Err(e) = seat.store.release(&id.to_string(), lease) {
                tracing::warn!(session = %id, "letting the session go: {e}");
            }
            return Err(sessions_exhausted());
        }
        seat.held.insert(id, lease);
        seat.lost.remove(&id);
        let tokens = row.history.len();
        let kv = SessionKv::new(Arc::clone(&self.kv_pool));
        let mut session = Session::new(kv, row.label, row.eos, owner);
        session.restored_spilled(row.history, None, None);
        self.add_session(id, SessionSlot::new(session));
        let counters = &self.shared.counters;
        counters.replica_takeovers.fetch_add(1, Ordering::Relaxed);
        counters
            .replica_takeover_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
        tracing::info!(session = %id, worker = self.index, tokens, epoch = lease.epoch, "session taken over from the store");
        Ok(())
    }

    /// The store's upkeep, once a turn: leases renewed when due, lost
    /// sessions dropped, waiting take-overs tried again, idle orphans swept.
    pub(super) fn replica_upkeep(&mut self) {
        let Some(seat) = self.replica.as_mut() else {
            return;
        };
        seat.renew_if_due(&self.shared.counters);
        seat.sweep_if_due(self.cfg.idle_ttl);
        // Unsure sessions are set right once the store answers again; a
        // busy one is, by its call's own write.
        for id in seat.unsure() {
            let Some(slot) = self.sessions.get(&id).filter(|slot| slot.idle()) else {
                continue;
            };
            let seat = self.replica.as_mut().expect("checked above");
            if let Err(e) = seat.resync(id, slot.session.history(), &self.shared.counters) {
                tracing::debug!(session = %id, "setting the store right: {e}");
                break;
            }
        }
        let Some(seat) = self.replica.as_mut() else {
            return;
        };
        let lost: Vec<SessionId> = seat.lost.drain().collect();
        for id in lost {
            self.drop_moved(id);
        }
        let now = Instant::now();
        let Some(seat) = self.replica.as_mut() else {
            return;
        };
        let longest = 2 * seat.lease;
        let given_up = |c: &Call| now.duration_since(c.arrived) >= longest;
        let due: Vec<SessionId> = seat
            .waiting
            .iter()
            .filter(|(_, w)| {
                w.retry_at <= now
                    || w.calls
                        .iter()
                        .any(|c| given_up(c) || c.deadline.is_some_and(|d| d <= now))
            })
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            let Some(waiting) = self.replica.as_mut().and_then(|s| s.waiting.remove(&id)) else {
                continue;
            };
            let (expired, calls): (VecDeque<Call>, VecDeque<Call>) =
                waiting.calls.into_iter().partition(given_up);
            for call in expired {
                call.fail(RuntimeError::HeldElsewhere(format!(
                    "session {id} was not let go within twice the lease ({longest:?})"
                )));
            }
            if !calls.is_empty() {
                self.take_over(id, calls, Some(waiting.wait));
            }
        }
    }

    /// Drops a session whose lease another replica holds now: what runs or
    /// waits on it fails (call again: it reaches the session where it is).
    fn drop_moved(&mut self, id: SessionId) {
        let moved = || RuntimeError::Moved(format!("session {id}: another replica holds it now"));
        self.with_session(id, |w, slot| {
            w.end_slot(id, slot, Removal::Moved, moved(), moved)
        });
    }

    /// Another replica asked for session `id`: it is let go (its KV
    /// dropped, its row kept, the lease ended) when nothing runs or waits
    /// on it; else the asker asks again.
    pub(super) fn hand_off(&mut self, id: SessionId) {
        let Some(slot) = self.sessions.get(&id).filter(|slot| slot.idle()) else {
            return;
        };
        let Some(seat) = self.replica.as_mut() else {
            return;
        };
        // Not before the store holds what the session holds.
        if seat
            .resync(id, slot.session.history(), &self.shared.counters)
            .is_ok()
        {
            tracing::info!(session = %id, worker = self.index, "session let go for another replica");
            self.remove(id, Removal::HandedOff);
        }
    }

    /// The worker stops: every held session is let go in the store.
    pub(super) fn leave_replica_set(&mut self) {
        let Some(seat) = self.replica.as_mut() else {
            return;
        };
        for (_, waiting) in seat.waiting.drain() {
            for call in waiting.calls {
                call.fail(RuntimeError::Unavailable);
            }
        }
        for id in seat.unsure() {
            let Some(slot) = self.sessions.get(&id) else {
                continue;
            };
            let seat = self.replica.as_mut().expect("checked above");
            if let Err(e) = seat.resync(id, slot.session.history(), &self.shared.counters) {
                tracing::warn!(session = %id, "setting the store right before stopping: {e}");
            }
        }
        if let Some(seat) = self.replica.as_mut() {
            seat.release_all();
        }
    }
}
