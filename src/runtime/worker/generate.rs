//! Generate: sampling the next token of every generating session in one
//! batch, stop conditions, the stream's events and a call's end (finished,
//! cancelled or out of time).

use super::*;

impl Worker {
    /// Samples the next token of every session `plan` queued, as one batch
    /// (one GPU dispatch on the wgpu sampler), and feeds each its token.
    pub(super) fn sample_planned(&mut self) {
        if self.to_sample.is_empty() {
            return;
        }
        self.constrain_planned();
        let mut requests = Vec::with_capacity(self.to_sample.len());
        let mut kept_requests = Vec::new();
        for id in &self.to_sample {
            let Some(slot) = self.sessions.get(id) else {
                continue;
            };
            let Some(Active {
                work: Work::Generate(gen),
                ..
            }) = slot.active.as_ref()
            else {
                continue;
            };
            let request = SampleRequest {
                logits: slot.session.next_logits(),
                params: &gen.params,
                history: slot.session.history(),
                position: slot.session.history().len() as u64,
                top_logprobs: gen.top_logprobs,
                mask: gen.constraint.is_some().then_some(&gen.mask[..]),
            };
            // Logits the layers hold are sampled there, without coming back.
            if slot.session.logits_kept() {
                kept_requests.push((*id, request.row()));
            } else {
                requests.push((*id, request));
            }
        }
        let rows: Vec<SampleRequest<'_>> = requests.iter().map(|(_, r)| *r).collect();
        match self.sampler.as_mut() {
            Some(sampler) => sampler.sample_batch(&rows, &mut self.sampled),
            None => self.runner.sample_host(&rows, &mut self.sampled),
        }
        let mut kept_sampled = Vec::new();
        if !kept_requests.is_empty() {
            self.runner.sample_kept(&kept_requests, &mut kept_sampled);
        }
        let ids: Vec<SessionId> = requests
            .iter()
            .map(|(id, _)| *id)
            .chain(kept_requests.iter().map(|(id, _)| *id))
            .collect();
        drop(rows);
        drop(requests);
        drop(kept_requests);
        self.to_sample.clear();
        // Proposals are sized by what they add to the step as planned so
        // far: the prompt chunks, every sampled token, the proposals
        // already added.
        self.step_rows = ids.len();
        for slot in self.sessions.values() {
            self.step_rows += slot.feed.len();
        }
        let mut sampled = std::mem::take(&mut self.sampled);
        sampled.append(&mut kept_sampled);
        for (id, result) in ids.into_iter().zip(sampled.iter_mut()) {
            match result {
                Ok(sampled) => {
                    // Looked up again: the batch's requests borrowed every
                    // sampled session at once.
                    let refused = self
                        .sessions
                        .get_mut(&id)
                        .and_then(|slot| advance_constraint(slot, sampled.token).err());
                    if let Some(e) = refused {
                        let end = Err(RuntimeError::invalid(e.to_string()));
                        self.with_session(id, |w, slot| w.finish_generate(id, slot, end));
                        continue;
                    }
                    if let Some(slot) = self.sessions.get_mut(&id) {
                        slot.feed.push(sampled.token);
                        slot.feed_logits = LogitsWanted::Last;
                        if let Some(Active {
                            work: Work::Generate(gen),
                            ..
                        }) = slot.active.as_mut()
                        {
                            gen.pending_logprobs = sampled.logprobs.take();
                        }
                    }
                    self.propose(id);
                }
                Err(e) => {
                    let end = Err(e.clone().into());
                    self.with_session(id, |w, slot| w.finish_generate(id, slot, end));
                }
            }
        }
        self.sampled = sampled;
        self.propose_drafts();
    }

    /// Fills the mask of every planned session with a constraint; one whose
    /// text is complete, or can go no further, ends here instead of being
    /// sampled.
    fn constrain_planned(&mut self) {
        let mut ended = Vec::new();
        for id in &self.to_sample {
            let Some(slot) = self.sessions.get_mut(id) else {
                continue;
            };
            let SessionSlot {
                session, active, ..
            } = slot;
            let Some(Active {
                work: Work::Generate(gen),
                ..
            }) = active.as_mut()
            else {
                continue;
            };
            let Some(constraint) = gen.constraint.as_mut() else {
                continue;
            };
            match constraint.allowed(session.eos(), &mut gen.mask) {
                Ok(allowed) => ended.extend(allowed.end().map(|end| (*id, Ok(end)))),
                Err(e) => ended.push((*id, Err(RuntimeError::invalid(e.to_string())))),
            }
        }
        for (id, end) in ended {
            self.to_sample.retain(|&s| s != id);
            self.with_session(id, |w, slot| w.finish_generate(id, slot, end));
        }
    }

    /// Stops the session's call (deadline, cancel): undoes a prompt it had
    /// not finished feeding, then answers it.
    pub(super) fn abandon(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        end: Result<StopReason, RuntimeError>,
    ) {
        slot.last_used = Instant::now();
        let Some(mut active) = slot.active.take() else {
            return;
        };
        let undone = match active.undo.take() {
            Some(undo) => self.apply_undo(id, slot, undo),
            None => Ok(()),
        };
        match active.work {
            Work::Append { reply, .. } => {
                let err = end.err().unwrap_or(RuntimeError::DeadlineExceeded);
                let _ = reply.send(Err(err));
            }
            Work::Generate(gen) => self.end_generate(id, slot, gen, end),
            Work::Fork { reply, .. } => {
                let err = end.err().unwrap_or(RuntimeError::DeadlineExceeded);
                let _ = reply.send(Err(err));
            }
            Work::Restore => {}
        }
        if let Err(e) = undone {
            tracing::error!(session = %id, "undoing a stopped call: {e}");
            self.fail_slot(id, slot, e);
        }
    }

    /// Ends the session's Generate with a stop reason or an error.
    pub(super) fn finish_generate(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        end: Result<StopReason, RuntimeError>,
    ) {
        slot.last_used = Instant::now();
        let Some(active) = slot.active.take() else {
            return;
        };
        let Work::Generate(gen) = active.work else {
            slot.active = Some(active);
            return;
        };
        self.end_generate(id, slot, gen, end);
    }

    /// Sends a Generate's terminal event.
    pub(super) fn end_generate(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        gen: Box<Generating>,
        end: Result<StopReason, RuntimeError>,
    ) {
        if matches!(end, Ok(StopReason::Cancelled)) {
            self.runner.cancel(id);
        }
        let mut end = end;
        // The journal records the logits' digest (what else reads them
        // between calls brings them home itself).
        if !slot.removed && slot.session.is_durable() {
            if let Err(e) = slot.session.bring_logits_home(id, &*self.runner) {
                tracing::error!(session = %id, "reading kept logits back: {e}");
                self.fail_slot(id, slot, e.clone());
                end = Err(e);
            }
        }
        // What the call added is journaled before its end is told; if the
        // journal does not take it, the call is taken back and fails.
        if !slot.removed {
            let history = slot.session.history();
            let record = if gen.rewritten {
                Some(Record::Reset(history.to_vec()))
            } else {
                history
                    .get(gen.history_start..)
                    .filter(|added| !added.is_empty())
                    .map(|added| Record::Append(added.to_vec()))
            };
            let counters = &self.shared.counters;
            let journaled = match record {
                Some(record) => {
                    let history = slot.session.history();
                    keep_in_store(self.replica.as_mut(), id, &record, history, counters)
                        .and_then(|()| slot.session.journal(record, counters))
                }
                None => Ok(()),
            };
            match journaled {
                Ok(()) => slot.session.journal_pages(&self.shared.counters),
                Err(e) => {
                    if let Err(undo) = self.take_back_generate(id, slot, &gen) {
                        tracing::error!(session = %id, "taking back a call not journaled: {undo}");
                        self.fail_slot(id, slot, undo);
                    }
                    end = Err(e);
                }
            }
        }
        // A session being restored (an undone call) holds its old history.
        let history_length = if slot.removed {
            0
        } else {
            slot.committed_len() as u64
        };
        let event = match end {
            Ok(stop_reason) => GenerateEvent::Done(GenerateDone {
                stop_reason,
                generated_token_count: gen.generated.len() as u32,
                prefill_duration: gen.prefill_duration,
                prefill_token_count: gen.prefill_tokens,
                total_duration: gen.started.elapsed(),
                seed_used: gen.seed_used,
                history_length,
                speculation: gen.speculation,
            }),
            Err(e) => GenerateEvent::Error(e),
        };
        if !slot.removed {
            announce_idle(slot, &self.shared, self.index);
        }
        // Room for it was checked before the last token; a gone reader is fine.
        let _ = gen.events.try_send(event);
    }

    /// Takes back every token of a Generate whose end the journal did not
    /// take: the session holds its history from before the call again (the
    /// journal's), and its last position (or, after a window shift, its
    /// whole history) is fed again before its next call, to the same bits.
    fn take_back_generate(
        &mut self,
        id: SessionId,
        slot: &mut SessionSlot,
        gen: &Generating,
    ) -> Result<(), RuntimeError> {
        let (undo, refeed) = slot
            .session
            .take_back_undo(gen.history_start, gen.before_rewrite.clone());
        self.apply_undo(id, slot, undo)?;
        if let Some(last) = refeed {
            slot.active = Some(Active::restore(vec![last]));
        }
        Ok(())
    }

    /// Bookkeeping after the session's feed went through the model: a
    /// prompt chunk counted (and the call answered once all of it is in),
    /// or a generated token emitted and the stop conditions checked.
    pub(super) fn after_feed(&mut self, id: SessionId, slot: &mut SessionSlot) {
        let n_fed = slot.feed.len();
        let last = slot.feed.last().copied();
        slot.feed.clear();
        if slot
            .active
            .as_ref()
            .is_some_and(|a| a.fed < a.pending.len())
        {
            let store = self.replica.as_mut();
            if let Err(e) = prompt_fed(id, slot, n_fed, store, &self.shared, self.index) {
                // Not journaled: the call is undone as if it had failed.
                self.abandon(id, slot, Err(e));
            }
            return;
        }
        let Some(token) = last else {
            return;
        };
        if let Some(end) = token_fed(slot, token, &self.shared, &self.gauges) {
            self.finish_generate(id, slot, Ok(end));
        }
    }
}

/// Writes a change of the session's history to the replicas' store, when
/// the worker has one.
fn keep_in_store(
    store: Option<&mut ReplicaSeat>,
    id: SessionId,
    record: &Record,
    history: &[u32],
    counters: &Counters,
) -> Result<(), RuntimeError> {
    store.map_or(Ok(()), |seat| seat.keep(id, record, history, counters))
}

/// `n_fed` more prompt tokens of the session's call are in. Once all are,
/// an append's change is journaled, and from then on the call can no longer
/// be undone: an append or a fork is answered, a Generate reports a
/// truncation it made and starts decoding. An error: the journal did not
/// take the change, and the caller undoes the call (its undo is still
/// there).
fn prompt_fed(
    id: SessionId,
    slot: &mut SessionSlot,
    n_fed: usize,
    store: Option<&mut ReplicaSeat>,
    shared: &WorkersState,
    worker: usize,
) -> Result<(), RuntimeError> {
    let counters = &shared.counters;
    let history_length = slot.session.history().len() as u64;
    let Some(active) = slot.active.as_mut() else {
        return Ok(());
    };
    // What an append changed, for the journal: tokens after the length it
    // started from, or a whole new history after a truncation.
    let record = match (&active.work, &active.undo) {
        (
            Work::Append { .. },
            Some(Undo {
                kind: UndoKind::Shorten(len),
                ..
            }),
        ) => Some(Record::Append(slot.session.history()[*len..].to_vec())),
        (Work::Append { .. }, Some(_)) => Some(Record::Reset(slot.session.history().to_vec())),
        _ => None,
    };
    active.fed += n_fed;
    counters
        .prefill_tokens
        .fetch_add(n_fed as u64, Ordering::Relaxed);
    if active.fed < active.pending.len() {
        return Ok(());
    }
    if let Some(record) = record {
        keep_in_store(store, id, &record, slot.session.history(), counters)?;
        slot.session.journal(record, counters)?;
    }
    let Some(active) = slot.active.as_mut() else {
        return Ok(());
    };
    active.pending = Vec::new();
    active.fed = 0;
    // All in: from here on the call's effect stands.
    active.undo = None;
    let took = active.prefill_started.elapsed();
    counters.prefill_duration.observe(took);
    match &mut active.work {
        Work::Append { .. } | Work::Restore | Work::Fork { .. } => {
            slot.last_used = Instant::now();
            slot.session.journal_pages(counters);
            let work = slot.active.take().map(|active| active.work);
            announce_idle(slot, shared, worker);
            match work {
                Some(Work::Append {
                    reply,
                    dropped,
                    reused,
                    ..
                }) => {
                    let _ = reply.send(Ok(AppendReply {
                        history_length,
                        dropped_token_count: dropped,
                        reused_token_count: reused,
                    }));
                }
                Some(Work::Fork { fork, reply }) => {
                    let _ = reply.send(Ok(ForkReply {
                        id: fork,
                        history_length,
                    }));
                }
                _ => {}
            }
        }
        Work::Generate(gen) => {
            gen.prefill_duration += took;
            if let Some(dropped) = gen.shift_dropped.take() {
                // Room for it was checked when the shift began.
                let _ = gen.events.try_send(GenerateEvent::Truncated {
                    dropped_token_count: dropped,
                });
            }
        }
    }
    Ok(())
}

/// Adds a session that just became idle to what this worker publishes (its
/// idle pages, and its oldest idle session on the eviction board) before
/// its caller hears back: a next call that needs it evicted, from another
/// worker right after the reply, must not find it missing until this
/// worker's loop publishes again (on two cores it may not run for a
/// while).
fn announce_idle(slot: &SessionSlot, shared: &WorkersState, worker: usize) {
    if !slot.idle() || slot.session.is_spilled() {
        return;
    }
    if let Some(pages) = shared.idle_pages.get(worker) {
        pages.fetch_add(slot.session.kv().pages_held(), Ordering::Relaxed);
    }
    let stamp = slot
        .last_used
        .saturating_duration_since(shared.epoch)
        .as_nanos() as u64;
    // Only this worker publishes its own stamp.
    if shared
        .board
        .oldest_idle(worker)
        .is_none_or(|oldest| stamp < oldest)
    {
        shared.board.publish(worker, Some(stamp));
    }
}

/// Moves the session's constraint past its sampled `token`.
pub(super) fn advance_constraint(
    slot: &mut SessionSlot,
    token: u32,
) -> Result<(), crate::constraint::ConstraintError> {
    let SessionSlot {
        session, active, ..
    } = slot;
    match active.as_mut() {
        Some(Active {
            work: Work::Generate(gen),
            ..
        }) => gen
            .constraint
            .as_mut()
            .map_or(Ok(()), |c| c.accept(token, session.eos())),
        _ => Ok(()),
    }
}

/// A Generate's `token` went through the model: it is counted and sent
/// (with its log-probabilities), and the call's end returned when the
/// reader is gone or a stop condition holds.
pub(super) fn token_fed(
    slot: &mut SessionSlot,
    token: u32,
    shared: &WorkersState,
    gauges: &WorkerGauges,
) -> Option<StopReason> {
    let eos_hit = slot.session.eos().contains(&token);
    let Some(Active {
        work: Work::Generate(gen),
        ..
    }) = slot.active.as_mut()
    else {
        return None;
    };
    gen.generated.push(token);
    shared
        .counters
        .tokens_generated
        .fetch_add(1, Ordering::Relaxed);
    gauges.tokens_generated.fetch_add(1, Ordering::Relaxed);
    gauges
        .decode_rate
        .record(shared.epoch.elapsed().as_secs(), 1);
    let gone = |sent| matches!(sent, Err(TrySendError::Disconnected(_)));
    if gone(gen.events.try_send(GenerateEvent::Token(token))) {
        return Some(StopReason::Cancelled);
    }
    if let Some(logprobs) = gen.pending_logprobs.take() {
        if gone(gen.events.try_send(GenerateEvent::Logprobs(logprobs))) {
            return Some(StopReason::Cancelled);
        }
    }
    if let Some(end) = gen.constraint.as_ref().and_then(|c| c.end_after(eos_hit)) {
        return Some(end);
    }
    if eos_hit {
        Some(StopReason::Eos)
    } else if let Some(index) = gen
        .stop_sequences
        .iter()
        .position(|s| gen.generated.ends_with(s))
    {
        Some(StopReason::StopSequence {
            index: index as u32,
        })
    } else if gen.generated.len() >= gen.max_tokens as usize {
        Some(
            gen.constraint
                .as_mut()
                .map_or(StopReason::MaxTokens, |c| c.end_at_limit()),
        )
    } else {
        None
    }
}
