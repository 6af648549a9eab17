//! The metrics endpoint of a real `inferd serve` process against hostile
//! HTTP clients: the listen rule it shares with the gRPC listener (a
//! non-loopback address needs the access token or the explicit opt-out),
//! the bearer token on every scrape, idle connections that must not cost
//! a thread each, and a client that pipelines thousands of requests and
//! never reads. The server runs a small synthetic model, so these tests
//! need no download.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use inferd::gguf::synthetic::SyntheticLlama;
use support::Inferd;

/// How long an honest scrape may take while the endpoint is under attack.
const SCRAPE_LIMIT: Duration = Duration::from_secs(2);

/// A synthetic model file in a fresh directory (kept while the guard lives).
fn model() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    std::fs::write(&path, SyntheticLlama::tiny().build()).expect("write the model");
    let path = path.to_str().expect("UTF-8 path").to_owned();
    (dir, path)
}

/// `inferd serve` on the model with small settings, plus `extra`.
fn serve_args<'a>(model: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "serve",
        "--model",
        model,
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "1",
        "--kv-mib",
        "8",
        "--sampler",
        "cpu",
    ];
    args.extend_from_slice(extra);
    args
}

/// Where to connect to reach what the server printed after `metrics on `
/// (an unspecified address is reached over loopback).
fn metrics_addr(server: &Inferd) -> SocketAddr {
    let printed: SocketAddr = server
        .metrics
        .as_deref()
        .expect("a metrics address")
        .parse()
        .expect("IP:PORT");
    SocketAddr::from(([127, 0, 0, 1], printed.port()))
}

/// Sends one request and reads the reply to its end, bounded.
fn exchange(addr: SocketAddr, request: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    stream.write_all(request.as_bytes()).expect("sends");
    let mut reply = Vec::new();
    let _ = stream.read_to_end(&mut reply);
    String::from_utf8_lossy(&reply).into_owned()
}

fn get(addr: SocketAddr, headers: &str) -> String {
    exchange(
        addr,
        &format!("GET /metrics HTTP/1.1\r\nHost: inferd\r\n{headers}\r\n"),
    )
}

/// An honest scrape: 200 with the metrics, within [`SCRAPE_LIMIT`].
fn scrape_quickly(addr: SocketAddr, what: &str) {
    let t0 = Instant::now();
    let reply = get(addr, "");
    let took = t0.elapsed();
    assert!(reply.starts_with("HTTP/1.1 200"), "{what}: {reply}");
    assert!(reply.contains("inferd_session_active"), "{what}: {reply}");
    assert!(took < SCRAPE_LIMIT, "{what}: the scrape took {took:?}");
}

#[test]
fn a_non_loopback_metrics_address_needs_a_token_or_the_opt_out() {
    let (_dir, model) = model();
    let out = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args(serve_args(&model, &["--metrics-listen", "0.0.0.0:0"]))
        .env_remove("INFERD_AUTH_TOKEN_FILE")
        .env_remove("INFERD_ALLOW_UNAUTHENTICATED")
        .stdin(Stdio::null())
        .output()
        .expect("run inferd serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it started: {stderr}");
    assert!(
        stderr.contains("refusing to serve metrics on 0.0.0.0:0"),
        "{stderr}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).is_empty(),
        "nothing was served"
    );

    // The explicit opt-out starts it, open.
    let open = Inferd::start(&serve_args(
        &model,
        &["--metrics-listen", "0.0.0.0:0", "--allow-unauthenticated"],
    ));
    scrape_quickly(metrics_addr(&open), "opted out");
}

#[test]
fn with_a_token_every_scrape_must_carry_it() {
    let (dir, model) = model();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token\n").expect("token file");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600))
            .expect("chmod 600");
    }
    let token_path = token_file.to_str().expect("UTF-8 path");
    // Off loopback, allowed because of the token; reached over loopback.
    let server = Inferd::start(&serve_args(
        &model,
        &[
            "--metrics-listen",
            "0.0.0.0:0",
            "--auth-token-file",
            token_path,
        ],
    ));
    let addr = metrics_addr(&server);
    for (what, headers) in [
        ("no header", ""),
        ("a wrong token", "Authorization: Bearer s3cret-tokem\r\n"),
        ("a prefix", "Authorization: Bearer s3cret\r\n"),
        ("no scheme", "Authorization: s3cret-token\r\n"),
    ] {
        let reply = get(addr, headers);
        assert!(reply.starts_with("HTTP/1.1 401"), "{what}: {reply}");
        assert!(
            reply.contains("WWW-Authenticate: Bearer"),
            "{what}: {reply}"
        );
        assert!(!reply.contains("inferd_session_active"), "{what}: {reply}");
    }
    let reply = get(addr, "Authorization: Bearer s3cret-token\r\n");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains("inferd_session_active"), "{reply}");
}

/// The process's thread count, from /proc.
#[cfg(target_os = "linux")]
fn threads(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("a Threads line")
}

#[cfg(target_os = "linux")]
#[test]
fn idle_connections_cost_no_threads_and_a_scrape_still_answers() {
    let (_dir, model) = model();
    let server = Inferd::start(&serve_args(&model, &["--metrics-listen", "127.0.0.1:0"]));
    let addr = metrics_addr(&server);
    scrape_quickly(addr, "before");
    let before = threads(server.pid().expect("inferd runs"));
    let idle: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(addr).expect("connects"))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let during = threads(server.pid().expect("inferd runs"));
    assert!(
        during <= before,
        "300 idle connections: {before} -> {during} threads"
    );
    scrape_quickly(addr, "with 300 idle connections open");
    // Half-sent requests hold nothing either.
    let slow: Vec<TcpStream> = (0..100)
        .map(|_| {
            let mut s = TcpStream::connect(addr).expect("connects");
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                .expect("sends");
            s
        })
        .collect();
    scrape_quickly(addr, "with 100 half-sent requests");
    assert!(threads(server.pid().expect("inferd runs")) <= before);
    drop((idle, slow));
}

#[test]
fn a_client_pipelining_thousands_of_requests_without_reading_blocks_no_one() {
    let (_dir, model) = model();
    let server = Inferd::start(&serve_args(&model, &["--metrics-listen", "127.0.0.1:0"]));
    let addr = metrics_addr(&server);
    let hog = std::thread::spawn(move || {
        let mut stream = TcpStream::connect(addr).expect("connects");
        stream
            .set_write_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let requests = "GET /metrics HTTP/1.1\r\nHost: inferd\r\n\r\n".repeat(5000);
        // It never reads; the write may end early when the server closes.
        let _ = stream.write_all(requests.as_bytes());
        stream
    });
    std::thread::sleep(Duration::from_millis(200));
    for i in 0..5 {
        scrape_quickly(addr, &format!("scrape {i} beside the pipelining client"));
    }
    let hog = hog.join().expect("the pipelining client");
    scrape_quickly(addr, "after");
    drop(hog);
}
