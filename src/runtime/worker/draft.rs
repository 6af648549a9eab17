//! Draft-model speculation in the workers (`serve --draft-model`): a
//! smaller model of the same vocabulary proposes its greedy continuation
//! of each drafting session, and the step verifies it as it verifies a
//! lookup's (`speculate.rs`), so the tokens stay plain decoding's.
//!
//! Each worker keeps its own pool of draft pages (its share of the draft's
//! part of the KV budget) and, per session, the draft's positions
//! ([`DraftKv`]): a cache of a prefix of the session's history. Before
//! proposing, a session's draft is cut back to what it shares with the
//! history and fed what it lacks; a long catch-up (a new prompt) goes in
//! chunks over several steps (each about a main prefill chunk's cost),
//! proposing nothing until it is done. All the
//! step's drafting sessions advance together, one batched draft pass per
//! proposed token. When the pool is short, other sessions' drafts are
//! dropped, least recently used first, to be fed again when next needed;
//! a spill drops the session's draft too. Nothing of the draft is ever
//! journaled: it is computed again from the history.
//!
//! Each session sizes its proposals from the acceptance it has seen and
//! what a draft step costs next to a main decode step on this worker
//! (`speculate::DraftPace`, `speculate::DraftCost`, as the engine's draft;
//! the main step's time from the worker's `speculate::PassTimes`).

use std::collections::HashMap;

use super::speculate::add_proposal;
use super::*;
use crate::kv::KvPoolConfig;
use crate::model::Sequence;
use crate::speculate::{greedy, DraftCost, DraftPace};

/// A worker's draft model, its pages and what its steps cost.
pub(crate) struct DraftRunner {
    model: Arc<Model>,
    pool: Arc<KvPool>,
    scratch: Scratch,
    /// A batched draft step against a decode-only main step.
    cost: DraftCost,
}

impl DraftRunner {
    /// A draft of `model` for `main` with `bytes` of draft pages (at least
    /// one page for every layer).
    pub(crate) fn new(
        model: Arc<Model>,
        main: &Model,
        page_positions: usize,
        bytes: u64,
    ) -> Result<Self, RuntimeError> {
        let layout = model.kv_layout(model.config.n_layers, page_positions);
        let pages = KvPool::pages_for_bytes(&layout, bytes).max(layout.n_layers);
        let pool = KvPool::new(KvPoolConfig::anonymous(layout, pages))
            .map_err(|e| RuntimeError::Internal(format!("the draft model's KV pool: {e}")))?;
        let cost = DraftCost::new(model.weight_bytes(), main.weight_bytes());
        Ok(DraftRunner {
            model,
            pool: Arc::new(pool),
            scratch: Scratch::default(),
            cost,
        })
    }

    /// Bytes of the pool's pages held by drafts, and of the whole pool.
    pub(super) fn kv_bytes(&self) -> (u64, u64) {
        let page = self.pool.page_bytes() as u64;
        let total = self.pool.total_pages() as u64;
        let free = self.pool.free_pages() as u64;
        (total.saturating_sub(free) * page, total * page)
    }
}

/// A session's positions in the draft model and what its proposals earned.
pub(crate) struct DraftKv {
    kv: SessionKv,
    /// The tokens `kv` holds: a prefix of the session's history, then
    /// maybe proposed tokens it has not accepted yet.
    history: Vec<u32>,
    pace: DraftPace,
    used: Instant,
}

impl DraftKv {
    fn new(pool: &Arc<KvPool>) -> Self {
        DraftKv {
            kv: SessionKv::new(Arc::clone(pool)),
            history: Vec::new(),
            pace: DraftPace::default(),
            used: Instant::now(),
        }
    }

    /// Learns from a verified proposal.
    pub(super) fn learn(&mut self, proposed: usize, accepted: usize) {
        self.pace.learn(proposed, accepted);
    }
}

/// One session's drafting this step.
struct Plan {
    id: SessionId,
    /// What the next draft pass feeds it.
    feed: Vec<u32>,
    /// Tokens to propose (0: it only catches up this step).
    want: usize,
    proposal: Vec<u32>,
}

impl Worker {
    /// Drafts for every session noted by `propose` this step, in batched
    /// draft passes, and adds each proposal to its session's feed.
    pub(super) fn propose_drafts(&mut self) {
        let mut asked = std::mem::take(&mut self.to_draft);
        if let Some(mut draft) = self.draft.take() {
            let mut plans = self.plan_drafts(&mut draft, &asked);
            self.run_drafts(&mut draft, &mut plans);
            for plan in plans {
                if let Some(slot) = self.sessions.get_mut(&plan.id) {
                    if plan.proposal.len() == plan.want {
                        add_proposal(slot, &plan.proposal);
                    }
                }
            }
            self.draft = Some(draft);
        }
        asked.clear();
        self.to_draft = asked;
    }

    /// Sizes each asking session's proposal, brings its draft in line with
    /// its history (cut back, then the tokens it lacks to be fed) and
    /// reserves the draft pages that takes.
    fn plan_drafts(&mut self, draft: &mut DraftRunner, asked: &[(SessionId, usize)]) -> Vec<Plan> {
        let main_step = self.pass_times.costs(self.step_rows).step();
        let cost = draft.cost.per_step(main_step);
        let context = draft.model.config.context;
        // A catch-up step feeds what costs about a main prefill chunk: a
        // draft ten times cheaper takes ten times the tokens (up to 16x).
        let most = self.cfg.prefill_chunk.max(1);
        let chunk = ((most as f32 / cost.max(1.0 / 16.0)) as usize).clamp(most, 16 * most);
        let mut plans = Vec::new();
        for &(id, limit) in asked {
            let Some(slot) = self.sessions.get_mut(&id) else {
                continue;
            };
            let &[token] = &slot.feed[..] else {
                continue;
            };
            let state = slot.draft.get_or_insert_with(|| DraftKv::new(&draft.pool));
            state.used = Instant::now();
            let costs = self.pass_times.costs(self.step_rows);
            let want = state
                .pace
                .wanted(&costs, cost, self.cfg.draft_tokens)
                .min(limit);
            let history = slot.session.history();
            let target = history.len() + 1;
            if want == 0 || target + want > context {
                continue;
            }
            let at = |i: usize| history.get(i).copied().unwrap_or(token);
            // Short of the last token, which is fed again so that the
            // draft's logits after it are there to propose from.
            let shared = (state.history.iter().enumerate())
                .take_while(|&(i, &t)| i < target && t == at(i))
                .count()
                .min(target - 1);
            if shared < state.history.len() {
                if state.kv.roll_back_to(shared).is_ok() {
                    state.history.truncate(shared);
                } else {
                    *state = DraftKv::new(&draft.pool);
                }
            }
            let have = state.history.len();
            let catch_up = (target - have).min(chunk);
            let want = if have + catch_up == target { want } else { 0 };
            self.step_rows += want;
            plans.push(Plan {
                id,
                feed: (have..have + catch_up).map(at).collect(),
                want,
                proposal: Vec::with_capacity(want),
            });
        }
        let planned: Vec<SessionId> = plans.iter().map(|p| p.id).collect();
        plans.retain(|plan| self.reserve_draft(plan, &planned));
        plans
    }

    /// Reserves the draft pages `plan` feeds into, dropping other
    /// sessions' drafts (least recently used first, none of `planned`)
    /// while the pool is short. Whether it got them.
    fn reserve_draft(&mut self, plan: &Plan, planned: &[SessionId]) -> bool {
        loop {
            let Some(state) = self
                .sessions
                .get_mut(&plan.id)
                .and_then(|slot| slot.draft.as_mut())
            else {
                return false;
            };
            let positions = state.history.len() + plan.feed.len() + plan.want.saturating_sub(1);
            if state.kv.reserve(positions).is_ok() {
                return true;
            }
            let oldest = (self.sessions.iter())
                .filter(|(id, slot)| slot.draft.is_some() && !planned.contains(id))
                .min_by_key(|(_, slot)| slot.draft.as_ref().map(|d| d.used))
                .map(|(id, _)| *id);
            match oldest.and_then(|id| self.sessions.get_mut(&id)) {
                Some(slot) => {
                    slot.draft = None;
                    let dropped = &self.shared.counters.draft_kv_dropped;
                    dropped.fetch_add(1, Ordering::Relaxed);
                }
                None => return false,
            }
        }
    }

    /// Runs the planned draft passes: the tokens each draft lacks, then
    /// one greedy token a pass while any plan wants more.
    fn run_drafts(&mut self, draft: &mut DraftRunner, plans: &mut [Plan]) {
        let vocab = draft.model.config.vocab;
        let index: HashMap<SessionId, usize> =
            plans.iter().enumerate().map(|(i, p)| (p.id, i)).collect();
        let mut first = true;
        loop {
            let mut seqs = Vec::new();
            let mut who = Vec::new();
            let mut catching_up = false;
            for (id, slot) in self.sessions.iter_mut() {
                let (Some(&i), Some(state)) = (index.get(id), slot.draft.as_mut()) else {
                    continue;
                };
                if plans[i].feed.is_empty() {
                    continue;
                }
                catching_up |= plans[i].feed.len() > 2;
                seqs.push(Sequence {
                    kv: &mut state.kv,
                    tokens: &plans[i].feed,
                    logits: LogitsWanted::Last,
                });
                who.push(i);
            }
            if seqs.is_empty() {
                return;
            }
            let started = Instant::now();
            let result = draft
                .model
                .forward(&mut seqs, &self.compute, &mut draft.scratch);
            drop(seqs);
            let rows = match result {
                Ok(rows) => rows,
                Err(e) => {
                    // Only speed is lost: the drafts go, nothing is proposed.
                    tracing::error!(worker = self.index, "draft pass failed: {e}");
                    for plan in plans.iter_mut() {
                        // A length no proposal reaches: none is added.
                        plan.want = usize::MAX;
                        if let Some(slot) = self.sessions.get_mut(&plan.id) {
                            slot.draft = None;
                        }
                    }
                    return;
                }
            };
            // A catch-up over a prompt is not a draft step's cost.
            if !first || !catching_up {
                draft.cost.learn_draft_step(started.elapsed());
            }
            first = false;
            for (b, &i) in who.iter().enumerate() {
                let plan = &mut plans[i];
                let Some(state) = self
                    .sessions
                    .get_mut(&plan.id)
                    .and_then(|slot| slot.draft.as_mut())
                else {
                    continue;
                };
                state.history.append(&mut plan.feed);
                let Some(row) = rows.per_sequence.get(b).and_then(|r| r.end.checked_sub(1)) else {
                    continue;
                };
                if plan.proposal.len() < plan.want {
                    let token = greedy(&draft.scratch.logits[row * vocab..][..vocab]);
                    plan.proposal.push(token);
                    if plan.proposal.len() < plan.want {
                        plan.feed.push(token);
                    }
                }
            }
        }
    }
}
