//! A stock TypeScript gRPC client (`@grpc/grpc-js` with the schema loaded
//! from `protos/` by `@grpc/proto-loader`, on Node.js; `scripts/node-env`
//! installs and compiles it) against a real `inferd serve`: create, append,
//! stream, info, continue, close, each typed error, EOS, seeded sampling,
//! the session limit and idle-TTL eviction
//! (`tests/interop/ts/scenarios.ts`).

mod support;

use std::process::Command;

use support::{have_reference, Inferd};

/// The compiled client, or `None` (after saying so loudly) when this
/// machine has no Node.js; in CI a missing Node.js fails the test.
fn client() -> Option<String> {
    if Command::new("node").arg("--version").output().is_err() {
        eprintln!("SKIPPED (LOUDLY): Node.js is not installed; scripts/setup installs it");
        assert!(!support::vocabs_required(), "Node.js is missing in CI");
        return None;
    }
    let built = support::script_output("node-env");
    assert!(
        built.is_some(),
        "scripts/node-env failed; it needs the npm registry the first time"
    );
    built
}

#[test]
fn a_stock_typescript_client_runs_every_scenario() {
    if !have_reference() {
        return;
    }
    let Some(client) = client() else {
        return;
    };
    let server = Inferd::start(&[
        "serve",
        "--model",
        support::REFERENCE,
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "2",
        "--sampler",
        "cpu",
        "--max-sessions",
        "2",
        "--eviction",
        "none",
        "--idle-ttl",
        "3",
    ]);
    let mut node = Command::new("node");
    node.arg(&client).arg(&server.addr);
    support::run_client("TypeScript client", &mut node, "scenarios passed");
}
