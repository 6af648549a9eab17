//! Shard-protocol frames: numbering and sealing outbound frames, and the
//! fail-closed checks every inbound frame passes before anything acts on it.
//!
//! The checks run in this order, and the first failure refuses the frame:
//!
//! 1. **Size**: the serialized frame is at most `max_frame_bytes`
//!    (`TooLarge`), checked before parsing.
//! 2. **Parse**: it decodes as a `Frame` with a header and a body
//!    (`Malformed`).
//! 3. **Epochs**: both epochs are the live ones from the handshake
//!    (`StaleEpoch`): frames of a restarted peer are refused.
//! 4. **Sequence**: exactly one more than the last accepted frame's
//!    (`Sequence`: a repeat or a gap). A frame that passes this step is
//!    counted even if a later step refuses it, so one refused frame does not
//!    turn every later one into a gap.
//! 5. **Checksum**: the payload's CRC32C matches the header (`Checksum`,
//!    DATA_LOSS).
//! 6. **Shape**: the body is one this direction may carry, session ids are
//!    16 bytes, runs are non-empty (one run for a prefill fragment, one row
//!    per session for a decode batch), the encoding is one both sides
//!    accepted and the payload length is exactly the rows it describes
//!    (`Malformed`).
//! 7. **Bounds** (to a shard, when set with [`Inbound::with_row_bounds`]):
//!    at most the agreed rows per frame, and no position at or past the
//!    model's context (`TooLarge`), so an over-large frame is refused
//!    before anything is computed or allocated for it.
//! 8. **Deadline**: not already past (`Deadline`); nothing is computed for
//!    an expired frame.
//! 9. **Flow control**: a hidden-state frame to a shard needs a credit the
//!    shard granted (`FlowControl`).
//!
//! Unknown sessions are refused by whoever holds the sessions, with
//! [`ErrorKind::UnknownSession`].

use std::time::{SystemTime, UNIX_EPOCH};

use protobuf::Message;

use super::payload::{checksum, Encoding, PayloadError};
use crate::proto::inferd_shard_v1::shard_runtime as pb;

/// A session id on the wire: the runtime's 16 bytes.
pub type WireSessionId = [u8; 16];

/// Which way frames travel on a stream; each direction carries its own bodies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Prefill, decode, release, cancel, resume.
    ToShard,
    /// Output, credit, error, resumed.
    ToCoordinator,
}

/// The body of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    Prefill,
    Decode,
    Output,
    Release,
    Cancel,
    Credit,
    Error,
    /// Keep what matches a history (to a shard that keeps pages).
    Resume,
    /// What a Resume kept.
    Resumed,
}

impl FrameKind {
    fn of(frame: &pb::Frame) -> Option<Self> {
        Some(if frame.has_prefill() {
            FrameKind::Prefill
        } else if frame.has_decode() {
            FrameKind::Decode
        } else if frame.has_output() {
            FrameKind::Output
        } else if frame.has_release() {
            FrameKind::Release
        } else if frame.has_cancel() {
            FrameKind::Cancel
        } else if frame.has_credit() {
            FrameKind::Credit
        } else if frame.has_error() {
            FrameKind::Error
        } else if frame.has_resume() {
            FrameKind::Resume
        } else if frame.has_resumed() {
            FrameKind::Resumed
        } else {
            return None;
        })
    }

    fn direction(self) -> Direction {
        match self {
            FrameKind::Prefill
            | FrameKind::Decode
            | FrameKind::Release
            | FrameKind::Cancel
            | FrameKind::Resume => Direction::ToShard,
            FrameKind::Output | FrameKind::Credit | FrameKind::Error | FrameKind::Resumed => {
                Direction::ToCoordinator
            }
        }
    }

    /// Whether the frame carries hidden states in its payload.
    pub fn carries_hidden(self) -> bool {
        matches!(
            self,
            FrameKind::Prefill | FrameKind::Decode | FrameKind::Output
        )
    }
}

/// Why a frame (or the sessions it names) failed; the wire's
/// `ShardError.Kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    Checksum,
    StaleEpoch,
    Sequence,
    TooLarge,
    Malformed,
    UnknownSession,
    Deadline,
    FlowControl,
    Internal,
}

impl ErrorKind {
    /// The gRPC status code name the kind is reported to clients as.
    pub fn status_name(self) -> &'static str {
        match self {
            ErrorKind::Checksum => "DATA_LOSS",
            ErrorKind::StaleEpoch => "FAILED_PRECONDITION",
            ErrorKind::Sequence => "ABORTED",
            ErrorKind::TooLarge | ErrorKind::FlowControl => "RESOURCE_EXHAUSTED",
            ErrorKind::Malformed => "INVALID_ARGUMENT",
            ErrorKind::UnknownSession => "NOT_FOUND",
            ErrorKind::Deadline => "DEADLINE_EXCEEDED",
            ErrorKind::Internal => "INTERNAL",
        }
    }

    /// A metric-friendly name.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Checksum => "checksum",
            ErrorKind::StaleEpoch => "stale_epoch",
            ErrorKind::Sequence => "sequence",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::Malformed => "malformed",
            ErrorKind::UnknownSession => "unknown_session",
            ErrorKind::Deadline => "deadline",
            ErrorKind::FlowControl => "flow_control",
            ErrorKind::Internal => "internal",
        }
    }

    pub fn to_wire(self) -> pb::ShardError_Kind {
        use pb::ShardError_Kind as K;
        match self {
            ErrorKind::Checksum => K::KIND_CHECKSUM,
            ErrorKind::StaleEpoch => K::KIND_STALE_EPOCH,
            ErrorKind::Sequence => K::KIND_SEQUENCE,
            ErrorKind::TooLarge => K::KIND_TOO_LARGE,
            ErrorKind::Malformed => K::KIND_MALFORMED,
            ErrorKind::UnknownSession => K::KIND_UNKNOWN_SESSION,
            ErrorKind::Deadline => K::KIND_DEADLINE,
            ErrorKind::FlowControl => K::KIND_FLOW_CONTROL,
            ErrorKind::Internal => K::KIND_INTERNAL,
        }
    }

    /// From the wire; `UNSPECIFIED` is `None`.
    pub fn from_wire(kind: pb::ShardError_Kind) -> Option<Self> {
        use pb::ShardError_Kind as K;
        Some(match kind {
            K::KIND_UNSPECIFIED => return None,
            K::KIND_CHECKSUM => ErrorKind::Checksum,
            K::KIND_STALE_EPOCH => ErrorKind::StaleEpoch,
            K::KIND_SEQUENCE => ErrorKind::Sequence,
            K::KIND_TOO_LARGE => ErrorKind::TooLarge,
            K::KIND_MALFORMED => ErrorKind::Malformed,
            K::KIND_UNKNOWN_SESSION => ErrorKind::UnknownSession,
            K::KIND_DEADLINE => ErrorKind::Deadline,
            K::KIND_FLOW_CONTROL => ErrorKind::FlowControl,
            K::KIND_INTERNAL => ErrorKind::Internal,
        })
    }
}

/// A refused frame: the kind, the numbers, and the sessions it named (empty
/// when it could not be attributed).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{} frame refused ({}): {message}", kind.name(), kind.status_name())]
pub struct FrameError {
    pub kind: ErrorKind,
    pub message: String,
    pub sessions: Vec<WireSessionId>,
    /// The refused frame's sequence number, when its header was read.
    pub sequence: Option<u64>,
}

impl FrameError {
    fn new(kind: ErrorKind, message: String) -> Self {
        FrameError {
            kind,
            message,
            sessions: Vec::new(),
            sequence: None,
        }
    }

    /// The `ShardError` body that reports it to the peer.
    pub fn to_wire(&self) -> pb::ShardError {
        let mut e = pb::ShardError::new();
        e.set_kind(self.kind.to_wire());
        e.set_message(self.message.clone());
        e.set_session_ids(self.sessions.iter().map(|s| s.to_vec()).collect());
        e.set_refused_sequence(self.sequence.unwrap_or(0));
        e
    }
}

/// The epochs both sides agreed on in the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Epochs {
    pub shard: u64,
    pub coordinator: u64,
}

/// One session's run of hidden-state rows in a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// The session the rows belong to.
    pub session: WireSessionId,
    /// The absolute position of the first row.
    pub position: u64,
    /// How many rows (consecutive positions).
    pub rows: u32,
}

/// What step 6 of the inbound checks reads off a frame's body.
struct Shape {
    /// The payload's encoding (`None` for frames without hidden states).
    encoding: Option<Encoding>,
    /// Hidden-state rows in the payload.
    rows: usize,
    /// The sessions the frame names, in order.
    sessions: Vec<WireSessionId>,
}

/// A hidden-state body for `runs`, in payload order.
pub fn hidden_body(runs: &[Run]) -> pb::Hidden {
    let mut body = pb::Hidden::new();
    body.set_runs(
        runs.iter()
            .map(|run| {
                let mut r = pb::Rows::new();
                r.set_session_id(run.session.to_vec());
                r.set_position(run.position);
                r.set_count(run.rows);
                r
            })
            .collect(),
    );
    body
}

/// Nanoseconds since the Unix epoch (0 before it).
pub fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Numbers and seals the frames one side sends on a stream.
#[derive(Debug)]
pub struct OutboundFrames {
    epochs: Epochs,
    next_sequence: u64,
}

impl OutboundFrames {
    pub fn new(epochs: Epochs) -> Self {
        OutboundFrames {
            epochs,
            next_sequence: 1,
        }
    }

    /// The sequence number the next frame gets.
    pub fn next_sequence(&self) -> u64 {
        self.next_sequence
    }

    /// Names `epochs` in the frames sealed from now on (a shard learns
    /// them from a stream's first valid frame); the numbering goes on.
    pub fn set_epochs(&mut self, epochs: Epochs) {
        self.epochs = epochs;
    }

    /// Fills in the header (epochs, the next sequence number, deadline,
    /// encoding, payload checksum) and serializes the frame.
    pub fn seal(
        &mut self,
        mut frame: pb::Frame,
        encoding: Option<Encoding>,
        deadline_unix_nanos: u64,
    ) -> Result<Vec<u8>, protobuf::ProtobufError> {
        let mut header = pb::FrameHeader::new();
        header.set_shard_epoch(self.epochs.shard);
        header.set_coordinator_epoch(self.epochs.coordinator);
        header.set_sequence(self.next_sequence);
        header.set_deadline_unix_nanos(deadline_unix_nanos);
        header.set_encoding(encoding.map_or(pb::Encoding::ENCODING_UNSPECIFIED, Encoding::to_wire));
        header.set_payload_crc32c(checksum(frame.get_payload()));
        frame.set_header(header);
        let bytes = frame.write_to_bytes()?;
        self.next_sequence += 1;
        Ok(bytes)
    }
}

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
    direction: Direction,
    epochs: Epochs,
    expected_sequence: u64,
    max_frame_bytes: usize,
    hidden_size: usize,
    encodings: Vec<Encoding>,
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
        let header = frame.get_header();
        let sequence = header.get_sequence();
        let refuse = |kind: ErrorKind, message: String, sessions: Vec<WireSessionId>| FrameError {
            kind,
            message,
            sessions,
            sequence: Some(sequence),
        };
        let kind = FrameKind::of(&frame)
            .ok_or_else(|| refuse(ErrorKind::Malformed, "frame without a body".into(), vec![]))?;
        // 3. Epochs.
        if header.get_shard_epoch() != self.epochs.shard
            || header.get_coordinator_epoch() != self.epochs.coordinator
        {
            return Err(refuse(
                ErrorKind::StaleEpoch,
                format!(
                    "epochs shard {:#x} coordinator {:#x}, live ones are {:#x} and {:#x}",
                    header.get_shard_epoch(),
                    header.get_coordinator_epoch(),
                    self.epochs.shard,
                    self.epochs.coordinator
                ),
                vec![],
            ));
        }
        // 4. Sequence.
        if sequence != self.expected_sequence {
            let what = if sequence < self.expected_sequence {
                "a repeat"
            } else {
                "a gap"
            };
            return Err(refuse(
                ErrorKind::Sequence,
                format!(
                    "sequence {sequence} is {what}: expected {}",
                    self.expected_sequence
                ),
                vec![],
            ));
        }
        self.expected_sequence += 1;
        // 5. Checksum.
        let crc = checksum(frame.get_payload());
        if crc != header.get_payload_crc32c() {
            return Err(refuse(
                ErrorKind::Checksum,
                format!(
                    "payload CRC32C {crc:#010x}, header says {:#010x}",
                    header.get_payload_crc32c()
                ),
                vec![],
            ));
        }
        // 6. Shape.
        let shape = self
            .shape(&frame, kind)
            .map_err(|message| refuse(ErrorKind::Malformed, message, vec![]))?;
        let Shape {
            encoding,
            rows,
            sessions,
        } = shape;
        // 7. Bounds.
        if let (Some((max_rows, context)), true) = (self.row_bounds, kind.carries_hidden()) {
            if rows > max_rows {
                return Err(refuse(
                    ErrorKind::TooLarge,
                    format!("a frame of {rows} rows, at most {max_rows} per frame"),
                    sessions,
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
                return Err(refuse(
                    ErrorKind::TooLarge,
                    format!(
                        "positions {}..{} run past the model's context of {context}",
                        r.get_position(),
                        r.get_position().saturating_add(u64::from(r.get_count()))
                    ),
                    sessions,
                ));
            }
        }
        // 8. Deadline.
        let deadline = header.get_deadline_unix_nanos();
        if deadline != 0 && unix_nanos(now) > deadline {
            return Err(refuse(
                ErrorKind::Deadline,
                format!(
                    "deadline passed {} µs before the frame was read",
                    (unix_nanos(now) - deadline) / 1000
                ),
                sessions,
            ));
        }
        // 9. Flow control.
        if kind.carries_hidden() {
            if let Some(credits) = &mut self.credits {
                if *credits == 0 {
                    return Err(refuse(
                        ErrorKind::FlowControl,
                        "a hidden-state frame with no credit left".into(),
                        sessions,
                    ));
                }
                *credits -= 1;
            }
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

    /// Step 6: the body's shape; the encoding, row count and sessions.
    fn shape(&self, frame: &pb::Frame, kind: FrameKind) -> Result<Shape, String> {
        if kind.direction() != self.direction {
            return Err(format!(
                "a {kind:?} frame cannot travel {:?}",
                self.direction
            ));
        }
        let session_id = |bytes: &[u8]| {
            WireSessionId::try_from(bytes)
                .map_err(|_| format!("a session id of {} bytes, not 16", bytes.len()))
        };
        let header = frame.get_header();
        if !kind.carries_hidden() {
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
            return Ok(Shape {
                encoding: None,
                rows: 0,
                sessions,
            });
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    const EPOCHS: Epochs = Epochs {
        shard: 5,
        coordinator: 6,
    };

    fn prefill(sealer: &mut OutboundFrames, position: u64, rows: u32, hidden: usize) -> Vec<u8> {
        let mut frame = pb::Frame::new();
        frame.set_prefill(hidden_body(&[Run {
            session: [1; 16],
            position,
            rows,
        }]));
        frame.set_payload(vec![0; rows as usize * hidden * 4]);
        sealer
            .seal(frame, Some(Encoding::F32), 0)
            .expect("serializable")
    }

    #[test]
    fn frames_over_the_rows_or_past_the_context_are_too_large() {
        let hidden = 8;
        let mut inbound = Inbound::to_shard(EPOCHS, 1 << 20, hidden, vec![Encoding::F32], 16)
            .with_row_bounds(4, 100);
        let mut sealer = OutboundFrames::new(EPOCHS);
        let now = SystemTime::now();
        let ok = prefill(&mut sealer, 0, 4, hidden);
        assert_eq!(inbound.check(&ok, now).map(|c| c.rows), Ok(4));
        let many = prefill(&mut sealer, 4, 5, hidden);
        let refused = inbound.check(&many, now).expect_err("5 rows > 4");
        assert_eq!(refused.kind, ErrorKind::TooLarge);
        assert_eq!(refused.sessions, vec![[1; 16]]);
        let past = prefill(&mut sealer, 98, 3, hidden);
        let refused = inbound.check(&past, now).expect_err("98..101 > 100");
        assert_eq!(refused.kind, ErrorKind::TooLarge);
        let last = prefill(&mut sealer, 96, 4, hidden);
        assert!(inbound.check(&last, now).is_ok(), "96..100 fits");
        assert_eq!(inbound.credits(), Some(14), "refused frames take no credit");
    }
}
