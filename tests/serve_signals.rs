//! A second SIGTERM or SIGINT during `inferd serve`'s drain stops the
//! process at once: a real server with a long `--drain-timeout` and a
//! Generate in flight (the client holds the stream without reading, so the
//! call cannot finish), a first signal that starts the drain (the process
//! is still there a second later), and a second one after which it exits
//! within seconds with 128 + the signal's number.

#![cfg(unix)]

mod support;

use std::time::Duration;

use futures_util::StreamExt;
use grpcio::CallOption;
use support::{Client, Inferd};

const REFERENCE: &str = support::REFERENCE;

/// Starts a server, puts a Generate in flight, signals twice; the exit code.
fn second_signal_exit(signal: &str) -> Option<i32> {
    let mut server = Inferd::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "1",
        "--model",
        REFERENCE,
        "--drain-timeout",
        "600",
    ]);
    let client = Client::connect(&server.addr);
    let id = client.create();
    client.append(&id, &[1, 504, 3575, 282]).expect("append");
    let req = support::greedy(&id, 1_000_000, 0);
    let mut stream = client
        .rpc
        .generate_opt(&req, CallOption::default().timeout(support::STREAM_TIMEOUT))
        .expect("generate");
    let first = futures_executor::block_on(stream.next());
    assert!(matches!(first, Some(Ok(_))), "a first token: {first:?}");
    // The stream stays open, unread: the call is in flight.
    server.signal(signal);
    assert!(
        server.wait_exit(Duration::from_secs(1)).is_err(),
        "the drain waits for the Generate"
    );
    server.signal(signal);
    let code = server
        .wait_exit(Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("still running 5 s after a second SIG{signal}"));
    drop(stream);
    code
}

#[test]
fn a_second_signal_ends_the_drain_at_once() {
    if !support::have_reference() {
        return;
    }
    assert_eq!(second_signal_exit("TERM"), Some(128 + 15));
    assert_eq!(second_signal_exit("INT"), Some(128 + 2));
}
