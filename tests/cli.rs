//! The `inferd` binary as a user runs it: ids out for scripts, text chat
//! over stdin, and clear failures with a non-zero exit for bad input.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

fn have_model() -> bool {
    let ok = Path::new(REFERENCE).exists();
    if !ok {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
    }
    ok
}

fn inferd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args(args)
        .output()
        .expect("run inferd")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn generate_ids_reproduces_llamacpp_greedy() {
    if !have_model() {
        return;
    }
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string("tests/vectors/greedy_smollm2.json").expect("golden"),
    )
    .expect("json");
    let case = &golden["cases"][0];
    let ids = |v: &Value| -> Vec<String> {
        v.as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id").to_string())
            .collect()
    };
    let prompt = ids(&case["prompt"]).join(",");
    let out = inferd(&[
        "generate",
        "--tokens",
        &prompt,
        "--format",
        "ids",
        "--temperature",
        "0",
        "-n",
        "32",
        "--ignore-eos",
        "--threads",
        "2",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let got: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    assert_eq!(got, ids(&case["generated_by_prefill"]));
}

#[test]
fn bad_input_fails_with_a_message_and_a_non_zero_exit() {
    if !have_model() {
        return;
    }
    let out = inferd(&["generate", "--tokens", "1,2,99999999", "-n", "1"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("outside the vocabulary"),
        "{}",
        stderr(&out)
    );

    let out = inferd(&["generate", "--tokens", "1", "--temperature=-1"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("temperature"), "{}", stderr(&out));

    let out = inferd(&[
        "generate",
        "--model",
        "/nonexistent/model.gguf",
        "--tokens",
        "1",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("/nonexistent/model.gguf"),
        "{}",
        stderr(&out)
    );

    let out = inferd(&["generate", "--tokens", "1,x"]);
    assert!(!out.status.success());
    assert_eq!(
        out.status.code(),
        Some(2),
        "usage errors exit 2: {}",
        stderr(&out)
    );
}

#[test]
fn chat_answers_each_line_of_stdin() {
    if !have_model() {
        return;
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args([
            "chat",
            "-n",
            "24",
            "--threads",
            "2",
            "--system",
            "You are a helpful assistant.",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn chat");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"What is the capital of France?\nAnd of Germany?\n")
        .expect("write");
    let out = child.wait_with_output().expect("chat exits");
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Paris"), "{text}");
    assert!(text.contains("Berlin"), "{text}");
}
