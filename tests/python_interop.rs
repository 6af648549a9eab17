//! A stock Python gRPC client against the real `inferd serve`: stubs
//! generated from the published `protos/` with grpcio-tools (in the
//! virtualenv `scripts/python-env` keeps), driving the session lifecycle,
//! streaming, every error status a client can provoke, deadlines and
//! cancellation (`tests/interop/runtime_client.py`), also against a
//! coordinator of two `inferd shard` processes; and the shard
//! protocol's golden frames decoded by stubs from its schema
//! (`tests/interop/shard_vectors.py`).

mod support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const CLIENT: &str = "tests/interop/runtime_client.py";
const RESTART_CLIENT: &str = "tests/interop/restart_client.py";
/// The session limit the server runs with; the client fills it up to
/// provoke RESOURCE_EXHAUSTED.
const MAX_SESSIONS: &str = "2";
/// The eviction policy the server runs with; the client checks that an
/// idle session is evicted (lru) or that the limit is a hard one (none).
const EVICTION: &str = "none";
/// How long the server may take to load the model and start listening.
const STARTUP: Duration = Duration::from_secs(120);
/// How long an idle server may take to stop after SIGTERM (its drain
/// timeout is 30 s, and nothing is running).
const DRAIN_LIMIT: Duration = Duration::from_secs(40);

/// The server process, killed (and reaped) however the test ends.
struct ServerGuard {
    child: Child,
    log: PathBuf,
}

impl ServerGuard {
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ServerGuard {
    fn drop(&mut self) {
        // Already exited is fine: the kill then just fails.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `inferd serve` on a free loopback port and returns it with the
/// address from its `listening on ADDR` line.
fn start_server(log_dir: &Path, extra: &[&str]) -> (ServerGuard, String) {
    let log = log_dir.join("server.log");
    let log_file = std::fs::File::create(&log).expect("create server log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_inferd"));
    cmd.args([
        "serve",
        "--model",
        REFERENCE,
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "2",
        "--max-sessions",
        MAX_SESSIONS,
        "--eviction",
        EVICTION,
    ])
    .args(extra)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::from(log_file));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("INFERD_") {
            cmd.env_remove(key);
        }
    }
    let mut child = cmd.spawn().expect("start inferd serve");
    let stdout = child.stdout.take().expect("piped stdout");
    let guard = ServerGuard { child, log };

    // Read stdout on a thread so that a server that never prints cannot
    // hang the test past STARTUP; the thread keeps draining afterwards.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
            if let Some(addr) = line.trim_end().strip_prefix("listening on ") {
                let _ = tx.send(addr.trim().to_owned());
                break;
            }
            line.clear();
        }
        let _ = std::io::copy(&mut reader, &mut std::io::sink());
    });
    match rx.recv_timeout(STARTUP) {
        Ok(addr) => (guard, addr),
        Err(_) => panic!(
            "inferd serve printed no `listening on` line within {STARTUP:?}; its log:\n{}",
            guard.log_text()
        ),
    }
}

#[test]
fn a_stock_python_client_drives_the_server_through_every_status() {
    drive_with_python(&[]);
}

#[test]
fn a_stock_python_client_drives_a_coordinator_of_two_shards_through_every_status() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let first = support::Inferd::shard("0..15", "127.0.0.1:0");
    let second = support::Inferd::shard("15..30", "127.0.0.1:0");
    let shards = format!("{},{}", first.addr, second.addr);
    drive_with_python(&["--shards", &shards]);
}

/// Runs the Python client against `inferd serve EXTRA...`, then stops the
/// server with SIGTERM.
fn drive_with_python(extra: &[&str]) {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let Some(python) = support::python_env() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let (server, addr) = start_server(dir.path(), extra);

    let out = Command::new(&python)
        .args([
            CLIENT,
            &addr,
            "--max-sessions",
            MAX_SESSIONS,
            "--eviction",
            EVICTION,
        ])
        .output()
        .expect("run the python client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the python client failed (exit {:?}):\n{stdout}\n{}\n--- server log ---\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr),
        server.log_text()
    );
    assert!(
        stdout.contains("interop: every check passed"),
        "the python client exited 0 without finishing:\n{stdout}"
    );
    stops_gracefully_on_sigterm(server);
}

#[test]
fn a_stock_python_client_sees_seeded_sampling_repeat_and_an_idle_session_evicted() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let Some(python) = support::python_env() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let (server, addr) = start_server(dir.path(), &["--idle-ttl", "2"]);
    let out = Command::new(&python)
        .args([CLIENT, &addr, "--idle-ttl", "2"])
        .output()
        .expect("run the python client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("interop: every check passed"),
        "the python client failed (exit {:?}):\n{stdout}\n{}\n--- server log ---\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr),
        server.log_text()
    );
}

#[test]
fn a_stock_python_clients_session_survives_a_sigkill_and_restart_of_the_server() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let Some(python) = support::python_env() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let state = state.to_str().expect("UTF-8 path");
    let run = |args: &[&str], server: &ServerGuard| {
        let out = Command::new(&python)
            .arg(RESTART_CLIENT)
            .args(args)
            .output()
            .expect("run the python client");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "the python client failed (exit {:?}):\n{stdout}\n{}\n--- server log ---\n{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr),
            server.log_text()
        );
        stdout
    };
    let (mut server, addr) = start_server(dir.path(), &["--state-dir", state]);
    let first = run(&["first", &addr], &server);
    let mut words = first.split_whitespace();
    let (id, digest) = (words.next().expect("id"), words.next().expect("digest"));
    let _ = server.child.kill();
    let _ = server.child.wait();
    let (server, addr) = start_server(dir.path(), &["--state-dir", state]);
    let second = run(&["second", &addr, id, digest], &server);
    assert!(second.contains("restart: the session survived"), "{second}");
    stops_gracefully_on_sigterm(server);
}

/// SIGTERM drains (nothing is running by now) and exits 0, as a service
/// manager expects.
fn stops_gracefully_on_sigterm(mut server: ServerGuard) {
    let pid = server.child.id().to_string();
    let sent = Command::new("kill").args(["-TERM", &pid]).status();
    if !sent.is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED: no `kill` command to send SIGTERM with");
        return;
    }
    let waited_from = std::time::Instant::now();
    let status = loop {
        match server.child.try_wait().expect("poll the server") {
            Some(status) => break status,
            None if waited_from.elapsed() > DRAIN_LIMIT => panic!(
                "inferd serve still running {DRAIN_LIMIT:?} after SIGTERM; its log:\n{}",
                server.log_text()
            ),
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    assert!(
        status.success(),
        "inferd serve exited {status} after SIGTERM; its log:\n{}",
        server.log_text()
    );
}

/// The shard protocol's golden frames decoded by Python stubs generated
/// from the same schema (`tests/interop/shard_vectors.py`).
#[test]
fn python_stubs_from_the_shard_schema_decode_the_golden_frames() {
    let Some(python) = support::python_env() else {
        return;
    };
    let out = Command::new(&python)
        .arg("tests/interop/shard_vectors.py")
        .output()
        .expect("run tests/interop/shard_vectors.py");
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("frames checked"));
}

/// The rows `tests/interop/shard_client.py` sends: exactly representable,
/// so both languages write the same bits.
fn client_rows(count: usize, first: usize, hidden: usize) -> Vec<f32> {
    (first * hidden..(first + count) * hidden)
        .map(|i| ((i * 37) % 101) as f32 / 64.0 - 50.0 / 64.0)
        .collect()
}

fn sha256_hex_f32(values: &[f32]) -> String {
    use sha2::Digest;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    sha2::Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A Python client generated from the shard schema drives a real `inferd
/// shard` (handshake, prefill, a corrupted frame refused with
/// KIND_CHECKSUM, decode, release); its outputs are the bits this process
/// computes for the same layers and rows.
#[test]
fn python_stubs_from_the_shard_schema_drive_a_real_shard() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let Some(python) = support::python_env() else {
        return;
    };
    let mut shard = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args([
            "shard",
            "--model",
            REFERENCE,
            "--layers",
            "0..10",
            "--listen",
            "127.0.0.1:0",
            "--kv-mib",
            "16",
            "--threads",
            "1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start inferd shard");
    let stdout = shard.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("listening on ") {
                let _ = tx.send(addr.to_owned());
            }
        }
    });
    let addr = rx.recv_timeout(STARTUP).expect("the shard listens");
    let guard = ServerGuard {
        child: shard,
        log: PathBuf::new(),
    };
    let model = inferd::model::Model::load(REFERENCE).expect("model");
    let (layers, hidden) = (model.config.n_layers, model.config.hidden);
    let out = Command::new(&python)
        .args([
            "tests/interop/shard_client.py",
            &addr,
            REFERENCE,
            "0",
            "10",
            &layers.to_string(),
            &hidden.to_string(),
        ])
        .output()
        .expect("run tests/interop/shard_client.py");
    drop(guard);
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let reply: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("one JSON line from the client");

    // The same layers over the same rows, in this process.
    use inferd::kv::{KvPool, KvPoolConfig, SessionKv};
    use inferd::model::{LayerFeed, Scratch};
    let pool = inferd::threads::ThreadPool::new(1);
    let mut scratch = Scratch::default();
    let kv_pool = std::sync::Arc::new(
        KvPool::new(KvPoolConfig::anonymous(model.kv_layout(10, 16), 80)).expect("kv"),
    );
    let mut kv = SessionKv::new(kv_pool);
    let mut expected = Vec::new();
    for (first, count) in [(0usize, 3usize), (3, 1)] {
        let mut x = client_rows(count, first, hidden);
        kv.reserve(first + count).expect("reserve");
        let mut feeds = [LayerFeed {
            kv: &mut kv,
            rows: count,
        }];
        model
            .forward_layers(0..10, &mut feeds, &mut x, &pool, &mut scratch)
            .expect("forward");
        kv.commit(first + count).expect("commit");
        expected.push(sha256_hex_f32(&x));
    }
    assert_eq!(reply["outputs"], serde_json::json!(expected));
}
