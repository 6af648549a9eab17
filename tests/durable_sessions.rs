//! Sessions that outlive the process (`inferd serve --state-dir`, CONTRACT
//! §2.13), with real processes and real files: a server under load killed
//! with SIGKILL at random moments and started again on the same directory,
//! fifty times, keeps every acknowledged token of every session and nothing
//! else, each with the logits of a cold recompute of its history (checked
//! against a second server that never crashed); damaged, truncated and
//! foreign journals are refused with reasons while the rest come back.

#![cfg(unix)]

mod support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inferd::gguf::synthetic::SyntheticLlama;
use rand::{Rng, SeedableRng};
use support::durable::{
    cold_digest, cold_greedy, journals, model_spec, records, reference_server, restored, serve,
    serve_with, write_model,
};
use support::{Client, Inferd};

const SESSIONS: usize = 16;
const THREADS: usize = 4;
const KILLS: usize = 50;
/// Histories stop growing here (the model's context is 4096).
const MOST_TOKENS: usize = 3_800;
const VOCAB: u32 = 320;

/// A call whose outcome the client did not learn (the server died).
#[derive(Clone, Debug)]
enum InFlight {
    Append(Vec<u32>),
    /// A greedy Generate of at most `max` tokens, `seen` of them received.
    Generate {
        max: u32,
        seen: Vec<u32>,
    },
}

#[derive(Debug)]
struct Track {
    id: String,
    /// The history as the acknowledged calls made it.
    acked: Vec<u32>,
    in_flight: Option<InFlight>,
}

/// Drives `sessions` until a call fails (the server was killed) or `stop`.
fn drive(client: &Client, sessions: &[Arc<Mutex<Track>>], stop: &AtomicBool, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    while !stop.load(Ordering::Relaxed) {
        let track = &sessions[rng.gen_range(0..sessions.len())];
        let mut t = track.lock().expect("track");
        if t.acked.len() >= MOST_TOKENS {
            continue;
        }
        if t.acked.is_empty() || rng.gen_bool(0.7) {
            let n = rng.gen_range(1..=12);
            let tokens: Vec<u32> = (0..n).map(|_| rng.gen_range(0..VOCAB)).collect();
            t.in_flight = Some(InFlight::Append(tokens.clone()));
            match client.append(&t.id, &tokens) {
                Ok(len) => {
                    t.acked.extend_from_slice(&tokens);
                    assert_eq!(len as usize, t.acked.len());
                    t.in_flight = None;
                }
                Err(_) => return,
            }
        } else {
            let max = rng.gen_range(1..=6);
            t.in_flight = Some(InFlight::Generate {
                max,
                seen: Vec::new(),
            });
            let got = client.generate(&support::greedy(&t.id, max, 0));
            if got.done.is_some() {
                t.acked.extend_from_slice(&got.tokens);
                t.in_flight = None;
            } else {
                t.in_flight = Some(InFlight::Generate {
                    max,
                    seen: got.tokens,
                });
                return;
            }
        }
    }
}

/// Settles a session after a restart: what it holds must be its
/// acknowledged history, or that plus exactly what its unanswered call
/// would have added; returns whether its digest was checked.
fn settle(server: &Client, reference: &Client, t: &mut Track, check_digest: bool) -> bool {
    let info = restored(server, &t.id);
    let len = info.get_history_length() as usize;
    let acked = t.acked.len();
    let truth = match t.in_flight.take() {
        None => {
            assert_eq!(len, acked, "session {} changed without a call", t.id);
            None
        }
        Some(InFlight::Append(tokens)) => {
            assert!(
                len == acked || len == acked + tokens.len(),
                "session {}: {len} tokens after an unanswered append of {} to {acked}",
                t.id,
                tokens.len()
            );
            (len > acked).then_some(tokens)
        }
        Some(InFlight::Generate { max, seen }) => {
            assert!(
                len >= acked && len <= acked + max as usize,
                "session {}: {len} tokens after an unanswered Generate({max}) on {acked}",
                t.id
            );
            if len > acked {
                let cont = cold_greedy(reference, &t.acked, (len - acked) as u32);
                assert!(cont.starts_with(&seen), "{cont:?} vs seen {seen:?}");
                Some(cont)
            } else {
                None
            }
        }
    };
    let moved = truth.is_some();
    if let Some(added) = truth {
        t.acked.extend_from_slice(&added);
    }
    assert_eq!(len, t.acked.len());
    if check_digest || moved {
        assert_eq!(
            info.get_logits_digest(),
            cold_digest(reference, &t.acked),
            "session {} is not what its history computes",
            t.id
        );
        return true;
    }
    false
}

#[test]
fn sigkill_under_load_fifty_times_loses_no_acknowledged_token_and_corrupts_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let (_reference_server, reference) = reference_server();
    let mut rng = rand::rngs::StdRng::seed_from_u64(2026);

    let mut server = serve(&model, &state, "sync");
    let client = Client::connect(&server.addr);
    let sessions: Vec<Arc<Mutex<Track>>> = (0..SESSIONS)
        .map(|_| {
            Arc::new(Mutex::new(Track {
                id: client.create(),
                acked: Vec::new(),
                in_flight: None,
            }))
        })
        .collect();
    let mut checked = 0;
    for round in 0..KILLS {
        let client = Client::connect(&server.addr);
        let stop = Arc::new(AtomicBool::new(false));
        let drivers: Vec<_> = sessions
            .chunks(SESSIONS / THREADS)
            .enumerate()
            .map(|(k, mine)| {
                let (client, mine, stop) = (client.clone(), mine.to_vec(), Arc::clone(&stop));
                let seed = (round * THREADS + k) as u64;
                std::thread::spawn(move || drive(&client, &mine, &stop, seed))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(rng.gen_range(20..250)));
        server.kill();
        stop.store(true, Ordering::Relaxed);
        for d in drivers {
            d.join().expect("driver");
        }
        server = serve(&model, &state, "sync");
        let client = Client::connect(&server.addr);
        let last = round + 1 == KILLS;
        for (k, track) in sessions.iter().enumerate() {
            let mut t = track.lock().expect("track");
            // Every session on the last round, a few on the others.
            let check = last || k % 8 == round % 8;
            checked += usize::from(settle(&client, &reference, &mut t, check));
        }
        // One journal per session: nothing duplicated, nothing left over.
        let kept = journals(&state)
            .into_iter()
            .filter(|p| p.extension().is_some_and(|x| x == "journal"))
            .count();
        assert_eq!(kept, SESSIONS, "round {round}");
    }
    let total: usize = sessions.iter().map(|t| t.lock().unwrap().acked.len()).sum();
    assert!(total > SESSIONS * 50, "the load moved: {total} tokens");
    assert!(checked >= SESSIONS, "{checked} digests checked");
    // A clean stop keeps them too.
    server.signal("TERM");
    server.wait_exit(Duration::from_secs(30)).expect("exits");
    let server = serve(&model, &state, "batch");
    let client = Client::connect(&server.addr);
    for track in &sessions {
        let mut t = track.lock().unwrap();
        settle(&client, &reference, &mut t, true);
    }
}

#[test]
fn damaged_truncated_and_foreign_journals_are_refused_with_reasons_and_the_rest_restored() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let (_reference_server, reference) = reference_server();
    let mut server = serve(&model, &state, "sync");
    let client = Client::connect(&server.addr);
    let ids: Vec<String> = (0..4).map(|_| client.create()).collect();
    let history = |k: u32| -> Vec<u32> { (0..40).map(|i| (i * 7 + k) % VOCAB).collect() };
    for (k, id) in ids.iter().enumerate() {
        client.append(id, &history(k as u32)[..30]).expect("append");
        client.append(id, &history(k as u32)[30..]).expect("append");
    }
    server.signal("TERM");
    server.wait_exit(Duration::from_secs(30)).expect("exits");
    let path = |id: &str| state.join("sessions").join(format!("{id}.journal"));

    // 0: a bit flipped in its first record (another follows): refused.
    let mut bytes = std::fs::read(path(&ids[0])).unwrap();
    let first = records(&bytes)[0];
    assert_eq!(first.2, 1, "an Append comes first");
    bytes[first.0 + 20] ^= 0x04;
    std::fs::write(path(&ids[0]), bytes).unwrap();
    // 1: its second Append cut short (a torn write; the page hint after it
    // never written): restored without it.
    let bytes = std::fs::read(path(&ids[1])).unwrap();
    let second = records(&bytes)
        .into_iter()
        .filter(|r| r.2 == 1)
        .nth(1)
        .expect("two appends");
    std::fs::write(path(&ids[1]), &bytes[..second.1 - 3]).unwrap();
    // 2: written for another model file: refused.
    let other = dir.path().join("other.gguf");
    std::fs::write(
        &other,
        SyntheticLlama {
            seed: 99,
            ..model_spec()
        }
        .build(),
    )
    .unwrap();
    let foreign_state = dir.path().join("foreign");
    {
        let server = serve(&other, &foreign_state, "sync");
        let c = Client::connect(&server.addr);
        let id = c.create();
        c.append(&id, &[1, 2, 3]).expect("append");
        drop(server);
        std::fs::copy(
            foreign_state.join("sessions").join(format!("{id}.journal")),
            path(&id),
        )
        .unwrap();
    }
    // Garbage under a session's name: refused.
    let garbage = "0123456789abcdef0123456789abcdef";
    std::fs::write(path(garbage), b"not a journal at all").unwrap();

    let server = serve(&model, &state, "sync");
    let client = Client::connect(&server.addr);
    assert!(client.info(&ids[0]).is_err(), "damaged: refused");
    let info = restored(&client, &ids[1]);
    assert_eq!(info.get_history_length(), 30);
    assert_eq!(
        info.get_logits_digest(),
        cold_digest(&reference, &history(1)[..30])
    );
    for (k, id) in ids.iter().enumerate().skip(2) {
        let info = restored(&client, id);
        assert_eq!(info.get_history_length(), 40);
        assert_eq!(
            info.get_logits_digest(),
            cold_digest(&reference, &history(k as u32))
        );
    }
    assert!(client.info(garbage).is_err());
    // The refused journals are kept, renamed, for an operator to look at.
    let names: Vec<String> = journals(&state)
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let refused: Vec<&String> = names.iter().filter(|n| n.ends_with(".refused")).collect();
    assert_eq!(refused.len(), 3, "{names:?}");
    assert!(names.contains(&format!("{}.journal.refused", ids[0])));
    assert!(names.contains(&format!("{garbage}.journal.refused")));
}

#[test]
fn a_second_server_on_the_same_state_directory_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let _first = serve(&model, &state, "sync");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--model",
            model.to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
        ])
        .output()
        .expect("run inferd");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("in use by another inferd process"),
        "{stderr}"
    );
}

#[test]
fn sessions_that_do_not_fit_at_start_come_back_spilled_and_are_fed_when_called() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let (_reference_server, reference) = reference_server();
    let history = |k: u32| -> Vec<u32> { (0..200).map(|i| (i * 13 + k) % VOCAB).collect() };
    let mut server = serve(&model, &state, "sync");
    let client = Client::connect(&server.addr);
    let ids: Vec<String> = (0..4).map(|_| client.create()).collect();
    for (k, id) in ids.iter().enumerate() {
        client.append(id, &history(k as u32)).expect("append");
    }
    server.signal("TERM");
    server.wait_exit(Duration::from_secs(30)).expect("exits");

    // 200 positions are 13 pages of 16: room for two sessions only.
    let server = serve_with(&model, &state, "sync", &["--kv-pages", "30"]);
    let client = Client::connect(&server.addr);
    let mut pages = Vec::new();
    for (k, id) in ids.iter().enumerate() {
        let info = restored(&client, id);
        assert_eq!(info.get_history_length(), 200, "every session is back");
        // Spilled or not, each reports its digest (a spilled one, the one
        // its journal recorded).
        assert_eq!(
            info.get_logits_digest(),
            cold_digest(&reference, &history(k as u32))
        );
        pages.push(info.get_kv_pages_held());
    }
    assert_eq!(pages.iter().filter(|&&p| p == 0).count(), 2, "{pages:?}");
    // Each one called is fed again (spilling others) and has its bits.
    for (k, id) in ids.iter().enumerate() {
        let mut more = history(k as u32);
        client
            .append(id, &[k as u32 + 1])
            .expect("append to a spilled session");
        more.push(k as u32 + 1);
        let info = restored(&client, id);
        assert_eq!(info.get_history_length(), 201);
        assert_eq!(info.get_logits_digest(), cold_digest(&reference, &more));
    }
}

/// Every session is back with its history and the digest a cold prefill
/// of it computes.
fn assert_all_restored(server: &Client, reference: &Client, truths: &[(String, Vec<u32>)]) {
    for (id, truth) in truths {
        let info = restored(server, id);
        assert_eq!(info.get_history_length() as usize, truth.len(), "{id}");
        assert_eq!(
            info.get_logits_digest(),
            cold_digest(reference, truth),
            "{id}"
        );
    }
}

/// The restore counters of a server started with `--metrics-listen`.
/// Every restored session so far computed the digest its journal recorded.
fn restore_metrics(server: &Inferd) -> (f64, f64) {
    let text = support::scrape(server.metrics.as_deref().expect("metrics address"));
    assert_eq!(
        support::sample(&text, "inferd_restore_digest_mismatches_total"),
        Some(0.0)
    );
    (
        support::sample(&text, "inferd_restore_kept_tokens_total").expect("kept tokens"),
        support::sample(&text, "inferd_restore_pages_rejected_total").expect("rejected pages"),
    )
}

#[test]
fn a_restart_takes_back_every_page_that_verifies_and_computes_only_the_rest() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let (_reference_server, reference) = reference_server();
    let metrics = ["--metrics-listen", "127.0.0.1:0"];
    let history = |k: u32, n: u32| -> Vec<u32> { (0..n).map(|i| (i * 11 + k) % VOCAB).collect() };
    let mut server = serve_with(&model, &state, "sync", &metrics);
    let client = Client::connect(&server.addr);
    // A long session, one sharing its first 500 tokens through a fork, and
    // one grown by a Generate.
    let long = client.create();
    client.append(&long, &history(1, 1000)).expect("append");
    let fork = client.fork(&long, 500);
    client
        .append(&fork, &history(2, 300))
        .expect("append to the fork");
    let generated = client.create();
    client.append(&generated, &history(3, 100)).expect("append");
    let got = client.generate(&support::greedy(&generated, 60, 0));
    assert!(got.error.is_none(), "{got:?}");
    let mut truths = vec![
        (long.clone(), history(1, 1000)),
        (
            fork.clone(),
            [&history(1, 1000)[..500], &history(2, 300)].concat(),
        ),
        (generated.clone(), [history(3, 100), got.tokens].concat()),
    ];
    // Killed: the pages are where the last run wrote them.
    server.kill();
    let server = serve_with(&model, &state, "sync", &metrics);
    let client = Client::connect(&server.addr);
    assert_all_restored(&client, &reference, &truths);
    // Every full page below each last token's page comes back.
    let whole: usize = truths.iter().map(|(_, t)| (t.len() - 1) / 16 * 16).sum();
    assert_eq!(restore_metrics(&server), (whole as f64, 0.0));
    // Calls go on from the taken-back pages as from computed ones.
    client
        .append(&long, &[5, 6, 7])
        .expect("append after the restart");
    truths[0].1.extend([5, 6, 7]);
    let info = client.info(&long).expect("info");
    assert_eq!(
        info.get_logits_digest(),
        cold_digest(&reference, &truths[0].1)
    );
    drop(client);
    drop(server);

    // Damage every page file byte in a stretch: those pages fail their
    // checksums and are computed again; the sessions still hold their bits.
    let pages = state.join("kv.pages");
    let mut bytes = std::fs::read(&pages).expect("page file");
    for b in &mut bytes[..64 << 10] {
        *b ^= 0x5a;
    }
    std::fs::write(&pages, &bytes).expect("damage");
    let server = serve_with(&model, &state, "sync", &metrics);
    let client = Client::connect(&server.addr);
    assert_all_restored(&client, &reference, &truths);
    let (kept, rejected) = restore_metrics(&server);
    assert!(rejected > 0.0, "damaged pages are rejected");
    assert!(kept < whole as f64, "{kept} tokens kept of {whole}");
    drop(client);
    drop(server);

    // A page file swapped for an empty one: every page is computed again.
    std::fs::write(&pages, b"").expect("truncate");
    let server = serve_with(&model, &state, "sync", &metrics);
    let client = Client::connect(&server.addr);
    assert_all_restored(&client, &reference, &truths);
    let (kept, rejected) = restore_metrics(&server);
    assert_eq!(kept, 0.0);
    assert!(rejected > 0.0);
}

/// The spill counters of a server started with `--metrics-listen`: bytes
/// written out now, and tokens read back so far.
fn spill_metrics(server: &Inferd) -> (f64, f64) {
    let text = support::scrape(server.metrics.as_deref().expect("metrics address"));
    assert_eq!(
        support::sample(&text, "inferd_restore_digest_mismatches_total"),
        Some(0.0)
    );
    (
        support::sample(&text, "inferd_session_spill_bytes").expect("spill bytes"),
        support::sample(&text, "inferd_session_spill_read_tokens_total").expect("read tokens"),
    )
}

fn spill_files(state: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(state.join("spill"))
        .expect("spill dir")
        .map(|e| e.expect("entry").path())
        .collect()
}

#[test]
fn a_spilled_session_reads_its_pages_back_and_a_damaged_spill_file_costs_only_a_recompute() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let (_reference_server, reference) = reference_server();
    let history = |k: u32| -> Vec<u32> { (0..200).map(|i| (i * 17 + k) % VOCAB).collect() };
    // Room for two sessions of 200 positions: a third spills the oldest.
    let server = serve_with(
        &model,
        &state,
        "sync",
        &["--kv-pages", "30", "--metrics-listen", "127.0.0.1:0"],
    );
    let client = Client::connect(&server.addr);
    let ids: Vec<String> = (0..3).map(|_| client.create()).collect();
    let mut truths: Vec<Vec<u32>> = (0..3).map(history).collect();
    for (id, truth) in ids.iter().zip(&truths) {
        client.append(id, truth).expect("append");
    }
    // The first was spilled for the third: its 12 full pages below its
    // last token's page are on disk.
    assert_eq!(client.info(&ids[0]).expect("info").get_kv_pages_held(), 0);
    let files = spill_files(&state);
    assert_eq!(files.len(), 1, "{files:?}");
    let (bytes, read) = spill_metrics(&server);
    assert!(bytes > 0.0 && read == 0.0, "{bytes} {read}");

    // Called again, it reads them back (spilling the second) and feeds
    // only its last page's positions and the new token.
    client
        .append(&ids[0], &[7])
        .expect("append to a spilled session");
    truths[0].push(7);
    let info = client.info(&ids[0]).expect("info");
    assert_eq!(
        info.get_logits_digest(),
        cold_digest(&reference, &truths[0])
    );
    assert_eq!(spill_metrics(&server).1, 192.0);
    assert!(!files[0].exists(), "a file read back is deleted");

    // The second's file, damaged in its page bytes: pages from the damage
    // on are computed; the session still holds its bits.
    let files = spill_files(&state);
    assert_eq!(files.len(), 1, "{files:?}");
    let mut bytes = std::fs::read(&files[0]).expect("spill file");
    let end = bytes.len();
    for b in &mut bytes[end - 8000..end - 4000] {
        *b ^= 0x5a;
    }
    std::fs::write(&files[0], &bytes).expect("damage");
    client
        .append(&ids[1], &[8])
        .expect("append to a spilled session");
    truths[1].push(8);
    let info = client.info(&ids[1]).expect("info");
    assert_eq!(
        info.get_logits_digest(),
        cold_digest(&reference, &truths[1])
    );
    let read = spill_metrics(&server).1 - 192.0;
    assert!(read < 192.0, "{read} tokens read back from a damaged file");
    // Closing every session deletes every spill file.
    for id in &ids {
        client.close(id).expect("close");
    }
    assert!(spill_files(&state).is_empty());
    assert_eq!(spill_metrics(&server).0, 0.0);
}

#[test]
fn sessions_taking_turns_in_room_for_one_spill_each_other_every_time() {
    // Each call needs the other session (idle, maybe on the other worker)
    // spilled: the call must find it evictable however soon it comes after
    // the other's reply.
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let history = |k: u32| -> Vec<u32> { (0..300).map(|i| (i * 19 + k) % VOCAB).collect() };
    // 300 positions are 19 pages of 16: room for one session.
    let server = serve_with(&model, &state, "none", &["--kv-pages", "30"]);
    let client = Client::connect(&server.addr);
    let ids: Vec<String> = (0..2).map(|_| client.create()).collect();
    for round in 0..40u32 {
        let k = (round % 2) as usize;
        let tokens = if round < 2 {
            history(round)
        } else {
            vec![round]
        };
        client
            .append(&ids[k], &tokens)
            .unwrap_or_else(|e| panic!("round {round}: {e:?}"));
    }
}

#[test]
fn a_session_spilled_when_the_server_died_reads_its_spill_file_after_the_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let (_reference_server, reference) = reference_server();
    let history = |k: u32| -> Vec<u32> { (0..300).map(|i| (i * 23 + k) % VOCAB).collect() };
    // Room for one session of 300 positions.
    let args = ["--kv-pages", "30", "--metrics-listen", "127.0.0.1:0"];
    let mut server = serve_with(&model, &state, "sync", &args);
    let client = Client::connect(&server.addr);
    let ids: Vec<String> = (0..2).map(|_| client.create()).collect();
    let mut truths: Vec<Vec<u32>> = (0..2).map(history).collect();
    for (id, truth) in ids.iter().zip(&truths) {
        client.append(id, truth).expect("append");
    }
    // The first is spilled, its pages in its spill file, and the second
    // took its pages in the page file.
    assert_eq!(spill_files(&state).len(), 1);
    server.kill();

    // Started again with room for both: the first reads its 18 full pages
    // (below its last token's) back from its spill file, the second takes
    // its pages back from the page file.
    let roomy = ["--kv-pages", "60", "--metrics-listen", "127.0.0.1:0"];
    let server = serve_with(&model, &state, "sync", &roomy);
    let client = Client::connect(&server.addr);
    for (k, id) in ids.iter().enumerate() {
        let info = restored(&client, id);
        assert_eq!(
            info.get_logits_digest(),
            cold_digest(&reference, &truths[k])
        );
    }
    assert_eq!(
        spill_metrics(&server).1,
        288.0,
        "read back from the spill file"
    );
    // (The first's hints are stale: the second took those pages.)
    let (kept, rejected) = restore_metrics(&server);
    assert_eq!(kept, 288.0, "taken back from the page file");
    assert!(rejected > 0.0);
    assert!(
        spill_files(&state).is_empty(),
        "a file read back is deleted"
    );
    for (k, id) in ids.iter().enumerate() {
        client.append(id, &[k as u32 + 3]).expect("append");
        truths[k].push(k as u32 + 3);
        let info = client.info(id).expect("info");
        assert_eq!(
            info.get_logits_digest(),
            cold_digest(&reference, &truths[k])
        );
    }
}
