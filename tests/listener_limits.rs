//! Real `inferd serve` processes against clients that hold connections:
//! half-sent request heads closed at the header timeout, idle keep-alive
//! connections closed at the idle timeout, the HTTP connection limit (the
//! server keeps answering HTTP, metrics and gRPC past it), and a small
//! RLIMIT_NOFILE: the start-time descriptor budget refuses a configuration
//! that does not fit and raises the soft limit when that is enough, and
//! with the descriptors exhausted the server logs a bounded number of lines
//! and answers again once the clients let go. The server runs a small
//! synthetic model, so these tests need no download. Every wait is bounded
//! and every server is killed when its test ends.

mod support;

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use grpcio::{CallOption, RpcStatusCode};
use inferd::gguf::synthetic::SyntheticLlama;
use inferd::proto::kakeya_v1::runtime as pb;
use support::Client;

/// A synthetic model file in a fresh directory (kept while the guard lives).
fn model() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    std::fs::write(&path, SyntheticLlama::tiny().build()).expect("write the model");
    let path = path.to_str().expect("UTF-8 path").to_owned();
    (dir, path)
}

/// `serve` on the model with small settings, every listener on loopback,
/// plus `extra`.
fn serve_args(model: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "serve",
        "--model",
        model,
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--workers",
        "1",
        "--completion-queues",
        "1",
        "--kv-mib",
        "8",
        "--sampler",
        "cpu",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// An `inferd serve` process with its standard error in a file, under an
/// RLIMIT_NOFILE of its own when asked; killed and reaped on drop.
struct Server {
    child: Child,
    grpc: String,
    http: SocketAddr,
    metrics: SocketAddr,
    stderr: tempfile::NamedTempFile,
}

/// `inferd ARGS` with `nofile` (soft, hard) set in the child before exec.
fn command(args: &[String], nofile: Option<(u64, u64)>, stderr: &std::fs::File) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_inferd"));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("INFERD_") {
            command.env_remove(key);
        }
    }
    command
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr.try_clone().expect("stderr file"));
    if let Some((soft, hard)) = nofile {
        let limit = libc::rlimit {
            rlim_cur: soft as libc::rlim_t,
            rlim_max: hard as libc::rlim_t,
        };
        // SAFETY: the closure runs in the forked child before exec and
        // calls only setrlimit, which is async-signal-safe, on a struct it
        // owns.
        unsafe {
            command.pre_exec(move || {
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    command
}

impl Server {
    fn start(args: &[String], nofile: Option<(u64, u64)>) -> Server {
        let stderr = tempfile::NamedTempFile::new().expect("stderr file");
        let mut child = command(args, nofile, stderr.as_file())
            .spawn()
            .expect("start inferd");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let (mut grpc, mut http, mut metrics) = (None, None, None);
        while grpc.is_none() || http.is_none() || metrics.is_none() {
            let Ok(line) = rx.recv_timeout(Duration::from_secs(60)) else {
                let _ = child.kill();
                let _ = child.wait();
                let log = std::fs::read_to_string(stderr.path()).unwrap_or_default();
                panic!("inferd {args:?} never said where it listens:\n{log}");
            };
            if let Some(addr) = line.strip_prefix("listening on ") {
                grpc = Some(addr.to_owned());
            } else if let Some(addr) = line.strip_prefix("metrics on ") {
                metrics = Some(addr.parse().expect("IP:PORT"));
            } else if let Some(addr) = line.strip_prefix("http on ") {
                http = Some(addr.parse().expect("IP:PORT"));
            }
        }
        Server {
            child,
            grpc: grpc.expect("grpc"),
            http: http.expect("http"),
            metrics: metrics.expect("metrics"),
            stderr,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.stderr.path()).unwrap_or_default()
    }

    fn open_descriptors(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request with `Connection: close`, the whole reply read (bounded).
fn exchange(addr: SocketAddr, request: &str, within: Duration) -> Result<String, String> {
    let mut stream =
        TcpStream::connect_timeout(&addr, within).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(within)).expect("timeout");
    stream.set_write_timeout(Some(within)).expect("timeout");
    stream
        .write_all(request.as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut reply = Vec::new();
    stream
        .read_to_end(&mut reply)
        .map_err(|e| format!("read: {e}"))?;
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

fn get(addr: SocketAddr, path: &str, within: Duration) -> Result<String, String> {
    exchange(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: inferd\r\nConnection: close\r\n\r\n"),
        within,
    )
}

/// `GET path` answers 200 within `within`.
fn answers(addr: SocketAddr, path: &str, within: Duration) {
    let t0 = Instant::now();
    let reply = get(addr, path, within).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(reply.starts_with("HTTP/1.1 200"), "{path}: {reply}");
    assert!(t0.elapsed() <= within, "{path} took {:?}", t0.elapsed());
}

/// The metrics, scraped within 5 s.
fn scrape(server: &Server) -> String {
    let reply = get(server.metrics, "/metrics", Duration::from_secs(5)).expect("scrape");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    reply
}

fn sample(metrics: &str, name: &str) -> Option<f64> {
    support::sample(metrics, name)
}

/// A CreateSession through a fresh channel, within 10 s.
fn create_session(addr: &str) -> Result<(), (RpcStatusCode, String)> {
    let client = Client::connect(addr);
    let mut req = pb::CreateSessionRequest::new();
    req.set_client_label("listener limits".into());
    let opt = CallOption::default().timeout(Duration::from_secs(10));
    match client.rpc.create_session_opt(&req, opt) {
        Ok(_) => Ok(()),
        Err(grpcio::Error::RpcFailure(s)) => Err((s.code(), s.message().to_owned())),
        Err(e) => Err((RpcStatusCode::UNKNOWN, e.to_string())),
    }
}

/// `n` connections to `addr`, each having sent `prefix` and nothing more.
fn half_sent(addr: SocketAddr, n: usize, prefix: &[u8]) -> Vec<TcpStream> {
    (0..n)
        .map(|_| {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
            // A connection still in the backlog takes the bytes too.
            s.write_all(prefix).expect("send half a head");
            s
        })
        .collect()
}

/// Whether the server closed `stream` (EOF or reset) within `within`.
fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let end = Instant::now() + within;
    let mut buf = [0u8; 256];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        stream.set_read_timeout(Some(left)).expect("timeout");
        match stream.read(&mut buf) {
            Ok(0) => return true,
            // A 408 or the like before the close is fine.
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return true,
        }
    }
}

#[test]
fn half_sent_heads_are_closed_at_the_header_timeout_and_idle_ones_at_the_idle_timeout() {
    let (_dir, model) = model();
    let server = Server::start(
        &serve_args(
            &model,
            &["--http-header-timeout", "1", "--http-idle-timeout", "3"],
        ),
        None,
    );
    let t0 = Instant::now();
    let mut slow = half_sent(server.http, 200, b"GET /v1/mod");
    for (i, stream) in slow.iter_mut().enumerate() {
        let left = Duration::from_secs(8).saturating_sub(t0.elapsed());
        assert!(
            closed_within(stream, left),
            "connection {i} still open {:?} after it sent half a request line",
            t0.elapsed()
        );
    }
    // An honest request is answered, and its keep-alive connection is
    // closed once idle for the idle timeout, not the header timeout.
    let mut kept = TcpStream::connect(server.http).expect("connect");
    kept.write_all(b"GET /v1/models HTTP/1.1\r\nHost: inferd\r\n\r\n")
        .expect("send");
    kept.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut head = [0u8; 12];
    kept.read_exact(&mut head).expect("a reply");
    assert_eq!(&head, b"HTTP/1.1 200");
    let idle_from = Instant::now();
    assert!(
        closed_within(&mut kept, Duration::from_secs(10)),
        "an idle keep-alive connection stayed open"
    );
    let idle = idle_from.elapsed();
    assert!(
        idle >= Duration::from_millis(2500),
        "closed after {idle:?} idle, before the idle timeout"
    );
    // The counters follow the close by a moment: the connection's task
    // counts after the socket is gone.
    let end = Instant::now() + Duration::from_secs(5);
    let counted = |metrics: &str| {
        let header = sample(
            metrics,
            "inferd_http_connections_timed_out_total{phase=\"header\"}",
        );
        let idle = sample(
            metrics,
            "inferd_http_connections_timed_out_total{phase=\"idle\"}",
        );
        let open = sample(metrics, "inferd_http_connections_open");
        header >= Some(200.0) && idle >= Some(1.0) && open == Some(0.0)
    };
    let mut metrics = scrape(&server);
    while !counted(&metrics) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
        metrics = scrape(&server);
    }
    assert!(counted(&metrics), "{metrics}");
}

#[test]
fn past_the_connection_limit_the_server_keeps_answering() {
    let (_dir, model) = model();
    let server = Server::start(
        &serve_args(
            &model,
            &[
                "--http-max-connections",
                "16",
                "--http-header-timeout",
                "2",
                "--http-idle-timeout",
                "2",
            ],
        ),
        None,
    );
    let before = server.open_descriptors();
    let slow = half_sent(server.http, 80, b"POST /v1/completions HTT");
    // The server holds its limit and no more.
    let end = Instant::now() + Duration::from_secs(5);
    let metrics = loop {
        let metrics = scrape(&server);
        if sample(&metrics, "inferd_http_connections_open") == Some(16.0) || Instant::now() > end {
            break metrics;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        sample(&metrics, "inferd_http_connections_open"),
        Some(16.0),
        "{metrics}"
    );
    assert_eq!(sample(&metrics, "inferd_http_connections_max"), Some(16.0));
    let reached = sample(&metrics, "inferd_http_connection_limit_reached_total");
    assert!(reached >= Some(1.0), "{reached:?}");
    let held = server.open_descriptors();
    assert!(
        held <= before + 16 + 4,
        "{held} descriptors open, {before} before 80 connections against a limit of 16"
    );
    // Metrics and gRPC answer at once; the HTTP API once the slow ones
    // timed out (80 at 16 at a time, 2 s each).
    assert_eq!(create_session(&server.grpc), Ok(()));
    answers(server.http, "/v1/models", Duration::from_secs(20));
    let metrics = scrape(&server);
    let open = sample(&metrics, "inferd_http_connections_open");
    assert!(open <= Some(16.0), "{open:?}");
    let timed_out = sample(
        &metrics,
        "inferd_http_connections_timed_out_total{phase=\"header\"}",
    );
    assert!(timed_out >= Some(16.0), "{timed_out:?}\n{metrics}");
    assert_eq!(create_session(&server.grpc), Ok(()));
    drop(slow);
}

#[test]
fn a_budget_over_the_hard_limit_is_refused_and_one_under_it_raises_the_soft_limit() {
    let (_dir, model) = model();
    // The defaults (512 HTTP connections, 256 gRPC) do not fit in 256.
    let stderr = tempfile::NamedTempFile::new().expect("stderr file");
    let mut child = command(&serve_args(&model, &[]), Some((256, 256)), stderr.as_file())
        .spawn()
        .expect("start inferd");
    let end = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("inferd started under a descriptor limit its budget exceeds");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let log = std::fs::read_to_string(stderr.path()).expect("stderr");
    assert!(!status.success(), "{log}");
    for needle in [
        "hard limit of 256",
        "513 HTTP connections",
        "257 gRPC connections",
        "--http-max-connections",
        "--grpc-connections",
    ] {
        assert!(log.contains(needle), "{needle:?} not in: {log}");
    }

    // A budget over the soft limit but under the hard one raises the soft.
    let small = ["--http-max-connections", "32", "--grpc-connections", "16"];
    let server = Server::start(&serve_args(&model, &small), Some((128, 512)));
    let limits =
        std::fs::read_to_string(format!("/proc/{}/limits", server.child.id())).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files");
    let numbers: Vec<&str> = line.split_whitespace().skip(3).take(2).collect();
    assert_eq!(numbers, ["512", "512"], "{line}");
    answers(server.http, "/v1/models", Duration::from_secs(5));
}

#[test]
fn with_descriptors_exhausted_the_log_stays_small_and_service_comes_back() {
    let (dir, model) = model();
    let state = dir.path().join("state");
    let state = state.to_str().expect("UTF-8");
    let args = serve_args(
        &model,
        &[
            "--http-max-connections",
            "48",
            "--grpc-connections",
            "16",
            "--http-header-timeout",
            "30",
            "--http-idle-timeout",
            "30",
            "--state-dir",
            state,
            "--max-sessions",
            "8",
            "--max-spilled-sessions",
            "8",
        ],
    );
    let server = Server::start(&args, Some((256, 256)));
    let connected = Client::connect(&server.grpc);
    let mut req = pb::CreateSessionRequest::new();
    req.set_client_label("before".into());
    let opt = || CallOption::default().timeout(Duration::from_secs(10));
    connected
        .rpc
        .create_session_opt(&req, opt())
        .expect("a session before the flood");

    // HTTP takes its 48; raw connections to the gRPC port (which the gRPC
    // core cannot cap) take every descriptor left; more knock on the
    // metrics endpoint while there are none.
    let http = half_sent(server.http, 400, b"GET /v1/models HT");
    let grpc_addr: SocketAddr = server.grpc.parse().expect("IP:PORT");
    let grpc: Vec<TcpStream> = (0..400)
        .filter_map(|_| TcpStream::connect_timeout(&grpc_addr, Duration::from_secs(2)).ok())
        .collect();
    let end = Instant::now() + Duration::from_secs(10);
    while server.open_descriptors() < 250 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    let held = server.open_descriptors();
    assert!(held >= 250, "the flood left descriptors free: {held} open");
    let metrics_knocks = half_sent(server.metrics, 20, b"GET /met");
    // What an accept loop that spins would log by the thousand.
    std::thread::sleep(Duration::from_secs(3));

    // A session's journal cannot be opened: a typed refusal, not INTERNAL.
    req.set_client_label("during".into());
    match connected.rpc.create_session_opt(&req, opt()) {
        Ok(_) => eprintln!("CreateSession during the flood: OK"),
        Err(grpcio::Error::RpcFailure(s)) => {
            eprintln!(
                "CreateSession during the flood: {:?} {}",
                s.code(),
                s.message()
            );
            assert_eq!(
                s.code(),
                RpcStatusCode::RESOURCE_EXHAUSTED,
                "{}",
                s.message()
            );
            assert!(s.message().contains("file descriptors"), "{}", s.message());
        }
        Err(e) => panic!("CreateSession during the flood: {e}"),
    }

    drop(metrics_knocks);
    drop(grpc);
    drop(http);
    answers(server.http, "/v1/models", Duration::from_secs(15));
    answers(server.metrics, "/metrics", Duration::from_secs(15));
    let end = Instant::now() + Duration::from_secs(15);
    let created = loop {
        let created = create_session(&server.grpc);
        if created.is_ok() || Instant::now() > end {
            break created;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(created, Ok(()));
    let metrics = scrape(&server);
    let errors = sample(&metrics, "inferd_accept_errors_total{listener=\"metrics\"}");
    assert!(errors >= Some(1.0), "{errors:?}\n{metrics}");

    let log = server.log();
    let lines = log.lines().count();
    eprintln!("{lines} lines of log:\n{log}");
    assert!(
        lines <= 200 && log.len() <= 64 << 10,
        "{lines} lines, {} bytes of log in about 10 s:\n{}",
        log.len(),
        &log[..log.len().min(4000)]
    );
}
