//! `inferd serve` under a service manager: a real process with
//! `NOTIFY_SOCKET` pointing at a datagram socket made by the test, as
//! systemd does for a `Type=notify` unit. The server must say READY=1 only
//! once it answers, STOPPING=1 when SIGTERM starts the drain, and exit 0.

#![cfg(unix)]

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Every notification datagram that arrives within `within`, up to one
/// containing `wanted`.
fn read_until(socket: &UnixDatagram, wanted: &str, within: Duration) -> Vec<String> {
    let end = Instant::now() + within;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while Instant::now() < end {
        socket
            .set_read_timeout(Some(
                end.saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1)),
            ))
            .expect("read timeout");
        match socket.recv(&mut buf) {
            Ok(n) => {
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                let done = text.lines().any(|l| l == wanted);
                seen.push(text);
                if done {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    seen
}

#[test]
fn serve_notifies_ready_then_stopping_and_exits_zero_on_sigterm() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let socket_path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).expect("bind notify socket");
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
        .env("NOTIFY_SOCKET", &socket_path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn inferd serve");
    let ready = read_until(&socket, "READY=1", Duration::from_secs(60));
    assert!(
        ready.iter().any(|m| m.lines().any(|l| l == "READY=1")),
        "no READY=1 from the server: {ready:?}"
    );
    assert!(
        ready.iter().any(|m| m
            .lines()
            .any(|l| l.starts_with("STATUS=serving on 127.0.0.1:"))),
        "READY comes with a status naming the address: {ready:?}"
    );
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -TERM failed");
    let stopping = read_until(&socket, "STOPPING=1", Duration::from_secs(30));
    assert!(
        stopping
            .iter()
            .any(|m| m.lines().any(|l| l == "STOPPING=1")),
        "no STOPPING=1 after SIGTERM: {stopping:?}"
    );
    let end = Instant::now() + Duration::from_secs(40);
    let code = loop {
        if let Some(status) = child.try_wait().expect("wait for server") {
            break status.code();
        }
        if Instant::now() > end {
            let _ = child.kill();
            panic!("the server did not exit within 40 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code, Some(0), "graceful shutdown exits 0");
}
