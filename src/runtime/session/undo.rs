//! Taking a session's change back: the session as it was before a call
//! began to change it, so that a call that fails, expires or is cancelled
//! halfway leaves nothing half-done (the history is append-only to
//! clients, so cutting the KV back is safe), and the restarts a truncation
//! makes (fresh pages beside the old ones, or the session's own pages
//! given back to be computed again).

use super::prefix::PrefixCursor;
use super::Session;
use crate::kv::{KvError, SessionKv};

/// How to put a session back as it was before a call changed it.
pub(crate) struct Undo {
    pub(crate) kind: UndoKind,
    pub(crate) next_logits: Vec<f32>,
    pub(crate) truncated: u64,
}

pub(crate) enum UndoKind {
    /// Tokens were only added: cut the history and KV back to this length.
    Shorten(usize),
    /// A truncation re-prefills into fresh pages; the session's own pages
    /// and history wait here until it is done.
    SwapBack { kv: SessionKv, history: Vec<u32> },
    /// A truncation re-prefills into the session's own pages (nothing else
    /// could be had): the old history has to be computed again.
    Recompute { history: Vec<u32> },
}

impl Session {
    /// The undo of a call that only adds tokens after the history's first
    /// `len` (its logits and truncation count are the ones now).
    pub(crate) fn undo_to(&self, len: usize) -> Undo {
        debug_assert!(
            !self.logits_kept || !self.next_logits.is_empty(),
            "logits kept by the layers were not brought home first"
        );
        Undo {
            kind: UndoKind::Shorten(len),
            next_logits: self.next_logits.clone(),
            truncated: self.truncated,
        }
    }

    /// Swaps `fresh` (empty, with the kept window's positions reserved) in
    /// for the session's KV, to feed a truncated history into; the old KV
    /// and history wait in the undo until the window is in.
    pub(crate) fn swap_in(&mut self, fresh: SessionKv) -> Undo {
        self.logits_home();
        let kv = std::mem::replace(&mut self.kv, fresh);
        let undo = Undo {
            kind: UndoKind::SwapBack {
                kv,
                history: std::mem::take(&mut self.history),
            },
            next_logits: std::mem::take(&mut self.next_logits),
            truncated: self.truncated,
        };
        self.restarted();
        undo
    }

    /// Gives the session's own pages back to be reserved again for a
    /// truncated history (the last resort of a truncation): the old
    /// history can only be computed again.
    pub(crate) fn give_back_pages(&mut self) -> Result<Undo, KvError> {
        self.kv.release()?;
        self.logits_home();
        let undo = Undo {
            kind: UndoKind::Recompute {
                history: std::mem::take(&mut self.history),
            },
            next_logits: std::mem::take(&mut self.next_logits),
            truncated: self.truncated,
        };
        self.restarted();
        Ok(undo)
    }

    /// Empty again: no logits, nothing committed, nothing listed.
    fn restarted(&mut self) {
        self.logits_digest.set(None);
        self.high_water = 0;
        self.prefix = Some(PrefixCursor::START);
    }

    /// Puts the session back as `undo` says. Returns the history to feed
    /// again when its pages were given back (its KV is then empty, with
    /// nothing reserved: the caller reserves and feeds it).
    pub(crate) fn roll_back(&mut self, undo: Undo) -> Result<Option<Vec<u32>>, KvError> {
        self.truncated = undo.truncated;
        self.logits_digest.set(None);
        self.logits_kept = false;
        // Pages it had listed may be cut off: list again from the start.
        self.prefix = Some(PrefixCursor::START);
        let recompute = match undo.kind {
            UndoKind::Shorten(len) => {
                self.history.truncate(len);
                self.kv.roll_back_to(len)?;
                self.next_logits = undo.next_logits;
                None
            }
            UndoKind::SwapBack { kv, history } => {
                let mut partial = std::mem::replace(&mut self.kv, kv);
                self.history = history;
                self.next_logits = undo.next_logits;
                partial.release()?;
                None
            }
            UndoKind::Recompute { history } => {
                self.kv.release()?;
                self.history.clear();
                self.next_logits.clear();
                Some(history)
            }
        };
        Ok(recompute)
    }

    /// The committed length after a roll back: the one deliberate decrease
    /// of it (INV-2).
    pub(crate) fn recommit(&mut self) {
        self.high_water = self.kv.len();
    }

    /// The undo that takes back every token a Generate added after its
    /// history's first `start` tokens, and the token to feed again after
    /// it. Its last position's logits were not kept: the KV is cut back
    /// before it and it is fed again. The KV was settled past there as
    /// tokens came; a sliding-window layer may have given back pages the
    /// shorter history reads, and then (as after a window shift, whose
    /// history before the call is `before_rewrite`) the history is
    /// computed again.
    pub(crate) fn take_back_undo(
        &mut self,
        start: usize,
        before_rewrite: Option<(Vec<u32>, u64)>,
    ) -> (Undo, Option<u32>) {
        let cut = start.saturating_sub(1);
        let recompute = match before_rewrite {
            Some(before) => Some(before),
            None if self.kv.cut_back_to(cut).is_err() => {
                Some((self.history[..start].to_vec(), self.truncated))
            }
            None => None,
        };
        if let Some((history, truncated)) = recompute {
            let undo = Undo {
                kind: UndoKind::Recompute { history },
                next_logits: Vec::new(),
                truncated,
            };
            return (undo, None);
        }
        let last = start
            .checked_sub(1)
            .and_then(|at| self.history.get(at).copied());
        let undo = Undo {
            kind: UndoKind::Shorten(cut),
            next_logits: Vec::new(),
            truncated: self.truncated,
        };
        (undo, last)
    }
}
