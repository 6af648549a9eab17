//! Room: KV pages and session places. Eviction of the least recently used
//! idle session (here, or by a request on the board to its owner), waiting
//! for another worker's answer, reservations, truncation (a fresh start or
//! in place) and undoing a call that stopped halfway.

use super::*;

impl Worker {
    /// Nanoseconds from the shared epoch to `t`: the board's stamps.
    pub(super) fn stamp(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.shared.epoch).as_nanos() as u64
    }

    /// The least recently used idle session other than `keep`.
    pub(super) fn lru_idle(&self, keep: Option<SessionId>) -> Option<(SessionId, Instant)> {
        self.sessions
            .iter()
            .filter(|(id, s)| s.idle() && !s.session.is_spilled() && Some(**id) != keep)
            .min_by_key(|(_, s)| s.last_used)
            .map(|(id, s)| (*id, s.last_used))
    }

    /// Evicts the least recently used idle session other than `keep`.
    pub(super) fn evict_lru(&mut self, keep: Option<SessionId>) -> bool {
        match self.lru_idle(keep) {
            Some((id, _)) => self.evict(id),
            None => false,
        }
    }

    /// Evicts an idle session: spilled when it has a journal and fewer than
    /// `max_spilled_sessions` are, removed otherwise.
    pub(super) fn evict(&mut self, id: SessionId) -> bool {
        self.with_session(id, |w, slot| w.evict_slot(id, slot))
            .is_some()
    }

    fn evict_slot(&mut self, id: SessionId, slot: &mut SessionSlot) {
        // The draft's positions go either way (fed again if it comes back).
        slot.draft = None;
        // A spill keeps the logits' digest.
        if slot.session.is_durable() {
            if let Err(e) = slot.session.bring_logits_home(id, &*self.runner) {
                return self.fail_slot(id, slot, e);
            }
        }
        if !slot.session.is_durable() || !self.claim_spilled_place() {
            return self.remove_slot(id, slot, Removal::Lru);
        }
        let released = slot.session.spill(
            id,
            self.cfg.state.as_deref(),
            &self.shared.spill_bytes,
            self.cfg.max_spill_bytes,
        );
        self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
        self.runner.release(id);
        self.trim_prefix_cache();
        self.shared
            .counters
            .sessions_spilled
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(session = %id, worker = self.index, "session spilled");
        if let Err(e) = released {
            tracing::error!(session = %id, "freeing a spilled session's KV: {e}");
        }
    }

    /// Brings a spilled session back: a place and the pages for its
    /// history (evicting others as any reservation does), then the history
    /// is fed again as its next work. `Later`: another worker was asked to
    /// evict; nothing changed.
    pub(super) fn unspill(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
    ) -> Result<Got, RuntimeError> {
        while !self.claim_session() {
            match self.room_for(id, slot) {
                Wait::Retry => {}
                Wait::Later => return Ok(Got::Later),
                Wait::GiveUp => return Err(sessions_exhausted()),
            }
        }
        // Pages other sessions hold for its history's start are mapped; only
        // the rest is fed again.
        let history = slot.session.take_history();
        let mapped = map_prefix(&self.shared, id, &mut slot.session, &history);
        match self.reserve(id, slot, history.len()) {
            Ok(Got::Now) => {}
            other => {
                self.unmap_prefix(id, slot, 0);
                slot.session.put_back_history(history);
                self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
                return other;
            }
        }
        self.shared.spilled_sessions.fetch_sub(1, Ordering::AcqRel);
        let tokens = history.len();
        // What the spill wrote out is read back, checked page by page.
        let (read, rest) = slot.session.unspilled(
            id,
            &history,
            mapped,
            self.cfg.state.as_deref(),
            &self.shared.spill_bytes,
            &self.shared.counters,
        );
        if !rest.is_empty() {
            slot.active = Some(Active::restore(rest));
        }
        tracing::info!(session = %id, worker = self.index, tokens, mapped, read, "spilled session back");
        Ok(Got::Now)
    }

    /// The KV pages evicting could free for `keep`: those of this worker's
    /// idle sessions (counted now) and of the others' (as last published).
    pub(super) fn evictable_pages(&self, keep: SessionId) -> usize {
        if self.cfg.eviction == EvictionPolicy::None {
            return 0;
        }
        let local: usize = self
            .sessions
            .iter()
            .filter(|(id, s)| s.idle() && **id != keep)
            .map(|(_, s)| s.session.kv().pages_held())
            .sum();
        let others: usize = self
            .shared
            .idle_pages
            .iter()
            .enumerate()
            .filter(|(worker, _)| *worker != self.index)
            .map(|(_, pages)| pages.load(Ordering::Relaxed))
            .sum();
        local
            .saturating_add(others)
            .saturating_add(self.cached_pages())
    }

    /// Frees room by evicting the least recently used idle session of any
    /// worker (never `keep`), as the eviction policy allows.
    pub(super) fn make_room(&mut self, keep: Option<SessionId>) -> Room {
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
                self.evict(id);
                Room::Retry
            }
            None => Room::Nothing,
        }
    }

    /// Serves other workers' eviction requests: one LRU idle session each,
    /// while any is idle; then republishes and marks them answered.
    pub(super) fn serve_evictions(&mut self) {
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
    pub(super) fn publish(&self) {
        let mut kv_bytes = 0;
        let mut history = 0;
        let mut queued = self.waiting_creates.len() as u64;
        let mut oldest: Option<Instant> = None;
        let mut idle_pages = 0;
        for slot in self.sessions.values() {
            kv_bytes += self.runner.kv_live_bytes(slot.session.kv());
            history += slot.session.history().len() as u64;
            queued += slot.queue.len() as u64;
            // A spilled session holds nothing an eviction could free.
            if slot.idle() && !slot.session.is_spilled() {
                idle_pages += slot.session.kv().pages_held();
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
        if let Some(draft) = &self.draft {
            let (held, pool) = draft.kv_bytes();
            g.draft_kv_held_bytes.store(held, Ordering::Relaxed);
            g.draft_kv_pool_bytes.store(pool, Ordering::Relaxed);
        }
        g.queued_ops.store(queued, Ordering::Relaxed);
        self.shared
            .board
            .publish(self.index, oldest.map(|t| self.stamp(t)));
    }

    /// Whether a session short of pages may go on waiting for another
    /// worker's eviction (starting its clock on the first call).
    pub(super) fn still_patient(slot: &mut SessionSlot) -> bool {
        let since = *slot.short_since.get_or_insert_with(Instant::now);
        if since.elapsed() < EVICTION_PATIENCE {
            return true;
        }
        slot.short_since = None;
        false
    }

    /// One round of making room for session `id`, within its patience.
    pub(super) fn room_for(&mut self, id: SessionId, slot: &mut SessionSlot) -> Wait {
        match self.make_room(Some(id)) {
            Room::Retry => Wait::Retry,
            Room::Later if Self::still_patient(slot) => Wait::Later,
            Room::Later | Room::Nothing => {
                slot.short_since = None;
                Wait::GiveUp
            }
        }
    }

    /// Reserves KV for `total` positions of `id`, evicting idle sessions
    /// while the pool is short. All or nothing.
    pub(super) fn reserve(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        total: usize,
    ) -> Result<Got, RuntimeError> {
        loop {
            match slot.session.reserve(total) {
                Ok(()) => {
                    slot.short_since = None;
                    return Ok(Got::Now);
                }
                Err(KvError::Exhausted { wanted, free }) => {
                    // Pages no session holds go first.
                    if self.reclaim_cached(wanted, free) {
                        continue;
                    }
                    // Decide from the numbers first: evict nothing for a
                    // request that would fail anyway.
                    if free.saturating_add(self.evictable_pages(id)) < wanted {
                        slot.short_since = None;
                        return Err(kv_exhausted(wanted, free));
                    }
                    match self.room_for(id, slot) {
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
    pub(super) fn restart_kv(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        positions: usize,
    ) -> Result<Restarted, RuntimeError> {
        // The undo keeps the logits on the host.
        slot.session.bring_logits_home(id, &*self.runner)?;
        loop {
            let mut fresh = SessionKv::new(Arc::clone(&self.kv_pool));
            match fresh.reserve(positions) {
                Ok(()) => {
                    let undo = slot.session.swap_in(fresh);
                    slot.short_since = None;
                    return Ok(Restarted::Now(undo));
                }
                Err(KvError::Exhausted { wanted, free }) => {
                    if self.reclaim_cached(wanted, free) {
                        continue;
                    }
                    let own = slot.session.kv().pages_held();
                    let evictable = self.evictable_pages(id);
                    let fresh_can_fit = free.saturating_add(evictable) >= wanted;
                    if !fresh_can_fit && free + own >= wanted {
                        slot.short_since = None;
                        return self.restart_in_place(id, slot, positions, wanted, free);
                    }
                    if !fresh_can_fit && (free + own).saturating_add(evictable) < wanted {
                        slot.short_since = None;
                        return Err(kv_exhausted(wanted, free));
                    }
                    match self.room_for(id, slot) {
                        Wait::Retry => {}
                        Wait::Later => return Ok(Restarted::Later),
                        Wait::GiveUp => {
                            return self.restart_in_place(id, slot, positions, wanted, free)
                        }
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The last resort of [`Worker::restart_kv`]: reuse the session's own
    /// pages when they and the free ones cover `wanted`.
    pub(super) fn restart_in_place(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        positions: usize,
        wanted: usize,
        free: usize,
    ) -> Result<Restarted, RuntimeError> {
        if wanted > free + slot.session.kv().pages_held() {
            return Err(kv_exhausted(wanted, free));
        }
        let undo = slot.session.give_back_pages()?;
        match self.reserve_own_pages_again(&mut slot.session, positions) {
            Ok(()) => Ok(Restarted::Now(undo)),
            Err(e) => {
                let err = match e {
                    KvError::Exhausted { wanted, free } => kv_exhausted(wanted, free),
                    e => e.into(),
                };
                tracing::warn!(session = %id, "pages taken while truncating: {err}");
                self.fail_slot(id, slot, err.clone());
                Err(err)
            }
        }
    }

    /// Reserves `positions` for a session that just gave its pages back.
    /// Those of its full pages the prefix index also listed went to the
    /// cache, not the pool: they are reclaimed if the pool is short.
    fn reserve_own_pages_again(
        &self,
        session: &mut Session,
        positions: usize,
    ) -> Result<(), KvError> {
        match session.reserve(positions) {
            Err(KvError::Exhausted { wanted, free }) if self.reclaim_cached(wanted, free) => {
                session.reserve(positions)
            }
            other => other,
        }
    }

    /// Puts a session back as `undo` says, after its call stopped halfway.
    /// When its pages were given back for an in-place truncation, the old
    /// history is queued to be fed again as the session's next work.
    pub(super) fn apply_undo(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        undo: Undo,
    ) -> Result<(), RuntimeError> {
        slot.feed.clear();
        let recompute = slot.session.roll_back(undo)?;
        if let Some(history) = &recompute {
            self.reserve_own_pages_again(&mut slot.session, history.len())
                .map_err(|e| match e {
                    KvError::Exhausted { wanted, free } => kv_exhausted(wanted, free),
                    e => e.into(),
                })?;
        }
        if let Some(history) = recompute {
            slot.active = Some(Active::restore(history));
        }
        // The one deliberate decrease of the committed length (INV-2).
        slot.session.recommit();
        // What the layers hold beyond the pages (the shards' copies) no
        // longer matches.
        self.runner.release(id);
        Ok(())
    }

    /// The context is full in the middle of a Generate: drop the oldest
    /// tokens after the sink, no more than the rest of the Generate needs
    /// and at most half the window, and re-prefill the kept window before
    /// the next token. `Truncated` is emitted once it is in. Returns
    /// whether the session moved.
    pub(super) fn shift_window(&mut self, id: SessionId, slot: &mut SessionSlot) -> bool {
        let OverflowPolicy::Truncate { sink } = self.cfg.overflow else {
            return false;
        };
        let context = self.model.config.context;
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
        let history = slot.session.history();
        let kept = keep_window(history, sink, context.saturating_sub(shift));
        let dropped = (history.len() - kept.len()) as u64;
        // The history before the call's first shift, for taking the whole
        // call back if its end cannot be journaled.
        let before = (!gen.rewritten).then(|| {
            (
                history[..gen.history_start].to_vec(),
                slot.session.truncated(),
            )
        });
        let undo = match self.restart_kv(id, slot, kept.len()) {
            Ok(Restarted::Now(undo)) => undo,
            Ok(Restarted::Later) => return false,
            Err(e) => {
                self.finish_generate(id, slot, Err(e));
                return true;
            }
        };
        if slot.removed {
            return true;
        }
        slot.session.add_truncated(dropped);
        if let Some(active) = slot.active.as_mut() {
            if let Work::Generate(gen) = &mut active.work {
                gen.shift_dropped = Some(dropped);
                gen.rewritten = true;
                if gen.before_rewrite.is_none() {
                    gen.before_rewrite = before;
                }
                gen.prefill_tokens += kept.len() as u64;
            }
            active.pending = kept;
            active.fed = 0;
            active.prefill_started = Instant::now();
            active.undo = Some(undo);
        }
        true
    }

    /// Gives back what [`map_prefix`] mapped after `len` tokens, when the
    /// append it was for could not start (a session that cannot give them
    /// back is removed).
    pub(super) fn unmap_prefix(&mut self, id: SessionId, slot: &mut SessionSlot, len: usize) {
        if let Err(e) = slot.session.unmap_prefix(len) {
            tracing::error!(session = %id, "giving back shared pages: {e}");
            self.fail_slot(id, slot, e.into());
        }
    }

    /// Frees pages only the prefix cache holds, toward `wanted` more free
    /// pages than `free`. Returns whether any were freed.
    pub(super) fn reclaim_cached(&self, wanted: usize, free: usize) -> bool {
        self.shared
            .prefix
            .as_ref()
            .is_some_and(|index| index.reclaim(wanted.saturating_sub(free)) > 0)
    }

    /// Pages the prefix cache could free.
    pub(super) fn cached_pages(&self) -> usize {
        self.shared
            .prefix
            .as_ref()
            .map_or(0, |index| index.stats().cached_pages)
    }

    /// Lets the prefix cache drop what is over its budget once a session
    /// let go of pages.
    pub(super) fn trim_prefix_cache(&self) {
        if let Some(index) = &self.shared.prefix {
            index.trim();
        }
    }
}

/// Maps the pages the shared-prefix index lists for `tokens` after the
/// session's history (see [`Session::map_prefix`]); nothing where the
/// workers keep no index. Mapping is part of an append's reservation: it
/// happens before the rest is reserved, and is given back with it when the
/// append cannot start.
pub(super) fn map_prefix(
    shared: &WorkersState,
    id: SessionId,
    session: &mut Session,
    tokens: &[u32],
) -> usize {
    match &shared.prefix {
        Some(index) => session.map_prefix(id, index, tokens, &shared.counters),
        None => 0,
    }
}
