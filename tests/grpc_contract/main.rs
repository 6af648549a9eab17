//! CONTRACT §2 through the wire: every clause of the client API, checked
//! with a real grpcio client against a real in-process server (and, for the
//! signal path, against the real `inferd serve` process).
//!
//! Most tests use synthetic models: `tiny` (fast, context 256) and `slow`
//! (a few milliseconds per token, context 4096) for the clauses that need a
//! call still running while the test acts. The reference model is used only
//! where the clause is about real output, and those tests skip when it is
//! missing. Every wait is bounded: no test can hang.
//!
//! This file is the harness (servers, clients, a Generate read on its own
//! thread); the clauses are checked by area in the modules below.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use futures_util::future::{select, Either};
use futures_util::StreamExt;
use grpcio::{
    CallOption, ChannelBuilder, ChannelCredentialsBuilder, EnvBuilder, Environment, GrpcSlice,
    Marshaller, MessageReader, MetadataBuilder, Method, MethodType, RpcStatusCode,
};
use protobuf::Message;
use rand::{Rng, SeedableRng};

use inferd::gguf::synthetic::SyntheticLlama;
use inferd::gguf::GgufFile;
use inferd::model::Model;
use inferd::proto::grpc_health_v1::health::{
    HealthCheckRequest, HealthCheckResponse_ServingStatus as Serving,
};
use inferd::proto::grpc_health_v1::health_grpc::HealthClient;
use inferd::proto::inferd_session_v1::session_service as ext;
use inferd::proto::inferd_session_v1::session_service_grpc::SessionServiceClient;
use inferd::proto::kakeya_v1::runtime as pb;
use inferd::proto::kakeya_v1::runtime_grpc::RuntimeServiceClient;
use inferd::quant::GgmlType;
use inferd::runtime::{OverflowPolicy, RuntimeConfig};
use inferd::server::{ServeConfig, ServeError, Server, TlsIdentity};

use pb::GenerateDone_StopReason as Stop;

#[path = "../support/mod.rs"]
mod support;
use support::tiny_model;

mod deadlines;
mod determinism;
mod errors;
mod eviction;
mod fork;
mod generate;
mod prefix;
mod security;
mod sessions;
mod shutdown;

/// Upper bound of any unary call; a call that takes longer is a hang.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// Upper bound of any Generate stream in these tests.
const STREAM_TIMEOUT: Duration = Duration::from_secs(60);

/// A well-formed id no session has.
const UNKNOWN_ID: &str = "00112233445566778899aabbccddeeff";

const TINY_VOCAB: u32 = 320;
const TINY_CONTEXT: u64 = 256;

/// Wide enough that one decode step takes milliseconds, so a Generate of a
/// few hundred tokens is still running while a test acts on it.
fn slow_model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| {
        let cfg = SyntheticLlama {
            n_layers: 6,
            hidden: 256,
            n_heads: 4,
            n_kv_heads: 2,
            ffn: 768,
            vocab: 512,
            context: 4096,
            weight_type: GgmlType::Q4_1,
            tied_output: true,
            seed: 7,
            ..SyntheticLlama::tiny()
        };
        let file = GgufFile::from_bytes(cfg.build()).expect("synthetic model parses");
        Arc::new(Model::from_gguf(Arc::new(file)).expect("synthetic model loads"))
    }))
}

fn reference_model_path() -> Option<std::path::PathBuf> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        Some(path)
    } else {
        eprintln!("skipped: reference model missing at {}", path.display());
        None
    }
}

fn runtime_config(workers: usize) -> RuntimeConfig {
    RuntimeConfig {
        workers,
        pin_cores: false,
        kv_bytes: 64 << 20,
        ..RuntimeConfig::default()
    }
}

fn loopback(runtime: RuntimeConfig) -> ServeConfig {
    ServeConfig::new("127.0.0.1:0", runtime)
}

/// A gRPC status as the client saw it.
#[derive(Debug, Clone)]
struct Status {
    code: RpcStatusCode,
    message: String,
}

fn status_of(err: grpcio::Error) -> Status {
    match err {
        grpcio::Error::RpcFailure(s) => Status {
            code: s.code(),
            message: s.message().to_owned(),
        },
        other => Status {
            code: RpcStatusCode::UNKNOWN,
            message: other.to_string(),
        },
    }
}

/// A running server and clients connected to it. Dropping it stops the
/// server at once; [`Served::stop`] drains first.
struct Served {
    server: Option<Server>,
    client: RuntimeServiceClient,
    /// inferd's extension service on the same channel.
    sessions: SessionServiceClient,
    /// The same channel for calls whose request bytes a test writes itself.
    raw: grpcio::Client,
    health: HealthClient,
    token: Option<String>,
    _env: Arc<Environment>,
}

fn client_env() -> Arc<Environment> {
    Arc::new(EnvBuilder::new().cq_count(1).build())
}

impl Served {
    fn start(model: Arc<Model>, cfg: ServeConfig) -> Served {
        let token = cfg.auth_token.clone();
        let server = Server::start(model, cfg).expect("server starts");
        let env = client_env();
        let channel = ChannelBuilder::new(Arc::clone(&env)).connect(&server.addr().to_string());
        Served {
            client: RuntimeServiceClient::new(channel.clone()),
            sessions: SessionServiceClient::new(channel.clone()),
            raw: grpcio::Client::new(channel.clone()),
            health: HealthClient::new(channel),
            server: Some(server),
            token,
            _env: env,
        }
    }

    fn tiny(workers: usize) -> Served {
        Served::start(tiny_model(), loopback(runtime_config(workers)))
    }

    fn slow(workers: usize) -> Served {
        Served::start(slow_model(), loopback(runtime_config(workers)))
    }

    fn server(&self) -> &Server {
        self.server.as_ref().expect("server running")
    }

    /// The call options every call carries: a timeout and, when the server
    /// wants one, the bearer token.
    fn opt(&self) -> CallOption {
        let opt = CallOption::default().timeout(CALL_TIMEOUT);
        match &self.token {
            Some(token) => opt.headers(bearer(token)),
            None => opt,
        }
    }

    fn try_create(&self, label: &str, eos: &[u32]) -> Result<pb::CreateSessionResponse, Status> {
        let mut req = pb::CreateSessionRequest::new();
        req.set_client_label(label.into());
        req.set_eos_token_ids(eos.to_vec());
        self.client
            .create_session_opt(&req, self.opt())
            .map_err(status_of)
    }

    fn create(&self, label: &str, eos: &[u32]) -> String {
        self.try_create(label, eos)
            .expect("session created")
            .take_session_id()
    }

    fn append_with(
        &self,
        id: &str,
        tokens: &[u32],
        opt: CallOption,
    ) -> Result<pb::AppendTokensResponse, Status> {
        let mut req = pb::AppendTokensRequest::new();
        req.set_session_id(id.into());
        req.set_token_ids(tokens.to_vec());
        self.client.append_tokens_opt(&req, opt).map_err(status_of)
    }

    fn append(&self, id: &str, tokens: &[u32]) -> Result<u64, Status> {
        self.append_with(id, tokens, self.opt())
            .map(|r| r.get_history_length())
    }

    fn info(&self, id: &str) -> Result<pb::GetSessionInfoResponse, Status> {
        let mut req = pb::GetSessionInfoRequest::new();
        req.set_session_id(id.into());
        self.client
            .get_session_info_opt(&req, self.opt())
            .map_err(status_of)
    }

    fn history(&self, id: &str) -> u64 {
        self.info(id).expect("session info").get_history_length()
    }

    fn digest(&self, id: &str) -> u64 {
        self.info(id).expect("session info").get_logits_digest()
    }

    fn close(&self, id: &str) -> Result<u64, Status> {
        let mut req = pb::CloseSessionRequest::new();
        req.set_session_id(id.into());
        self.client
            .close_session_opt(&req, self.opt())
            .map(|r| r.get_final_history_length())
            .map_err(status_of)
    }

    /// ForkSession at `at` tokens (all of them when `None`).
    fn fork(&self, id: &str, at: Option<u64>) -> Result<ext::ForkSessionResponse, Status> {
        let mut req = ext::ForkSessionRequest::new();
        req.set_session_id(id.into());
        if let Some(at) = at {
            req.set_at_length(at);
        }
        self.sessions
            .fork_session_opt(&req, self.opt())
            .map_err(status_of)
    }

    fn generate(&self, req: pb::GenerateRequest) -> Gen {
        self.generate_with(req, self.opt())
    }

    fn generate_with(&self, req: pb::GenerateRequest, opt: CallOption) -> Gen {
        Gen::spawn(self.client.clone(), req, opt)
    }

    /// A whole Generate that must end with `done`: its tokens and the done.
    fn run(&self, req: pb::GenerateRequest) -> (Vec<u32>, pb::GenerateDone) {
        let outcome = self.generate(req).finish(STREAM_TIMEOUT);
        let done = outcome.done();
        (outcome.tokens(), done)
    }

    fn health_check(&self, service: &str) -> Result<Serving, Status> {
        let mut req = HealthCheckRequest::new();
        req.set_service(service.into());
        self.health
            .check_opt(&req, CallOption::default().timeout(CALL_TIMEOUT))
            .map(|r| r.get_status())
            .map_err(status_of)
    }

    /// Polls until the session is idle (nothing running or queued on it).
    fn wait_idle(&self, id: &str, within: Duration) -> pb::GetSessionInfoResponse {
        let t0 = Instant::now();
        loop {
            let info = self.info(id).expect("session info");
            if !info.get_busy() {
                return info;
            }
            assert!(
                t0.elapsed() < within,
                "session {id} still busy after {within:?}"
            );
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sends `body` as the request of RuntimeService method `method` and
    /// reads every response message (as bytes) or the failure.
    fn raw_call(
        &self,
        method: &'static str,
        ty: MethodType,
        body: &[u8],
    ) -> Result<Vec<Vec<u8>>, Status> {
        let method = Method {
            ty,
            name: method,
            req_mar: Marshaller {
                ser: raw_ser,
                de: raw_de,
            },
            resp_mar: Marshaller {
                ser: raw_ser,
                de: raw_de,
            },
        };
        let body = body.to_vec();
        if matches!(ty, MethodType::Unary) {
            return self
                .raw
                .unary_call(&method, &body, self.opt())
                .map(|reply| vec![reply])
                .map_err(status_of);
        }
        let mut stream = self
            .raw
            .server_streaming(&method, &body, self.opt())
            .map_err(status_of)?;
        let mut replies = Vec::new();
        while let Some(item) = futures_executor::block_on(stream.next()) {
            replies.push(item.map_err(status_of)?);
        }
        Ok(replies)
    }

    fn stop(mut self) {
        if let Some(server) = self.server.take() {
            let report = server.shutdown(Duration::from_secs(10));
            assert!(report.drained, "{report:?}");
        }
    }
}

fn raw_ser(bytes: &Vec<u8>, buf: &mut GrpcSlice) -> grpcio::Result<()> {
    *buf = GrpcSlice::from(bytes.as_slice());
    Ok(())
}

fn raw_de(mut reader: MessageReader) -> grpcio::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    reader
        .read_to_end(&mut bytes)
        .map_err(|e| grpcio::Error::Codec(Box::new(e)))?;
    Ok(bytes)
}

/// Every RuntimeService method: its path, kind and request type.
const RUNTIME_METHODS: [(&str, MethodType, &str); 5] = [
    (
        "/kakeya.v1.RuntimeService/CreateSession",
        MethodType::Unary,
        "kakeya.v1.CreateSessionRequest",
    ),
    (
        "/kakeya.v1.RuntimeService/AppendTokens",
        MethodType::Unary,
        "kakeya.v1.AppendTokensRequest",
    ),
    (
        "/kakeya.v1.RuntimeService/Generate",
        MethodType::ServerStreaming,
        "kakeya.v1.GenerateRequest",
    ),
    (
        "/kakeya.v1.RuntimeService/CloseSession",
        MethodType::Unary,
        "kakeya.v1.CloseSessionRequest",
    ),
    (
        "/kakeya.v1.RuntimeService/GetSessionInfo",
        MethodType::Unary,
        "kakeya.v1.GetSessionInfoRequest",
    ),
];

fn bearer(token: &str) -> grpcio::Metadata {
    let mut meta = MetadataBuilder::new();
    meta.add_str("authorization", &format!("Bearer {token}"))
        .expect("ASCII metadata");
    meta.build()
}

fn gen_req(id: &str, max_tokens: u32) -> pb::GenerateRequest {
    let mut req = pb::GenerateRequest::new();
    req.set_session_id(id.into());
    req.set_max_tokens(max_tokens);
    req
}

/// Sampling hot enough that a synthetic model's tokens vary.
fn seeded_req(id: &str, max_tokens: u32, seed: Option<u64>) -> pb::GenerateRequest {
    let mut req = gen_req(id, max_tokens);
    req.set_temperature(50.0);
    req.set_min_p(0.01);
    if let Some(seed) = seed {
        req.set_seed(seed);
    }
    req
}

/// What two sessions with the same history must agree on: the digest, a
/// greedy continuation, a seeded one, and the digest after them.
#[derive(Debug, PartialEq, Eq)]
struct Continuation {
    digest: u64,
    greedy: Vec<u32>,
    seeded: Vec<u32>,
    digest_after: u64,
}

fn continuation(served: &Served, id: &str) -> Continuation {
    let digest = served.digest(id);
    let greedy = served.run(gen_req(id, 8)).0;
    let seeded = served.run(seeded_req(id, 8, Some(99))).0;
    Continuation {
        digest,
        greedy,
        seeded,
        digest_after: served.digest(id),
    }
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt) % 300).collect()
}

/// What the reader thread of a Generate saw.
enum Event {
    Message(pb::GenerateResponse),
    /// The call ended with a non-OK status.
    Failed(Status),
    /// The stream ended with OK.
    Ended,
}

/// A Generate call read on its own thread, so that the test can wait on it
/// with a timeout. Dropping it cancels the call.
struct Gen {
    events: mpsc::Receiver<Event>,
    cancel: Option<futures_channel::oneshot::Sender<()>>,
    seen: Vec<pb::GenerateResponse>,
}

impl Gen {
    fn spawn(client: RuntimeServiceClient, req: pb::GenerateRequest, opt: CallOption) -> Gen {
        let (tx, events) = mpsc::channel();
        let (cancel, mut cancelled) = futures_channel::oneshot::channel::<()>();
        thread::spawn(move || {
            let mut stream = match client.generate_opt(&req, opt) {
                Ok(stream) => stream,
                Err(e) => {
                    let _ = tx.send(Event::Failed(status_of(e)));
                    return;
                }
            };
            futures_executor::block_on(async {
                loop {
                    let next = match select(stream.next(), &mut cancelled).await {
                        Either::Left((item, _)) => Some(item),
                        Either::Right(_) => None,
                    };
                    match next {
                        None => {
                            stream.cancel();
                            return;
                        }
                        Some(Some(Ok(msg))) => {
                            if tx.send(Event::Message(msg)).is_err() {
                                stream.cancel();
                                return;
                            }
                        }
                        Some(Some(Err(e))) => {
                            let _ = tx.send(Event::Failed(status_of(e)));
                            return;
                        }
                        Some(None) => {
                            let _ = tx.send(Event::Ended);
                            return;
                        }
                    }
                }
            });
        });
        Gen {
            events,
            cancel: Some(cancel),
            seen: Vec::new(),
        }
    }

    /// The next message; panics on a timeout, a failure or the end.
    fn next_message(&mut self, within: Duration) -> pb::GenerateResponse {
        match self.events.recv_timeout(within) {
            Ok(Event::Message(msg)) => {
                self.seen.push(msg.clone());
                msg
            }
            Ok(Event::Failed(s)) => panic!("stream failed: {s:?}"),
            Ok(Event::Ended) => panic!("stream ended early"),
            Err(e) => panic!("no message within {within:?}: {e}"),
        }
    }

    /// Reads up to and including the first token.
    fn first_token(&mut self, within: Duration) -> u32 {
        loop {
            let msg = self.next_message(within);
            if msg.has_token_id() {
                return msg.get_token_id();
            }
            assert!(!msg.has_done(), "done before any token: {msg:?}");
        }
    }

    /// Cancels the call from the client side.
    fn cancel(&mut self) {
        if let Some(cancel) = self.cancel.take() {
            let _ = cancel.send(());
        }
    }

    /// Reads to the end of the stream.
    fn finish(mut self, within: Duration) -> Outcome {
        let deadline = Instant::now() + within;
        let end = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(Event::Message(msg)) => self.seen.push(msg),
                Ok(Event::Failed(s)) => break Err(s),
                Ok(Event::Ended) => break Ok(()),
                Err(e) => {
                    self.cancel();
                    panic!(
                        "stream not over within {within:?} ({e}) after {} messages",
                        self.seen.len()
                    )
                }
            }
        };
        Outcome {
            messages: std::mem::take(&mut self.seen),
            end,
        }
    }
}

impl Drop for Gen {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// Everything one Generate call delivered, and how it ended.
#[derive(Debug)]
struct Outcome {
    messages: Vec<pb::GenerateResponse>,
    end: Result<(), Status>,
}

impl Outcome {
    fn tokens(&self) -> Vec<u32> {
        self.messages
            .iter()
            .filter(|m| m.has_token_id())
            .map(|m| m.get_token_id())
            .collect()
    }

    /// The one `done`; checks that the call ended OK, that there was exactly
    /// one `done`, and that nothing came after it.
    fn done(&self) -> pb::GenerateDone {
        assert!(self.end.is_ok(), "stream failed: {:?}", self.end);
        let dones: Vec<usize> = (0..self.messages.len())
            .filter(|&i| self.messages[i].has_done())
            .collect();
        assert_eq!(dones.len(), 1, "exactly one done: {:?}", self.messages);
        assert_eq!(
            dones[0],
            self.messages.len() - 1,
            "nothing after done: {:?}",
            self.messages
        );
        self.messages[dones[0]].get_done().clone()
    }

    /// The status a failed call ended with; checks there was no `done`.
    fn failure(&self) -> &Status {
        assert!(
            self.messages.iter().all(|m| !m.has_done()),
            "a failed call sends no done: {:?}",
            self.messages
        );
        match &self.end {
            Err(s) => s,
            Ok(()) => panic!("stream ended OK: {:?}", self.messages),
        }
    }
}

fn assert_code<T: std::fmt::Debug>(got: Result<T, Status>, code: RpcStatusCode, what: &str) {
    match got {
        Err(s) => assert_eq!(s.code, code, "{what}: {s:?}"),
        Ok(v) => panic!("{what}: expected {code:?}, got {v:?}"),
    }
}
