//! Agreement with llama.cpp on the models people deploy: every file of
//! tests/vectors/models/ (made by scripts/golden-models), one test each.
//!
//! Each vector names a model file: a random-weight model of real shape
//! (Llama-3.2-1B, Qwen2.5-0.5B, Qwen3-0.6B, Mistral-7B, a few layers deep)
//! in one quantization type, built by scripts/make-models into the models
//! cache, or Gemma 3 270M Q4_K_M (real weights) from scripts/fetch-model in
//! models/. For each file:
//!
//! - its SHA-256 must be the one llama.cpp ran on (else the vectors say
//!   nothing about it, and the failure says how to rebuild it);
//! - inferd's tokenizer must give llama.cpp's ids for every prompt text;
//! - at the last prompt position, the log-probabilities of llama.cpp's
//!   top-10 tokens agree within 0.05;
//! - the greedy continuation (32 tokens) equals llama.cpp's batched path
//!   token for token (so its incremental decode too, up to where llama.cpp's
//!   own two paths part; tests/llamacpp_agreement.rs says why), and at every
//!   step the log-probabilities of llama.cpp's top-10 agree within 0.05.
//!   The one exception is a near-tie: at a step where llama.cpp's top-1
//!   leads its top-2 by less than twice that tolerance, an engine within the
//!   tolerance may pick either, so the continuation is compared up to that
//!   step only. The random-weight models are built so that this never
//!   happens (their smallest margin is far larger); a real model such as
//!   Gemma has such steps.
//!
//! Without the model files the tests say so loudly and pass, unless
//! INFERD_REQUIRE_MODELS is set (scripts/test sets it, after making them).

mod support;

use std::path::PathBuf;
use std::sync::Arc;

use inferd::cluster::fingerprint::sha256_of_file;
use inferd::engine::{Engine, EngineConfig};
use inferd::gguf::GgufFile;
use inferd::model::Model;
use inferd::sampler::argmax;
use inferd::tokenizer::Tokenizer;
use serde_json::Value;
use support::golden::{common_prefix, ids, models_dir, models_required, worst_logprob_diff};

const LOGPROB_TOLERANCE: f64 = 0.05;
/// Below this top-1 minus top-2 margin, llama.cpp's greedy choice is within
/// the tolerance of the runner-up.
const DECISIVE_MARGIN: f64 = 2.0 * LOGPROB_TOLERANCE;

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn vectors_dir() -> PathBuf {
    manifest_dir().join("tests/vectors/models")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks one vector file; panics with every disagreement found. Returns
/// false when the model is absent and not required (nothing was checked).
fn check(stem: &str) -> bool {
    let path = vectors_dir().join(format!("{stem}.json"));
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .expect("vector file is JSON");
    let about = &doc["model"];
    let file = about["file"].as_str().expect("model.file");
    let rebuild = about["rebuild"].as_str().expect("model.rebuild");
    let model_path = match about["dir"].as_str() {
        Some("models") => manifest_dir().join("models").join(file),
        Some("cache") => models_dir().join(file),
        other => panic!("{stem}: unknown model.dir {other:?}"),
    };
    if !model_path.exists() {
        let message = format!("{} is missing: run `{rebuild}`", model_path.display());
        if models_required() {
            panic!("{message}");
        }
        eprintln!("\n!!! SKIPPED {stem}: {message}\n");
        return false;
    }
    let want_sha = about["sha256"].as_str().expect("model.sha256");
    let got_sha = hex(&sha256_of_file(&model_path).expect("read the model"));
    assert_eq!(
        got_sha,
        want_sha,
        "{}: SHA-256 {got_sha}, but llama.cpp's vectors were made on {want_sha}. \
         Rebuild it with `{rebuild}` (delete the file first; for a random-weight model \
         also its .recipe), or regenerate the vectors with scripts/golden-models {stem}.",
        model_path.display()
    );

    let mut failures = Vec::new();
    let cases = doc["cases"].as_array().expect("cases");

    // The tokenizer, from the same file.
    let gguf = GgufFile::open(&model_path).expect("the model opens");
    match Tokenizer::from_gguf(&gguf) {
        Ok(tokenizer) => {
            let bos = doc["vocab"]["bos"].as_u64().expect("vocab.bos") as u32;
            for case in cases {
                let name = case["name"].as_str().unwrap_or("?");
                let text = case["text"].as_str().expect("text");
                let mut ours = Vec::new();
                if case["bos_prepended"].as_bool().expect("bos_prepended") {
                    ours.push(bos);
                }
                match tokenizer.encode(text, false, true) {
                    Ok(t) => ours.extend(t),
                    Err(e) => failures.push(format!("{name}: tokenizer: {e}")),
                }
                let want = ids(&case["prompt"]);
                if ours != want {
                    failures.push(format!(
                        "{name}: tokenizer gives {ours:?}, llama.cpp {want:?}"
                    ));
                }
            }
        }
        Err(e) => failures.push(format!("tokenizer does not load: {e}")),
    }
    drop(gguf);

    let model = match Model::load(&model_path) {
        Ok(m) => Arc::new(m),
        Err(e) => panic!(
            "{stem}: {} does not load: {e}\n{}",
            model_path.display(),
            failures.join("\n")
        ),
    };
    let config = EngineConfig {
        threads: 2,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model, &config).expect("engine");
    for case in cases {
        let name = case["name"].as_str().unwrap_or("?");
        let prompt = ids(&case["prompt"]);
        let llama_prefill = ids(&case["generated_by_prefill"]);
        let llama_decode = ids(&case["generated"]);
        let top_by_step = case["top_logprobs_by_prefill"]
            .as_array()
            .expect("top_logprobs_by_prefill");
        let mut session = engine.new_session();
        engine.append(&mut session, &prompt).expect("prefill");
        let at_prompt = worst_logprob_diff(session.next_logits(), &case["top_logprobs"]);
        if at_prompt > LOGPROB_TOLERANCE {
            failures.push(format!(
                "{name}: top-10 logprobs at the last prompt position differ by up to {at_prompt:.4}"
            ));
        }
        // Greedy, one token at a time, comparing every step's top-10 while
        // our tokens are llama.cpp's.
        let mut ours = Vec::with_capacity(llama_prefill.len());
        let mut worst_step = (0.0f64, 0usize);
        for step in 0..llama_prefill.len() {
            let logits = session.next_logits();
            if ours[..] == llama_prefill[..step] {
                let diff = worst_logprob_diff(logits, &top_by_step[step]);
                if diff > worst_step.0 {
                    worst_step = (diff, step);
                }
            }
            let token = argmax(logits).expect("a finite logit");
            ours.push(token);
            if step + 1 < llama_prefill.len() {
                engine.append(&mut session, &[token]).expect("decode");
            }
        }
        if worst_step.0 > LOGPROB_TOLERANCE {
            failures.push(format!(
                "{name}: top-10 logprobs differ by up to {:.4} at step {}",
                worst_step.0, worst_step.1
            ));
        }
        // Ours must be llama.cpp's at every step, except that at a
        // near-tie the two may part (and are compared no further).
        let margins = case["margins_by_prefill"]
            .as_array()
            .expect("margins_by_prefill");
        let agreed = common_prefix(&ours, &llama_prefill);
        if agreed < llama_prefill.len() {
            let margin = margins[agreed].as_f64().expect("margin");
            if margin >= DECISIVE_MARGIN {
                failures.push(format!(
                    "{name}: greedy parts from llama.cpp at step {agreed}, where llama.cpp's top-1 \
                     leads by {margin:.3}: ours {ours:?}, llama.cpp {llama_prefill:?}"
                ));
            }
        }
        eprintln!(
            "{stem} {name}: {} prompt tokens, top-10 logprob difference {at_prompt:.1e} at the prompt, \
             {:.1e} at worst along the continuation (step {}), greedy {agreed}/{} equal to llama.cpp's \
             batched path, {}/{} to its incremental decode",
            prompt.len(),
            worst_step.0,
            worst_step.1,
            llama_prefill.len(),
            common_prefix(&ours, &llama_decode),
            llama_decode.len()
        );
    }
    assert!(
        failures.is_empty(),
        "{stem}: disagreements with llama.cpp:\n{}",
        failures.join("\n")
    );
    true
}

/// Files inferd does not yet agree on, each with what is known. Their
/// tests pass only while the disagreement lasts, so a fix has to move the
/// file out of this list (and a new disagreement anywhere else fails).
const KNOWN_GAPS: &[(&str, &str)] = &[];

/// Checks `stem`, or, for a known gap, that it still disagrees.
fn check_or_known_gap(stem: &str) {
    let Some((_, why)) = KNOWN_GAPS.iter().find(|(s, _)| *s == stem) else {
        check(stem);
        return;
    };
    match std::panic::catch_unwind(|| check(stem)) {
        Err(_) => eprintln!("*** KNOWN GAP {stem}: {why} ***"),
        Ok(false) => {}
        Ok(true) => panic!("{stem} now agrees with llama.cpp: remove it from KNOWN_GAPS"),
    }
}

macro_rules! vector_tests {
    ($($test:ident => $stem:literal,)*) => {
        $(
            #[test]
            fn $test() {
                check_or_known_gap($stem);
            }
        )*
        /// Every vector file a test above checks.
        const CHECKED: &[&str] = &[$($stem),*];
    };
}

vector_tests! {
    llama_3_2_1b_q4_k_m => "llama-3.2-1b-rand-2l-q4_k_m",
    llama_3_2_1b_q5_k_m => "llama-3.2-1b-rand-2l-q5_k_m",
    llama_3_2_1b_q6_k => "llama-3.2-1b-rand-2l-q6_k",
    llama_3_2_1b_q8_0 => "llama-3.2-1b-rand-2l-q8_0",
    llama_3_2_1b_q4_0 => "llama-3.2-1b-rand-2l-q4_0",
    llama_3_2_1b_iq4_xs => "llama-3.2-1b-rand-2l-iq4_xs",
    llama_3_2_1b_iq4_nl => "llama-3.2-1b-rand-2l-iq4_nl",
    qwen2_5_0_5b_q4_k_m => "qwen2.5-0.5b-rand-2l-q4_k_m",
    qwen2_5_0_5b_q5_k_m => "qwen2.5-0.5b-rand-2l-q5_k_m",
    qwen2_5_0_5b_q6_k => "qwen2.5-0.5b-rand-2l-q6_k",
    qwen2_5_0_5b_q8_0 => "qwen2.5-0.5b-rand-2l-q8_0",
    qwen2_5_0_5b_q4_0 => "qwen2.5-0.5b-rand-2l-q4_0",
    qwen2_5_0_5b_iq4_xs => "qwen2.5-0.5b-rand-2l-iq4_xs",
    qwen2_5_0_5b_iq4_nl => "qwen2.5-0.5b-rand-2l-iq4_nl",
    qwen3_0_6b_q4_k_m => "qwen3-0.6b-rand-2l-q4_k_m",
    qwen3_0_6b_q5_k_m => "qwen3-0.6b-rand-2l-q5_k_m",
    qwen3_0_6b_q6_k => "qwen3-0.6b-rand-2l-q6_k",
    qwen3_0_6b_q8_0 => "qwen3-0.6b-rand-2l-q8_0",
    qwen3_0_6b_q4_0 => "qwen3-0.6b-rand-2l-q4_0",
    qwen3_0_6b_iq4_xs => "qwen3-0.6b-rand-2l-iq4_xs",
    qwen3_0_6b_iq4_nl => "qwen3-0.6b-rand-2l-iq4_nl",
    mistral_7b_q4_k_m => "mistral-7b-v0.1-rand-2l-q4_k_m",
    mistral_7b_q5_k_m => "mistral-7b-v0.1-rand-2l-q5_k_m",
    mistral_7b_q6_k => "mistral-7b-v0.1-rand-2l-q6_k",
    mistral_7b_q8_0 => "mistral-7b-v0.1-rand-2l-q8_0",
    mistral_7b_q4_0 => "mistral-7b-v0.1-rand-2l-q4_0",
    mistral_7b_iq4_xs => "mistral-7b-v0.1-rand-2l-iq4_xs",
    mistral_7b_iq4_nl => "mistral-7b-v0.1-rand-2l-iq4_nl",
    gemma_3_270m_q4_k_m => "gemma-3-270m-q4_k_m",
}

/// A vector file no test checks would be a silent gap.
#[test]
fn every_vector_file_has_a_test() {
    let mut files: Vec<String> = std::fs::read_dir(vectors_dir())
        .expect("tests/vectors/models")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".json").map(str::to_owned))
        .collect();
    files.sort();
    let mut checked: Vec<String> = CHECKED.iter().map(|s| s.to_string()).collect();
    checked.sort();
    assert_eq!(
        files, checked,
        "tests/vectors/models/ and the tests listed here differ"
    );
}
