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
//! (`speculate::Sizer`); while no proposal is expected to beat plain
//! decoding it proposes nothing, trying one token every [`PROBE_EVERY`]
//! steps to see whether that changed, unless its steps cost too much for
//! any proposal to pay even if every token were accepted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::speculative::Proposer;
use super::{Engine, EngineConfig, EngineError, Session};
use crate::model::Model;
use crate::speculate::{greedy, pass_cost, Sizer, PROBE_EVERY};

/// A draft model and its session.
pub struct Draft {
    engine: Engine,
    session: Session,
    sizer: Sizer,
    /// Recent time of one draft step, and of one main decode step (a
    /// verification pass over its cost in decode steps).
    draft_step: Option<Duration>,
    main_step: Option<Duration>,
    /// What a draft step costs in main decode steps until both are timed.
    prior_cost: f32,
    /// How long the last proposal took to make, and in how many draft steps.
    last: (Duration, usize),
    /// Steps since the draft last proposed.
    idle: usize,
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
        // Until measured, a step is taken to cost what reading the weights
        // does: decode streams them once per token.
        let weights = |m: &Model| (m.gguf().file_len() - m.gguf().data_start()).max(1) as f32;
        let prior = weights(&model) / weights(main);
        let engine = Engine::new(model, cfg)?;
        let session = engine.new_session();
        Ok(Draft {
            engine,
            session,
            sizer: Sizer::default(),
            draft_step: None,
            main_step: None,
            prior_cost: prior,
            last: (Duration::ZERO, 0),
            idle: 0,
            fixed: None,
        })
    }

    /// Proposes `length` tokens every step instead of sizing proposals by
    /// what they earn (`None`: sized).
    pub fn with_fixed_length(mut self, length: Option<usize>) -> Self {
        self.fixed = length;
        self
    }

    /// What one draft step costs in main decode steps.
    fn step_cost(&self) -> f32 {
        match (self.draft_step, self.main_step) {
            (Some(d), Some(m)) if !m.is_zero() => d.as_secs_f32() / m.as_secs_f32(),
            _ => self.prior_cost,
        }
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
    fn prepare(&mut self, history: &[u32]) -> Result<(), EngineError> {
        if self.fixed.is_some() || Sizer::could_pay(self.step_cost()) {
            self.sync(history)?;
        }
        Ok(())
    }

    fn propose(&mut self, history: &[u32], limit: usize) -> Result<Vec<u32>, EngineError> {
        let cost = self.step_cost();
        let worth = match self.fixed.map_or_else(|| self.sizer.worth(cost), Some) {
            Some(length) => Some(length),
            // Probing is worth it only if acceptance is what is lacking: a
            // draft too slow to pay even when always right stays idle.
            None if self.idle + 1 >= PROBE_EVERY && Sizer::could_pay(cost) => Some(1),
            None => None,
        };
        let want = worth.unwrap_or(0).min(limit);
        if want == 0 || history.is_empty() {
            self.idle += 1;
            return Ok(Vec::new());
        }
        self.idle = 0;
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

    fn learn(&mut self, proposed: usize, accepted: usize, pass: Duration) {
        self.sizer.learn(proposed, accepted);
        let decay = |old: Option<Duration>, new: Duration| {
            Some(old.map_or(new, |old| old.mul_f32(0.7) + new.mul_f32(0.3)))
        };
        let (took, steps) = self.last;
        if steps > 0 {
            self.draft_step = decay(self.draft_step, took / steps as u32);
        }
        self.main_step = decay(self.main_step, pass.div_f32(pass_cost(proposed)));
        self.last = (Duration::ZERO, 0);
    }
}
