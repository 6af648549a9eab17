//! A split model as its clients see it: decode through the real grpcio
//! client against `inferd serve` (the in-process `Server`, one worker) on
//! the reference model, run whole on one host or as the coordinator of 2
//! or 3 shards (`ShardServer`s behind real sockets on 127.0.0.1, one compute
//! thread each), directly or each behind a relay. For 1 and 8 sessions
//! generating at once (8 sessions share each decode frame): aggregate decode
//! tokens/s and the median gap between one session's tokens.
//!
//! `cargo bench --bench serve_shards` (needs `scripts/fetch-model`). Prints
//! a Markdown table. INFERD_BENCH_TOKENS sets the tokens each session
//! generates (default 64).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_executor::block_on;
use futures_util::StreamExt;
use grpcio::{ChannelBuilder, EnvBuilder};

use inferd::cluster::coordinator::{ShardPlan, ShardSpec};
use inferd::cluster::fingerprint::{sha256_of_file, Fingerprint};
use inferd::cluster::layers::ShardLayers;
use inferd::cluster::relay::{Relay, RelayConfig};
use inferd::cluster::shard::{ShardConfig, ShardServer};
use inferd::cluster::Encoding;
use inferd::model::Model;
use inferd::proto::kakeya_v1::runtime as pb;
use inferd::proto::kakeya_v1::runtime_grpc::RuntimeServiceClient;
use inferd::runtime::{LocalLayers, RuntimeConfig};
use inferd::server::{ServeConfig, Server};

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const PROMPT: [u32; 8] = [1, 504, 3575, 282, 4649, 314, 9, 45];

fn tokens() -> u32 {
    std::env::var("INFERD_BENCH_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

/// Aggregate decode tokens/s and the median gap between a session's tokens,
/// with `sessions` generating at once.
fn decode(addr: &str, sessions: usize) -> (f64, Duration) {
    let env = Arc::new(EnvBuilder::new().cq_count(1).build());
    let client = RuntimeServiceClient::new(ChannelBuilder::new(env).connect(addr));
    let ids: Vec<String> = (0..sessions)
        .map(|i| {
            let id = client
                .create_session(&pb::CreateSessionRequest::new())
                .expect("create")
                .take_session_id();
            let mut append = pb::AppendTokensRequest::new();
            append.set_session_id(id.clone());
            let mut prompt = PROMPT.to_vec();
            prompt.push(100 + i as u32);
            append.set_token_ids(prompt);
            client.append_tokens(&append).expect("append");
            id
        })
        .collect();
    let t0 = Instant::now();
    let streams: Vec<_> = ids
        .iter()
        .map(|id| {
            let client = client.clone();
            let id = id.clone();
            std::thread::spawn(move || {
                let mut req = pb::GenerateRequest::new();
                req.set_session_id(id);
                req.set_max_tokens(tokens());
                let mut stream = client.generate(&req).expect("generate");
                let mut gaps = Vec::new();
                let mut last = Instant::now();
                let mut n = 0usize;
                while let Some(msg) = block_on(stream.next()) {
                    let msg = msg.expect("stream");
                    if !msg.has_done() {
                        n += 1;
                        if n > 1 {
                            gaps.push(last.elapsed());
                        }
                        last = Instant::now();
                    }
                }
                (n, gaps)
            })
        })
        .collect();
    let mut total = 0;
    let mut gaps = Vec::new();
    for s in streams {
        let (n, g) = s.join().expect("stream thread");
        total += n;
        gaps.extend(g);
    }
    let elapsed = t0.elapsed();
    gaps.sort();
    (
        total as f64 / elapsed.as_secs_f64(),
        gaps.get(gaps.len() / 2).copied().unwrap_or_default(),
    )
}

fn serve(model: &Arc<Model>, shards: Option<ShardPlan>) -> Server {
    let runtime = RuntimeConfig {
        workers: 1,
        pin_cores: false,
        kv_bytes: 64 << 20,
        layers: match shards {
            Some(plan) => Arc::new(ShardLayers::new(Arc::new(plan))),
            None => Arc::new(LocalLayers),
        },
        ..RuntimeConfig::default()
    };
    Server::start(Arc::clone(model), ServeConfig::new("127.0.0.1:0", runtime)).expect("server")
}

fn main() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("{REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let model = Arc::new(Model::load(REFERENCE).expect("model"));
    let hash = sha256_of_file(Path::new(REFERENCE)).expect("hash");
    let n = model.config.n_layers;
    println!(
        "CPU threads available: {}; tokens per session: {}\n",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        tokens()
    );
    println!("| setup | sessions | decode tokens/s (all sessions) | ms between a session's tokens (median) |");
    println!("|---|---:|---:|---:|");
    let row = |setup: &str, addr: &str| {
        for sessions in [1, 8] {
            let (rate, gap) = decode(addr, sessions);
            println!(
                "| {setup} | {sessions} | {rate:.1} | {:.2} |",
                gap.as_secs_f64() * 1e3
            );
        }
    };
    {
        let server = serve(&model, None);
        row("1 host", &server.addr().to_string());
        server.shutdown(Duration::from_secs(5));
    }
    let splits: [Vec<(usize, usize)>; 2] = [
        vec![(0, n / 2), (n / 2, n)],
        vec![(0, n / 3), (n / 3, 2 * n / 3), (2 * n / 3, n)],
    ];
    for split in &splits {
        for relayed in [false, true] {
            if relayed && split.len() == 2 {
                continue;
            }
            let shards: Vec<ShardServer> = split
                .iter()
                .map(|&(a, b)| {
                    let fingerprint = Fingerprint::of_layers(hash, &model.config, a..b);
                    let mut cfg = ShardConfig::new(a..b, "127.0.0.1:0");
                    cfg.threads = 1;
                    cfg.kv_bytes = 64 << 20;
                    ShardServer::start(Arc::clone(&model), fingerprint, &cfg).expect("shard")
                })
                .collect();
            let relays: Vec<Relay> = if relayed {
                shards
                    .iter()
                    .map(|s| {
                        Relay::start(&RelayConfig {
                            listen: "127.0.0.1:0".into(),
                            upstream: s.addr().to_string(),
                            record: None,
                            max_message_bytes: 64 << 20,
                        })
                        .expect("relay")
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let specs: Vec<ShardSpec> = if relayed {
                relays
                    .iter()
                    .map(|r| r.addr().to_string())
                    .collect::<Vec<_>>()
            } else {
                shards.iter().map(|s| s.addr().to_string()).collect()
            }
            .into_iter()
            .zip(split)
            .map(|(addr, &(a, b))| ShardSpec {
                addr,
                layers: Some(a..b),
            })
            .collect();
            let plan =
                ShardPlan::new(n, model.config.hidden, hash, &specs, Encoding::F32).expect("plan");
            let server = serve(&model, Some(plan));
            let setup = format!(
                "{} shards{}",
                split.len(),
                if relayed { ", each behind a relay" } else { "" }
            );
            row(&setup, &server.addr().to_string());
            server.shutdown(Duration::from_secs(5));
            for r in relays {
                r.shutdown();
            }
            for s in shards {
                s.shutdown();
            }
        }
    }
}
