//! Bringing a session's KV on the shards back in step with its history:
//! a restored session resumed from what shards kept, a doubtful one rebuilt.

use std::sync::atomic::Ordering;
use std::time::SystemTime;

use super::{ChainError, FailureKind, Held, ShardChain, ShardFailure, STEP_DEADLINE};
use crate::cluster::frame::{unix_nanos, ErrorKind, Run, WireSessionId};
use crate::durable::page_chain;
use crate::model::Model;

impl ShardChain {
    /// For a session the coordinator restored from its journal: when every
    /// shard keeps pages, has each keep what matches `history` without its
    /// last token (which is fed again for its logits), and returns the
    /// positions every shard now holds; 0 when a shard keeps no pages or
    /// cannot be reached (the whole history is then fed as before).
    pub fn resume(&mut self, id: WireSessionId, history: &[u32]) -> usize {
        let Some(head) = history.len().checked_sub(1) else {
            return 0;
        };
        if self.connect_all().is_err() || !self.keeping_pages().all(|k| k) {
            return 0;
        }
        let deadline = unix_nanos(SystemTime::now() + STEP_DEADLINE);
        match self.resume_everywhere(id, &history[..head], deadline) {
            Ok(kept) => {
                self.held.insert(id, Held::InStep(self.lineage));
                self.plan
                    .stats
                    .resumed_positions
                    .fetch_add(kept as u64, Ordering::Relaxed);
                tracing::info!(
                    kept,
                    tokens = history.len(),
                    "restored session resumed on the shards"
                );
                kept
            }
            Err(failure) => {
                tracing::warn!(%failure, "resuming a restored session on the shards; feeding it whole");
                self.held.insert(id, Held::Doubtful);
                0
            }
        }
    }

    /// Asks every shard to keep what it holds of `id` that matches
    /// `history`, then each that kept more than the least to keep only
    /// that, and returns the least: the positions every shard now holds.
    fn resume_everywhere(
        &mut self,
        id: WireSessionId,
        history: &[u32],
        deadline: u64,
    ) -> Result<usize, ShardFailure> {
        let page = self.page_positions();
        let chain = page_chain(history, page, history.len() / page);
        let length = history.len() as u64;
        let mut kept = Vec::with_capacity(self.slots.len());
        for index in 0..self.slots.len() {
            let Some(link) = self.slots[index].link.as_mut() else {
                return Err(self.link_down(index));
            };
            match link.resume(id, length, &chain, deadline) {
                Ok(k) => kept.push(k),
                Err(e) => return Err(self.failure(index, &e)),
            }
        }
        let least = kept.iter().copied().min().unwrap_or(0);
        let blocks = least as usize / page;
        for (index, &k) in kept.iter().enumerate() {
            if k == least {
                continue;
            }
            let Some(link) = self.slots[index].link.as_mut() else {
                return Err(self.link_down(index));
            };
            match link.resume(id, least, &chain[..blocks], deadline) {
                Ok(again) if again == least => {}
                Ok(again) => {
                    return Err(ShardFailure {
                        shard: self.plan.shards[index].label(),
                        kind: FailureKind::Protocol(ErrorKind::Internal),
                        message: format!(
                        "asked to keep {least} of the {k} positions it had kept, it kept {again}"
                    ),
                    })
                }
                Err(e) => return Err(self.failure(index, &e)),
            }
        }
        self.chains.insert(id, chain);
        Ok(least as usize)
    }

    /// Brings a session's KV on every shard in step with its history: when
    /// every shard keeps pages, each keeps what matches the history
    /// (Resume) and only the positions after what all of them kept are fed
    /// again; otherwise it is released everywhere and fed again whole.
    pub(super) fn rebuild(
        &mut self,
        model: &Model,
        id: WireSessionId,
        history: &[u32],
        chunk: usize,
        deadline: u64,
    ) -> Result<(), ChainError> {
        let start = if self.keeping_pages().all(|k| k) {
            self.resume_everywhere(id, history, deadline)?
        } else {
            for index in 0..self.slots.len() {
                if let Some(Err(e)) = self.slots[index]
                    .link
                    .as_mut()
                    .map(|link| link.release(&[id]))
                {
                    return Err(self.failure(index, &e).into());
                }
            }
            if self.keeping_pages().any(|k| k) {
                let page = self.page_positions();
                let chain = page_chain(history, page, history.len() / page);
                self.chains.insert(id, chain);
            }
            0
        };
        let h = model.config.hidden;
        let mut rows = std::mem::take(&mut self.rows);
        let mut position = start as u64;
        for part in history[start..].chunks(chunk.max(1)) {
            rows.clear();
            rows.resize(part.len() * h, 0.0);
            model.embed(part, &mut rows)?;
            let result = self.through_shards(
                &[Run {
                    session: id,
                    position,
                    rows: part.len() as u32,
                }],
                deadline,
                &mut rows,
            );
            if let Err(e) = result {
                self.rows = rows;
                return Err(e.into());
            }
            position += part.len() as u64;
        }
        self.rows = rows;
        let stats = &self.plan.stats;
        stats.rebuilds.fetch_add(1, Ordering::Relaxed);
        stats
            .rebuilt_tokens
            .fetch_add((history.len() - start) as u64, Ordering::Relaxed);
        stats
            .resumed_positions
            .fetch_add(start as u64, Ordering::Relaxed);
        tracing::info!(
            fed = history.len() - start,
            kept = start,
            "session rebuilt on the shards"
        );
        Ok(())
    }
}
