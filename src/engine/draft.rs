//! Draft-model speculation in the engine: a smaller model with the same
//! vocabulary proposes the next tokens, its greedy choice one forward pass
//! at a time, and the main model verifies them in one pass
//! (`speculative.rs`), so the output is the main model's plain decoding,
//! whatever the draft proposes. The draft keeps a session of its own whose
//! history is a prefix of the main one: before proposing it is cut back to
//! what the two share and fed what it lacks.
//!
//! How many tokens it proposes follows the acceptance it has seen and what
//! a draft step costs next to a main decode step, both measured as it runs
//! (`speculate::DraftPace`, `speculate::DraftCost`); while no proposal is
//! expected to beat plain decoding it proposes nothing but an occasional
//! probe, and a draft too costly to pay even if always right stays idle.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::speculative::Proposer;
use super::{Engine, EngineConfig, EngineError, Session};
use crate::model::Model;
use crate::speculate::{greedy, Costs, DraftCost, DraftPace, Sizer};

/// A draft model and its session.
pub struct Draft {
    engine: Engine,
    session: Session,
    pace: DraftPace,
    cost: DraftCost,
    /// How long the last proposal took to make, and in how many draft steps.
    last: (Duration, usize),
    /// A proposal length fixed by the caller instead of sized.
    fixed: Option<usize>,
}

impl Draft {
    /// A draft engine for `model`, which must have as many tokens as
    /// `main` (a caller also checks that they are the same ones).
    pub fn new(model: Arc<Model>, cfg: &EngineConfig, main: &Model) -> Result<Self, EngineError> {
        if model.config.vocab != main.config.vocab {
            return Err(EngineError::DraftVocabulary {
                draft: model.config.vocab,
                main: main.config.vocab,
            });
        }
        let cost = DraftCost::new(model.weight_bytes(), main.weight_bytes());
        let engine = Engine::new(model, cfg)?;
        let session = engine.new_session();
        Ok(Draft {
            engine,
            session,
            pace: DraftPace::default(),
            cost,
            last: (Duration::ZERO, 0),
            fixed: None,
        })
    }

    /// Proposes `length` tokens every step instead of sizing proposals by
    /// what they earn (`None`: sized).
    pub fn with_fixed_length(mut self, length: Option<usize>) -> Self {
        self.fixed = length;
        self
    }

    /// Cuts the draft session back to the longest prefix it shares with
    /// `history`, short of its last token (which is fed again, so that the
    /// draft's next logits are there to propose from); a cut its pages
    /// cannot take (a sliding window gave them back) starts it afresh.
    /// Returns how many tokens it fed.
    fn sync(&mut self, history: &[u32]) -> Result<usize, EngineError> {
        let shared = self
            .session
            .history
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count()
            .min(history.len().saturating_sub(1));
        if shared < self.session.history.len() {
            let cut = self.session.kv.roll_back_to(shared).is_ok();
            if cut {
                self.session.history.truncate(shared);
                self.session.next_logits.clear();
            } else {
                self.session = self.engine.new_session();
            }
        }
        let have = self.session.history.len();
        self.engine.append(&mut self.session, &history[have..])?;
        Ok(history.len() - have)
    }
}

impl Proposer for Draft {
    fn prepare(&mut self, history: &[u32], costs: &Costs) -> Result<(), EngineError> {
        if self.fixed.is_some() || Sizer::could_pay(costs, self.cost.per_step(costs.step())) {
            self.sync(history)?;
        }
        Ok(())
    }

    fn propose(
        &mut self,
        history: &[u32],
        limit: usize,
        costs: &Costs,
    ) -> Result<Vec<u32>, EngineError> {
        let step = self.cost.per_step(costs.step());
        let want = self.pace.wanted(costs, step, self.fixed).min(limit);
        if want == 0 || history.is_empty() {
            return Ok(Vec::new());
        }
        let started = Instant::now();
        let fed = self.sync(history)?;
        // Catching up on a token or two (the steady state) is timed as a
        // draft step; a longer catch-up (the prompt) is not.
        let (started, steps) = if fed <= 2 {
            (started, want)
        } else {
            (Instant::now(), want - 1)
        };
        let mut proposal = Vec::with_capacity(want);
        while proposal.len() < want {
            let token = greedy(&self.session.next_logits);
            proposal.push(token);
            if proposal.len() < want {
                self.engine.append(&mut self.session, &[token])?;
            }
        }
        self.last = (started.elapsed(), steps);
        Ok(proposal)
    }

    fn learn(&mut self, proposed: usize, accepted: usize) {
        self.pace.learn(proposed, accepted);
        let (took, steps) = std::mem::take(&mut self.last);
        if steps > 0 {
            self.cost.learn_draft_step(took / steps as u32);
        }
    }
}
