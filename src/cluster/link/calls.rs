//! The calls a coordinator makes through a link: hidden states through the
//! shard's layers, a Resume of a kept session, and releases and cancels.

use std::time::{Duration, Instant, SystemTime};

use super::{LinkError, ShardLink, ANSWER_GRACE};
use crate::cluster::frame::{
    hidden_body, unix_nanos, ErrorKind, FrameError, FrameKind, Run, WireSessionId,
};
use crate::cluster::payload::{decode_rows, encode_rows};
use crate::proto::inferd_shard_v1::shard_runtime as pb;

impl ShardLink {
    /// Runs `hidden` (the rows of `runs`, in order) through the shard's
    /// layers, replacing it with the result. One run is a prefill fragment;
    /// several (one row each) are a decode batch.
    pub fn forward(
        &mut self,
        runs: &[Run],
        hidden: &mut [f32],
        deadline_unix_nanos: u64,
    ) -> Result<(), LinkError> {
        self.forward_chained(runs, &[], hidden, deadline_unix_nanos)
    }

    /// [`ShardLink::forward`], with each run's page chains (one per page
    /// it fills; `page_chains[i]` for `runs[i]`, none when shorter), sent
    /// only to a shard that keeps pages.
    pub fn forward_chained(
        &mut self,
        runs: &[Run],
        page_chains: &[Vec<u64>],
        hidden: &mut [f32],
        deadline_unix_nanos: u64,
    ) -> Result<(), LinkError> {
        // Answers are awaited until the frame's deadline (plus a grace);
        // 0 means none.
        let answer_by = (deadline_unix_nanos != 0).then(|| {
            let left = deadline_unix_nanos.saturating_sub(unix_nanos(SystemTime::now()));
            Instant::now() + Duration::from_nanos(left) + ANSWER_GRACE
        });
        while self.credits == 0 {
            let checked = self.next_frame_until(answer_by)?;
            let upcoming = self.outbound.next_sequence();
            if checked.kind == FrameKind::Error && !self.answers_earlier(&checked, upcoming) {
                return Err(self.refused(checked.frame.get_error()));
            }
        }
        let mut body = hidden_body(runs);
        if self.capacity.keeps_pages {
            for (rows, chains) in body.mut_runs().iter_mut().zip(page_chains) {
                rows.set_page_chains(chains.clone());
            }
        }
        let mut frame = pb::Frame::new();
        frame.set_payload(
            encode_rows(self.encoding, self.hidden_size, hidden)
                .map_err(|e| self.transport(format!("encoding hidden states: {e}")))?,
        );
        if runs.len() == 1 {
            frame.set_prefill(body);
        } else {
            frame.set_decode(body);
        }
        let sequence = self.send(frame, Some(self.encoding), deadline_unix_nanos)?;
        self.credits -= 1;
        loop {
            let checked = self.next_frame_until(answer_by)?;
            match checked.kind {
                FrameKind::Credit => continue,
                FrameKind::Error if self.answers_earlier(&checked, sequence) => continue,
                FrameKind::Error => {
                    // A refused frame's credit comes back with the refusal:
                    // the shard grants no credit frame for it (see
                    // `Answered` in shard/answer.rs), so none is lost to refusals.
                    self.credits += 1;
                    return Err(self.refused(checked.frame.get_error()));
                }
                FrameKind::Output => {
                    let output = checked.frame.get_output();
                    let answers = output.get_answers_sequence();
                    if answers < sequence {
                        // The rest of a frame whose call already ended on
                        // the shard's error frame.
                        continue;
                    }
                    let same_rows = output.get_runs().len() == runs.len()
                        && output.get_runs().iter().zip(runs).all(|(got, sent)| {
                            got.get_session_id() == sent.session
                                && got.get_position() == sent.position
                                && got.get_count() == sent.rows
                        });
                    if answers > sequence || !same_rows {
                        return Err(LinkError::BadReply {
                            addr: self.addr.clone(),
                            error: FrameError {
                                kind: if answers > sequence {
                                    ErrorKind::Sequence
                                } else {
                                    ErrorKind::Malformed
                                },
                                message: format!(
                                    "an output for frame {answers} with {} runs, while frame \
                                     {sequence} with {} runs awaits its answer",
                                    output.get_runs().len(),
                                    runs.len()
                                ),
                                sessions: runs.iter().map(|r| r.session).collect(),
                                sequence: Some(checked.sequence),
                            },
                        });
                    }
                    let answered: usize = runs.iter().map(|r| r.rows as usize).sum();
                    let encoding = checked.encoding.unwrap_or(self.encoding);
                    let values = decode_rows(
                        encoding,
                        self.hidden_size,
                        answered,
                        checked.frame.get_payload(),
                    )
                    .map_err(|e| self.transport(e.to_string()))?;
                    hidden.copy_from_slice(&values);
                    return Ok(());
                }
                _ => continue,
            }
        }
    }

    /// Asks a shard that keeps pages to keep what it holds of `session`
    /// that matches a history of `length` positions whose full pages have
    /// these chains, and returns the positions it kept (a multiple of the
    /// page size, at most `length`).
    pub fn resume(
        &mut self,
        session: WireSessionId,
        length: u64,
        page_chains: &[u64],
        deadline_unix_nanos: u64,
    ) -> Result<u64, LinkError> {
        let answer_by = (deadline_unix_nanos != 0).then(|| {
            let left = deadline_unix_nanos.saturating_sub(unix_nanos(SystemTime::now()));
            Instant::now() + Duration::from_nanos(left) + ANSWER_GRACE
        });
        let mut body = pb::Resume::new();
        body.set_session_id(session.to_vec());
        body.set_length(length);
        body.set_page_chains(page_chains.to_vec());
        body.set_encoding(self.encoding.to_wire());
        let mut frame = pb::Frame::new();
        frame.set_resume(body);
        let sequence = self.send(frame, None, deadline_unix_nanos)?;
        loop {
            let checked = self.next_frame_until(answer_by)?;
            match checked.kind {
                FrameKind::Error if self.answers_earlier(&checked, sequence) => continue,
                FrameKind::Error => return Err(self.refused(checked.frame.get_error())),
                FrameKind::Resumed => {
                    let resumed = checked.frame.get_resumed();
                    let page = u64::from(self.capacity.page_positions.max(1));
                    let kept = resumed.get_kept();
                    let fits = resumed.get_answers_sequence() == sequence
                        && resumed.get_session_id() == session
                        && kept <= length
                        && kept % page == 0;
                    if !fits {
                        return Err(LinkError::BadReply {
                            addr: self.addr.clone(),
                            error: FrameError {
                                kind: ErrorKind::Malformed,
                                message: format!(
                                    "a Resumed keeping {kept} positions for frame {}, while \
                                     frame {sequence} resumes {length} positions in pages of {page}",
                                    resumed.get_answers_sequence()
                                ),
                                sessions: vec![session],
                                sequence: Some(checked.sequence),
                            },
                        });
                    }
                    return Ok(kept);
                }
                _ => continue,
            }
        }
    }

    /// Frees the sessions' KV on the shard.
    pub fn release(&mut self, sessions: &[WireSessionId]) -> Result<(), LinkError> {
        let mut body = pb::Release::new();
        body.set_session_ids(sessions.iter().map(|s| s.to_vec()).collect());
        let mut frame = pb::Frame::new();
        frame.set_release(body);
        self.send(frame, None, 0).map(|_| ())
    }

    /// Tells the shard the sessions' generations ended (nothing of theirs
    /// is queued there: frames are answered in order).
    pub fn cancel(&mut self, sessions: &[WireSessionId]) -> Result<(), LinkError> {
        let mut body = pb::Cancel::new();
        body.set_session_ids(sessions.iter().map(|s| s.to_vec()).collect());
        let mut frame = pb::Frame::new();
        frame.set_cancel(body);
        self.send(frame, None, 0).map(|_| ())
    }
}
