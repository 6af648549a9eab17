//! The GPU backend on the reference model (SmolLM2-135M-Instruct Q4_1) for
//! the golden prompts of tests/vectors/greedy_smollm2.json of at most 30
//! tokens, on a real wgpu
//! device (Mesa's lavapipe in CI), beside the CPU backend fed the same
//! tokens:
//!
//! - at the last prompt position and at every step of the continuation,
//!   the log-probabilities of the CPU's top-10 tokens agree within
//!   `LOGPROB_TOLERANCE`;
//! - the greedy continuation (32 tokens) equals llama.cpp's batched path,
//!   except at a near-tie: where the two part, the CPU's top-1 must lead
//!   its top-2 by less than `NEAR_TIE` (a backend that close may pick
//!   either), and nothing after it is compared.
//!
//! Without the model, or without an adapter, the test says so and passes,
//! unless INFERD_REQUIRE_WGPU=1 (scripts/test sets it).

mod support;

use std::path::Path;
use std::sync::Arc;

use inferd::engine::{Engine, EngineConfig};
use inferd::gpu::{AdapterKind, GpuDevice};
use inferd::model::Model;
use inferd::sampler::argmax;
use serde_json::Value;
use support::golden::{common_prefix, ids, logprob};

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const VECTORS: &str = "tests/vectors/greedy_smollm2.json";
/// The CPU quantizes activations to 8 bits before each product (as
/// llama.cpp's CPU backend does); the GPU multiplies them as f32. Over the
/// 30 layers of this model the two differ by up to 0.86 in a top-10
/// log-probability along these continuations (measured on lavapipe), most
/// in the tail of the ten.
const LOGPROB_TOLERANCE: f64 = 1.0;
/// Where the CPU's top-1 leads by less than this, the GPU may pick the
/// other token (partings were seen at leads of 0.19 and 0.30).
const NEAR_TIE: f64 = 0.5;
/// Longest golden prompt run here.
const MAX_PROMPT: usize = 30;

/// The top `n` ids of `logits` and the largest log-probability difference
/// between `a` and `b` at them.
fn top_diff(a: &[f32], b: &[f32], n: usize) -> f64 {
    let mut ids: Vec<u32> = (0..a.len() as u32).collect();
    ids.sort_by(|&x, &y| a[y as usize].total_cmp(&a[x as usize]));
    ids[..n]
        .iter()
        .map(|&id| (logprob(a, id) - logprob(b, id)).abs())
        .fold(0.0, f64::max)
}

/// How far the top-1 log-probability of `logits` leads the top-2.
fn margin(logits: &[f32]) -> f64 {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|&x, &y| logits[y as usize].total_cmp(&logits[x as usize]));
    logprob(logits, ids[0]) - logprob(logits, ids[1])
}

#[test]
fn greedy_continuations_on_the_gpu_agree_with_the_cpu_and_llamacpp() {
    let required = std::env::var("INFERD_REQUIRE_WGPU").is_ok_and(|v| v == "1");
    if !Path::new(REFERENCE).exists() {
        assert!(!required, "INFERD_REQUIRE_WGPU=1 but {REFERENCE} is absent");
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let device = match GpuDevice::open(AdapterKind::Any) {
        Ok(device) => device,
        Err(e) => {
            assert!(!required, "INFERD_REQUIRE_WGPU=1 but {e}");
            eprintln!("\n!!! SKIPPING the GPU agreement test: {e}\n");
            return;
        }
    };
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(VECTORS).expect("golden vectors"))
            .expect("json");
    let model = Arc::new(Model::load(REFERENCE).expect("reference model loads"));
    let cpu_config = EngineConfig {
        threads: 2,
        ..EngineConfig::default()
    };
    let mut cpu = Engine::new(Arc::clone(&model), &cpu_config).expect("cpu engine");
    let gpu_config = EngineConfig {
        gpu: Some(device),
        ..cpu_config.clone()
    };
    let mut gpu = Engine::new(model, &gpu_config).expect("gpu engine");
    let mut failures = Vec::new();
    let mut worst_overall = 0.0f64;
    // The prompts of at most 30 tokens: lavapipe on two cores decodes about
    // a token a second, and CI runs this.
    let cases = golden["cases"].as_array().expect("cases");
    let short: Vec<&Value> = cases
        .iter()
        .filter(|c| ids(&c["prompt"]).len() <= MAX_PROMPT)
        .collect();
    assert!(
        short.len() >= 5,
        "only {} short golden prompts",
        short.len()
    );
    for case in short {
        let name = case["name"].as_str().unwrap_or("?");
        let prompt = ids(&case["prompt"]);
        let llama = ids(&case["generated_by_prefill"]);
        let mut on_cpu = cpu.new_session();
        let mut on_gpu = gpu.new_session();
        cpu.append(&mut on_cpu, &prompt).expect("cpu prefill");
        gpu.append(&mut on_gpu, &prompt).expect("gpu prefill");
        let mut ours = Vec::new();
        let mut worst = (0.0f64, 0usize);
        let mut parted_at_tie = None;
        for step in 0..llama.len() {
            let diff = top_diff(on_cpu.next_logits(), on_gpu.next_logits(), 10);
            if diff > worst.0 {
                worst = (diff, step);
            }
            let token = argmax(on_gpu.next_logits()).expect("a finite logit");
            if parted_at_tie.is_none() && ours[..] == llama[..step] && token != llama[step] {
                let m = margin(on_cpu.next_logits());
                eprintln!("{name}: parts from llama.cpp at step {step}, the CPU's margin {m:.3}");
                if m >= NEAR_TIE {
                    failures.push(format!(
                        "{name}: greedy parts from llama.cpp at step {step}, where the CPU's \
                         top-1 leads by {m:.3}"
                    ));
                }
                parted_at_tie = Some(step);
            }
            ours.push(token);
            cpu.append(&mut on_cpu, &[token]).expect("cpu decode");
            gpu.append(&mut on_gpu, &[token]).expect("gpu decode");
        }
        worst_overall = worst_overall.max(worst.0);
        if worst.0 > LOGPROB_TOLERANCE {
            failures.push(format!(
                "{name}: top-10 logprobs differ from the CPU's by {:.4} at step {}",
                worst.0, worst.1
            ));
        }
        eprintln!(
            "{name}: {} prompt tokens, GPU vs CPU top-10 logprob difference up to {:.1e} (step {}), \
             greedy {}/{} equal to llama.cpp's batched path{}",
            prompt.len(),
            worst.0,
            worst.1,
            common_prefix(&ours, &llama),
            llama.len(),
            parted_at_tie.map_or(String::new(), |s| format!(" (parted at a near-tie, step {s})")),
        );
    }
    eprintln!("largest GPU vs CPU top-10 logprob difference: {worst_overall:.2e}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
