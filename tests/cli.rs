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
    // Plain, prompt-lookup and draft-model decoding (the model drafting for
    // itself) alike.
    let model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    for speculation in [
        &["--speculate", "none"][..],
        &["--speculate", "lookup"],
        &["--draft-model", model, "--draft-tokens", "3"],
    ] {
        let mut args = vec![
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
        ];
        args.extend_from_slice(speculation);
        let out = inferd(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let got: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        assert_eq!(got, ids(&case["generated_by_prefill"]), "{speculation:?}");
    }
    // A draft needs its model, and a draft model is for drafting.
    let out = inferd(&["generate", "--tokens", "1,2", "--speculate", "draft"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--draft-model"), "{}", stderr(&out));
    let out = inferd(&[
        "generate",
        "--tokens",
        "1,2",
        "--speculate",
        "lookup",
        "--draft-model",
        model,
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--speculate draft"),
        "{}",
        stderr(&out)
    );
    // The same rules for `serve`, whose draft model is checked at start.
    let serve = |extra: &[&str]| {
        let mut args = vec!["serve", "--model", model, "--check"];
        args.extend_from_slice(extra);
        inferd(&args)
    };
    let out = serve(&["--speculate", "draft"]);
    assert!(
        stderr(&out).contains("needs --draft-model"),
        "{}",
        stderr(&out)
    );
    let out = serve(&["--draft-tokens", "3"]);
    assert!(
        stderr(&out).contains("needs --draft-model"),
        "{}",
        stderr(&out)
    );
    let out = serve(&["--speculate", "none", "--draft-model", model]);
    assert!(
        stderr(&out).contains("--speculate draft"),
        "{}",
        stderr(&out)
    );
    let out = serve(&["--draft-model", model, "--draft-tokens", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let shown = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(shown.contains("speculation by draft model"), "{shown}");
    let gemma = "models/gemma-3-270m-q4_k_m.gguf";
    if std::path::Path::new(gemma).exists() {
        let out = serve(&["--draft-model", gemma]);
        assert!(!out.status.success());
        assert!(
            stderr(&out).contains("does not have the main model's vocabulary"),
            "{}",
            stderr(&out)
        );
    }
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
    assert!(
        stderr(&out).contains("scripts/fetch-model"),
        "{}",
        stderr(&out)
    );

    // A file that is there but is no model: the reason, and no download hint.
    let dir = tempfile::tempdir().expect("tempdir");
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"not a gguf file at all").expect("write");
    let out = inferd(&[
        "generate",
        "--model",
        junk.to_str().expect("utf-8"),
        "--tokens",
        "1",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("junk.gguf"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("fetch-model"), "{}", stderr(&out));

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

/// `inferd chat` with these lines on stdin (and `--threads 2`).
fn chat_child(extra: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args([
            "chat",
            "--threads",
            "2",
            "--system",
            "You are a helpful assistant.",
        ])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn chat")
}

#[test]
fn chat_saves_loads_and_resets_conversations_and_reports_its_speed() {
    if !have_model() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let saved = dir.path().join("conversation.json");
    let mut child = chat_child(&["-n", "24"]);
    let script = format!(
        "What is the capital of France?\n/save {0}\n/reset\n/load {0}\nAnd of Germany?\n/help\n",
        saved.display()
    );
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("chat exits");
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Paris"), "{text}");
    assert!(
        text.contains("Berlin"),
        "the loaded conversation goes on: {text}"
    );
    let messages: Value =
        serde_json::from_str(&std::fs::read_to_string(&saved).expect("saved")).expect("JSON");
    let roles: Vec<&str> = messages
        .as_array()
        .expect("a list")
        .iter()
        .map(|m| m["role"].as_str().expect("a role"))
        .collect();
    assert_eq!(roles, ["system", "user", "assistant"]);
    assert!(messages[2]["content"]
        .as_str()
        .is_some_and(|c| c.contains("Paris")));
    for said in [
        "saved 3 messages",
        "a new conversation",
        "loaded 3 messages",
        "tokens/s",
        "/reset",
    ] {
        assert!(err.contains(said), "stderr lacks {said:?}: {err}");
    }
}

#[test]
fn ctrl_c_stops_a_chat_reply_and_the_chat_goes_on() {
    if !have_model() {
        return;
    }
    use std::io::Read;
    let mut child = chat_child(&["-n", "400"]);
    let mut stdin = child.stdin.take().expect("stdin");
    stdin
        .write_all(b"Tell me a long story about a brave knight and a dragon.\n")
        .expect("write");
    // Read the reply as it streams; once it has begun, Ctrl-C.
    let mut stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 256];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
            let _ = tx.send(all.len());
        }
        all
    });
    let t0 = std::time::Instant::now();
    while rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the reply streams")
        < 40
    {
        assert!(t0.elapsed().as_secs() < 60, "no reply");
    }
    // SAFETY: signalling our own child process.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    stdin
        .write_all(b"What is the capital of France?\n")
        .expect("write");
    drop(stdin);
    let status = child.wait().expect("chat exits");
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    let text = String::from_utf8_lossy(&reader.join().expect("reader")).into_owned();
    assert!(status.success(), "{err}");
    assert!(err.contains("(stopped: "), "the reply was stopped: {err}");
    assert!(text.contains("Paris"), "the chat went on: {text}");
}

/// Where `scripts/fetch-vocabs` puts llama.cpp's vocabulary-only files.
fn vocab_dir() -> std::path::PathBuf {
    match std::env::var_os("INFERD_VOCAB_DIR") {
        Some(dir) => dir.into(),
        None => {
            Path::new(&std::env::var_os("HOME").unwrap_or_default()).join(".cache/inferd/vocabs")
        }
    }
}

/// The vocabulary-only GGUF `ggml-vocab-NAME.gguf` and its test cases
/// (text, expected ids), or `None` (said loudly) when it has not been
/// fetched; a missing file fails instead under `CI` or
/// `INFERD_REQUIRE_VOCABS`.
fn vocab(name: &str) -> Option<(String, Vec<(String, String)>)> {
    let gguf = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
    let (inp, out) = (
        gguf.with_extension("gguf.inp"),
        gguf.with_extension("gguf.out"),
    );
    if !(gguf.exists() && inp.exists() && out.exists()) {
        let required = ["CI", "INFERD_REQUIRE_VOCABS"]
            .iter()
            .any(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty() && v != "0"));
        assert!(
            !required,
            "{} is missing (scripts/fetch-vocabs)",
            gguf.display()
        );
        eprintln!(
            "SKIPPED: {} is absent; run scripts/fetch-vocabs",
            gguf.display()
        );
        return None;
    }
    let inp = std::fs::read_to_string(inp).expect("read .inp");
    let out = std::fs::read_to_string(out).expect("read .out");
    let texts = inp
        .strip_suffix("\n__ggml_vocab_test__\n")
        .unwrap_or(&inp)
        .split("\n__ggml_vocab_test__\n");
    let cases = texts
        .zip(out.lines())
        .map(|(t, ids)| (t.to_owned(), ids.trim().to_owned()))
        .collect();
    Some((gguf.display().to_string(), cases))
}

#[test]
fn tokenize_works_on_vocabulary_only_files() {
    for name in ["llama-bpe", "llama-spm", "qwen2", "deepseek-llm", "gpt-2"] {
        let Some((gguf, cases)) = vocab(name) else {
            continue;
        };
        // The longest case mixes scripts, emoji, code, digits and spaces.
        let (text, want) = cases.iter().max_by_key(|(t, _)| t.len()).expect("cases");
        let out = inferd(&["tokenize", "-m", &gguf, "--no-special", "--text", text]);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("{want}\n"),
            "{name}"
        );

        let ids = want.replace(' ', ",");
        let out = inferd(&["tokenize", "-m", &gguf, "--no-special", "--ids", &ids]);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        assert_eq!(&String::from_utf8_lossy(&out.stdout), text, "{name}");
    }
}

#[test]
fn tokenize_adds_and_shows_special_tokens_unless_told_not_to() {
    let Some((gguf, _)) = vocab("llama-bpe") else {
        return;
    };
    let run = |args: &[&str]| {
        let out = inferd(&[&["tokenize", "-m", &gguf][..], args].concat());
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        String::from_utf8(out.stdout).expect("UTF-8")
    };
    // Llama 3 adds <|begin_of_text|> (128000); <|eot_id|> is 128009.
    assert_eq!(run(&["--text", "Hello world"]), "128000 9906 1917\n");
    assert_eq!(
        run(&["--no-special", "--text", "Hello world"]),
        "9906 1917\n"
    );
    assert_eq!(run(&["--text", "Hello<|eot_id|>"]), "128000 9906 128009\n");
    let plain = run(&["--no-special", "--text", "<|eot_id|>"]);
    assert!(
        !plain.split_whitespace().any(|id| id == "128009"),
        "{plain}"
    );
    assert_eq!(
        run(&["--ids", "128000 9906 1917 128009"]),
        "<|begin_of_text|>Hello world<|eot_id|>"
    );
    assert_eq!(
        run(&["--no-special", "--ids", "128000,9906,1917,128009"]),
        "Hello world"
    );
}

#[test]
fn tokenize_refuses_bad_input_with_a_message() {
    let missing = inferd(&["tokenize", "-m", "no/such/file.gguf", "--text", "x"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        stderr(&missing).contains("no/such/file.gguf"),
        "{}",
        stderr(&missing)
    );

    let neither = inferd(&["tokenize", "-m", "no/such/file.gguf"]);
    assert_eq!(neither.status.code(), Some(2), "clap usage error");
    let both = inferd(&["tokenize", "--text", "a", "--ids", "1"]);
    assert_eq!(both.status.code(), Some(2), "clap usage error");

    let Some((gguf, _)) = vocab("gpt-2") else {
        return;
    };
    let out = inferd(&["tokenize", "-m", &gguf, "--ids", "1,99999999"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("outside the vocabulary"),
        "{}",
        stderr(&out)
    );
    let out = inferd(&["tokenize", "-m", &gguf, "--ids", "1,two"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("\"two\""), "{}", stderr(&out));
}

#[test]
fn a_kv_cache_larger_than_the_machine_is_refused_up_front_with_numbers() {
    if !have_model() {
        return;
    }
    // 64 TiB: more than any machine the tests run on.
    let huge = (64u64 << 20).to_string();
    for args in [
        vec!["serve", "--model", REFERENCE, "--kv-mib", &huge, "--check"],
        vec![
            "generate", "--model", REFERENCE, "--kv-mib", &huge, "-p", "hi", "-n", "1",
        ],
    ] {
        let out = inferd(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = stderr(&out);
        assert!(
            err.contains("a KV cache of 67108864 MiB") && err.contains("lower --kv-mib"),
            "{args:?}: {err}"
        );
    }
}
