//! End-to-end speed of the forward pass on the reference model (or
//! `INFERD_BENCH_MODEL`): one decode
//! step at a given history length, a 64-token prefill chunk, and the short
//! chunks speculative decoding verifies (2, 4, 8 and 16 tokens after the
//! same history: what a proposal costs against one decode step), in
//! tokens per second; and those chunks as speculative decoding really
//! feeds them, every row's logits computed (`verify_k_at_256`). Skips
//! (with a message) when the model is absent.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use inferd::engine::{Engine, EngineConfig};
use inferd::kv::{KvPool, KvPoolConfig, SessionKv};
use inferd::model::{LogitsWanted, Model, Scratch, Sequence};
use inferd::threads::ThreadPool;

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model timed: `INFERD_BENCH_MODEL`, else the reference model.
fn model_path() -> String {
    std::env::var("INFERD_BENCH_MODEL").unwrap_or_else(|_| REFERENCE.to_owned())
}

/// The model, or `None` (said) when its file is absent.
fn load_model() -> Option<Model> {
    let path = model_path();
    if !Path::new(&path).exists() {
        eprintln!("SKIPPED: {path} is absent; run scripts/fetch-model");
        return None;
    }
    Some(Model::load(&path).expect("the model loads"))
}

fn engine(threads: usize) -> Option<Engine> {
    let model = Arc::new(load_model()?);
    Some(
        Engine::new(
            model,
            &EngineConfig {
                threads,
                ..EngineConfig::default()
            },
        )
        .expect("engine"),
    )
}

fn forward(c: &mut Criterion) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let Some(mut engine) = engine(threads) else {
        return;
    };
    let vocab = engine.model().config.vocab as u32;
    let history: Vec<u32> = (0..256u32).map(|i| (i * 7919 + 13) % vocab).collect();

    let mut group = c.benchmark_group(format!("forward/{threads}threads"));
    group.sample_size(20);
    // Sessions are built outside the timed region; only the step is timed:
    // one decode step, then the short chunks a speculative step verifies.
    for k in [1usize, 2, 4, 8, 16] {
        let name = match k {
            1 => "decode_step_at_256".to_owned(),
            _ => format!("chunk_{k}_at_256"),
        };
        group.throughput(Throughput::Elements(k as u64));
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let mut s = engine.new_session();
                    engine.append(&mut s, &history).expect("history");
                    let t0 = Instant::now();
                    engine.append(&mut s, &history[..k]).expect("step");
                    total += t0.elapsed();
                }
                total
            })
        });
    }
    group.throughput(Throughput::Elements(64));
    group.bench_function("prefill_64", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut s = engine.new_session();
                let t0 = Instant::now();
                engine.append(&mut s, &history[..64]).expect("prefill");
                total += t0.elapsed();
            }
            total
        })
    });
    group.finish();
}

/// Passes as a verification feeds them: the same history, then k tokens
/// with every row's logits (the output projection of each row included).
fn verify(c: &mut Criterion) {
    let Some(model) = load_model() else {
        return;
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let layout = model.kv_layout(model.config.n_layers, 16);
    let kv = Arc::new(
        KvPool::new(KvPoolConfig::anonymous(layout, 64 * layout.n_layers)).expect("kv pool"),
    );
    let pool = ThreadPool::new(threads);
    let mut scratch = Scratch::default();
    let vocab = model.config.vocab as u32;
    let history: Vec<u32> = (0..256u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut feed = |session: &mut SessionKv, tokens: &[u32], logits: LogitsWanted| {
        let mut batch = [Sequence {
            kv: session,
            tokens,
            logits,
        }];
        model
            .forward(&mut batch, &pool, &mut scratch)
            .expect("forward");
    };

    let mut group = c.benchmark_group(format!("forward/{threads}threads"));
    group.sample_size(20);
    for k in [1usize, 2, 4, 8, 16] {
        group.throughput(Throughput::Elements(k as u64));
        group.bench_function(format!("verify_{k}_at_256"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let mut session = SessionKv::new(Arc::clone(&kv));
                    feed(&mut session, &history, LogitsWanted::None);
                    let t0 = Instant::now();
                    feed(&mut session, &history[..k], LogitsWanted::All);
                    total += t0.elapsed();
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group!(benches, forward, verify);
criterion_main!(benches);
