//! The batched step: plan what each session feeds (a decode token or a
//! prefill chunk sized to the step budget), run one forward through the
//! [`StepRunner`](super::super::StepRunner), commit, check the invariants
//! and settle sliding-window pages.

use super::*;

impl Worker {
    /// One turn: start queued operations, run one batched forward, emit.
    /// Returns whether anything moved.
    pub(crate) fn step(&mut self) -> bool {
        let ids: Vec<SessionId> = self.sessions.keys().copied().collect();
        let mut moved = false;
        for &id in &ids {
            moved |= self
                .with_session(id, |w, slot| w.start_next(id, slot))
                .unwrap_or(false);
        }
        for &id in &ids {
            moved |= self
                .with_session(id, |w, slot| w.plan(id, slot))
                .unwrap_or(false);
        }
        self.sample_planned();
        moved | self.run_batch()
    }

    /// Decides what the session feeds this step (a prefill chunk or one
    /// sampled token), or ends its Generate. Returns whether it moved.
    pub(super) fn plan(&mut self, id: SessionId, slot: &mut SessionSlot) -> bool {
        let context = self.model.config.context;
        let chunk = self.chunk_at(slot.session.history().len());
        slot.feed.clear();
        let Some(active) = slot.active.as_mut() else {
            return false;
        };
        // Checked before every prompt chunk and every decode step, so a call
        // stops within one step (undoing a prompt it had not finished).
        if let Some(end) = active.stopped() {
            self.abandon(id, slot, end);
            return true;
        }
        if active.fed < active.pending.len() {
            let end = (active.fed + chunk).min(active.pending.len());
            slot.feed
                .extend_from_slice(&active.pending[active.fed..end]);
            slot.feed_logits = if end == active.pending.len() {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            };
            return true;
        }
        if !matches!(active.work, Work::Generate(_)) {
            return false;
        }
        let full = slot.session.history().len() >= context;
        if full && self.cfg.overflow == OverflowPolicy::Stop {
            self.finish_generate(id, slot, Ok(StopReason::Truncated));
            return true;
        }
        let Some(Active {
            work: Work::Generate(gen),
            ..
        }) = &slot.active
        else {
            return false;
        };
        // Room for a token (and its log-probabilities), a `Truncated` when
        // the window shifts, and a terminal event, or the session sits out.
        let room = gen
            .events
            .capacity()
            .map_or(usize::MAX, |c| c.saturating_sub(gen.events.len()));
        if room < 2 + usize::from(full) + usize::from(gen.top_logprobs > 0) {
            return false;
        }
        if full {
            return self.shift_window(id, slot);
        }
        // Pages first: a session waiting for another worker's eviction sits
        // out the step and samples the same token next time.
        let total = slot.session.history().len() + 1;
        match self.reserve(id, slot, total) {
            Ok(Got::Now) => {}
            Ok(Got::Later) => return false,
            Err(e) => {
                self.finish_generate(id, slot, Err(e));
                return true;
            }
        }
        // The token itself is sampled with the rest of the step's batch.
        self.to_sample.push(id);
        true
    }

    /// How many prompt tokens a session at `depth` feeds this step: as many
    /// as fit the step budget by the recent cost per token (attention makes
    /// a token deeper in the history dearer), at most `prefill_chunk`.
    pub(super) fn chunk_at(&self, depth: usize) -> usize {
        let most = self.cfg.prefill_chunk.max(1);
        let Some(ns) = self.ns_per_weighted_token else {
            return most;
        };
        let budget = self.cfg.prefill_step_budget.as_nanos() as f64;
        let fits = budget / (ns * depth_weight(depth)).max(1.0);
        (fits as usize).clamp(1, most)
    }

    /// Learns the cost per depth-weighted token from a step that took
    /// `elapsed` to feed `feeds` (tokens, depth before them).
    pub(super) fn learn_step_cost(&mut self, elapsed: Duration, feeds: &[(usize, usize)]) {
        let weighted: f64 = feeds
            .iter()
            .map(|&(tokens, depth)| tokens as f64 * depth_weight(depth + tokens / 2))
            .sum();
        if weighted <= 0.0 {
            return;
        }
        let sample = elapsed.as_nanos() as f64 / weighted;
        self.ns_per_weighted_token = Some(match self.ns_per_weighted_token {
            // Recent steps count most; one odd step moves it only so far.
            Some(ns) => 0.7 * ns + 0.3 * sample,
            None => sample,
        });
    }

    /// Runs one forward over every planned feed and applies the results.
    pub(super) fn run_batch(&mut self) -> bool {
        let mut ids = Vec::new();
        let mut feeds = Vec::new();
        let mut fed = Vec::new();
        let mut kept = Vec::new();
        let keeps = self.runner.keeps_logits();
        // A step of decode tokens alone (each maybe with a proposal) is
        // timed for what verification costs (`PassTimes`).
        let mut decode_only = true;
        for (id, slot) in self.sessions.iter_mut() {
            if !slot.feed.is_empty() {
                decode_only &= slot.feed.len() == 1 + slot.proposed() && !slot.prefilling();
                ids.push(*id);
                fed.push((slot.feed.len(), slot.session.history().len()));
                // A generating session samples its logits where they are.
                let keep = keeps
                    && slot.feed_logits == LogitsWanted::Last
                    && matches!(
                        slot.active,
                        Some(Active {
                            work: Work::Generate(_),
                            ..
                        })
                    );
                kept.push(keep);
                let mut feed = slot.session.step_feed(*id, &slot.feed, slot.feed_logits);
                feed.keep_logits = keep;
                feeds.push(feed);
            }
        }
        if feeds.is_empty() {
            return false;
        }
        let started = Instant::now();
        let result = self
            .runner
            .forward(&mut feeds, &self.compute, &mut self.scratch);
        drop(feeds);
        self.learn_step_cost(started.elapsed(), &fed);
        self.count_step(ids.len());
        match result {
            Ok(rows) => {
                self.commit_batch(ids, &kept, &rows);
                // With the verifications' sampling, which the proposals
                // added to the step.
                if decode_only {
                    let rows = fed.iter().map(|&(tokens, _)| tokens).sum();
                    self.pass_times.learn(rows, started.elapsed());
                }
            }
            Err(StepError::SessionsLost(err)) => {
                tracing::error!(worker = self.index, "batched forward failed: {err}");
                for id in ids {
                    self.with_session(id, |w, slot| w.fail_slot(id, slot, err.clone()));
                }
            }
            Err(StepError::NothingCommitted(err)) => {
                for id in ids {
                    self.with_session(id, |w, slot| w.fail_step(id, slot, err.clone()));
                }
            }
        }
        true
    }

    /// The step gauges, after a batch of `sequences` went through.
    pub(super) fn count_step(&self, sequences: usize) {
        let g = &self.gauges;
        g.steps.fetch_add(1, Ordering::Relaxed);
        g.last_batch_sequences
            .store(sequences as u64, Ordering::Relaxed);
        g.max_batch_sequences
            .fetch_max(sequences as u64, Ordering::Relaxed);
    }

    /// A step that committed nothing failed for `id`: its call fails with
    /// `err`, and whatever the call had fed is undone (remote layers
    /// rebuild the session at its next step). Only a restore of a history
    /// whose pages were given back cannot be undone: that session goes.
    pub(super) fn fail_step(&mut self, id: SessionId, slot: &mut SessionSlot, err: RuntimeError) {
        slot.feed.clear();
        slot.last_used = Instant::now();
        let Some(mut active) = slot.active.take() else {
            return;
        };
        if matches!(active.work, Work::Fork { .. }) {
            // A fork that could not be completed is not kept.
            finish_with_error(active, err.clone());
            return self.fail_slot(id, slot, err);
        }
        if matches!(active.work, Work::Restore) {
            let removed = match err {
                RuntimeError::Shard { status, message } => RuntimeError::Shard {
                    status,
                    message: format!(
                        "{message}; the session was removed (its history was being fed again)"
                    ),
                },
                other => other,
            };
            return self.fail_slot(id, slot, removed);
        }
        if let Some(undo) = active.undo.take() {
            if let Err(e) = self.apply_undo(id, slot, undo) {
                finish_with_error(active, err);
                return self.fail_slot(id, slot, e);
            }
        }
        finish_with_error(active, err);
    }

    /// Applies a successful step's results to its sessions (`kept[i]`: the
    /// layers hold session `ids[i]`'s new logits).
    pub(super) fn commit_batch(&mut self, ids: Vec<SessionId>, kept: &[bool], rows: &LogitRows) {
        let vocab = self.model.config.vocab;
        for (i, id) in ids.into_iter().enumerate() {
            let range = rows.per_sequence.get(i).cloned();
            let row = range.as_ref().and_then(|r| r.end.checked_sub(1));
            let kept = kept.get(i).copied().unwrap_or(false);
            self.with_session(id, |w, slot| {
                if slot.proposed() > 0 {
                    w.commit_speculative(id, slot, range)
                } else {
                    w.commit_one(id, slot, row, kept, vocab)
                }
            });
        }
    }

    /// Applies one session's part of a successful step: `row` is its last
    /// fed position's row of logits, if there is one; `kept`: the layers
    /// hold that row instead.
    fn commit_one(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        row: Option<usize>,
        kept: bool,
        vocab: usize,
    ) {
        let committed = if kept {
            slot.session
                .commit_fed_kept(&slot.feed, &self.shared.counters)
        } else {
            let logits = row
                .filter(|_| slot.feed_logits != LogitsWanted::None)
                .map(|r| &self.scratch.logits[r * vocab..][..vocab]);
            slot.session
                .commit_fed(&slot.feed, logits, &self.shared.counters)
        };
        if let Err(e) = committed {
            return self.fail_slot(id, slot, e);
        }
        if let Some(index) = &self.shared.prefix {
            slot.session.list_full_pages(id, index);
        }
        self.after_feed(id, slot);
        self.settle_kv(id, slot);
    }

    /// Once a session's call can no longer be undone (its prompt is all in,
    /// or it has none), gives back the KV pages its sliding-window layers
    /// will not read again.
    pub(super) fn settle_kv(&mut self, id: SessionId, slot: &mut SessionSlot) {
        if slot.removed || slot.active.as_ref().is_some_and(|a| a.undo.is_some()) {
            return;
        }
        if let Err(e) = slot.session.settle() {
            tracing::error!(session = %id, "giving back window pages: {e}");
            self.fail_slot(id, slot, e.into());
        }
    }

    /// Removes a session whose call failed, telling every waiter.
    pub(super) fn fail_slot(&mut self, id: SessionId, slot: &mut SessionSlot, err: RuntimeError) {
        self.end_slot(id, slot, Removal::Failed, err, || RuntimeError::NotFound);
    }

    /// Removes the session an operation holds for `reason`: its running
    /// operation ends with `err`, each queued one with `queued()`.
    pub(super) fn end_slot(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        reason: Removal,
        err: RuntimeError,
        queued: impl Fn() -> RuntimeError,
    ) {
        if slot.removed {
            return;
        }
        self.remove_slot(id, slot, reason);
        if let Some(active) = slot.active.take() {
            finish_with_error(active, err);
        }
        for q in slot.queue.drain(..) {
            q.op.fail(queued());
        }
    }
}
