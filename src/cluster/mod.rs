//! Running one model across hosts (CONTRACT §4): the shard protocol of
//! `protos/inferd/shard/v1/shard_runtime.proto`. A coordinator streams
//! hidden states through shards that each run a layer range.
//!
//! The protocol layer every side shares has no transport in it: payload
//! encodings and checksums ([`payload`]), frame sealing and the fail-closed
//! checks an inbound frame passes, in a fixed order, before anything acts on
//! it ([`frame`]), the handshake's rules ([`handshake`]) and the model
//! fingerprint ([`fingerprint`]). Over gRPC: the raw-bytes session method
//! ([`raw`]) and shared channel settings ([`transport`]), the shard server
//! ([`shard`], `inferd shard`), the coordinator's link to one shard
//! ([`link`]), the chain of links a runtime worker drives as a coordinator
//! ([`coordinator`]) behind the runtime's step interface ([`layers`],
//! `inferd serve --shards`), and the opaque relay
//! ([`relay`], `inferd relay`).

pub mod coordinator;
pub mod fingerprint;
pub mod frame;
pub mod handshake;
pub mod keeper;
pub mod kept;
pub mod layers;
pub mod link;
pub mod payload;
pub mod raw;
pub mod relay;
pub mod shard;
pub mod transport;

pub use fingerprint::Fingerprint;
pub use frame::{
    Direction, Epochs, ErrorKind, FrameCheck, FrameError, FrameKind, Inbound, OutboundFrames,
    WireSessionId,
};
pub use handshake::{agree, Agreed, HandshakeError, PROTOCOL_VERSION};
pub use payload::{decode_rows, encode_rows, Encoding, PayloadError};
