//! Per-step sampling latency, CPU reference against the WGSL sampler, for
//! each vocabulary size the issue names (32, 49,152, 151,936) and batches of
//! 1, 8 and 32 rows: p50 and p99 over many steps, greedy and the full chain.
//! A step is what a worker does per decode step: every generating session's
//! next token (on the CPU one row after another; on wgpu one upload, one
//! dispatch, one readback).
//!
//! `cargo bench --bench sampler_backends` (or `scripts/bench-sampler`);
//! `INFERD_BENCH_STEPS` scales the step counts; without a wgpu adapter only
//! the CPU rows are measured. Prints a Markdown table.

use std::time::{Duration, Instant};

use inferd::sampler::gpu::{AdapterKind, GpuContext, GpuSampler};
use inferd::sampler::{SampleRequest, Sampled, Sampler, SamplerError, SamplingParams};

const VOCABS: [usize; 3] = [32, 49_152, 151_936];
const BATCHES: [usize; 3] = [1, 8, 32];

/// Model-like logits: a few strong tokens over a broad floor, from a fixed
/// integer hash, different per row.
fn logits(vocab: usize, row: usize) -> Vec<f32> {
    (0..vocab as u32)
        .map(|i| {
            let hash = (i ^ (row as u32).wrapping_mul(0x9e37_79b9))
                .wrapping_mul(2_654_435_761)
                .rotate_left(13)
                ^ 0x5bd1_e995;
            let unit = (hash >> 8) as f32 / 16_777_216.0;
            if hash.is_multiple_of(997) {
                8.0 + 6.0 * unit
            } else {
                -4.0 + 8.0 * unit
            }
        })
        .collect()
}

fn full_chain() -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        repetition_penalty: 1.1,
        presence_penalty: 0.2,
        penalty_last_n: 64,
        seed: 7,
        ..SamplingParams::greedy()
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index]
}

fn micros(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 10.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.0}")
    }
}

/// Runs `steps` timed steps (after two warm-up steps) of `step`.
fn measure(steps: usize, mut step: impl FnMut(u64)) -> (Duration, Duration) {
    step(0);
    step(1);
    let mut times: Vec<Duration> = (0..steps as u64)
        .map(|i| {
            let t = Instant::now();
            step(i + 2);
            t.elapsed()
        })
        .collect();
    times.sort();
    (percentile(&times, 0.5), percentile(&times, 0.99))
}

fn steps_for(vocab: usize, batch: usize, gpu: bool) -> usize {
    let scale: f64 = std::env::var("INFERD_BENCH_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0);
    let work = (vocab * batch) as f64;
    let base = if gpu { 4e6 } else { 2e7 } / work.max(1.0);
    (base * scale).clamp(30.0, 2000.0) as usize
}

fn main() {
    // Mesa's device-select layer would look for a display.
    if std::env::var_os("NODEVICE_SELECT").is_none() {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
    let context = match GpuContext::open(AdapterKind::Any) {
        Ok(context) => Some(context),
        Err(e) => {
            eprintln!("no wgpu adapter, CPU rows only: {e}");
            None
        }
    };
    let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    println!(
        "CPU: {cpu_model}, {} threads available; wgpu adapter: {}\n",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        context.as_ref().map_or("none".into(), |c| c.describe())
    );
    println!("| vocab | batch | mode | CPU p50 µs | CPU p99 µs | wgpu p50 µs | wgpu p99 µs |");
    println!("|---:|---:|---|---:|---:|---:|---:|");
    let history: Vec<u32> = (0..256u32).map(|i| (i * 7919) % 32).collect();
    for vocab in VOCABS {
        let rows: Vec<Vec<f32>> = (0..32).map(|r| logits(vocab, r)).collect();
        let mut gpu = context.as_ref().map(|c| {
            GpuSampler::new(std::sync::Arc::clone(c), vocab, 32, 1024).expect("GPU buffers")
        });
        for batch in BATCHES {
            for (mode, params) in [
                ("greedy", SamplingParams::greedy()),
                ("full chain", full_chain()),
            ] {
                let params = params.checked(vocab).expect("valid");
                let mut cpu = Sampler::new();
                let cpu_times = measure(steps_for(vocab, batch, false), |step| {
                    for (r, row) in rows.iter().take(batch).enumerate() {
                        let token = cpu.sample(row, &params, &history, step * 64 + r as u64);
                        std::hint::black_box(token.expect("a token"));
                    }
                });
                let gpu_times = gpu.as_mut().map(|gpu| {
                    let mut out: Vec<Result<Sampled, SamplerError>> = Vec::with_capacity(batch);
                    let mut requests = Vec::with_capacity(batch);
                    measure(steps_for(vocab, batch, true), |step| {
                        requests.clear();
                        for (r, row) in rows.iter().take(batch).enumerate() {
                            requests.push(SampleRequest {
                                mask: None,
                                logits: row,
                                params: &params,
                                history: &history,
                                position: step * 64 + r as u64,
                                top_logprobs: 0,
                            });
                        }
                        gpu.sample_batch(&requests, &mut out);
                        assert!(out.iter().all(Result::is_ok), "{out:?}");
                    })
                });
                let (gpu50, gpu99) =
                    gpu_times.map_or(("-".into(), "-".into()), |(a, b)| (micros(a), micros(b)));
                println!(
                    "| {vocab} | {batch} | {mode} | {} | {} | {gpu50} | {gpu99} |",
                    micros(cpu_times.0),
                    micros(cpu_times.1)
                );
            }
        }
    }
}
