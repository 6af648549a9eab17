//! Running the shard's layers over a hidden-state frame: each run admitted
//! against its session, the rows computed in steps, the KV committed.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Core, PREFILL_STEP_ROWS};
use crate::cluster::frame::{ErrorKind, Run, WireSessionId};
use crate::cluster::keeper::SessionKey;
use crate::cluster::payload::Encoding;
use crate::gpu::GpuLayerFeed;
use crate::kv::{KvError, SessionKv};
use crate::model::LayerFeed;

/// Why a computation stops before its next step, if it must.
pub(super) type Interrupt<'a> = &'a mut dyn FnMut() -> Option<(ErrorKind, String)>;

/// The page chains a frame's runs carry (by session) and the encoding of
/// its hidden states: what a keeper records of the pages the runs fill.
pub(super) struct Chained<'a> {
    pub(super) chains: &'a HashMap<WireSessionId, &'a [u64]>,
    pub(super) encoding: Encoding,
}

/// What one hidden-state frame produced: the rows computed and the sessions
/// that failed, by kind.
pub(super) struct Computed {
    pub(super) runs: Vec<Run>,
    pub(super) values: Vec<f32>,
    pub(super) failed: Vec<Refused>,
}

impl Core {
    /// Runs the shard's layers over every run whose session continues at
    /// its position (a new session starts at position 0). A prefill
    /// fragment (one run) is computed in steps of [`PREFILL_STEP_ROWS`] rows,
    /// each committed to the KV; `interrupt` is asked before every step, and
    /// when it stops the frame, the frame's sessions are released here, so
    /// no half-computed fragment stays behind.
    pub(super) fn compute(
        &mut self,
        coordinator: u64,
        runs: &[Run],
        chained: &Chained<'_>,
        values: Vec<f32>,
        hidden_size: usize,
        interrupt: Interrupt<'_>,
    ) -> Computed {
        let (accepted, mut x, mut failed) = self.admit(coordinator, runs, &values, hidden_size);
        if accepted.is_empty() {
            return Computed {
                runs: accepted,
                values: Vec::new(),
                failed,
            };
        }
        let mut kvs: Vec<(SessionKey, SessionKv)> = accepted
            .iter()
            .filter_map(|run| self.sessions.remove_entry(&(coordinator, run.session)))
            .collect();
        let total_rows = x.len() / hidden_size.max(1);
        let stepped = self.forward_in_steps(&mut kvs, &accepted, &mut x, hidden_size, interrupt);
        match stepped {
            Ok(()) => {
                // A shard never rolls a session back (a stopped frame frees
                // it instead), so window pages can go as soon as a frame is in.
                for ((key, mut kv), run) in kvs.into_iter().zip(&accepted) {
                    if let Err(e) = kv.settle() {
                        tracing::error!("shard KV: giving back window pages: {e}");
                    }
                    if let Some(keeper) = self.keeper.as_mut() {
                        let chains = chained.chains.get(&run.session).copied().unwrap_or(&[]);
                        keeper.record(
                            key,
                            &kv,
                            run.position as usize,
                            run.rows as usize,
                            chains,
                            chained.encoding,
                        );
                    }
                    self.sessions.insert(key, kv);
                }
                Computed {
                    runs: accepted,
                    values: x,
                    failed,
                }
            }
            Err(Stopped { done, kind, why }) => {
                // Nothing of a stopped frame stays: its sessions' KV is
                // freed, and the coordinator rebuilds them from history.
                let ids: Vec<WireSessionId> = kvs.iter().map(|(k, _)| k.1).collect();
                for (key, mut kv) in kvs {
                    let _ = kv.release();
                    if let Some(keeper) = self.keeper.as_mut() {
                        keeper.forget(key);
                    }
                }
                failed.push((
                    kind,
                    format!(
                        "{why}: stopped after {done} of {total_rows} rows; the session's KV on \
                         this shard was released"
                    ),
                    ids,
                ));
                Computed {
                    runs: Vec::new(),
                    values: Vec::new(),
                    failed,
                }
            }
        }
    }

    /// Checks each run against what the shard holds of its session (a new
    /// session starts at position 0, within the session limit) and
    /// reserves its positions. Returns the accepted runs, their rows in
    /// order, and the refused sessions by kind.
    fn admit(
        &mut self,
        coordinator: u64,
        runs: &[Run],
        values: &[f32],
        hidden_size: usize,
    ) -> (Vec<Run>, Vec<f32>, Vec<Refused>) {
        let mut failed = Vec::new();
        let mut accepted = Vec::new();
        let mut x = Vec::with_capacity(values.len());
        let mut offset = 0usize;
        for &run in runs {
            let rows = &values[offset * hidden_size..(offset + run.rows as usize) * hidden_size];
            offset += run.rows as usize;
            match self.admit_run(coordinator, run) {
                Ok(()) => {
                    accepted.push(run);
                    x.extend_from_slice(rows);
                }
                Err((kind, why)) => failed.push((kind, why, vec![run.session])),
            }
        }
        (accepted, x, failed)
    }

    /// One run of [`Core::admit`].
    fn admit_run(&mut self, coordinator: u64, run: Run) -> Result<(), (ErrorKind, String)> {
        let Run {
            session: id,
            position,
            rows,
        } = run;
        let key = (coordinator, id);
        let held = self.sessions.get(&key).map(SessionKv::len);
        match held {
            Some(len) if len as u64 != position => {
                return Err((
                    ErrorKind::UnknownSession,
                    format!("session holds {len} positions, frame starts at {position}"),
                ))
            }
            None if position != 0 => {
                return Err((
                    ErrorKind::UnknownSession,
                    format!("no such session here (frame starts at {position})"),
                ))
            }
            None if self.sessions.len() >= self.max_sessions => {
                return Err((
                    ErrorKind::Internal,
                    format!(
                        "the shard holds its limit of {} sessions",
                        self.max_sessions
                    ),
                ))
            }
            _ => {}
        }
        let kv_pool = &self.kv_pool;
        let kv = self
            .sessions
            .entry(key)
            .or_insert_with(|| SessionKv::new(Arc::clone(kv_pool)));
        loop {
            match kv.reserve(position as usize + rows as usize) {
                Ok(()) => return Ok(()),
                // Detached sessions give their pages back before a held one
                // goes without.
                Err(KvError::Exhausted { .. })
                    if self
                        .keeper
                        .as_mut()
                        .is_some_and(|k| k.free_oldest_detached()) => {}
                Err(e) => return Err((ErrorKind::Internal, format!("KV: {e}"))),
            }
        }
    }

    /// Runs the layers over `x` (the accepted runs' rows, in order): a
    /// prefill fragment (one run) in steps of [`PREFILL_STEP_ROWS`] rows,
    /// a decode batch (one row per session) in one, committing each step
    /// to the KV. `interrupt` is asked before every step.
    fn forward_in_steps(
        &mut self,
        kvs: &mut [(SessionKey, SessionKv)],
        accepted: &[Run],
        x: &mut [f32],
        hidden_size: usize,
        interrupt: Interrupt<'_>,
    ) -> Result<(), Stopped> {
        let total_rows = x.len() / hidden_size.max(1);
        let one_fragment = accepted.len() == 1;
        let step_rows = if one_fragment {
            PREFILL_STEP_ROWS.max(1)
        } else {
            total_rows.max(1)
        };
        let mut done = 0usize;
        let stop = |done: usize, kind: ErrorKind, why: String| Stopped { done, kind, why };
        while done < total_rows {
            if let Some((kind, why)) = interrupt() {
                return Err(stop(done, kind, why));
            }
            let n = step_rows.min(total_rows - done);
            // Rows each sequence feeds in this step, and where it then ends.
            let fed = |run: &Run| if one_fragment { n } else { run.rows as usize };
            let end = |run: &Run| {
                if one_fragment {
                    done + n
                } else {
                    run.rows as usize
                }
            };
            let rows = &mut x[done * hidden_size..(done + n) * hidden_size];
            let result = match &mut self.gpu {
                Some(gpu) => {
                    let mut feeds: Vec<GpuLayerFeed<'_>> = kvs
                        .iter_mut()
                        .zip(accepted)
                        .map(|((_, kv), run)| GpuLayerFeed { kv, rows: fed(run) })
                        .collect();
                    gpu.forward_layers(&mut feeds, rows)
                        .map_err(|e| e.to_string())
                }
                None => {
                    let mut feeds: Vec<LayerFeed<'_>> = kvs
                        .iter_mut()
                        .zip(accepted)
                        .map(|((_, kv), run)| LayerFeed { kv, rows: fed(run) })
                        .collect();
                    self.model
                        .forward_layers(
                            self.layers.clone(),
                            &mut feeds,
                            rows,
                            &self.pool,
                            &mut self.scratch,
                        )
                        .map_err(|e| e.to_string())
                }
            };
            if let Err(e) = result {
                return Err(stop(done, ErrorKind::Internal, format!("forward: {e}")));
            }
            for ((_, kv), run) in kvs.iter_mut().zip(accepted) {
                if let Err(e) = kv.commit(run.position as usize + end(run)) {
                    return Err(stop(done, ErrorKind::Internal, format!("KV: {e}")));
                }
            }
            done += n;
        }
        Ok(())
    }
}

/// Sessions a frame could not take, with why.
pub(super) type Refused = (ErrorKind, String, Vec<WireSessionId>);

/// Why and where [`Core::forward_in_steps`] stopped.
struct Stopped {
    /// Rows computed and committed before the stop.
    done: usize,
    kind: ErrorKind,
    why: String,
}
