//! The frame vocabulary every check and every peer names: which way a
//! frame travels, what its body is, and why one is refused.

use super::WireSessionId;
use crate::proto::inferd_shard_v1::shard_runtime as pb;

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
    pub(super) fn of(frame: &pb::Frame) -> Option<Self> {
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

    pub(super) fn direction(self) -> Direction {
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
    pub(super) fn new(kind: ErrorKind, message: String) -> Self {
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
