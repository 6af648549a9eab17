//! Bytes-per-second benchmarks of the quant kernels on the shapes of the
//! reference model (hidden 576, FFN 1536, vocabulary 49152), single thread;
//! the Q5_0/Q5_1/IQ4_NL shapes are Qwen2.5-0.5B's FFN (896 x 4864), whose
//! rows are what K-quant files store in those formats.
//! Throughput counts weight bytes for matrix kernels and input f32 bytes for
//! activation quantization. `INFERD_SIMD=scalar|avx2|avx512` picks a level.
//!
//! Run: `cargo bench --bench kernels`

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use inferd::quant::{self, matmul, quantize_row, GgmlType};
use std::time::{Duration, Instant};

#[path = "support/quant_inputs.rs"]
mod quant_inputs;
use quant_inputs::{activations, weights};

/// Matrix shapes (weight type, rows, row length, label).
const SHAPES: &[(GgmlType, usize, usize, &str)] = &[
    (GgmlType::Q4_1, 1536, 576, "q4_1 1536x576"),
    (GgmlType::Q4_1, 576, 1536, "q4_1 576x1536"),
    (GgmlType::Q8_0, 49152, 576, "q8_0 49152x576"),
    (GgmlType::Q8_0, 1536, 576, "q8_0 1536x576"),
    (GgmlType::Q4_0, 1536, 576, "q4_0 1536x576"),
    (GgmlType::Q5_0, 4864, 896, "q5_0 4864x896"),
    (GgmlType::Q5_1, 4864, 896, "q5_1 4864x896"),
    (GgmlType::IQ4_NL, 4864, 896, "iq4_nl 4864x896"),
    (GgmlType::Q2_K, 576, 1536, "q2_k 576x1536"),
    (GgmlType::Q3_K, 576, 1536, "q3_k 576x1536"),
    (GgmlType::Q4_K, 576, 1536, "q4_k 576x1536"),
    (GgmlType::Q5_K, 576, 1536, "q5_k 576x1536"),
    (GgmlType::Q6_K, 576, 1536, "q6_k 576x1536"),
    (GgmlType::IQ4_XS, 576, 1536, "iq4_xs 576x1536"),
];

/// Prints the fastest of many runs per kernel: on a shared machine the
/// minimum is the figure least disturbed by other processes.
fn best_case(c: &mut Criterion) {
    let _ = c;
    for &(ty, rows, n, name) in SHAPES {
        let w = weights(ty, rows, n);
        for tokens in [1usize, 2, 4, 8, 16] {
            let acts = activations(ty, n, tokens);
            let mut out = vec![0.0f32; rows * tokens];
            let runs = if rows > 10_000 { 20 } else { 300 };
            let best = (0..runs)
                .map(|_| {
                    let start = Instant::now();
                    matmul(ty, n, black_box(&w), black_box(&acts), tokens, &mut out);
                    start.elapsed()
                })
                .min()
                .unwrap_or_default();
            let gbs = w.len() as f64 / best.as_secs_f64().max(1e-12) / 1e9;
            eprintln!(
                "best case: {name} T={tokens}: {:.1} us, {gbs:.1} GB/s of weights, {:.1} us/token",
                best.as_secs_f64() * 1e6,
                best.as_secs_f64() * 1e6 / tokens as f64
            );
        }
    }
}

fn bench_matmul(c: &mut Criterion) {
    let mut g = c.benchmark_group("matmul");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    for &(ty, rows, n, name) in SHAPES {
        let w = weights(ty, rows, n);
        for tokens in [1usize, 16] {
            if rows > 10_000 && tokens > 1 {
                continue;
            }
            let acts = activations(ty, n, tokens);
            let mut out = vec![0.0f32; rows * tokens];
            g.throughput(Throughput::Bytes(w.len() as u64));
            g.bench_with_input(
                BenchmarkId::new(name, format!("T={tokens}")),
                &tokens,
                |b, &t| b.iter(|| matmul(ty, n, black_box(&w), black_box(&acts), t, &mut out)),
            );
        }
    }
    g.finish();
}

fn bench_quantize(c: &mut Criterion) {
    let mut g = c.benchmark_group("quantize_row");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    for (ty, n) in [
        (GgmlType::Q8_1, 576),
        (GgmlType::Q8_0, 576),
        (GgmlType::Q8_K, 1536),
    ] {
        let x: Vec<f32> = (0..n).map(|i| (i % 17) as f32 * 0.3 - 2.0).collect();
        let mut out = vec![0u8; ty.row_bytes(n).expect("whole blocks")];
        g.throughput(Throughput::Bytes((n * 4) as u64));
        g.bench_function(format!("{ty} n={n}"), |b| {
            b.iter(|| quantize_row(ty, black_box(&x), &mut out).expect("quantize"))
        });
    }
    g.finish();
}

fn bench_attention_helpers(c: &mut Criterion) {
    let mut g = c.benchmark_group("f16");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    let a: Vec<half::f16> = (0..64)
        .map(|i| half::f16::from_f32(i as f32 * 0.01))
        .collect();
    let mut y = vec![0.0f32; 64];
    g.throughput(Throughput::Bytes(128));
    g.bench_function("dot_f16 64", |b| {
        b.iter(|| quant::dot_f16(black_box(&a), black_box(&a)))
    });
    g.bench_function("axpy_f16 64", |b| {
        b.iter(|| quant::axpy_f16(0.5, black_box(&a), &mut y))
    });
    g.finish();
}

fn print_level(c: &mut Criterion) {
    eprintln!("SIMD level: {}", quant::simd_level());
    let _ = c;
}

criterion_group!(
    benches,
    print_level,
    best_case,
    bench_matmul,
    bench_quantize,
    bench_attention_helpers
);
criterion_main!(benches);
