//! The OpenAI-compatible HTTP front door (`inferd serve --http-listen
//! ADDR`): the same runtime as the gRPC service, in the same process, over
//! HTTP/1.1 with axum (hyper) on a small tokio runtime of its own, whose
//! threads only parse, tokenize and stream; the forward passes stay on the
//! runtime's workers. When the workers are pinned and leave cores free,
//! the HTTP threads are pinned to those, off the workers' cores.
//!
//! The listen rules are the gRPC service's: loopback unless a bearer token
//! is configured (then every request must send `Authorization: Bearer
//! <token>`, else 401, and the request runs as that token's tenant:
//! CONTRACT §2.10) or the server is declared open; with the server's
//! TLS certificate and key it serves HTTPS only (rustls, ring). Connections
//! are limited in number and each request head in time ([`listener`]).
//! Bodies are bounded ([`MAX_HTTP_BODY_BYTES`]); an unknown path is a 404 in
//! OpenAI's error shape.

mod completion;
mod format;
mod handlers;
pub mod listener;
pub mod openai;
mod responses;
pub mod stop_text;
mod tools;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use super::service::ServiceState;
use super::stats::ServerStats;
use super::tokens::AccessTokens;
use crate::chat_template::ChatTemplate;
use crate::model::Model;
use crate::runtime::limits::MAX_HTTP_BODY_BYTES;
use crate::runtime::Tenant;
use crate::tokenizer::Tokenizer;
use crate::tools::ToolSyntax;
pub use listener::{ConnNumbers, ConnStats, HttpLimits};
use openai::ApiError;

/// Threads of the HTTP runtime: parsing and streaming only.
const HTTP_THREADS: usize = 2;

/// What every handler reads.
pub(crate) struct Front {
    pub state: Arc<ServiceState>,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// How the chat template writes tool calls.
    pub tool_syntax: ToolSyntax,
    /// The name `/v1/models` lists (the model file's stem). Requests may
    /// name any model: this server runs one.
    pub model_id: String,
    /// When the server started (Unix seconds), as `/v1/models` reports.
    pub created: u64,
    /// Ids that end a generation (the vocabulary's end-of-generation set).
    pub eos: Vec<u32>,
    pub vocab: usize,
    pub context: usize,
}

impl Front {
    /// What the handlers read: the runtime, the model's tokenizer and chat
    /// template (`chat_template`, the Jinja source given at start, or the
    /// model's own; one that does not parse leaves `/v1/chat/completions`
    /// refusing, with the reason logged) and the template's tool-call
    /// syntax.
    pub(crate) fn new(
        shared: &Arc<ServiceState>,
        model: &Model,
        model_name: &str,
        chat_template: Option<&str>,
    ) -> std::io::Result<Front> {
        let tokenizer = Tokenizer::from_gguf(model.gguf())
            .map_err(|e| std::io::Error::other(format!("the model's tokenizer: {e}")))?;
        let text_of = |id: Option<u32>| {
            id.and_then(|i| tokenizer.token_text(i))
                .unwrap_or("")
                .to_owned()
        };
        let source = chat_template.or(tokenizer.chat_template());
        let template = source.and_then(|source| {
            ChatTemplate::new(source, &text_of(tokenizer.bos()), &text_of(tokenizer.eos()))
                .map_err(|e| tracing::warn!(error = %e, "the chat template does not parse"))
                .ok()
        });
        let tool_syntax = source.map_or(ToolSyntax::Generic, ToolSyntax::of_template);
        Ok(Front {
            state: Arc::clone(shared),
            tool_syntax,
            eos: tokenizer.eog_tokens().to_vec(),
            tokenizer,
            template,
            model_id: model_name.to_owned(),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            vocab: model.config.vocab,
            context: model.config.context,
        })
    }
}

/// The running front door; dropping it stops it at once.
pub struct HttpServer {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    done: crossbeam_channel::Receiver<()>,
}

impl HttpServer {
    /// Binds `listen` and serves on a thread of its own, within `limits`.
    pub(crate) fn start(
        front: Front,
        listen: &str,
        authorize: Option<AccessTokens>,
        tls: Option<&super::TlsIdentity>,
        limits: HttpLimits,
    ) -> std::io::Result<HttpServer> {
        let acceptor = tls.map(tls_acceptor).transpose()?;
        let cores = free_cores(&front.state);
        // The thread that accepts connections, on the first free core.
        let accept_core = cores.first().copied();
        let next_core = std::sync::atomic::AtomicUsize::new(0);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(HTTP_THREADS)
            .thread_name("inferd-http")
            .on_thread_start(move || {
                if cores.is_empty() {
                    return;
                }
                let n = next_core.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let core = cores[n % cores.len()];
                if !core_affinity::set_for_current(core) {
                    tracing::warn!(core = core.id, "could not pin an HTTP thread");
                }
            })
            .enable_all()
            .build()?;
        let listener = runtime.block_on(listener::bind(listen))?;
        let addr = listener.local_addr()?;
        let conn_stats = Arc::clone(&front.state.stats.http_connections);
        let app = router(Arc::new(front), authorize);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done) = crossbeam_channel::bounded(1);
        let thread = std::thread::Builder::new()
            .name("inferd-http".into())
            .spawn(move || {
                if let Some(core) = accept_core {
                    if !core_affinity::set_for_current(core) {
                        tracing::warn!(core = core.id, "could not pin the HTTP accept thread");
                    }
                }
                runtime.block_on(listener::serve(
                    listener, app, acceptor, limits, conn_stats, stopped,
                ));
                let _ = done_tx.send(());
                // Streams still open past the drain are cut here.
                runtime.shutdown_timeout(Duration::from_secs(1));
            })?;
        tracing::info!(%addr, "serving the OpenAI-compatible HTTP API");
        Ok(HttpServer {
            addr,
            stop: Some(stop),
            thread: Some(thread),
            done,
        })
    }

    /// The address bound (the real port when 0 was asked).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets open requests finish for up to `drain`, then
    /// cuts what is left. Returns whether every request finished.
    pub fn shutdown(mut self, drain: Duration) -> bool {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let drained = self.done.recv_timeout(drain).is_ok();
        self.join();
        drained
    }

    fn join(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.join();
    }
}

/// The cores no runtime worker is pinned to (workers take the first ones);
/// none when the workers are not pinned or take every core.
fn free_cores(state: &ServiceState) -> Vec<core_affinity::CoreId> {
    let cfg = state.runtime.config();
    if !cfg.pin_cores {
        return Vec::new();
    }
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    cores.into_iter().skip(cfg.workers).collect()
}

/// A rustls acceptor presenting the server's certificate chain.
fn tls_acceptor(tls: &super::TlsIdentity) -> std::io::Result<tokio_rustls::TlsAcceptor> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    use tokio_rustls::rustls;
    let bad = |what: &str, e: &dyn std::fmt::Display| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what}: {e}"))
    };
    let certs = CertificateDer::pem_slice_iter(&tls.cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad("the TLS certificate", &e))?;
    let key = PrivateKeyDer::from_pem_slice(&tls.key_pem).map_err(|e| bad("the TLS key", &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("TLS", &e))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| bad("the TLS certificate and key", &e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

fn router(front: Arc<Front>, authorize: Option<AccessTokens>) -> Router {
    let stats = Arc::clone(&front.state.stats);
    Router::new()
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/models", get(handlers::models))
        .fallback(unknown_path)
        .method_not_allowed_fallback(wrong_method)
        .with_state(front)
        .layer(DefaultBodyLimit::max(MAX_HTTP_BODY_BYTES))
        .layer(middleware::from_fn_with_state(authorize, check_token))
        .layer(middleware::from_fn_with_state(stats, count_request))
}

/// The route a request is counted under (a fixed set, so an unknown path
/// cannot grow the metrics).
fn route_name(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/models" => "/v1/models",
        _ => "other",
    }
}

/// Counts every answered request by route and status
/// (`inferd_http_requests_total`), refusals included.
async fn count_request(
    State(stats): State<Arc<ServerStats>>,
    request: Request,
    next: Next,
) -> Response {
    let route = route_name(request.uri().path());
    let response = next.run(request).await;
    stats.record_http(route, response.status().as_u16());
    response
}

async fn wrong_method(request: Request) -> Response {
    ApiError::method_not_allowed(format!(
        "{} does not take {}",
        request.uri().path(),
        request.method()
    ))
    .into_response()
}

async fn unknown_path(request: Request) -> Response {
    ApiError::not_found(format!(
        "no route for {} {}",
        request.method(),
        request.uri().path()
    ))
    .into_response()
}

/// With tokens configured, every request must carry one. The request's
/// [`Tenant`] (none without tokens) goes with it as an extension, which
/// the handlers that run sessions require.
async fn check_token(
    State(authorize): State<Option<AccessTokens>>,
    mut request: Request,
    next: Next,
) -> Response {
    let caller = match &authorize {
        Some(tokens) => {
            let given = request.headers().get_all(AUTHORIZATION);
            match tokens.caller(given.iter().map(|v| v.as_bytes())) {
                Some(tenant) => tenant,
                None => return ApiError::unauthorized().into_response(),
            }
        }
        None => Tenant::NONE,
    };
    request.extensions_mut().insert(caller);
    next.run(request).await
}
