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
//! (`speculate::Sizer`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::speculative::Proposer;
use super::{Engine, EngineConfig, EngineError, Session};
use crate::model::Model;
use crate::speculate::{pass_cost, Sizer};

/// A draft model and its session.
pub struct Draft {
    engine: Engine,
    session: Session,
    sizer: Sizer,
    /// Recent time of one draft step, and of one main decode step (a
    /// verification pass over its cost in decode steps).
    draft_step: Option<Duration>,
    main_step: Option<Duration>,
    /// How long the last proposal took to make, and how many tokens.
    last: (Duration, usize),
}

impl Draft {
    /// A draft engine for `model`, which must have `vocab` tokens (the main
    /// model's; a caller also checks that the tokens are the same ones).
    pub fn new(model: Arc<Model>, cfg: &EngineConfig, vocab: usize) -> Result<Self, EngineError> {
        if model.config.vocab != vocab {
            return Err(EngineError::DraftVocabulary {
                draft: model.config.vocab,
                main: vocab,
            });
        }
        let engine = Engine::new(model, cfg)?;
        let session = engine.new_session();
        Ok(Draft {
            engine,
            session,
            sizer: Sizer::default(),
            draft_step: None,
            main_step: None,
            last: (Duration::ZERO, 0),
        })
    }

    /// What one draft step costs in main decode steps (1 until measured,
    /// which keeps proposals short until then).
    fn step_cost(&self) -> f32 {
        match (self.draft_step, self.main_step) {
            (Some(d), Some(m)) if !m.is_zero() => d.as_secs_f32() / m.as_secs_f32(),
            _ => 1.0,
        }
    }

    /// Cuts the draft session back to the longest prefix it shares with
    /// `history`, short of its last token (which is fed again, so that the
    /// draft's next logits are there to propose from); a cut its pages
    /// cannot take (a sliding window gave them back) starts it afresh.
    fn sync(&mut self, history: &[u32]) -> Result<(), EngineError> {
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
        self.engine.append(&mut self.session, &history[have..])
    }
}

impl Proposer for Draft {
    fn propose(&mut self, history: &[u32], limit: usize) -> Result<Vec<u32>, EngineError> {
        let want = self.sizer.length(self.step_cost()).min(limit);
        if want == 0 || history.is_empty() {
            return Ok(Vec::new());
        }
        self.sync(history)?;
        let started = Instant::now();
        let mut proposal = Vec::with_capacity(want);
        while proposal.len() < want {
            let token = argmax(&self.session.next_logits);
            proposal.push(token);
            if proposal.len() < want {
                self.engine.append(&mut self.session, &[token])?;
            }
        }
        self.last = (started.elapsed(), want);
        Ok(proposal)
    }

    fn learn(&mut self, proposed: usize, accepted: usize, pass: Duration) {
        self.sizer.learn(proposed, accepted);
        let decay = |old: Option<Duration>, new: Duration| {
            Some(old.map_or(new, |old| old.mul_f32(0.7) + new.mul_f32(0.3)))
        };
        // A proposal of n tokens ran n - 1 draft steps (the first came from
        // the logits its catching up left).
        let (took, tokens) = self.last;
        if tokens > 1 {
            self.draft_step = decay(self.draft_step, took / (tokens - 1) as u32);
        }
        self.main_step = decay(self.main_step, pass.div_f32(pass_cost(proposed)));
        self.last = (Duration::ZERO, 0);
    }
}

/// The highest logit's token (the first of equals).
fn argmax(logits: &[f32]) -> u32 {
    let mut best = (f32::NEG_INFINITY, 0usize);
    for (i, &v) in logits.iter().enumerate() {
        if v > best.0 {
            best = (v, i);
        }
    }
    best.1 as u32
}
