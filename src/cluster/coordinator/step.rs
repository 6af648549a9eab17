//! One batched step through the shards: the fed tokens embedded here, their
//! hidden states sent through every shard in frames, the logits computed here.

use std::ops::Range;
use std::time::SystemTime;

use super::{ChainError, FailureKind, Held, ShardChain, ShardFailure, STEP_DEADLINE};
use crate::cluster::frame::{unix_nanos, Run};
use crate::durable::extend_page_chain;
use crate::model::{LogitRows, Model, Scratch};
use crate::runtime::StepFeed;
use crate::threads::ThreadPool;

impl ShardChain {
    /// One batched step: like [`Model::forward`], with the layers run by
    /// the shards. On success every ledger is committed and the logits are
    /// in `scratch.logits`; on failure no ledger moved and every feed's
    /// session is marked for a rebuild.
    pub fn forward(
        &mut self,
        model: &Model,
        feeds: &mut [StepFeed<'_>],
        pool: &ThreadPool,
        scratch: &mut Scratch,
        prefill_chunk: usize,
    ) -> Result<LogitRows, ChainError> {
        let connected: Vec<bool> = self.slots.iter().map(|s| s.link.is_some()).collect();
        let mut result = self.try_forward(model, feeds, pool, scratch, prefill_chunk);
        // A stream that died while idle (its shard restarted, say) is only
        // found out by using it: connect again and run the step once more,
        // rebuilding its sessions, rather than fail a call a live shard
        // could answer.
        if let Err(ChainError::Shard(failure)) = &result {
            let went_stale = failure.kind == FailureKind::Transport
                && self
                    .slots
                    .iter()
                    .zip(&connected)
                    .any(|(slot, &was)| was && slot.link.is_none());
            if went_stale {
                for f in feeds.iter() {
                    self.held.insert(f.session.bytes(), Held::Doubtful);
                }
                result = self.try_forward(model, feeds, pool, scratch, prefill_chunk);
            }
        }
        let held = match &result {
            Ok(_) => Held::InStep(self.lineage),
            Err(_) => Held::Doubtful,
        };
        for f in feeds.iter() {
            self.held.insert(f.session.bytes(), held);
        }
        result
    }

    fn try_forward(
        &mut self,
        model: &Model,
        feeds: &mut [StepFeed<'_>],
        pool: &ThreadPool,
        scratch: &mut Scratch,
        prefill_chunk: usize,
    ) -> Result<LogitRows, ChainError> {
        for f in feeds.iter_mut() {
            f.kv.reserve(f.kv.len() + f.tokens.len())?;
        }
        self.connect_all()?;
        let deadline = unix_nanos(SystemTime::now() + STEP_DEADLINE);
        for f in feeds.iter() {
            let len = f.kv.len();
            match (self.held.get(&f.session.bytes()).copied(), len) {
                (None, 0) => {}
                (Some(Held::InStep(l)), n) if l == self.lineage && n > 0 => {}
                // The ledger restarted (a truncation): so do the shards.
                (Some(_), 0) => self.release(&[f.session.bytes()]),
                (_, n) => self.rebuild(
                    model,
                    f.session.bytes(),
                    &f.history[..n],
                    prefill_chunk,
                    deadline,
                )?,
            }
        }
        if self.keeping_pages().any(|k| k) {
            let page = self.page_positions();
            for f in feeds.iter() {
                let n = f.kv.len();
                let chain = self.chains.entry(f.session.bytes()).or_default();
                // Blocks past the committed length may be from a step that
                // failed: hashed again from the history and the new tokens.
                chain.truncate(n / page);
                let from = chain.len() * page;
                let mut rest = f.history[from..n].to_vec();
                rest.extend_from_slice(f.tokens);
                extend_page_chain(chain, &rest, page);
            }
        }
        let h = model.config.hidden;
        let total: usize = feeds.iter().map(|f| f.tokens.len()).sum();
        let mut hidden = std::mem::take(&mut self.hidden);
        hidden.clear();
        hidden.resize(total * h, 0.0);
        let mut offsets = Vec::with_capacity(feeds.len());
        let mut at = 0;
        for f in feeds.iter() {
            offsets.push(at);
            if let Err(e) = model.embed(f.tokens, &mut hidden[at * h..(at + f.tokens.len()) * h]) {
                self.hidden = hidden;
                return Err(e.into());
            }
            at += f.tokens.len();
        }
        let result = self.run_groups(feeds, &offsets, deadline, h, &mut hidden);
        if let Err(e) = result {
            self.hidden = hidden;
            return Err(e.into());
        }
        // Final norm and logits for the rows each feed wants.
        let mut wanted = std::mem::take(&mut self.rows);
        wanted.clear();
        let mut per_sequence = Vec::with_capacity(feeds.len());
        let mut n_rows = 0;
        for (f, &offset) in feeds.iter().zip(&offsets) {
            let rows = f.logits.rows(f.tokens.len());
            wanted.extend_from_slice(&hidden[(offset + rows.start) * h..(offset + rows.end) * h]);
            per_sequence.push(n_rows..n_rows + rows.len());
            n_rows += rows.len();
        }
        let mut logits = std::mem::take(&mut scratch.logits);
        model.logits_from_hidden(pool, &wanted, &mut logits, scratch);
        scratch.logits = logits;
        self.rows = wanted;
        self.hidden = hidden;
        for f in feeds.iter_mut() {
            f.kv.commit(f.kv.len() + f.tokens.len())?;
        }
        Ok(LogitRows { per_sequence })
    }

    /// Sends the step's hidden states through the shards: every
    /// single-token feed in one decode frame, each longer feed in a
    /// prefill frame of its own.
    fn run_groups(
        &mut self,
        feeds: &[StepFeed<'_>],
        offsets: &[usize],
        deadline: u64,
        h: usize,
        hidden: &mut [f32],
    ) -> Result<(), ShardFailure> {
        let decoding: Vec<usize> = (0..feeds.len())
            .filter(|&i| feeds[i].tokens.len() == 1)
            .collect();
        if !decoding.is_empty() {
            let runs: Vec<Run> = decoding
                .iter()
                .map(|&i| Run {
                    session: feeds[i].session.bytes(),
                    position: feeds[i].kv.len() as u64,
                    rows: 1,
                })
                .collect();
            let mut rows = std::mem::take(&mut self.rows);
            rows.clear();
            for &i in &decoding {
                rows.extend_from_slice(&hidden[offsets[i] * h..(offsets[i] + 1) * h]);
            }
            let result = self.through_shards(&runs, deadline, &mut rows);
            if result.is_ok() {
                for (&i, row) in decoding.iter().zip(rows.chunks_exact(h)) {
                    hidden[offsets[i] * h..(offsets[i] + 1) * h].copy_from_slice(row);
                }
            }
            self.rows = rows;
            result?;
        }
        for (f, &offset) in feeds.iter().zip(offsets) {
            if f.tokens.len() < 2 {
                continue;
            }
            let run = [Run {
                session: f.session.bytes(),
                position: f.kv.len() as u64,
                rows: f.tokens.len() as u32,
            }];
            self.through_shards(
                &run,
                deadline,
                &mut hidden[offset * h..(offset + f.tokens.len()) * h],
            )?;
        }
        Ok(())
    }

    /// Runs `rows` hidden states (`runs` in order) through every shard, in
    /// frames of at most the rows every connected shard accepts.
    pub(super) fn through_shards(
        &mut self,
        runs: &[Run],
        deadline: u64,
        hidden: &mut [f32],
    ) -> Result<(), ShardFailure> {
        let max_rows = self
            .slots
            .iter()
            .filter_map(|s| s.link.as_ref())
            .map(|l| match l.capacity().max_frame_rows {
                0 => usize::MAX,
                n => n as usize,
            })
            .min()
            .unwrap_or(usize::MAX);
        let h = hidden.len() / runs.iter().map(|r| r.rows as usize).sum::<usize>().max(1);
        let page = self.page_positions();
        let chained = self.keeping_pages().any(|k| k);
        for (piece, rows) in frame_pieces(runs, max_rows) {
            let hidden = &mut hidden[rows.start * h..rows.end * h];
            let chains: Vec<Vec<u64>> = if chained {
                piece
                    .iter()
                    .map(|run| self.page_chains(run, page))
                    .collect()
            } else {
                Vec::new()
            };
            for index in 0..self.slots.len() {
                let Some(link) = self.slots[index].link.as_mut() else {
                    return Err(self.link_down(index));
                };
                if let Err(e) = link.forward_chained(&piece, &chains, hidden, deadline) {
                    return Err(self.failure(index, &e));
                }
            }
        }
        Ok(())
    }

    /// The chains of the pages `run` fills, from the session's chain.
    fn page_chains(&self, run: &Run, page: usize) -> Vec<u64> {
        let start = run.position as usize;
        let blocks = start / page..(start + run.rows as usize) / page;
        self.chains
            .get(&run.session)
            .and_then(|chain| chain.get(blocks))
            .map(<[u64]>::to_vec)
            .unwrap_or_default()
    }
}

/// The runs of one frame, and the rows of the step's hidden states they cover.
type FramePiece = (Vec<Run>, Range<usize>);

/// Splits `runs` (rows in order) into frames of at most `max_rows` rows:
/// a long run into consecutive pieces, a decode batch into smaller
/// batches. Each piece comes with the rows it covers.
fn frame_pieces(runs: &[Run], max_rows: usize) -> Vec<FramePiece> {
    let max_rows = max_rows.clamp(1, u32::MAX as usize);
    let mut pieces = Vec::new();
    let mut current: Vec<Run> = Vec::new();
    let (mut start, mut at) = (0usize, 0usize);
    for run in runs {
        let mut done = 0usize;
        while done < run.rows as usize {
            let filled = at - start;
            if filled == max_rows {
                pieces.push((std::mem::take(&mut current), start..at));
                start = at;
            }
            let n = (run.rows as usize - done).min(max_rows - (at - start));
            current.push(Run {
                session: run.session,
                position: run.position + done as u64,
                rows: n as u32,
            });
            done += n;
            at += n;
        }
    }
    if !current.is_empty() {
        pieces.push((current, start..at));
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_keep_to_the_agreed_rows() {
        let (a, b, c) = ([1u8; 16], [2u8; 16], [3u8; 16]);
        let run = |session, position, rows| Run {
            session,
            position,
            rows,
        };
        // A long prefill run becomes consecutive pieces.
        let pieces = frame_pieces(&[run(a, 10, 5)], 2);
        assert_eq!(
            pieces,
            vec![
                (vec![run(a, 10, 2)], 0..2),
                (vec![run(a, 12, 2)], 2..4),
                (vec![run(a, 14, 1)], 4..5)
            ]
        );
        // A decode batch becomes smaller batches.
        let pieces = frame_pieces(&[run(a, 3, 1), run(b, 7, 1), run(c, 0, 1)], 2);
        assert_eq!(
            pieces,
            vec![
                (vec![run(a, 3, 1), run(b, 7, 1)], 0..2),
                (vec![run(c, 0, 1)], 2..3)
            ]
        );
        // Within the bound nothing changes.
        assert_eq!(
            frame_pieces(&[run(a, 0, 64)], usize::MAX),
            vec![(vec![run(a, 0, 64)], 0..64)]
        );
    }
}
