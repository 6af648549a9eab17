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
//!
//! Files by job: the vocabulary of kinds and errors (`kinds.rs`), sealing
//! what a side sends (`outbound.rs`), and the checks of what it receives
//! (`inbound.rs`: steps 1 to 5 and 7 to 9; `shape.rs`: step 6).

use std::time::{SystemTime, UNIX_EPOCH};

use crate::proto::inferd_shard_v1::shard_runtime as pb;

mod inbound;
mod kinds;
mod outbound;
mod shape;
#[cfg(test)]
mod tests;

pub use inbound::{FrameCheck, Inbound};
pub use kinds::{Direction, ErrorKind, FrameError, FrameKind};
pub use outbound::OutboundFrames;

/// A session id on the wire: the runtime's 16 bytes.
pub type WireSessionId = [u8; 16];

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
