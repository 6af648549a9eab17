//! What the tests against llama.cpp's golden vectors share: reading ids
//! from the JSON, log-probabilities as llama.cpp's tool computes them, and
//! where the models those vectors were made on live.

use std::path::PathBuf;

use serde_json::Value;

/// The ids of a JSON array.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// log-softmax of `logits` at `id`, computed in f64 (as
/// scripts/llamacpp/golden.c does).
pub fn logprob(logits: &[f32], id: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    logits[id as usize] as f64 - max - sum.ln()
}

/// The largest difference between our log-probabilities and llama.cpp's
/// for its `[[id, logprob], ...]` list.
pub fn worst_logprob_diff(logits: &[f32], pairs: &Value) -> f64 {
    pairs
        .as_array()
        .expect("[[id, logprob], ...]")
        .iter()
        .map(|pair| {
            let id = pair[0].as_u64().expect("id") as u32;
            let want = pair[1].as_f64().expect("logprob");
            (logprob(logits, id) - want).abs()
        })
        .fold(0.0, f64::max)
}

/// How many leading tokens `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Where scripts/make-models writes the random-weight models of real shape.
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("INFERD_MODELS_DIR") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| ".".into(), PathBuf::from);
    home.join(".cache/inferd/models")
}

/// Whether missing models fail a test (scripts/test) rather than skip it
/// loudly.
pub fn models_required() -> bool {
    std::env::var_os("INFERD_REQUIRE_MODELS").is_some_and(|v| !v.is_empty() && v != "0")
}
