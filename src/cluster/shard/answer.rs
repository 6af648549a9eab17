//! Acting on a checked frame: releases, cancels and resumes at once, and
//! hidden states through the layers, each answered on the stream.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use super::compute::Chained;
use super::stream::{error_frame, Replies, StreamState};
use super::{lock, ShardState};
use crate::cluster::frame::{
    hidden_body, unix_nanos, ErrorKind, FrameCheck, FrameError, FrameKind, Run, WireSessionId,
};
use crate::cluster::handshake::Agreed;
use crate::cluster::payload::{decode_rows, encode_rows, Encoding};
use crate::proto::inferd_shard_v1::shard_runtime as pb;

/// How a checked frame was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Answered {
    /// Acted on, or computed for every session it carried.
    Computed,
    /// Refused, in whole or for some of its sessions: an error frame says
    /// why (and stands for the frame's credit at the coordinator).
    Refused,
    /// The stream is gone.
    Gone,
}

impl Answered {
    fn from_sent(sent: bool, refused: bool) -> Answered {
        match (sent, refused) {
            (false, _) => Answered::Gone,
            (true, true) => Answered::Refused,
            (true, false) => Answered::Computed,
        }
    }
}

/// Acts on a checked frame.
pub(super) fn answer(
    shared: &ShardState,
    agreed: &Agreed,
    checked: FrameCheck,
    replies: &mut Replies,
    state: &StreamState,
) -> Answered {
    let coordinator = agreed.epochs.coordinator;
    let hidden_size = agreed.fingerprint.hidden_size as usize;
    match checked.kind {
        FrameKind::Release => {
            let mut core = lock(&shared.core);
            for id in &checked.sessions {
                if let Some(mut kv) = core.sessions.remove(&(coordinator, *id)) {
                    let _ = kv.release();
                }
                if let Some(keeper) = core.keeper.as_mut() {
                    keeper.forget((coordinator, *id));
                }
            }
            Answered::Computed
        }
        FrameKind::Resume => answer_resume(shared, coordinator, &checked, replies),
        FrameKind::Cancel => {
            // Frames are answered in order, so nothing of these sessions
            // sent before the cancel is still waiting: counting the cancel
            // is all there is to do.
            shared.cancelled.fetch_add(
                checked.sessions.len() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            Answered::Computed
        }
        FrameKind::Prefill | FrameKind::Decode => {
            answer_hidden(shared, coordinator, hidden_size, &checked, replies, state)
        }
        // Checked frames of the other kinds cannot travel to a shard.
        FrameKind::Output | FrameKind::Credit | FrameKind::Error | FrameKind::Resumed => {
            Answered::Computed
        }
    }
}

/// A hidden-state frame (prefill or decode): decoded, computed through the
/// shard's layers (stopping between steps when the shard stops, the
/// stream ends or the deadline passes), answered with the output rows and
/// an error frame per refused session.
fn answer_hidden(
    shared: &ShardState,
    coordinator: u64,
    hidden_size: usize,
    checked: &FrameCheck,
    replies: &mut Replies,
    state: &StreamState,
) -> Answered {
    let frame = &checked.frame;
    let body = if checked.kind == FrameKind::Prefill {
        frame.get_prefill()
    } else {
        frame.get_decode()
    };
    let Some(encoding) = checked.encoding else {
        return Answered::Computed;
    };
    // The frame may have waited in the queue: its deadline again.
    let deadline = frame.get_header().get_deadline_unix_nanos();
    if let Some(late) = past_deadline(deadline) {
        let message = format!("{late}, before the frame was computed");
        return refuse_frame(replies, checked, ErrorKind::Deadline, message);
    }
    let values = match decode_rows(encoding, hidden_size, checked.rows, frame.get_payload()) {
        Ok(v) => v,
        Err(e) => return refuse_frame(replies, checked, ErrorKind::Malformed, e.to_string()),
    };
    let runs: Vec<Run> = body
        .get_runs()
        .iter()
        .zip(&checked.sessions)
        .map(|(r, id)| Run {
            session: *id,
            position: r.get_position(),
            rows: r.get_count(),
        })
        .collect();
    // The page chains a coordinator sends along: exactly one per page a
    // run fills, or none.
    let page = u64::from(shared.page_positions.max(1));
    let mut chains: HashMap<WireSessionId, &[u64]> = HashMap::new();
    for (r, run) in body.get_runs().iter().zip(&runs) {
        let sent = r.get_page_chains();
        let filled = (run.position + u64::from(run.rows)) / page - run.position / page;
        if !sent.is_empty() && sent.len() as u64 != filled {
            let message = format!(
                "a run of positions {}..{} fills {filled} pages and names {} page chains",
                run.position,
                run.position + u64::from(run.rows),
                sent.len()
            );
            return refuse_frame(replies, checked, ErrorKind::Malformed, message);
        }
        chains.insert(run.session, sent);
    }
    let chained = Chained {
        chains: &chains,
        encoding,
    };
    // Checked before every step of the computation.
    let mut interrupt = || {
        if shared.stopping.load(Ordering::Acquire) {
            return Some((ErrorKind::Internal, "the shard is shutting down".to_owned()));
        }
        if state.lost.load(Ordering::Acquire) || replies.call_gone() {
            return Some((ErrorKind::Internal, "the stream ended".to_owned()));
        }
        past_deadline(deadline).map(|late| (ErrorKind::Deadline, late))
    };
    let outcome = lock(&shared.core).compute(
        coordinator,
        &runs,
        &chained,
        values,
        hidden_size,
        &mut interrupt,
    );
    let mut alive = true;
    let refused = !outcome.failed.is_empty();
    if refused {
        for (kind, message, sessions) in outcome.failed {
            let error = FrameError {
                kind,
                message,
                sessions,
                sequence: Some(checked.sequence),
            };
            alive &= replies.send(error_frame(&error), None);
        }
    }
    if !outcome.runs.is_empty() {
        let mut output = hidden_body(&outcome.runs);
        output.set_answers_sequence(checked.sequence);
        let mut reply = pb::Frame::new();
        reply.set_output(output);
        match encode_rows(encoding, hidden_size, &outcome.values) {
            Ok(payload) => reply.set_payload(payload),
            Err(_) => return Answered::Gone,
        }
        alive &= replies.send(reply, Some(encoding));
    }
    Answered::from_sent(alive, refused)
}

/// A Resume: the session cut back to what matches the coordinator's
/// history, answered with a Resumed frame saying how much that is.
fn answer_resume(
    shared: &ShardState,
    coordinator: u64,
    checked: &FrameCheck,
    replies: &mut Replies,
) -> Answered {
    let resume = checked.frame.get_resume();
    let Some(&id) = checked.sessions.first() else {
        return Answered::Computed;
    };
    let length = resume.get_length();
    if length > shared.context {
        let message = format!(
            "a Resume of {length} positions, past the model's context of {}",
            shared.context
        );
        return refuse_frame(replies, checked, ErrorKind::TooLarge, message);
    }
    let page = u64::from(shared.page_positions.max(1));
    let chains = resume.get_page_chains();
    if chains.len() as u64 != length / page {
        let message = format!(
            "a Resume of {length} positions names {} page chains, not {}",
            chains.len(),
            length / page
        );
        return refuse_frame(replies, checked, ErrorKind::Malformed, message);
    }
    let encoding = match Encoding::from_wire(resume.get_encoding()) {
        Ok(encoding) => encoding,
        Err(e) => return refuse_frame(replies, checked, ErrorKind::Malformed, e.to_string()),
    };
    let kept = {
        let mut core = lock(&shared.core);
        let core = &mut *core;
        core.keeper.as_mut().map(|keeper| {
            let key = (coordinator, id);
            let held = core.sessions.remove(&key);
            let (kv, kept) = keeper.resume(key, held, chains, encoding);
            if let Some(kv) = kv {
                core.sessions.insert(key, kv);
            }
            kept
        })
    };
    let Some(kept) = kept else {
        let message = "a Resume to a shard that keeps no pages (it has no state directory)";
        return refuse_frame(replies, checked, ErrorKind::Malformed, message.into());
    };
    let mut body = pb::Resumed::new();
    body.set_session_id(id.to_vec());
    body.set_kept(kept as u64);
    body.set_answers_sequence(checked.sequence);
    let mut frame = pb::Frame::new();
    frame.set_resumed(body);
    Answered::from_sent(replies.send(frame, None), false)
}

/// Answers a whole frame with one error frame of `kind`.
fn refuse_frame(
    replies: &mut Replies,
    checked: &FrameCheck,
    kind: ErrorKind,
    message: String,
) -> Answered {
    let error = FrameError {
        kind,
        message,
        sessions: checked.sessions.clone(),
        sequence: Some(checked.sequence),
    };
    Answered::from_sent(replies.send(error_frame(&error), None), true)
}

/// How long ago `deadline` (Unix nanoseconds, 0: none) passed, if it has.
pub(super) fn past_deadline(deadline: u64) -> Option<String> {
    let now = unix_nanos(SystemTime::now());
    (deadline != 0 && now > deadline)
        .then(|| format!("the deadline passed {} µs ago", (now - deadline) / 1000))
}
