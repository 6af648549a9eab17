//! Tool calls (`tools`, `tool_choice`, `parallel_tool_calls`) of a real
//! `inferd serve --http-listen`, driven by the official `openai` Python
//! package (`tests/interop/openai_tools.py`, which says what it checks):
//!
//! - the reference model, whose template has no tool syntax (the generic
//!   JSON form), checked for what it says too;
//! - each native call syntax through its family's own chat template
//!   (`--chat-template-file`, templates fetched by `scripts/fetch-vocabs`)
//!   on a random-weight model of that family (`scripts/make-models`):
//!   Hermes (Qwen 2.5), Llama 3 (Llama 3.2) and Mistral (Mistral Nemo's
//!   template). Random weights say nothing sensible; the constraint still
//!   makes every required call parse and fit its schema, and the calls
//!   still go through the template and back.
//!
//! A missing model or template fails the test when INFERD_REQUIRE_MODELS /
//! INFERD_REQUIRE_VOCABS is set (scripts/test sets both) and is skipped
//! loudly otherwise.

mod support;

use std::path::PathBuf;
use std::process::Command;

use support::golden::{models_dir, models_required};
use support::{have_reference, Inferd};

/// Runs the script against `inferd serve` with `args`, in `mode`.
fn run_script(args: &[&str], mode: &str) {
    let Some(python) = support::python_env() else {
        return;
    };
    let mut all = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ];
    all.extend_from_slice(args);
    let server = Inferd::start(&all);
    let http = server.http.as_deref().expect("an http address");
    let mut cmd = Command::new(python);
    cmd.arg("tests/interop/openai_tools.py").arg(http).arg(mode);
    support::run_client(&format!("openai tools ({mode})"), &mut cmd, "checks passed");
}

#[test]
fn the_reference_model_calls_tools_in_the_generic_form() {
    if !have_reference() {
        return;
    }
    run_script(&["--model", support::REFERENCE], "reference");
}

/// A random-weight model of a family with that family's template, or
/// `None` (skipped loudly) when one is missing and not required.
fn native(model: &str, template: &str) -> Option<(PathBuf, PathBuf)> {
    let model = models_dir().join(model);
    let template = support::vocab_dir().join("templates").join(template);
    if !model.exists() {
        let message = format!("{} is missing: run scripts/make-models", model.display());
        assert!(!models_required(), "{message}");
        eprintln!("\n!!! SKIPPED: {message}\n");
        return None;
    }
    if !template.exists() {
        let message = format!(
            "{} is missing: run scripts/fetch-vocabs",
            template.display()
        );
        assert!(!support::vocabs_required(), "{message}");
        eprintln!("\n!!! SKIPPED: {message}\n");
        return None;
    }
    Some((model, template))
}

fn run_native(model: &str, template: &str) {
    let Some((model, template)) = native(model, template) else {
        return;
    };
    let (model, template) = (model.to_string_lossy(), template.to_string_lossy());
    run_script(
        &["--model", &model, "--chat-template-file", &template],
        "native",
    );
}

#[test]
fn hermes_calls_through_qwens_template() {
    run_native(
        "qwen2.5-0.5b-rand-2l-q4_0.gguf",
        "Qwen-Qwen2.5-7B-Instruct.jinja",
    );
}

#[test]
fn llama3_calls_through_llamas_template() {
    run_native(
        "llama-3.2-1b-rand-2l-q4_0.gguf",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
    );
}

#[test]
fn mistral_calls_through_mistrals_template() {
    run_native(
        "mistral-7b-v0.1-rand-2l-q4_0.gguf",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    );
}
