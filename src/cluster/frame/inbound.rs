//! The receiving side of a stream: the fail-closed checks every inbound
//! frame passes, in the order the module docs of [`super`] give.
//!
//! [`Inbound::check`] runs the stages in turn: size and parse, the
//! header's own checks (epochs, sequence, checksum), the body's shape
//! ([`super::shape`]), then what admits the frame to be acted on (row
//! bounds, deadline, flow control), whose refusals name its sessions.

use std::time::SystemTime;

use protobuf::Message;

use super::shape::Shape;
use super::{unix_nanos, Direction, Epochs, ErrorKind, FrameError, FrameKind, WireSessionId};
use crate::cluster::payload::{checksum, Encoding};
use crate::proto::inferd_shard_v1::shard_runtime as pb;

/// Why a stage refused a frame; [`Inbound::check`] adds the sequence and
/// the sessions.
type Refusal = (ErrorKind, String);

/// A frame that passed every check, with what the checks learned.
#[derive(Debug)]
pub struct FrameCheck {
    pub frame: pb::Frame,
    pub kind: FrameKind,
    pub sequence: u64,
    /// The encoding of a hidden-state payload.
    pub encoding: Option<Encoding>,
    /// Rows in a hidden-state payload.
    pub rows: usize,
    /// The sessions the frame names, in order.
    pub sessions: Vec<WireSessionId>,
}

/// The receiving side of one stream; see the module docs for the checks.
#[derive(Debug)]
pub struct Inbound {
    pub(super) direction: Direction,
    epochs: Epochs,
    expected_sequence: u64,
    max_frame_bytes: usize,
    pub(super) hidden_size: usize,
    pub(super) encodings: Vec<Encoding>,
    /// Hidden-state frames the peer may still send (shard side only).
    credits: Option<u64>,
    /// Rows one hidden-state frame may carry, and the first position past
    /// the model's context (shard side, when set).
    row_bounds: Option<(usize, u64)>,
}

impl Inbound {
    /// A shard's inbound side: frames to the shard, `credits` hidden-state
    /// frames granted up front (the credit window).
    pub fn to_shard(
        epochs: Epochs,
        max_frame_bytes: usize,
        hidden_size: usize,
        encodings: Vec<Encoding>,
        credits: u32,
    ) -> Self {
        Inbound {
            direction: Direction::ToShard,
            epochs,
            expected_sequence: 1,
            max_frame_bytes,
            hidden_size,
            encodings,
            credits: Some(u64::from(credits)),
            row_bounds: None,
        }
    }

    /// Refuses (`TooLarge`, step 7) a hidden-state frame of more than
    /// `max_rows` rows, or one whose positions reach `context`.
    pub fn with_row_bounds(mut self, max_rows: usize, context: u64) -> Self {
        self.row_bounds = Some((max_rows, context));
        self
    }

    /// A coordinator's inbound side: frames from a shard.
    pub fn to_coordinator(
        epochs: Epochs,
        max_frame_bytes: usize,
        hidden_size: usize,
        encodings: Vec<Encoding>,
    ) -> Self {
        Inbound {
            direction: Direction::ToCoordinator,
            epochs,
            expected_sequence: 1,
            max_frame_bytes,
            hidden_size,
            encodings,
            credits: None,
            row_bounds: None,
        }
    }

    /// The shard sent the peer a Credit frame for `frames` more.
    pub fn grant(&mut self, frames: u32) {
        if let Some(credits) = &mut self.credits {
            *credits = credits.saturating_add(u64::from(frames));
        }
    }

    /// Hidden-state frames the peer may still send (`None` on the
    /// coordinator side, which does not meter).
    pub fn credits(&self) -> Option<u64> {
        self.credits
    }

    /// Runs the checks of the module docs on one serialized frame.
    pub fn check(&mut self, bytes: &[u8], now: SystemTime) -> Result<FrameCheck, FrameError> {
        // 1-2. Size, before any parsing; then the parse.
        let frame = self.parse(bytes)?;
        let sequence = frame.get_header().get_sequence();
        let refuse = |(kind, message): Refusal, sessions: Vec<WireSessionId>| FrameError {
            kind,
            message,
            sessions,
            sequence: Some(sequence),
        };
        let kind = FrameKind::of(&frame).ok_or_else(|| {
            let message = "frame without a body".into();
            refuse((ErrorKind::Malformed, message), vec![])
        })?;
        // 3-5. Epochs, sequence, checksum: the header's own.
        self.check_header(frame.get_header(), frame.get_payload())
            .map_err(|refusal| refuse(refusal, vec![]))?;
        // 6. Shape.
        let shape = self
            .shape(&frame, kind)
            .map_err(|message| refuse((ErrorKind::Malformed, message), vec![]))?;
        let Shape {
            encoding,
            rows,
            sessions,
        } = shape;
        // 7-9. Bounds, deadline, flow control: refusals from here on name
        // the frame's sessions.
        let deadline = frame.get_header().get_deadline_unix_nanos();
        let admitted = self
            .check_bounds(&frame, kind, rows)
            .and_then(|()| check_deadline(deadline, now))
            .and_then(|()| self.take_credit(kind));
        if let Err(refusal) = admitted {
            return Err(refuse(refusal, sessions));
        }
        Ok(FrameCheck {
            frame,
            kind,
            sequence,
            encoding,
            rows,
            sessions,
        })
    }

    /// Steps 1 and 2: the size, before any parsing, then the parse; a
    /// frame refused here has no sequence number yet.
    fn parse(&self, bytes: &[u8]) -> Result<pb::Frame, FrameError> {
        // 1. Size, before any parsing.
        if bytes.len() > self.max_frame_bytes {
            return Err(FrameError::new(
                ErrorKind::TooLarge,
                format!(
                    "frame of {} bytes, limit {}",
                    bytes.len(),
                    self.max_frame_bytes
                ),
            ));
        }
        // 2. Parse.
        let frame = pb::Frame::parse_from_bytes(bytes)
            .map_err(|e| FrameError::new(ErrorKind::Malformed, format!("not a Frame: {e}")))?;
        if !frame.has_header() {
            return Err(FrameError::new(
                ErrorKind::Malformed,
                "frame without a header".into(),
            ));
        }
        Ok(frame)
    }

    /// Steps 3 to 5: the live epochs, the next sequence number (counted
    /// once it passes, whatever a later step says) and the payload's
    /// checksum.
    fn check_header(&mut self, header: &pb::FrameHeader, payload: &[u8]) -> Result<(), Refusal> {
        // 3. Epochs.
        if header.get_shard_epoch() != self.epochs.shard
            || header.get_coordinator_epoch() != self.epochs.coordinator
        {
            return Err((
                ErrorKind::StaleEpoch,
                format!(
                    "epochs shard {:#x} coordinator {:#x}, live ones are {:#x} and {:#x}",
                    header.get_shard_epoch(),
                    header.get_coordinator_epoch(),
                    self.epochs.shard,
                    self.epochs.coordinator
                ),
            ));
        }
        // 4. Sequence.
        let sequence = header.get_sequence();
        if sequence != self.expected_sequence {
            let what = if sequence < self.expected_sequence {
                "a repeat"
            } else {
                "a gap"
            };
            return Err((
                ErrorKind::Sequence,
                format!(
                    "sequence {sequence} is {what}: expected {}",
                    self.expected_sequence
                ),
            ));
        }
        self.expected_sequence += 1;
        // 5. Checksum.
        let crc = checksum(payload);
        if crc != header.get_payload_crc32c() {
            return Err((
                ErrorKind::Checksum,
                format!(
                    "payload CRC32C {crc:#010x}, header says {:#010x}",
                    header.get_payload_crc32c()
                ),
            ));
        }
        Ok(())
    }

    /// Step 7 (when bounds are set): a hidden-state frame carries at most
    /// the agreed rows, and no run reaches past the model's context.
    fn check_bounds(&self, frame: &pb::Frame, kind: FrameKind, rows: usize) -> Result<(), Refusal> {
        let (Some((max_rows, context)), true) = (self.row_bounds, kind.carries_hidden()) else {
            return Ok(());
        };
        if rows > max_rows {
            return Err((
                ErrorKind::TooLarge,
                format!("a frame of {rows} rows, at most {max_rows} per frame"),
            ));
        }
        let runs = match kind {
            FrameKind::Prefill => frame.get_prefill().get_runs(),
            FrameKind::Decode => frame.get_decode().get_runs(),
            _ => frame.get_output().get_runs(),
        };
        let past = runs.iter().find(|r| {
            r.get_position()
                .checked_add(u64::from(r.get_count()))
                .is_none_or(|end| end > context)
        });
        if let Some(r) = past {
            return Err((
                ErrorKind::TooLarge,
                format!(
                    "positions {}..{} run past the model's context of {context}",
                    r.get_position(),
                    r.get_position().saturating_add(u64::from(r.get_count()))
                ),
            ));
        }
        Ok(())
    }

    /// Step 9: a hidden-state frame to a shard takes one of the credits
    /// the shard granted.
    fn take_credit(&mut self, kind: FrameKind) -> Result<(), Refusal> {
        if kind.carries_hidden() {
            if let Some(credits) = &mut self.credits {
                if *credits == 0 {
                    return Err((
                        ErrorKind::FlowControl,
                        "a hidden-state frame with no credit left".into(),
                    ));
                }
                *credits -= 1;
            }
        }
        Ok(())
    }
}

/// Step 8: a frame whose deadline (Unix nanoseconds, 0: none) passed
/// before it was read.
fn check_deadline(deadline: u64, now: SystemTime) -> Result<(), Refusal> {
    if deadline != 0 && unix_nanos(now) > deadline {
        return Err((
            ErrorKind::Deadline,
            format!(
                "deadline passed {} µs before the frame was read",
                (unix_nanos(now) - deadline) / 1000
            ),
        ));
    }
    Ok(())
}
