//! A worker's moves in a replica set (`serve --session-store`, CONTRACT
//! §2.14): sessions taken over from the store and let go to other replicas,
//! and the store's upkeep between turns (its seat is `seat.rs`).
//!
//! A call for a session this worker does not hold takes it over
//! from the store: the lease is taken (a live holder asked to hand the
//! session over, a dead or paused one's lease waited out, within the call's
//! deadline), and the session joins as a spilled one
//! holding the stored history, fed again by its first call that needs KV
//! (shared prefix pages mapped), so the call runs after everything the store
//! has.

use super::*;
use crate::replica::{Lease, StoreError};

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
pub(super) struct WaitingTake {
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
                Err(e @ StoreError::OtherModel(_)) => {
                    call.fail(RuntimeError::OtherModel(format!("{e}: not continued here")))
                }
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
        self.settle_unsure();
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
        self.settle_unsure();
        if let Some(seat) = self.replica.as_mut() {
            seat.release_all();
        }
    }

    /// Sets the store right for the idle unsure sessions (a busy one is,
    /// by its call's own write), until the store fails again.
    fn settle_unsure(&mut self) {
        let Some(seat) = self.replica.as_mut() else {
            return;
        };
        for id in seat.unsure() {
            let Some(slot) = self.sessions.get(&id).filter(|slot| slot.idle()) else {
                continue;
            };
            if let Err(e) = seat.resync(id, slot.session.history(), &self.shared.counters) {
                tracing::warn!(session = %id, "setting the store right: {e}");
                return;
            }
        }
    }
}
