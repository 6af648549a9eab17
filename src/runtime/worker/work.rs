//! What a worker keeps per session to schedule it: the session, the
//! operation running on it (an append, a Generate, a restore, a fork) with
//! its undo, the ones queued behind, and the small answers its rooms give.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::notify::NotifySender;
use super::super::session::{Session, Undo};
use super::super::{
    AppendReply, CreateSession, ForkReply, GenerateEvent, RuntimeError, SessionId,
    SpeculationCounts, StopReason, Tenant,
};
use super::commands::{Op, Reply};
use super::draft::DraftKv;
use crate::constraint::Constraint;
use crate::model::LogitsWanted;
use crate::sampler::{CheckedParams, TokenLogprobs};
use crate::speculate::Lookup;

pub(super) struct Queued {
    pub(super) op: Op,
    pub(super) deadline: Option<Instant>,
}

/// A CreateSession waiting for another worker to evict a session.
pub(super) struct WaitingCreate {
    pub(super) id: SessionId,
    pub(super) owner: Tenant,
    pub(super) req: CreateSession,
    pub(super) reply: Reply<SessionId>,
    pub(super) deadline: Option<Instant>,
    pub(super) since: Instant,
    pub(super) transient: bool,
}

/// A Generate in progress.
pub(super) struct Generating {
    pub(super) params: CheckedParams,
    pub(super) seed_used: u64,
    pub(super) max_tokens: u32,
    pub(super) stop_sequences: Vec<Vec<u32>>,
    pub(super) generated: Vec<u32>,
    pub(super) events: NotifySender<GenerateEvent>,
    pub(super) cancel: Arc<AtomicBool>,
    pub(super) deadline: Option<Instant>,
    pub(super) started: Instant,
    pub(super) prefill_duration: Duration,
    /// History tokens computed again before the first sampled token.
    pub(super) prefill_tokens: u64,
    /// Log-probabilities to report with each token (0: none).
    pub(super) top_logprobs: usize,
    /// The report for the token sampled and not yet emitted.
    pub(super) pending_logprobs: Option<TokenLogprobs>,
    /// A window shift in progress: the tokens it dropped, reported as
    /// `Truncated` once the kept window is in (never if the call stops
    /// first and the shift is undone).
    pub(super) shift_dropped: Option<u64>,
    /// The history's length when the call began, and whether a window
    /// shift rewrote it since: what the journal records at the end.
    pub(super) history_start: usize,
    pub(super) rewritten: bool,
    /// The history (and truncation count) before the call, kept from its
    /// first window shift on.
    pub(super) before_rewrite: Option<(Vec<u32>, u64)>,
    /// What the output must match, and the tokens it allows next (filled
    /// before each sample).
    pub(super) constraint: Option<Box<Constraint>>,
    pub(super) mask: Vec<u32>,
    /// The call's proposer when it speculates (`speculate.rs`), and what
    /// speculation did in it.
    pub(super) proposer: Option<Proposer>,
    pub(super) speculation: SpeculationCounts,
}

/// Where a speculating Generate's proposals come from.
pub(super) enum Proposer {
    /// Its own history (the call's lookup and what it learned).
    Lookup(Box<Lookup>),
    /// The worker's draft model, from the session's draft KV
    /// ([`SessionSlot::draft`], kept across calls).
    Draft,
}

pub(super) enum Work {
    Append {
        reply: Reply<AppendReply>,
        dropped: u64,
        reused: u64,
        /// Checked before every chunk: past it the append is undone.
        deadline: Option<Instant>,
    },
    Generate(Box<Generating>),
    /// A failed call's truncation gave the session's pages back: its old
    /// history is fed again (bit-identical by INV-3) before anything else
    /// runs on it. Nobody waits for it and nothing cuts it short.
    Restore,
    /// A fork short of its source's end feeds its last token again for the
    /// logits after it; the fork is answered once that is in. Nothing cuts
    /// it short (one token); if the step fails, the fork is removed.
    Fork {
        fork: SessionId,
        reply: Reply<ForkReply>,
    },
}

/// The operation a session is running: prompt tokens still to feed (after
/// an append or a truncation), then, for a Generate, decoding.
pub(super) struct Active {
    pub(super) work: Work,
    pub(super) pending: Vec<u32>,
    pub(super) fed: usize,
    pub(super) prefill_started: Instant,
    /// How to put the session back if the call stops before `pending` is
    /// all in; dropped once it is.
    pub(super) undo: Option<Undo>,
}

/// What restarting a session's KV did.
pub(super) enum Restarted {
    /// Emptied, with the pages for the kept window reserved.
    Now(Undo),
    /// Waiting for another worker's eviction; nothing changed.
    Later,
}

/// How an append starts.
pub(super) enum Begin {
    /// Nothing to append.
    Empty,
    /// Reserved (and truncated, if it had to be): feed these tokens.
    Prefill {
        pending: Vec<u32>,
        dropped: u64,
        /// Tokens mapped from shared pages rather than fed.
        reused: u64,
        undo: Undo,
    },
    /// Waiting for another worker to evict; nothing changed.
    Later,
}

/// Whether pages or a place were had now, or another worker was asked to
/// evict and the caller should try again on a later turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Got {
    Now,
    Later,
}

/// What making room did.
pub(super) enum Room {
    /// Something was evicted (or a remote request answered): try again now.
    Retry,
    /// Another worker was asked to evict; try again on a later turn.
    Later,
    /// Nothing idle anywhere may be evicted.
    Nothing,
}

/// What a session short of pages does after one round of making room.
pub(super) enum Wait {
    /// Something was freed: try again now.
    Retry,
    /// Another worker was asked to evict: try again on a later turn.
    Later,
    /// Nothing more can be freed for it, or it waited long enough.
    GiveUp,
}

/// Why a session left its worker; each reason has a counter.
#[derive(Clone, Copy, Debug)]
pub(super) enum Removal {
    Ttl,
    Lru,
    Close,
    /// An invariant broke or the forward pass failed.
    Failed,
    /// Another replica holds the session's lease now (its row stays).
    Moved,
    /// Let go for another replica that asked for it (its row stays).
    HandedOff,
}

/// A session as its worker schedules it: the session itself, the
/// operation running on it and the ones queued behind, and what this step
/// feeds it.
pub(super) struct SessionSlot {
    pub(super) session: Session,
    pub(super) last_used: Instant,
    pub(super) active: Option<Active>,
    pub(super) queue: VecDeque<Queued>,
    /// When the session began waiting for another worker to free pages.
    pub(super) short_since: Option<Instant>,
    /// What this step feeds for the session.
    pub(super) feed: Vec<u32>,
    pub(super) feed_logits: LogitsWanted,
    /// Speculation's counts over the session's Generates.
    pub(super) speculation: SpeculationCounts,
    /// The draft model's positions for this session, when a draft
    /// proposed for it: a cache, dropped whenever its pages are wanted and
    /// fed again from the history.
    pub(super) draft: Option<DraftKv>,
    /// Removed during the operation that holds it (see
    /// [`Worker::with_session`]): it does not go back into the map.
    pub(super) removed: bool,
}

impl SessionSlot {
    pub(super) fn new(session: Session) -> Self {
        SessionSlot {
            session,
            last_used: Instant::now(),
            active: None,
            queue: VecDeque::new(),
            short_since: None,
            feed: Vec::new(),
            feed_logits: LogitsWanted::None,
            speculation: SpeculationCounts::default(),
            draft: None,
            removed: false,
        }
    }

    /// How many tokens of this step's feed speculation proposed: a feed
    /// that wants every row's logits is a sampled token and a proposal
    /// after it (their rows are verified after the step).
    pub(super) fn proposed(&self) -> usize {
        if self.feed_logits == LogitsWanted::All {
            self.feed.len().saturating_sub(1)
        } else {
            0
        }
    }

    /// Whether this step's feed is part of a prompt (or of a history being
    /// fed again), not a sampled token.
    pub(super) fn prefilling(&self) -> bool {
        self.active
            .as_ref()
            .is_some_and(|active| active.fed < active.pending.len())
    }

    /// The committed history's length: a history being fed again (a
    /// restore) counts whole, fed or not.
    pub(super) fn committed_len(&self) -> usize {
        match &self.active {
            Some(Active {
                work: Work::Restore,
                pending,
                fed,
                ..
            }) => self.session.history().len() + pending.len() - fed,
            _ => self.session.history().len(),
        }
    }

    pub(super) fn idle(&self) -> bool {
        self.active.is_none() && self.queue.is_empty()
    }
}

pub(super) fn finish_with_error(active: Active, err: RuntimeError) {
    match active.work {
        Work::Append { reply, .. } => drop(reply.send(Err(err))),
        Work::Generate(gen) => drop(gen.events.try_send(GenerateEvent::Error(err))),
        Work::Fork { reply, .. } => drop(reply.send(Err(err))),
        Work::Restore => {}
    }
}

impl Active {
    /// Feeding `history` again into a session whose KV it no longer has.
    pub(super) fn restore(history: Vec<u32>) -> Active {
        Active {
            work: Work::Restore,
            pending: history,
            fed: 0,
            prefill_started: Instant::now(),
            undo: None,
        }
    }

    /// Why the call must stop before its next step, if it must: a cancelled
    /// Generate, or a deadline that passed. A restore never stops.
    pub(super) fn stopped(&self) -> Option<Result<StopReason, RuntimeError>> {
        let now = Instant::now();
        match &self.work {
            Work::Append { deadline, .. } => deadline
                .is_some_and(|d| d <= now)
                .then_some(Err(RuntimeError::DeadlineExceeded)),
            Work::Generate(gen) => {
                if gen.cancel.load(Ordering::Acquire) {
                    Some(Ok(StopReason::Cancelled))
                } else if gen.deadline.is_some_and(|d| d <= now) {
                    Some(Err(RuntimeError::DeadlineExceeded))
                } else {
                    None
                }
            }
            Work::Restore | Work::Fork { .. } => None,
        }
    }
}
