//! What of a session the state directory keeps: its journal (each change
//! of the history, durable before the call that made it is answered), the
//! page hints and logits digest beside it, its spill file while it is
//! evicted but kept, and how a session read back at start takes its place.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{digest, Session};
use crate::durable::{JournalFile, Record, SessionStore};
use crate::kv::{KvError, SessionKv};
use crate::runtime::stats::Counters;
use crate::runtime::{RuntimeError, SessionId};

/// Counts a journal that could not be started or written.
pub(crate) fn count_journal_failure(counters: &Counters) {
    counters.journal_failures.fetch_add(1, Ordering::Relaxed);
}

impl Session {
    /// Keeps the session's history in `journal` from now on.
    pub(crate) fn attach_journal(&mut self, journal: JournalFile) {
        self.journal = Some(journal);
    }

    /// Journals a change of the history (the history already holds it),
    /// durable as the store's policy says, before the call that made it is
    /// answered. An error means the change is not kept: the caller must
    /// undo it and fail the call (the journal still holds the history
    /// before it). Counted and logged here.
    pub(crate) fn journal(
        &mut self,
        record: Record,
        counters: &Counters,
    ) -> Result<(), RuntimeError> {
        let Some(journal) = &mut self.journal else {
            return Ok(());
        };
        let result = journal.append(&record, &self.history);
        if let Record::Reset(_) = record {
            // A rewritten file starts its hints over.
            self.hinted.clear();
        }
        result.map_err(|e| {
            count_journal_failure(counters);
            tracing::error!(
                label = %self.label,
                "session journal write failed, the call is undone: {e}"
            );
            // A rewrite (after a failure, or a reset) starts the hints over.
            self.hinted.clear();
            RuntimeError::NotDurable(e.to_string())
        })
    }

    /// Journals the history's logits digest and where its newly full pages
    /// lie in the kept page file, beside the journal (hints: not synced, and
    /// one lost costs only a recompute).
    pub(crate) fn journal_pages(&mut self, counters: &Counters) {
        let Some(journal) = &mut self.journal else {
            return;
        };
        // Pages on a device do not outlive the process: no hints for them.
        let rows = self.kv.pool().maps_rows();
        let page = self.kv.pool().layout().page_positions;
        let full = if rows {
            self.kv.len().min(self.history.len()) / page
        } else {
            0
        };
        // Hints written again (after a spill moved the pages, say) pile up:
        // past twice what one set for the history needs, they start over.
        let n_layers = self.kv.pool().layout().n_layers as u64;
        let needed = (12 * n_layers + 13) * full as u64 + 40;
        if journal.hint_bytes() > 2 * needed + (1 << 20) {
            journal.clear_hints();
            self.hinted.clear();
        }
        // What GetSessionInfo reports, for a restart that does not compute
        // it (a session that comes back spilled).
        if !self.next_logits.is_empty() {
            let d = self
                .logits_digest
                .get()
                .unwrap_or_else(|| digest(&self.next_logits));
            self.logits_digest.set(Some(d));
            if let Some(expected) = self.expected_digest.take() {
                if expected != d {
                    counters
                        .restore_digest_mismatches
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::error!(
                        label = %self.label,
                        expected,
                        computed = d,
                        "a restored session's logits differ from what its journal recorded"
                    );
                }
            }
            if let Err(e) = journal.hint_digest(&self.history, d) {
                tracing::debug!(label = %self.label, "a logits digest hint was not written: {e}");
            }
        }
        if !rows {
            return;
        }
        let chain = crate::durable::page_chain(&self.history, page, full);
        let same = self
            .hinted
            .iter()
            .zip(&chain)
            .take_while(|(a, b)| a == b)
            .count();
        self.hinted.truncate(same);
        if same == full {
            return;
        }
        let Some(records) = crate::durable::hint_records(&self.kv, &chain, same) else {
            return;
        };
        for hints in records {
            if let Err(e) = journal.hint_pages(&hints) {
                tracing::debug!(label = %self.label, "page hints were not written: {e}");
                // Whatever was half written went with the file.
                self.hinted.clear();
                return;
            }
        }
        self.hinted = chain;
    }

    /// Spills the session (it holds a spilled place now): its logits go
    /// (their digest is kept), its pages are written out to the state
    /// directory when `store` has room for them within `max_spill_bytes`
    /// of all spill files (`spill_bytes`), and its KV is given back.
    pub(crate) fn spill(
        &mut self,
        id: SessionId,
        store: Option<&SessionStore>,
        spill_bytes: &AtomicU64,
        max_spill_bytes: u64,
    ) -> Result<(), KvError> {
        if self.logits_digest.get().is_none() {
            self.logits_digest.set(Some(digest(&self.next_logits)));
        }
        self.logits_home();
        self.next_logits = Vec::new();
        self.prefix = Some(super::PrefixCursor::START);
        self.high_water = 0;
        self.spilled = true;
        // The pages move: hints of where they were are stale.
        self.hinted.clear();
        if let Some(store) = store {
            self.spill_file = self.spill_out(store, id, spill_bytes, max_spill_bytes);
        }
        self.kv.release()
    }

    /// Writes the session's pages out, within the bytes spilled sessions
    /// may hold on disk in all. Returns the file and its bytes, or `None`
    /// when nothing was written (the session is computed again when
    /// called).
    fn spill_out(
        &self,
        store: &SessionStore,
        id: SessionId,
        spill_bytes: &AtomicU64,
        max_spill_bytes: u64,
    ) -> Option<(PathBuf, u64)> {
        let pool = self.kv.pool();
        let page = pool.layout().page_positions;
        if !pool.holds_rows() || self.history.len() <= page {
            return None;
        }
        // Claimed before writing, so workers spilling at once stay within
        // it: at most every page held, each with its table entry.
        let page_bytes = pool.layout().page_values() * 2;
        let estimate = crate::durable::spill_estimate(self.kv.pages_held(), page_bytes);
        // Within the state directory's limits too; past them only the
        // history is kept, as past `max_spill_bytes`.
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
        match crate::durable::write_spill(&path, &self.kv, &self.history) {
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

    /// The history of a spilled session coming back, taken out while its
    /// pages are mapped and reserved; [`Session::put_back_history`] if they
    /// cannot be, [`Session::unspilled`] once they are.
    pub(crate) fn take_history(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.history)
    }

    pub(crate) fn put_back_history(&mut self, history: Vec<u32>) {
        self.history = history;
    }

    /// The spilled session has its place and the pages for `history` (the
    /// first `mapped` tokens mapped from shared pages): what its spill file
    /// holds beyond them is read back, checked page by page. Returns the
    /// tokens read back and the rest of the history, to be fed again.
    pub(crate) fn unspilled(
        &mut self,
        id: SessionId,
        history: &[u32],
        mapped: usize,
        store: Option<&SessionStore>,
        spill_bytes: &AtomicU64,
        counters: &Counters,
    ) -> (usize, Vec<u32>) {
        self.spilled = false;
        // What it reported while spilled is what its KV must compute again.
        self.expected_digest = self.logits_digest.get();
        let mut read = 0;
        if let Some((path, bytes)) = self.spill_file.take() {
            match crate::durable::read_spill(&path, &mut self.kv, history) {
                Ok(n) => read = n,
                Err(e) => tracing::warn!(session = %id, "reading spilled pages back: {e}"),
            }
            spill_gone(store, &path, bytes);
            spill_bytes.fetch_sub(bytes, Ordering::Relaxed);
        }
        if read > 0 {
            self.history
                .extend_from_slice(&history[mapped..mapped + read]);
            self.high_water = self.kv.len();
            counters
                .spill_read_tokens
                .fetch_add(read as u64, Ordering::Relaxed);
        }
        let done = mapped + read;
        (read, history[done..].to_vec())
    }

    /// A session read back at start that found no place or pages now: kept
    /// spilled with its whole `history`, fed when first called; until then
    /// it reports the digest its journal recorded. Returns the bytes of
    /// the spill file it keeps.
    pub(crate) fn restored_spilled(
        &mut self,
        history: Vec<u32>,
        journaled_digest: Option<u64>,
        spill: Option<(PathBuf, u64)>,
    ) -> u64 {
        self.history = history;
        self.spilled = true;
        self.logits_digest.set(journaled_digest);
        let bytes = spill.as_ref().map_or(0, |(_, bytes)| *bytes);
        self.spill_file = spill;
        bytes
    }

    /// A session read back at start into its KV, which holds `history`'s
    /// first `kv.len()` positions (`from_page_file` of them taken back from
    /// the page file, whose hints the journal already holds). Returns the
    /// rest of the history, to be fed again.
    pub(crate) fn restored_resident(
        &mut self,
        history: &[u32],
        from_page_file: usize,
        journaled_digest: Option<u64>,
    ) -> Vec<u32> {
        let kept = self.kv.len();
        let page = self.kv.pool().layout().page_positions;
        self.hinted = crate::durable::page_chain(history, page, from_page_file / page);
        self.history = history[..kept].to_vec();
        self.high_water = kept;
        self.expected_digest = journaled_digest;
        history[kept..].to_vec()
    }

    /// The session ends: its journal and spill file are deleted. Returns
    /// the bytes the spill file held (0 without one).
    pub(crate) fn discard_files(&mut self, id: SessionId, store: Option<&SessionStore>) -> u64 {
        if let Some(journal) = self.journal.take() {
            if let Err(e) = journal.remove() {
                tracing::error!(session = %id, "deleting the session's journal: {e}");
            }
        }
        match self.spill_file.take() {
            Some((path, bytes)) => {
                spill_gone(store, &path, bytes);
                bytes
            }
            None => 0,
        }
    }
}

/// Deletes a spill file that was read back or whose session ended, giving
/// its bytes back to the state directory's budget.
pub(crate) fn spill_gone(store: Option<&SessionStore>, path: &Path, bytes: u64) {
    if std::fs::remove_file(path).is_ok() {
        if let Some(store) = store {
            store.budget().shrank(bytes);
        }
    }
}

/// A kept session's KV read back from its spill file at start (a resident
/// restore): the pages beyond those `kv` already holds. Returns the tokens
/// read.
pub(crate) fn read_spill_at_start(
    id: SessionId,
    kv: &mut SessionKv,
    history: &[u32],
    spill: (PathBuf, u64),
    store: Option<&SessionStore>,
) -> usize {
    let (path, bytes) = spill;
    let read = match crate::durable::read_spill(&path, kv, history) {
        Ok(read) => read,
        Err(e) => {
            tracing::warn!(session = %id, "reading spilled pages back: {e}");
            0
        }
    };
    spill_gone(store, &path, bytes);
    read
}
