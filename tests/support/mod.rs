//! What the tests of a split model share: `inferd` processes that say where
//! they listen, a stock grpcio client of `kakeya.v1.RuntimeService`, and a
//! Prometheus scrape. Every wait is bounded. `golden`: what the tests
//! against llama.cpp's golden vectors share; `postgres`: a PostgreSQL
//! server of a test's own; `haproxy`: HAProxy on the shipped replica
//! configuration; `replicas`: `inferd serve --session-store` processes;
//! `cutter`: a relay that cuts a PostgreSQL connection after a statement.

#![allow(dead_code)]

pub mod cutter;
pub mod durable;
pub mod golden;
pub mod haproxy;
pub mod postgres;
pub mod replicas;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use grpcio::{CallOption, ChannelBuilder, EnvBuilder, Environment, RpcStatusCode};

use inferd::proto::inferd_session_v1::session_service as ext;
use inferd::proto::inferd_session_v1::session_service_grpc::SessionServiceClient;
use inferd::proto::kakeya_v1::runtime as pb;
use inferd::proto::kakeya_v1::runtime_grpc::RuntimeServiceClient;

pub const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The synthetic model the runtime, engine and server tests share: the
/// tiny llama shape in Q4_1 with a tied output, built once per test binary.
/// It runs through the real loader and forward pass.
pub fn tiny_model() -> Arc<inferd::model::Model> {
    use inferd::gguf::synthetic::SyntheticLlama;
    use inferd::gguf::GgufFile;
    use inferd::model::Model;
    use inferd::quant::GgmlType;
    static MODEL: std::sync::OnceLock<Arc<Model>> = std::sync::OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| {
        let cfg = SyntheticLlama {
            weight_type: GgmlType::Q4_1,
            tied_output: true,
            ..SyntheticLlama::tiny()
        };
        let file = GgufFile::from_bytes(cfg.build()).expect("synthetic model parses");
        Arc::new(Model::from_gguf(Arc::new(file)).expect("synthetic model loads"))
    }))
}
/// The three-layer synthetic llama the determinism tests of both backends
/// share (hidden 128, 4 query heads over 2 KV heads, vocabulary 384).
pub fn small_llama(
    weight_type: inferd::quant::GgmlType,
    tied_output: bool,
) -> inferd::gguf::synthetic::SyntheticLlama {
    inferd::gguf::synthetic::SyntheticLlama {
        n_layers: 3,
        hidden: 128,
        n_heads: 4,
        n_kv_heads: 2,
        ffn: 256,
        vocab: 384,
        context: 512,
        rope_base: 10_000.0,
        weight_type,
        tied_output,
        seed: 7,
    }
}

/// `inferd serve` of `model` on a free loopback port, with two workers
/// and the CPU sampler, and `extra` arguments.
pub fn serve_model(model: &str, extra: &[&str]) -> Inferd {
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--model",
        model,
        "--workers",
        "2",
        "--sampler",
        "cpu",
    ];
    args.extend_from_slice(extra);
    Inferd::start(&args)
}

/// Upper bound of any unary call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Upper bound of any Generate stream.
pub const STREAM_TIMEOUT: Duration = Duration::from_secs(120);

/// Gemma 3 270M (base), with sliding-window layers (`scripts/fetch-model
/// gemma3-270m`).
pub const GEMMA: &str = "models/gemma-3-270m-q4_k_m.gguf";

/// Whether Gemma 3 270M is here; under `INFERD_REQUIRE_MODELS` its absence
/// fails the test instead of skipping it.
pub fn have_gemma() -> bool {
    let here = std::path::Path::new(GEMMA).exists();
    if !here {
        assert!(
            std::env::var_os("INFERD_REQUIRE_MODELS").is_none(),
            "{GEMMA} is missing (scripts/fetch-model gemma3-270m)"
        );
        eprintln!("\n!!! SKIPPED: {GEMMA} is missing (scripts/fetch-model gemma3-270m)\n");
    }
    here
}

/// Whether the reference model is here; says so loudly when it is not.
pub fn have_reference() -> bool {
    let here = std::path::Path::new(REFERENCE).exists();
    if !here {
        eprintln!("\n!!! SKIPPED: {REFERENCE} is missing (scripts/fetch-model)\n");
    }
    here
}

/// An `inferd` process, killed and reaped however the test ends.
pub struct Inferd {
    child: Option<Child>,
    /// What it printed after `listening on `.
    pub addr: String,
    /// What it printed after `metrics on `, if anything.
    pub metrics: Option<String>,
    /// What it printed after `http on `, if anything.
    pub http: Option<String>,
}

impl Inferd {
    /// Starts `inferd ARGS` (under `prefix`, e.g. `ip netns exec NS`, when
    /// given) and waits for its `listening on` line (and its `metrics on`
    /// line when `--metrics-listen` is among the arguments).
    pub fn start_with(prefix: &[&str], args: &[&str]) -> Inferd {
        Inferd::start_full(prefix, args, &[])
    }

    /// As [`Inferd::start_with`], with these environment variables set and
    /// every other `INFERD_*` variable of the test's environment removed.
    pub fn start_full(prefix: &[&str], args: &[&str], envs: &[(String, String)]) -> Inferd {
        let bin = env!("CARGO_BIN_EXE_inferd");
        let mut command = match prefix.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("INFERD_") {
                command.env_remove(key);
            }
        }
        let mut child = command
            .args(args)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start inferd");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let wants_metrics = args.contains(&"--metrics-listen");
        let wants_http = args.contains(&"--http-listen");
        let mut process = Inferd {
            child: Some(child),
            addr: String::new(),
            metrics: None,
            http: None,
        };
        while process.addr.is_empty()
            || (wants_metrics && process.metrics.is_none())
            || (wants_http && process.http.is_none())
        {
            let line = rx
                .recv_timeout(Duration::from_secs(90))
                .unwrap_or_else(|_| panic!("inferd {args:?} never said where it listens"));
            if let Some(addr) = line.strip_prefix("listening on ") {
                process.addr = addr.to_owned();
            } else if let Some(addr) = line.strip_prefix("metrics on ") {
                process.metrics = Some(addr.to_owned());
            } else if let Some(addr) = line.strip_prefix("http on ") {
                process.http = Some(addr.to_owned());
            }
        }
        process
    }

    pub fn start(args: &[&str]) -> Inferd {
        Inferd::start_with(&[], args)
    }

    /// `inferd shard` for `layers` of the reference model.
    pub fn shard(layers: &str, listen: &str) -> Inferd {
        Inferd::start(&shard_args(layers, listen))
    }

    /// One shard per layer range of the reference model on loopback, and
    /// their addresses as `serve --shards` takes them.
    pub fn shards(ranges: &[&str]) -> (Vec<Inferd>, String) {
        let shards: Vec<Inferd> = (ranges.iter())
            .map(|layers| Inferd::shard(layers, "127.0.0.1:0"))
            .collect();
        let list = shards.iter().map(|s| s.addr.as_str()).collect::<Vec<_>>();
        let list = list.join(",");
        (shards, list)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("ADDR:PORT")
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `signal` (a name for `kill -s`, e.g. `TERM`) to the process.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid().expect("the process runs");
        let sent = Command::new("kill")
            .args(["-s", signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -s {signal} {pid} failed");
    }

    /// Waits up to `within` for the process to exit; its exit code (`None`
    /// if a signal ended it), or `Err` if it still runs.
    pub fn wait_exit(&mut self, within: Duration) -> Result<Option<i32>, ()> {
        let end = Instant::now() + within;
        let child = self.child.as_mut().expect("the process runs");
        loop {
            if let Some(status) = child.try_wait().expect("wait for inferd") {
                self.child = None;
                return Ok(status.code());
            }
            if Instant::now() >= end {
                return Err(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: no goodbye to anyone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Inferd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The arguments of `inferd shard` for `layers` of the reference model.
pub fn shard_args(layers: &str, listen: &str) -> Vec<&'static str> {
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    vec![
        "shard",
        "--model",
        REFERENCE,
        "--layers",
        leak(layers.to_owned()),
        "--listen",
        leak(listen.to_owned()),
        "--kv-mib",
        "32",
        "--threads",
        "1",
    ]
}

/// The body of `GET /metrics` at `addr`.
pub fn scrape(addr: &str) -> String {
    scrape_as(addr, None)
}

/// [`scrape`] sending `token` as a bearer token (a server with tokens).
pub fn scrape_as(addr: &str, token: Option<&str>) -> String {
    let mut stream = TcpStream::connect(addr).expect("metrics endpoint");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: x\r\n{auth}\r\n").expect("request");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("response");
    text.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

/// The value of the sample whose line starts with `prefix` (a name and
/// labels, written as rendered).
pub fn sample(metrics: &str, prefix: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(prefix) && l[prefix.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// How a call failed.
pub type Status = (RpcStatusCode, String);

fn status_of(err: grpcio::Error) -> Status {
    match err {
        grpcio::Error::RpcFailure(s) => (s.code(), s.message().to_owned()),
        other => (RpcStatusCode::UNKNOWN, other.to_string()),
    }
}

/// Everything a Generate sent, and how it ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Generated {
    pub tokens: Vec<u32>,
    /// Bits of every log-probability reported, in order.
    pub logprob_bits: Vec<(u32, u32)>,
    pub done: Option<(i32, u64)>,
    pub error: Option<(i32, String)>,
}

/// A stock client of `kakeya.v1.RuntimeService`.
#[derive(Clone)]
pub struct Client {
    pub rpc: RuntimeServiceClient,
    /// The extension service (ForkSession) on the same channel.
    pub sessions: SessionServiceClient,
    _env: Arc<Environment>,
}

impl Client {
    pub fn connect(addr: &str) -> Client {
        let env = Arc::new(EnvBuilder::new().cq_count(1).build());
        let channel = ChannelBuilder::new(Arc::clone(&env)).connect(addr);
        Client {
            rpc: RuntimeServiceClient::new(channel.clone()),
            sessions: SessionServiceClient::new(channel),
            _env: env,
        }
    }

    fn opt() -> CallOption {
        CallOption::default().timeout(CALL_TIMEOUT)
    }

    pub fn create(&self) -> String {
        self.try_create().expect("session created")
    }

    /// CreateSession, its failure returned.
    pub fn try_create(&self) -> Result<String, Status> {
        let mut req = pb::CreateSessionRequest::new();
        req.set_client_label("split-model test".into());
        self.rpc
            .create_session_opt(&req, Self::opt())
            .map(|mut reply| reply.take_session_id())
            .map_err(status_of)
    }

    pub fn append(&self, id: &str, tokens: &[u32]) -> Result<u64, Status> {
        let mut req = pb::AppendTokensRequest::new();
        req.set_session_id(id.into());
        req.set_token_ids(tokens.to_vec());
        self.rpc
            .append_tokens_opt(&req, Self::opt())
            .map(|r| r.get_history_length())
            .map_err(status_of)
    }

    /// ForkSession of `id`'s first `at` tokens; the fork's id.
    pub fn fork(&self, id: &str, at: u64) -> String {
        self.try_fork(id, Some(at)).expect("session forked")
    }

    /// ForkSession of `id`'s first `at` tokens (all of them when `None`),
    /// its failure returned.
    pub fn try_fork(&self, id: &str, at: Option<u64>) -> Result<String, Status> {
        let mut req = ext::ForkSessionRequest::new();
        req.set_session_id(id.into());
        if let Some(at) = at {
            req.set_at_length(at);
        }
        self.sessions
            .fork_session_opt(&req, Self::opt())
            .map(|mut reply| reply.take_session_id())
            .map_err(status_of)
    }

    pub fn info(&self, id: &str) -> Result<pb::GetSessionInfoResponse, Status> {
        let mut req = pb::GetSessionInfoRequest::new();
        req.set_session_id(id.into());
        self.rpc
            .get_session_info_opt(&req, Self::opt())
            .map_err(status_of)
    }

    pub fn close(&self, id: &str) -> Result<u64, Status> {
        let mut req = pb::CloseSessionRequest::new();
        req.set_session_id(id.into());
        self.rpc
            .close_session_opt(&req, Self::opt())
            .map(|r| r.get_final_history_length())
            .map_err(status_of)
    }

    /// Runs a Generate to its end; `stop_after` drops the stream (a client
    /// cancel) after that many tokens, and `on_token` sees each token as it
    /// arrives.
    pub fn generate_watching(
        &self,
        req: &pb::GenerateRequest,
        stop_after: Option<usize>,
        mut on_token: impl FnMut(usize),
    ) -> Generated {
        let mut out = Generated::default();
        let mut stream = match self
            .rpc
            .generate_opt(req, CallOption::default().timeout(STREAM_TIMEOUT))
        {
            Ok(stream) => stream,
            Err(e) => {
                let (code, message) = status_of(e);
                out.error = Some((code.into(), message));
                return out;
            }
        };
        while let Some(item) = futures_executor::block_on(stream.next()) {
            match item {
                Ok(mut msg) => {
                    if msg.has_logprobs() {
                        let l = msg.take_logprobs();
                        let chosen = l.get_chosen();
                        out.logprob_bits
                            .push((chosen.get_token_id(), chosen.get_logprob().to_bits()));
                        for t in l.get_top() {
                            out.logprob_bits
                                .push((t.get_token_id(), t.get_logprob().to_bits()));
                        }
                    } else if msg.has_done() {
                        let d = msg.get_done();
                        out.done = Some((d.get_stop_reason() as i32, d.get_history_length()));
                    } else if !msg.has_truncated() {
                        out.tokens.push(msg.get_token_id());
                        on_token(out.tokens.len());
                        if stop_after == Some(out.tokens.len()) {
                            return out;
                        }
                    }
                }
                Err(e) => {
                    let (code, message) = status_of(e);
                    out.error = Some((code.into(), message));
                    break;
                }
            }
        }
        out
    }

    pub fn generate(&self, req: &pb::GenerateRequest) -> Generated {
        self.generate_watching(req, None, |_| {})
    }
}

/// A greedy Generate of `n` tokens reporting `top` log-probabilities.
pub fn greedy(id: &str, n: u32, top: u32) -> pb::GenerateRequest {
    let mut req = pb::GenerateRequest::new();
    req.set_session_id(id.into());
    req.set_max_tokens(n);
    req.set_top_logprobs(top);
    req
}

/// A seeded Generate through the whole sampling chain.
pub fn seeded(id: &str, n: u32, seed: u64) -> pb::GenerateRequest {
    let mut req = greedy(id, n, 0);
    req.set_seed(seed);
    req.set_temperature(0.8);
    req.set_top_p(0.9);
    req.set_top_k(40);
    req.set_repetition_penalty(1.1);
    req
}

/// Repeats `call` while it fails with UNAVAILABLE before any token, for at
/// most `within`: what a client does while a host is coming back.
pub fn retry_unavailable(within: Duration, mut call: impl FnMut() -> Generated) -> Generated {
    let t0 = Instant::now();
    loop {
        let got = call();
        match &got.error {
            Some((code, _))
                if *code == i32::from(RpcStatusCode::UNAVAILABLE)
                    && got.tokens.is_empty()
                    && t0.elapsed() < within =>
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            _ => return got,
        }
    }
}

/// Where scripts/fetch-vocabs puts llama.cpp's vocabulary files and chat
/// templates.
pub fn vocab_dir() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("INFERD_VOCAB_DIR") {
        return std::path::PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| ".".into(), std::path::PathBuf::from);
    home.join(".cache/inferd/vocabs")
}

/// Whether missing vocabulary files fail a test (CI, scripts/test) rather
/// than skip it loudly.
pub fn vocabs_required() -> bool {
    ["CI", "INFERD_REQUIRE_VOCABS"]
        .iter()
        .any(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty() && v != "0"))
}

/// The virtualenv's python, made by scripts/python-env; None (after saying
/// so loudly) when this machine has no python3 at all.
pub fn python_env() -> Option<std::path::PathBuf> {
    let has_python = std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_python {
        eprintln!(
            "SKIPPED (LOUDLY): python3 is not installed, so the stock-client interop test \
             did not run; scripts/setup installs it"
        );
        return None;
    }
    let out = std::process::Command::new("scripts/python-env")
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run scripts/python-env");
    assert!(
        out.status.success(),
        "scripts/python-env failed (exit {:?}); it needs pip access to PyPI the first time",
        out.status.code()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let python = std::path::PathBuf::from(stdout.lines().next_back().unwrap_or_default().trim());
    assert!(
        python.is_file(),
        "scripts/python-env printed {python:?}, which is not a file"
    );
    Some(python)
}

/// Runs `scripts/NAME` (its progress goes to stderr) and returns the last
/// line it printed on stdout (a path), or `None` when it failed.
pub fn script_output(name: &str) -> Option<String> {
    let out = std::process::Command::new(format!("scripts/{name}"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("run scripts/{name}: {e}"));
    if !out.status.success() {
        eprintln!("scripts/{name} failed (exit {:?})", out.status.code());
        return None;
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    Some(
        stdout
            .lines()
            .next_back()
            .unwrap_or_default()
            .trim()
            .to_owned(),
    )
}

/// Runs a client program to its end; it must exit 0 and print `done`.
/// Returns its stdout (also shown, for the test log).
pub fn run_client(what: &str, command: &mut std::process::Command, done: &str) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("run the {what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the {what} failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains(done), "{stdout}");
    eprintln!("{stdout}");
    stdout
}
