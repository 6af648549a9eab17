//! `inferd relay`: forwards shard-protocol calls to an upstream shard for
//! coordinators that cannot reach it directly, without decoding a single
//! message. Both methods are registered with raw-bytes marshallers, so the
//! bytes a client sends are the bytes the upstream receives, and back.
//!
//! The relay proves it: it hashes (SHA-256) every message when it arrives
//! (ingress) and again right before it is written out (egress), and keeps
//! the pairs per call and direction: the most recent [`RECENT_HOPS`] in
//! memory (a relay's memory stays flat however many frames it forwards)
//! and, with `--record`, every one as JSON lines in a file.

use std::collections::VecDeque;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use futures_util::{SinkExt, StreamExt};
use grpcio::{
    CallOption, Client, DuplexSink, Environment, RequestStream, RpcContext, RpcStatus,
    RpcStatusCode, ServiceBuilder, UnarySink, WriteFlags,
};
use sha2::{Digest, Sha256};

use super::raw::{HANDSHAKE_RAW, SESSION_RAW};

/// Which way a message travelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Way {
    /// From the client (coordinator) to the upstream (shard).
    Upstream,
    /// From the upstream back to the client.
    Downstream,
}

/// One forwarded message: its hashes at both boundaries.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Hop {
    /// Calls are numbered from 1 in the order they arrived.
    pub call: u64,
    pub method: &'static str,
    pub way: Way,
    /// Messages of this call and way, from 1.
    pub index: u64,
    pub bytes: usize,
    pub ingress_sha256: String,
    pub egress_sha256: String,
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Hops kept in memory (the `--record` file keeps them all).
pub const RECENT_HOPS: usize = 1024;

/// The most recent hops, and the optional record file.
#[derive(Default)]
struct Record {
    hops: VecDeque<Hop>,
    file: Option<std::fs::File>,
    calls: u64,
}

fn lock(record: &Mutex<Record>) -> std::sync::MutexGuard<'_, Record> {
    record.lock().unwrap_or_else(|p| p.into_inner())
}

impl Record {
    fn push(&mut self, hop: Hop) {
        if let Some(file) = &mut self.file {
            if let Ok(line) = serde_json::to_string(&hop) {
                let _ = writeln!(file, "{line}");
            }
        }
        if self.hops.len() == RECENT_HOPS {
            self.hops.pop_front();
        }
        self.hops.push_back(hop);
    }
}

/// Where a relay listens and forwards to.
#[derive(Clone, Debug)]
pub struct RelayConfig {
    pub listen: String,
    pub upstream: String,
    /// Append every hop as a JSON line to this file.
    pub record: Option<PathBuf>,
    /// Largest message forwarded, in bytes.
    pub max_message_bytes: u32,
}

/// A running relay; dropping it stops the server.
pub struct Relay {
    server: grpcio::Server,
    addr: std::net::SocketAddr,
    record: Arc<Mutex<Record>>,
}

/// Records a hop: the hash taken when the message arrived, and the hash of
/// the bytes about to be written out.
fn finish_hop(
    record: &Mutex<Record>,
    call: u64,
    method: &'static str,
    way: Way,
    index: u64,
    ingress_sha256: String,
    bytes: &[u8],
) {
    let egress_sha256 = sha256_hex(bytes);
    lock(record).push(Hop {
        call,
        method,
        way,
        index,
        bytes: bytes.len(),
        ingress_sha256,
        egress_sha256,
    });
}

/// Why a relay could not start.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("record file {path}: {source}")]
    RecordFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot listen on {addr}: {message}")]
    Listen { addr: String, message: String },
}

/// What both handlers share: the upstream channel and the record.
struct Upstream {
    client: Client,
    record: Arc<Mutex<Record>>,
}

impl Upstream {
    /// Numbers a new call.
    fn next_call(&self) -> u64 {
        let mut r = lock(&self.record);
        r.calls += 1;
        r.calls
    }
}

impl Relay {
    pub fn start(cfg: &RelayConfig) -> Result<Relay, RelayError> {
        let env = Arc::new(Environment::new(1));
        let channel = super::transport::client(Arc::clone(&env), cfg.max_message_bytes)
            .connect(&cfg.upstream);
        let file = match &cfg.record {
            Some(path) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| RelayError::RecordFile {
                        path: path.clone(),
                        source,
                    })?,
            ),
            None => None,
        };
        let record = Arc::new(Mutex::new(Record {
            file,
            ..Record::default()
        }));
        let upstream = Arc::new(Upstream {
            client: Client::new(channel),
            record: Arc::clone(&record),
        });
        let for_stream = Arc::clone(&upstream);
        let service = ServiceBuilder::new()
            .add_unary_handler(
                &HANDSHAKE_RAW,
                move |ctx: RpcContext<'_>, req: Vec<u8>, sink: UnarySink<Vec<u8>>| {
                    let call = upstream.next_call();
                    ctx.spawn(relay_handshake(Arc::clone(&upstream), call, req, sink));
                },
            )
            .add_duplex_streaming_handler(
                &SESSION_RAW,
                move |ctx: RpcContext<'_>,
                      incoming: RequestStream<Vec<u8>>,
                      sink: DuplexSink<Vec<u8>>| {
                    relay_session(&for_stream, &ctx, incoming, sink);
                },
            )
            .build();
        let (server, addr) =
            super::transport::start_server(env, cfg.max_message_bytes, service, &cfg.listen)
                .map_err(|message| RelayError::Listen {
                    addr: cfg.listen.clone(),
                    message,
                })?;
        tracing::info!(%addr, upstream = %cfg.upstream, "relay forwarding");
        Ok(Relay {
            server,
            addr,
            record,
        })
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The most recent messages forwarded (at most [`RECENT_HOPS`]),
    /// oldest first.
    pub fn hops(&self) -> Vec<Hop> {
        lock(&self.record).hops.iter().cloned().collect()
    }

    /// Stops accepting and cancels the calls it carries; waits for them to
    /// end for at most a few seconds.
    pub fn shutdown(mut self) {
        let done = self.server.shutdown();
        self.server.cancel_all_calls();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let waiter = std::thread::Builder::new()
            .name("inferd-relay-stop".into())
            .spawn(move || {
                let _ = futures_executor::block_on(done);
                let _ = tx.send(());
            });
        if waiter.is_ok() && rx.recv_timeout(std::time::Duration::from_secs(5)).is_err() {
            tracing::warn!("calls still open at shutdown; stopping anyway");
        }
    }
}

/// Forwards one Handshake call and its reply, hashing both.
async fn relay_handshake(
    upstream: Arc<Upstream>,
    call: u64,
    req: Vec<u8>,
    sink: UnarySink<Vec<u8>>,
) {
    let record = &upstream.record;
    let method = "Handshake";
    let ingress = sha256_hex(&req);
    finish_hop(record, call, method, Way::Upstream, 1, ingress, &req);
    let reply = match upstream
        .client
        .unary_call_async(&HANDSHAKE_RAW, &req, CallOption::default())
    {
        Ok(receiver) => receiver.await,
        Err(e) => Err(e),
    };
    match reply {
        Ok(bytes) => {
            let ingress = sha256_hex(&bytes);
            finish_hop(record, call, method, Way::Downstream, 1, ingress, &bytes);
            let _ = sink.success(bytes).await;
        }
        Err(e) => {
            let _ = sink.fail(status_of(e)).await;
        }
    }
}

/// Opens the upstream Session call for an incoming one and pumps both.
fn relay_session(
    upstream: &Upstream,
    ctx: &RpcContext<'_>,
    incoming: RequestStream<Vec<u8>>,
    sink: DuplexSink<Vec<u8>>,
) {
    let call = upstream.next_call();
    let (upstream_tx, upstream_rx) = match upstream
        .client
        .duplex_streaming(&SESSION_RAW, CallOption::default())
    {
        Ok(pair) => pair,
        Err(e) => {
            let status = status_of(e);
            // Dropping `incoming` first would cancel the call before the
            // status is sent.
            ctx.spawn(async move {
                let _ = sink.fail(status).await;
                drop(incoming);
            });
            return;
        }
    };
    ctx.spawn(forward_session(
        call,
        Arc::clone(&upstream.record),
        incoming,
        sink,
        upstream_tx,
        upstream_rx,
    ));
}

fn status_of(e: grpcio::Error) -> RpcStatus {
    match e {
        grpcio::Error::RpcFailure(status) => status,
        other => RpcStatus::with_message(RpcStatusCode::UNAVAILABLE, format!("upstream: {other}")),
    }
}

/// Pumps one Session call both ways until either side ends.
async fn forward_session(
    call: u64,
    record: Arc<Mutex<Record>>,
    mut incoming: RequestStream<Vec<u8>>,
    mut sink: DuplexSink<Vec<u8>>,
    mut upstream_tx: grpcio::ClientDuplexSender<Vec<u8>>,
    mut upstream_rx: grpcio::ClientDuplexReceiver<Vec<u8>>,
) {
    let method = "Session";
    let up_record = Arc::clone(&record);
    let up = async move {
        let mut index = 0u64;
        // After a failed send the upstream call is over; grpcio must not be
        // asked to close it (it panics on a finished call).
        let mut upstream_gone = false;
        while let Some(next) = incoming.next().await {
            let Ok(bytes) = next else {
                break;
            };
            index += 1;
            let ingress = sha256_hex(&bytes);
            finish_hop(
                &up_record,
                call,
                method,
                Way::Upstream,
                index,
                ingress,
                &bytes,
            );
            if upstream_tx
                .send((bytes, WriteFlags::default()))
                .await
                .is_err()
            {
                upstream_gone = true;
                break;
            }
        }
        if !upstream_gone {
            let _ = upstream_tx.close().await;
        }
    };
    let down = async move {
        let mut index = 0u64;
        loop {
            match upstream_rx.next().await {
                Some(Ok(bytes)) => {
                    index += 1;
                    let ingress = sha256_hex(&bytes);
                    finish_hop(
                        &record,
                        call,
                        method,
                        Way::Downstream,
                        index,
                        ingress,
                        &bytes,
                    );
                    if sink.send((bytes, WriteFlags::default())).await.is_err() {
                        return;
                    }
                }
                Some(Err(e)) => {
                    let _ = sink.fail(status_of(e)).await;
                    return;
                }
                None => {
                    let _ = sink.close().await;
                    return;
                }
            }
        }
    };
    futures_util::future::join(up, down).await;
}
