//! Prompt-sized matrix products on one thread: the Llama-3.2-1B shapes
//! (hidden 2048, FFN 8192) at 512 tokens, the work of a prefill chunk, in
//! each format a Q4_K_M, Q5_K_M or Q8_0 file stores them, and the reference
//! model's FFN shape in its Q4_1. Prints the best of a few runs (the figure
//! least disturbed on a shared machine) as milliseconds, nanoseconds per
//! output and 256 weights, and multiply-adds per second.
//! `INFERD_SIMD=scalar|avx2|avx512` picks a level; `INFERD_BENCH_TOKENS=N`
//! another token count (1 times the decode kernels on the same matrices);
//! `INFERD_BENCH_ROWS=N` another row count (256 keeps a matrix in L2, so
//! the kernel's own cost shows apart from memory's); `INFERD_BENCH_ONLY=TEXT`
//! only the shapes whose name holds TEXT (for a profile of one of them).
//!
//! Run: `cargo bench --bench prefill_kernels`

use criterion::black_box;
use inferd::quant::{self, matmul, GgmlType};
use std::time::Instant;

#[path = "support/quant_inputs.rs"]
mod quant_inputs;
use quant_inputs::{activations, weights};

const DEFAULT_TOKENS: usize = 512;
const RUNS: usize = 5;
const SHAPES: &[(GgmlType, usize, usize, &str)] = &[
    (GgmlType::Q4_K, 8192, 2048, "q4_k 8192x2048 (gate, up)"),
    (GgmlType::Q4_K, 2048, 8192, "q4_k 2048x8192 (down)"),
    (GgmlType::Q6_K, 2048, 8192, "q6_k 2048x8192 (down)"),
    (
        GgmlType::Q5_K,
        8192,
        2048,
        "q5_k 8192x2048 (gate, up in Q5_K_M)",
    ),
    (GgmlType::Q8_0, 8192, 2048, "q8_0 8192x2048 (gate, up)"),
    (GgmlType::Q8_0, 2048, 8192, "q8_0 2048x8192 (down)"),
    (
        GgmlType::Q4_1,
        1536,
        576,
        "q4_1 1536x576 (SmolLM2-135M gate, up)",
    ),
];

fn main() {
    eprintln!("SIMD level: {}", quant::simd_level());
    let tokens = std::env::var("INFERD_BENCH_TOKENS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&t| t > 0)
        .unwrap_or(DEFAULT_TOKENS);
    let rows_override = std::env::var("INFERD_BENCH_ROWS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&r| r > 0);
    let only = std::env::var("INFERD_BENCH_ONLY").unwrap_or_default();
    for &(ty, rows, n, name) in SHAPES.iter().filter(|s| s.3.contains(only.as_str())) {
        let rows = rows_override.unwrap_or(rows);
        // Short products take too little time for one run to be timed well.
        let repeat = (DEFAULT_TOKENS * 8192 / (tokens * rows)).max(1);
        let w = weights(ty, rows, n);
        let acts = activations(ty, n, tokens);
        let mut out = vec![0.0f32; rows * tokens];
        let best = (0..RUNS)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..repeat {
                    matmul(ty, n, black_box(&w), black_box(&acts), tokens, &mut out);
                }
                start.elapsed() / repeat as u32
            })
            .min()
            .unwrap_or_default()
            .as_secs_f64();
        let outputs = (rows * tokens) as f64;
        eprintln!(
            "{name}, {rows} rows x {tokens} tokens: {:.1} ms, {:.3} ns per output and 256 weights, {:.1} G multiply-adds/s",
            best * 1e3,
            best * 1e9 / (outputs * n as f64 / 256.0),
            outputs * n as f64 / best / 1e9
        );
    }
}
