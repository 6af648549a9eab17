//! Sampler latency at the reference vocabulary (49,152 logits): greedy, and
//! the full filtered chain with penalties, bias, temperature, top-k, top-p
//! and min-p; plus top-p alone (no top-k), which needs the growing sort.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use inferd::sampler::{argmax, Sampler, SamplingParams};

const VOCAB: usize = 49_152;

/// Logits shaped like a language model's: a few strong tokens over a broad
/// floor, from a fixed integer hash so every run sees the same row.
fn model_like_logits() -> Vec<f32> {
    (0..VOCAB as u32)
        .map(|i| {
            let hash = i.wrapping_mul(2_654_435_761).rotate_left(13) ^ 0x5bd1_e995;
            let unit = (hash >> 8) as f32 / 16_777_216.0;
            if hash % 997 == 0 {
                8.0 + 6.0 * unit
            } else {
                -4.0 + 8.0 * unit
            }
        })
        .collect()
}

fn bench_sampler(c: &mut Criterion) {
    let logits = model_like_logits();
    let history: Vec<u32> = (0..256u32).map(|i| (i * 7919) % VOCAB as u32).collect();
    let mut sampler = Sampler::new();

    c.bench_function("argmax_49152", |b| b.iter(|| argmax(black_box(&logits))));

    let greedy = SamplingParams::greedy();
    c.bench_function("sample_greedy_49152", |b| {
        b.iter(|| sampler.sample(black_box(&logits), &greedy, &history, 7))
    });

    let full_chain = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        repetition_penalty: 1.1,
        presence_penalty: 0.2,
        frequency_penalty: 0.1,
        penalty_last_n: 64,
        logit_bias: vec![(17, -5.0), (42, 1.0)],
        seed: 1234,
    };
    let mut position = 0u64;
    c.bench_function("sample_full_chain_49152", |b| {
        b.iter(|| {
            position += 1;
            sampler.sample(black_box(&logits), &full_chain, &history, position)
        })
    });

    let nucleus_only = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: 1234,
        ..SamplingParams::greedy()
    };
    c.bench_function("sample_top_p_only_49152", |b| {
        b.iter(|| {
            position += 1;
            sampler.sample(black_box(&logits), &nucleus_only, &history, position)
        })
    });

    let plain = SamplingParams {
        temperature: 1.0,
        seed: 1234,
        ..SamplingParams::greedy()
    };
    c.bench_function("sample_temperature_only_49152", |b| {
        b.iter(|| {
            position += 1;
            sampler.sample(black_box(&logits), &plain, &history, position)
        })
    });
}

criterion_group!(benches, bench_sampler);
criterion_main!(benches);
