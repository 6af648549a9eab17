//! Three replicas behind HAProxy on the shipped configuration
//! (`deploy/replicas/haproxy.cfg`), one PostgreSQL of the test's own, stock
//! gRPC clients that know only the proxy's address: the client contract
//! holds whichever replica a channel reaches, a session used through
//! several channels moves between replicas with the same answers, the
//! OpenAI API's requests bound to a session stay on one replica, and
//! killing the replica that holds 16 conversations loses no acknowledged
//! token while every conversation goes on through the proxy.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use grpcio::RpcStatusCode;
use support::durable::{cold_digest, cold_greedy, reference_server, write_model};
use support::haproxy::HaProxy;
use support::postgres::Postgres;
use support::replicas::{after_a_kill, converse, prompt, replica, row};
use support::{greedy, seeded, Client, Inferd};

/// Three replicas of `model` (leases of `lease` seconds) and HAProxy in
/// front of them.
fn replica_set(model: &std::path::Path, pg: &Postgres, lease: &str) -> (Vec<Inferd>, HaProxy) {
    replica_set_with(model, pg, lease, &[])
}

/// [`replica_set`] with `extra` arguments for every replica.
fn replica_set_with(
    model: &std::path::Path,
    pg: &Postgres,
    lease: &str,
    extra: &[&str],
) -> (Vec<Inferd>, HaProxy) {
    let args: Vec<&str> = ["--http-listen", "127.0.0.1:0"]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
    let replicas: Vec<Inferd> = ["r1", "r2", "r3"]
        .into_iter()
        .map(|name| replica(model, pg, name, lease, &args))
        .collect();
    let addrs: Vec<(String, String)> = replicas
        .iter()
        .map(|r| (r.addr.clone(), r.http.clone().expect("an HTTP listener")))
        .collect();
    let proxy = HaProxy::start(&addrs);
    (replicas, proxy)
}

#[test]
fn the_client_contract_holds_through_the_proxy_on_any_replica() {
    if !support::haproxy::installed() {
        return;
    }
    let Some(pg) = Postgres::start() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let (_replicas, proxy) = replica_set(&model, &pg, "10");
    let (_reference_server, reference) = reference_server();
    // Six channels: HAProxy spreads their connections over the replicas.
    let clients: Vec<Client> = (0..6).map(|_| Client::connect(&proxy.grpc)).collect();

    for (n, client) in clients.iter().enumerate() {
        let id = client.create();
        let mut history = prompt(n, 0);
        assert_eq!(client.append(&id, &history).expect("appended"), 6);
        // Out of the vocabulary: INVALID_ARGUMENT, and nothing changed.
        let bad = client.append(&id, &[1 << 20]).expect_err("refused");
        assert_eq!(bad.0, RpcStatusCode::INVALID_ARGUMENT, "{bad:?}");
        let got = client.generate(&greedy(&id, 5, 0));
        assert!(got.error.is_none(), "{got:?}");
        assert_eq!(got.tokens, cold_greedy(&reference, &history, 5));
        history.extend(&got.tokens);
        // A seeded Generate through the whole sampling chain, the same on
        // the session's replica as on the reference.
        let seeded_here = client.generate(&seeded(&id, 6, 7 + n as u64));
        assert!(seeded_here.error.is_none(), "{seeded_here:?}");
        let twin = reference.create();
        reference.append(&twin, &history).expect("reference append");
        let seeded_there = reference.generate(&seeded(&twin, 6, 7 + n as u64));
        assert_eq!(seeded_here.tokens, seeded_there.tokens);
        reference.close(&twin).expect("closed");
        history.extend(&seeded_here.tokens);
        let info = client.info(&id).expect("info");
        assert_eq!(info.get_history_length(), history.len() as u64);
        assert_eq!(info.get_logits_digest(), cold_digest(&reference, &history));
        // The same session through another channel (most likely another
        // replica): it moves, with its history, KV and answers; a
        // GetSessionInfo that moves it answers with the digest it had.
        let other = &clients[(n + 1) % clients.len()];
        let moved = other.info(&id).expect("info where it moved");
        assert_eq!(moved.get_history_length(), history.len() as u64);
        assert_eq!(moved.get_logits_digest(), info.get_logits_digest());
        assert!(moved.get_kv_live_bytes() > 0, "{moved:?}");
        let got = other.generate(&greedy(&id, 3, 0));
        assert!(got.error.is_none(), "{got:?}");
        assert_eq!(got.tokens, cold_greedy(&reference, &history, 3));
        history.extend(&got.tokens);
        let (stored, _, _) = row(&pg, &id).expect("in the store");
        assert_eq!(stored, history);
        assert_eq!(client.close(&id).expect("closed"), history.len() as u64);
        for c in [client, other] {
            let gone = c.info(&id).expect_err("closed everywhere");
            assert_eq!(gone.0, RpcStatusCode::NOT_FOUND, "{gone:?}");
        }
        assert!(row(&pg, &id).is_none());
    }
    let unknown = clients[0]
        .info("00112233445566778899aabbccddeeff")
        .expect_err("never made");
    assert_eq!(unknown.0, RpcStatusCode::NOT_FOUND);
}

/// The stock Python client's whole contract walk
/// (`tests/interop/runtime_client.py`, stubs generated from the published
/// protos) through the proxy, its calls spread over three channels so that
/// its sessions move between the replicas on nearly every call; then its
/// seeded-sampling and idle-TTL walk on replicas with a 2 s TTL.
#[test]
fn the_stock_python_contract_walk_passes_through_the_proxy_with_sessions_moving() {
    if !support::haproxy::installed() || !support::have_reference() {
        return;
    }
    let Some(python) = support::python_env() else {
        return;
    };
    let Some(pg) = Postgres::start() else { return };
    let model = std::path::Path::new(support::REFERENCE);
    let walk = |proxy: &HaProxy, replicas: &[Inferd], args: &[&str]| {
        let out = std::process::Command::new(&python)
            .arg("tests/interop/runtime_client.py")
            .arg(&proxy.grpc)
            .args(["--spread", "3"])
            .args(args)
            .output()
            .expect("run the python client");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("interop: every check passed"),
            "the python client failed (exit {:?}):\n{stdout}\n{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr),
        );
        let moves: f64 = replicas
            .iter()
            .map(|r| support::replicas::metric(r, "inferd_replica_takeovers_total"))
            .sum();
        assert!(moves >= 3.0, "the sessions never moved: {moves} take-overs");
    };
    {
        let limits = ["--max-sessions", "2", "--eviction", "none"];
        let (replicas, proxy) = replica_set_with(model, &pg, "10", &limits);
        walk(
            &proxy,
            &replicas,
            &["--max-sessions", "2", "--eviction", "none"],
        );
    }
    let (replicas, proxy) = replica_set_with(model, &pg, "10", &["--idle-ttl", "2"]);
    walk(&proxy, &replicas, &["--idle-ttl", "2"]);
}

#[test]
fn killing_the_replica_that_holds_sixteen_conversations_loses_nothing_through_the_proxy() {
    if !support::haproxy::installed() {
        return;
    }
    let Some(pg) = Postgres::start() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let (mut replicas, proxy) = replica_set(&model, &pg, "2");
    let (_reference_server, reference) = reference_server();

    // One channel (one connection, so one replica holds all 16), with 16
    // conversations on it at once, each keeping what a call acknowledged.
    let client = Client::connect(&proxy.grpc);
    let ids: Vec<String> = (0..16).map(|_| client.create()).collect();
    let (_, holder, _) = row(&pg, &ids[0]).expect("in the store");
    for id in &ids {
        assert_eq!(row(&pg, id).expect("in the store").1, holder);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let conversations: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| {
            let (client, id, stop) = (client.clone(), id.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let acknowledged = converse(&client, &id, n, &stop);
                (id, acknowledged)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    let index = ["r1", "r2", "r3"]
        .iter()
        .position(|name| *name == holder)
        .expect("a replica's name");
    replicas[index].kill();
    let sessions: Vec<(String, Vec<u32>)> = conversations
        .into_iter()
        .map(|t| t.join().expect("a conversation"))
        .collect();

    // The same channel: grpc reconnects through the proxy to a live
    // replica; each conversation answers after at most one UNAVAILABLE.
    for (id, acknowledged) in &sessions {
        let (stored, got) = after_a_kill(&pg, &client, id, acknowledged, 4);
        assert_eq!(got.tokens, cold_greedy(&reference, &stored, 4), "{id}");
        let (after, owner, _) = row(&pg, id).expect("in the store");
        assert_ne!(owner, holder);
        assert_eq!(after.len(), stored.len() + 4);
    }
}

#[test]
fn the_openai_api_through_the_proxy_keeps_a_bound_session_on_one_replica() {
    if !support::haproxy::installed() || !support::have_reference() {
        return;
    }
    let Some(pg) = Postgres::start() else { return };
    let (replicas, proxy) = replica_set(std::path::Path::new(support::REFERENCE), &pg, "10");
    // Made and first fed through gRPC (whichever replica that reaches).
    let grpc = Client::connect(&proxy.grpc);
    let id = grpc.create();
    let mut prompt: Vec<u32> = vec![1, 504, 3575, 282, 4649, 314];
    grpc.append(&id, &prompt).expect("appended");
    let mut owners = Vec::new();
    for turn in 0..3 {
        prompt.extend([9, 45, 17 + turn]);
        let body = serde_json::json!({
            "model": "any",
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
        });
        let out = std::process::Command::new("curl")
            .args([
                "-sS",
                "--fail-with-body",
                "-H",
                "Content-Type: application/json",
            ])
            .args(["-H", &format!("x-inferd-session: {id}")])
            .args(["-d", &body.to_string()])
            .arg(format!("http://{}/v1/completions", proxy.http))
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "turn {turn}: {text}");
        let reply: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let generated = reply["usage"]["completion_tokens"].as_u64().expect("usage");
        // Only what the prompt adds was appended to the bound session.
        let (stored, owner, _) = row(&pg, &id).expect("in the store");
        assert_eq!(
            stored.len() as u64,
            prompt.len() as u64 + generated,
            "turn {turn}"
        );
        assert_eq!(&stored[..prompt.len()], &prompt[..]);
        prompt = stored;
        owners.push(owner);
    }
    // The header's hash keeps the conversation on one replica: at most the
    // first request moved it from where gRPC made it.
    assert!(owners.iter().all(|o| *o == owners[0]), "{owners:?}");
    let moves: f64 = replicas
        .iter()
        .map(|r| support::replicas::metric(r, "inferd_replica_takeovers_total"))
        .sum();
    assert!(moves <= 1.0, "{moves} moves");
}
