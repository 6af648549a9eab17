//! The client commands against a real `inferd serve` process: session ids
//! passed from one command to the next, typed failures with a non-zero
//! exit, and `generate`/`chat --server` printing exactly what the local
//! commands print.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const SYSTEM: &str = "You are a helpful assistant.";

fn have_model() -> bool {
    let ok = Path::new(REFERENCE).exists();
    if !ok {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
    }
    ok
}

/// A running `inferd serve`, killed when dropped so a failing test never
/// leaves a server behind.
struct ServerProcess {
    child: Child,
    addr: String,
}

impl ServerProcess {
    fn start(extra: &[&str]) -> ServerProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_inferd"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--workers",
                "1",
                "--model",
                REFERENCE,
            ])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn inferd serve");
        let stdout = child.stdout.take().expect("server stdout");
        let (tx, rx) = mpsc::channel();
        // Keeps reading to the end, so the server never writes to a closed pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(addr) = line.strip_prefix("listening on ") {
                    let _ = tx.send(addr.trim().to_owned());
                }
            }
        });
        let mut server = ServerProcess {
            child,
            addr: String::new(),
        };
        match rx.recv_timeout(Duration::from_secs(180)) {
            Ok(addr) => server.addr = addr,
            Err(e) => panic!("the server never printed 'listening on ADDR': {e}"),
        }
        server
    }

    /// Runs `inferd ARGS --server ADDR`.
    fn client(&self, args: &[&str]) -> Output {
        self.client_with_stdin(args, None)
    }

    fn client_with_stdin(&self, args: &[&str], stdin: Option<&str>) -> Output {
        run_inferd(
            &[args, &["--server", &self.addr, "--timeout", "300"]].concat(),
            stdin,
        )
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run_inferd(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run inferd");
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("write stdin");
    }
    child.wait_with_output().expect("inferd exits")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The first golden greedy case: a prompt and llama.cpp's continuation.
fn golden_case() -> (Vec<u32>, Vec<u32>) {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string("tests/vectors/greedy_smollm2.json").expect("golden"),
    )
    .expect("json");
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    let case = &golden["cases"][0];
    (ids(&case["prompt"]), ids(&case["generated_by_prefill"]))
}

fn joined(ids: &[u32], sep: &str) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(sep)
}

#[test]
fn session_commands_round_trip_ids_between_processes() {
    if !have_model() {
        return;
    }
    let (prompt, expected) = golden_case();
    let steps = 8;
    let expected = &expected[..steps];
    // A stop id that the expected continuation never produces.
    let eos = (0u32..)
        .find(|i| !expected.contains(i))
        .expect("an unused id");
    let server = ServerProcess::start(&[]);

    let out = server.client(&[
        "session",
        "create",
        "--label",
        "round trip",
        "--eos",
        &eos.to_string(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let id = stdout(&out).trim().to_owned();
    assert!(id.len() >= 16, "session id '{id}'");

    // The first ids as arguments, the rest on stdin (mixed separators).
    let (head, tail) = prompt.split_at(2);
    let head: Vec<String> = head.iter().map(u32::to_string).collect();
    let mut args = vec!["session", "append", id.as_str()];
    args.extend(head.iter().map(String::as_str));
    let out = server.client(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "2");
    let out = server.client_with_stdin(
        &["session", "append", &id],
        Some(&format!("{}\n", joined(tail, ", "))),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), prompt.len().to_string());

    let out = server.client(&[
        "session",
        "generate",
        &id,
        "--max-tokens",
        &steps.to_string(),
        "--temperature",
        "0",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), joined(expected, " "));
    let summary = stderr(&out);
    assert!(summary.contains("stop_reason=max_tokens"), "{summary}");
    assert!(
        summary.contains(&format!("generated_token_count={steps}")),
        "{summary}"
    );
    let history = prompt.len() + steps;
    assert!(
        summary.contains(&format!("history_length={history}")),
        "{summary}"
    );

    let out = server.client(&["session", "info", &id, "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let info: Value = serde_json::from_str(stdout(&out).trim()).expect("info is JSON");
    assert_eq!(info["session_id"], Value::from(id.as_str()));
    assert_eq!(info["history_length"], Value::from(history as u64));
    assert_eq!(info["client_label"], Value::from("round trip"));
    assert_eq!(info["cache_invariant_inv1_violations"], Value::from(0));
    assert_eq!(info["cache_invariant_inv2_violations"], Value::from(0));
    assert!(info["kv_live_bytes"].as_u64().unwrap_or(0) > 0, "{info}");

    let out = server.client(&["session", "info", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("history_length"), "{}", stdout(&out));

    // A fork at the prompt's end continues with the same golden tokens.
    let at = prompt.len().to_string();
    let out = server.client(&["session", "fork", &id, "--at", &at]);
    assert!(out.status.success(), "{}", stderr(&out));
    let fork = stdout(&out).trim().to_owned();
    assert!(fork.len() >= 16 && fork != id, "fork id '{fork}'");
    let steps_arg = steps.to_string();
    let out = server.client(&[
        "session",
        "generate",
        &fork,
        "-n",
        &steps_arg,
        "--temperature",
        "0",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), joined(expected, " "));
    let out = server.client(&["session", "close", &fork]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), history.to_string());

    let out = server.client(&["session", "close", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), history.to_string());

    let out = server.client(&["session", "close", &id]);
    assert!(!out.status.success(), "a second close must fail");
    assert!(stderr(&out).contains("NOT_FOUND"), "{}", stderr(&out));

    // The --eos ids reach the server: a session whose stop id is the
    // first greedy token stops right after emitting it.
    let first = expected[0].to_string();
    let out = server.client(&["session", "create", "--eos", &first]);
    assert!(out.status.success(), "{}", stderr(&out));
    let id = stdout(&out).trim().to_owned();
    let out = server.client_with_stdin(&["session", "append", &id], Some(&joined(&prompt, " ")));
    assert!(out.status.success(), "{}", stderr(&out));
    let out = server.client(&["session", "generate", &id, "-n", "4", "--seed", "7"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), first);
    assert!(stderr(&out).contains("stop_reason=eos"), "{}", stderr(&out));
    assert!(stderr(&out).contains("seed_used=7"), "{}", stderr(&out));
    let out = server.client(&["session", "close", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), (prompt.len() + 1).to_string());
}

#[test]
fn calls_on_unknown_sessions_fail_with_not_found() {
    if !have_model() {
        return;
    }
    let server = ServerProcess::start(&[]);
    // Well-formed (32 hex digits) but never handed out.
    let unknown = "0123456789abcdef0123456789abcdef";
    let out = server.client(&["session", "append", unknown, "1", "2"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("NOT_FOUND"), "{}", stderr(&out));
    assert!(stdout(&out).is_empty(), "{}", stdout(&out));

    let out = server.client(&["session", "generate", unknown, "-n", "1"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("NOT_FOUND"), "{}", stderr(&out));

    // Nothing listens here: the failure names the transport's status.
    let out = run_inferd(
        &[
            "session",
            "create",
            "--server",
            "127.0.0.1:1",
            "--timeout",
            "20",
        ],
        None,
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("UNAVAILABLE"), "{}", stderr(&out));
}

#[test]
fn the_bearer_token_is_sent_on_every_call() {
    if !have_model() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let token = dir.path().join("token");
    std::fs::write(&token, "let-me-in\n").expect("write token");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600))
            .expect("chmod token");
    }
    let token = token.to_str().expect("utf-8 path");
    let server = ServerProcess::start(&["--auth-token-file", token]);

    let out = server.client(&["session", "create"]);
    assert!(!out.status.success(), "a call without the token must fail");
    assert!(stderr(&out).contains("UNAUTHENTICATED"), "{}", stderr(&out));

    let out = server.client(&["session", "create", "--auth-token-file", token]);
    assert!(out.status.success(), "{}", stderr(&out));
    let id = stdout(&out).trim().to_owned();
    let out = server.client(&["session", "close", &id, "--auth-token-file", token]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "0");
}

#[test]
fn generate_over_the_server_prints_what_local_generate_prints() {
    if !have_model() {
        return;
    }
    let server = ServerProcess::start(&[]);
    for format in ["text", "ids"] {
        let args = [
            "generate",
            "--prompt",
            "The capital of France is",
            "-n",
            "16",
            "--temperature",
            "0",
            "--format",
            format,
        ];
        let local = run_inferd(&[&args[..], &["--threads", "2"]].concat(), None);
        assert!(local.status.success(), "{}", stderr(&local));
        let remote = server.client(&args);
        assert!(remote.status.success(), "{}", stderr(&remote));
        assert!(!stdout(&local).trim().is_empty());
        assert_eq!(stdout(&remote), stdout(&local), "--format {format}");
    }
}

#[test]
fn chat_over_the_server_says_what_local_chat_says() {
    if !have_model() {
        return;
    }
    let server = ServerProcess::start(&[]);
    let turns = "What is the capital of France?\nAnd of Germany?\n";
    let args = ["chat", "-n", "24", "--system", SYSTEM];
    let local = run_inferd(&[&args[..], &["--threads", "2"]].concat(), Some(turns));
    assert!(local.status.success(), "{}", stderr(&local));
    let remote = server.client_with_stdin(&args, Some(turns));
    assert!(remote.status.success(), "{}", stderr(&remote));
    let text = stdout(&remote);
    assert!(text.contains("Paris"), "{text}");
    assert!(text.contains("Berlin"), "{text}");
    assert_eq!(text, stdout(&local));
}
