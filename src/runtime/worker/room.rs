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
            .filter(|(id, s)| s.idle() && !s.spilled && Some(**id) != keep)
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
        let journaled = self.sessions.get(&id).is_some_and(|s| s.journal.is_some());
        if !journaled || !self.claim_spilled_place() {
            return self.remove(id, Removal::Lru).is_some();
        }
        let Some(slot) = self.sessions.get_mut(&id) else {
            self.shared.spilled_sessions.fetch_sub(1, Ordering::AcqRel);
            return false;
        };
        if slot.logits_digest.get().is_none() {
            slot.logits_digest.set(Some(digest(&slot.next_logits)));
        }
        slot.next_logits = Vec::new();
        slot.prefix = Some(PrefixCursor::START);
        slot.high_water = 0;
        slot.spilled = true;
        // The pages move: hints of where they were are stale.
        slot.hinted.clear();
        if let Some(store) = &self.cfg.state {
            slot.spill_file = spill_out(
                store,
                id,
                slot,
                &self.shared.spill_bytes,
                self.cfg.max_spill_bytes,
            );
        }
        let released = slot.kv.release();
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
        true
    }

    /// Brings a spilled session back: a place and the pages for its
    /// history (evicting others as any reservation does), then the history
    /// is fed again as its next work. `Later`: another worker was asked to
    /// evict; nothing changed.
    pub(super) fn unspill(&mut self, id: SessionId) -> Result<Got, RuntimeError> {
        while !self.claim_session() {
            match self.room_for(id) {
                Wait::Retry => {}
                Wait::Later => return Ok(Got::Later),
                Wait::GiveUp => return Err(sessions_exhausted()),
            }
        }
        let Some(slot) = self.sessions.get_mut(&id) else {
            self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
            return Err(RuntimeError::NotFound);
        };
        // Pages other sessions hold for its history's start are mapped; only
        // the rest is fed again.
        let history = std::mem::take(&mut slot.history);
        let mapped = self.map_prefix(id, &history);
        match self.reserve(id, history.len()) {
            Ok(Got::Now) => {}
            other => {
                self.unmap_prefix(id, 0);
                if let Some(slot) = self.sessions.get_mut(&id) {
                    slot.history = history;
                }
                self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
                return other;
            }
        }
        self.shared.spilled_sessions.fetch_sub(1, Ordering::AcqRel);
        let slot = self.sessions.get_mut(&id).ok_or(RuntimeError::NotFound)?;
        slot.spilled = false;
        // What it reported while spilled is what its KV must compute again.
        slot.expected_digest = slot.logits_digest.get();
        let tokens = history.len();
        // What the spill wrote out is read back, checked page by page.
        let mut read = 0;
        if let Some((path, bytes)) = slot.spill_file.take() {
            match crate::durable::read_spill(&path, &mut slot.kv, &history) {
                Ok(n) => read = n,
                Err(e) => tracing::warn!(session = %id, "reading spilled pages back: {e}"),
            }
            spill_gone(self.cfg.state.as_deref(), &path, bytes);
            self.shared.spill_bytes.fetch_sub(bytes, Ordering::Relaxed);
        }
        if read > 0 {
            slot.history
                .extend_from_slice(&history[mapped..mapped + read]);
            slot.high_water = slot.kv.len();
            self.shared
                .counters
                .spill_read_tokens
                .fetch_add(read as u64, Ordering::Relaxed);
        }
        let done = mapped + read;
        if done < tokens {
            slot.active = Some(Active::restore(history[done..].to_vec()));
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
            kv_bytes += self.runner.kv_live_bytes(&slot.kv);
            history += slot.history.len() as u64;
            queued += slot.queue.len() as u64;
            // A spilled session holds nothing an eviction could free.
            if slot.idle() && !slot.spilled {
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
    pub(super) fn still_patient(&mut self, id: SessionId) -> bool {
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
    pub(super) fn room_for(&mut self, id: SessionId) -> Wait {
        match self.make_room(Some(id)) {
            Room::Retry => Wait::Retry,
            Room::Later if self.still_patient(id) => Wait::Later,
            Room::Later | Room::Nothing => {
                self.clear_short(id);
                Wait::GiveUp
            }
        }
    }

    pub(super) fn clear_short(&mut self, id: SessionId) {
        if let Some(slot) = self.sessions.get_mut(&id) {
            slot.short_since = None;
        }
    }

    /// Reserves KV for `total` positions of `id`, evicting idle sessions
    /// while the pool is short. All or nothing.
    pub(super) fn reserve(&mut self, id: SessionId, total: usize) -> Result<Got, RuntimeError> {
        loop {
            let slot = self.sessions.get_mut(&id).ok_or(RuntimeError::NotFound)?;
            match slot.kv.reserve(total) {
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
    pub(super) fn restart_kv(
        &mut self,
        id: SessionId,
        positions: usize,
    ) -> Result<Restarted, RuntimeError> {
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
                    slot.prefix = Some(PrefixCursor::START);
                    return Ok(Restarted::Now(undo));
                }
                Err(KvError::Exhausted { wanted, free }) => {
                    if self.reclaim_cached(wanted, free) {
                        continue;
                    }
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
    pub(super) fn restart_in_place(
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
        slot.prefix = Some(PrefixCursor::START);
        match self.reserve_own_pages_again(id, positions) {
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

    /// Reserves `positions` for a session that just gave its pages back.
    /// Those of its full pages the prefix index also listed went to the
    /// cache, not the pool: they are reclaimed if the pool is short.
    fn reserve_own_pages_again(&mut self, id: SessionId, positions: usize) -> Result<(), KvError> {
        let reserved = match self.sessions.get_mut(&id) {
            Some(slot) => slot.kv.reserve(positions),
            None => return Ok(()),
        };
        match reserved {
            Err(KvError::Exhausted { wanted, free }) if self.reclaim_cached(wanted, free) => self
                .sessions
                .get_mut(&id)
                .map_or(Ok(()), |slot| slot.kv.reserve(positions)),
            other => other,
        }
    }

    /// Puts a session back as `undo` says, after its call stopped halfway.
    /// When its pages were given back for an in-place truncation, the old
    /// history is queued to be fed again as the session's next work.
    pub(super) fn apply_undo(&mut self, id: SessionId, undo: Undo) -> Result<(), RuntimeError> {
        let slot = self.sessions.get_mut(&id).ok_or(RuntimeError::NotFound)?;
        slot.feed.clear();
        slot.truncated = undo.truncated;
        slot.logits_digest.set(None);
        // Pages it had listed may be cut off: list again from the start.
        slot.prefix = Some(PrefixCursor::START);
        let recompute = match undo.kind {
            UndoKind::Shorten(len) => {
                slot.history.truncate(len);
                slot.kv.roll_back_to(len)?;
                slot.next_logits = undo.next_logits;
                None
            }
            UndoKind::SwapBack { kv, history } => {
                let mut partial = std::mem::replace(&mut slot.kv, kv);
                slot.history = history;
                slot.next_logits = undo.next_logits;
                partial.release()?;
                None
            }
            UndoKind::Recompute { history } => {
                slot.kv.release()?;
                slot.history.clear();
                slot.next_logits.clear();
                Some(history)
            }
        };
        if let Some(history) = &recompute {
            self.reserve_own_pages_again(id, history.len())
                .map_err(|e| match e {
                    KvError::Exhausted { wanted, free } => kv_exhausted(wanted, free),
                    e => e.into(),
                })?;
        }
        let slot = self.sessions.get_mut(&id).ok_or(RuntimeError::NotFound)?;
        if let Some(history) = recompute {
            slot.active = Some(Active::restore(history));
        }
        // The one deliberate decrease of the committed length (INV-2).
        slot.high_water = slot.kv.len();
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
    pub(super) fn shift_window(&mut self, id: SessionId) -> bool {
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
        // The history before the call's first shift, for taking the whole
        // call back if its end cannot be journaled.
        let before =
            (!gen.rewritten).then(|| (slot.history[..gen.history_start].to_vec(), slot.truncated));
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
}

/// Writes a session being spilled's pages out, within the bytes spilled
/// sessions may hold on disk in all. Returns the file and its bytes, or
/// `None` when nothing was written (the session is computed again when
/// called).
fn spill_out(
    store: &crate::durable::SessionStore,
    id: SessionId,
    slot: &SessionSlot,
    spill_bytes: &AtomicU64,
    max_spill_bytes: u64,
) -> Option<(std::path::PathBuf, u64)> {
    let pool = slot.kv.pool();
    let page = pool.layout().page_positions;
    if !pool.holds_rows() || slot.history.len() <= page {
        return None;
    }
    // Claimed before writing, so workers spilling at once stay within it:
    // at most every page held, each with its table entry.
    let page_bytes = pool.layout().page_values() * 2;
    let estimate = crate::durable::spill_estimate(slot.kv.pages_held(), page_bytes);
    // Within the state directory's limits too; past them only the history
    // is kept, as past `max_spill_bytes`.
    if let Err(refusal) = store.admit(estimate) {
        tracing::debug!(session = %id, "spilling its history only: {refusal}");
        return None;
    }
    spill_bytes
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            (held.saturating_add(estimate) <= max_spill_bytes).then_some(held + estimate)
        })
        .ok()?;
    let path = store.spill_path(id);
    match crate::durable::write_spill(&path, &slot.kv, &slot.history) {
        Ok(bytes) => {
            // The claim becomes what was written (never more).
            spill_bytes.fetch_sub(estimate.saturating_sub(bytes), Ordering::AcqRel);
            store.budget().grew(bytes.min(estimate));
            Some((path, bytes.min(estimate)))
        }
        Err(e) => {
            tracing::warn!(session = %id, "writing spilled pages out: {e}");
            let _ = std::fs::remove_file(&path);
            spill_bytes.fetch_sub(estimate, Ordering::AcqRel);
            None
        }
    }
}
