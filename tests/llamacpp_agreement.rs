//! Agreement with llama.cpp on the reference model: for every golden prompt
//! (tests/vectors/greedy_smollm2.json, made by scripts/golden-llamacpp), the
//! greedy continuation of 32 tokens matches llama.cpp's token for token, and
//! the log-probabilities of llama.cpp's top-10 tokens at the last prompt
//! position agree within 0.05.

use std::path::Path;
use std::sync::Arc;

use inferd::engine::{Engine, EngineConfig};
use inferd::model::Model;
use inferd::sampler::SamplingParams;
use serde_json::Value;

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const VECTORS: &str = "tests/vectors/greedy_smollm2.json";
const LOGPROB_TOLERANCE: f64 = 0.05;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// log-softmax of `logits` at `id`, computed in f64.
fn logprob(logits: &[f32], id: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    logits[id as usize] as f64 - max - sum.ln()
}

#[test]
fn greedy_continuations_and_top10_logprobs_match_llamacpp() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(VECTORS).expect("golden vectors")).expect("json");
    let cases = golden["cases"].as_array().expect("cases");
    assert!(cases.len() >= 8, "need at least 8 golden prompts");
    let model = Arc::new(Model::load(REFERENCE).expect("reference model loads"));
    let mut engine = Engine::new(model, &EngineConfig { threads: 2, ..EngineConfig::default() }).expect("engine");
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap_or("?");
        let prompt = ids(&case["prompt"]);
        assert!((5..=300).contains(&prompt.len()), "{name}: prompt length {}", prompt.len());
        let mut session = engine.new_session();
        engine.append(&mut session, &prompt).expect("prefill");

        let mut worst = 0f64;
        for pair in case["top_logprobs"].as_array().expect("top_logprobs") {
            let id = pair[0].as_u64().expect("id") as u32;
            let want = pair[1].as_f64().expect("logprob");
            let got = logprob(session.next_logits(), id);
            worst = worst.max((got - want).abs());
        }
        if worst > LOGPROB_TOLERANCE {
            failures.push(format!("{name}: top-10 logprob differs by {worst:.4}"));
        }

        let want = ids(&case["generated"]);
        let got = engine
            .generate(&mut session, &SamplingParams::greedy(), want.len(), &[], |_| true)
            .expect("generate")
            .tokens;
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
            failures.push(format!("{name}: greedy diverges at step {at}: got {got:?}, llama.cpp {want:?}"));
        }
        eprintln!("{name}: {} prompt tokens, worst top-10 logprob difference {worst:.5}", prompt.len());
    }
    assert!(failures.is_empty(), "disagreements with llama.cpp:\n{}", failures.join("\n"));
}
