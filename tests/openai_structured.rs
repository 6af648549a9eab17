//! Structured output (`response_format`, llama.cpp's `grammar` and
//! `json_schema`) of a real `inferd serve --http-listen`, driven by the
//! official `openai` Python package: a pydantic model round-trip
//! (`tests/interop/openai_structured.py`), its completions checks again on
//! Gemma 3 270M (a base model without a chat template), and 120 JSON
//! Schemas (nested objects, bounded arrays, enums, anyOf/oneOf, $ref and
//! $defs, string patterns and formats, bounded numbers) whose completed
//! outputs all validate with Python's `jsonschema`
//! (`tests/interop/schema_corpus.py`). Each script says what it checks.

mod support;

use std::process::Command;

use support::{have_reference, Inferd};

/// Runs `script` against a server of the reference model, until it prints
/// `checks passed`.
fn run_against_server(name: &str, script: &str) {
    if !have_reference() {
        return;
    }
    run_with_model(name, script, support::REFERENCE, &[]);
}

/// Runs `script ADDR args...` against a server of `model`.
fn run_with_model(name: &str, script: &str, model: &str, args: &[&str]) {
    let Some(python) = support::python_env() else {
        return;
    };
    let server = Inferd::start(&[
        "serve",
        "--model",
        model,
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ]);
    let http = server.http.as_deref().expect("an http address");
    let mut cmd = Command::new(python);
    cmd.arg(script).arg(http).args(args);
    support::run_client(name, &mut cmd, "checks passed");
}

/// Gemma 3 270M, a base model without a chat template: `/v1/completions`
/// with `response_format`, llama.cpp's `grammar` and `json_schema`.
#[test]
fn a_base_model_completes_under_a_schema_through_v1_completions() {
    let model = "models/gemma-3-270m-q4_k_m.gguf";
    if !std::path::Path::new(model).exists() {
        let message = format!("{model} is missing: run scripts/fetch-model gemma3-270m");
        assert!(!support::golden::models_required(), "{message}");
        eprintln!("\n!!! SKIPPED: {message}\n");
        return;
    }
    run_with_model(
        "openai structured (base model)",
        "tests/interop/openai_structured.py",
        model,
        &["base"],
    );
}

#[test]
fn the_openai_package_parses_constrained_output_into_its_model() {
    run_against_server("openai structured", "tests/interop/openai_structured.py");
}

#[test]
fn every_completed_output_of_the_schema_corpus_validates() {
    run_against_server("schema corpus", "tests/interop/schema_corpus.py");
}
