//! `inferd shard`: serves one layer range of a model over the shard
//! protocol. It maps the GGUF, keeps per-session KV for its layers in its
//! own page pool, agrees on terms in `Handshake`, and answers each
//! `Session` stream frame by frame: every inbound frame passes the
//! fail-closed checks of [`super::frame`] first; a refused frame is answered
//! with a `ShardError` frame naming what failed, and the stream goes on.
//!
//! Sessions belong to the coordinator epoch that created them: a
//! coordinator that restarts (new epoch) sees none of its predecessor's
//! sessions, and a shard that restarts has a new epoch, so frames meant for
//! its predecessor are refused as stale.
//!
//! Each stream has two threads. A reader takes frames off the wire as they
//! arrive and checks them at once (flow control included: a frame beyond
//! the credit window is refused even while the shard is busy computing),
//! handing the rest to the stream's compute thread through a bounded queue.
//! The compute thread answers in arrival order. Work is bounded: a frame
//! may carry at most the agreed rows and no position past the model's
//! context (refused before anything is computed), and a prefill fragment
//! runs in steps of [`PREFILL_STEP_ROWS`]; before each step the shard checks
//! the frame's deadline, whether the stream was cancelled or broke, and
//! whether the shard is shutting down. A fragment stopped midway releases
//! its session here (nothing half-written stays), and the coordinator
//! rebuilds the session before its next step.
//!
//! Files by job: opening the shard's state (`state.rs`), the handshake and
//! which one a stream names (`handshake.rs`), a Session stream's reader
//! and compute threads (`stream.rs`), acting on each checked frame
//! (`answer.rs`), and running the layers over a frame's rows
//! (`compute.rs`).

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use futures_executor::block_on;
use grpcio::{DuplexSink, Environment, RequestStream, RpcContext, ServiceBuilder, UnarySink};

use super::fingerprint::Fingerprint;
use super::frame::unix_nanos;
use super::handshake::Agreed;
use super::keeper::{Keeper, SessionKey};
use super::kept::KeptError;
use super::payload::Encoding;
use super::raw::{HANDSHAKE_RAW, SESSION_RAW};
use crate::gpu::{GpuDevice, GpuError, GpuForward};
use crate::kv::{KvError, KvPool, SessionKv};
use crate::model::{Model, Scratch};
use crate::proto::inferd_shard_v1::shard_runtime as pb;
use crate::threads::ThreadPool;

mod answer;
mod compute;
mod handshake;
mod state;
mod stream;

/// Rows a hidden-state frame may carry unless configured otherwise
/// (advertised in the handshake's `Limits.max_frame_rows`).
pub const DEFAULT_MAX_FRAME_ROWS: u32 = 2048;

/// Rows of a prefill fragment computed in one uninterrupted step; between
/// steps the shard checks the deadline, the stream and its own shutdown.
pub const PREFILL_STEP_ROWS: usize = 64;

/// How long `shutdown` waits for the calls to end before it returns anyway.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// How a shard is sized and where it listens.
#[derive(Clone, Debug)]
pub struct ShardConfig {
    /// Layers `[start, end)` of the model this shard runs.
    pub layers: Range<usize>,
    /// IP:PORT to listen on (port 0: any free port).
    pub listen: String,
    /// KV memory for the shard's layers, in bytes.
    pub kv_bytes: u64,
    /// Compute threads for the forward pass.
    pub threads: usize,
    pub max_frame_bytes: u32,
    pub credit_window: u32,
    pub max_sessions: u32,
    /// Rows one hidden-state frame may carry (0: [`DEFAULT_MAX_FRAME_ROWS`]).
    pub max_frame_rows: u32,
    /// Session streams open at once (each has a thread); more are refused
    /// with RESOURCE_EXHAUSTED. A coordinator opens one per worker.
    pub max_streams: usize,
    pub encodings: Vec<Encoding>,
    /// Where the KV page pool and its log live so that sessions' pages
    /// outlive the process (`None`: in memory only).
    pub state_dir: Option<PathBuf>,
    /// The device the layers run on (`None`: the CPU).
    pub gpu: Option<Arc<GpuDevice>>,
}

impl ShardConfig {
    /// Defaults for a layer range and listen address.
    pub fn new(layers: Range<usize>, listen: impl Into<String>) -> Self {
        ShardConfig {
            layers,
            listen: listen.into(),
            kv_bytes: 256 << 20,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_frame_bytes: 64 << 20,
            credit_window: 16,
            max_sessions: 1024,
            max_frame_rows: DEFAULT_MAX_FRAME_ROWS,
            max_streams: 256,
            encodings: vec![Encoding::F32, Encoding::F16, Encoding::Q8_0],
            state_dir: None,
            gpu: None,
        }
    }
}

/// Why a shard could not start.
#[derive(Debug, thiserror::Error)]
pub enum ShardStartError {
    #[error("layers {start}..{end} are not a non-empty range inside the model's {n_layers}")]
    Layers {
        start: usize,
        end: usize,
        n_layers: usize,
    },
    #[error("KV pool: {0}")]
    Kv(#[from] KvError),
    #[error(transparent)]
    StateDir(#[from] KeptError),
    #[error("cannot listen on {addr}: {message}")]
    Listen { addr: String, message: String },
    #[error("the GPU: {0}")]
    Gpu(#[from] GpuError),
    #[error(
        "a state directory keeps a shard's pages in a file on the host; with the layers on a \
         GPU the pages are on the device: run the shard without --state-dir"
    )]
    StateDirOnDevice,
}

/// What the shard computes with; one frame at a time holds it.
struct Core {
    model: Arc<Model>,
    layers: Range<usize>,
    kv_pool: Arc<KvPool>,
    sessions: HashMap<SessionKey, SessionKv>,
    pool: ThreadPool,
    scratch: Scratch,
    max_sessions: usize,
    /// With a state directory: the sessions' page chains and the detached
    /// sessions.
    keeper: Option<Keeper>,
    /// The layers on a GPU (`None`: on the CPU, through `Model::forward_layers`).
    gpu: Option<GpuForward>,
}

/// State every handler shares.
struct ShardState {
    core: Mutex<Core>,
    fingerprint: Fingerprint,
    epoch: u64,
    limits: pb::Limits,
    /// Agreements by coordinator epoch; a newer coordinator's handshake
    /// drops its predecessors' sessions.
    agreed: Mutex<HashMap<u64, Agreed>>,
    /// Sessions named by cancel frames so far.
    cancelled: std::sync::atomic::AtomicU64,
    /// Session streams open now, and the most allowed.
    streams: std::sync::atomic::AtomicUsize,
    max_streams: usize,
    /// The model's context: no frame may name a position at or past it.
    context: u64,
    /// Set by `shutdown`: computations stop at their next step.
    stopping: AtomicBool,
    /// KV pages of the pool, and positions per page.
    kv_pages: u64,
    page_positions: u32,
    /// Whether the shard keeps pages by their chains (has a state dir).
    keeps_pages: bool,
    /// Where the layers run: `cpu` or `gpu`.
    backend: &'static str,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A running shard; dropping it stops the server.
pub struct ShardServer {
    server: grpcio::Server,
    addr: std::net::SocketAddr,
    shared: Arc<ShardState>,
}

pub(crate) fn random_epoch() -> u64 {
    let mut bytes = [0u8; 8];
    // An epoch only has to differ between starts; the clock is the fallback.
    if getrandom::getrandom(&mut bytes).is_err() {
        return unix_nanos(SystemTime::now()) | 1;
    }
    u64::from_le_bytes(bytes) | 1
}

impl ShardServer {
    /// Maps nothing new (the model is loaded), builds the KV pool for the
    /// layer range, and starts serving.
    pub fn start(
        model: Arc<Model>,
        fingerprint: Fingerprint,
        cfg: &ShardConfig,
    ) -> Result<ShardServer, ShardStartError> {
        let shared = Arc::new(ShardState::new(model, fingerprint, cfg)?);
        let env = Arc::new(Environment::new(1));
        let handshake_shared = Arc::clone(&shared);
        let session_shared = Arc::clone(&shared);
        let service = ServiceBuilder::new()
            .add_unary_handler(
                &HANDSHAKE_RAW,
                move |ctx: RpcContext<'_>, req: Vec<u8>, sink: UnarySink<Vec<u8>>| {
                    handshake::answer(&handshake_shared, ctx, &req, sink)
                },
            )
            .add_duplex_streaming_handler(
                &SESSION_RAW,
                move |ctx: RpcContext<'_>,
                      stream: RequestStream<Vec<u8>>,
                      sink: DuplexSink<Vec<u8>>| {
                    stream::open_stream(&session_shared, &ctx, stream, sink)
                },
            )
            .build();
        let (server, addr) =
            super::transport::start_server(env, cfg.max_frame_bytes, service, &cfg.listen)
                .map_err(|message| ShardStartError::Listen {
                    addr: cfg.listen.clone(),
                    message,
                })?;
        tracing::info!(
            %addr,
            layers = ?cfg.layers,
            epoch = format_args!("{:#018x}", shared.epoch),
            "shard serving"
        );
        Ok(ShardServer {
            server,
            addr,
            shared,
        })
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// This start's epoch.
    pub fn epoch(&self) -> u64 {
        self.shared.epoch
    }

    /// Sessions held now.
    pub fn sessions(&self) -> usize {
        lock(&self.shared.core).sessions.len()
    }

    /// Sessions kept for no coordinator (with a state dir), and the
    /// positions they hold.
    pub fn detached(&self) -> (usize, usize) {
        let core = lock(&self.shared.core);
        core.keeper
            .as_ref()
            .map_or((0, 0), |k| (k.detached(), k.detached_positions()))
    }

    /// Sessions named by cancel frames so far.
    pub fn cancelled_sessions(&self) -> u64 {
        self.shared
            .cancelled
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops accepting, cancels open streams and stops computations at
    /// their next step; waits for the calls and their stream threads to
    /// end for at most a few seconds. When they have, the state directory
    /// is unlocked on return, so a shard started next on it opens it.
    pub fn shutdown(mut self) {
        let deadline = Instant::now() + SHUTDOWN_WAIT;
        self.shared.stopping.store(true, Ordering::Release);
        let done = self.server.shutdown();
        self.server.cancel_all_calls();
        let (tx, rx) = sync_channel(1);
        let waiter = std::thread::Builder::new()
            .name("inferd-shard-stop".into())
            .spawn(move || {
                let _ = block_on(done);
                let _ = tx.send(());
            });
        if waiter.is_ok() && rx.recv_timeout(SHUTDOWN_WAIT).is_err() {
            tracing::warn!(
                seconds = SHUTDOWN_WAIT.as_secs(),
                "calls still open at shutdown; stopping anyway"
            );
        }
        // A call ends before its stream thread does: the thread still
        // answers what it read and holds the shared state. Its end is what
        // makes the keeper's log final.
        while self.shared.streams.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        if self.shared.streams.load(Ordering::Acquire) > 0 {
            tracing::warn!("stream threads still running at shutdown; the state directory stays locked until they end");
            return;
        }
        // Readers and finished threads may still hold the shared state for
        // a moment; the lock goes with the keeper, now.
        drop(lock(&self.shared.core).keeper.take());
    }
}
