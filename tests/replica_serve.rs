//! Replicas sharing their sessions through a real PostgreSQL (a server of
//! the test's own): real `inferd serve --session-store` processes on
//! loopback, stock gRPC clients. A replica killed with 16 sessions in
//! mid-conversation loses no acknowledged token, and every session goes on
//! on another replica with the tokens a session that never moved would
//! give; a paused replica whose lease was taken over writes nothing when it
//! wakes; the database restarted under traffic fails calls typed and loses
//! nothing; a database whose schema is newer than the build is refused at
//! start.

mod support;

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use grpcio::RpcStatusCode;
use support::durable::{cold_digest, cold_greedy, reference_server, write_model};
use support::postgres::Postgres;
use support::replicas::{after_a_kill, converse, metric, prompt, replica, row, unavailable};
use support::{greedy, Client};

#[test]
fn sixteen_sessions_of_a_killed_replica_go_on_elsewhere_bit_for_bit() {
    let Some(pg) = Postgres::start() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let mut a = replica(&model, &pg, "a", "1.5", &[]);
    let b = replica(&model, &pg, "b", "1.5", &[]);
    let (_reference_server, reference) = reference_server();

    // 16 conversations on replica a, each keeping what a call acknowledged.
    let stop = Arc::new(AtomicBool::new(false));
    let (report, reports) = mpsc::channel();
    let mut threads = Vec::new();
    for n in 0..16 {
        let client = Client::connect(&a.addr);
        let (stop, report) = (Arc::clone(&stop), report.clone());
        threads.push(std::thread::spawn(move || {
            let id = client.create();
            let acknowledged = converse(&client, &id, n, &stop);
            report.send((id, acknowledged)).expect("reported");
        }));
    }
    drop(report);
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    // Mid-conversation: no goodbye to the store or the clients.
    a.kill();
    let sessions: Vec<(String, Vec<u32>)> = reports.iter().collect();
    for t in threads {
        t.join().expect("a conversation thread");
    }
    assert_eq!(sessions.len(), 16);

    let moved = Client::connect(&b.addr);
    for (id, acknowledged) in &sessions {
        assert_eq!(row(&pg, id).expect("in the store").1, "a");
        // Every acknowledged token is there; the next call, on another
        // replica, answers after at most one UNAVAILABLE, with the tokens
        // of a session that never moved.
        let (stored, got) = after_a_kill(&pg, &moved, id, acknowledged, 5);
        assert_eq!(got.tokens, cold_greedy(&reference, &stored, 5), "{id}");
        let mut history = stored.clone();
        history.extend_from_slice(&got.tokens);
        let info = moved.info(id).expect("info on the new replica");
        assert_eq!(info.get_history_length(), history.len() as u64);
        assert_eq!(
            info.get_logits_digest(),
            cold_digest(&reference, &history),
            "{id}"
        );
        let (stored, owner, _) = row(&pg, id).expect("still in the store");
        assert_eq!((stored, owner.as_str()), (history, "b"));
    }
    assert_eq!(metric(&b, "inferd_replica_takeovers_total"), 16.0);
    // A close on the new replica deletes the row.
    let (id, _) = &sessions[0];
    moved.close(id).expect("closed");
    assert!(row(&pg, id).is_none());
    let gone = moved.info(id).expect_err("closed everywhere");
    assert_eq!(gone.0, RpcStatusCode::NOT_FOUND);
}

#[test]
fn a_paused_replica_whose_lease_was_taken_writes_nothing_when_it_wakes() {
    let Some(pg) = Postgres::start() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let a = replica(&model, &pg, "a", "1", &[]);
    let b = replica(&model, &pg, "b", "1", &[]);
    let on_a = Client::connect(&a.addr);
    let id = on_a.create();
    on_a.append(&id, &prompt(0, 0)).expect("appended on a");

    // A long Generate on a, paused after its first token.
    let (paused, when_paused) = mpsc::channel();
    let generating = {
        let (client, id) = (on_a.clone(), id.clone());
        let pid = a.pid().expect("a runs").to_string();
        std::thread::spawn(move || {
            let mut paused = Some(paused);
            client.generate_watching(&greedy(&id, 2000, 0), None, |n| {
                if n == 1 {
                    let stopped = Command::new("kill").args(["-s", "STOP", &pid]).status();
                    assert!(stopped.expect("kill").success());
                    if let Some(tx) = paused.take() {
                        tx.send(()).expect("told");
                    }
                }
            })
        })
    };
    when_paused
        .recv_timeout(Duration::from_secs(60))
        .expect("a paused mid-Generate");
    let (before, _, epoch_a) = row(&pg, &id).expect("in the store");

    // Replica b takes it over once a's lease runs out, and goes on.
    let on_b = Client::connect(&b.addr);
    let t0 = Instant::now();
    let length = on_b
        .append(&id, &prompt(0, 1))
        .expect("b takes the session over");
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "a's live lease was not waited for"
    );
    let got = on_b.generate(&greedy(&id, 4, 0));
    assert!(got.error.is_none(), "{got:?}");
    let (after_b, owner, epoch_b) = row(&pg, &id).expect("in the store");
    assert_eq!(owner, "b");
    assert!(epoch_b > epoch_a);
    assert_eq!(after_b.len() as u64, length + 4);
    assert_eq!(&after_b[..before.len()], &before[..]);

    // Replica a wakes: its Generate's write is refused by the epoch, and
    // the call fails UNAVAILABLE; the store holds b's history only.
    a.signal("CONT");
    let ended = generating.join().expect("the Generate thread");
    assert!(unavailable(&ended), "{ended:?}");
    assert!(ended.done.is_none());
    let (stored, owner, epoch) = row(&pg, &id).expect("in the store");
    assert_eq!((stored, owner.as_str(), epoch), (after_b, "b", epoch_b));
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&a, "inferd_replica_leases_lost_total") < 1.0 {
        assert!(Instant::now() < deadline, "a never counted its lost lease");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_database_restarted_under_traffic_fails_calls_typed_and_loses_nothing() {
    let Some(mut pg) = Postgres::start() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let a = replica(&model, &pg, "a", "10", &[]);
    let client = Client::connect(&a.addr);
    let (_reference_server, reference) = reference_server();
    let ids: Vec<String> = (0..4).map(|_| client.create()).collect();
    let mut histories = vec![Vec::new(); ids.len()];
    for (n, id) in ids.iter().enumerate() {
        client.append(id, &prompt(n, 0)).expect("appended");
        histories[n].extend(prompt(n, 0));
    }

    pg.stop();
    for (n, id) in ids.iter().enumerate() {
        let t0 = Instant::now();
        let refused = client
            .append(id, &prompt(n, 1))
            .expect_err("no store, no append");
        assert_eq!(refused.0, RpcStatusCode::UNAVAILABLE, "{refused:?}");
        assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
        let got = client.generate(&greedy(id, 3, 0));
        assert!(unavailable(&got), "{got:?}");
        // Nothing of the refused calls stays.
        let info = client.info(id).expect("still held");
        assert_eq!(info.get_history_length(), histories[n].len() as u64);
    }
    assert!(metric(&a, "inferd_replica_store_failures_total") >= 8.0);

    pg.start_again();
    // A replica's calls fail at once for a second after a failed connect.
    std::thread::sleep(inferd::replica::RETRY_CONNECT);
    for (n, id) in ids.iter().enumerate() {
        client
            .append(id, &prompt(n, 2))
            .expect("appends once it is back");
        histories[n].extend(prompt(n, 2));
        let got = client.generate(&greedy(id, 3, 0));
        assert!(got.error.is_none(), "{got:?}");
        assert_eq!(got.tokens, cold_greedy(&reference, &histories[n], 3));
        histories[n].extend(&got.tokens);
        let (stored, owner, _) = row(&pg, id).expect("in the store");
        assert_eq!((stored, owner.as_str()), (histories[n].clone(), "a"));
    }
}

#[test]
fn a_store_with_a_newer_schema_is_refused_at_start() {
    let Some(pg) = Postgres::start() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    // A replica of this build makes the schema; a later one moved it on.
    drop(replica(&model, &pg, "a", "10", &[]));
    pg.client()
        .execute("INSERT INTO inferd_schema (version) VALUES (1000)", &[])
        .expect("writes");
    let out = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--model",
            model.to_str().expect("UTF-8 path"),
            "--session-store",
            &pg.url,
        ])
        .env_remove("INFERD_SESSION_STORE")
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("schema is version 1000"), "{stderr}");
    assert!(
        !stderr.contains(&pg.url),
        "the URL (and its password) was printed: {stderr}"
    );
}

#[test]
fn a_live_replica_hands_an_idle_session_over_at_once() {
    let Some(pg) = Postgres::start() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    // Leases far longer than the test: only a hand-off moves the session.
    let a = replica(&model, &pg, "a", "60", &[]);
    let b = replica(&model, &pg, "b", "60", &[]);
    let (_reference_server, reference) = reference_server();
    let (on_a, on_b) = (Client::connect(&a.addr), Client::connect(&b.addr));
    let id = on_a.create();
    let mut history = prompt(1, 0);
    on_a.append(&id, &history).expect("appended on a");

    // A reconnect that lands on the other replica: a asks nothing of the
    // client, and lets the session go as soon as b asks.
    for (round, (here, there)) in [(&on_b, &b), (&on_a, &a), (&on_b, &b)]
        .into_iter()
        .enumerate()
    {
        let t0 = Instant::now();
        let got = here.generate(&greedy(&id, 4, 0));
        assert!(got.error.is_none(), "round {round}: {got:?}");
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "round {round}: the move waited {:?}",
            t0.elapsed()
        );
        assert_eq!(
            got.tokens,
            cold_greedy(&reference, &history, 4),
            "round {round}"
        );
        history.extend(&got.tokens);
        let (stored, owner, _) = row(&pg, &id).expect("in the store");
        assert_eq!(stored, history);
        assert_eq!(owner, if std::ptr::eq(there, &a) { "a" } else { "b" });
    }
    assert_eq!(metric(&a, "inferd_replica_handoffs_total"), 2.0);
    assert_eq!(metric(&b, "inferd_replica_handoffs_total"), 1.0);
    assert_eq!(metric(&b, "inferd_replica_takeovers_total"), 2.0);
}

#[test]
fn a_live_replica_keeps_a_session_that_is_mid_call_and_lets_it_go_after() {
    if !support::have_reference() {
        return;
    }
    let Some(pg) = Postgres::start() else { return };
    let model = std::path::Path::new(support::REFERENCE);
    // Short leases: the other replica's call gives up after a second.
    let a = replica(model, &pg, "a", "0.5", &[]);
    let b = replica(model, &pg, "b", "0.5", &[]);
    let (on_a, on_b) = (Client::connect(&a.addr), Client::connect(&b.addr));
    let id = on_a.create();
    let prompt = [1, 504, 3458, 282, 4667, 30, 216, 1095, 314];
    on_a.append(&id, &prompt).expect("appended on a");

    // A long Generate on a, read to its 800th token and then cancelled.
    let (started, running) = mpsc::channel();
    let generating = {
        let (client, id) = (on_a.clone(), id.clone());
        std::thread::spawn(move || {
            client.generate_watching(&greedy(&id, 4000, 0), Some(800), |n| {
                if n == 1 {
                    let _ = started.send(());
                }
            })
        })
    };
    running
        .recv_timeout(Duration::from_secs(60))
        .expect("the Generate started");
    let t0 = Instant::now();
    let refused = on_b.info(&id).expect_err("held by a, mid-call");
    assert_eq!(refused.0, RpcStatusCode::UNAVAILABLE, "{refused:?}");
    assert!(refused.1.contains("held by another replica"), "{refused:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(
        !generating.is_finished(),
        "the Generate ended before b gave up"
    );
    let got = generating.join().expect("the Generate");
    assert!(got.error.is_none(), "{got:?}");
    assert_eq!(got.tokens.len(), 800);
    assert_eq!(row(&pg, &id).expect("in the store").1, "a");
    assert_eq!(metric(&a, "inferd_replica_handoffs_total"), 0.0);

    // Once the cancelled Generate has stopped, b's call moves it: the
    // history has every token a streamed, and nothing after them.
    let moved = on_b.info(&id).expect("moved to b");
    let (stored, owner, _) = row(&pg, &id).expect("in the store");
    assert_eq!(owner, "b");
    assert_eq!(moved.get_history_length(), stored.len() as u64);
    assert_eq!(&stored[..prompt.len()], &prompt);
    let committed = &stored[prompt.len()..];
    assert!(committed.len() >= 800, "{} committed", committed.len());
    assert_eq!(&committed[..800], &got.tokens[..]);
    assert_eq!(metric(&a, "inferd_replica_handoffs_total"), 1.0);
}

/// A write the database committed but whose answer never came back (the
/// connection cut right after the statement left): the call failed, so the
/// session holds what it held before it, and the store is set back to
/// that too, by the worker's next turn or the session's next write,
/// before the session goes on. Nothing the client was told failed is kept.
#[test]
fn a_write_committed_without_an_answer_is_set_right_in_the_store() {
    let Some(pg) = Postgres::start() else { return };
    let cutter = support::cutter::Cutter::start(&pg);
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let a = support::replicas::replica_of(&model, &cutter.url(&pg), "a", "10", &[]);
    let (_reference_server, reference) = reference_server();
    let client = Client::connect(&a.addr);
    let id = client.create();
    let start = prompt(2, 0);
    client.append(&id, &start).expect("appended");

    // The next append's statement reaches the database; its answer does not.
    cutter.arm("history = history ||");
    let lost = client.append(&id, &prompt(2, 1)).expect_err("no answer");
    assert_eq!(lost.0, RpcStatusCode::UNAVAILABLE, "{lost:?}");
    assert_eq!(cutter.cuts(), 1);
    let info = client.info(&id).expect("info");
    assert_eq!(info.get_history_length(), start.len() as u64);
    // The store took it all the same (the create, the first append, the
    // lost one), and is set back within a few turns of the worker (a
    // renewal every third of the lease wakes it): one change more.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (stored, owner, _) = row(&pg, &id).expect("in the store");
        assert_eq!(owner, "a");
        if stored == start {
            assert_eq!(changes(&pg, &id), 4);
            break;
        }
        assert_eq!(stored.len(), 2 * start.len(), "{stored:?}");
        assert!(
            Instant::now() < deadline,
            "the store still holds {stored:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Again, now for a Generate's tokens, with the session's next write
    // (an append at once) setting the store right.
    cutter.arm("history = history ||");
    let got = client.generate(&greedy(&id, 3, 0));
    assert!(unavailable(&got), "{got:?}");
    let more = prompt(2, 2);
    client.append(&id, &more).expect("appended");
    let history: Vec<u32> = start.iter().chain(&more).copied().collect();
    assert_eq!(row(&pg, &id).expect("in the store").0, history);
    let got = client.generate(&greedy(&id, 4, 0));
    assert!(got.error.is_none(), "{got:?}");
    assert_eq!(got.tokens, cold_greedy(&reference, &history, 4));
    let after: Vec<u32> = history.iter().chain(&got.tokens).copied().collect();
    assert_eq!(row(&pg, &id).expect("in the store").0, after);
    assert_eq!(cutter.cuts(), 2);
    // The Generate's lost write, the store set right (by the worker's turn
    // or by the append, whichever came first), the append, the Generate.
    let n = changes(&pg, &id);
    assert!(n == 7 || n == 8, "{n} changes");
}

/// How many writes made session `id`'s row.
fn changes(pg: &Postgres, id: &str) -> i64 {
    pg.client()
        .query_one("SELECT changes FROM inferd_sessions WHERE id = $1", &[&id])
        .expect("reads the store")
        .get(0)
}

/// Replicas of two model files on one store (a rolling upgrade): a session
/// made with one is not continued by a replica of the other, which says
/// so (FAILED_PRECONDITION) and leaves it where it is; its own replica
/// goes on with it.
#[test]
fn a_replica_of_another_model_does_not_continue_a_session() {
    let Some(pg) = Postgres::start() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let other = dir.path().join("other.gguf");
    let spec = inferd::gguf::synthetic::SyntheticLlama {
        seed: 99,
        ..support::durable::model_spec()
    };
    std::fs::write(&other, spec.build()).expect("write the other model");
    let mut a = replica(&model, &pg, "a", "0.5", &[]);
    let b = replica(&other, &pg, "b", "0.5", &[]);
    let (on_a, on_b) = (Client::connect(&a.addr), Client::connect(&b.addr));
    let id = on_a.create();
    let history = prompt(3, 0);
    on_a.append(&id, &history).expect("appended on a");
    // Even once a is gone and its lease ran out, b does not take it.
    a.kill();
    std::thread::sleep(Duration::from_millis(800));
    let before = row(&pg, &id).expect("in the store");
    for refused in [
        on_b.info(&id).map(drop),
        on_b.append(&id, &prompt(3, 1)).map(drop),
    ] {
        let (code, message) = refused.expect_err("another model's session");
        assert_eq!(code, RpcStatusCode::FAILED_PRECONDITION, "{message}");
        assert!(message.contains("another model file"), "{message}");
    }
    assert_eq!(row(&pg, &id), Some(before));
    assert_eq!(metric(&b, "inferd_replica_takeovers_total"), 0.0);
    // A replica of its own model goes on with it.
    let (_reference_server, reference) = reference_server();
    let a_again = replica(&model, &pg, "a", "0.5", &[]);
    let got = Client::connect(&a_again.addr).generate(&greedy(&id, 3, 0));
    assert!(got.error.is_none(), "{got:?}");
    assert_eq!(got.tokens, cold_greedy(&reference, &history, 3));
}
