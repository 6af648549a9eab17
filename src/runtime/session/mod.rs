//! One session's own state and the operations on it: the history and the KV
//! that caches it, the invariants between them, its logits, its journal and
//! spill file ([`durable`](self::durable)), its place in the shared-prefix
//! index ([`prefix`](self::prefix)) and how a change is taken back
//! ([`undo`](self::undo)).
//!
//! A `Session` never looks anything up and knows nothing of queues, batches
//! or other sessions: the worker that owns it schedules, finds it once per
//! operation and passes it by reference.

mod durable;
mod prefix;
mod undo;

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use super::stats::Counters;
use super::step::{StepFeed, StepRunner};
use super::{RuntimeError, SessionId, SessionInfo, Tenant};
use crate::durable::JournalFile;
use crate::kv::SessionKv;
use crate::model::LogitsWanted;
use prefix::PrefixCursor;

pub(crate) use durable::{count_journal_failure, read_spill_at_start};
pub(crate) use undo::{Undo, UndoKind};

/// A session: what it holds and what it is.
pub(crate) struct Session {
    kv: SessionKv,
    history: Vec<u32>,
    next_logits: Vec<f32>,
    /// The layers hold the next logits where they computed them (a GPU
    /// runner's kept logits, see [`StepRunner::keeps_logits`]);
    /// `next_logits` is empty or a copy of them.
    logits_kept: bool,
    /// `digest(next_logits)`, computed on the first GetSessionInfo after the
    /// logits changed (hashing 49k logits costs ~0.2 ms of worker time).
    logits_digest: Cell<Option<u64>>,
    label: String,
    eos: Vec<u32>,
    /// The tenant the session belongs to (CONTRACT §2.10).
    owner: Tenant,
    /// INV-1 violations seen on this session (cached positions against
    /// history length).
    inv1_violations: u64,
    /// INV-2 violations seen on this session (a cached length that went
    /// down).
    inv2_violations: u64,
    /// Tokens dropped so far by context-overflow truncation.
    truncated: u64,
    /// Committed KV length after the last mutation; it must never decrease
    /// except through a deliberate truncation, which resets it.
    high_water: usize,
    /// How far the history's full pages are listed in the shared-prefix
    /// index (`None`: they are not, and will not be).
    prefix: Option<PrefixCursor>,
    /// The session's journal in the state directory (`None` without one).
    journal: Option<JournalFile>,
    /// The chain hashes of the blocks whose page hints the journal holds,
    /// so a history changed below them is hinted again.
    hinted: Vec<u64>,
    /// Spilled with its pages written out: the file and its bytes.
    spill_file: Option<(PathBuf, u64)>,
    /// Restored: the digest its journal recorded, checked once its logits
    /// are computed again.
    expected_digest: Option<u64>,
    /// Evicted to make room but kept: no KV and no logits (their digest is
    /// kept), the history to be fed again before its next call.
    spilled: bool,
}

impl Session {
    /// A session of `owner` holding `kv`, with an empty history.
    pub(crate) fn new(kv: SessionKv, label: String, eos: Vec<u32>, owner: Tenant) -> Self {
        Session {
            owner,
            high_water: kv.len(),
            kv,
            history: Vec::new(),
            next_logits: Vec::new(),
            logits_kept: false,
            logits_digest: Cell::new(None),
            label,
            eos,
            inv1_violations: 0,
            inv2_violations: 0,
            truncated: 0,
            prefix: Some(PrefixCursor::START),
            journal: None,
            hinted: Vec::new(),
            spill_file: None,
            expected_digest: None,
            spilled: false,
        }
    }

    /// A fork of this session holding `kv` (its first `kv.len()` positions,
    /// with room for `at`): the fork, and the tokens up to `at` it must
    /// feed again (short of the end, the logits after `at` are not kept).
    pub(crate) fn fork(
        &self,
        kv: SessionKv,
        at: usize,
        label: Option<String>,
        owner: Tenant,
    ) -> (Session, Vec<u32>) {
        let label = label.unwrap_or_else(|| self.label.clone());
        let mut fork = Session::new(kv, label, self.eos.clone(), owner);
        let kept = fork.kv.len();
        fork.history.extend_from_slice(&self.history[..kept]);
        fork.truncated = self.truncated;
        let refeed = self.history[kept..at].to_vec();
        if refeed.is_empty() && at == self.history.len() {
            fork.next_logits.clone_from(&self.next_logits);
            fork.logits_digest.set(self.logits_digest.get());
        }
        (fork, refeed)
    }

    pub(crate) fn history(&self) -> &[u32] {
        &self.history
    }

    pub(crate) fn kv(&self) -> &SessionKv {
        &self.kv
    }

    /// The next logits on the host (empty while only the layers hold them).
    pub(crate) fn next_logits(&self) -> &[f32] {
        &self.next_logits
    }

    /// Whether the layers hold the next logits (sample them there).
    pub(crate) fn logits_kept(&self) -> bool {
        self.logits_kept
    }

    /// Copies logits only the layers hold to the host, where undo, fork,
    /// spill and the journal's digest read them.
    pub(crate) fn bring_logits_home(
        &mut self,
        id: SessionId,
        runner: &dyn StepRunner,
    ) -> Result<(), RuntimeError> {
        if self.logits_kept && self.next_logits.is_empty() {
            self.next_logits = runner.kept_logits(id)?;
        }
        Ok(())
    }

    /// The next logits now live on the host only (after an undo, a spill).
    fn logits_home(&mut self) {
        debug_assert!(
            !self.logits_kept || !self.next_logits.is_empty() || self.history.is_empty(),
            "logits kept by the layers were not brought home first"
        );
        self.logits_kept = false;
    }

    pub(crate) fn label(&self) -> &str {
        &self.label
    }

    pub(crate) fn eos(&self) -> &[u32] {
        &self.eos
    }

    pub(crate) fn owner(&self) -> &Tenant {
        &self.owner
    }

    pub(crate) fn truncated(&self) -> u64 {
        self.truncated
    }

    /// Counts `dropped` more tokens lost to context-overflow truncation.
    pub(crate) fn add_truncated(&mut self, dropped: u64) {
        self.truncated += dropped;
    }

    /// Spilled: no KV and no logits, its history fed again when called.
    pub(crate) fn is_spilled(&self) -> bool {
        self.spilled
    }

    /// Whether the session has a journal (a state directory keeps it).
    pub(crate) fn is_durable(&self) -> bool {
        self.journal.is_some()
    }

    /// Whether a Generate can start: it samples from the logits after a
    /// non-empty history.
    pub(crate) fn check_can_generate(&self) -> Result<(), RuntimeError> {
        if self.history.is_empty() || (self.next_logits.is_empty() && !self.logits_kept) {
            return Err(RuntimeError::invalid(
                "cannot generate from an empty history: append tokens first",
            ));
        }
        Ok(())
    }

    /// Reserves KV for `total` positions (all or nothing).
    pub(crate) fn reserve(&mut self, total: usize) -> Result<(), crate::kv::KvError> {
        self.kv.reserve(total)
    }

    /// This step's input for the layers: `tokens` after the history.
    pub(crate) fn step_feed<'a>(
        &'a mut self,
        id: SessionId,
        tokens: &'a [u32],
        logits: LogitsWanted,
    ) -> StepFeed<'a> {
        StepFeed {
            session: id,
            history: &self.history,
            kv: &mut self.kv,
            tokens,
            logits,
            keep_logits: false,
        }
    }

    /// Cuts the KV back to `len` positions, dropping what a step computed
    /// past the history it will commit (speculation's refused tokens),
    /// before that commit; the committed length is not touched.
    pub(crate) fn drop_uncommitted(&mut self, len: usize) -> Result<(), crate::kv::KvError> {
        debug_assert!(len >= self.history.len(), "only uncommitted positions go");
        self.kv.roll_back_to(len)
    }

    /// A step went through: `fed` joins the history, `logits` (the last fed
    /// position's row, when it was asked for) become the next logits, and
    /// the invariants are checked.
    pub(crate) fn commit_fed(
        &mut self,
        fed: &[u32],
        logits: Option<&[f32]>,
        counters: &Counters,
    ) -> Result<(), RuntimeError> {
        self.history.extend_from_slice(fed);
        if let Some(row) = logits {
            self.next_logits.clear();
            self.logits_digest.set(None);
            self.next_logits.extend_from_slice(row);
            self.logits_kept = false;
        }
        self.check_invariants(counters)
    }

    /// As [`Session::commit_fed`], with the last fed position's logits
    /// held by the layers.
    pub(crate) fn commit_fed_kept(
        &mut self,
        fed: &[u32],
        counters: &Counters,
    ) -> Result<(), RuntimeError> {
        self.history.extend_from_slice(fed);
        self.next_logits.clear();
        self.logits_digest.set(None);
        self.logits_kept = true;
        self.check_invariants(counters)
    }

    /// INV-1 (cached positions = history length, within the pages held) and
    /// INV-2 (the committed length never went down).
    fn check_invariants(&mut self, counters: &Counters) -> Result<(), RuntimeError> {
        let kv_len = self.kv.len();
        if kv_len < self.high_water {
            self.inv2_violations += 1;
            counters.inv2_violations.fetch_add(1, Ordering::Relaxed);
            return Err(RuntimeError::FailedPrecondition(format!(
                "INV-2: KV length went from {} down to {kv_len}",
                self.high_water
            )));
        }
        if kv_len != self.history.len() || kv_len > self.kv.capacity() {
            self.inv1_violations += 1;
            counters.inv1_violations.fetch_add(1, Ordering::Relaxed);
            return Err(RuntimeError::FailedPrecondition(format!(
                "INV-1: {kv_len} cached positions for a history of {} ({} reserved)",
                self.history.len(),
                self.kv.capacity()
            )));
        }
        self.high_water = kv_len;
        Ok(())
    }

    /// Gives back the KV pages its sliding-window layers will not read
    /// again (once its call can no longer be undone).
    pub(crate) fn settle(&mut self) -> Result<(), crate::kv::KvError> {
        self.kv.settle()
    }

    /// The digest of the next logits (computed once after they change),
    /// from the layers' copy when only they hold them.
    fn logits_digest(&self, id: SessionId, runner: &dyn StepRunner) -> u64 {
        if let Some(d) = self.logits_digest.get() {
            return d;
        }
        let d = if self.logits_kept && self.next_logits.is_empty() {
            match runner.kept_logits(id) {
                Ok(logits) => digest(&logits),
                Err(e) => {
                    tracing::error!(session = %id, "reading kept logits for their digest: {e}");
                    return 0;
                }
            }
        } else {
            digest(&self.next_logits)
        };
        self.logits_digest.set(Some(d));
        d
    }

    /// What GetSessionInfo reports: `history_length` is the committed
    /// length the worker counts (a history being fed again counts whole),
    /// `backend` where the layers run.
    pub(crate) fn info(
        &self,
        id: SessionId,
        runner: &dyn StepRunner,
        backend: &'static str,
        history_length: usize,
        busy: bool,
        idle_seconds: f64,
    ) -> SessionInfo {
        SessionInfo {
            history_length: history_length as u64,
            kv_live_bytes: runner.kv_live_bytes(&self.kv),
            inv1_violations: self.inv1_violations,
            inv2_violations: self.inv2_violations,
            idle_seconds,
            pages_held: self.kv.pages_held() as u64,
            client_label: self.label.clone(),
            eos_token_ids: self.eos.clone(),
            truncated_token_count: self.truncated,
            busy,
            logits_digest: match self.logits_digest.get() {
                Some(d) => d,
                // Restored spilled at start from a journal that recorded no
                // digest: its logits were never computed.
                None if self.spilled => 0,
                None => self.logits_digest(id, runner),
            },
            durable: self.journal.is_some(),
            backend,
            speculation: Default::default(),
        }
    }

    /// Gives the session's KV pages back (it is being removed).
    pub(crate) fn release_kv(&mut self) -> Result<(), crate::kv::KvError> {
        self.kv.release()
    }

    #[cfg(test)]
    pub(crate) fn break_inv1_for_test(&mut self) {
        self.history.push(7);
    }

    #[cfg(test)]
    pub(crate) fn break_inv2_for_test(&mut self) {
        self.high_water = 10;
    }
}

/// The first `sink` tokens plus the most recent ones, `keep` in all.
pub(crate) fn keep_window(history: &[u32], sink: usize, keep: usize) -> Vec<u32> {
    if history.len() <= keep {
        return history.to_vec();
    }
    let sink = sink.min(keep);
    let mut kept = history[..sink].to_vec();
    kept.extend_from_slice(&history[history.len() - (keep - sink)..]);
    kept
}

/// FNV-1a over the bits of `values`.
pub(crate) fn digest(values: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in values {
        for b in v.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
