//! The gRPC front end: `kakeya.v1.RuntimeService`, its extension
//! `inferd.session.v1.SessionService` (ForkSession) and
//! `grpc.health.v1.Health` on a grpcio (gRPC C core) server in front of the
//! [`crate::runtime`].
//!
//! The completion-queue threads only decode, validate, check the bearer
//! token and hand work to the owning worker through the runtime's bounded
//! crossbeam channels; replies come back through channels the handlers'
//! futures await (never blocking a completion-queue thread). A Generate
//! stream whose reader is slow fills its bounded channel, and the worker
//! then leaves that session out of its batch steps until there is room.

mod auth;
mod constraints;
mod convert;
mod deadline;
mod health;
pub mod http;
mod service;
mod stats;
pub mod tokens;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;

pub use auth::is_loopback;
pub use health::{HealthState, SERVICES as HEALTH_SERVICES};
pub use stats::{code_name, Method, ServerStats};

use crate::metrics::{self, MetricsEndpoint, RenderFn, RequestCount, ServerNumbers};
use crate::model::Model;
use crate::proto::grpc_health_v1::health::HealthCheckResponse_ServingStatus as ServingStatus;
use crate::proto::grpc_health_v1::health_grpc::create_health;
use crate::runtime::{
    AppendTokens, CreateSession, Runtime, RuntimeConfig, RuntimeError, RuntimeStats, Tenant,
};
use service::{RuntimeServiceImpl, ServiceState};
use tokens::{AccessTokens, TokenFileError};

/// A PEM certificate chain and its private key.
#[derive(Clone)]
pub struct TlsIdentity {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        write!(
            f,
            "TlsIdentity {{ cert: {} bytes, key: <hidden> }}",
            self.cert_pem.len()
        )
    }
}

/// Everything `Server::start` needs besides the model.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// `IP:PORT` (port 0 picks a free one) or `localhost:PORT`.
    pub listen: String,
    pub runtime: RuntimeConfig,
    /// The access-token file's text (`--auth-token-file`, format in
    /// [`tokens`]): one bare token, or several, each with an optional
    /// name. Every RuntimeService call must then send one as
    /// `authorization: Bearer <token>`, and with several tokens each
    /// session belongs to the tenant of the token that created it.
    pub auth_token: Option<String>,
    /// Allows a non-loopback `listen` without a token.
    pub allow_unauthenticated: bool,
    pub tls: Option<TlsIdentity>,
    /// gRPC completion-queue threads (decode and hand over only).
    pub completion_queues: usize,
    /// Serve Prometheus metrics at `http://ADDR/metrics` (port 0: any free
    /// port). Off loopback it needs `auth_token` (then every scrape must send
    /// it as `Authorization: Bearer <token>`) or `allow_unauthenticated`,
    /// exactly as `listen` does.
    pub metrics_listen: Option<String>,
    /// Serve the OpenAI-compatible HTTP API on this address (port 0: any
    /// free port), under the same rules as `listen`.
    pub http_listen: Option<String>,
    /// The chat template the HTTP API renders with (Jinja source),
    /// instead of the model's own.
    pub chat_template: Option<String>,
    /// The model's name as the HTTP API's `/v1/models` lists it.
    pub model_name: String,
    /// The HTTP API's connection limit and timeouts.
    pub http_limits: http::HttpLimits,
}

impl ServeConfig {
    /// Loopback, no token, no TLS, the runtime's defaults.
    pub fn new(listen: impl Into<String>, runtime: RuntimeConfig) -> Self {
        Self {
            listen: listen.into(),
            runtime,
            auth_token: None,
            allow_unauthenticated: false,
            tls: None,
            completion_queues: default_completion_queues(),
            metrics_listen: None,
            http_listen: None,
            chat_template: None,
            model_name: "inferd".into(),
            http_limits: http::HttpLimits::default(),
        }
    }

    /// Refuses an open non-loopback server or metrics endpoint, and a
    /// token file that does not parse (an empty one included).
    pub fn check_security(&self) -> Result<(), ServeError> {
        self.access_tokens()?;
        let open = self.auth_token.is_none() && !self.allow_unauthenticated;
        if open && !is_loopback(&self.listen) {
            return Err(ServeError::OpenListen(self.listen.clone()));
        }
        if let Some(metrics) = &self.metrics_listen {
            if open && !is_loopback(metrics) {
                return Err(ServeError::OpenMetricsListen(metrics.clone()));
            }
        }
        if let Some(http) = &self.http_listen {
            if open && !is_loopback(http) {
                return Err(ServeError::OpenListen(http.clone()));
            }
        }
        Ok(())
    }

    /// The parsed token file, if one is configured.
    pub fn access_tokens(&self) -> Result<Option<AccessTokens>, ServeError> {
        self.auth_token
            .as_deref()
            .map(AccessTokens::parse)
            .transpose()
            .map_err(ServeError::TokenFile)
    }
}

/// How long a gRPC connection may take over its TLS and HTTP/2 handshake
/// before the C core closes it (the core's default is 120 s): a client
/// that connects and sends nothing holds a descriptor this long at most.
pub const GRPC_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// One completion-queue thread per four cores: they only decode and hand
/// over, the cores belong to the workers.
pub fn default_completion_queues() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().div_ceil(4))
}

/// Why the server could not start.
#[derive(Debug, Error)]
pub enum ServeError {
    /// A non-loopback address without a token or the explicit opt-out.
    #[error(
        "refusing to listen on {0} without an access token: it is not a loopback address; \
         give --auth-token-file, or --allow-unauthenticated to accept an open server"
    )]
    OpenListen(String),
    /// A non-loopback metrics address without a token or the explicit
    /// opt-out.
    #[error(
        "refusing to serve metrics on {0} without an access token: it is not a loopback \
         address; give --auth-token-file (every scrape then sends `Authorization: Bearer \
         <token>`), or --allow-unauthenticated to accept open metrics"
    )]
    OpenMetricsListen(String),
    /// The token file is empty or malformed (the error names the line).
    #[error("the access-token file: {0}")]
    TokenFile(TokenFileError),
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {reason}")]
    Bind { addr: String, reason: String },
    /// The runtime (KV pool, workers) could not start.
    #[error("cannot start the runtime: {0}")]
    Runtime(#[from] RuntimeError),
    /// The metrics endpoint could not be bound.
    #[error("{0}")]
    Metrics(std::io::Error),
    /// The HTTP front door could not be bound.
    #[error("cannot serve HTTP on {addr}: {source}")]
    Http {
        addr: String,
        source: std::io::Error,
    },
    /// The one-token warm-up forward failed, so the server never turned SERVING.
    #[error("warm-up forward failed: {0}")]
    Warmup(RuntimeError),
}

/// A running server. Dropping it stops it at once; [`Server::shutdown`]
/// drains first.
pub struct Server {
    // Declared first so they are dropped first: they read the runtime.
    http: Option<http::HttpServer>,
    metrics: Option<MetricsEndpoint>,
    grpc: Option<grpcio::Server>,
    shared: Option<Arc<ServiceState>>,
    health: Arc<HealthState>,
    stats: Arc<ServerStats>,
    addr: SocketAddr,
}

/// How a drain ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Every call in flight finished before the drain timeout.
    pub drained: bool,
    pub waited: Duration,
}

impl Server {
    /// Starts the runtime, binds, and turns SERVING after a one-token
    /// forward through a worker succeeded. The warm-up creates and closes
    /// one session labelled `inferd-warmup` (it shows in the counters).
    pub fn start(model: Arc<Model>, cfg: ServeConfig) -> Result<Server, ServeError> {
        cfg.check_security()?;
        let tokens = cfg.access_tokens()?;
        let vocab = u32::try_from(model.config.vocab).unwrap_or(u32::MAX);
        let context = model.config.context as u64;
        let warmup_token = warmup_token(&model);
        let for_http = Arc::clone(&model);
        let runtime = Runtime::start(model, cfg.runtime.clone())?;
        let page_bytes = runtime.kv_page_bytes();
        let stats = Arc::new(ServerStats::default());
        let health = HealthState::new();
        let shared = Arc::new(ServiceState {
            runtime,
            tokens: tokens.clone(),
            stats: Arc::clone(&stats),
            vocab,
            context,
            page_bytes,
            constraints: constraints::Constraints::new(Arc::clone(&for_http)),
        });

        let env = Arc::new(
            grpcio::EnvBuilder::new()
                .cq_count(cfg.completion_queues.max(1))
                .name_prefix("inferd-grpc")
                .build(),
        );
        // The C core (1.56) has no cap on connections; what it can bound is
        // the handshake. On EMFILE it leaves connections in the backlog and
        // retries once a second, logging at most once a second.
        let channel_args = grpcio::ChannelBuilder::new(Arc::clone(&env))
            .raw_cfg_int(
                std::ffi::CString::from(c"grpc.server_handshake_timeout_ms"),
                i32::try_from(GRPC_HANDSHAKE_TIMEOUT.as_millis()).unwrap_or(i32::MAX),
            )
            .build_args();
        let mut builder = grpcio::ServerBuilder::new(env)
            .channel_args(channel_args)
            .register_service(service::runtime_service(RuntimeServiceImpl {
                shared: Arc::clone(&shared),
            }))
            .register_service(service::session_service(RuntimeServiceImpl {
                shared: Arc::clone(&shared),
            }))
            .register_service(create_health(health::HealthService {
                state: Arc::clone(&health),
            }));
        if let Some(tokens) = &tokens {
            builder =
                builder.add_checker(auth::BearerAuth::new(tokens.clone(), Arc::clone(&stats)));
        }
        let bind_error = |reason: String| ServeError::Bind {
            addr: cfg.listen.clone(),
            reason,
        };
        let mut grpc = builder.build().map_err(|e| bind_error(e.to_string()))?;
        let credentials = match &cfg.tls {
            Some(tls) => grpcio::ServerCredentialsBuilder::new()
                .add_cert(tls.cert_pem.clone(), tls.key_pem.clone())
                .build(),
            None => grpcio::ServerCredentials::insecure(),
        };
        let port = grpc
            .add_listening_port(cfg.listen.clone(), credentials)
            .map_err(|e| bind_error(e.to_string()))?;
        let addr = crate::listen::bound_address(&cfg.listen, port).map_err(bind_error)?;
        grpc.start();

        warm_up(&shared.runtime, warmup_token).map_err(ServeError::Warmup)?;
        let metrics = match &cfg.metrics_listen {
            Some(listen) => Some(
                MetricsEndpoint::bind_counted(
                    listen,
                    metrics_renderer(&shared, &health, cfg.http_listen.is_some()),
                    tokens.clone().map(auth::http_bearer_check),
                    Arc::clone(&stats.metrics_accept_errors),
                )
                .map_err(ServeError::Metrics)?,
            ),
            None => None,
        };
        let http = match &cfg.http_listen {
            Some(listen) => Some(
                http::Front::new(
                    &shared,
                    &for_http,
                    &cfg.model_name,
                    cfg.chat_template.as_deref(),
                )
                .and_then(|front| {
                    http::HttpServer::start(
                        front,
                        listen,
                        tokens.clone(),
                        cfg.tls.as_ref(),
                        cfg.http_limits,
                    )
                })
                .map_err(|source| ServeError::Http {
                    addr: listen.clone(),
                    source,
                })?,
            ),
            None => None,
        };
        if let Some(store) = &cfg.runtime.state {
            let told = Arc::clone(&health);
            told.set_state_dir_writable(store.health().writable());
            store.health().listen(Box::new(move |writable| {
                told.set_state_dir_writable(writable)
            }));
        }
        health.set(ServingStatus::SERVING);
        tracing::info!(
            %addr,
            workers = shared.runtime.workers(),
            tls = cfg.tls.is_some(),
            auth = tokens.is_some(),
            tenants = tokens.as_ref().is_some_and(AccessTokens::has_tenants),
            "serving kakeya.v1.RuntimeService"
        );
        Ok(Server {
            http,
            metrics,
            grpc: Some(grpc),
            shared: Some(shared),
            health,
            stats,
            addr,
        })
    }

    /// The address actually bound (the real port when 0 was asked).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the OpenAI-compatible HTTP API is served, when it is.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(http::HttpServer::addr)
    }

    /// Where the Prometheus metrics are served, when they are.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsEndpoint::addr)
    }

    /// The serving status the health service reports.
    pub fn health(&self) -> &Arc<HealthState> {
        &self.health
    }

    /// Counters of the gRPC front end.
    pub fn server_stats(&self) -> &Arc<ServerStats> {
        &self.stats
    }

    /// A snapshot of the runtime's counters.
    pub fn runtime_stats(&self) -> RuntimeStats {
        self.shared
            .as_ref()
            .map(|s| s.runtime.stats())
            .unwrap_or_default()
    }

    /// Stops taking calls (new ones get UNAVAILABLE, health turns
    /// NOT_SERVING), lets the calls in flight finish for up to `drain`, then
    /// cancels what is left and stops the workers.
    pub fn shutdown(mut self, drain: Duration) -> ShutdownReport {
        let began = Instant::now();
        self.health.set(ServingStatus::NOT_SERVING);
        // Metrics stay up while draining: the drain is worth watching.
        if let Some(shared) = &self.shared {
            shared.runtime.drain();
        }
        let mut drained = true;
        if let Some(http) = self.http.take() {
            drained &= http.shutdown(drain);
        }
        let drain = drain.saturating_sub(began.elapsed());
        if let Some(mut grpc) = self.grpc.take() {
            // The C core stops accepting at once and completes the future
            // when the last call in flight is over.
            let done = grpc.shutdown();
            let (tx, rx) = crossbeam_channel::bounded(1);
            let waiter = std::thread::spawn(move || {
                let _ = futures_executor::block_on(done);
                let _ = tx.send(());
            });
            if rx.recv_timeout(drain).is_err() {
                drained = false;
                tracing::warn!(
                    seconds = drain.as_secs_f64(),
                    "drain timeout: cancelling the calls still running"
                );
                grpc.cancel_all_calls();
                // Stopping the workers ends whatever still waits on them.
                self.shared = None;
                let _ = rx.recv_timeout(Duration::from_secs(5));
            }
            let _ = waiter.join();
            drop(grpc);
        }
        self.metrics = None;
        self.shared = None;
        let report = ShutdownReport {
            drained,
            waited: began.elapsed(),
        };
        tracing::info!(
            drained,
            seconds = report.waited.as_secs_f64(),
            "server stopped"
        );
        report
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.metrics = None;
        if let Some(mut grpc) = self.grpc.take() {
            let done = grpc.shutdown();
            grpc.cancel_all_calls();
            self.shared = None;
            let _ = futures_executor::block_on(done);
        }
    }
}

/// Renders the runtime's and the front end's numbers for one scrape. Holds
/// the runtime weakly: a scrape racing shutdown gets an empty snapshot.
/// `http_front`: the HTTP API is served, so its connections are reported.
fn metrics_renderer(
    shared: &Arc<ServiceState>,
    health: &Arc<HealthState>,
    http_front: bool,
) -> RenderFn {
    let shared = Arc::downgrade(shared);
    let health = Arc::clone(health);
    Arc::new(move || {
        let Some(shared) = shared.upgrade() else {
            return String::new();
        };
        let stats = &shared.stats;
        let sampler = &shared.runtime.config().sampler;
        let mut requests: Vec<RequestCount> = stats
            .calls()
            .into_iter()
            .map(|(method, code, count)| RequestCount {
                method: method.into(),
                code: code.into(),
                count,
            })
            .collect();
        let refused = stats.unauthenticated();
        if refused > 0 {
            // Refused before any handler ran, so no method is known.
            requests.push(RequestCount {
                method: "unknown".into(),
                code: "UNAUTHENTICATED".into(),
                count: refused,
            });
        }
        let http_requests = stats
            .http_calls()
            .into_iter()
            .map(|(route, status, count)| RequestCount {
                method: route.into(),
                code: status.to_string(),
                count,
            })
            .collect();
        let numbers = ServerNumbers {
            requests,
            http_requests,
            http_connections: http_front.then(|| {
                let c = stats.http_connections.snapshot();
                metrics::HttpConnections {
                    open: c.open,
                    limit: c.limit,
                    header_timeouts: c.header_timeouts,
                    idle_timeouts: c.idle_timeouts,
                    limit_reached: c.limit_reached,
                }
            }),
            accept_errors: {
                let mut errors = vec![(
                    "metrics",
                    stats
                        .metrics_accept_errors
                        .load(std::sync::atomic::Ordering::Relaxed),
                )];
                if http_front {
                    errors.push(("http", stats.http_connections.snapshot().accept_errors));
                }
                errors
            },
            grpc_active_streams: stats.active_streams(),
            health_serving: health.status() == ServingStatus::SERVING,
            sampler_backend: sampler.backend_name().into(),
            sampler_adapter: sampler.adapter().unwrap_or_default(),
            layers_backend: shared.runtime.config().layers.backend().into(),
            layers: shared.runtime.config().layers.describe(),
        };
        metrics::render(&shared.runtime.stats(), &numbers)
    })
}

/// A token every vocabulary has: the model's BOS if it names one, else 0.
fn warmup_token(model: &Model) -> u32 {
    crate::tokenizer::Tokenizer::from_gguf(model.gguf())
        .ok()
        .and_then(|t| t.bos())
        .unwrap_or(0)
}

/// One token through a real worker's forward pass, in a throwaway session.
fn warm_up(runtime: &Runtime, token: u32) -> Result<(), RuntimeError> {
    let deadline = Some(Instant::now() + Duration::from_secs(120));
    // Not journaled: a start on a full disk still warms up.
    let id = runtime
        .create_transient_session(
            &Tenant::NONE,
            CreateSession {
                client_label: "inferd-warmup".into(),
                eos_token_ids: Vec::new(),
            },
            deadline,
        )?
        .wait()?;
    let appended = runtime
        .append_tokens(
            &Tenant::NONE,
            AppendTokens {
                id,
                tokens: vec![token],
            },
            deadline,
        )
        .and_then(|p| p.wait());
    let closed = runtime
        .close_session(&Tenant::NONE, id, deadline)
        .and_then(|p| p.wait());
    appended?;
    closed?;
    Ok(())
}
