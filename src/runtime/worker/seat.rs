//! A worker's seat in a replica set (`serve --session-store`, CONTRACT
//! §2.14): its own connection to the store, the leases of the sessions it
//! holds, and the store's side of each change of theirs.
//!
//! Every change of a held session's history is written here, fenced by the
//! session's lease, before the call that made it is answered; a write that
//! does not land undoes the call as a failed journal write does, and one
//! that went unanswered leaves the session unsure until the store is set
//! back to what the session holds. Leases are renewed every third of their
//! length; one another replica took marks the session lost, and so does
//! every held lease once the store has been out of reach for a whole lease.

use std::collections::HashSet;

use super::replica::WaitingTake;
use super::*;
use crate::replica::{Lease, NewSession, Store, StoreError};

/// The store, and what this worker holds of it.
pub(crate) struct ReplicaSeat {
    pub(super) store: Store,
    pub(super) lease: Duration,
    pub(super) held: HashMap<SessionId, Lease>,
    /// Sessions whose lease no longer holds: dropped on the worker's next
    /// turn, and never written for again.
    pub(super) lost: HashSet<SessionId>,
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
    pub(super) waiting: HashMap<SessionId, WaitingTake>,
    /// Whether this worker also deletes the store's orphans idle past the
    /// TTL (one worker per replica does), and when it last did.
    sweeps: bool,
    last_sweep: Instant,
}

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
    pub(super) fn release_all(&mut self) {
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
    pub(super) fn renew_if_due(&mut self, counters: &Counters) {
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
    pub(super) fn sweep_if_due(&mut self, idle_ttl: Duration) {
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
