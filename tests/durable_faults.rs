//! Durable sessions under faults (CONTRACT §2.13), with real processes and
//! real file systems: the tails a crash or a power cut leaves at the end of
//! a journal (zeros, garbage, a record cut short, the last record zeroed)
//! are dropped and the session restored, while damage in the middle is
//! refused; a full disk (a small tmpfs under the state directory) and a
//! failing one (a preload shim that fails fsync or write, tests/faults)
//! fail the call that could not be made durable with UNAVAILABLE and
//! change nothing, refuse new durable sessions and turn health NOT_SERVING
//! until the directory takes writes again, which it is found to do without
//! a restart; and after a SIGKILL every acknowledged token is there.
//!
//! Mounting needs root (as CI runs): elsewhere the tmpfs tests say so
//! loudly and skip, unless `CI` is set, where they fail.

#![cfg(unix)]

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use grpcio::{ChannelBuilder, EnvBuilder, RpcStatusCode};
use inferd::proto::grpc_health_v1::health::{
    HealthCheckRequest, HealthCheckResponse_ServingStatus as Serving,
};
use inferd::proto::grpc_health_v1::health_grpc::HealthClient;
use rand::{Rng, SeedableRng};
use support::durable::{
    cold_digest, records, reference_server, restored, serve_env, serve_with, write_model,
};
use support::{Client, Inferd};

const VOCAB: u32 = 320;

fn history(k: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 29 + k * 7 + 3) % VOCAB)
        .collect()
}

fn journal_path(state: &Path, id: &str) -> PathBuf {
    state.join("sessions").join(format!("{id}.journal"))
}

fn append_bytes(path: &Path, bytes: &[u8]) {
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .expect("open the journal")
        .write_all(bytes)
        .expect("write");
}

#[test]
fn tails_a_crash_leaves_are_dropped_and_damage_in_the_middle_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let (_reference_server, reference) = reference_server();
    let mut server = serve_with(&model, &state, "sync", &[]);
    let client = Client::connect(&server.addr);
    let ids: Vec<String> = (0..8).map(|_| client.create()).collect();
    for (k, id) in ids.iter().enumerate() {
        let h = history(k as u32, 40);
        client.append(id, &h[..30]).expect("append");
        client.append(id, &h[30..]).expect("append");
    }
    server.signal("TERM");
    server.wait_exit(Duration::from_secs(30)).expect("exits");

    let mut rng = rand::rngs::StdRng::seed_from_u64(28);
    let random =
        |rng: &mut rand::rngs::StdRng, n: usize| -> Vec<u8> { (0..n).map(|_| rng.gen()).collect() };
    let path = |k: usize| journal_path(&state, &ids[k]);
    // A whole valid record to cut prefixes from.
    let bytes1 = std::fs::read(path(1)).unwrap();
    let last = *records(&bytes1).last().unwrap();
    let record = bytes1[last.0..last.1].to_vec();
    // 0: 12 zero bytes.
    append_bytes(&path(0), &[0; 12]);
    // 1: 64 random bytes.
    append_bytes(&path(1), &random(&mut rng, 64));
    // 2: the last record zeroed in place: that record is gone.
    let mut bytes = std::fs::read(path(2)).unwrap();
    let (start, end, _) = *records(&bytes).last().unwrap();
    bytes[start..end].fill(0);
    std::fs::write(path(2), &bytes).unwrap();
    // 3: a torn write padded with zeros to the end of its 4 KiB block.
    let mut bytes = std::fs::read(path(3)).unwrap();
    bytes.extend_from_slice(&record[..record.len() / 2]);
    bytes.resize(bytes.len().next_multiple_of(4096), 0);
    std::fs::write(path(3), &bytes).unwrap();
    // 4: a valid record cut short.
    append_bytes(&path(4), &record[..record.len() - 1]);
    // 5: a page of garbage.
    append_bytes(&path(5), &random(&mut rng, 4096));
    // 6: damage in the middle, a good record after it: refused.
    let mut bytes = std::fs::read(path(6)).unwrap();
    let first = records(&bytes)[0];
    bytes[first.0 + 16] ^= 0x20;
    std::fs::write(path(6), &bytes).unwrap();
    // 7: its hints garbled: they cost only a recompute.
    let hints = state.join("sessions").join(format!("{}.hints", ids[7]));
    let mut bytes = std::fs::read(&hints).expect("hints beside the journal");
    let n = bytes.len();
    bytes[n / 2..].copy_from_slice(&random(&mut rng, n - n / 2));
    std::fs::write(&hints, &bytes).unwrap();

    let server = serve_with(&model, &state, "sync", &[]);
    let client = Client::connect(&server.addr);
    for (k, id) in ids.iter().enumerate() {
        if k == 6 {
            let gone = client.info(id).expect_err("damaged: refused");
            assert_eq!(gone.0, RpcStatusCode::NOT_FOUND);
            assert!(journal_path(&state, id)
                .with_extension("journal.refused")
                .exists());
            continue;
        }
        let kept = if k == 2 { 30 } else { 40 };
        let info = restored(&client, id);
        assert_eq!(info.get_history_length(), kept, "session {k}");
        assert!(info.get_durable());
        let truth = &history(k as u32, 40)[..kept as usize];
        assert_eq!(
            info.get_logits_digest(),
            cold_digest(&reference, truth),
            "session {k}"
        );
        // It goes on: the next append lands after the tail was cut.
        client
            .append(id, &[5, 6])
            .expect("append after a torn tail");
    }
}

/// A tmpfs of `size` mounted at `at`, unmounted when dropped. `None` when
/// mounting is not permitted here (not root).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(at).expect("mount point");
        let ok = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(at)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            assert!(
                std::env::var_os("CI").is_none(),
                "cannot mount a tmpfs at {} (CI runs as root)",
                at.display()
            );
            eprintln!(
                "\n*** SKIPPED: mounting a tmpfs needs root; the full-disk test did not run\n"
            );
            return None;
        }
        Some(Tmpfs(at.to_owned()))
    }

    /// Fills it up with a file of its own: the space left after it is
    /// less than a page.
    fn fill(&self) -> PathBuf {
        let path = self.0.join("filler");
        let mut file = std::fs::File::create(&path).expect("filler");
        let chunk = [0xa5u8; 4096];
        loop {
            match file.write(&chunk) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        loop {
            if file.write(&[0xa5]).map_or(true, |n| n == 0) {
                break;
            }
        }
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn health(addr: &str) -> Serving {
    let env = std::sync::Arc::new(EnvBuilder::new().cq_count(1).build());
    let channel = ChannelBuilder::new(env).connect(addr);
    let client = HealthClient::new(channel);
    client
        .check(&HealthCheckRequest::new())
        .expect("health check")
        .get_status()
}

fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn metric(server: &Inferd, name: &str) -> f64 {
    let addr = server.metrics.as_deref().expect("metrics");
    support::sample(&support::scrape(addr), name).unwrap_or_else(|| panic!("{name} missing"))
}

/// What a client is told, what the session then holds, and what survives
/// a SIGKILL, when the state directory is full; and that it all comes back
/// once space does, without a restart.
#[test]
fn a_full_disk_fails_the_call_changes_nothing_and_recovers_when_space_returns() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let Some(disk) = Tmpfs::mount(&state.join("sessions"), "512k") else {
        return;
    };
    let Some(spill_disk) = Tmpfs::mount(&state.join("spill"), "64k") else {
        return;
    };
    let (_reference_server, reference) = reference_server();
    // Room for three sessions: a fourth spills the oldest idle one.
    let extra = ["--metrics-listen", "127.0.0.1:0", "--max-sessions", "3"];
    let mut server = serve_with(&model, &state, "sync", &extra);
    let client = Client::connect(&server.addr);
    let a = client.create();
    let long = history(1, 4000);
    client.append(&a, &long[..50]).expect("append");
    let b = client.create();
    // Near the context (4096): its next append past it truncates, which
    // rewrites the journal (a new file renamed over it).
    client.append(&b, &long).expect("append");
    let digest_a = client.info(&a).unwrap().get_logits_digest();
    let digest_b = client.info(&b).unwrap().get_logits_digest();
    let filler = disk.fill();

    // A new session: its journal cannot be created.
    let refused = client.try_create().expect_err("a full disk");
    assert_eq!(refused.0, RpcStatusCode::UNAVAILABLE, "{refused:?}");
    assert!(refused.1.contains("No space left"), "{}", refused.1);

    // An append: UNAVAILABLE, and nothing changed.
    let err = client
        .append(&a, &history(2, 3000))
        .expect_err("a full disk");
    assert_eq!(err.0, RpcStatusCode::UNAVAILABLE, "{err:?}");
    assert!(err.1.contains("No space left"), "the reason: {}", err.1);
    let info = client.info(&a).unwrap();
    assert_eq!(
        (info.get_history_length(), info.get_logits_digest()),
        (50, digest_a)
    );
    // A truncating append (a rewrite): the same.
    let err = client.append(&b, &history(3, 200)).expect_err("full");
    assert_eq!(err.0, RpcStatusCode::UNAVAILABLE, "{err:?}");
    let info = restored(&client, &b);
    assert_eq!(
        (info.get_history_length(), info.get_logits_digest()),
        (4000, digest_b)
    );
    // A Generate: its tokens may have streamed, but its end fails and the
    // session holds what it held.
    let got = client.generate(&support::greedy(&a, 30, 0));
    let err = got.error.expect("the Generate fails");
    assert_eq!(err.0, i32::from(RpcStatusCode::UNAVAILABLE), "{err:?}");
    let info = restored(&client, &a);
    assert_eq!(
        (info.get_history_length(), info.get_logits_digest()),
        (50, digest_a)
    );
    // New durable sessions are refused with the reason; health and the
    // metrics say so.
    let refused = client.try_create().expect_err("no new durable session");
    assert_eq!(refused.0, RpcStatusCode::UNAVAILABLE, "{refused:?}");
    assert_eq!(health(&server.addr), Serving::NOT_SERVING);
    assert_eq!(metric(&server, "inferd_state_dir_writable"), 0.0);
    assert!(metric(&server, "inferd_session_journal_failures_total") >= 3.0);

    // Space comes back: found within the probe's interval, no restart.
    std::fs::remove_file(&filler).unwrap();
    wait_for("health SERVING again", Duration::from_secs(10), || {
        health(&server.addr) == Serving::SERVING
    });
    assert_eq!(metric(&server, "inferd_state_dir_writable"), 1.0);
    client
        .append(&a, &long[50..60])
        .expect("append after space came back");
    let c = client.create();
    client.append(&c, &long[..20]).expect("append");

    // A spill that finds its disk full: the session evicted keeps only its
    // history, and is computed again, to the same bits, when called.
    spill_disk.fill();
    let d = client.create();
    client.append(&d, &long[..10]).expect("append");
    assert_eq!(metric(&server, "inferd_session_spilled_total"), 1.0);
    assert_eq!(metric(&server, "inferd_session_spill_bytes"), 0.0);
    let mut truths = vec![
        (a.clone(), long[..60].to_vec()),
        (b.clone(), long.clone()),
        (c.clone(), long[..20].to_vec()),
    ];
    for (id, truth) in &mut truths {
        truth.push(7);
        client
            .append(id, &[7])
            .expect("append to a spilled or resident session");
        let info = client.info(id).unwrap();
        assert_eq!(info.get_logits_digest(), cold_digest(&reference, truth));
    }

    // Nothing acknowledged is lost, nothing refused is kept.
    server.kill();
    let server = serve_with(&model, &state, "sync", &[]);
    let client = Client::connect(&server.addr);
    for (id, truth) in &truths {
        let info = restored(&client, id);
        assert_eq!(info.get_history_length(), truth.len() as u64);
        assert_eq!(info.get_logits_digest(), cold_digest(&reference, truth));
    }
    drop(server);
}

/// Builds the preload shim that fails I/O on command.
fn fault_shim(dir: &Path) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/faults/fail_io.c");
    let out = dir.join("libfail_io.so");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&out)
        .arg(&source)
        .arg("-ldl")
        .status()
        .expect("run cc");
    assert!(status.success(), "building the fault shim");
    out
}

/// A server whose state directory's disk fails on command: the preload
/// shim, steered by writing words to `control` (tests/faults/fail_io.c).
struct FailingDisk {
    _dir: tempfile::TempDir,
    model: PathBuf,
    state: PathBuf,
    control: PathBuf,
    _reference_server: inferd::server::Server,
    reference: Client,
    server: Inferd,
}

impl FailingDisk {
    fn start(durability: &str) -> FailingDisk {
        let dir = tempfile::tempdir().expect("temp dir");
        let model = write_model(dir.path());
        let state = dir.path().join("state");
        let shim = fault_shim(dir.path());
        let control = dir.path().join("faults");
        let (reference_server, reference) = reference_server();
        let envs = [
            ("LD_PRELOAD".to_owned(), shim.display().to_string()),
            ("INFERD_FAULTS".to_owned(), control.display().to_string()),
        ];
        let extra = ["--metrics-listen", "127.0.0.1:0"];
        let server = serve_env(&model, &state, durability, &extra, &envs);
        FailingDisk {
            _dir: dir,
            model,
            state,
            control,
            _reference_server: reference_server,
            reference,
            server,
        }
    }

    /// Kills the server and starts one without the shim on the same
    /// directory: `session` must hold `truth`, to the bit.
    fn restart_and_check(&mut self, session: &str, truth: &[u32]) {
        self.server.kill();
        let server = serve_with(&self.model, &self.state, "sync", &[]);
        let client = Client::connect(&server.addr);
        let info = restored(&client, session);
        assert_eq!(info.get_history_length(), truth.len() as u64);
        assert_eq!(
            info.get_logits_digest(),
            cold_digest(&self.reference, truth)
        );
    }
}

/// A disk that fails fsync or write (`sync`): the call fails UNAVAILABLE
/// and nothing changes; once it works again the journal is written whole
/// (a failed fsync may have dropped what the kernel held), and a SIGKILL
/// after it loses nothing acknowledged.
#[test]
fn a_failing_sync_or_write_fails_the_call_and_the_journal_is_written_whole_after() {
    let mut disk = FailingDisk::start("sync");
    let client = Client::connect(&disk.server.addr);
    let a = client.create();
    let h = history(4, 200);
    client.append(&a, &h[..20]).expect("append");
    let digest = client.info(&a).unwrap().get_logits_digest();
    for fault in ["fsync", "write-eio", "write-enospc"] {
        std::fs::write(&disk.control, fault).unwrap();
        let err = client.append(&a, &h[20..40]).expect_err(fault);
        assert_eq!(err.0, RpcStatusCode::UNAVAILABLE, "{fault}: {err:?}");
        let got = client.generate(&support::greedy(&a, 8, 0));
        assert_eq!(
            got.error.map(|e| e.0),
            Some(i32::from(RpcStatusCode::UNAVAILABLE)),
            "{fault}"
        );
        let info = restored(&client, &a);
        assert_eq!(
            (info.get_history_length(), info.get_logits_digest()),
            (20, digest),
            "{fault}"
        );
        assert_eq!(health(&disk.server.addr), Serving::NOT_SERVING, "{fault}");
        let refused = client.try_create().expect_err(fault);
        assert_eq!(refused.0, RpcStatusCode::UNAVAILABLE);
        std::fs::remove_file(&disk.control).unwrap();
        wait_for("health SERVING again", Duration::from_secs(10), || {
            health(&disk.server.addr) == Serving::SERVING
        });
    }
    client
        .append(&a, &h[20..40])
        .expect("append once the disk works");
    // Written whole: the header and one reset holding the history.
    let bytes = std::fs::read(journal_path(&disk.state, &a)).unwrap();
    let kinds: Vec<u8> = records(&bytes).iter().map(|r| r.2).collect();
    assert_eq!(kinds, vec![2], "one reset");
    client.append(&a, &h[40..50]).expect("append");
    assert!(metric(&disk.server, "inferd_session_journal_failures_total") >= 6.0);
    disk.restart_and_check(&a, &h[..50]);
}

/// `batch`: a flush that fails cannot fail calls already answered; it is
/// counted, health says so, and the session's next change writes its
/// journal whole. A SIGKILL (the page cache survives it) loses nothing.
#[test]
fn a_failed_batch_flush_is_not_forgotten() {
    let mut disk = FailingDisk::start("batch");
    let client = Client::connect(&disk.server.addr);
    let a = client.create();
    let h = history(5, 100);
    client.append(&a, &h[..20]).expect("append");
    std::fs::write(&disk.control, "fsync").unwrap();
    let failures = metric(&disk.server, "inferd_state_dir_write_failures_total");
    client
        .append(&a, &h[20..30])
        .expect("batch: answered before the flush");
    wait_for("the failed flush seen", Duration::from_secs(5), || {
        health(&disk.server.addr) == Serving::NOT_SERVING
    });
    assert_eq!(metric(&disk.server, "inferd_state_dir_writable"), 0.0);
    std::fs::remove_file(&disk.control).unwrap();
    wait_for("health SERVING again", Duration::from_secs(10), || {
        health(&disk.server.addr) == Serving::SERVING
    });
    client.append(&a, &h[30..40]).expect("append");
    let bytes = std::fs::read(journal_path(&disk.state, &a)).unwrap();
    let kinds: Vec<u8> = records(&bytes).iter().map(|r| r.2).collect();
    assert_eq!(kinds, vec![2], "written whole after the failed flush");
    assert!(metric(&disk.server, "inferd_state_dir_write_failures_total") > failures);
    std::thread::sleep(Duration::from_millis(50));
    disk.restart_and_check(&a, &h[..40]);
}
