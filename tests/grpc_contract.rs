//! CONTRACT §2 through the wire: every clause of the client API, checked
//! with a real grpcio client against a real in-process server (and, for the
//! signal path, against the real `inferd serve` process).
//!
//! Most tests use synthetic models: `tiny` (fast, context 256) and `slow`
//! (a few milliseconds per token, context 4096) for the clauses that need a
//! call still running while the test acts. The reference model is used only
//! where the clause is about real output, and those tests skip when it is
//! missing. Every wait is bounded: no test can hang.

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
use inferd::proto::kakeya_v1::runtime as pb;
use inferd::proto::kakeya_v1::runtime_grpc::RuntimeServiceClient;
use inferd::quant::GgmlType;
use inferd::runtime::{OverflowPolicy, RuntimeConfig};
use inferd::server::{ServeConfig, ServeError, Server, TlsIdentity};

use pb::GenerateDone_StopReason as Stop;

mod support;
use support::tiny_model;

/// Upper bound of any unary call; a call that takes longer is a hang.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// Upper bound of any Generate stream in these tests.
const STREAM_TIMEOUT: Duration = Duration::from_secs(60);

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

// ---------------------------------------------------------------- §2.1 --

#[test]
fn session_ids_are_server_owned_random_hex_and_the_reply_describes_the_model() {
    let served = Served::tiny(2);
    let label = "0123456789abcdef0123456789abcdef";
    let mut ids = std::collections::HashSet::new();
    let mut workers = std::collections::HashSet::new();
    let n = 200;
    for _ in 0..n {
        let reply = served.try_create(label, &[]).expect("created");
        let id = reply.get_session_id().to_owned();
        assert_eq!(id.len(), 32, "{id}");
        assert!(
            id.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "32 lowercase hex digits: {id}"
        );
        assert_ne!(id, label, "never the client's text");
        assert_eq!(reply.get_vocab_size(), TINY_VOCAB);
        assert_eq!(reply.get_context_length(), TINY_CONTEXT);
        assert!(reply.get_worker() < 2);
        workers.insert(reply.get_worker());
        let info = served.info(&id).expect("info");
        assert_eq!(info.get_worker(), reply.get_worker());
        assert_eq!(info.get_client_label(), label, "kept verbatim");
        ids.insert(id);
    }
    assert_eq!(ids.len(), n, "every id is new");
    assert_eq!(workers.len(), 2, "sessions are spread over the workers");
    // Random bits: every hex position past the first byte (which picks the
    // worker) takes many values over 200 ids, and no two ids share a long
    // common prefix.
    let ids: Vec<&String> = ids.iter().collect();
    for pos in 2..32 {
        let values: std::collections::HashSet<u8> =
            ids.iter().map(|id| id.as_bytes()[pos]).collect();
        assert!(values.len() >= 8, "position {pos} takes {values:?}");
    }
    let longest_shared = ids
        .iter()
        .enumerate()
        .flat_map(|(i, a)| ids[i + 1..].iter().map(move |b| (a, b)))
        .map(|(a, b)| a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count())
        .max()
        .unwrap_or(0);
    assert!(
        longest_shared < 8,
        "ids share {longest_shared} leading digits"
    );
    served.stop();
}

#[test]
fn session_info_echoes_the_eos_ids() {
    let served = Served::tiny(1);
    let id = served.create("eos", &[7, 9]);
    assert_eq!(served.info(&id).expect("info").get_eos_token_ids(), &[7, 9]);
    served.stop();
}

#[test]
fn appends_add_up_and_an_id_outside_the_vocabulary_changes_nothing() {
    let served = Served::tiny(1);
    let id = served.create("append", &[]);
    let empty = served.info(&id).expect("info");
    assert_eq!(empty.get_history_length(), 0);
    assert_eq!(empty.get_logits_digest(), 0, "no logits yet");
    assert_eq!(served.append(&id, &[1, 2, 3]).expect("append"), 3);
    assert_eq!(served.append(&id, &[0, 319]).expect("append"), 5);
    assert_eq!(
        served.append(&id, &[]).expect("append"),
        5,
        "an empty append is a no-op"
    );
    assert_eq!(served.append(&id, &prompt(40, 9)).expect("append"), 45);
    let before = served.info(&id).expect("info");
    assert_eq!(before.get_history_length(), 45);
    assert_ne!(before.get_logits_digest(), 0);

    let err = served
        .append(&id, &[4, TINY_VOCAB, 5])
        .expect_err("token == vocabulary size");
    assert_eq!(err.code, RpcStatusCode::INVALID_ARGUMENT, "{err:?}");
    assert!(err.message.contains("320"), "{err:?}");
    let err = served
        .append(&id, &[u32::MAX])
        .expect_err("far outside the vocabulary");
    assert_eq!(err.code, RpcStatusCode::INVALID_ARGUMENT, "{err:?}");
    let after = served.info(&id).expect("info");
    assert_eq!(after.get_history_length(), 45, "nothing was appended");
    assert_eq!(after.get_logits_digest(), before.get_logits_digest());
    assert_eq!(after.get_kv_live_bytes(), before.get_kv_live_bytes());

    assert_eq!(
        served.append(&id, &[6]).expect("append"),
        46,
        "later appends still work"
    );
    served.stop();
}

// ---------------------------------------------------------------- §2.4 --

/// A well-formed id no session has.
const UNKNOWN_ID: &str = "00112233445566778899aabbccddeeff";

#[test]
fn unknown_closed_and_twice_closed_ids_are_not_found() {
    let served = Served::tiny(2);
    // Any id the server does not hold is NOT_FOUND on every RPC, whatever
    // its form: the published SDKs' own tests send `sess-does-not-exist`.
    for unknown in [
        UNKNOWN_ID,
        "sess-does-not-exist",
        "",
        "xyz",
        "00112233445566778899AABBCCDDEEFF",
        "00112233445566778899aabbccddeef",
        "00112233445566778899aabbccddeeff0",
        "0011223344556677-899aabbccddeeff",
        "é0112233445566778899aabbccddeef",
    ] {
        let what = format!("id {unknown:?}");
        assert_code(served.info(unknown), RpcStatusCode::NOT_FOUND, &what);
        assert_code(
            served.append(unknown, &[1]),
            RpcStatusCode::NOT_FOUND,
            &what,
        );
        assert_code(served.close(unknown), RpcStatusCode::NOT_FOUND, &what);
        let outcome = served.generate(gen_req(unknown, 3)).finish(STREAM_TIMEOUT);
        assert_eq!(outcome.failure().code, RpcStatusCode::NOT_FOUND, "{what}");
    }

    let id = served.create("closing", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    assert_eq!(served.close(&id).expect("closed"), 3);
    assert_code(served.close(&id), RpcStatusCode::NOT_FOUND, "second close");
    assert_code(
        served.info(&id),
        RpcStatusCode::NOT_FOUND,
        "info after close",
    );
    assert_code(
        served.append(&id, &[4]),
        RpcStatusCode::NOT_FOUND,
        "append after close",
    );
    let outcome = served.generate(gen_req(&id, 3)).finish(STREAM_TIMEOUT);
    assert_eq!(outcome.failure().code, RpcStatusCode::NOT_FOUND);
    // The warm-up session and this one.
    let stats = served.server().runtime_stats();
    assert_eq!(stats.evicted_close, 2, "{stats:?}");
    assert_eq!(stats.kv_free_pages, stats.kv_total_pages, "KV freed");
    // A failed session (invariant violation) cannot be provoked through the
    // API; the worker's unit tests cover that it is removed and NOT_FOUND.
    served.stop();
}

#[test]
fn every_bad_argument_is_invalid_argument_and_changes_nothing() {
    let served = Served::tiny(1);
    let id = served.create("bad", &[]);
    let outcome = served.generate(gen_req(&id, 4)).finish(STREAM_TIMEOUT);
    assert_eq!(
        outcome.failure().code,
        RpcStatusCode::INVALID_ARGUMENT,
        "Generate on an empty history"
    );
    served.append(&id, &[1, 2, 3]).expect("append");
    let digest = served.digest(&id);

    type Spoil = fn(&mut pb::GenerateRequest);
    let bad: [(&str, Spoil); 8] = [
        ("max_tokens 0", |r| r.set_max_tokens(0)),
        ("temperature -1", |r| r.set_temperature(-1.0)),
        ("temperature NaN", |r| r.set_temperature(f32::NAN)),
        // So small that 1/T overflows: refused, never INTERNAL.
        ("temperature 1e-45", |r| r.set_temperature(1e-45)),
        ("temperature below the bound", |r| {
            r.set_temperature(inferd::sampler::MIN_TEMPERATURE / 2.0)
        }),
        ("top_p 0", |r| r.set_top_p(0.0)),
        ("top_p 1.5", |r| r.set_top_p(1.5)),
        ("logit_bias token out of range", |r| {
            let mut bias = pb::LogitBias::new();
            bias.set_token_id(TINY_VOCAB);
            bias.set_bias(-5.0);
            r.mut_logit_bias().push(bias);
        }),
    ];
    // A bad argument is INVALID_ARGUMENT whatever the id: the arguments are
    // checked before the session is looked up, for ids of every form alike.
    for (what, set) in &bad {
        for target in [id.as_str(), UNKNOWN_ID, "sess-does-not-exist", ""] {
            let mut req = gen_req(target, 4);
            set(&mut req);
            let outcome = served.generate(req).finish(STREAM_TIMEOUT);
            assert!(outcome.tokens().is_empty(), "{what}");
            assert_eq!(
                outcome.failure().code,
                RpcStatusCode::INVALID_ARGUMENT,
                "{what}, id {target:?}"
            );
        }
    }
    for target in [UNKNOWN_ID, "sess-does-not-exist", ""] {
        assert_code(
            served.append(target, &[1, TINY_VOCAB]),
            RpcStatusCode::INVALID_ARGUMENT,
            &format!("token outside the vocabulary, id {target:?}"),
        );
    }
    let info = served.info(&id).expect("info");
    assert_eq!(info.get_history_length(), 3, "nothing changed");
    assert_eq!(info.get_logits_digest(), digest);
    assert!(!info.get_busy());
    served.stop();
}

#[test]
fn a_temperature_below_the_bound_names_it_and_the_bound_itself_samples() {
    let served = Served::tiny(1);
    let id = served.create("tiny-temperature", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let mut req = gen_req(&id, 2);
    req.set_temperature(1e-45);
    let outcome = served.generate(req).finish(STREAM_TIMEOUT);
    let status = outcome.failure();
    assert_eq!(status.code, RpcStatusCode::INVALID_ARGUMENT, "{status:?}");
    assert!(status.message.contains("0.00001"), "{status:?}");
    // At the bound it samples (from the argmax or its ties), never failing.
    let mut req = seeded_req(&id, 8, Some(7));
    req.set_temperature(inferd::sampler::MIN_TEMPERATURE);
    let (tokens, _) = served.run(req);
    assert_eq!(tokens.len(), 8);
    served.stop();
}

#[test]
fn a_request_body_that_does_not_parse_is_invalid_argument_on_every_method() {
    let served = Served::tiny(1);
    let runaway_varint = [&b"\x10"[..], &[0xff; 11], b"\x01"].concat();
    let bodies: [(&str, &[u8]); 5] = [
        ("garbage (field number 0)", b"\x00\x01\x02\x03"),
        ("a varint of 12 bytes", &runaway_varint),
        ("a truncated varint", b"\x10\x80"),
        ("field 1 as a fixed32", b"\x0d\x00\x00\x00\x00"),
        ("field 1 not UTF-8", b"\x0a\x02\xff\xfe"),
    ];
    for (method, ty, request_type) in RUNTIME_METHODS {
        for (what, body) in bodies {
            let status = served
                .raw_call(method, ty, body)
                .expect_err("a body that does not parse");
            assert_eq!(
                status.code,
                RpcStatusCode::INVALID_ARGUMENT,
                "{method} with {what}: {status:?}"
            );
            assert!(status.message.contains(request_type), "{status:?}");
        }
    }
    // Nothing was created, and well-formed bytes on the same path work.
    let stats = served.server().runtime_stats();
    assert_eq!(stats.sessions_created, 1, "only the warm-up: {stats:?}");
    let replies = served
        .raw_call(RUNTIME_METHODS[0].0, MethodType::Unary, b"")
        .expect("an empty body is a default request");
    let created =
        pb::CreateSessionResponse::parse_from_bytes(&replies[0]).expect("a response message");
    assert_eq!(created.get_session_id().len(), 32);
    assert!(served.info(created.get_session_id()).is_ok());
    served.stop();
}

/// Checks that `got` is INVALID_ARGUMENT and its message names `numbers`.
fn assert_refused<T: std::fmt::Debug>(got: Result<T, Status>, numbers: &[&str], what: &str) {
    match got {
        Err(s) => {
            assert_eq!(s.code, RpcStatusCode::INVALID_ARGUMENT, "{what}: {s:?}");
            for n in numbers {
                assert!(s.message.contains(n), "{what}: {n} missing from {s:?}");
            }
        }
        Ok(v) => panic!("{what}: expected INVALID_ARGUMENT, got {v:?}"),
    }
}

#[test]
fn fields_over_their_bounds_are_invalid_argument_and_keep_nothing() {
    use inferd::runtime::limits;
    let served = Served::tiny(1);
    let created_before = served.server().runtime_stats().sessions_created;
    // What a session keeps for its life: the label and the EOS ids.
    let long_label = "x".repeat(limits::MAX_CLIENT_LABEL_BYTES + 1);
    assert_refused(
        served.try_create(&long_label, &[]),
        &["257", "256"],
        "label",
    );
    let huge_label = "x".repeat(3_900_000);
    assert_refused(
        served.try_create(&huge_label, &[]),
        &["256"],
        "3.9 MB label",
    );
    let many_eos: Vec<u32> = (0..limits::MAX_EOS_TOKEN_IDS as u32 + 1).collect();
    assert_refused(
        served.try_create("eos", &many_eos),
        &["65", "64"],
        "EOS ids",
    );
    let huge_eos = vec![1u32; 900_000];
    assert_refused(
        served.try_create("eos", &huge_eos),
        &["900000", "64"],
        "EOS ids",
    );
    assert_eq!(
        served.server().runtime_stats().sessions_created,
        created_before,
        "no session was created"
    );
    // At the bounds, it is kept verbatim.
    let label = "é".repeat(limits::MAX_CLIENT_LABEL_BYTES / 2);
    let eos: Vec<u32> = (0..limits::MAX_EOS_TOKEN_IDS as u32).collect();
    let id = served.create(&label, &eos);
    let info = served.info(&id).expect("info");
    assert_eq!(info.get_client_label(), label);
    assert_eq!(info.get_eos_token_ids(), &eos[..]);
    served.close(&id).expect("closed");

    // One append carries at most MAX_APPEND_TOKENS ids.
    let id = served.create("bounds", &[]);
    let too_many = prompt(limits::MAX_APPEND_TOKENS + 1, 3);
    assert_refused(served.append(&id, &too_many), &["65537", "65536"], "append");
    assert_eq!(served.history(&id), 0, "nothing appended");
    served.append(&id, &[1, 2, 3]).expect("append");
    let digest = served.digest(&id);

    // Generate: stop sequences, logit bias, the penalty window.
    type Spoil = fn(&mut pb::GenerateRequest);
    let over: [(&str, &[&str], Spoil); 4] = [
        ("17 stop sequences", &["17", "16"], |r| {
            for _ in 0..=limits::MAX_STOP_SEQUENCES {
                let mut stop = pb::StopSequence::new();
                stop.set_token_ids(vec![7]);
                r.mut_stop_sequences().push(stop);
            }
        }),
        ("a stop sequence of 65 ids", &["65", "64"], |r| {
            let mut stop = pb::StopSequence::new();
            stop.set_token_ids(vec![7; limits::MAX_STOP_SEQUENCE_TOKENS + 1]);
            r.mut_stop_sequences().push(stop);
        }),
        ("1025 logit_bias entries", &["1025", "1024"], |r| {
            for _ in 0..=limits::MAX_LOGIT_BIAS_ENTRIES {
                let mut bias = pb::LogitBias::new();
                bias.set_token_id(5);
                bias.set_bias(0.5);
                r.mut_logit_bias().push(bias);
            }
        }),
        ("penalty_last_n 65537", &["65537", "65536"], |r| {
            r.set_repetition_penalty(1.1);
            r.set_penalty_last_n(limits::MAX_PENALTY_LAST_N + 1);
        }),
    ];
    for (what, numbers, spoil) in over {
        let mut req = gen_req(&id, 4);
        spoil(&mut req);
        let outcome = served.generate(req).finish(STREAM_TIMEOUT);
        assert!(outcome.tokens().is_empty(), "{what}");
        let status = outcome.failure().clone();
        assert_refused::<()>(Err(status), numbers, what);
    }
    let info = served.info(&id).expect("info");
    assert_eq!(info.get_history_length(), 3, "nothing changed");
    assert_eq!(info.get_logits_digest(), digest);

    // Every bound itself is accepted.
    let mut req = gen_req(&id, 2);
    for _ in 0..limits::MAX_STOP_SEQUENCES {
        let mut stop = pb::StopSequence::new();
        stop.set_token_ids(vec![7; limits::MAX_STOP_SEQUENCE_TOKENS]);
        req.mut_stop_sequences().push(stop);
    }
    for _ in 0..limits::MAX_LOGIT_BIAS_ENTRIES {
        let mut bias = pb::LogitBias::new();
        bias.set_token_id(5);
        bias.set_bias(0.001);
        req.mut_logit_bias().push(bias);
    }
    req.set_repetition_penalty(1.1);
    req.set_penalty_last_n(limits::MAX_PENALTY_LAST_N);
    let (tokens, _) = served.run(req);
    assert_eq!(tokens.len(), 2);
    let at_bound = prompt(limits::MAX_APPEND_TOKENS, 5);
    assert!(
        served.append(&id, &at_bound).is_ok(),
        "65536 ids in one append"
    );
    served.stop();
}

#[test]
fn kv_exhaustion_is_resource_exhausted_with_the_numbers_and_changes_nothing() {
    // Tiny model: 256 bytes per position, 4096 per 16 positions over its
    // two layers (a page holds one layer's 16 positions).
    let served = Served::start(
        tiny_model(),
        loopback(RuntimeConfig {
            kv_bytes: 4 * 4096,
            ..runtime_config(1)
        }),
    );
    assert_eq!(served.server().runtime_stats().kv_total_pages, 8);
    let id = served.create("big", &[]);
    served.append(&id, &[1, 2]).expect("append");
    let err = served.append(&id, &prompt(100, 2)).expect_err("too big");
    assert_eq!(err.code, RpcStatusCode::RESOURCE_EXHAUSTED, "{err:?}");
    assert!(
        err.message.contains("KV pages exhausted: 12 asked, 6 free"),
        "how much was asked and how much is free: {err:?}"
    );
    assert_eq!(served.history(&id), 2, "the failed append changed nothing");
    assert_eq!(served.append(&id, &[3]).expect("append"), 3);
    served.stop();
}

#[test]
fn a_full_session_queue_is_resource_exhausted_with_the_numbers() {
    let served = Served::start(
        slow_model(),
        loopback(RuntimeConfig {
            session_queue: 1,
            ..runtime_config(1)
        }),
    );
    let id = served.create("queue", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let mut busy = served.generate(gen_req(&id, 4000));
    busy.first_token(STREAM_TIMEOUT);
    let queued = {
        let client = served.client.clone();
        let (id, opt) = (id.clone(), served.opt());
        thread::spawn(move || {
            let mut req = pb::AppendTokensRequest::new();
            req.set_session_id(id);
            req.set_token_ids(vec![7]);
            client.append_tokens_opt(&req, opt).map_err(status_of)
        })
    };
    // Until the first append sits in the queue, a second one would be taken
    // in its place; wait for the worker to hold it.
    thread::sleep(Duration::from_millis(200));
    let err = served.append(&id, &[8]).expect_err("queue full");
    assert_eq!(err.code, RpcStatusCode::RESOURCE_EXHAUSTED, "{err:?}");
    assert!(
        err.message
            .contains("session wait queue exhausted: 2 asked, 0 free"),
        "{err:?}"
    );
    busy.cancel();
    let queued = queued.join().expect("thread").expect("queued append ran");
    assert!(queued.get_history_length() > 4);
    served.stop();
}

// ------------------------------------------------------- §2.1 EOS, §2.7 --

#[test]
fn eos_is_emitted_counted_committed_then_done() {
    let served = Served::tiny(1);
    let probe = served.create("probe", &[]);
    served.append(&probe, &[5, 6, 7]).expect("append");
    let (first, _) = served.run(gen_req(&probe, 1));
    let eos = first[0];
    let id = served.create("eos", &[eos]);
    served.append(&id, &[5, 6, 7]).expect("append");
    let (tokens, done) = served.run(gen_req(&id, 10));
    assert_eq!(tokens, vec![eos], "the EOS token itself is emitted");
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_EOS);
    assert_eq!(done.get_generated_token_count(), 1, "and counted");
    assert_eq!(done.get_history_length(), 4);
    assert_eq!(served.history(&id), 4, "and committed");
    served.stop();
}

#[test]
fn max_tokens_ends_with_one_done_and_every_token_committed() {
    let served = Served::tiny(1);
    let id = served.create("max", &[]);
    served.append(&id, &prompt(10, 1)).expect("append");
    for round in 0..3u64 {
        let before = served.history(&id);
        let outcome = served.generate(gen_req(&id, 7)).finish(STREAM_TIMEOUT);
        let done = outcome.done();
        assert_eq!(outcome.tokens().len(), 7);
        assert!(
            outcome.messages.iter().all(|m| !m.has_truncated()),
            "round {round}"
        );
        assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_MAX_TOKENS);
        assert_eq!(done.get_generated_token_count(), 7);
        assert_eq!(done.get_history_length(), before + 7);
        assert!(done.get_total_duration_seconds() > 0.0);
        assert!(done.get_total_duration_seconds() >= done.get_prefill_duration_seconds());
        let info = served.info(&id).expect("info");
        assert_eq!(info.get_history_length(), before + 7);
        // The invariant counters are reported, and zero.
        assert_eq!(info.get_cache_invariant_inv1_violations(), 0);
        assert_eq!(info.get_cache_invariant_inv2_violations(), 0);
        assert!(info.get_kv_pages_held() >= 1);
        assert_eq!(
            info.get_kv_live_bytes(),
            info.get_history_length() * 256,
            "tiny model: 256 KV bytes per position"
        );
        assert_eq!(info.get_kv_page_bytes(), 2048, "one layer's 16 positions");
        assert!(!info.get_busy());
    }
    let stats = served.server().runtime_stats();
    assert_eq!((stats.inv1_violations, stats.inv2_violations), (0, 0));
    served.stop();
}

// ---------------------------------------------------------------- §2.2 --

/// How a session's history is built.
#[derive(Clone, Copy, Debug)]
enum Build {
    OneAppend,
    TokenByToken,
    RandomChunks(u64),
    /// `prefix` appended, the rest generated greedily (the history must be
    /// that greedy continuation).
    PartlyGenerated {
        prefix: usize,
    },
}

/// What must be identical however the history was built: the digest, a
/// greedy continuation, the digest after it, a seeded continuation, the
/// digest after that.
#[derive(Debug, PartialEq, Eq)]
struct Fingerprint {
    digest: u64,
    greedy: Vec<u32>,
    digest_after_greedy: u64,
    seeded: Vec<u32>,
    digest_after_seeded: u64,
}

fn build_history(served: &Served, id: &str, history: &[u32], build: Build) {
    match build {
        Build::OneAppend => {
            served.append(id, history).expect("append");
        }
        Build::TokenByToken => {
            for &t in history {
                served.append(id, &[t]).expect("append");
            }
        }
        Build::RandomChunks(seed) => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut at = 0;
            while at < history.len() {
                let n = rng.gen_range(1..=13).min(history.len() - at);
                served.append(id, &history[at..at + n]).expect("append");
                at += n;
            }
        }
        Build::PartlyGenerated { prefix } => {
            served.append(id, &history[..prefix]).expect("append");
            let want = (history.len() - prefix) as u32;
            let (generated, _) = served.run(gen_req(id, want));
            assert_eq!(generated, history[prefix..], "greedy continuation");
        }
    }
    assert_eq!(served.history(id), history.len() as u64, "{build:?}");
}

fn fingerprint(served: &Served, id: &str) -> Fingerprint {
    let digest = served.digest(id);
    let greedy = served.run(gen_req(id, 12)).0;
    let digest_after_greedy = served.digest(id);
    let seeded = served.run(seeded_req(id, 12, Some(1234))).0;
    Fingerprint {
        digest,
        greedy,
        digest_after_greedy,
        seeded,
        digest_after_seeded: served.digest(id),
    }
}

/// A 40-token prompt followed by its 30-token greedy continuation.
fn partly_generated_history(served: &Served) -> Vec<u32> {
    let mut history = prompt(40, 3);
    let id = served.create("history", &[]);
    served.append(&id, &history).expect("append");
    history.extend(served.run(gen_req(&id, 30)).0);
    history
}

#[test]
fn the_same_history_built_any_way_generates_the_same_bits() {
    let served = Served::tiny(1);
    let history = partly_generated_history(&served);
    let reference_id = served.create("reference", &[]);
    build_history(&served, &reference_id, &history, Build::OneAppend);
    let reference = fingerprint(&served, &reference_id);
    assert_ne!(reference.digest, 0);
    assert_ne!(reference.digest, reference.digest_after_greedy);
    assert!(
        reference.seeded.iter().any(|&t| t != reference.seeded[0]),
        "seeded sampling varies: {:?}",
        reference.seeded
    );
    for build in [
        Build::TokenByToken,
        Build::RandomChunks(1),
        Build::RandomChunks(2),
        Build::PartlyGenerated { prefix: 40 },
        Build::PartlyGenerated { prefix: 55 },
    ] {
        let id = served.create("build", &[]);
        build_history(&served, &id, &history, build);
        assert_eq!(fingerprint(&served, &id), reference, "{build:?}");
    }
    // A different history gives a different fingerprint (the check can fail).
    let other = served.create("other", &[]);
    let mut changed = history.clone();
    changed[10] = (changed[10] + 1) % TINY_VOCAB;
    build_history(&served, &other, &changed, Build::OneAppend);
    assert_ne!(fingerprint(&served, &other).digest, reference.digest);
    served.stop();
}

#[test]
fn determinism_holds_across_workers_and_with_neighbours_generating() {
    let single = Served::tiny(1);
    let history = partly_generated_history(&single);
    let id = single.create("reference", &[]);
    build_history(&single, &id, &history, Build::OneAppend);
    let reference = fingerprint(&single, &id);
    single.stop();

    let served = Served::tiny(3);
    let mut seen_workers = std::collections::HashSet::new();
    let builds = [
        Build::OneAppend,
        Build::TokenByToken,
        Build::RandomChunks(3),
        Build::PartlyGenerated { prefix: 40 },
        Build::OneAppend,
        Build::RandomChunks(4),
    ];
    for (k, build) in builds.into_iter().enumerate() {
        // Neighbours on every worker, generating while this session is
        // built and generates.
        let neighbours: Vec<Gen> = (0..3)
            .map(|j| {
                let n = served.create("neighbour", &[]);
                served
                    .append(&n, &prompt(20 + 7 * j, (k * 3 + j) as u32))
                    .expect("append");
                served.generate(seeded_req(&n, 200, Some(j as u64)))
            })
            .collect();
        let created = served.try_create("build", &[]).expect("created");
        seen_workers.insert(created.get_worker());
        let id = created.get_session_id();
        build_history(&served, id, &history, build);
        assert_eq!(
            fingerprint(&served, id),
            reference,
            "{build:?} on worker {}",
            created.get_worker()
        );
        for n in neighbours {
            let outcome = n.finish(STREAM_TIMEOUT);
            assert_eq!(outcome.tokens().len(), 200);
            outcome.done();
        }
    }
    assert!(
        seen_workers.len() >= 2,
        "sessions landed on different workers: {seen_workers:?}"
    );
    served.stop();
}

#[test]
fn reference_model_history_built_any_way_generates_the_same_tokens() {
    let Some(path) = reference_model_path() else {
        return;
    };
    let model = Arc::new(Model::load(&path).expect("reference model loads"));
    let served = Served::start(model, loopback(runtime_config(2)));
    // "The quick brown fox" style ids; any ids below the vocabulary will do.
    let history: Vec<u32> = vec![1, 504, 2365, 6354, 16438, 27003, 690, 260, 23790, 3290, 30];
    let mut results = Vec::new();
    for build in [
        Build::OneAppend,
        Build::TokenByToken,
        Build::RandomChunks(5),
    ] {
        let id = served.create("real", &[]);
        build_history(&served, &id, &history, build);
        let digest = served.digest(&id);
        let (tokens, done) = served.run(gen_req(&id, 6));
        assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_MAX_TOKENS);
        results.push((digest, tokens, served.digest(&id)));
    }
    assert_eq!(results[0].1.len(), 6);
    assert!(results.iter().all(|r| *r == results[0]), "{results:?}");
    served.stop();
}

// ---------------------------------------------------------------- §2.5 --

#[test]
fn a_second_generate_on_a_busy_session_waits_its_turn() {
    let served = Served::slow(1);
    let id = served.create("busy", &[]);
    let base = prompt(8, 1);
    served.append(&id, &base).expect("append");
    let mut first = served.generate(gen_req(&id, 120));
    first.first_token(STREAM_TIMEOUT);
    let second = served.generate(gen_req(&id, 15));
    thread::sleep(Duration::from_millis(20));
    assert!(served.info(&id).expect("info").get_busy());
    let first = first.finish(STREAM_TIMEOUT);
    let second = second.finish(STREAM_TIMEOUT);
    let (first_done, second_done) = (first.done(), second.done());
    assert_eq!(first.tokens().len(), 120);
    assert_eq!(second.tokens().len(), 15, "not rejected");
    assert_eq!(first_done.get_history_length(), 8 + 120);
    assert_eq!(second_done.get_history_length(), 8 + 120 + 15);
    // Never interleaved: the second stream is exactly the greedy
    // continuation of the history the first one left.
    let check = served.create("check", &[]);
    let mut history = base.clone();
    history.extend(first.tokens());
    served.append(&check, &history).expect("append");
    let (continued, _) = served.run(gen_req(&check, 15));
    assert_eq!(second.tokens(), continued);
    assert_eq!(served.digest(&check), served.digest(&id));
    served.stop();
}

// ---------------------------------------------------------------- §2.7 --

#[test]
fn a_generate_past_its_deadline_ends_deadline_exceeded_and_keeps_its_tokens() {
    let served = Served::slow(1);
    let id = served.create("deadline", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let t0 = Instant::now();
    let outcome = served
        .generate_with(
            gen_req(&id, 4000),
            CallOption::default().timeout(Duration::from_millis(400)),
        )
        .finish(STREAM_TIMEOUT);
    assert_eq!(outcome.failure().code, RpcStatusCode::DEADLINE_EXCEEDED);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let received = outcome.tokens().len() as u64;
    assert!(received >= 1, "some tokens came before the deadline");
    let info = served.wait_idle(&id, Duration::from_secs(2));
    let committed = info.get_history_length();
    assert!(
        committed >= 3 + received && committed < 3 + 4000,
        "{committed} committed, {received} received"
    );
    thread::sleep(Duration::from_millis(100));
    assert_eq!(served.history(&id), committed, "the work stopped");
    assert_eq!(
        served.append(&id, &[4]).expect("append"),
        committed + 1,
        "still usable"
    );
    served.stop();
}

#[test]
fn an_append_whose_deadline_passed_in_the_queue_is_never_applied() {
    let served = Served::slow(1);
    let id = served.create("late append", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    // Long enough to outlive the append's deadline on a quiet fast machine
    // too (300 tokens of this model once took under 150 ms).
    let mut long = served.generate(gen_req(&id, 3000));
    long.first_token(STREAM_TIMEOUT);
    let late = served.append_with(
        &id,
        &[9, 9],
        CallOption::default().timeout(Duration::from_millis(150)),
    );
    assert_code(late, RpcStatusCode::DEADLINE_EXCEEDED, "queued append");
    assert!(
        served.info(&id).expect("info").get_busy(),
        "the generate outlived the append's deadline"
    );
    let done = long.finish(STREAM_TIMEOUT).done();
    assert_eq!(done.get_history_length(), 3 + 3000);
    thread::sleep(Duration::from_millis(100));
    assert_eq!(served.history(&id), 3 + 3000, "the late append never ran");
    served.stop();
}

#[test]
fn a_cancelled_stream_frees_the_session_and_keeps_what_was_committed() {
    let served = Served::slow(1);
    let id = served.create("cancel", &[]);
    let base = prompt(6, 2);
    served.append(&id, &base).expect("append");
    let mut stream = served.generate(gen_req(&id, 4000));
    stream.first_token(STREAM_TIMEOUT);
    let t0 = Instant::now();
    drop(stream);
    let info = served.wait_idle(&id, Duration::from_secs(2));
    let stopped_after = t0.elapsed();
    let committed = info.get_history_length();
    assert!(
        committed > base.len() as u64 && committed < base.len() as u64 + 4000,
        "{committed}"
    );
    thread::sleep(Duration::from_millis(150));
    assert_eq!(served.history(&id), committed, "nothing runs any more");
    // What is committed is exactly the greedy continuation the worker had
    // emitted: a fresh session generating that many tokens ends up with the
    // same logits.
    let check = served.create("check", &[]);
    served.append(&check, &base).expect("append");
    served.run(gen_req(&check, (committed - base.len() as u64) as u32));
    assert_eq!(served.digest(&check), served.digest(&id));
    // And the session takes new work.
    let (tokens, done) = served.run(gen_req(&id, 3));
    assert_eq!(tokens.len(), 3);
    assert_eq!(done.get_history_length(), committed + 3);
    eprintln!("cancelled generate stopped within {stopped_after:?}");
    served.stop();
}

// ---------------------------------------------------------------- §2.6 --

#[test]
fn idle_sessions_expire_after_the_ttl_but_never_mid_call() {
    let served = Served::start(
        slow_model(),
        loopback(RuntimeConfig {
            idle_ttl: Duration::from_millis(250),
            ..runtime_config(1)
        }),
    );
    let idle = served.create("idle", &[]);
    served.append(&idle, &[1, 2, 3]).expect("append");
    let kept_fresh = served.create("fresh", &[]);
    served.append(&kept_fresh, &[1]).expect("append");
    let working = served.create("working", &[]);
    served.append(&working, &[4, 5]).expect("append");
    let long = served.generate(gen_req(&working, 1000));
    // Appends refresh the idle clock: keep one session fresh for as long as
    // the long call runs.
    thread::sleep(Duration::from_millis(20));
    while served
        .info(&working)
        .expect("never evicted mid-call")
        .get_busy()
    {
        served
            .append(&kept_fresh, &[2])
            .expect("refreshed session lives");
        thread::sleep(Duration::from_millis(50));
    }
    assert_code(served.info(&idle), RpcStatusCode::NOT_FOUND, "expired");
    assert_code(
        served.append(&idle, &[1]),
        RpcStatusCode::NOT_FOUND,
        "expired",
    );
    let done = long.finish(STREAM_TIMEOUT).done();
    assert!(
        done.get_total_duration_seconds() > 0.5,
        "the generate ran longer than the TTL ({} s)",
        done.get_total_duration_seconds()
    );
    assert_eq!(done.get_generated_token_count(), 1000);
    assert_eq!(served.history(&working), 2 + 1000, "not evicted mid-call");
    assert!(served.info(&kept_fresh).is_ok());
    let stats = served.server().runtime_stats();
    assert_eq!(stats.evicted_ttl, 1, "{stats:?}");
    assert_eq!(stats.evicted_lru, 0, "{stats:?}");
    served.stop();
}

#[test]
fn the_session_limit_evicts_the_lru_idle_session_and_never_a_busy_one() {
    let served = Served::start(
        slow_model(),
        loopback(RuntimeConfig {
            max_sessions: 2,
            ..runtime_config(1)
        }),
    );
    let a = served.create("a", &[]);
    let b = served.create("b", &[]);
    served.append(&a, &[1]).expect("append");
    served.append(&b, &[2]).expect("append");
    served.append(&a, &[3]).expect("touch a");
    let c = served.create("c", &[]);
    assert_code(served.info(&b), RpcStatusCode::NOT_FOUND, "b was the LRU");
    assert_eq!(served.history(&a), 2, "a stays");
    assert_eq!(served.server().runtime_stats().evicted_lru, 1);

    // Both sessions mid-call: nothing may be evicted.
    served.append(&c, &[4, 5]).expect("append");
    let mut gen_a = served.generate(gen_req(&a, 4000));
    let mut gen_c = served.generate(gen_req(&c, 4000));
    gen_a.first_token(STREAM_TIMEOUT);
    gen_c.first_token(STREAM_TIMEOUT);
    let err = served.try_create("d", &[]).expect_err("all sessions busy");
    assert_eq!(err.code, RpcStatusCode::RESOURCE_EXHAUSTED, "{err:?}");
    assert!(
        err.message.contains("sessions exhausted: 1 asked, 0 free"),
        "{err:?}"
    );
    assert_eq!(served.server().runtime_stats().evicted_lru, 1);
    assert!(served.info(&a).expect("a lives").get_busy());
    assert!(served.info(&c).expect("c lives").get_busy());
    drop((gen_a, gen_c));
    served.wait_idle(&a, Duration::from_secs(2));
    served.wait_idle(&c, Duration::from_secs(2));
    served.create("d", &[]);
    assert_eq!(served.server().runtime_stats().evicted_lru, 2);
    served.stop();
}

#[test]
fn kv_pressure_evicts_the_lru_idle_session() {
    let served = Served::start(
        tiny_model(),
        loopback(RuntimeConfig {
            kv_bytes: 4 * 4096,
            ..runtime_config(1)
        }),
    );
    let a = served.create("a", &[]);
    served.append(&a, &prompt(40, 1)).expect("3 pages");
    let b = served.create("b", &[]);
    served
        .append(&b, &prompt(30, 2))
        .expect("2 pages, a evicted");
    assert_code(served.info(&a), RpcStatusCode::NOT_FOUND, "evicted");
    assert_eq!(served.history(&b), 30);
    let stats = served.server().runtime_stats();
    assert_eq!((stats.evicted_lru, stats.evicted_ttl), (1, 0), "{stats:?}");
    served.stop();
}

#[test]
fn overflow_truncates_when_the_context_fills_and_says_so_there() {
    let served = Served::tiny(1);
    let id = served.create("long", &[]);
    served.append(&id, &prompt(250, 5)).expect("append");
    let outcome = served.generate(gen_req(&id, 20)).finish(STREAM_TIMEOUT);
    let done = outcome.done();
    // Six tokens fill the context of 256; only then is room made, and only
    // as much as the other 14 need.
    assert!(
        outcome.messages[..6].iter().all(|m| m.has_token_id()),
        "{:?}",
        outcome.messages
    );
    assert!(
        outcome.messages[6].has_truncated(),
        "{:?}",
        outcome.messages[6]
    );
    assert_eq!(
        outcome.messages[6]
            .get_truncated()
            .get_dropped_token_count(),
        14
    );
    assert_eq!(
        outcome
            .messages
            .iter()
            .filter(|m| m.has_truncated())
            .count(),
        1
    );
    assert_eq!(outcome.tokens().len(), 20);
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_MAX_TOKENS);
    assert_eq!(done.get_history_length(), TINY_CONTEXT);
    let info = served.info(&id).expect("info");
    assert_eq!(info.get_history_length(), TINY_CONTEXT);

    // An append past the context truncates too, and says by how much.
    let reply = served
        .append_with(&id, &prompt(10, 6), served.opt())
        .expect("append");
    assert_eq!(reply.get_history_length(), TINY_CONTEXT);
    assert_eq!(reply.get_dropped_token_count(), 10);
    let fits = served
        .append_with(&served.create("short", &[]), &[1, 2], served.opt())
        .expect("append");
    assert_eq!(fits.get_dropped_token_count(), 0);
    served.stop();
}

#[test]
fn the_stop_overflow_policy_ends_with_truncated() {
    let served = Served::start(
        tiny_model(),
        loopback(RuntimeConfig {
            overflow: OverflowPolicy::Stop,
            ..runtime_config(1)
        }),
    );
    let id = served.create("long", &[]);
    served.append(&id, &prompt(250, 5)).expect("append");
    let outcome = served.generate(gen_req(&id, 20)).finish(STREAM_TIMEOUT);
    let done = outcome.done();
    assert!(outcome.messages.iter().all(|m| !m.has_truncated()));
    assert_eq!(outcome.tokens().len(), 6);
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_TRUNCATED);
    assert_eq!(done.get_generated_token_count(), 6);
    assert_eq!(served.history(&id), TINY_CONTEXT);
    assert_code(
        served.append(&id, &[1]),
        RpcStatusCode::INVALID_ARGUMENT,
        "full",
    );
    assert_eq!(served.history(&id), TINY_CONTEXT);
    served.stop();
}

// ---------------------------------------------------------------- §2.8 --

#[test]
fn an_unset_seed_is_reported_and_reproduces_the_stream() {
    let served = Served::tiny(1);
    let run_on_fresh = |seed: Option<u64>| {
        let id = served.create("seed", &[]);
        served.append(&id, &[4, 5, 6]).expect("append");
        let (tokens, done) = served.run(seeded_req(&id, 16, seed));
        (tokens, done.get_seed_used(), served.digest(&id))
    };
    let (tokens, seed_used, digest) = run_on_fresh(None);
    assert_eq!(tokens.len(), 16);
    let replay = run_on_fresh(Some(seed_used));
    assert_eq!(replay, (tokens.clone(), seed_used, digest), "bit for bit");
    let (other_tokens, other_seed, _) = run_on_fresh(None);
    assert_ne!(other_seed, seed_used, "a fresh seed each time");
    assert_ne!(other_tokens, tokens, "and a different stream");
    let (_, fixed, _) = run_on_fresh(Some(42));
    assert_eq!(fixed, 42, "a given seed is reported as used");
    served.stop();
}

// ---------------------------------------------------------------- §2.9 --

#[test]
fn health_is_serving_for_both_names_and_not_found_otherwise() {
    let served = Served::tiny(1);
    assert_eq!(served.health_check("").expect("health"), Serving::SERVING);
    assert_eq!(
        served
            .health_check("kakeya.v1.RuntimeService")
            .expect("health"),
        Serving::SERVING
    );
    assert_code(
        served.health_check("kakeya.v1.NoSuchService"),
        RpcStatusCode::NOT_FOUND,
        "unknown service",
    );
    served.stop();
}

// --------------------------------------------------------------- §2.10 --

#[test]
fn a_bearer_token_is_required_except_for_health() {
    let mut cfg = loopback(runtime_config(1));
    cfg.auth_token = Some("s3cret-token".into());
    let served = Served::start(tiny_model(), cfg);
    let mut req = pb::CreateSessionRequest::new();
    req.set_client_label("auth".into());
    let timeout = CallOption::default().timeout(CALL_TIMEOUT);
    let none = served.client.create_session_opt(&req, timeout.clone());
    assert_code(
        none.map_err(status_of),
        RpcStatusCode::UNAUTHENTICATED,
        "no token",
    );
    let wrong = served
        .client
        .create_session_opt(&req, timeout.clone().headers(bearer("s3cret-tokem")));
    assert_code(
        wrong.map_err(status_of),
        RpcStatusCode::UNAUTHENTICATED,
        "wrong",
    );
    let prefix = served
        .client
        .create_session_opt(&req, timeout.clone().headers(bearer("s3cret")));
    assert_code(
        prefix.map_err(status_of),
        RpcStatusCode::UNAUTHENTICATED,
        "prefix",
    );
    let mut info = pb::GetSessionInfoRequest::new();
    info.set_session_id("00112233445566778899aabbccddeeff".into());
    let unauthenticated_info = served.client.get_session_info_opt(&info, timeout.clone());
    assert_code(
        unauthenticated_info.map_err(status_of),
        RpcStatusCode::UNAUTHENTICATED,
        "checked before the handler",
    );
    // The helpers send the right token.
    let id = served.create("auth", &[]);
    assert_eq!(served.append(&id, &[1, 2]).expect("append"), 2);
    let (tokens, _) = served.run(gen_req(&id, 2));
    assert_eq!(tokens.len(), 2);
    let stream = Gen::spawn(served.client.clone(), gen_req(&id, 2), timeout);
    assert_eq!(
        stream.finish(STREAM_TIMEOUT).failure().code,
        RpcStatusCode::UNAUTHENTICATED
    );
    // Health needs no token.
    assert_eq!(served.health_check("").expect("health"), Serving::SERVING);
    served.stop();
}

#[test]
fn an_open_listen_address_needs_a_token_or_an_explicit_opt_out() {
    let open = ServeConfig::new("0.0.0.0:0", runtime_config(1));
    assert!(matches!(
        open.check_security(),
        Err(ServeError::OpenListen(_))
    ));
    assert!(matches!(
        Server::start(tiny_model(), open.clone()),
        Err(ServeError::OpenListen(_))
    ));
    let mut with_token = open.clone();
    with_token.auth_token = Some("t".into());
    assert!(with_token.check_security().is_ok());
    let mut blank = open.clone();
    blank.auth_token = Some("  ".into());
    assert!(matches!(
        blank.check_security(),
        Err(ServeError::EmptyToken)
    ));
    let mut opted_out = open;
    opted_out.allow_unauthenticated = true;
    assert!(opted_out.check_security().is_ok());
    assert!(loopback(runtime_config(1)).check_security().is_ok());
    assert!(ServeConfig::new("localhost:0", runtime_config(1))
        .check_security()
        .is_ok());
}

#[test]
fn an_open_metrics_address_needs_a_token_or_an_explicit_opt_out() {
    let mut open = loopback(runtime_config(1));
    open.metrics_listen = Some("0.0.0.0:0".into());
    assert!(matches!(
        open.check_security(),
        Err(ServeError::OpenMetricsListen(ref addr)) if addr == "0.0.0.0:0"
    ));
    assert!(matches!(
        Server::start(tiny_model(), open.clone()),
        Err(ServeError::OpenMetricsListen(_))
    ));
    let mut with_token = open.clone();
    with_token.auth_token = Some("t".into());
    assert!(with_token.check_security().is_ok());
    let mut opted_out = open;
    opted_out.allow_unauthenticated = true;
    assert!(opted_out.check_security().is_ok());
    let mut local = loopback(runtime_config(1));
    local.metrics_listen = Some("127.0.0.1:0".into());
    assert!(local.check_security().is_ok());
}

#[test]
fn tls_serves_a_whole_session_and_refuses_plaintext() {
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .expect("self-signed certificate");
    let cert_pem = certified.cert.pem();
    let mut cfg = loopback(runtime_config(1));
    cfg.tls = Some(TlsIdentity {
        cert_pem: cert_pem.clone().into_bytes(),
        key_pem: certified.key_pair.serialize_pem().into_bytes(),
    });
    let server = Server::start(tiny_model(), cfg).expect("TLS server starts");
    let addr = server.addr().to_string();
    let env = client_env();
    let credentials = ChannelCredentialsBuilder::new()
        .root_cert(cert_pem.into_bytes())
        .build();
    let channel = ChannelBuilder::new(Arc::clone(&env))
        .override_ssl_target("localhost")
        .set_credentials(credentials)
        .connect(&addr);
    let secure = Served {
        client: RuntimeServiceClient::new(channel.clone()),
        raw: grpcio::Client::new(channel.clone()),
        health: HealthClient::new(channel),
        server: Some(server),
        token: None,
        _env: Arc::clone(&env),
    };
    let id = secure.create("tls", &[]);
    assert_eq!(secure.append(&id, &[1, 2, 3]).expect("append"), 3);
    let (tokens, done) = secure.run(gen_req(&id, 4));
    assert_eq!(tokens.len(), 4);
    assert_eq!(done.get_history_length(), 7);
    assert_eq!(secure.close(&id).expect("closed"), 7);

    let plain = RuntimeServiceClient::new(ChannelBuilder::new(env).connect(&addr));
    let got = plain.create_session_opt(
        &pb::CreateSessionRequest::new(),
        CallOption::default().timeout(Duration::from_secs(3)),
    );
    let err = got.map_err(status_of).expect_err("plaintext is refused");
    assert_ne!(err.code, RpcStatusCode::OK);
    secure.stop();
}

// ------------------------------------------------------ graceful shutdown --

#[test]
fn shutdown_lets_a_running_stream_finish_and_refuses_new_calls() {
    let mut served = Served::slow(1);
    let id = served.create("drain", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let started = Instant::now();
    let mut running = served.generate(gen_req(&id, 250));
    running.first_token(STREAM_TIMEOUT);
    let shutdown_after = started.elapsed().as_secs_f64();
    let server = served.server.take().expect("server");
    let (report_tx, report_rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = report_tx.send(server.shutdown(Duration::from_secs(20)));
    });
    // Shutdown has begun once health leaves SERVING (or stops answering).
    let t0 = Instant::now();
    while matches!(served.health_check(""), Ok(Serving::SERVING)) {
        assert!(t0.elapsed() < Duration::from_secs(5), "never left SERVING");
        thread::sleep(Duration::from_millis(5));
    }
    thread::sleep(Duration::from_millis(50));
    let late = served.try_create("late", &[]);
    match late {
        Err(s) => {
            eprintln!("a call after shutdown began: {s:?}");
            assert!(
                matches!(
                    s.code,
                    RpcStatusCode::UNAVAILABLE | RpcStatusCode::DEADLINE_EXCEEDED
                ),
                "refused or unreachable: {s:?}"
            )
        }
        Ok(r) => panic!("a call after shutdown began was served: {r:?}"),
    }
    let outcome = running.finish(STREAM_TIMEOUT);
    let done = outcome.done();
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_MAX_TOKENS);
    assert_eq!(outcome.tokens().len(), 250);
    assert!(
        done.get_total_duration_seconds() > shutdown_after,
        "the generate was still running when shutdown began ({} s vs {shutdown_after} s)",
        done.get_total_duration_seconds()
    );
    let report = report_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("shutdown returns");
    assert!(report.drained, "{report:?}");
}

/// Reads lines of a child's stream on a thread.
fn line_reader(stream: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

#[test]
fn sigterm_drains_the_real_process_and_it_exits_zero() {
    let Some(model) = reference_model_path() else {
        return;
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args(["serve", "--listen", "127.0.0.1:0", "--workers", "1"])
        .args(["--drain-timeout", "30", "--kv-mib", "64", "--model"])
        .arg(&model)
        .env_remove("INFERD_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("inferd serve starts");
    /// Kills the child if the test fails before it exits.
    struct Reaper(Option<std::process::Child>);
    impl Drop for Reaper {
        fn drop(&mut self) {
            if let Some(child) = self.0.as_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
    let stdout = line_reader(child.stdout.take().expect("stdout"));
    let stderr = line_reader(child.stderr.take().expect("stderr"));
    let pid = child.id().to_string();
    let mut reaper = Reaper(Some(child));
    let logs = |stderr: &mpsc::Receiver<String>| stderr.try_iter().collect::<Vec<_>>().join("\n");

    let line = stdout
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("no `listening on` line; stderr:\n{}", logs(&stderr)));
    let addr = line
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    let env = client_env();
    let client = RuntimeServiceClient::new(ChannelBuilder::new(env).connect(&addr));
    let opt = CallOption::default().timeout(CALL_TIMEOUT);
    let id = client
        .create_session_opt(&pb::CreateSessionRequest::new(), opt.clone())
        .expect("created")
        .take_session_id();
    let mut append = pb::AppendTokensRequest::new();
    append.set_session_id(id.clone());
    append.set_token_ids(vec![1, 504, 2365, 6354]);
    client
        .append_tokens_opt(&append, opt.clone())
        .expect("append");
    let started = Instant::now();
    let mut running = Gen::spawn(client.clone(), gen_req(&id, 120), opt);
    running.first_token(STREAM_TIMEOUT);
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let t0 = Instant::now();
    let signalled_after = t0.duration_since(started).as_secs_f64();
    let outcome = running.finish(STREAM_TIMEOUT);
    let done = outcome.done();
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_MAX_TOKENS);
    assert_eq!(outcome.tokens().len(), 120);
    assert!(
        done.get_total_duration_seconds() > signalled_after,
        "the generate was still running when the signal came ({} s vs {signalled_after} s)",
        done.get_total_duration_seconds()
    );
    let child = reaper.0.as_mut().expect("child");
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(35),
            "no exit within the drain timeout; stderr:\n{}",
            logs(&stderr)
        );
        thread::sleep(Duration::from_millis(20));
    };
    reaper.0 = None;
    assert_eq!(status.code(), Some(0), "stderr:\n{}", logs(&stderr));
}

#[test]
fn a_stop_sequence_ends_the_stream_with_eos_after_it_is_emitted() {
    let served = Served::tiny(1);
    let probe = served.create("probe", &[]);
    served.append(&probe, &[9, 8]).expect("append");
    let (free, _) = served.run(seeded_req(&probe, 8, Some(99)));
    let stop = free[3..5].to_vec();
    let first_end = (2..=free.len())
        .find(|&k| free[..k].ends_with(&stop))
        .expect("the sequence occurs");
    let id = served.create("stop", &[]);
    served.append(&id, &[9, 8]).expect("append");
    let mut req = seeded_req(&id, 8, Some(99));
    for seq in [vec![319, 319, 319], stop] {
        let mut s = pb::StopSequence::new();
        s.set_token_ids(seq);
        req.mut_stop_sequences().push(s);
    }
    let (tokens, done) = served.run(req);
    assert_eq!(tokens, free[..first_end].to_vec(), "emitted, then stopped");
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_EOS);
    assert_eq!(served.history(&id), 2 + first_end as u64);
    served.stop();
}

#[test]
fn generate_done_names_the_stop_sequence_that_ended_it() {
    let served = Served::tiny(1);
    let id = served.create("stop", &[]);
    served.append(&id, &[9, 8]).expect("append");
    let (free, _) = served.run(gen_req(&id, 2));
    let id = served.create("stop", &[]);
    served.append(&id, &[9, 8]).expect("append");
    let mut req = gen_req(&id, 8);
    for seq in [vec![319, 319], vec![free[0]]] {
        let mut s = pb::StopSequence::new();
        s.set_token_ids(seq);
        req.mut_stop_sequences().push(s);
    }
    let (_, done) = served.run(req);
    assert!(done.has_stop_sequence_index());
    assert_eq!(done.get_stop_sequence_index(), 1);
    served.stop();
}

#[test]
fn generate_done_counts_the_re_prefilled_tokens_of_a_truncation() {
    let served = Served::tiny(1);
    let id = served.create("long", &[]);
    served.append(&id, &prompt(250, 5)).expect("append");
    let (_, done) = served.run(gen_req(&id, 20));
    // When the context filled after 6 tokens, the 4 sink tokens and the
    // 238 most recent were computed again.
    assert_eq!(done.get_prefill_token_count(), 242);
    served.stop();
}

#[test]
fn top_logprobs_follow_every_token() {
    let served = Served::tiny(1);
    let id = served.create("logprobs", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let mut req = gen_req(&id, 3);
    req.set_top_logprobs(2);
    let outcome = served.generate(req).finish(STREAM_TIMEOUT);
    outcome.done();
    // Token, then its report, for every token.
    let payloads: Vec<_> = outcome
        .messages
        .iter()
        .filter(|m| m.has_token_id() || m.has_logprobs())
        .collect();
    assert_eq!(payloads.len(), 6);
    for pair in payloads.chunks(2) {
        assert!(pair[0].has_token_id() && pair[1].has_logprobs());
        let report = pair[1].get_logprobs();
        assert_eq!(report.get_chosen().get_token_id(), pair[0].get_token_id());
        let top = report.get_top();
        assert_eq!(top.len(), 2);
        assert!(top[0].get_logprob() >= top[1].get_logprob());
        assert!(top.iter().all(|t| t.get_logprob() <= 0.0));
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0].get_token_id(), pair[0].get_token_id());
        assert_eq!(top[0].get_logprob(), report.get_chosen().get_logprob());
    }
    served.stop();
}

#[test]
fn too_many_top_logprobs_are_refused() {
    let served = Served::tiny(1);
    let id = served.create("logprobs-refused", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let mut req = gen_req(&id, 3);
    req.set_top_logprobs(21);
    let outcome = served.generate(req).finish(STREAM_TIMEOUT);
    assert!(outcome.messages.is_empty(), "nothing may be generated");
    let status = outcome.failure();
    assert_eq!(status.code, RpcStatusCode::INVALID_ARGUMENT, "{status:?}");
    served.stop();
}
