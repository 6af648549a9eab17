//! Prompt-lookup speculation: proposing the tokens that may come next from
//! the session's own history, for a decode that verifies several tokens in
//! one forward pass.
//!
//! The proposal is what followed the most recent earlier occurrence of the
//! history's last `n` tokens, for the longest `n` (from [`MIN_NGRAM`] up to
//! [`MAX_NGRAM`]) that occurred before: agent sessions repeat themselves
//! (code being edited, a document quoted, tool output echoed), and there
//! the continuation is often a copy. [`Lookup`] sizes each proposal by what
//! it is expected to earn: from a decayed estimate of how often a proposed
//! token is accepted, the length (1, 3, 7 or 15: with the sampled token,
//! whole tiles of the matrix kernels) whose expected tokens per unit of
//! verification cost ([`PASS_COST`]) is highest. After a proposal refused
//! outright, where acceptance has fallen below what pays, it rests a
//! while. A proposal costs nothing when there is none;
//! verifying changes no token (the caller samples every position as plain
//! decoding would).
//!
//! A draft model's proposals (the engine's `Draft`, the workers' drafts)
//! are sized by the same [`Sizer`], with what a draft step costs
//! ([`DraftCost`]) and probing while nothing pays ([`DraftPace`]).

use std::collections::HashMap;
use std::time::Duration;

/// The longest run of last tokens looked up.
pub const MAX_NGRAM: usize = 4;

/// The shortest: one or two repeated tokens are too weak a hint (in free
/// text they recur by chance, and every refused proposal costs).
pub const MIN_NGRAM: usize = 3;

/// The steps a lookup rests after the first proposal refused outright
/// that leaves acceptance below what pays, and the most it rests after
/// several such refusals in a row.
pub const FIRST_REST: usize = 4;
pub const MAX_REST: usize = 64;

/// The proposal lengths, with what a pass verifying each costs in decode
/// steps (the sampled token and the proposal, every row's logits): the
/// 2-, 4-, 8- and 16-token chunks of `benches/forward` on the reference
/// model (1.25, 1.86, 3.09 and 5.95 steps) plus about a fifth of a step for
/// each extra row's output projection, which those chunks do not compute
/// (fitted to the whole-process runs in docs/PERFORMANCE.md).
pub const PASS_COST: [(usize, f32); 4] = [(1, 1.45), (3, 2.46), (7, 4.49), (15, 8.95)];

/// What a pass verifying `proposed` tokens costs in decode steps: the
/// [`PASS_COST`] of the shortest length that holds them (1 for none).
pub fn pass_cost(proposed: usize) -> f32 {
    if proposed == 0 {
        return 1.0;
    }
    PASS_COST
        .iter()
        .find(|(length, _)| *length >= proposed)
        .map_or(PASS_COST[PASS_COST.len() - 1].1, |(_, cost)| *cost)
}

/// How often a draft model that does not pay proposes one token anyway,
/// to measure its acceptance again.
pub const PROBE_EVERY: usize = 16;

/// A draft model's proposal: the highest logit's token (the first of
/// equals).
pub fn greedy(logits: &[f32]) -> u32 {
    let mut best = (f32::NEG_INFINITY, 0usize);
    for (i, &v) in logits.iter().enumerate() {
        if v > best.0 {
            best = (v, i);
        }
    }
    best.1 as u32
}

/// How much each earlier proposal's outcome still counts after another:
/// acceptance changes quickly where a copied span begins or ends.
const DECAY: f32 = 0.8;

/// How far back a lookup searches (tokens), so that a step's cost stays
/// bounded in a long session.
pub const SEARCH_WINDOW: usize = 16_384;

/// How long a proposal should be, from what the last ones earned: a
/// decayed estimate of the chance that a proposed token is accepted.
#[derive(Clone, Debug)]
pub struct Sizer {
    /// Decayed counts of proposed tokens accepted, and of proposals cut
    /// short by a refused token (a geometric run's successes and ends).
    accepted_weight: f32,
    refused_weight: f32,
}

impl Default for Sizer {
    fn default() -> Self {
        // Even odds until something was proposed.
        Sizer {
            accepted_weight: 1.0,
            refused_weight: 1.0,
        }
    }
}

impl Sizer {
    /// The proposal length (of [`PASS_COST`]'s) with the most expected
    /// tokens (the sampled one and the accepted run) per unit of cost: its
    /// pass's, plus `cost_per_proposed` decode steps for making each
    /// proposed token (a draft model's step; nothing for a lookup).
    pub fn length(&self, cost_per_proposed: f32) -> usize {
        self.best(cost_per_proposed).1
    }

    /// [`Sizer::length`], if proposing it is expected to beat plain
    /// decoding's one token per decode step.
    pub fn worth(&self, cost_per_proposed: f32) -> Option<usize> {
        let (per_cost, length) = self.best(cost_per_proposed);
        (per_cost > 1.0).then_some(length)
    }

    /// Whether any proposal could beat plain decoding were every proposed
    /// token accepted: if not, proposing (or trying to) only costs.
    pub fn could_pay(cost_per_proposed: f32) -> bool {
        best_at(1.0, cost_per_proposed).0 > 1.0
    }

    /// The best expected tokens per decode step, and its length.
    fn best(&self, cost_per_proposed: f32) -> (f32, usize) {
        let p = self.accepted_weight / (self.accepted_weight + self.refused_weight);
        best_at(p, cost_per_proposed)
    }

    /// Learns from a proposal of `proposed` tokens of which the first
    /// `accepted` were the ones sampled.
    pub fn learn(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.accepted_weight = self.accepted_weight * DECAY + accepted as f32;
        self.refused_weight =
            self.refused_weight * DECAY + f32::from(u8::from(accepted < proposed));
    }
}

/// What one step of a draft model costs in main decode steps, measured as
/// it runs: recent times of a draft step and of a main decode step (a
/// verification pass over its [`pass_cost`]); until both are timed, the
/// ratio of the two models' weight bytes (decode streams them once per
/// token).
#[derive(Clone, Debug)]
pub struct DraftCost {
    draft_step: Option<Duration>,
    main_step: Option<Duration>,
    prior: f32,
}

impl DraftCost {
    /// For a draft of `draft_bytes` of weights drafting for `main_bytes`.
    pub fn new(draft_bytes: u64, main_bytes: u64) -> Self {
        DraftCost {
            draft_step: None,
            main_step: None,
            prior: draft_bytes.max(1) as f32 / main_bytes.max(1) as f32,
        }
    }

    /// A draft step's cost in main decode steps.
    pub fn per_step(&self) -> f32 {
        match (self.draft_step, self.main_step) {
            (Some(d), Some(m)) if !m.is_zero() => d.as_secs_f32() / m.as_secs_f32(),
            _ => self.prior,
        }
    }

    /// Learns from a draft step that took `took`.
    pub fn learn_draft_step(&mut self, took: Duration) {
        self.draft_step = decayed(self.draft_step, took);
    }

    /// Learns from a verification pass of `proposed` tokens that took `pass`.
    pub fn learn_main_pass(&mut self, pass: Duration, proposed: usize) {
        self.main_step = decayed(self.main_step, pass.div_f32(pass_cost(proposed)));
    }
}

/// Recent steps count most; one odd step moves an estimate only so far.
fn decayed(old: Option<Duration>, new: Duration) -> Option<Duration> {
    Some(old.map_or(new, |old| old.mul_f32(0.7) + new.mul_f32(0.3)))
}

/// How many tokens a draft model proposes: what its acceptance and cost
/// say pays ([`Sizer`]), else one every [`PROBE_EVERY`] steps to see
/// whether acceptance changed, unless no proposal could pay even if every
/// token were accepted.
#[derive(Clone, Debug, Default)]
pub struct DraftPace {
    sizer: Sizer,
    /// Steps since it last proposed.
    idle: usize,
}

impl DraftPace {
    /// Tokens to propose now, a draft step costing `cost` main decode
    /// steps (`fixed`: a length the caller chose instead).
    pub fn wanted(&mut self, cost: f32, fixed: Option<usize>) -> usize {
        let want = match fixed.or_else(|| self.sizer.worth(cost)) {
            Some(length) => length,
            None if self.idle + 1 >= PROBE_EVERY && Sizer::could_pay(cost) => 1,
            None => 0,
        };
        self.idle = if want == 0 { self.idle + 1 } else { 0 };
        want
    }

    /// Learns from a proposal of `proposed` tokens of which the first
    /// `accepted` were the ones sampled.
    pub fn learn(&mut self, proposed: usize, accepted: usize) {
        self.sizer.learn(proposed, accepted);
    }
}

/// The best expected tokens per decode step over [`PASS_COST`]'s lengths,
/// and its length, for a proposed token accepted with chance `p`.
fn best_at(p: f32, cost_per_proposed: f32) -> (f32, usize) {
    let mut best = (f32::MIN, 1);
    for (length, cost) in PASS_COST {
        // 1 + p + p^2 + ... + p^length: a run stops at its first refusal.
        let expected: f32 = (0..=length).map(|i| p.powi(i as i32)).sum();
        let per_cost = expected / (cost + cost_per_proposed * length as f32);
        if per_cost > best.0 {
            best = (per_cost, length);
        }
    }
    best
}

/// Where each run of 3 and of 4 tokens ([`MIN_NGRAM`], [`MAX_NGRAM`]) of a
/// history last ended, kept up to date as the history grows.
#[derive(Clone, Debug, Default)]
struct RunIndex {
    /// History tokens indexed, and the last of them: a history shorter
    /// than that, or with another token there (a window shift rewrote it),
    /// is indexed afresh.
    len: usize,
    last: Option<u32>,
    /// Run → the end (exclusive) of its most recent occurrence.
    ends3: HashMap<[u32; 3], usize>,
    ends4: HashMap<[u32; 4], usize>,
}

const _: () = assert!(MIN_NGRAM == 3 && MAX_NGRAM == 4);

impl RunIndex {
    /// Indexes what `history` added since the last call (only its last
    /// [`SEARCH_WINDOW`] tokens when starting afresh).
    fn catch_up(&mut self, history: &[u32]) {
        let same = self.len <= history.len()
            && (self.len == 0 || history.get(self.len - 1) == self.last.as_ref());
        if !same {
            *self = RunIndex::default();
        }
        let first_end = self.len.max(history.len().saturating_sub(SEARCH_WINDOW)) + 1;
        for end in first_end..=history.len() {
            if let Ok(run) = <[u32; 3]>::try_from(&history[end.saturating_sub(3)..end]) {
                self.ends3.insert(run, end);
            }
            if let Ok(run) = <[u32; 4]>::try_from(&history[end.saturating_sub(4)..end]) {
                self.ends4.insert(run, end);
            }
        }
        self.len = history.len();
        self.last = history.last().copied();
    }

    /// The end of the most recent occurrence of `run` (3 or 4 tokens).
    fn last_end(&self, run: &[u32]) -> Option<usize> {
        match run.len() {
            3 => self.ends3.get(<&[u32; 3]>::try_from(run).ok()?).copied(),
            4 => self.ends4.get(<&[u32; 4]>::try_from(run).ok()?).copied(),
            _ => None,
        }
    }
}

/// A session's proposer, with what it has learned of its acceptance.
#[derive(Clone, Debug, Default)]
pub struct Lookup {
    sizer: Sizer,
    index: RunIndex,
    /// Steps to go without a lookup.
    resting: usize,
    /// How long the last rest was (it doubles while proposals keep being
    /// refused outright).
    rest: usize,
}

impl Lookup {
    /// Writes into `out` the tokens that may follow `history` and then
    /// `next` (the token just sampled), at most `limit` (and at most the
    /// length worth proposing now, [`Lookup::length`]): what followed the
    /// most recent earlier occurrence of the last [`MAX_NGRAM`] (else
    /// [`MIN_NGRAM`]) tokens within the last [`SEARCH_WINDOW`]; nothing
    /// when they occurred nowhere before. After a proposal refused outright
    /// that leaves acceptance below what pays ([`Sizer::worth`]), it rests
    /// (proposes nothing) for a number of steps that doubles with each
    /// such refusal, up to [`MAX_REST`]: a session with nothing to copy
    /// soon costs nothing. The runs of `history` are indexed as it
    /// grows, so a lookup costs the same at any length.
    pub fn propose_after(&mut self, history: &[u32], next: u32, limit: usize, out: &mut Vec<u32>) {
        out.clear();
        if self.resting > 0 {
            self.resting -= 1;
            return;
        }
        let want = self.length().min(limit);
        if want == 0 {
            return;
        }
        self.index.catch_up(history);
        // `history` and then `next`, without copying the history.
        let len = history.len() + 1;
        let at = |i: usize| if i < history.len() { history[i] } else { next };
        let window_start = len.saturating_sub(SEARCH_WINDOW);
        for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
            if len <= n {
                continue;
            }
            let mut tail = [0u32; MAX_NGRAM];
            for (slot, i) in tail.iter_mut().zip(len - n..len) {
                *slot = at(i);
            }
            // The match must start in the window (and, being indexed from
            // `history` alone, ends before the tail does).
            let found = self.index.last_end(&tail[..n]);
            if let Some(end) = found.filter(|&e| e - n >= window_start) {
                out.extend((end..(end + want).min(len)).map(at));
                return;
            }
        }
    }

    /// The length worth proposing now.
    pub fn length(&self) -> usize {
        self.sizer.length(0.0)
    }

    /// Learns from a proposal of `proposed` tokens of which the first
    /// `accepted` were the ones sampled.
    pub fn learn(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.sizer.learn(proposed, accepted);
        if accepted > 0 {
            self.rest = 0;
        } else if self.sizer.worth(0.0).is_none() {
            // A refusal where proposals still pay on the whole (a copy
            // that departs from its source for a word, then rejoins it)
            // is no reason to stop looking.
            self.rest = (self.rest * 2).clamp(FIRST_REST, MAX_REST);
            self.resting = self.rest;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`Lookup::propose_after`] with the history's last token as `next`.
    fn propose(lookup: &mut Lookup, history: &[u32], limit: usize) -> Vec<u32> {
        let mut out = Vec::new();
        if let Some((&next, before)) = history.split_last() {
            lookup.propose_after(before, next, limit, &mut out);
        }
        out
    }

    /// The search the index replaces: the most recent earlier occurrence
    /// of the last 4, else 3, tokens within the window.
    fn searched(history: &[u32], want: usize) -> Vec<u32> {
        let start = history.len().saturating_sub(SEARCH_WINDOW);
        for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
            if history.len() <= n {
                continue;
            }
            let tail = &history[history.len() - n..];
            let found = (start..history.len() - n)
                .rev()
                .find(|&at| &history[at..at + n] == tail);
            if let Some(at) = found {
                return history[at + n..(at + n + want).min(history.len())].to_vec();
            }
        }
        Vec::new()
    }

    #[test]
    fn the_index_finds_what_a_search_finds_as_the_history_grows_and_is_rewritten() {
        let eager = || Lookup {
            sizer: Sizer {
                accepted_weight: 100.0,
                refused_weight: 0.01,
            },
            ..Lookup::default()
        };
        let mut lookup = eager();
        let mut state = 12345u64;
        let mut history: Vec<u32> = Vec::new();
        for step in 0..3000 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            // Few distinct tokens, so runs recur; now and then a rewrite.
            history.push(((state >> 33) % 7) as u32);
            if step % 997 == 996 {
                history.drain(4..history.len() / 2);
            }
            let want = lookup.length();
            assert_eq!(
                propose(&mut lookup, &history, 100),
                searched(&history, want),
                "step {step}"
            );
        }
        // A fresh lookup on a long history indexes only the window.
        let long: Vec<u32> = (0..SEARCH_WINDOW as u32 + 50).map(|i| i % 5000).collect();
        let mut fresh = eager();
        assert_eq!(
            propose(&mut fresh, &long, 100),
            searched(&long, fresh.length())
        );
    }

    #[test]
    fn the_longest_most_recent_match_proposes_what_followed_it() {
        // The tail "4 2 3" occurred twice before: the later one was
        // followed by "7 8 4 2 3" (up to the history's end).
        let history = [1, 4, 2, 3, 9, 5, 4, 2, 3, 7, 8, 4, 2, 3];
        assert_eq!(propose(&mut Lookup::default(), &history, 8), [7]);
        // One that has seen its proposals accepted proposes more.
        let mut lookup = Lookup {
            sizer: Sizer {
                accepted_weight: 100.0,
                refused_weight: 0.01,
            },
            ..Lookup::default()
        };
        assert_eq!(propose(&mut lookup, &history, 8), [7, 8, 4, 2, 3]);
        assert_eq!(propose(&mut lookup, &history, 3), [7, 8, 4]);
        // A longer tail wins over a more recent shorter one.
        let history = [5, 6, 7, 8, 1, 0, 9, 6, 7, 8, 2, 5, 6, 7, 8];
        assert_eq!(propose(&mut lookup, &history, 2), [1, 0]);
        assert!(propose(&mut lookup, &[1, 2, 3, 4], 8).is_empty());
        assert!(propose(&mut lookup, &history, 0).is_empty());
    }

    #[test]
    fn the_length_grows_while_proposals_are_accepted_and_falls_after_refusals() {
        let mut lookup = Lookup::default();
        let history: Vec<u32> = (0..80).map(|i| i % 20).collect();
        let (mut proposed, mut accepted) = (0, 0);
        // Accepted whole, proposal after proposal: never shorter, up to 7.
        let mut lengths = Vec::new();
        for _ in 0..8 {
            let len = propose(&mut lookup, &history, 100).len();
            lengths.push(len);
            lookup.learn(len, len);
            (proposed, accepted) = (proposed + len, accepted + len);
        }
        assert_eq!(lengths[0], 1, "{lengths:?}");
        assert!(lengths.windows(2).all(|w| w[0] <= w[1]), "{lengths:?}");
        assert_eq!(*lengths.last().unwrap(), 7, "{lengths:?}");
        // Refused after one token, twice: back to short proposals.
        for _ in 0..2 {
            let len = propose(&mut lookup, &history, 100).len();
            lookup.learn(len, 1);
            (proposed, accepted) = (proposed + len, accepted + 1);
        }
        assert!(propose(&mut lookup, &history, 100).len() <= 3);
        assert!(accepted > 0 && proposed > accepted);
    }

    #[test]
    fn refused_proposals_make_it_rest_longer_each_time() {
        let mut lookup = Lookup::default();
        let history: Vec<u32> = (0..40).map(|i| i % 20).collect();
        // Rests of 4, 8, 16 steps after three refusals in a row.
        for rest in [FIRST_REST, 8, 16] {
            assert!(!propose(&mut lookup, &history, 100).is_empty());
            lookup.learn(1, 0);
            for _ in 0..rest {
                assert!(propose(&mut lookup, &history, 100).is_empty());
            }
        }
        // An accepted token ends the resting.
        assert!(!propose(&mut lookup, &history, 100).is_empty());
        lookup.learn(1, 1);
        assert!(!propose(&mut lookup, &history, 100).is_empty());
        lookup.learn(2, 0);
        for _ in 0..FIRST_REST {
            assert!(propose(&mut lookup, &history, 100).is_empty());
        }
        assert!(!propose(&mut lookup, &history, 100).is_empty());
    }

    #[test]
    fn a_refusal_amid_accepted_proposals_does_not_rest() {
        let mut lookup = Lookup::default();
        let history: Vec<u32> = (0..40).map(|i| i % 20).collect();
        for _ in 0..6 {
            let len = propose(&mut lookup, &history, 100).len();
            lookup.learn(len, len);
        }
        // One word departs from the copy: the next step looks again.
        let len = propose(&mut lookup, &history, 100).len();
        lookup.learn(len, 0);
        assert!(!propose(&mut lookup, &history, 100).is_empty());
        // Refused again and again, acceptance falls below what pays: rest.
        let mut refusals = 0;
        loop {
            let len = propose(&mut lookup, &history, 100).len();
            if len == 0 {
                break;
            }
            lookup.learn(len, 0);
            refusals += 1;
            assert!(refusals < 10, "never rested");
        }
        assert!(refusals >= 1);
    }
}
