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

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime};

use futures_executor::block_on;
use futures_util::{Sink, SinkExt, StreamExt};
use grpcio::{
    DuplexSink, Environment, RequestStream, RpcContext, RpcStatus, RpcStatusCode, ServerBuilder,
    ServerCredentials, ServiceBuilder, UnarySink, WriteFlags,
};
use protobuf::Message;

use super::fingerprint::Fingerprint;
use super::frame::{
    unix_nanos, Epochs, ErrorKind, FrameCheck, FrameError, FrameKind, Inbound, OutboundFrames, Run,
    WireSessionId,
};
use super::handshake::{agree, limits_to_wire, Agreed};
use super::keeper::{self, Keeper, SessionKey};
use super::kept::{Identity, KeptError, StateDir};
use super::payload::{decode_rows, encode_rows, Encoding};
use super::raw::{HANDSHAKE_RAW, SESSION_RAW};
use crate::kv::{KvBacking, KvError, KvPool, KvPoolConfig, SessionKv, DEFAULT_PAGE_POSITIONS};
use crate::model::{LayerFeed, Model, Scratch};
use crate::proto::inferd_shard_v1::shard_runtime as pb;
use crate::threads::ThreadPool;

/// Rows a hidden-state frame may carry unless configured otherwise
/// (advertised in the handshake's `Limits.max_frame_rows`).
pub const DEFAULT_MAX_FRAME_ROWS: u32 = 2048;

/// Rows of a prefill fragment computed in one uninterrupted step; between
/// steps the shard checks the deadline, the stream and its own shutdown.
pub const PREFILL_STEP_ROWS: usize = 64;

/// Frames (beyond the credit window) a stream's reader may queue ahead of
/// its compute: refusals and control frames. A full queue stops the reader,
/// and HTTP/2 flow control then stops the peer.
const QUEUE_SLACK: usize = 64;

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
}

/// One open session stream, counted in `ShardState::streams` while it lives.
struct StreamSlot(Arc<ShardState>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0
            .streams
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
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

impl ShardState {
    /// The layer range's KV pool, sized from `cfg.kv_bytes`, and the
    /// limits the handshake offers.
    fn new(
        model: Arc<Model>,
        fingerprint: Fingerprint,
        cfg: &ShardConfig,
    ) -> Result<ShardState, ShardStartError> {
        let n_layers = model.config.n_layers;
        if cfg.layers.start >= cfg.layers.end || cfg.layers.end > n_layers {
            return Err(ShardStartError::Layers {
                start: cfg.layers.start,
                end: cfg.layers.end,
                n_layers,
            });
        }
        let context = model.config.context as u64;
        let layout = model.kv_layout(cfg.layers.len(), DEFAULT_PAGE_POSITIONS);
        let n_pages = KvPool::pages_for_bytes(&layout, cfg.kv_bytes).max(layout.n_layers);
        let identity = Identity {
            gguf_sha256: fingerprint.gguf_sha256,
            layer_begin: cfg.layers.start as u32,
            layer_end: cfg.layers.end as u32,
            page_positions: layout.page_positions as u32,
            kv_dim: layout.kv_dim as u32,
        };
        let state = match &cfg.state_dir {
            Some(dir) => Some(StateDir::open(dir, identity)?),
            None => None,
        };
        let backing = match &state {
            Some((dir, _)) => KvBacking::Kept(dir.page_file()),
            None => KvBacking::Anonymous,
        };
        let mut kv_pool = KvPool::new(KvPoolConfig {
            layout,
            n_pages,
            backing,
            prefault: false,
        })?
        .with_layer_windows(model.kv_layer_windows(cfg.layers.clone()))?;
        let verified = match state {
            Some((dir, opened)) => {
                // A window layer keeps a page of slack, so that a session
                // cut back to a page boundary still has what it reads.
                kv_pool = kv_pool.with_window_slack(layout.page_positions);
                let verified = keeper::verify(&identity, opened, &mut kv_pool)?;
                Some((dir, verified))
            }
            None => None,
        };
        let kv_pool = Arc::new(kv_pool);
        let keeper = verified.map(|(dir, verified)| {
            let report = &verified.report;
            if let Some(why) = &report.refused {
                tracing::warn!(reason = %why, "the state directory's page log is not this shard's: starting without kept pages");
            }
            if let Some(offset) = report.damaged_at {
                tracing::warn!(offset, "the page log is damaged there: what follows is not used");
            }
            tracing::info!(
                sessions = report.sessions,
                positions = report.taken.positions,
                pages_rejected = report.taken.rejected,
                "pages kept from the state directory"
            );
            Keeper::new(dir, verified, &kv_pool)
        });
        let keeps_pages = keeper.is_some();
        // Told to the coordinator in pages of positions over all the
        // shard's layers (a pool page holds one layer), as its ledger counts.
        let kv_pages = (kv_pool.total_pages() / cfg.layers.len().max(1)) as u64;
        let page_positions = kv_pool.layout().page_positions as u32;
        Ok(ShardState {
            core: Mutex::new(Core {
                model,
                layers: cfg.layers.clone(),
                kv_pool,
                sessions: HashMap::new(),
                pool: ThreadPool::new(cfg.threads.max(1)),
                scratch: Scratch::default(),
                max_sessions: cfg.max_sessions as usize,
                keeper,
            }),
            fingerprint,
            epoch: random_epoch(),
            limits: {
                let mut limits = limits_to_wire(
                    cfg.max_frame_bytes,
                    cfg.credit_window,
                    cfg.max_sessions,
                    &cfg.encodings,
                );
                limits.set_max_frame_rows(match cfg.max_frame_rows {
                    0 => DEFAULT_MAX_FRAME_ROWS,
                    n => n,
                });
                limits
            },
            agreed: Mutex::new(HashMap::new()),
            cancelled: std::sync::atomic::AtomicU64::new(0),
            streams: std::sync::atomic::AtomicUsize::new(0),
            max_streams: cfg.max_streams.max(1),
            context,
            stopping: AtomicBool::new(false),
            kv_pages,
            page_positions,
            keeps_pages,
        })
    }
}

/// A Session stream arrived: refused when the shard already serves its
/// most streams, otherwise served on a thread of its own (compute blocks;
/// the completion queue must not).
fn open_stream(
    shared: &Arc<ShardState>,
    ctx: &RpcContext<'_>,
    stream: RequestStream<Vec<u8>>,
    sink: DuplexSink<Vec<u8>>,
) {
    use std::sync::atomic::Ordering::AcqRel;
    let open = shared.streams.fetch_add(1, AcqRel);
    if open >= shared.max_streams {
        shared.streams.fetch_sub(1, AcqRel);
        let message = format!(
            "the shard serves at most {} streams at once",
            shared.max_streams
        );
        return refuse_stream(ctx, stream, sink, message);
    }
    // The sink is handed over only once the thread exists.
    let (hand, take) = sync_channel(1);
    let thread_shared = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("inferd-shard-stream".into())
        .spawn(move || {
            // Frees the slot however the thread ends.
            let _slot = StreamSlot(Arc::clone(&thread_shared));
            if let Ok((stream, sink)) = take.recv() {
                serve_stream(thread_shared, stream, sink);
            }
        });
    match spawned {
        Ok(_) => {
            let _ = hand.send((stream, sink));
        }
        Err(e) => {
            shared.streams.fetch_sub(1, AcqRel);
            let message = format!("cannot start a stream thread: {e}");
            refuse_stream(ctx, stream, sink, message);
        }
    }
}

/// Ends a Session stream with RESOURCE_EXHAUSTED and why. The request
/// stream lives until the status is sent: dropping it first would cancel
/// the call, and the coordinator would read CANCELLED instead of why.
fn refuse_stream(
    ctx: &RpcContext<'_>,
    stream: RequestStream<Vec<u8>>,
    sink: DuplexSink<Vec<u8>>,
    message: String,
) {
    tracing::warn!(%message, "session stream refused");
    let status = RpcStatus::with_message(RpcStatusCode::RESOURCE_EXHAUSTED, message);
    ctx.spawn(async move {
        let _ = sink.fail(status).await;
        drop(stream);
    });
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
                    handshake(&handshake_shared, ctx, &req, sink)
                },
            )
            .add_duplex_streaming_handler(
                &SESSION_RAW,
                move |ctx: RpcContext<'_>,
                      stream: RequestStream<Vec<u8>>,
                      sink: DuplexSink<Vec<u8>>| {
                    open_stream(&session_shared, &ctx, stream, sink)
                },
            )
            .build();
        let args = super::transport::server(Arc::clone(&env), cfg.max_frame_bytes).build_args();
        let listen_error = |message: String| ShardStartError::Listen {
            addr: cfg.listen.clone(),
            message,
        };
        let mut server = ServerBuilder::new(env)
            .channel_args(args)
            .register_service(service)
            .build()
            .map_err(|e| listen_error(e.to_string()))?;
        let port = server
            .add_listening_port(&cfg.listen, ServerCredentials::insecure())
            .map_err(|e| listen_error(e.to_string()))?;
        server.start();
        let addr = crate::listen::bound_address(&cfg.listen, port).map_err(listen_error)?;
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
    /// their next step; waits for the calls to end for at most a few
    /// seconds.
    pub fn shutdown(mut self) {
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
    }
}

/// Answers a `Handshake` whose body is read here, so that a body that does
/// not parse is the caller's error (INVALID_ARGUMENT), not grpcio's
/// INTERNAL.
fn handshake(shared: &ShardState, ctx: RpcContext<'_>, body: &[u8], sink: UnarySink<Vec<u8>>) {
    let fail = |ctx: RpcContext<'_>, sink: UnarySink<Vec<u8>>, code, message: String| {
        tracing::warn!(%message, "handshake refused");
        let status = RpcStatus::with_message(code, message);
        ctx.spawn(async move {
            let _ = sink.fail(status).await;
        });
    };
    let req = match pb::HandshakeRequest::parse_from_bytes(body) {
        Ok(req) => req,
        Err(e) => {
            return fail(
                ctx,
                sink,
                RpcStatusCode::INVALID_ARGUMENT,
                format!(
                    "the request ({} bytes) is not a HandshakeRequest: {e}",
                    body.len()
                ),
            )
        }
    };
    let result = agree(&req, &shared.fingerprint, &shared.limits, shared.epoch);
    match result {
        Ok(agreed) => {
            let mut response = pb::HandshakeResponse::new();
            response.set_protocol_version(super::handshake::PROTOCOL_VERSION);
            response.set_served(shared.fingerprint.to_wire());
            response.set_shard_epoch(shared.epoch);
            // Read without the core's lock, which a computation holds.
            response.set_kv_pages(shared.kv_pages);
            response.set_page_positions(shared.page_positions);
            response.set_keeps_pages(shared.keeps_pages);
            let mut limits = limits_to_wire(
                agreed.max_frame_bytes,
                agreed.credit_window,
                agreed.max_sessions,
                &agreed.encodings,
            );
            limits.set_max_frame_rows(agreed.max_frame_rows);
            response.set_limits(limits);
            let bytes = match response.write_to_bytes() {
                Ok(bytes) => bytes,
                Err(e) => {
                    return fail(
                        ctx,
                        sink,
                        RpcStatusCode::INTERNAL,
                        format!("serializing the handshake response: {e}"),
                    )
                }
            };
            let coordinator = agreed.epochs.coordinator;
            {
                let mut all = lock(&shared.agreed);
                // A new coordinator epoch means its predecessors restarted.
                let stale: Vec<u64> = all.keys().copied().filter(|&e| e != coordinator).collect();
                for epoch in &stale {
                    all.remove(epoch);
                }
                all.insert(coordinator, agreed);
                if !stale.is_empty() {
                    let mut core = lock(&shared.core);
                    let core = &mut *core;
                    let gone: Vec<SessionKey> = core
                        .sessions
                        .keys()
                        .filter(|(epoch, _)| *epoch != coordinator)
                        .copied()
                        .collect();
                    for key in gone {
                        let Some(kv) = core.sessions.remove(&key) else {
                            continue;
                        };
                        // Kept for the new coordinator to resume, with a
                        // state dir; freed (dropped) otherwise.
                        if let Some(keeper) = core.keeper.as_mut() {
                            keeper.detach(key, kv);
                        }
                    }
                }
            }
            tracing::info!(
                coordinator = format_args!("{coordinator:#018x}"),
                "handshake agreed"
            );
            ctx.spawn(async move {
                let _ = sink.success(bytes).await;
            });
        }
        Err(e) => fail(ctx, sink, RpcStatusCode::FAILED_PRECONDITION, e.to_string()),
    }
}

/// The handshake a stream's first frame names. A frame too large or that
/// does not parse is refused as such (`TooLarge`, `Malformed`); one naming
/// no live handshake is stale, with the coordinator epoch it claimed.
fn bind(shared: &ShardState, bytes: &[u8]) -> Result<Agreed, (FrameError, u64)> {
    let unbound = |kind, message: String| FrameError {
        kind,
        message,
        sessions: Vec::new(),
        sequence: None,
    };
    let max = shared.limits.get_max_frame_bytes() as usize;
    if bytes.len() > max {
        let message = format!("frame of {} bytes, limit {max}", bytes.len());
        return Err((unbound(ErrorKind::TooLarge, message), 0));
    }
    let frame = pb::Frame::parse_from_bytes(bytes).map_err(|e| {
        let message = format!("the stream's first frame is not a Frame: {e}");
        (unbound(ErrorKind::Malformed, message), 0)
    })?;
    if !frame.has_header() {
        let message = "the stream's first frame has no header".to_owned();
        return Err((unbound(ErrorKind::Malformed, message), 0));
    }
    let coordinator = frame.get_header().get_coordinator_epoch();
    lock(&shared.agreed)
        .get(&coordinator)
        .cloned()
        .ok_or_else(|| {
            let message = "no handshake with this coordinator epoch on this shard epoch".to_owned();
            (unbound(ErrorKind::StaleEpoch, message), coordinator)
        })
}

fn error_frame(error: &FrameError) -> pb::Frame {
    let mut frame = pb::Frame::new();
    frame.set_error(error.to_wire());
    frame
}

fn credit_frame(frames: u32) -> pb::Frame {
    let mut credit = pb::Credit::new();
    credit.set_frames(frames);
    let mut frame = pb::Frame::new();
    frame.set_credit(credit);
    frame
}

/// Sends frames to the coordinator; false once the stream is gone.
struct Replies {
    sink: DuplexSink<Vec<u8>>,
    outbound: OutboundFrames,
    /// A send failed: the call is over, and grpcio's sink must not be
    /// polled again (it panics on a finished call).
    gone: bool,
}

impl Replies {
    fn new(sink: DuplexSink<Vec<u8>>, epochs: Epochs) -> Replies {
        Replies {
            sink,
            outbound: OutboundFrames::new(epochs),
            gone: false,
        }
    }

    fn send(&mut self, frame: pb::Frame, encoding: Option<Encoding>) -> bool {
        if self.gone {
            return false;
        }
        let Ok(bytes) = self.outbound.seal(frame, encoding, 0) else {
            return false;
        };
        let sent = block_on(self.sink.send((bytes, WriteFlags::default()))).is_ok();
        self.gone = !sent;
        sent
    }

    /// Whether the call is over on the coordinator's side (cancelled,
    /// broken, past its deadline); never waits.
    fn call_gone(&mut self) -> bool {
        if !self.gone {
            let mut cx = Context::from_waker(Waker::noop());
            // `poll_ready` looks at the call's completion first and reports
            // a finished call as an error; after that the sink is left alone.
            if let Poll::Ready(Err(_)) = Pin::new(&mut self.sink).poll_ready(&mut cx) {
                self.gone = true;
            }
        }
        self.gone
    }

    /// Ends the call cleanly after the frames sent so far (dropping the
    /// sink instead would cancel the call and could lose them).
    fn end(mut self) {
        if self.gone {
            return;
        }
        let _ = block_on(self.sink.close());
    }
}

/// What a stream's reader hands its compute thread, in arrival order.
enum Inbox {
    /// The stream's first valid frame named this handshake.
    Bound(Agreed),
    /// A frame that passed every check.
    Frame(Box<FrameCheck>),
    /// A frame the checks refused; `claimed` is the coordinator epoch to
    /// name in the answer while the stream is bound to no handshake.
    Refused { error: FrameError, claimed: u64 },
    /// No more frames. `lost`: the call was cancelled or broke (nothing can
    /// be answered); otherwise the coordinator half-closed, or `retired`
    /// says why the shard ends the stream, and the frames before are
    /// answered first. The request stream rides along so that it lives
    /// until the call's status is sent.
    End {
        stream: RequestStream<Vec<u8>>,
        lost: bool,
        retired: Option<FrameError>,
    },
}

/// What both threads of a stream share.
#[derive(Default)]
struct StreamState {
    /// The call was cancelled or broke: computing for it stops.
    lost: AtomicBool,
    /// Credits the compute thread granted that the reader has not yet
    /// added to its checks.
    granted: AtomicU32,
}

/// The reader: takes frames off the wire as they arrive and checks them,
/// until the call ends or the compute thread is gone.
fn read_frames(
    shared: &ShardState,
    state: &StreamState,
    mut stream: RequestStream<Vec<u8>>,
    inbox: &SyncSender<Inbox>,
) {
    let mut bound: Option<(Inbound, u64)> = None;
    loop {
        let bytes = match block_on(stream.next()) {
            Some(Ok(bytes)) => bytes,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "session stream lost");
                state.lost.store(true, Ordering::Release);
                let end = Inbox::End {
                    stream,
                    lost: true,
                    retired: None,
                };
                let _ = inbox.send(end);
                return;
            }
            None => {
                let end = Inbox::End {
                    stream,
                    lost: false,
                    retired: None,
                };
                let _ = inbox.send(end);
                return;
            }
        };
        if bound.is_none() {
            match bind(shared, &bytes) {
                Ok(agreed) => {
                    let checker = Inbound::to_shard(
                        agreed.epochs,
                        agreed.max_frame_bytes as usize,
                        agreed.fingerprint.hidden_size as usize,
                        agreed.encodings.clone(),
                        agreed.credit_window,
                    )
                    .with_row_bounds(agreed.max_frame_rows as usize, shared.context);
                    bound = Some((checker, agreed.epochs.coordinator));
                    if inbox.send(Inbox::Bound(agreed)).is_err() {
                        return;
                    }
                }
                Err((error, claimed)) => {
                    if inbox.send(Inbox::Refused { error, claimed }).is_err() {
                        return;
                    }
                    continue;
                }
            }
        }
        let Some((checker, coordinator)) = bound.as_mut() else {
            continue;
        };
        // A handshake by a newer coordinator retires this stream's epoch.
        if !lock(&shared.agreed).contains_key(coordinator) {
            let error = FrameError {
                kind: ErrorKind::StaleEpoch,
                message: "a newer coordinator has taken over this shard".into(),
                sessions: Vec::new(),
                sequence: None,
            };
            let end = Inbox::End {
                stream,
                lost: false,
                retired: Some(error),
            };
            let _ = inbox.send(end);
            return;
        }
        checker.grant(state.granted.swap(0, Ordering::AcqRel));
        let item = match checker.check(&bytes, SystemTime::now()) {
            Ok(checked) => Inbox::Frame(Box::new(checked)),
            Err(error) => {
                tracing::debug!(%error, "frame refused");
                Inbox::Refused {
                    error,
                    claimed: *coordinator,
                }
            }
        };
        if inbox.send(item).is_err() {
            return;
        }
    }
}

/// Serves one Session stream until the coordinator closes it, the call
/// breaks, or the shard stops: a reader thread checks frames as they
/// arrive, this thread answers them in order.
fn serve_stream(
    shared: Arc<ShardState>,
    stream: RequestStream<Vec<u8>>,
    sink: DuplexSink<Vec<u8>>,
) {
    let state = Arc::new(StreamState::default());
    let capacity = shared.limits.get_credit_window() as usize + QUEUE_SLACK;
    let (inbox, items) = sync_channel(capacity);
    let (reader_shared, reader_state) = (Arc::clone(&shared), Arc::clone(&state));
    let spawned = std::thread::Builder::new()
        .name("inferd-shard-read".into())
        .spawn(move || read_frames(&reader_shared, &reader_state, stream, &inbox));
    if let Err(e) = spawned {
        // The stream went with the closure; the call is cancelled.
        tracing::warn!(error = %e, "cannot start a stream reader");
        return;
    }
    let mut replies = Replies::new(
        sink,
        Epochs {
            shard: shared.epoch,
            coordinator: 0,
        },
    );
    let mut agreed: Option<Agreed> = None;
    while let Ok(item) = items.recv() {
        match item {
            Inbox::Bound(a) => {
                replies.outbound.set_epochs(a.epochs);
                agreed = Some(a);
            }
            Inbox::Refused { error, claimed } => {
                if agreed.is_none() {
                    replies.outbound.set_epochs(Epochs {
                        shard: shared.epoch,
                        coordinator: claimed,
                    });
                }
                if !replies.send(error_frame(&error), None) {
                    return;
                }
            }
            Inbox::Frame(checked) => {
                let Some(agreed) = agreed.as_ref() else {
                    continue;
                };
                let hidden = checked.kind.carries_hidden();
                let answered = answer(&shared, agreed, *checked, &mut replies, &state);
                if answered == Answered::Gone {
                    return;
                }
                if hidden {
                    // The frame's credit is back for the reader's checks; the
                    // coordinator's link takes a refusal as its credit, so a
                    // credit frame goes only with an answer it computed.
                    state.granted.fetch_add(1, Ordering::AcqRel);
                    if answered == Answered::Computed && !replies.send(credit_frame(1), None) {
                        return;
                    }
                }
            }
            Inbox::End {
                stream,
                lost,
                retired,
            } => {
                if lost {
                    return;
                }
                // The error frame says why; the call then ends cleanly (a
                // failing status could overtake the frame at the client).
                if let Some(error) = retired {
                    let _ = replies.send(error_frame(&error), None);
                }
                replies.end();
                drop(stream);
                return;
            }
        }
    }
}

/// How a checked frame was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answered {
    /// Acted on, or computed for every session it carried.
    Computed,
    /// Refused, in whole or for some of its sessions: an error frame says
    /// why (and stands for the frame's credit at the coordinator).
    Refused,
    /// The stream is gone.
    Gone,
}

impl Answered {
    fn from_sent(sent: bool, refused: bool) -> Answered {
        match (sent, refused) {
            (false, _) => Answered::Gone,
            (true, true) => Answered::Refused,
            (true, false) => Answered::Computed,
        }
    }
}

/// Acts on a checked frame.
fn answer(
    shared: &ShardState,
    agreed: &Agreed,
    checked: FrameCheck,
    replies: &mut Replies,
    state: &StreamState,
) -> Answered {
    let coordinator = agreed.epochs.coordinator;
    let hidden_size = agreed.fingerprint.hidden_size as usize;
    match checked.kind {
        FrameKind::Release => {
            let mut core = lock(&shared.core);
            for id in &checked.sessions {
                if let Some(mut kv) = core.sessions.remove(&(coordinator, *id)) {
                    let _ = kv.release();
                }
                if let Some(keeper) = core.keeper.as_mut() {
                    keeper.forget((coordinator, *id));
                }
            }
            Answered::Computed
        }
        FrameKind::Resume => answer_resume(shared, coordinator, &checked, replies),
        FrameKind::Cancel => {
            // Frames are answered in order, so nothing of these sessions
            // sent before the cancel is still waiting: counting the cancel
            // is all there is to do.
            shared.cancelled.fetch_add(
                checked.sessions.len() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            Answered::Computed
        }
        FrameKind::Prefill | FrameKind::Decode => {
            answer_hidden(shared, coordinator, hidden_size, &checked, replies, state)
        }
        // Checked frames of the other kinds cannot travel to a shard.
        FrameKind::Output | FrameKind::Credit | FrameKind::Error | FrameKind::Resumed => {
            Answered::Computed
        }
    }
}

/// A hidden-state frame (prefill or decode): decoded, computed through the
/// shard's layers (stopping between steps when the shard stops, the
/// stream ends or the deadline passes), answered with the output rows and
/// an error frame per refused session.
fn answer_hidden(
    shared: &ShardState,
    coordinator: u64,
    hidden_size: usize,
    checked: &FrameCheck,
    replies: &mut Replies,
    state: &StreamState,
) -> Answered {
    let frame = &checked.frame;
    let body = if checked.kind == FrameKind::Prefill {
        frame.get_prefill()
    } else {
        frame.get_decode()
    };
    let Some(encoding) = checked.encoding else {
        return Answered::Computed;
    };
    // The frame may have waited in the queue: its deadline again.
    let deadline = frame.get_header().get_deadline_unix_nanos();
    if let Some(late) = past_deadline(deadline) {
        let message = format!("{late}, before the frame was computed");
        return refuse_frame(replies, checked, ErrorKind::Deadline, message);
    }
    let values = match decode_rows(encoding, hidden_size, checked.rows, frame.get_payload()) {
        Ok(v) => v,
        Err(e) => return refuse_frame(replies, checked, ErrorKind::Malformed, e.to_string()),
    };
    let runs: Vec<Run> = body
        .get_runs()
        .iter()
        .zip(&checked.sessions)
        .map(|(r, id)| Run {
            session: *id,
            position: r.get_position(),
            rows: r.get_count(),
        })
        .collect();
    // The page chains a coordinator sends along: exactly one per page a
    // run fills, or none.
    let page = u64::from(shared.page_positions.max(1));
    let mut chains: HashMap<WireSessionId, &[u64]> = HashMap::new();
    for (r, run) in body.get_runs().iter().zip(&runs) {
        let sent = r.get_page_chains();
        let filled = (run.position + u64::from(run.rows)) / page - run.position / page;
        if !sent.is_empty() && sent.len() as u64 != filled {
            let message = format!(
                "a run of positions {}..{} fills {filled} pages and names {} page chains",
                run.position,
                run.position + u64::from(run.rows),
                sent.len()
            );
            return refuse_frame(replies, checked, ErrorKind::Malformed, message);
        }
        chains.insert(run.session, sent);
    }
    let chained = Chained {
        chains: &chains,
        encoding,
    };
    // Checked before every step of the computation.
    let mut interrupt = || {
        if shared.stopping.load(Ordering::Acquire) {
            return Some((ErrorKind::Internal, "the shard is shutting down".to_owned()));
        }
        if state.lost.load(Ordering::Acquire) || replies.call_gone() {
            return Some((ErrorKind::Internal, "the stream ended".to_owned()));
        }
        past_deadline(deadline).map(|late| (ErrorKind::Deadline, late))
    };
    let outcome = lock(&shared.core).compute(
        coordinator,
        &runs,
        &chained,
        values,
        hidden_size,
        &mut interrupt,
    );
    let mut alive = true;
    let refused = !outcome.failed.is_empty();
    if refused {
        for (kind, message, sessions) in outcome.failed {
            let error = FrameError {
                kind,
                message,
                sessions,
                sequence: Some(checked.sequence),
            };
            alive &= replies.send(error_frame(&error), None);
        }
    }
    if !outcome.runs.is_empty() {
        let mut output = super::frame::hidden_body(&outcome.runs);
        output.set_answers_sequence(checked.sequence);
        let mut reply = pb::Frame::new();
        reply.set_output(output);
        match encode_rows(encoding, hidden_size, &outcome.values) {
            Ok(payload) => reply.set_payload(payload),
            Err(_) => return Answered::Gone,
        }
        alive &= replies.send(reply, Some(encoding));
    }
    Answered::from_sent(alive, refused)
}

/// A Resume: the session cut back to what matches the coordinator's
/// history, answered with a Resumed frame saying how much that is.
fn answer_resume(
    shared: &ShardState,
    coordinator: u64,
    checked: &FrameCheck,
    replies: &mut Replies,
) -> Answered {
    let resume = checked.frame.get_resume();
    let Some(&id) = checked.sessions.first() else {
        return Answered::Computed;
    };
    let length = resume.get_length();
    if length > shared.context {
        let message = format!(
            "a Resume of {length} positions, past the model's context of {}",
            shared.context
        );
        return refuse_frame(replies, checked, ErrorKind::TooLarge, message);
    }
    let page = u64::from(shared.page_positions.max(1));
    let chains = resume.get_page_chains();
    if chains.len() as u64 != length / page {
        let message = format!(
            "a Resume of {length} positions names {} page chains, not {}",
            chains.len(),
            length / page
        );
        return refuse_frame(replies, checked, ErrorKind::Malformed, message);
    }
    let encoding = match Encoding::from_wire(resume.get_encoding()) {
        Ok(encoding) => encoding,
        Err(e) => return refuse_frame(replies, checked, ErrorKind::Malformed, e.to_string()),
    };
    let kept = {
        let mut core = lock(&shared.core);
        let core = &mut *core;
        core.keeper.as_mut().map(|keeper| {
            let key = (coordinator, id);
            let held = core.sessions.remove(&key);
            let (kv, kept) = keeper.resume(key, held, chains, encoding);
            if let Some(kv) = kv {
                core.sessions.insert(key, kv);
            }
            kept
        })
    };
    let Some(kept) = kept else {
        let message = "a Resume to a shard that keeps no pages (it has no state directory)";
        return refuse_frame(replies, checked, ErrorKind::Malformed, message.into());
    };
    let mut body = pb::Resumed::new();
    body.set_session_id(id.to_vec());
    body.set_kept(kept as u64);
    body.set_answers_sequence(checked.sequence);
    let mut frame = pb::Frame::new();
    frame.set_resumed(body);
    Answered::from_sent(replies.send(frame, None), false)
}

/// Answers a whole frame with one error frame of `kind`.
fn refuse_frame(
    replies: &mut Replies,
    checked: &FrameCheck,
    kind: ErrorKind,
    message: String,
) -> Answered {
    let error = FrameError {
        kind,
        message,
        sessions: checked.sessions.clone(),
        sequence: Some(checked.sequence),
    };
    Answered::from_sent(replies.send(error_frame(&error), None), true)
}

/// How long ago `deadline` (Unix nanoseconds, 0: none) passed, if it has.
fn past_deadline(deadline: u64) -> Option<String> {
    let now = unix_nanos(SystemTime::now());
    (deadline != 0 && now > deadline)
        .then(|| format!("the deadline passed {} µs ago", (now - deadline) / 1000))
}

/// Why a computation stops before its next step, if it must.
type Interrupt<'a> = &'a mut dyn FnMut() -> Option<(ErrorKind, String)>;

/// The page chains a frame's runs carry (by session) and the encoding of
/// its hidden states: what a keeper records of the pages the runs fill.
struct Chained<'a> {
    chains: &'a HashMap<WireSessionId, &'a [u64]>,
    encoding: Encoding,
}

/// What one hidden-state frame produced: the rows computed and the sessions
/// that failed, by kind.
struct Computed {
    runs: Vec<Run>,
    values: Vec<f32>,
    failed: Vec<Refused>,
}

impl Core {
    /// Runs the shard's layers over every run whose session continues at
    /// its position (a new session starts at position 0). A prefill
    /// fragment (one run) is computed in steps of [`PREFILL_STEP_ROWS`] rows,
    /// each committed to the KV; `interrupt` is asked before every step, and
    /// when it stops the frame, the frame's sessions are released here, so
    /// no half-computed fragment stays behind.
    fn compute(
        &mut self,
        coordinator: u64,
        runs: &[Run],
        chained: &Chained<'_>,
        values: Vec<f32>,
        hidden_size: usize,
        interrupt: Interrupt<'_>,
    ) -> Computed {
        let (accepted, mut x, mut failed) = self.admit(coordinator, runs, &values, hidden_size);
        if accepted.is_empty() {
            return Computed {
                runs: accepted,
                values: Vec::new(),
                failed,
            };
        }
        let mut kvs: Vec<(SessionKey, SessionKv)> = accepted
            .iter()
            .filter_map(|run| self.sessions.remove_entry(&(coordinator, run.session)))
            .collect();
        let total_rows = x.len() / hidden_size.max(1);
        let stepped = self.forward_in_steps(&mut kvs, &accepted, &mut x, hidden_size, interrupt);
        match stepped {
            Ok(()) => {
                // A shard never rolls a session back (a stopped frame frees
                // it instead), so window pages can go as soon as a frame is in.
                for ((key, mut kv), run) in kvs.into_iter().zip(&accepted) {
                    if let Err(e) = kv.settle() {
                        tracing::error!("shard KV: giving back window pages: {e}");
                    }
                    if let Some(keeper) = self.keeper.as_mut() {
                        let chains = chained.chains.get(&run.session).copied().unwrap_or(&[]);
                        keeper.record(
                            key,
                            &kv,
                            run.position as usize,
                            run.rows as usize,
                            chains,
                            chained.encoding,
                        );
                    }
                    self.sessions.insert(key, kv);
                }
                Computed {
                    runs: accepted,
                    values: x,
                    failed,
                }
            }
            Err(Stopped { done, kind, why }) => {
                // Nothing of a stopped frame stays: its sessions' KV is
                // freed, and the coordinator rebuilds them from history.
                let ids: Vec<WireSessionId> = kvs.iter().map(|(k, _)| k.1).collect();
                for (key, mut kv) in kvs {
                    let _ = kv.release();
                    if let Some(keeper) = self.keeper.as_mut() {
                        keeper.forget(key);
                    }
                }
                failed.push((
                    kind,
                    format!(
                        "{why}: stopped after {done} of {total_rows} rows; the session's KV on \
                         this shard was released"
                    ),
                    ids,
                ));
                Computed {
                    runs: Vec::new(),
                    values: Vec::new(),
                    failed,
                }
            }
        }
    }

    /// Checks each run against what the shard holds of its session (a new
    /// session starts at position 0, within the session limit) and
    /// reserves its positions. Returns the accepted runs, their rows in
    /// order, and the refused sessions by kind.
    fn admit(
        &mut self,
        coordinator: u64,
        runs: &[Run],
        values: &[f32],
        hidden_size: usize,
    ) -> (Vec<Run>, Vec<f32>, Vec<Refused>) {
        let mut failed = Vec::new();
        let mut accepted = Vec::new();
        let mut x = Vec::with_capacity(values.len());
        let mut offset = 0usize;
        for &run in runs {
            let rows = &values[offset * hidden_size..(offset + run.rows as usize) * hidden_size];
            offset += run.rows as usize;
            match self.admit_run(coordinator, run) {
                Ok(()) => {
                    accepted.push(run);
                    x.extend_from_slice(rows);
                }
                Err((kind, why)) => failed.push((kind, why, vec![run.session])),
            }
        }
        (accepted, x, failed)
    }

    /// One run of [`Core::admit`].
    fn admit_run(&mut self, coordinator: u64, run: Run) -> Result<(), (ErrorKind, String)> {
        let Run {
            session: id,
            position,
            rows,
        } = run;
        let key = (coordinator, id);
        let held = self.sessions.get(&key).map(SessionKv::len);
        match held {
            Some(len) if len as u64 != position => {
                return Err((
                    ErrorKind::UnknownSession,
                    format!("session holds {len} positions, frame starts at {position}"),
                ))
            }
            None if position != 0 => {
                return Err((
                    ErrorKind::UnknownSession,
                    format!("no such session here (frame starts at {position})"),
                ))
            }
            None if self.sessions.len() >= self.max_sessions => {
                return Err((
                    ErrorKind::Internal,
                    format!(
                        "the shard holds its limit of {} sessions",
                        self.max_sessions
                    ),
                ))
            }
            _ => {}
        }
        let kv_pool = &self.kv_pool;
        let kv = self
            .sessions
            .entry(key)
            .or_insert_with(|| SessionKv::new(Arc::clone(kv_pool)));
        loop {
            match kv.reserve(position as usize + rows as usize) {
                Ok(()) => return Ok(()),
                // Detached sessions give their pages back before a held one
                // goes without.
                Err(KvError::Exhausted { .. })
                    if self
                        .keeper
                        .as_mut()
                        .is_some_and(|k| k.free_oldest_detached()) => {}
                Err(e) => return Err((ErrorKind::Internal, format!("KV: {e}"))),
            }
        }
    }

    /// Runs the layers over `x` (the accepted runs' rows, in order): a
    /// prefill fragment (one run) in steps of [`PREFILL_STEP_ROWS`] rows,
    /// a decode batch (one row per session) in one, committing each step
    /// to the KV. `interrupt` is asked before every step.
    fn forward_in_steps(
        &mut self,
        kvs: &mut [(SessionKey, SessionKv)],
        accepted: &[Run],
        x: &mut [f32],
        hidden_size: usize,
        interrupt: Interrupt<'_>,
    ) -> Result<(), Stopped> {
        let total_rows = x.len() / hidden_size.max(1);
        let one_fragment = accepted.len() == 1;
        let step_rows = if one_fragment {
            PREFILL_STEP_ROWS.max(1)
        } else {
            total_rows.max(1)
        };
        let mut done = 0usize;
        let stop = |done: usize, kind: ErrorKind, why: String| Stopped { done, kind, why };
        while done < total_rows {
            if let Some((kind, why)) = interrupt() {
                return Err(stop(done, kind, why));
            }
            let n = step_rows.min(total_rows - done);
            // Rows each sequence feeds in this step, and where it then ends.
            let fed = |run: &Run| if one_fragment { n } else { run.rows as usize };
            let end = |run: &Run| {
                if one_fragment {
                    done + n
                } else {
                    run.rows as usize
                }
            };
            let mut feeds: Vec<LayerFeed<'_>> = kvs
                .iter_mut()
                .zip(accepted)
                .map(|((_, kv), run)| LayerFeed { kv, rows: fed(run) })
                .collect();
            let result = self.model.forward_layers(
                self.layers.clone(),
                &mut feeds,
                &mut x[done * hidden_size..(done + n) * hidden_size],
                &self.pool,
                &mut self.scratch,
            );
            drop(feeds);
            if let Err(e) = result {
                return Err(stop(done, ErrorKind::Internal, format!("forward: {e}")));
            }
            for ((_, kv), run) in kvs.iter_mut().zip(accepted) {
                if let Err(e) = kv.commit(run.position as usize + end(run)) {
                    return Err(stop(done, ErrorKind::Internal, format!("KV: {e}")));
                }
            }
            done += n;
        }
        Ok(())
    }
}

/// Sessions a frame could not take, with why.
type Refused = (ErrorKind, String, Vec<WireSessionId>);

/// Why and where [`Core::forward_in_steps`] stopped.
struct Stopped {
    /// Rows computed and committed before the stop.
    done: usize,
    kind: ErrorKind,
    why: String,
}
