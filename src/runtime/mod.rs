//! The transport-independent server core: sessions sharded over pinned
//! worker threads, each advancing all of its generating sessions in one
//! batched forward step, with the session contract (CONTRACT §2) enforced
//! here so a transport only converts messages.
//!
//! A caller's request becomes a [`worker::Command`] on the owning worker's
//! bounded channel (full: `ResourceExhausted`, never a blocked caller). The
//! session id's first byte picks the worker, so no shared map exists. Unary
//! replies come back as a [`Pending`]; a Generate streams over a bounded
//! channel, and a full stream makes only that session sit out steps.

mod board;
mod config;
mod error;
pub mod limits;
#[cfg(loom)]
pub mod notify;
#[cfg(not(loom))]
mod notify;
mod rate;
mod request_constraint;
mod stats;
mod types;
// Under loom only the concurrency primitives above are built and checked.
#[cfg(not(loom))]
mod gpu_layers;
#[cfg(not(loom))]
mod handle;
#[cfg(not(loom))]
mod local;
#[cfg(not(loom))]
mod session;
#[cfg(not(loom))]
mod step;
#[cfg(not(loom))]
mod worker;

pub use crate::base::{BadTenant, SessionId, Tenant};
pub use board::{EvictionBoard, EvictionTicket, OpenRequests};
#[cfg(not(loom))]
pub use config::ReplicaConfig;
pub use config::{EvictionPolicy, OverflowPolicy, RuntimeConfig, Speculation};
pub use error::{RuntimeError, StatusKind};
#[cfg(not(loom))]
pub use gpu_layers::GpuLayers;
#[cfg(not(loom))]
pub use handle::Runtime;
#[cfg(not(loom))]
pub use local::LocalLayers;
pub use rate::{DecodeRate, RATE_BUCKETS, RATE_WINDOW_SECS};
pub use request_constraint::RequestConstraint;
pub use stats::{
    Counters, DurationHistogram, HistogramSnapshot, ReplicaStats, RuntimeStats, WorkerGauges,
    WorkerStats, PREFILL_BUCKETS,
};
#[cfg(not(loom))]
pub use step::{Layers, ShardSnapshot, ShardStatsSnapshot, StepError, StepFeed, StepRunner};
pub use types::{
    AppendReply, AppendTokens, CloseReply, CreateSession, ForkReply, ForkSession, GenerateDone,
    GenerateEvent, GenerateRequest, GenerateStream, Pending, SamplingOptions, SessionInfo,
    SpeculationCounts, StopReason,
};
