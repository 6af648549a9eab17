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
//! verification cost ([`Costs`]: what passes take on this model and
//! machine, [`PassTimes`]; [`PASS_COST`] until timed) is highest. After a
//! proposal refused outright, where acceptance has fallen below what pays,
//! it rests a while. A proposal costs nothing when there is none;
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
/// steps (the sampled token and the proposal, every row's logits) before
/// any pass was timed: the 2-, 4-, 8- and 16-token chunks of
/// `benches/forward` on the reference model (1.25, 1.86, 3.09 and 5.95
/// steps) plus about a fifth of a step for each extra row's output
/// projection, which those chunks do not compute (fitted to the
/// whole-process runs in docs/PERFORMANCE.md). [`PassTimes`] replaces
/// them with what passes take on the model and machine at hand.
pub const PASS_COST: [(usize, f32); 4] = [(1, 1.45), (3, 2.46), (7, 4.49), (15, 8.95)];

/// What verifying a proposal of each of [`PASS_COST`]'s lengths costs now,
/// in plain decode steps, and how long such a step takes (`None`: not
/// timed yet).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    lengths: [(usize, f32); 4],
    step: Option<Duration>,
}

impl Default for Costs {
    fn default() -> Self {
        Costs {
            lengths: PASS_COST,
            step: None,
        }
    }
}

impl Costs {
    /// What a pass verifying `proposed` tokens costs in decode steps: the
    /// cost of the shortest length that holds them (1 for none).
    pub fn of(&self, proposed: usize) -> f32 {
        if proposed == 0 {
            return 1.0;
        }
        let lengths = &self.lengths;
        lengths
            .iter()
            .find(|(length, _)| *length >= proposed)
            .map_or(lengths[lengths.len() - 1].1, |(_, cost)| *cost)
    }

    /// How long a plain decode step takes, once timed.
    pub fn step(&self) -> Option<Duration> {
        self.step
    }

    /// The costs of the four lengths, in order.
    pub fn lengths(&self) -> [(usize, f32); 4] {
        self.lengths
    }
}

/// The most rows a pass of which is timed apart: bucket `b` holds passes
/// of `2^(b-1) + 1 ..= 2^b` rows, the last one every longer pass.
const TIME_BUCKETS: usize = 13;

/// How much a new timing counts against what a bucket has seen.
const TIME_WEIGHT: f32 = 0.25;

/// What forward passes take by how many rows they feed, timed as they run
/// (decayed means per power-of-two bucket of rows), so that proposals are
/// sized by what verification costs on this model and machine: on a
/// large model whose decode streams its weights, a pass of 8 rows can
/// cost little more than one; on a small one, several times one. Between
/// timed sizes a pass's time is interpolated; beyond them it follows
/// [`PASS_COST`]'s shape from the nearest timed size. A size never timed
/// is only ever estimated that way, so a length the estimate rules out is
/// not tried.
#[derive(Clone, Debug)]
pub struct PassTimes {
    /// Per bucket: mean rows and mean seconds of its passes.
    buckets: [Option<(f32, f32)>; TIME_BUCKETS],
    /// Whether timings are ignored (costs stay [`PASS_COST`]'s).
    fixed: bool,
}

impl Default for PassTimes {
    /// Timed, unless `INFERD_PASS_COSTS=fixed` keeps [`PASS_COST`] (so
    /// that a replay of the lookup's policy can reproduce a run's counts).
    fn default() -> Self {
        let fixed = std::env::var("INFERD_PASS_COSTS").is_ok_and(|v| v == "fixed");
        PassTimes {
            buckets: [None; TIME_BUCKETS],
            fixed,
        }
    }
}

impl PassTimes {
    /// Learns from a pass that fed `rows` and took `took` (with the
    /// sampling of its rows). One odd pass (the thread preempted) moves
    /// its bucket's time at most by half.
    pub fn learn(&mut self, rows: usize, took: Duration) {
        if rows == 0 || self.fixed {
            return;
        }
        let bucket = &mut self.buckets[time_bucket(rows)];
        let (rows, secs) = (rows as f32, took.as_secs_f32());
        *bucket = Some(match *bucket {
            None => (rows, secs),
            Some((old_rows, old_secs)) => {
                // `max`/`min` rather than `clamp`, which panics on odd bounds.
                let secs = secs.max(old_secs * 0.5).min(old_secs * 2.0);
                (
                    old_rows + TIME_WEIGHT * (rows - old_rows),
                    old_secs + TIME_WEIGHT * (secs - old_secs),
                )
            }
        });
    }

    /// The costs of verifying each proposal length in a step that feeds
    /// `base` rows without it: the step's time with the proposal over its
    /// time without (for a step of one sampled token, the pass's time over
    /// a plain decode step's). The other sessions of a shared step wait
    /// for those rows too, but they propose as well, and every accepted
    /// run shortens the generations the steps serve: charging each waiting
    /// session the added time made proposals too timid (measured with 4
    /// and 8 sessions at once, docs/PERFORMANCE.md).
    pub fn costs(&self, base: usize) -> Costs {
        let base = base.max(1);
        let step = self.time(base).unwrap_or_else(|| prior_time(base as f32));
        let mut lengths = PASS_COST;
        for (length, cost) in &mut lengths {
            let time = self
                .time(base + *length)
                .unwrap_or_else(|| prior_time((base + *length) as f32));
            // A pass is never cheaper than one with fewer rows.
            *cost = (time / step).max(1.0);
        }
        let timed = self.buckets.iter().any(Option::is_some);
        Costs {
            lengths,
            step: Duration::try_from_secs_f32(step).ok().filter(|_| timed),
        }
    }

    /// A pass of `rows` rows' estimated seconds (`None`: nothing timed).
    fn time(&self, rows: usize) -> Option<f32> {
        let timed = || self.buckets.iter().flatten().copied();
        let r = rows as f32;
        let below = timed().take_while(|&(at, _)| at <= r).last();
        let above = timed().find(|&(at, _)| at >= r);
        let from = |(at, secs): (f32, f32)| secs * prior_time(r) / prior_time(at);
        match (below, above) {
            (Some((r0, t0)), Some((r1, t1))) if r1 > r0 => {
                Some(t0 + (t1 - t0) * (r - r0) / (r1 - r0))
            }
            (Some(point), _) | (None, Some(point)) => Some(from(point)),
            (None, None) => None,
        }
    }
}

/// Which bucket of [`PassTimes`] a pass of `rows` rows is timed in.
fn time_bucket(rows: usize) -> usize {
    (rows.max(1).next_power_of_two().trailing_zeros() as usize).min(TIME_BUCKETS - 1)
}

/// [`PASS_COST`]'s shape: a pass of `rows` rows in one-row passes, linear
/// between its sizes and beyond the last at the slope of the last two.
fn prior_time(rows: f32) -> f32 {
    let mut points = [(1.0f32, 1.0f32); PASS_COST.len() + 1];
    for (point, (length, cost)) in points[1..].iter_mut().zip(PASS_COST) {
        *point = ((length + 1) as f32, cost);
    }
    let rows = rows.max(1.0);
    let pair = points
        .windows(2)
        .find(|w| rows <= w[1].0)
        .unwrap_or(&points[points.len() - 2..]);
    let ((r0, t0), (r1, t1)) = (pair[0], pair[1]);
    t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
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
    /// pass's (`costs`), plus `cost_per_proposed` decode steps for making
    /// each proposed token (a draft model's step; nothing for a lookup).
    pub fn length(&self, costs: &Costs, cost_per_proposed: f32) -> usize {
        self.best(costs, cost_per_proposed).1
    }

    /// [`Sizer::length`], if proposing it is expected to beat plain
    /// decoding's one token per decode step.
    pub fn worth(&self, costs: &Costs, cost_per_proposed: f32) -> Option<usize> {
        let (per_cost, length) = self.best(costs, cost_per_proposed);
        (per_cost > 1.0).then_some(length)
    }

    /// Whether any proposal could beat plain decoding were every proposed
    /// token accepted: if not, proposing (or trying to) only costs.
    pub fn could_pay(costs: &Costs, cost_per_proposed: f32) -> bool {
        best_at(1.0, costs, cost_per_proposed).0 > 1.0
    }

    /// The best expected tokens per decode step, and its length.
    fn best(&self, costs: &Costs, cost_per_proposed: f32) -> (f32, usize) {
        let p = self.accepted_weight / (self.accepted_weight + self.refused_weight);
        best_at(p, costs, cost_per_proposed)
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
/// it runs: recent times of a draft step against a main decode step's
/// ([`Costs::step`]); until both are timed, the ratio of the two models'
/// weight bytes (decode streams them once per token).
#[derive(Clone, Debug)]
pub struct DraftCost {
    draft_step: Option<Duration>,
    prior: f32,
}

impl DraftCost {
    /// For a draft of `draft_bytes` of weights drafting for `main_bytes`.
    pub fn new(draft_bytes: u64, main_bytes: u64) -> Self {
        DraftCost {
            draft_step: None,
            prior: draft_bytes.max(1) as f32 / main_bytes.max(1) as f32,
        }
    }

    /// A draft step's cost in main decode steps of `main_step` each.
    pub fn per_step(&self, main_step: Option<Duration>) -> f32 {
        match (self.draft_step, main_step) {
            (Some(d), Some(m)) if !m.is_zero() => d.as_secs_f32() / m.as_secs_f32(),
            _ => self.prior,
        }
    }

    /// Learns from a draft step that took `took`.
    pub fn learn_draft_step(&mut self, took: Duration) {
        self.draft_step = decayed(self.draft_step, took);
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
    /// Tokens to propose now, verification costing `costs` and a draft
    /// step `cost` main decode steps (`fixed`: a length the caller chose
    /// instead).
    pub fn wanted(&mut self, costs: &Costs, cost: f32, fixed: Option<usize>) -> usize {
        let want = match fixed.or_else(|| self.sizer.worth(costs, cost)) {
            Some(length) => length,
            None if self.idle + 1 >= PROBE_EVERY && Sizer::could_pay(costs, cost) => 1,
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

/// The best expected tokens per decode step over [`PASS_COST`]'s lengths
/// at `costs`, and its length, for a proposed token accepted with chance
/// `p`.
fn best_at(p: f32, costs: &Costs, cost_per_proposed: f32) -> (f32, usize) {
    let mut best = (f32::MIN, 1);
    for (length, cost) in costs.lengths {
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
    /// What verification cost when it last proposed.
    costs: Costs,
}

impl Lookup {
    /// Writes into `out` the tokens that may follow `history` and then
    /// `next` (the token just sampled), at most `limit` (and at most the
    /// length worth proposing at `costs`, [`Lookup::length`]): what
    /// followed the most recent earlier occurrence of the last
    /// [`MAX_NGRAM`] (else [`MIN_NGRAM`]) tokens within the last
    /// [`SEARCH_WINDOW`], running on into itself past the history's end;
    /// nothing when they occurred nowhere before. After a proposal refused outright
    /// that leaves acceptance below what pays ([`Sizer::worth`]), it rests
    /// (proposes nothing) for a number of steps that doubles with each
    /// such refusal, up to [`MAX_REST`]: a session with nothing to copy
    /// soon costs nothing. The runs of `history` are indexed as it
    /// grows, so a lookup costs the same at any length.
    pub fn propose_after(
        &mut self,
        history: &[u32],
        next: u32,
        limit: usize,
        costs: &Costs,
        out: &mut Vec<u32>,
    ) {
        out.clear();
        self.costs = *costs;
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
                // A match that ends near the history's end is followed
                // by what it is followed by now: the copy runs on into
                // itself, so a loop is proposed round and round.
                for i in end..end + want {
                    let token = if i < len { at(i) } else { out[i - len] };
                    out.push(token);
                }
                return;
            }
        }
    }

    /// The length worth proposing at the costs it last saw.
    pub fn length(&self) -> usize {
        self.sizer.length(&self.costs, 0.0)
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
        } else if self.sizer.worth(&self.costs, 0.0).is_none() {
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
            lookup.propose_after(before, next, limit, &Costs::default(), &mut out);
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
                // What followed, running on into the proposal itself.
                let mut out = history[at + n..].to_vec();
                while out.len() < want {
                    out.push(out[out.len() - (history.len() - at - n)]);
                }
                out.truncate(want);
                return out;
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
        // One that has seen its proposals accepted proposes more: past the
        // history's end, what the copy itself proposed ("7 8 4" again: the
        // history loops "7 8 4 2 3").
        let mut lookup = Lookup {
            sizer: Sizer {
                accepted_weight: 100.0,
                refused_weight: 0.01,
            },
            ..Lookup::default()
        };
        assert_eq!(lookup.length(), 15);
        assert_eq!(propose(&mut lookup, &history, 8), [7, 8, 4, 2, 3, 7, 8, 4]);
        assert_eq!(propose(&mut lookup, &history, 3), [7, 8, 4]);
        // A loop of two tokens is proposed round and round.
        let looping = [9, 1, 2, 1, 2, 1, 2];
        let round: Vec<u32> = (0..15).map(|i| 1 + i % 2).collect();
        assert_eq!(propose(&mut lookup, &looping, 100), round);
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

    /// A [`PassTimes`] that has timed passes of `rows` rows at `ms` each.
    fn timed(passes: &[(usize, f32)]) -> PassTimes {
        let mut times = PassTimes {
            buckets: [None; TIME_BUCKETS],
            fixed: false,
        };
        for &(rows, ms) in passes {
            times.learn(rows, Duration::from_secs_f32(ms / 1000.0));
        }
        times
    }

    fn rounded(costs: &Costs) -> Vec<(usize, f32)> {
        let lengths = costs.lengths();
        lengths
            .iter()
            .map(|&(length, cost)| (length, (cost * 100.0).round() / 100.0))
            .collect()
    }

    #[test]
    fn verification_costs_are_the_timed_passes_over_a_decode_step() {
        let times = timed(&[(1, 10.0), (2, 10.5), (4, 11.0), (8, 20.0), (16, 40.0)]);
        let costs = times.costs(1);
        assert_eq!(rounded(&costs), [(1, 1.05), (3, 1.1), (7, 2.0), (15, 4.0)]);
        assert_eq!(costs.step(), Some(Duration::from_millis(10)));
        assert_eq!(costs.of(0), 1.0);
        assert_eq!(costs.of(5), costs.of(7));
        // Nothing timed: PASS_COST, and no step time.
        let untimed = timed(&[]).costs(1);
        assert_eq!((untimed.lengths(), untimed.step()), (PASS_COST, None));
        // Only decode steps timed: PASS_COST's shape from there.
        let decode_only = timed(&[(1, 10.0)]).costs(1);
        assert_eq!(
            rounded(&decode_only),
            [(1, 1.45), (3, 2.46), (7, 4.49), (15, 8.95)]
        );
    }

    #[test]
    fn untimed_sizes_are_interpolated_or_follow_the_nearest_timed_one() {
        // 1 and 4 rows timed: 2 between them; 8 and 16 scaled from 4 by
        // PASS_COST's shape (4.49 / 2.46, 8.95 / 2.46).
        let costs = timed(&[(1, 10.0), (4, 12.0)]).costs(1);
        let expected = [
            (1, 1.07),
            (3, 1.2),
            (7, (1.2f32 * 4.49 / 2.46 * 100.0).round() / 100.0),
            (15, (1.2f32 * 8.95 / 2.46 * 100.0).round() / 100.0),
        ];
        assert_eq!(rounded(&costs), expected);
        // A pass timed faster than a shorter one costs as much as a step.
        let noisy = timed(&[(1, 10.0), (2, 9.0), (4, 9.5), (8, 12.0)]).costs(1);
        assert_eq!(rounded(&noisy)[..2], [(1, 1.0), (3, 1.0)]);
    }

    #[test]
    fn a_proposal_in_a_shared_step_costs_what_it_adds_to_that_step() {
        // Passes take 10 ms plus 1 ms a row: a step of 4 rows takes 14 ms,
        // 3 more rows make it 17.
        let times = timed(&[(1, 11.0), (4, 14.0), (8, 18.0), (16, 26.0)]);
        let costs = times.costs(4);
        assert_eq!(
            rounded(&costs)[1],
            (3, (100.0f32 * 17.0 / 14.0).round() / 100.0)
        );
        assert!(costs.of(1) < costs.of(3) && costs.of(3) < costs.of(15));
        // The same rows added to one sampled token cost more.
        assert!(times.costs(1).of(3) > costs.of(3));
    }

    #[test]
    fn one_odd_pass_moves_its_size_only_so_far() {
        let times = timed(&[(1, 10.0), (1, 1000.0)]);
        // Clamped to twice the mean, then weighted by TIME_WEIGHT.
        let step = times.costs(1).step().unwrap().as_secs_f32() * 1000.0;
        assert!((step - 12.5).abs() < 0.01, "{step}");
    }

    #[test]
    fn cheap_verification_makes_proposals_longer() {
        let history: Vec<u32> = (0..40).map(|i| i % 20).collect();
        let expensive = Costs::default();
        let cheap = timed(&[(1, 10.0), (2, 10.5), (4, 11.0), (8, 12.0), (16, 14.0)]).costs(1);
        let mut out = Vec::new();
        // At even odds (nothing learned yet) PASS_COST pays for one token,
        // the cheap passes for more.
        let mut lookup = Lookup::default();
        lookup.propose_after(&history[..39], history[39], 100, &expensive, &mut out);
        assert_eq!(out.len(), 1);
        lookup.propose_after(&history[..39], history[39], 100, &cheap, &mut out);
        assert!(out.len() >= 3, "{}", out.len());
        // And a refusal that would rest it at PASS_COST does not.
        let mut resting = Lookup::default();
        resting.propose_after(&history[..39], history[39], 100, &expensive, &mut out);
        resting.learn(out.len(), 0);
        resting.propose_after(&history[..39], history[39], 100, &expensive, &mut out);
        assert!(out.is_empty());
        let mut looking = Lookup::default();
        looking.propose_after(&history[..39], history[39], 100, &cheap, &mut out);
        looking.learn(out.len(), 0);
        looking.propose_after(&history[..39], history[39], 100, &cheap, &mut out);
        assert!(!out.is_empty());
    }

    #[test]
    fn fixed_pass_times_learn_nothing() {
        let mut times = timed(&[]);
        times.fixed = true;
        times.learn(1, Duration::from_millis(10));
        times.learn(8, Duration::from_millis(11));
        assert_eq!(times.costs(1), Costs::default());
    }
}
