//! Structured output (`response_format`, llama.cpp's `grammar` and
//! `json_schema`) of a real `inferd serve --http-listen`, driven by the
//! official `openai` Python package: a pydantic model round-trip
//! (`tests/interop/openai_structured.py`), and 120 JSON Schemas (nested
//! objects, bounded arrays, enums, anyOf/oneOf, $ref and $defs, string
//! patterns and formats, bounded numbers) whose completed outputs all
//! validate with Python's `jsonschema` (`tests/interop/schema_corpus.py`).
//! Each script says what it checks.

mod support;

use std::process::Command;

use support::{have_reference, Inferd};

/// Runs `script` against a server of the reference model, until it prints
/// `checks passed`.
fn run_against_server(name: &str, script: &str) {
    if !have_reference() {
        return;
    }
    let Some(python) = support::python_env() else {
        return;
    };
    let server = Inferd::start(&[
        "serve",
        "--model",
        support::REFERENCE,
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ]);
    let http = server.http.as_deref().expect("an http address");
    let mut cmd = Command::new(python);
    cmd.arg(script).arg(http);
    support::run_client(name, &mut cmd, "checks passed");
}

#[test]
fn the_openai_package_parses_constrained_output_into_its_model() {
    run_against_server("openai structured", "tests/interop/openai_structured.py");
}

#[test]
fn every_completed_output_of_the_schema_corpus_validates() {
    run_against_server("schema corpus", "tests/interop/schema_corpus.py");
}
