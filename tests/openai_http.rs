//! The OpenAI-compatible HTTP API of a real `inferd serve --http-listen`,
//! driven by the official `openai` Python package (in the virtualenv
//! `scripts/python-env` keeps; `tests/interop/openai_client.py` says what
//! it checks) and by `curl` reading the server-sent events raw, with and
//! without a bearer token.

mod support;

use std::path::Path;
use std::process::Command;

use support::{have_reference, Inferd};

const CLIENT: &str = "tests/interop/openai_client.py";

fn serve(extra: &[&str]) -> Inferd {
    support::serve_model(
        support::REFERENCE,
        &[&["--http-listen", "127.0.0.1:0"], extra].concat(),
    )
}

/// Whether the reference model and curl are here; a missing curl is a
/// loud skip, and a failure where the tests' requirements are enforced.
fn have_reference_and_curl() -> bool {
    if !have_reference() {
        return false;
    }
    if Command::new("curl").arg("--version").output().is_err() {
        eprintln!("SKIPPED (LOUDLY): curl is not installed; scripts/setup installs it");
        assert!(!support::vocabs_required(), "curl is missing in CI");
        return false;
    }
    true
}

fn run_client(python: &Path, server: &Inferd, token: Option<&str>) {
    let http = server.http.as_deref().expect("an http address");
    let mut cmd = Command::new(python);
    cmd.arg(CLIENT).arg(http).arg(&server.addr);
    if let Some(token) = token {
        cmd.arg(token);
    }
    cmd.env("PYTHONPATH", "tests/interop");
    support::run_client("openai client", &mut cmd, "checks passed");
}

#[test]
fn the_openai_python_package_drives_the_http_api() {
    if !have_reference() {
        return;
    }
    let Some(python) = support::python_env() else {
        return;
    };
    let server = serve(&[]);
    run_client(&python, &server, None);
}

#[test]
fn a_bearer_token_guards_the_http_api() {
    if !have_reference() {
        return;
    }
    let Some(python) = support::python_env() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token\n").expect("token file");
    let token_path = token_file.to_str().expect("utf-8");
    let server = serve(&["--auth-token-file", token_path]);
    run_client(&python, &server, Some("s3cret-token"));
}

/// With a worker pinned to the first core, the HTTP threads are pinned to
/// the others, off the worker's core.
#[cfg(target_os = "linux")]
#[test]
fn http_threads_stay_off_the_workers_cores() {
    if !have_reference() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        eprintln!("SKIPPED: one core, nothing to keep the HTTP threads apart on");
        return;
    }
    let server = Inferd::start(&[
        "serve",
        "--model",
        support::REFERENCE,
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--workers",
        "1",
    ]);
    let pid = server.pid().expect("running");
    // "0-2,5" -> [0, 1, 2, 5]
    let cpus_of = |list: &str| -> Vec<usize> {
        list.split(',')
            .filter(|part| !part.is_empty())
            .flat_map(|part| {
                let (a, b) = part.split_once('-').unwrap_or((part, part));
                let (a, b): (usize, usize) = (a.parse().expect("cpu"), b.parse().expect("cpu"));
                a..=b
            })
            .collect()
    };
    // Threads pin themselves as they start: look until they have.
    let t0 = std::time::Instant::now();
    loop {
        let (worker, http) = threads(pid, &cpus_of);
        let Some(worker) = worker else {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(5),
                "no inferd-worker-0 thread"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
            continue;
        };
        assert_eq!(
            worker.len(),
            1,
            "the worker is pinned to one core: {worker:?}"
        );
        // A thread names itself once it runs: on a busy machine one just
        // spawned still has its parent's name, so none may be seen yet.
        let off = !http.is_empty()
            && http
                .iter()
                .all(|cpus| !cpus.is_empty() && !cpus.contains(&worker[0]));
        if off {
            break;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "no inferd-http thread, or one may run on the worker's core {}: {http:?}",
            worker[0]
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Per thread of process `pid`: the cores `inferd-worker-0` and the
/// `inferd-http` threads may run on.
type Cores = Vec<usize>;
fn threads(pid: u32, cpus_of: &dyn Fn(&str) -> Cores) -> (Option<Cores>, Vec<Cores>) {
    let (mut worker, mut http) = (None, Vec::new());
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("tasks")
        .flatten()
    {
        let path = task.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(path.join("status")).unwrap_or_default();
        let Some(list) = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        else {
            continue;
        };
        let cpus = cpus_of(list.trim());
        match comm.trim() {
            "inferd-http" => http.push(cpus),
            "inferd-worker-0" => worker = Some(cpus),
            _ => {}
        }
    }
    (worker, http)
}

/// A file of `bytes` in a fresh temporary directory (kept alive by the
/// returned guard).
fn dir_file(name: &str, bytes: &[u8]) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).expect("write");
    (dir, path)
}

/// With the server's TLS certificate the HTTP API is HTTPS only.
#[test]
fn with_tls_the_http_api_serves_https_only() {
    if !have_reference_and_curl() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("certificate");
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    std::fs::write(&cert, certified.cert.pem()).expect("cert");
    std::fs::write(&key, certified.key_pair.serialize_pem()).expect("key");
    let (cert, key) = (cert.to_str().expect("utf-8"), key.to_str().expect("utf-8"));
    let server = serve(&["--tls-cert", cert, "--tls-key", key]);
    let http = server.http.clone().expect("an http address");
    let port = http.rsplit_once(':').expect("a port").1;
    let resolve = format!("localhost:{port}:127.0.0.1");
    let out = Command::new("curl")
        .args(["-sS", "--cacert", cert, "--resolve", &resolve])
        .arg(format!("https://localhost:{port}/v1/models"))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let models: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(models["data"][0]["object"], "model", "{text}");
    // Plain HTTP gets no answer.
    let plain = Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .arg(format!("http://{http}/v1/models"))
        .output()
        .expect("curl");
    assert!(!plain.status.success(), "plain HTTP was answered");
}

/// `curl -N` sees `data: {...}` chunks, the usage, then `data: [DONE]`.
#[test]
fn curl_reads_the_stream_as_server_sent_events() {
    if !have_reference_and_curl() {
        return;
    }
    let server = serve(&["--metrics-listen", "127.0.0.1:0"]);
    let http = server.http.clone().expect("an http address");
    let body = r#"{"model":"any","messages":[{"role":"user","content":"Say hi."}],
                  "stream":true,"max_tokens":8,"temperature":0}"#;
    let out = Command::new("curl")
        .args([
            "-sS",
            "-N",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ])
        .arg(format!("http://{http}/v1/chat/completions"))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("a JSON chunk"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    // No include_usage: every chunk has a choice; the usage rides on the
    // last one, which says why the reply finished.
    assert!(
        chunks.iter().all(|c| c["choices"].get(0).is_some()),
        "{text}"
    );
    let last = chunks.last().expect("a last chunk");
    assert!(!last["choices"][0]["finish_reason"].is_null(), "{text}");
    let usage = &last["usage"];
    assert_eq!(
        usage["completion_tokens"].as_u64().map(|n| n > 0),
        Some(true)
    );
    let finish: Vec<&serde_json::Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .map(|c| &c["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish.len(), 1, "{text}");

    // A malformed body is a 400 in OpenAI's error shape.
    let out = Command::new("curl")
        .args(["-sS", "-w", "\n%{http_code}", "-d", "{not json"])
        .arg(format!("http://{http}/v1/chat/completions"))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').expect("a status line");
    assert_eq!(code, "400", "{text}");
    let error: serde_json::Value = serde_json::from_str(body).expect("JSON");
    assert_eq!(error["error"]["type"], "invalid_request_error", "{body}");

    // A body over 8 MiB is a 413 and a wrong method a 405, both in
    // OpenAI's error shape.
    let big = dir_file("big.json", &vec![b' '; 9 << 20]);
    for (args, want) in [
        (
            vec!["-d".to_string(), format!("@{}", big.1.display())],
            "413",
        ),
        (vec!["-X".to_string(), "GET".to_string()], "405"),
    ] {
        let out = Command::new("curl")
            .args(["-sS", "-w", "\n%{http_code}"])
            .args(&args)
            .arg(format!("http://{http}/v1/chat/completions"))
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout);
        let (body, code) = text.rsplit_once('\n').expect("a status line");
        assert_eq!(code, want, "{text}");
        let error: serde_json::Value = serde_json::from_str(body).expect("JSON");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{body}");
    }

    // Every request is counted by route and status.
    let metrics = support::scrape(server.metrics.as_deref().expect("metrics"));
    for code in ["200", "400", "405", "413"] {
        let name =
            format!("inferd_http_requests_total{{route=\"/v1/chat/completions\",code=\"{code}\"}}");
        assert_eq!(support::sample(&metrics, &name), Some(1.0), "{metrics}");
    }
}

#[test]
fn the_speculate_extension_changes_the_passes_not_the_text() {
    if !have_reference_and_curl() {
        return;
    }
    let server = serve(&["--metrics-listen", "127.0.0.1:0"]);
    let http = server.http.clone().expect("an http address");
    let proposed = || {
        let metrics = support::scrape(server.metrics.as_deref().expect("metrics"));
        support::sample(&metrics, "inferd_speculation_proposed_tokens_total").unwrap_or(0.0)
    };
    let ask = |speculate: bool| {
        let body = serde_json::json!({
            "model": "any",
            "messages": [{"role": "user", "content":
                "Repeat exactly: the quick brown fox jumps over the lazy dog, \
                 the quick brown fox jumps over the lazy dog."}],
            "max_tokens": 40,
            "temperature": 0,
            "speculate": speculate,
        });
        let out = Command::new("curl")
            .args(["-sS", "-H", "Content-Type: application/json", "-d"])
            .arg(body.to_string())
            .arg(format!("http://{http}/v1/chat/completions"))
            .output()
            .expect("curl");
        let reply: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        reply["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_owned()
    };
    let plain = ask(false);
    assert_eq!(proposed(), 0.0, "a plain call proposes nothing");
    let fast = ask(true);
    assert_eq!(fast, plain);
    assert!(proposed() > 0.0, "the speculating call proposed nothing");
}
