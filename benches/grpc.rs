//! What the gRPC front end costs, measured through the real grpcio client
//! against an in-process server on the reference model:
//!
//! 1. unary latency (p50/p99) of CreateSession and GetSessionInfo, next to
//!    a bare grpcio server in the same process whose handlers answer at once
//!    with the same message types (the transport's floor);
//! 2. time to first token and decode tokens/s of one session through gRPC
//!    (one worker) next to the engine alone on one thread;
//! 3. aggregate decode tokens/s with 1, 4 and 16 sessions generating at
//!    once, with 1 and 2 workers.
//!
//! A plain `main` that prints markdown tables (criterion's sampling does not
//! fit streams and concurrent sessions). `cargo bench --bench grpc` runs it;
//! `-- --quick` makes every count small for a smoke run, `-- --only
//! unary|single|concurrent` runs one section. Skips (with a
//! message) when the reference model is absent.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_executor::block_on;
use futures_util::future::join_all;
use futures_util::StreamExt;
use grpcio::{
    ChannelBuilder, Environment, RpcContext, ServerBuilder, ServerCredentials, UnarySink,
};

use inferd::engine::{Engine, EngineConfig};
use inferd::model::Model;
use inferd::proto::grpc_health_v1::health::HealthCheckRequest;
use inferd::proto::grpc_health_v1::health_grpc::HealthClient;
use inferd::proto::kakeya_v1::runtime as pb;
use inferd::proto::kakeya_v1::runtime_grpc::{
    create_runtime_service, RuntimeService, RuntimeServiceClient,
};
use inferd::runtime::RuntimeConfig;
use inferd::sampler::SamplingParams;
use inferd::server::{ServeConfig, Server};

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// How much of everything to do.
struct Plan {
    unary_calls: usize,
    unary_warmup: usize,
    prompt_tokens: usize,
    gen_tokens: u32,
    single_reps: usize,
    concurrent_prompt: usize,
    concurrent_gen: u32,
    concurrent_reps: usize,
}

impl Plan {
    fn full() -> Self {
        Plan {
            unary_calls: 2000,
            unary_warmup: 200,
            prompt_tokens: 64,
            gen_tokens: 128,
            single_reps: 5,
            concurrent_prompt: 32,
            concurrent_gen: 64,
            concurrent_reps: 3,
        }
    }

    fn quick() -> Self {
        Plan {
            unary_calls: 100,
            unary_warmup: 10,
            prompt_tokens: 16,
            gen_tokens: 8,
            single_reps: 1,
            concurrent_prompt: 8,
            concurrent_gen: 4,
            concurrent_reps: 1,
        }
    }
}

/// A deterministic prompt of `n` in-vocabulary tokens.
fn filler(n: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919 + salt) % vocab).collect()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    if values.is_empty() {
        return 0.0;
    }
    values[values.len() / 2]
}

/// p50, p99 and mean of `calls` timed calls after `warmup` untimed ones.
struct Latency {
    p50: Duration,
    p99: Duration,
    mean: Duration,
}

fn measure(calls: usize, warmup: usize, mut once: impl FnMut() -> Duration) -> Latency {
    for _ in 0..warmup {
        once();
    }
    let mut times: Vec<Duration> = (0..calls).map(|_| once()).collect();
    times.sort();
    let total: Duration = times.iter().sum();
    Latency {
        p50: percentile(&times, 50.0),
        p99: percentile(&times, 99.0),
        mean: total / calls.max(1) as u32,
    }
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The transport's floor: a RuntimeService whose unary handlers answer at
/// once with a filled-in message, no runtime behind them.
#[derive(Clone)]
struct Echo;

const ECHO_ID: &str = "0123456789abcdef0123456789abcdef";

impl RuntimeService for Echo {
    fn create_session(
        &mut self,
        ctx: RpcContext,
        _req: pb::CreateSessionRequest,
        sink: UnarySink<pb::CreateSessionResponse>,
    ) {
        let mut msg = pb::CreateSessionResponse::new();
        msg.set_session_id(ECHO_ID.into());
        msg.set_vocab_size(49152);
        msg.set_context_length(8192);
        ctx.spawn(async move {
            let _ = sink.success(msg).await;
        });
    }

    fn get_session_info(
        &mut self,
        ctx: RpcContext,
        _req: pb::GetSessionInfoRequest,
        sink: UnarySink<pb::GetSessionInfoResponse>,
    ) {
        let mut msg = pb::GetSessionInfoResponse::new();
        msg.set_history_length(64);
        msg.set_kv_live_bytes(64 * 23040);
        msg.set_kv_pages_held(4);
        msg.set_kv_page_bytes(368_640);
        msg.set_client_label("bench".into());
        msg.set_logits_digest(0x0123_4567_89ab_cdef);
        ctx.spawn(async move {
            let _ = sink.success(msg).await;
        });
    }
}

/// A bare grpcio server with the echo service, one completion queue like
/// the real server on this machine.
fn echo_server() -> (grpcio::Server, String) {
    let env = Arc::new(Environment::new(1));
    let mut server = ServerBuilder::new(env)
        .register_service(create_runtime_service(Echo))
        .build()
        .expect("echo server builds");
    let port = server
        .add_listening_port("127.0.0.1:0", ServerCredentials::insecure())
        .expect("echo server binds");
    server.start();
    (server, format!("127.0.0.1:{port}"))
}

fn runtime_config(workers: usize) -> RuntimeConfig {
    RuntimeConfig {
        workers,
        // The client and the completion queues share these two cores.
        pin_cores: false,
        ..RuntimeConfig::default()
    }
}

fn start_server(model: &Arc<Model>, workers: usize) -> Server {
    Server::start(
        Arc::clone(model),
        ServeConfig::new("127.0.0.1:0", runtime_config(workers)),
    )
    .expect("server starts")
}

fn connect(env: &Arc<Environment>, addr: &str) -> grpcio::Channel {
    ChannelBuilder::new(Arc::clone(env)).connect(addr)
}

fn create(client: &RuntimeServiceClient) -> String {
    let mut req = pb::CreateSessionRequest::new();
    req.set_client_label("bench".into());
    client
        .create_session(&req)
        .expect("CreateSession")
        .get_session_id()
        .to_owned()
}

fn append(client: &RuntimeServiceClient, id: &str, tokens: &[u32]) {
    let mut req = pb::AppendTokensRequest::new();
    req.set_session_id(id.to_owned());
    req.set_token_ids(tokens.to_vec());
    client.append_tokens(&req).expect("AppendTokens");
}

fn close(client: &RuntimeServiceClient, id: &str) {
    let mut req = pb::CloseSessionRequest::new();
    req.set_session_id(id.to_owned());
    client.close_session(&req).expect("CloseSession");
}

fn info_request(id: &str) -> pb::GetSessionInfoRequest {
    let mut req = pb::GetSessionInfoRequest::new();
    req.set_session_id(id.to_owned());
    req
}

fn greedy_request(id: &str, max_tokens: u32) -> pb::GenerateRequest {
    let mut req = pb::GenerateRequest::new();
    req.set_session_id(id.to_owned());
    req.set_max_tokens(max_tokens);
    req.set_temperature(0.0);
    req
}

/// Tokens of one Generate and when the first and last arrived.
struct Streamed {
    tokens: Vec<u32>,
    first: Instant,
    last: Instant,
}

async fn read_stream(mut stream: grpcio::ClientSStreamReceiver<pb::GenerateResponse>) -> Streamed {
    let mut tokens = Vec::new();
    let now = Instant::now();
    let (mut first, mut last) = (now, now);
    let mut done = false;
    while let Some(message) = stream.next().await {
        let message = message.expect("Generate stream");
        if message.has_token_id() {
            last = Instant::now();
            if tokens.is_empty() {
                first = last;
            }
            tokens.push(message.get_token_id());
        } else if message.has_done() {
            done = true;
        }
    }
    assert!(done, "the stream ended without done");
    Streamed {
        tokens,
        first,
        last,
    }
}

fn unary_section(model: &Arc<Model>, plan: &Plan) {
    let env = Arc::new(Environment::new(1));
    let (_echo, echo_addr) = echo_server();
    let echo = RuntimeServiceClient::new(connect(&env, &echo_addr));
    let server = start_server(model, 1);
    let real_channel = connect(&env, &server.addr().to_string());
    let real = RuntimeServiceClient::new(real_channel.clone());
    let health = HealthClient::new(real_channel);

    let session = create(&real);
    append(&real, &session, &filler(64, 13, model.config.vocab as u32));
    let (n, w) = (plan.unary_calls, plan.unary_warmup);
    let timed = |f: &mut dyn FnMut()| {
        let t0 = Instant::now();
        f();
        t0.elapsed()
    };
    let create_req = pb::CreateSessionRequest::new();
    let echo_info = info_request(ECHO_ID);
    let real_info = info_request(&session);
    // An empty session has no logits to digest: the difference to the row
    // above is the digest GetSessionInfo computes over the vocabulary.
    let empty = create(&real);
    let empty_info = info_request(&empty);
    let health_req = HealthCheckRequest::new();

    let rows = [
        (
            "CreateSession",
            "bare grpcio (answers at once)",
            measure(n, w, || {
                timed(&mut || {
                    echo.create_session(&create_req).expect("echo");
                })
            }),
        ),
        (
            "CreateSession",
            "inferd server",
            measure(n, w, || {
                let mut id = String::new();
                let t = timed(&mut || {
                    id = real
                        .create_session(&create_req)
                        .expect("CreateSession")
                        .get_session_id()
                        .to_owned();
                });
                close(&real, &id);
                t
            }),
        ),
        (
            "GetSessionInfo",
            "bare grpcio (answers at once)",
            measure(n, w, || {
                timed(&mut || {
                    echo.get_session_info(&echo_info).expect("echo");
                })
            }),
        ),
        (
            "GetSessionInfo",
            "inferd server, 64-token history",
            measure(n, w, || {
                timed(&mut || {
                    real.get_session_info(&real_info).expect("GetSessionInfo");
                })
            }),
        ),
        (
            "GetSessionInfo",
            "inferd server, empty session",
            measure(n, w, || {
                timed(&mut || {
                    real.get_session_info(&empty_info).expect("GetSessionInfo");
                })
            }),
        ),
        (
            "Health.Check",
            "inferd server (answered on the completion queue)",
            measure(n, w, || {
                timed(&mut || {
                    health.check(&health_req).expect("Check");
                })
            }),
        ),
    ];
    println!("\n### Unary latency ({n} sequential calls each, after {w} warm-up calls)\n");
    println!("| RPC | server | p50 µs | p99 µs | mean µs |");
    println!("|---|---|---|---|---|");
    for (rpc, who, l) in rows {
        println!(
            "| {rpc} | {who} | {:.0} | {:.0} | {:.0} |",
            micros(l.p50),
            micros(l.p99),
            micros(l.mean)
        );
    }
    close(&real, &session);
    close(&real, &empty);
    server.shutdown(Duration::from_secs(5));
}

/// Time to first token and decode rate of one run.
struct Single {
    ttft: Duration,
    decode_tps: f64,
    tokens: Vec<u32>,
}

/// Tokens per second from the moment generation was asked for to the last
/// token: every token's step is inside the span, and a late first token
/// cannot shorten it.
fn rate(tokens: usize, start: Instant, last: Instant) -> f64 {
    let span = last.duration_since(start).as_secs_f64();
    if tokens == 0 || span <= 0.0 {
        return 0.0;
    }
    tokens as f64 / span
}

fn engine_single(engine: &mut Engine, prompt: &[u32], gen: u32) -> Single {
    let mut s = engine.new_session();
    let t0 = Instant::now();
    engine.append(&mut s, prompt).expect("prefill");
    let decode_start = Instant::now();
    let (mut first, mut last) = (None, t0);
    let generation = engine
        .generate(&mut s, &SamplingParams::greedy(), gen as usize, &[], |_| {
            last = Instant::now();
            first.get_or_insert(last);
            true
        })
        .expect("generate");
    let first = first.unwrap_or(last);
    Single {
        ttft: first.duration_since(t0),
        decode_tps: rate(generation.tokens.len(), decode_start, last),
        tokens: generation.tokens,
    }
}

fn grpc_single(client: &RuntimeServiceClient, prompt: &[u32], gen: u32) -> Single {
    let id = create(client);
    let t0 = Instant::now();
    append(client, &id, prompt);
    let decode_start = Instant::now();
    let stream = client
        .generate(&greedy_request(&id, gen))
        .expect("Generate");
    let got = block_on(read_stream(stream));
    close(client, &id);
    Single {
        ttft: got.first.duration_since(t0),
        decode_tps: rate(got.tokens.len(), decode_start, got.last),
        tokens: got.tokens,
    }
}

fn single_section(model: &Arc<Model>, plan: &Plan) {
    let vocab = model.config.vocab as u32;
    let prompt = filler(plan.prompt_tokens, 13, vocab);
    let mut engine = Engine::new(
        Arc::clone(model),
        &EngineConfig {
            threads: 1,
            ..EngineConfig::default()
        },
    )
    .expect("engine");
    let server = start_server(model, 1);
    let env = Arc::new(Environment::new(1));
    let client = RuntimeServiceClient::new(connect(&env, &server.addr().to_string()));
    // One untimed run of each so first-touch costs are not measured.
    engine_single(&mut engine, &prompt, 4);
    grpc_single(&client, &prompt, 4);

    let (mut e_ttft, mut e_tps, mut g_ttft, mut g_tps) = (vec![], vec![], vec![], vec![]);
    let mut same_tokens = true;
    for _ in 0..plan.single_reps {
        // Alternated so drift on the shared machine hits both alike.
        let g = grpc_single(&client, &prompt, plan.gen_tokens);
        let e = engine_single(&mut engine, &prompt, plan.gen_tokens);
        same_tokens &= e.tokens == g.tokens;
        e_ttft.push(e.ttft.as_secs_f64() * 1e3);
        e_tps.push(e.decode_tps);
        g_ttft.push(g.ttft.as_secs_f64() * 1e3);
        g_tps.push(g.decode_tps);
    }
    let (e_ttft, e_tps) = (median(&mut e_ttft), median(&mut e_tps));
    let (g_ttft, g_tps) = (median(&mut g_ttft), median(&mut g_tps));
    println!(
        "\n### One session: {}-token prompt, {} greedy tokens (median of {} runs; time to \
         first token from the prompt's append, decode rate from the Generate call to the \
         last token)\n",
        plan.prompt_tokens, plan.gen_tokens, plan.single_reps
    );
    println!("| path | time to first token ms | decode tokens/s | decode µs/token |");
    println!("|---|---|---|---|");
    for (who, ttft, tps) in [
        ("engine alone, 1 thread", e_ttft, e_tps),
        ("gRPC, 1 worker", g_ttft, g_tps),
    ] {
        println!(
            "| {who} | {ttft:.1} | {tps:.1} | {:.0} |",
            if tps > 0.0 { 1e6 / tps } else { 0.0 }
        );
    }
    let overhead = if e_tps > 0.0 && g_tps > 0.0 {
        1e6 / g_tps - 1e6 / e_tps
    } else {
        0.0
    };
    println!(
        "\ngRPC overhead: {:.1} ms on the first token, {overhead:.0} µs per decoded token; \
         same tokens as the engine: {}",
        g_ttft - e_ttft,
        if same_tokens { "yes" } else { "NO" }
    );
    server.shutdown(Duration::from_secs(5));
}

/// Aggregate decode rate of `sessions` Generates running at once.
fn concurrent_run(
    client: &RuntimeServiceClient,
    vocab: u32,
    sessions: usize,
    plan: &Plan,
) -> (f64, Duration) {
    let ids: Vec<String> = (0..sessions)
        .map(|k| {
            let id = create(client);
            append(
                client,
                &id,
                &filler(plan.concurrent_prompt, 13 + k as u32, vocab),
            );
            id
        })
        .collect();
    let t0 = Instant::now();
    let streams: Vec<_> = ids
        .iter()
        .map(|id| {
            client
                .generate(&greedy_request(id, plan.concurrent_gen))
                .expect("Generate")
        })
        .collect();
    let results = block_on(join_all(streams.into_iter().map(read_stream)));
    let wall = t0.elapsed();
    let tokens: usize = results.iter().map(|r| r.tokens.len()).sum();
    assert_eq!(tokens, sessions * plan.concurrent_gen as usize);
    for id in &ids {
        close(client, id);
    }
    (tokens as f64 / wall.as_secs_f64(), wall)
}

fn concurrent_section(model: &Arc<Model>, plan: &Plan) {
    let vocab = model.config.vocab as u32;
    println!(
        "\n### Aggregate decode through gRPC: N sessions generating {} greedy tokens each \
         at once after a {}-token prompt (median of {} runs, wall time from the first \
         Generate sent to the last done)\n",
        plan.concurrent_gen, plan.concurrent_prompt, plan.concurrent_reps
    );
    println!("| workers | sessions | aggregate tokens/s | per session tokens/s | largest batch |");
    println!("|---|---|---|---|---|");
    for workers in [1, 2] {
        let server = start_server(model, workers);
        let env = Arc::new(Environment::new(1));
        let client = RuntimeServiceClient::new(connect(&env, &server.addr().to_string()));
        for sessions in [1usize, 4, 16] {
            let mut rates: Vec<f64> = (0..plan.concurrent_reps)
                .map(|_| concurrent_run(&client, vocab, sessions, plan).0)
                .collect();
            let aggregate = median(&mut rates);
            let batch = server
                .runtime_stats()
                .workers
                .iter()
                .map(|w| w.max_batch_sequences)
                .max()
                .unwrap_or(0);
            println!(
                "| {workers} | {sessions} | {aggregate:.1} | {:.1} | {batch} |",
                aggregate / sessions as f64
            );
        }
        server.shutdown(Duration::from_secs(5));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--only unary|single|concurrent` runs one section.
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let wanted = |section: &str| only.as_deref().is_none_or(|o| o == section);
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let plan = if quick { Plan::quick() } else { Plan::full() };
    let model = Arc::new(Model::load(REFERENCE).expect("reference model loads"));
    println!(
        "gRPC bench: {REFERENCE}, {} cores seen, simd {}{}",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        inferd::quant::simd_level(),
        if quick { " (--quick)" } else { "" }
    );
    if wanted("unary") {
        unary_section(&model, &plan);
    }
    if wanted("single") {
        single_section(&model, &plan);
    }
    if wanted("concurrent") {
        concurrent_section(&model, &plan);
    }
}
