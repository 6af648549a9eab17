//! Running one model across hosts (CONTRACT §4): the shard protocol of
//! `protos/inferd/shard/v1/shard_runtime.proto`. A coordinator streams
//! hidden states through shards that each run a layer range.
//!
//! Built so far: the protocol layer every side shares, with no transport in
//! it: the payload encodings and checksums ([`payload`]), frame building and
//! the fail-closed checks an inbound frame passes, in a fixed order, before
//! anything acts on it ([`frame`]), the handshake's agreement rules
//! ([`handshake`]), and the model fingerprint ([`fingerprint`]).

pub mod fingerprint;
pub mod frame;
pub mod handshake;
pub mod link;
pub mod payload;
pub mod raw;
pub mod relay;
pub mod shard;

pub use fingerprint::Fingerprint;
pub use frame::{
    Direction, Epochs, ErrorKind, FrameCheck, FrameError, FrameKind, Inbound, OutboundFrames,
    WireSessionId,
};
pub use handshake::{agree, Agreed, HandshakeError, PROTOCOL_VERSION};
pub use payload::{decode_rows, encode_rows, Encoding, PayloadError};
