//! 120 JSON Schemas (nested objects, bounded arrays, enums, anyOf/oneOf,
//! $ref and $defs, string patterns and formats, bounded numbers) through a
//! real server's `response_format`: every output that completes validates
//! with Python's `jsonschema` (`tests/interop/schema_corpus.py`).

mod support;

use std::process::Command;

use support::{have_reference, Inferd};

#[test]
fn every_completed_output_of_the_schema_corpus_validates() {
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
    cmd.arg("tests/interop/schema_corpus.py").arg(http);
    support::run_client("schema corpus", &mut cmd, "checks passed");
}
