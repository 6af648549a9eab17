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

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use futures_executor::block_on;
use futures_util::{SinkExt, StreamExt};
use grpcio::{
    DuplexSink, Environment, RequestStream, RpcContext, RpcStatus, RpcStatusCode, ServerBuilder,
    ServerCredentials, ServiceBuilder, UnarySink, WriteFlags,
};
use protobuf::Message;

use super::fingerprint::Fingerprint;
use super::frame::{
    unix_nanos, Epochs, ErrorKind, FrameCheck, FrameError, FrameKind, Inbound, OutboundFrames,
    WireSessionId,
};
use super::handshake::{agree, limits_to_wire, Agreed};
use super::payload::{decode_rows, encode_rows, Encoding};
use super::raw::SESSION_RAW;
use crate::kv::{KvError, KvPool, KvPoolConfig, SessionKv, DEFAULT_PAGE_POSITIONS};
use crate::model::{LogitsWanted, Model, Scratch, Sequence};
use crate::proto::inferd_shard_v1::shard_runtime as pb;
use crate::proto::inferd_shard_v1::shard_runtime_grpc::METHOD_SHARD_RUNTIME_HANDSHAKE;
use crate::threads::ThreadPool;

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
    /// Session streams open at once (each has a thread); more are refused
    /// with RESOURCE_EXHAUSTED. A coordinator opens one per worker.
    pub max_streams: usize,
    pub encodings: Vec<Encoding>,
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
            max_streams: 256,
            encodings: vec![Encoding::F32, Encoding::F16, Encoding::Q8_0],
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
    #[error("cannot listen on {addr}: {message}")]
    Listen { addr: String, message: String },
}

/// A session's KV on this shard, keyed by the coordinator epoch that made it.
type SessionKey = (u64, WireSessionId);

/// What the shard computes with; one frame at a time holds it.
struct Core {
    model: Arc<Model>,
    layers: Range<usize>,
    kv_pool: Arc<KvPool>,
    sessions: HashMap<SessionKey, SessionKv>,
    pool: ThreadPool,
    scratch: Scratch,
    max_sessions: usize,
}

/// State every handler shares.
struct Shared {
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
}

/// One open session stream, counted in `Shared::streams` while it lives.
struct StreamSlot(Arc<Shared>);

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
    shared: Arc<Shared>,
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
        let n_layers = model.config.n_layers;
        if cfg.layers.start >= cfg.layers.end || cfg.layers.end > n_layers {
            return Err(ShardStartError::Layers {
                start: cfg.layers.start,
                end: cfg.layers.end,
                n_layers,
            });
        }
        let layout = model.kv_layout(cfg.layers.len(), DEFAULT_PAGE_POSITIONS);
        let n_pages = KvPool::pages_for_bytes(&layout, cfg.kv_bytes).max(1);
        let kv_pool = Arc::new(KvPool::new(KvPoolConfig {
            layout,
            n_pages,
            backing: crate::kv::KvBacking::Anonymous,
            prefault: false,
        })?);
        let shared = Arc::new(Shared {
            core: Mutex::new(Core {
                model,
                layers: cfg.layers.clone(),
                kv_pool,
                sessions: HashMap::new(),
                pool: ThreadPool::new(cfg.threads.max(1)),
                scratch: Scratch::default(),
                max_sessions: cfg.max_sessions as usize,
            }),
            fingerprint,
            epoch: random_epoch(),
            limits: limits_to_wire(
                cfg.max_frame_bytes,
                cfg.credit_window,
                cfg.max_sessions,
                &cfg.encodings,
            ),
            agreed: Mutex::new(HashMap::new()),
            cancelled: std::sync::atomic::AtomicU64::new(0),
            streams: std::sync::atomic::AtomicUsize::new(0),
            max_streams: cfg.max_streams.max(1),
        });
        let env = Arc::new(Environment::new(1));
        let handshake_shared = Arc::clone(&shared);
        let session_shared = Arc::clone(&shared);
        let service = ServiceBuilder::new()
            .add_unary_handler(
                &METHOD_SHARD_RUNTIME_HANDSHAKE,
                move |ctx: RpcContext<'_>,
                      req: pb::HandshakeRequest,
                      sink: UnarySink<pb::HandshakeResponse>| {
                    handshake(&handshake_shared, ctx, req, sink)
                },
            )
            .add_duplex_streaming_handler(
                &SESSION_RAW,
                move |ctx: RpcContext<'_>,
                      stream: RequestStream<Vec<u8>>,
                      sink: DuplexSink<Vec<u8>>| {
                    use std::sync::atomic::Ordering::AcqRel;
                    let shared = Arc::clone(&session_shared);
                    // The request stream lives until the status is sent:
                    // dropping it first would cancel the call, and the
                    // coordinator would read CANCELLED instead of why.
                    let refuse = |stream: RequestStream<Vec<u8>>,
                                  sink: DuplexSink<Vec<u8>>,
                                  message: String| {
                        tracing::warn!(%message, "session stream refused");
                        let status =
                            RpcStatus::with_message(RpcStatusCode::RESOURCE_EXHAUSTED, message);
                        ctx.spawn(async move {
                            let _ = sink.fail(status).await;
                            drop(stream);
                        });
                    };
                    let open = shared.streams.fetch_add(1, AcqRel);
                    if open >= shared.max_streams {
                        shared.streams.fetch_sub(1, AcqRel);
                        return refuse(
                            stream,
                            sink,
                            format!(
                                "the shard serves at most {} streams at once",
                                shared.max_streams
                            ),
                        );
                    }
                    // Compute blocks; the completion queue must not. The
                    // sink is handed over only once the thread exists.
                    let (hand, take) = std::sync::mpsc::sync_channel(1);
                    let thread_shared = Arc::clone(&shared);
                    let spawned = std::thread::Builder::new()
                        .name("inferd-shard-stream".into())
                        .spawn(move || {
                            // Frees the slot however the thread ends.
                            let _slot = StreamSlot(Arc::clone(&thread_shared));
                            if let Ok((stream, sink)) = take.recv() {
                                serve_stream(&thread_shared, stream, sink);
                            }
                        });
                    match spawned {
                        Ok(_) => {
                            let _ = hand.send((stream, sink));
                        }
                        Err(e) => {
                            shared.streams.fetch_sub(1, AcqRel);
                            refuse(stream, sink, format!("cannot start a stream thread: {e}"));
                        }
                    }
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

    /// Sessions named by cancel frames so far.
    pub fn cancelled_sessions(&self) -> u64 {
        self.shared
            .cancelled
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops accepting and cancels open streams.
    pub fn shutdown(mut self) {
        let done = self.server.shutdown();
        self.server.cancel_all_calls();
        let _ = block_on(done);
    }
}

fn handshake(
    shared: &Shared,
    ctx: RpcContext<'_>,
    req: pb::HandshakeRequest,
    sink: UnarySink<pb::HandshakeResponse>,
) {
    let result = agree(&req, &shared.fingerprint, &shared.limits, shared.epoch);
    match result {
        Ok(agreed) => {
            let mut response = pb::HandshakeResponse::new();
            response.set_protocol_version(super::handshake::PROTOCOL_VERSION);
            response.set_served(shared.fingerprint.to_wire());
            response.set_shard_epoch(shared.epoch);
            {
                let core = lock(&shared.core);
                response.set_kv_pages(core.kv_pool.total_pages() as u64);
                response.set_page_positions(core.kv_pool.layout().page_positions as u32);
            }
            response.set_limits(limits_to_wire(
                agreed.max_frame_bytes,
                agreed.credit_window,
                agreed.max_sessions,
                &agreed.encodings,
            ));
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
                    core.sessions.retain(|(epoch, _), _| *epoch == coordinator);
                }
            }
            tracing::info!(
                coordinator = format_args!("{coordinator:#018x}"),
                "handshake agreed"
            );
            ctx.spawn(async move {
                let _ = sink.success(response).await;
            });
        }
        Err(e) => {
            tracing::warn!(error = %e, "handshake refused");
            let status = RpcStatus::with_message(RpcStatusCode::FAILED_PRECONDITION, e.to_string());
            ctx.spawn(async move {
                let _ = sink.fail(status).await;
            });
        }
    }
}

/// The epochs a stream's first frame names, read without trusting it.
fn claimed_epochs(bytes: &[u8]) -> Option<Epochs> {
    let frame = pb::Frame::parse_from_bytes(bytes).ok()?;
    let header = frame.get_header();
    Some(Epochs {
        shard: header.get_shard_epoch(),
        coordinator: header.get_coordinator_epoch(),
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

    /// Ends the call cleanly after the frames sent so far (dropping the
    /// sink instead would cancel the call and could lose them).
    fn end(mut self) {
        if self.gone {
            return;
        }
        let _ = block_on(self.sink.close());
    }
}

/// Serves one Session stream until the coordinator closes it or the
/// transport fails.
fn serve_stream(shared: &Shared, mut stream: RequestStream<Vec<u8>>, sink: DuplexSink<Vec<u8>>) {
    let mut replies: Option<Replies> = None;
    let mut inbound: Option<(Inbound, Agreed)> = None;
    let mut sink = Some(sink);
    while let Some(next) = block_on(stream.next()) {
        let bytes = match next {
            Ok(bytes) => bytes,
            Err(e) => {
                tracing::warn!(error = %e, "session stream lost");
                return;
            }
        };
        if inbound.is_none() {
            // Bind the stream to the handshake its first frame names.
            let claimed = claimed_epochs(&bytes);
            let agreed = claimed.and_then(|c| lock(&shared.agreed).get(&c.coordinator).cloned());
            let epochs = agreed.as_ref().map_or(
                Epochs {
                    shard: shared.epoch,
                    coordinator: claimed.map_or(0, |c| c.coordinator),
                },
                |a| a.epochs,
            );
            if replies.is_none() {
                if let Some(sink) = sink.take() {
                    replies = Some(Replies::new(sink, epochs));
                }
            }
            match agreed {
                Some(agreed) => {
                    inbound = Some((
                        Inbound::to_shard(
                            agreed.epochs,
                            agreed.max_frame_bytes as usize,
                            agreed.fingerprint.hidden_size as usize,
                            agreed.encodings.clone(),
                            agreed.credit_window,
                        ),
                        agreed,
                    ));
                }
                None => {
                    let error = FrameError {
                        kind: ErrorKind::StaleEpoch,
                        message: "no handshake with this coordinator epoch on this shard epoch"
                            .into(),
                        sessions: Vec::new(),
                        sequence: None,
                    };
                    if let Some(r) = replies.as_mut() {
                        if !r.send(error_frame(&error), None) {
                            return;
                        }
                    }
                    continue;
                }
            }
        }
        // A handshake by a newer coordinator retires this stream's epoch.
        if let Some((_, agreed)) = inbound.as_ref() {
            if !lock(&shared.agreed).contains_key(&agreed.epochs.coordinator) {
                let error = FrameError {
                    kind: ErrorKind::StaleEpoch,
                    message: "a newer coordinator has taken over this shard".into(),
                    sessions: Vec::new(),
                    sequence: None,
                };
                // The error frame says why; the call then ends cleanly (a
                // failing status could overtake the frame at the client).
                if let Some(mut r) = replies.take() {
                    let _ = r.send(error_frame(&error), None);
                    r.end();
                }
                return;
            }
        }
        let (Some((checker, agreed)), Some(replies)) = (inbound.as_mut(), replies.as_mut()) else {
            return;
        };
        let checked = match checker.check(&bytes, SystemTime::now()) {
            Ok(checked) => checked,
            Err(error) => {
                tracing::debug!(%error, "frame refused");
                if !replies.send(error_frame(&error), None) {
                    return;
                }
                continue;
            }
        };
        let hidden = checked.kind.carries_hidden();
        let ok = answer(shared, agreed, checked, replies);
        if hidden && ok {
            checker.grant(1);
            if !replies.send(credit_frame(1), None) {
                return;
            }
        }
        if !ok {
            return;
        }
    }
    // The coordinator closed its side: close ours after what was sent.
    if let Some(r) = replies.take() {
        r.end();
    } else if let Some(mut sink) = sink.take() {
        let _ = block_on(sink.close());
    }
}

/// Acts on a checked frame; false once the stream is gone.
fn answer(shared: &Shared, agreed: &Agreed, checked: FrameCheck, replies: &mut Replies) -> bool {
    let coordinator = agreed.epochs.coordinator;
    let hidden_size = agreed.fingerprint.hidden_size as usize;
    let frame = &checked.frame;
    match checked.kind {
        FrameKind::Release => {
            let mut core = lock(&shared.core);
            for id in &checked.sessions {
                if let Some(mut kv) = core.sessions.remove(&(coordinator, *id)) {
                    let _ = kv.release();
                }
            }
            true
        }
        FrameKind::Cancel => {
            // Frames are answered in order, so nothing of these sessions is
            // queued here: counting the cancel is all there is to do.
            shared.cancelled.fetch_add(
                checked.sessions.len() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            true
        }
        FrameKind::Prefill | FrameKind::Decode => {
            let body = if checked.kind == FrameKind::Prefill {
                frame.get_prefill()
            } else {
                frame.get_decode()
            };
            let Some(encoding) = checked.encoding else {
                return true;
            };
            let values = match decode_rows(encoding, hidden_size, checked.rows, frame.get_payload())
            {
                Ok(v) => v,
                Err(e) => {
                    let error = FrameError {
                        kind: ErrorKind::Malformed,
                        message: e.to_string(),
                        sessions: checked.sessions.clone(),
                        sequence: Some(checked.sequence),
                    };
                    return replies.send(error_frame(&error), None);
                }
            };
            let runs: Vec<(WireSessionId, u64, u32)> = body
                .get_runs()
                .iter()
                .zip(&checked.sessions)
                .map(|(r, id)| (*id, r.get_position(), r.get_count()))
                .collect();
            let outcome = lock(&shared.core).compute(coordinator, &runs, values, hidden_size);
            let mut alive = true;
            if !outcome.failed.is_empty() {
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
                    Err(_) => return false,
                }
                alive &= replies.send(reply, Some(encoding));
            }
            alive
        }
        // Checked frames of the other kinds cannot travel to a shard.
        FrameKind::Output | FrameKind::Credit | FrameKind::Error => true,
    }
}

/// What one hidden-state frame produced: the rows computed and the sessions
/// that failed, by kind.
struct Computed {
    runs: Vec<(WireSessionId, u64, u32)>,
    values: Vec<f32>,
    failed: Vec<(ErrorKind, String, Vec<WireSessionId>)>,
}

impl Core {
    /// Runs the shard's layers over every run whose session continues at
    /// its position (a new session starts at position 0).
    fn compute(
        &mut self,
        coordinator: u64,
        runs: &[(WireSessionId, u64, u32)],
        values: Vec<f32>,
        hidden_size: usize,
    ) -> Computed {
        let mut failed = Vec::new();
        let mut accepted = Vec::new();
        let mut x = Vec::with_capacity(values.len());
        let mut offset = 0usize;
        for &(id, position, count) in runs {
            let rows = &values[offset * hidden_size..(offset + count as usize) * hidden_size];
            offset += count as usize;
            let key = (coordinator, id);
            let held = self.sessions.get(&key).map(SessionKv::len);
            let fits = match held {
                Some(len) => len as u64 == position,
                None => position == 0,
            };
            if !fits {
                failed.push((
                    ErrorKind::UnknownSession,
                    match held {
                        Some(len) => {
                            format!("session holds {len} positions, frame starts at {position}")
                        }
                        None => format!("no such session here (frame starts at {position})"),
                    },
                    vec![id],
                ));
                continue;
            }
            if held.is_none() {
                if self.sessions.len() >= self.max_sessions {
                    failed.push((
                        ErrorKind::Internal,
                        format!(
                            "the shard holds its limit of {} sessions",
                            self.max_sessions
                        ),
                        vec![id],
                    ));
                    continue;
                }
                self.sessions
                    .insert(key, SessionKv::new(Arc::clone(&self.kv_pool)));
            }
            let Some(kv) = self.sessions.get_mut(&key) else {
                continue;
            };
            if let Err(e) = kv.reserve(position as usize + count as usize) {
                failed.push((ErrorKind::Internal, format!("KV: {e}"), vec![id]));
                continue;
            }
            accepted.push((id, position, count));
            x.extend_from_slice(rows);
        }
        if accepted.is_empty() {
            return Computed {
                runs: accepted,
                values: Vec::new(),
                failed,
            };
        }
        // forward_layers reads only how many tokens each sequence feeds.
        let placeholder = vec![0u32; accepted.iter().map(|r| r.2 as usize).max().unwrap_or(0)];
        let Core {
            model,
            layers,
            sessions,
            pool,
            scratch,
            ..
        } = self;
        let mut kvs: Vec<(SessionKey, SessionKv)> = accepted
            .iter()
            .filter_map(|(id, _, _)| sessions.remove_entry(&(coordinator, *id)))
            .collect();
        let result = {
            let mut seqs: Vec<Sequence<'_>> = kvs
                .iter_mut()
                .zip(&accepted)
                .map(|((_, kv), (_, _, count))| Sequence {
                    kv,
                    tokens: &placeholder[..*count as usize],
                    logits: LogitsWanted::None,
                })
                .collect();
            model.forward_layers(layers.clone(), &mut seqs, &mut x, pool, scratch)
        };
        match result {
            Ok(()) => {
                for ((key, mut kv), (_, position, count)) in kvs.into_iter().zip(&accepted) {
                    match kv.commit(*position as usize + *count as usize) {
                        Ok(()) => {
                            sessions.insert(key, kv);
                        }
                        Err(e) => {
                            failed.push((ErrorKind::Internal, format!("KV: {e}"), vec![key.1]))
                        }
                    }
                }
                Computed {
                    runs: accepted,
                    values: x,
                    failed,
                }
            }
            Err(e) => {
                // The sessions' KV may be half written: they are dropped.
                let ids: Vec<WireSessionId> = kvs.iter().map(|(k, _)| k.1).collect();
                failed.push((ErrorKind::Internal, format!("forward: {e}"), ids));
                Computed {
                    runs: Vec::new(),
                    values: Vec::new(),
                    failed,
                }
            }
        }
    }
}
