//! Forking a session: a new session on this worker that holds the source's
//! first `at` history tokens. Its KV references the source's full pages and
//! copies the partial one ([`SessionKv::fork`]), so a fork costs at most one
//! page per layer however long the history. The logits after `at` tokens
//! are the source's when `at` is its whole history; otherwise the fork keeps
//! `at - 1` positions and feeds token `at - 1` again, which gives the same
//! bits as any other way of feeding that history (CONTRACT §2.2).
//!
//! Validate, reserve, then mutate: the fork's pages and its place under the
//! session limit are had (evicting idle sessions other than the source as
//! needed) before anything is added; a fork that cannot be had changes
//! nothing.

use super::*;

/// What the caller asked of a fork, carried to where it is added.
pub(super) struct Asked {
    pub(super) fork: SessionId,
    /// Who the fork belongs to: the caller.
    pub(super) owner: Tenant,
    pub(super) client_label: Option<String>,
    pub(super) reply: Reply<ForkReply>,
}

/// What preparing a fork did.
pub(super) enum Forking {
    /// The KV is made (with room for a token to feed again) and the place
    /// under the session limit taken.
    Ready { kv: SessionKv, at: usize },
    /// Waiting for another worker's eviction; nothing changed.
    Later,
}

impl Worker {
    /// Makes the fork's KV from session `source` and takes its place.
    pub(super) fn prepare_fork(
        &mut self,
        source: SessionId,
        slot: &mut SessionSlot,
        at_length: Option<u64>,
    ) -> Result<Forking, RuntimeError> {
        // A fork of the whole history copies the logits from the host.
        slot.session.bring_logits_home(source, &*self.runner)?;
        loop {
            let len = slot.session.history().len();
            let at = match at_length {
                None => len,
                Some(asked) => usize::try_from(asked)
                    .ok()
                    .filter(|&at| at <= len)
                    .ok_or_else(|| {
                        RuntimeError::invalid(format!(
                            "at_length {asked} is past the session's history of {len} tokens"
                        ))
                    })?,
            };
            // Short of the end, the logits after `at` tokens are not kept:
            // keep one position less and feed that token again.
            let kept = if at < len { at.saturating_sub(1) } else { at };
            let made = slot.session.kv().fork(kept).and_then(|mut kv| {
                kv.reserve(at)?;
                Ok(kv)
            });
            let wait = match made {
                Ok(kv) => {
                    if self.claim_session() {
                        return Ok(Forking::Ready { kv, at });
                    }
                    drop(kv);
                    match self.room_for(source, slot) {
                        Wait::GiveUp => return Err(sessions_exhausted()),
                        wait => wait,
                    }
                }
                Err(KvError::Exhausted { wanted, free }) if self.reclaim_cached(wanted, free) => {
                    Wait::Retry
                }
                Err(KvError::Exhausted { wanted, free }) => {
                    // Evict nothing for a fork that would fail anyway.
                    if free.saturating_add(self.evictable_pages(source)) < wanted {
                        slot.short_since = None;
                        return Err(kv_exhausted(wanted, free));
                    }
                    match self.room_for(source, slot) {
                        Wait::GiveUp => return Err(kv_exhausted(wanted, free)),
                        wait => wait,
                    }
                }
                Err(KvError::OutsideWindow {
                    layer,
                    pos,
                    first_kept,
                }) => {
                    return Err(RuntimeError::invalid(format!(
                        "cannot fork at {at} tokens: sliding-window layer {layer} keeps \
                         positions from {first_kept} on, and the fork needs position {pos}"
                    )))
                }
                Err(e) => return Err(e.into()),
            };
            match wait {
                Wait::Later => return Ok(Forking::Later),
                Wait::Retry | Wait::GiveUp => {}
            }
        }
    }

    /// Adds the fork prepared from `source` (`src`): answered at once when
    /// its KV holds all `at` tokens, else once the token fed again is in.
    pub(super) fn add_fork(
        &mut self,
        source: SessionId,
        src: &SessionSlot,
        asked: Asked,
        kv: SessionKv,
        at: usize,
    ) {
        let Asked {
            fork,
            owner,
            client_label,
            reply,
        } = asked;
        let (session, refeed) = src.session.fork(kv, at, client_label, owner);
        let mut slot = SessionSlot::new(session);
        let answer_now = if refeed.is_empty() {
            Some(reply)
        } else {
            slot.active = Some(Active {
                work: Work::Fork { fork, reply },
                pending: refeed,
                fed: 0,
                prefill_started: Instant::now(),
                undo: None,
            });
            None
        };
        if let Some(store) = &self.cfg.state {
            let session = &slot.session;
            let history = &src.session.history()[..at];
            match store.create(
                fork,
                session.label(),
                session.eos(),
                session.owner(),
                history,
            ) {
                Ok(journal) => slot.session.attach_journal(journal),
                Err(e) => {
                    self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
                    tracing::error!(session = %fork, "cannot start the fork's journal: {e}");
                    count_journal_failure(&self.shared.counters);
                    let err = RuntimeError::file("the fork's journal", &e);
                    match slot.active.take() {
                        Some(active) => finish_with_error(active, err),
                        None => drop(answer_now.map(|reply| reply.send(Err(err)))),
                    }
                    return;
                }
            }
        }
        if let Some(seat) = self.replica.as_mut() {
            let history = &src.session.history()[..at];
            let counters = &self.shared.counters;
            if let Err(e) = seat.create(fork, &slot.session, history, Some(source), counters) {
                self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
                match slot.active.take() {
                    Some(active) => finish_with_error(active, e),
                    None => drop(answer_now.map(|reply| reply.send(Err(e)))),
                }
                return;
            }
        }
        let shared_pages = slot.session.kv().shared_pages();
        self.add_session(fork, slot);
        self.shared
            .counters
            .sessions_forked
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            session = %fork,
            %source,
            worker = self.index,
            at,
            shared_pages,
            "session forked"
        );
        if let Some(reply) = answer_now {
            let _ = reply.send(Ok(ForkReply {
                id: fork,
                history_length: at as u64,
            }));
        }
    }
}
