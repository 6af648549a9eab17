//! Step 6 of the inbound checks: a frame's body has the shape its kind and
//! direction allow, and its payload is exactly the rows the body describes.
//!
//! A control frame (release, cancel, credit, error, resume, resumed) names
//! its sessions and carries no payload; a hidden-state frame (prefill,
//! decode, output) names runs of rows in an agreed encoding.

use super::{FrameKind, Inbound, WireSessionId};
use crate::cluster::payload::{Encoding, PayloadError};
use crate::proto::inferd_shard_v1::shard_runtime as pb;

/// What step 6 of the inbound checks reads off a frame's body.
pub(super) struct Shape {
    /// The payload's encoding (`None` for frames without hidden states).
    pub(super) encoding: Option<Encoding>,
    /// Hidden-state rows in the payload.
    pub(super) rows: usize,
    /// The sessions the frame names, in order.
    pub(super) sessions: Vec<WireSessionId>,
}

/// A session id off the wire: exactly 16 bytes.
fn session_id(bytes: &[u8]) -> Result<WireSessionId, String> {
    WireSessionId::try_from(bytes)
        .map_err(|_| format!("a session id of {} bytes, not 16", bytes.len()))
}

impl Inbound {
    /// Step 6: the body's shape; the encoding, row count and sessions.
    pub(super) fn shape(&self, frame: &pb::Frame, kind: FrameKind) -> Result<Shape, String> {
        if kind.direction() != self.direction {
            return Err(format!(
                "a {kind:?} frame cannot travel {:?}",
                self.direction
            ));
        }
        if kind.carries_hidden() {
            self.hidden_shape(frame, kind)
        } else {
            self.control_shape(frame, kind)
        }
    }

    /// A frame without hidden states: no payload, the sessions it must
    /// name, and what its body says about itself.
    fn control_shape(&self, frame: &pb::Frame, kind: FrameKind) -> Result<Shape, String> {
        if !frame.get_payload().is_empty() {
            return Err(format!(
                "a {kind:?} frame with a {}-byte payload",
                frame.get_payload().len()
            ));
        }
        let ids: &[Vec<u8>] = match kind {
            FrameKind::Release => frame.get_release().get_session_ids(),
            FrameKind::Cancel => frame.get_cancel().get_session_ids(),
            FrameKind::Error => frame.get_error().get_session_ids(),
            _ => &[],
        };
        if matches!(kind, FrameKind::Release | FrameKind::Cancel) && ids.is_empty() {
            return Err(format!("a {kind:?} frame naming no session"));
        }
        if kind == FrameKind::Credit && frame.get_credit().get_frames() == 0 {
            return Err("a credit of 0 frames".into());
        }
        let one_id;
        let ids: &[Vec<u8>] = match kind {
            FrameKind::Resume => {
                let resume = frame.get_resume();
                let encoding = Encoding::from_wire(resume.get_encoding())
                    .map_err(|e| format!("a Resume frame: {e}"))?;
                if !self.encodings.contains(&encoding) {
                    return Err(format!("a Resume for encoding {encoding:?}, not agreed"));
                }
                let pages = resume.get_page_chains().len() as u64;
                if pages > resume.get_length() {
                    return Err(format!(
                        "a Resume of {} positions with {pages} page chains",
                        resume.get_length()
                    ));
                }
                one_id = [resume.get_session_id().to_vec()];
                &one_id
            }
            FrameKind::Resumed => {
                let resumed = frame.get_resumed();
                if resumed.get_answers_sequence() == 0 {
                    return Err("a Resumed frame answering no frame".into());
                }
                one_id = [resumed.get_session_id().to_vec()];
                &one_id
            }
            _ => ids,
        };
        let sessions = ids
            .iter()
            .map(|id| session_id(id))
            .collect::<Result<_, _>>()?;
        Ok(Shape {
            encoding: None,
            rows: 0,
            sessions,
        })
    }

    /// A hidden-state frame: non-empty runs (one for a prefill fragment,
    /// one row per distinct session for a decode batch), an agreed encoding,
    /// and a payload of exactly the rows the runs describe.
    fn hidden_shape(&self, frame: &pb::Frame, kind: FrameKind) -> Result<Shape, String> {
        let header = frame.get_header();
        let hidden = match kind {
            FrameKind::Prefill => frame.get_prefill(),
            FrameKind::Decode => frame.get_decode(),
            _ => frame.get_output(),
        };
        let runs = hidden.get_runs();
        if runs.is_empty() {
            return Err(format!("a {kind:?} frame with no rows"));
        }
        if kind == FrameKind::Prefill && runs.len() != 1 {
            return Err(format!(
                "a prefill fragment is one run of one session, not {}",
                runs.len()
            ));
        }
        if kind == FrameKind::Output && hidden.get_answers_sequence() == 0 {
            return Err("an output frame answering no frame".into());
        }
        let mut rows = 0usize;
        let mut sessions = Vec::with_capacity(runs.len());
        for run in runs {
            let id = session_id(run.get_session_id())?;
            if run.get_count() == 0 {
                return Err("a run of 0 rows".into());
            }
            if kind == FrameKind::Decode && run.get_count() != 1 {
                return Err(format!(
                    "a decode batch carries one position per session, not {}",
                    run.get_count()
                ));
            }
            if kind == FrameKind::Decode && sessions.contains(&id) {
                return Err("a decode batch naming one session twice".into());
            }
            rows = rows.saturating_add(run.get_count() as usize);
            sessions.push(id);
        }
        let encoding = Encoding::from_wire(header.get_encoding()).map_err(|e| e.to_string())?;
        if !self.encodings.contains(&encoding) {
            return Err(format!("encoding {encoding:?} was not agreed"));
        }
        let row_bytes = encoding
            .row_bytes(self.hidden_size)
            .map_err(|e: PayloadError| e.to_string())?;
        let want = rows.checked_mul(row_bytes);
        if want != Some(frame.get_payload().len()) {
            return Err(format!(
                "{rows} rows of {} values in {encoding:?} are {} bytes, the payload has {}",
                self.hidden_size,
                want.map_or("too many".to_string(), |w| w.to_string()),
                frame.get_payload().len()
            ));
        }
        Ok(Shape {
            encoding: Some(encoding),
            rows,
            sessions,
        })
    }
}
