//! The shard protocol's cost on loopback, with the reference model: decode
//! time per token on one host (the engine) against the model split over 2
//! and 3 shards (in-process `ShardServer`s behind real gRPC sockets, one
//! compute thread each), per payload encoding; the bytes a decode frame
//! puts on the wire per hop; and what a relay in front of every shard adds.
//!
//! `cargo bench --bench shard` (needs `scripts/fetch-model`). Prints a
//! Markdown table. INFERD_BENCH_TOKENS sets the decode tokens per cell
//! (default 48).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inferd::cluster::fingerprint::{sha256_of_file, Fingerprint};
use inferd::cluster::frame::{hidden_body, Run};
use inferd::cluster::link::{LinkOptions, ShardLink};
use inferd::cluster::payload::encode_rows;
use inferd::cluster::relay::{Relay, RelayConfig};
use inferd::cluster::shard::{ShardConfig, ShardServer};
use inferd::cluster::{Encoding, Epochs, OutboundFrames};
use inferd::engine::{Engine, EngineConfig};
use inferd::model::{Model, Scratch};
use inferd::proto::inferd_shard_v1::shard_runtime as pb;
use inferd::threads::ThreadPool;

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const PROMPT: [u32; 8] = [1, 504, 3575, 282, 4649, 314, 9, 45];

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

fn tokens() -> usize {
    std::env::var("INFERD_BENCH_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

/// Greedy decode on one host: time per token.
fn one_host(model: &Arc<Model>) -> Duration {
    let mut engine = Engine::new(
        Arc::clone(model),
        &EngineConfig {
            threads: 1,
            ..EngineConfig::default()
        },
    )
    .expect("engine");
    let mut session = engine.new_session();
    engine.append(&mut session, &PROMPT).expect("prefill");
    let mut samples = Vec::new();
    for _ in 0..tokens() {
        let token = inferd::sampler::argmax(session.next_logits()).expect("token");
        let t = Instant::now();
        engine.append(&mut session, &[token]).expect("decode");
        samples.push(t.elapsed());
    }
    median(samples)
}

/// Greedy decode through `links`: time per token (embed, every shard,
/// final norm and logits).
fn through(model: &Arc<Model>, links: &mut [ShardLink], session: [u8; 16]) -> Duration {
    let hidden = model.config.hidden;
    let pool = ThreadPool::new(1);
    let mut scratch = Scratch::default();
    let mut logits = Vec::new();
    let mut step = |tokens: &[u32], position: u64, logits: &mut Vec<f32>| {
        let mut x = vec![0f32; tokens.len() * hidden];
        model.embed(tokens, &mut x).expect("embed");
        for link in links.iter_mut() {
            link.forward(
                &[Run {
                    session,
                    position,
                    rows: tokens.len() as u32,
                }],
                &mut x,
                0,
            )
            .expect("forward");
        }
        model.logits_from_hidden(
            &pool,
            &x[(tokens.len() - 1) * hidden..],
            logits,
            &mut scratch,
        );
    };
    step(&PROMPT, 0, &mut logits);
    let mut samples = Vec::new();
    for i in 0..tokens() {
        let token = inferd::sampler::argmax(&logits).expect("token");
        let t = Instant::now();
        step(&[token], (PROMPT.len() + i) as u64, &mut logits);
        samples.push(t.elapsed());
    }
    median(samples)
}

/// Bytes of one sealed decode frame (one session, one row) in `encoding`.
fn decode_frame_bytes(hidden: usize, encoding: Encoding) -> usize {
    let mut frame = pb::Frame::new();
    frame.set_decode(hidden_body(&[Run {
        session: [1; 16],
        position: 1000,
        rows: 1,
    }]));
    frame.set_payload(encode_rows(encoding, hidden, &vec![0.25; hidden]).expect("rows"));
    let mut out = OutboundFrames::new(Epochs {
        shard: u64::MAX,
        coordinator: u64::MAX,
    });
    out.seal(frame, Some(encoding), u64::MAX)
        .expect("seal")
        .len()
}

fn main() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("{REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let model = Arc::new(Model::load(REFERENCE).expect("model"));
    let hash = sha256_of_file(Path::new(REFERENCE)).expect("hash");
    let (n_layers, hidden) = (model.config.n_layers, model.config.hidden);
    println!(
        "CPU threads available: {}; decode tokens per cell: {}\n",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        tokens()
    );
    println!("| setup | encoding | ms / token | tokens/s | decode frame bytes per hop |");
    println!("|---|---|---:|---:|---:|");
    let single = one_host(&model);
    println!(
        "| 1 host (engine, 1 thread) | - | {} | {:.1} | - |",
        ms(single),
        1.0 / single.as_secs_f64()
    );
    let splits: [&[(usize, usize)]; 2] = [
        &[(0, n_layers / 2), (n_layers / 2, n_layers)],
        &[
            (0, n_layers / 3),
            (n_layers / 3, 2 * n_layers / 3),
            (2 * n_layers / 3, n_layers),
        ],
    ];
    let mut session = 0u8;
    for split in splits {
        let servers: Vec<ShardServer> = split
            .iter()
            .map(|&(a, b)| {
                let fingerprint = Fingerprint::of_layers(hash, &model.config, a..b);
                let mut cfg = ShardConfig::new(a..b, "127.0.0.1:0");
                cfg.threads = 1;
                cfg.kv_bytes = 64 << 20;
                ShardServer::start(Arc::clone(&model), fingerprint, &cfg).expect("shard")
            })
            .collect();
        let fingerprints: Vec<Fingerprint> = split
            .iter()
            .map(|&(a, b)| Fingerprint::of_layers(hash, &model.config, a..b))
            .collect();
        for encoding in [Encoding::F32, Encoding::F16, Encoding::Q8_0] {
            let options = LinkOptions {
                encoding,
                ..LinkOptions::default()
            };
            let mut links: Vec<ShardLink> = servers
                .iter()
                .zip(&fingerprints)
                .map(|(s, f)| {
                    ShardLink::connect(
                        &s.addr().to_string(),
                        f,
                        0xbe_u64 << 8 | session as u64,
                        &options,
                    )
                    .expect("link")
                })
                .collect();
            session += 1;
            let per_token = through(&model, &mut links, [session; 16]);
            println!(
                "| {} shards, loopback | {encoding:?} | {} | {:.1} | {} |",
                split.len(),
                ms(per_token),
                1.0 / per_token.as_secs_f64(),
                decode_frame_bytes(hidden, encoding)
            );
        }
        if split.len() == 3 {
            let relays: Vec<Relay> = servers
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
                .collect();
            let mut links: Vec<ShardLink> = relays
                .iter()
                .zip(&fingerprints)
                .map(|(r, f)| {
                    ShardLink::connect(
                        &r.addr().to_string(),
                        f,
                        0xfe_u64 << 8 | session as u64,
                        &LinkOptions::default(),
                    )
                    .expect("link")
                })
                .collect();
            session += 1;
            let per_token = through(&model, &mut links, [session; 16]);
            println!(
                "| 3 shards, each behind a relay | F32 | {} | {:.1} | {} |",
                ms(per_token),
                1.0 / per_token.as_secs_f64(),
                decode_frame_bytes(hidden, Encoding::F32)
            );
            for relay in relays {
                relay.shutdown();
            }
        }
        for server in servers {
            server.shutdown();
        }
    }
}
