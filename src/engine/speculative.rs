//! Speculative decoding in the engine: each step feeds the sampled token
//! together with the tokens a [`Proposer`] proposes after it (prompt
//! lookup, `speculate`, or a draft model, `draft`) in one forward pass,
//! then samples every proposed position from its own row of logits,
//! exactly as plain decoding would sample it (the same logits, since a
//! chunk's rows are the bits one-at-a-time decoding computes; the same
//! history for the penalties; the same position for the sampler's
//! counter). The first proposed token that differs from the one sampled
//! ends the accepted run; the positions after it are rolled back. So the
//! tokens are the plain decoding's, to the bit, whatever was proposed. A
//! constraint's masks come from a copy of it walked along the proposal
//! (`Constraint::proposal_masks`, as the server's workers use).

use std::time::Instant;

use super::{end_before_sampling, Engine, EngineError, Generation, Session, StopReason};
use crate::constraint::Constraint;
use crate::model::LogitsWanted;
use crate::sampler::{CheckedParams, SampleRequest, SamplerBackend, SamplingParams};
use crate::speculate::{Costs, Lookup};

/// What proposes the tokens a speculative step verifies.
pub trait Proposer {
    /// Called once before a generation continues `history`: a proposer
    /// with state of its own (a draft model's KV) catches up here, with
    /// the prompt, rather than in the middle of decoding, if proposing
    /// could pay at verification's `costs`.
    fn prepare(&mut self, _history: &[u32], _costs: &Costs) -> Result<(), EngineError> {
        Ok(())
    }

    /// Tokens that may follow `history` (which ends with the token just
    /// sampled), at most `limit`, sized by what verifying them `costs`;
    /// empty when there is nothing to propose.
    fn propose(
        &mut self,
        history: &[u32],
        limit: usize,
        costs: &Costs,
    ) -> Result<Vec<u32>, EngineError>;

    /// The first `accepted` of `proposed` tokens were the ones sampled.
    fn learn(&mut self, proposed: usize, accepted: usize);
}

impl Proposer for Lookup {
    fn propose(
        &mut self,
        history: &[u32],
        limit: usize,
        costs: &Costs,
    ) -> Result<Vec<u32>, EngineError> {
        let mut proposal = Vec::new();
        if let Some((&next, before)) = history.split_last() {
            self.propose_after(before, next, limit, costs, &mut proposal);
        }
        Ok(proposal)
    }

    fn learn(&mut self, proposed: usize, accepted: usize) {
        Lookup::learn(self, proposed, accepted);
    }
}

/// What speculation did in one generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Speculation {
    /// Tokens proposed (and computed) beyond the one sampled each step.
    pub proposed: u64,
    /// Proposed tokens that were the ones sampled.
    pub accepted: u64,
    /// Forward passes run.
    pub steps: u64,
}

impl Engine {
    /// [`Engine::generate`] with prompt-lookup speculation: the same tokens
    /// and stop, in fewer forward passes where the history repeats itself.
    /// On a GPU engine it is plain decoding (the logits stay there).
    pub fn generate_speculative(
        &mut self,
        session: &mut Session,
        params: &SamplingParams,
        max_tokens: usize,
        stop_tokens: &[u32],
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Generation, Speculation), EngineError> {
        let mut lookup = Lookup::default();
        self.generate_proposed(
            session,
            &mut lookup,
            params,
            max_tokens,
            stop_tokens,
            None,
            on_token,
        )
    }

    /// [`Engine::generate_constrained`] verifying what `proposer`
    /// proposes: the same tokens and stop, in fewer forward passes where
    /// proposals are accepted. A constrained generation's proposal is cut
    /// to what the grammar takes, and each proposed position is sampled
    /// under the mask the grammar gives after the tokens before it. On a
    /// GPU engine it is plain decoding.
    #[allow(clippy::too_many_arguments)] // generate_constrained's, and the proposer
    pub fn generate_proposed(
        &mut self,
        session: &mut Session,
        proposer: &mut dyn Proposer,
        params: &SamplingParams,
        max_tokens: usize,
        stop_tokens: &[u32],
        mut constraint: Option<&mut Constraint>,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Generation, Speculation), EngineError> {
        #[cfg(not(loom))]
        if self.gpu.is_some() {
            let plain = self.generate_constrained(
                session,
                params,
                max_tokens,
                stop_tokens,
                constraint,
                on_token,
            )?;
            return Ok((plain, Speculation::default()));
        }
        let params = params.clone().checked(self.model.config.vocab)?;
        if session.history.is_empty() || session.next_logits.is_empty() {
            return Err(EngineError::EmptyHistory);
        }
        let vocab = self.model.config.vocab;
        let context = self.model.config.context;
        proposer.prepare(&session.history, &self.pass_times.costs(1))?;
        let mut counts = Speculation::default();
        let mut tokens = Vec::new();
        let mut feed = Vec::new();
        let mut mask = Vec::new();
        let mut row_masks = Vec::new();
        let stop = loop {
            if let Some(end) = end_before_sampling(
                constraint.as_deref_mut(),
                &tokens,
                max_tokens,
                stop_tokens,
                &mut mask,
            )? {
                break end;
            }
            let position = session.history.len();
            let first = sample(
                &mut self.sampler,
                &session.next_logits,
                &params,
                &session.history,
                constraint.is_some().then_some(&mask[..]),
            )?;
            if let Some(c) = constraint.as_mut() {
                c.accept(first, stop_tokens)?;
            }
            let is_stop = stop_tokens.contains(&first);
            // Only what may still be emitted, and fits the context.
            let room = (max_tokens - tokens.len() - 1).min(context.saturating_sub(position + 1));
            feed.clear();
            feed.push(first);
            if !is_stop && room > 0 {
                session.history.push(first);
                let costs = self.pass_times.costs(1);
                let proposal = proposer.propose(&session.history, room, &costs);
                session.history.pop();
                let proposal = proposal?;
                let take = constraint
                    .as_ref()
                    .map_or(proposal.len(), |c| c.valid_prefix(&proposal, stop_tokens));
                feed.extend_from_slice(&proposal[..take]);
            }
            let proposed = feed.len() - 1;
            let started = Instant::now();
            let row0 = self.feed_all(session, &feed)?;
            // The pass's time with its rows' sampling, not the caller's.
            let mut pass = started.elapsed();
            counts.steps += 1;
            tokens.push(first);
            let go_on = on_token(first);
            let mut end = emitted_end(constraint.as_deref(), is_stop, go_on);
            let mut accepted = 0;
            let rows = constraint.as_ref().map_or(proposed, |c| {
                c.proposal_masks(&feed[1..], stop_tokens, &mut row_masks)
            });
            if end.is_none() {
                for i in 0..rows {
                    let at = position + 1 + i;
                    let row = &self.scratch.logits[(row0 + i) * vocab..][..vocab];
                    let sampling = Instant::now();
                    let sampled = sample(
                        &mut self.sampler,
                        row,
                        &params,
                        &session.history[..at],
                        constraint.is_some().then(|| &row_masks[i][..]),
                    )?;
                    pass += sampling.elapsed();
                    if sampled != feed[1 + i] {
                        break;
                    }
                    if let Some(c) = constraint.as_mut() {
                        c.accept(sampled, stop_tokens)?;
                    }
                    accepted += 1;
                    tokens.push(sampled);
                    let go_on = on_token(sampled);
                    end = emitted_end(constraint.as_deref(), stop_tokens.contains(&sampled), go_on);
                    if end.is_some() {
                        break;
                    }
                }
            }
            proposer.learn(proposed, accepted);
            self.pass_times.learn(feed.len(), pass);
            counts.proposed += proposed as u64;
            counts.accepted += accepted as u64;
            // Keep the sampled token and the accepted run; the logits after
            // the last kept token predict the next.
            let kept = position + 1 + accepted;
            session.kv.roll_back_to(kept)?;
            session.history.truncate(kept);
            session.kv.settle()?;
            self.keep_logits(session, row0 + accepted);
            if let Some(end) = end {
                break end;
            }
        };
        Ok((Generation { tokens, stop }, counts))
    }

    /// What verifying each proposal length costs now, in decode steps, as
    /// its passes were timed.
    pub fn verification_costs(&self) -> Costs {
        self.pass_times.costs(1)
    }

    /// Feeds `tokens` in one forward pass wanting every row's logits; the
    /// index of the first row in the scratch logits. Nothing is settled:
    /// the caller may still roll positions back.
    fn feed_all(&mut self, session: &mut Session, tokens: &[u32]) -> Result<usize, EngineError> {
        self.model.check_append(session.kv.len(), tokens)?;
        session.kv.reserve(session.kv.len() + tokens.len())?;
        // One token (nothing proposed) takes the plain decode's path.
        let want = if tokens.len() == 1 {
            LogitsWanted::Last
        } else {
            LogitsWanted::All
        };
        Ok(self.forward_unsettled(session, tokens, want)?.start)
    }
}

/// How a generation ends after emitting a token, as plain decoding ends
/// it: a complete constraint, a stop id, a caller that wants no more.
fn emitted_end(constraint: Option<&Constraint>, is_stop: bool, go_on: bool) -> Option<StopReason> {
    if let Some(end) = constraint.and_then(|c| c.end_after(is_stop)) {
        Some(end)
    } else if is_stop {
        Some(StopReason::Eos)
    } else if !go_on {
        Some(StopReason::Cancelled)
    } else {
        None
    }
}

/// The token plain decoding samples from `logits` after `history` (its
/// position is the history's length), under `mask` when constrained.
fn sample(
    sampler: &mut SamplerBackend,
    logits: &[f32],
    params: &CheckedParams,
    history: &[u32],
    mask: Option<&[u32]>,
) -> Result<u32, EngineError> {
    let request = SampleRequest {
        logits,
        params,
        history,
        position: history.len() as u64,
        top_logprobs: 0,
        mask,
    };
    Ok(sampler.sample(request)?.token)
}
