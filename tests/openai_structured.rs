//! Structured output (`response_format`) of a real `inferd serve
//! --http-listen`, driven by the official `openai` Python package with a
//! pydantic model (`tests/interop/openai_structured.py` says what it
//! checks).

mod support;

use std::process::Command;

use support::{have_reference, Inferd};

#[test]
fn the_openai_package_parses_constrained_output_into_its_model() {
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
    cmd.arg("tests/interop/openai_structured.py").arg(http);
    support::run_client("openai structured", &mut cmd, "checks passed");
}
