//! Speculative steps: after a generating session's token is sampled, prompt
//! lookup proposes what may follow it and the proposal is fed in the same
//! step, every row's logits wanted. After the step each proposed position
//! is sampled from its own row exactly as plain decoding samples it there
//! (the same history before it, the same position for the sampler's
//! counter); the run up to the first disagreement is emitted token by
//! token with plain decoding's stop checks, and the KV of everything after
//! the last emitted token is dropped before the commit. A constrained
//! call's proposal is cut to what its grammar takes, and each row is
//! sampled under the mask the grammar gives after the tokens before it (a
//! copy of the constraint walks the proposal; the call's own moves only
//! past what is emitted). The tokens, log-probabilities, history and next
//! logits are plain decoding's; only the number of forward passes differs.

use std::ops::Range;

use super::generate::{advance_constraint, token_fed};
use super::*;

impl Worker {
    /// Adds what the session's lookup proposes after the token just
    /// sampled for it (its feed's only token) to its feed, as far as
    /// `max_tokens`, the context, the stream's room and free pages allow;
    /// or, for a call that drafts, notes the session for this step's
    /// drafting.
    pub(super) fn propose(&mut self, id: SessionId) {
        let context = self.model.config.context;
        let Some(slot) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some((token, limit)) = proposal_room(slot, context) else {
            return;
        };
        let SessionSlot {
            session, active, ..
        } = slot;
        let Some(Active {
            work: Work::Generate(gen),
            ..
        }) = active.as_mut()
        else {
            return;
        };
        let mut proposal = std::mem::take(&mut self.lookup_history);
        proposal.clear();
        match gen.proposer.as_mut() {
            Some(Proposer::Lookup(lookup)) => {
                let costs = self.pass_times.costs(self.step_rows);
                lookup.propose_after(session.history(), token, limit, &costs, &mut proposal);
            }
            // Drafted for with the step's other drafting sessions, after
            // the sampling (`propose_drafts`).
            Some(Proposer::Draft) => self.to_draft.push((id, limit)),
            None => {}
        }
        add_proposal(slot, &proposal);
        self.step_rows += slot.proposed();
        self.lookup_history = proposal;
    }

    /// Applies a step that fed a sampled token and a proposal after it
    /// (`rows`: their rows of logits): verifies the proposal, emits the
    /// accepted run as plain decoding would emit it, drops the KV after
    /// the last emitted token and commits the rest.
    pub(super) fn commit_speculative(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        rows: Option<Range<usize>>,
    ) {
        let vocab = self.model.config.vocab;
        let proposed = slot.proposed();
        let feed = std::mem::take(&mut slot.feed);
        let Some(rows) = rows.filter(|r| r.len() == feed.len()) else {
            let err = RuntimeError::Internal("a speculative step returned no row per token".into());
            return self.fail_slot(id, slot, err);
        };
        let verified = self.verify(slot, &feed, rows.start);
        let accepted = verified
            .iter()
            .zip(&feed[1..])
            .take_while(|(sampled, &token)| sampled.as_ref().is_ok_and(|s| s.token == token))
            .count();
        // Emitted in order, with each token's stop checks: a run that
        // reaches a stop is kept up to it, as plain decoding would stop.
        let mut logprobs = verified
            .into_iter()
            .map(|r| r.ok().and_then(|s| s.logprobs));
        let (mut kept, mut end) = (0, None);
        for (j, &token) in feed[..=accepted].iter().enumerate() {
            if j > 0 {
                set_pending_logprobs(slot, logprobs.next().flatten());
                // The sampled token moved the constraint when it was
                // sampled; an accepted one moves it now.
                if let Err(e) = advance_constraint(slot, token) {
                    end = Some(Err(RuntimeError::invalid(e.to_string())));
                    break;
                }
            }
            kept = j + 1;
            end = token_fed(slot, token, &self.shared, &self.gauges).map(Ok);
            if end.is_some() {
                break;
            }
        }
        self.count_speculation(slot, proposed, accepted, kept - 1);
        let position = slot.session.history().len();
        let logits = &self.scratch.logits[(rows.start + kept - 1) * vocab..][..vocab];
        let committed = slot
            .session
            .drop_uncommitted(position + kept)
            .map_err(RuntimeError::from)
            .and_then(|()| {
                slot.session
                    .commit_fed(&feed[..kept], Some(logits), &self.shared.counters)
            });
        slot.feed = feed;
        slot.feed.clear();
        if let Err(e) = committed {
            return self.fail_slot(id, slot, e);
        }
        if let Some(index) = &self.shared.prefix {
            slot.session.list_full_pages(id, index);
        }
        if let Some(end) = end {
            self.finish_generate(id, slot, end);
        }
        self.settle_kv(id, slot);
    }

    /// Samples every proposed position of `feed` (the sampled token, then
    /// the proposal) from its row, starting at `first_row`, with the
    /// history plain decoding would have there, in one batch with the
    /// worker's sampler.
    fn verify(
        &mut self,
        slot: &SessionSlot,
        feed: &[u32],
        first_row: usize,
    ) -> Vec<Result<Sampled, SamplerError>> {
        let Some(Active {
            work: Work::Generate(gen),
            ..
        }) = slot.active.as_ref()
        else {
            return Vec::new();
        };
        let vocab = self.model.config.vocab;
        let history = slot.session.history();
        let position = history.len();
        self.lookup_history.clear();
        self.lookup_history.extend_from_slice(history);
        self.lookup_history.extend_from_slice(feed);
        let eos = slot.session.eos();
        let rows = gen.constraint.as_ref().map_or(feed.len() - 1, |c| {
            c.proposal_masks(&feed[1..], eos, &mut self.row_masks)
        });
        let masks = &self.row_masks;
        let requests: Vec<SampleRequest<'_>> = (1..=rows)
            .map(|j| SampleRequest {
                logits: &self.scratch.logits[(first_row + j - 1) * vocab..][..vocab],
                params: &gen.params,
                history: &self.lookup_history[..position + j],
                position: (position + j) as u64,
                top_logprobs: gen.top_logprobs,
                mask: gen.constraint.is_some().then(|| &masks[j - 1][..]),
            })
            .collect();
        let mut out = Vec::with_capacity(requests.len());
        match self.sampler.as_mut() {
            Some(sampler) => sampler.sample_batch(&requests, &mut out),
            None => self.runner.sample_host(&requests, &mut out),
        }
        out
    }

    /// Counts a verified proposal: the lookup learns from the `accepted`
    /// run, the counters count the `emitted` part of it.
    fn count_speculation(
        &self,
        slot: &mut SessionSlot,
        proposed: usize,
        accepted: usize,
        emitted: usize,
    ) {
        let counters = &self.shared.counters;
        counters
            .speculation_proposed
            .fetch_add(proposed as u64, Ordering::Relaxed);
        counters
            .speculation_accepted
            .fetch_add(emitted as u64, Ordering::Relaxed);
        slot.speculation.proposed += proposed as u64;
        slot.speculation.accepted += emitted as u64;
        if let Some(Active {
            work: Work::Generate(gen),
            ..
        }) = slot.active.as_mut()
        {
            gen.speculation.proposed += proposed as u64;
            gen.speculation.accepted += emitted as u64;
            match gen.proposer.as_mut() {
                Some(Proposer::Lookup(lookup)) => lookup.learn(proposed, accepted),
                Some(Proposer::Draft) => {
                    if let Some(draft) = slot.draft.as_mut() {
                        draft.learn(proposed, accepted);
                    }
                }
                None => {}
            }
        }
    }
}

/// The log-probabilities to send with the next emitted token.
fn set_pending_logprobs(slot: &mut SessionSlot, logprobs: Option<crate::sampler::TokenLogprobs>) {
    if let Some(Active {
        work: Work::Generate(gen),
        ..
    }) = slot.active.as_mut()
    {
        gen.pending_logprobs = logprobs;
    }
}

/// The sampled token a generating session's feed holds (its only token),
/// and how many tokens may be proposed after it: as far as `max_tokens`,
/// the context and the stream's room allow. `None`: nothing may be.
pub(super) fn proposal_room(slot: &SessionSlot, context: usize) -> Option<(u32, usize)> {
    let Some(Active {
        work: Work::Generate(gen),
        ..
    }) = slot.active.as_ref()
    else {
        return None;
    };
    let &[token] = &slot.feed[..] else {
        return None;
    };
    if gen.proposer.is_none() || slot.session.eos().contains(&token) {
        return None;
    }
    let position = slot.session.history().len();
    let tokens_left = (gen.max_tokens as usize).saturating_sub(gen.generated.len() + 1);
    let context_left = context.saturating_sub(position + 1);
    // Each emitted token takes one event (two with log-probabilities);
    // the sampled token's and the terminal event come first.
    let per_token = 1 + usize::from(gen.top_logprobs > 0);
    let stream_left = gen.events.capacity().map_or(usize::MAX, |capacity| {
        let free = capacity.saturating_sub(gen.events.len());
        (free.saturating_sub(1) / per_token).saturating_sub(1)
    });
    let limit = tokens_left.min(context_left).min(stream_left);
    (limit > 0).then_some((token, limit))
}

/// Feeds `proposal` after the session's sampled token, every row's logits
/// wanted; its pages only if they are free now (speculation never evicts
/// anything).
pub(super) fn add_proposal(slot: &mut SessionSlot, proposal: &[u32]) {
    let position = slot.session.history().len();
    let take = match slot.active.as_ref() {
        Some(Active {
            work: Work::Generate(gen),
            ..
        }) => gen.constraint.as_ref().map_or(proposal.len(), |c| {
            c.valid_prefix(proposal, slot.session.eos())
        }),
        _ => proposal.len(),
    };
    let proposal = &proposal[..take];
    if proposal.is_empty() || slot.session.reserve(position + 1 + proposal.len()).is_err() {
        return;
    }
    slot.feed.extend_from_slice(proposal);
    slot.feed_logits = LogitsWanted::All;
}
