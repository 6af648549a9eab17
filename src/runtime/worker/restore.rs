//! Sessions read back from the state directory at start: each takes its
//! place (resident, or spilled when there is no room) with the pages the
//! page file gave back, and its history's rest is fed again first.

use super::*;

impl Worker {
    /// Adds a session read back from the state directory, its history to be
    /// fed again as its first work (calls on it wait behind that). Nothing
    /// is evicted for it: one that finds no place or no pages is added
    /// spilled (fed when first called), and one that finds no spilled place
    /// either is left in the directory for a later start, and reported.
    pub(super) fn restore(&mut self, session: Recovered) {
        let Recovered {
            id,
            label,
            eos,
            owner,
            history,
            pages,
            digest: journaled_digest,
            spill,
            journal,
            torn_bytes,
            ..
        } = session;
        let refuse = |why: &str| {
            tracing::error!(session = %id, "not restored: {why}; its journal stays for a later start");
        };
        if self.sessions.contains_key(&id) {
            return refuse("a session with its id exists");
        }
        if torn_bytes > 0 {
            tracing::warn!(session = %id, torn_bytes, "a torn last journal write was dropped");
        }
        let mut kv = SessionKv::new(Arc::clone(&self.kv_pool));
        // The pages taken back from the page file are this session's now;
        // dropping `kv` gives them back.
        if let Err(e) = kv.adopt_kept(&pages) {
            tracing::error!(session = %id, "taking back kept pages: {e}");
            let allocator = self.kv_pool.allocator();
            for &page in pages.iter().flat_map(|row| row.iter()).flatten() {
                let _ = allocator.free(page);
            }
        }
        let resident = self.claim_session()
            && (kv.reserve(history.len()).is_ok() || {
                self.shared.live_sessions.fetch_sub(1, Ordering::AcqRel);
                false
            });
        if !resident {
            kv = SessionKv::new(Arc::clone(&self.kv_pool));
        }
        let from_page_file = kv.len();
        // Layers run by shards may still hold (or have kept on disk) the
        // history's first positions: those are not fed again.
        if resident && from_page_file == 0 {
            let held = self.runner.resume(id, &history);
            if held > 0 {
                if let Err(e) = kv.commit(held) {
                    tracing::error!(session = %id, "committing resumed positions: {e}");
                    self.runner.release(id);
                }
            }
        }
        let taken_back = kv.len();
        // A session spilled when the last run ended: what its spill file
        // holds beyond the pages taken back is read back now (resident),
        // or when it is first called (spilled).
        let mut spill = spill;
        if resident {
            if let Some(file) = spill.take() {
                let state = self.cfg.state.as_deref();
                let read = read_spill_at_start(id, &mut kv, &history, file, state);
                self.shared
                    .counters
                    .spill_read_tokens
                    .fetch_add(read as u64, Ordering::Relaxed);
            }
        }
        if !resident && !self.claim_spilled_place() {
            self.shared
                .counters
                .restore_refused
                .fetch_add(1, Ordering::Relaxed);
            // Its spill file stays with it, for the start that restores it.
            journal.keep();
            return refuse("no session place or KV pages, and the spilled sessions are full");
        }
        let tokens = history.len();
        let kept = kv.len();
        let mut session = Session::new(kv, label, eos, owner);
        session.attach_journal(journal);
        let slot = if !resident {
            // No place or pages now: kept spilled, fed when first called.
            let bytes = session.restored_spilled(history, journaled_digest, spill);
            self.shared.spill_bytes.fetch_add(bytes, Ordering::Relaxed);
            SessionSlot::new(session)
        } else if !history.is_empty() {
            let rest = session.restored_resident(&history, from_page_file, journaled_digest);
            let mut slot = SessionSlot::new(session);
            slot.active = Some(Active::restore(rest));
            slot
        } else {
            SessionSlot::new(session)
        };
        if taken_back > 0 {
            self.shared
                .counters
                .restore_kept_tokens
                .fetch_add(taken_back as u64, Ordering::Relaxed);
        }
        self.add_session(id, slot);
        self.shared
            .counters
            .sessions_restored
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(session = %id, worker = self.index, tokens, kept, spilled = !resident, "session restored");
    }
}
