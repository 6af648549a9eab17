//! The coordinator's end of one shard: handshake, then a Session stream on
//! which it sends hidden states through the shard's layers and reads back
//! the result. Every frame the shard sends passes the same fail-closed
//! checks the shard applies ([`super::frame::Inbound`]); a refused frame or
//! a `ShardError` from the shard fails the call with a typed error naming
//! the sessions concerned.
//!
//! Files by job: connecting and the handshake (`connect.rs`), moving
//! frames on the stream and reading the shard's refusals (`wire.rs`), and
//! the calls a coordinator makes through it (`calls.rs`: forward, resume,
//! release, cancel).

use std::time::Duration;

use grpcio::{ClientDuplexReceiver, ClientDuplexSender};

use super::fingerprint::Fingerprint;
use super::frame::{Epochs, ErrorKind, FrameError, Inbound, OutboundFrames};
use super::payload::Encoding;
use crate::proto::inferd_shard_v1::shard_runtime_grpc::ShardRuntimeClient;

mod calls;
mod connect;
mod wire;

/// Why a call through a shard failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("shard {addr}: handshake failed: {message}")]
    Handshake { addr: String, message: String },
    #[error("shard {addr}: transport failed: {message}")]
    Transport { addr: String, message: String },
    /// The shard refused a frame or failed sessions (its `ShardError`).
    #[error("shard {addr}: {error}")]
    Refused { addr: String, error: FrameError },
    /// A frame from the shard failed our checks.
    #[error("shard {addr} sent a frame we refuse: {error}")]
    BadReply { addr: String, error: FrameError },
}

impl LinkError {
    /// The failure kind, when the protocol named one.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            LinkError::Refused { error, .. } | LinkError::BadReply { error, .. } => {
                Some(error.kind)
            }
            _ => None,
        }
    }
}

/// Terms the coordinator asks for.
#[derive(Clone, Debug)]
pub struct LinkOptions {
    pub encoding: Encoding,
    pub max_frame_bytes: u32,
    pub credit_window: u32,
    /// Keep the SHA-256 of every frame sent and received (to compare with
    /// what a relay saw).
    pub record_hashes: bool,
    /// How long the handshake may take (connecting included).
    pub handshake_timeout: std::time::Duration,
}

/// Where a shard computes its layers, from its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardBackend {
    Cpu,
    Gpu,
}

impl ShardBackend {
    /// The handshake's name (empty from shards that predate the field: the
    /// CPU); `None` for a name this coordinator does not know.
    pub fn from_wire(name: &str) -> Option<Self> {
        match name {
            "" | "cpu" => Some(Self::Cpu),
            "gpu" => Some(Self::Gpu),
            _ => None,
        }
    }

    /// `cpu` or `gpu`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Gpu => "gpu",
        }
    }
}

/// What a shard can hold, from its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardCapacity {
    /// KV pages for all sessions together, in pages of positions over all
    /// the shard's layers.
    pub kv_pages: u64,
    /// Positions per page.
    pub page_positions: u32,
    /// Sessions at once (the agreed limit).
    pub max_sessions: u32,
    /// Rows one hidden-state frame may carry (the agreed limit; 0: none).
    pub max_frame_rows: u32,
    /// The shard keeps pages by their chains and answers Resume frames.
    pub keeps_pages: bool,
    /// Where it computes.
    pub backend: ShardBackend,
}

impl Default for LinkOptions {
    fn default() -> Self {
        LinkOptions {
            encoding: Encoding::F32,
            max_frame_bytes: 64 << 20,
            credit_window: 16,
            record_hashes: false,
            handshake_timeout: std::time::Duration::from_secs(30),
        }
    }
}

/// One connected shard; see the module docs.
pub struct ShardLink {
    addr: String,
    epochs: Epochs,
    hidden_size: usize,
    encoding: Encoding,
    sender: ClientDuplexSender<Vec<u8>>,
    receiver: ClientDuplexReceiver<Vec<u8>>,
    outbound: OutboundFrames,
    inbound: Inbound,
    credits: u64,
    served: Fingerprint,
    capacity: ShardCapacity,
    /// SHA-256 (hex) of frames sent and received, when recording.
    hashes: Option<(Vec<String>, Vec<String>)>,
    _client: ShardRuntimeClient,
}

/// How long past a frame's deadline the coordinator still waits for its
/// answer before it gives the link up: a shard that is connected (its
/// transport answers keepalive pings) but never answers must not hold a
/// worker forever.
const ANSWER_GRACE: Duration = Duration::from_secs(2);

impl ShardLink {
    /// SHA-256 (hex) of every frame sent and received on the stream so
    /// far, in order, when `record_hashes` was set.
    pub fn frame_hashes(&self) -> Option<(&[String], &[String])> {
        self.hashes
            .as_ref()
            .map(|(sent, received)| (sent.as_slice(), received.as_slice()))
    }

    /// The agreed epochs.
    pub fn epochs(&self) -> Epochs {
        self.epochs
    }

    /// What the shard serves.
    pub fn served(&self) -> &Fingerprint {
        &self.served
    }

    /// What the shard can hold.
    pub fn capacity(&self) -> ShardCapacity {
        self.capacity
    }

    /// The shard's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }
}
