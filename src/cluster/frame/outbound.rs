//! The sending side of a stream: numbers each frame and seals its header
//! (epochs, sequence, deadline, encoding, payload checksum).

use protobuf::Message;

use super::Epochs;
use crate::cluster::payload::{checksum, Encoding};
use crate::proto::inferd_shard_v1::shard_runtime as pb;

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
