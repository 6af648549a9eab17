//! A real `inferd relay` keeps its memory flat however many frames it
//! forwards: only a bounded window of hashes stays in memory (the
//! `--record` file keeps them all). The upstream is an echo server in the
//! test speaking the raw Session method; the relay's RSS (VmRSS in
//! /proc/PID/status) is read after a warm-up and again after 100,000 more
//! frames each way, with the streams closed.

#![cfg(target_os = "linux")]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use grpcio::{
    CallOption, ChannelBuilder, Client, DuplexSink, EnvBuilder, RequestStream, RpcContext,
    ServerBuilder, ServerCredentials, ServiceBuilder, WriteFlags,
};
use inferd::cluster::raw::SESSION_RAW;
use support::Inferd;

/// Frames per stream, and streams after the warm-up.
const PER_STREAM: usize = 25_000;
const STREAMS: usize = 4;
/// Growth allowed over 100,000 frames (unbounded hashes were ~50 MB).
const SLACK_KIB: u64 = 4 * 1024;

/// An upstream that sends every message back as it came.
fn echo_server() -> (grpcio::Server, u16) {
    let env = Arc::new(EnvBuilder::new().cq_count(1).build());
    let service = ServiceBuilder::new()
        .add_duplex_streaming_handler(
            &SESSION_RAW,
            |ctx: RpcContext<'_>, stream: RequestStream<Vec<u8>>, mut sink: DuplexSink<Vec<u8>>| {
                ctx.spawn(async move {
                    let mut echoed = stream.map(|m| m.map(|bytes| (bytes, WriteFlags::default())));
                    if sink.send_all(&mut echoed).await.is_ok() {
                        let _ = sink.close().await;
                    }
                });
            },
        )
        .build();
    let mut server = ServerBuilder::new(env)
        .register_service(service)
        .build()
        .expect("echo server");
    let port = server
        .add_listening_port("127.0.0.1:0", ServerCredentials::insecure())
        .expect("listen");
    server.start();
    (server, port)
}

/// Frames in flight at once on a stream, as a credit window would allow.
const WINDOW: usize = 1_000;

/// Sends `n` distinct frames through the relay on one stream, at most
/// [`WINDOW`] ahead of their echoes, and reads every echo back.
fn pump(client: &Client, n: usize, tag: u8) {
    let (mut tx, mut rx) = client
        .duplex_streaming(
            &SESSION_RAW,
            CallOption::default().timeout(Duration::from_secs(120)),
        )
        .expect("open a stream");
    futures_executor::block_on(async move {
        let mut sent = 0usize;
        while sent < n {
            let batch = WINDOW.min(n - sent);
            for i in sent..sent + batch {
                let mut frame = vec![tag; 64];
                frame[..8].copy_from_slice(&(i as u64).to_le_bytes());
                let last = i + 1 == sent + batch;
                let flags = WriteFlags::default().buffer_hint(!last);
                tx.send((frame, flags)).await.expect("send");
            }
            for _ in 0..batch {
                rx.next().await.expect("an echo").expect("an echo");
            }
            sent += batch;
        }
        tx.close().await.expect("close");
        assert!(rx.next().await.is_none(), "nothing more than the echoes");
    });
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

#[test]
fn relay_memory_stays_flat_over_100k_frames() {
    let (_upstream, port) = echo_server();
    let relay = Inferd::start(&[
        "relay",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &format!("127.0.0.1:{port}"),
    ]);
    let pid = relay.pid().expect("relay pid");
    let env = Arc::new(EnvBuilder::new().cq_count(1).build());
    let client = Client::new(ChannelBuilder::new(env).connect(&relay.addr));
    let t0 = Instant::now();
    // Warm-up: buffers, allocator arenas, the connection.
    pump(&client, 10_000, 0);
    let before = rss_kib(pid);
    for s in 0..STREAMS {
        pump(&client, PER_STREAM, s as u8 + 1);
        eprintln!("after stream {}: {} KiB", s + 1, rss_kib(pid));
    }
    let after = rss_kib(pid);
    eprintln!(
        "relay RSS {before} KiB -> {after} KiB over {} frames each way ({:?})",
        STREAMS * PER_STREAM,
        t0.elapsed()
    );
    assert!(
        after <= before + SLACK_KIB,
        "the relay grew from {before} KiB to {after} KiB"
    );
}
