//! `inferd make-model` as a user on a machine without downloads runs it:
//! the file it writes is one `inferd generate` and `inferd bench` run.

use std::process::{Command, Output};

fn inferd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args(args)
        .output()
        .expect("run inferd")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn a_made_model_generates_and_benches() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("qwen.gguf");
    let model = path.to_str().expect("utf-8");
    let out = inferd(&[
        "make-model",
        "--shape",
        "qwen2.5-0.5b",
        "--type",
        "Q4_K_M",
        "--layers",
        "2",
        "--vocab",
        "1024",
        "--out",
        model,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let len = std::fs::metadata(&path).expect("the file is there").len();
    let report = stdout(&out);
    assert!(report.contains(&format!("{len} bytes")), "{report}");
    // token_embd, output_norm (tied: no output), and 12 per qwen2 layer:
    // two norms, seven matrices, three biases.
    assert!(report.contains(" 26 tensors"), "{report}");
    assert!(report.contains("(2 layers, q4_k_m)"), "{report}");
    assert!(!dir.path().join("qwen.gguf.partial").exists());

    let out = inferd(&[
        "generate",
        "--model",
        model,
        "--tokens",
        "257,72,105",
        "-n",
        "4",
        "--format",
        "ids",
        "--ignore-eos",
        "--threads",
        "2",
        "--kv-mib",
        "16",
        "--sampler",
        "cpu",
        "--temperature",
        "0",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let ids: Vec<u32> = stdout(&out)
        .split_whitespace()
        .map(|s| s.parse().expect("an id"))
        .collect();
    assert_eq!(ids.len(), 4, "{}", stdout(&out));
    assert!(ids.iter().all(|&id| id < 1024), "{ids:?}");

    let out = inferd(&[
        "bench",
        "--model",
        model,
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "4",
        "--repetitions",
        "1",
        "--format",
        "json",
        "--threads",
        "2",
        "--kv-mib",
        "16",
        "--sampler",
        "cpu",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("\"tg_tokens_per_s\""),
        "{}",
        stdout(&out)
    );

    // The same flags write the same bytes.
    let again = dir.path().join("again.gguf");
    let out = inferd(&[
        "make-model",
        "--shape",
        "qwen2.5-0.5b",
        "--type",
        "q4_k_m",
        "--layers",
        "2",
        "--vocab",
        "1024",
        "--out",
        again.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(std::fs::read(&path).expect("read") == std::fs::read(&again).expect("read"));
}

#[test]
fn make_model_refuses_what_it_cannot_make() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    let model = path.to_str().expect("utf-8");
    let base = ["make-model", "--shape", "smollm2-135m", "--out", model];
    for (extra, says) in [
        (&["--type", "q8_k"][..], "q8_k"),
        (
            &["--type", "q8_0", "--layers", "0"][..],
            "n_layers must be at least 1",
        ),
        (
            &["--type", "q8_0", "--vocab", "100"][..],
            "vocabulary size 100",
        ),
        (&["--type", "q4_k_m", "--pure"][..], "--pure"),
    ] {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let out = inferd(&args);
        assert!(!out.status.success(), "{extra:?}");
        assert!(stderr(&out).contains(says), "{extra:?}: {}", stderr(&out));
        assert!(!path.exists(), "{extra:?} left a file");
    }
    let out = inferd(&[
        "make-model",
        "--shape",
        "gpt-2",
        "--type",
        "f16",
        "--out",
        model,
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("llama-3.2-1b"), "{}", stderr(&out));
}
