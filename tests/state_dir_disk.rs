//! A state directory under disk faults and other users (CONTRACT §2.13),
//! with real `inferd serve` processes: its files are the server user's
//! alone whatever the umask, a directory another user owns or may write is
//! refused, a page file the disk cannot hold refuses the start (instead of
//! a SIGBUS later), a restart on a full disk serves its restored sessions,
//! and the budget and the free-space floor refuse new durable work with a
//! typed error that changes nothing. The disk-full cases run on small
//! tmpfs mounts (root only; skipped with a message otherwise).

#![cfg(unix)]

mod support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use grpcio::RpcStatusCode;
use inferd::gguf::synthetic::SyntheticLlama;
use inferd::proto::kakeya_v1::runtime as pb;
use inferd::quant::GgmlType;
use support::{Client, Inferd};

const VOCAB: u32 = 320;
/// How long a server that refuses to start may take to say so.
const REFUSAL_WITHIN: Duration = Duration::from_secs(60);

fn write_model(dir: &Path) -> PathBuf {
    let path = dir.join("model.gguf");
    let spec = SyntheticLlama {
        weight_type: GgmlType::Q4_1,
        tied_output: true,
        context: 4096,
        ..SyntheticLlama::tiny()
    };
    std::fs::write(&path, spec.build()).expect("write the model");
    path
}

fn args<'a>(model: &'a Path, state: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "1",
        "--model",
        model.to_str().expect("UTF-8 path"),
        "--state-dir",
        state.to_str().expect("UTF-8 path"),
    ];
    args.extend_from_slice(extra);
    args
}

/// Runs `inferd ARGS` that must refuse to start: its exit status and
/// standard error, or a panic if it still runs after [`REFUSAL_WITHIN`].
fn refused_start(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start inferd");
    let end = Instant::now() + REFUSAL_WITHIN;
    loop {
        if let Some(status) = child.try_wait().expect("wait for inferd") {
            let mut stderr = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .expect("stderr")
                .read_to_string(&mut stderr)
                .expect("read stderr");
            return (status, stderr);
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("inferd {args:?} started instead of refusing");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A tmpfs of a few MiB, unmounted however the test ends.
struct Tmpfs {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    /// `None` (with a message) where mounting is not permitted.
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).expect("mount point");
        let mounted = is_root()
            && Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700")])
                .arg("tmpfs")
                .arg(&path)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
        if !mounted {
            eprintln!("\n!!! SKIPPED: cannot mount a tmpfs here (needs root)\n");
            return None;
        }
        Some(Tmpfs { path, _dir: dir })
    }

    /// Writes a file until the filesystem is full; returns its path.
    fn fill(&self) -> PathBuf {
        use std::io::Write;
        let path = self.path.join("filler");
        let mut file = std::fs::File::create(&path).expect("filler");
        let chunk = vec![0x5au8; 4096];
        while file.write_all(&chunk).is_ok() {}
        // The last partial page too.
        while file.write_all(&[1]).is_ok() {}
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

fn mode_of(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .mode()
        & 0o7777
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files
}

/// The session's info once it is no longer busy (a restore feeds first).
fn settled(client: &Client, id: &str) -> pb::GetSessionInfoResponse {
    let t0 = Instant::now();
    loop {
        let info = client.info(id).expect("info");
        if !info.get_busy() {
            return info;
        }
        assert!(t0.elapsed() < support::CALL_TIMEOUT, "{id} still busy");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn history(k: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 13 + k) % VOCAB).collect()
}

#[test]
fn state_files_are_private_under_umask_022_and_another_user_cannot_read_them() {
    let dir = tempfile::tempdir().expect("temp dir");
    // Others may pass through the test's directory: only the server's own
    // modes keep them out of the state directory.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    // Room for two sessions of 200 positions: a third spills the oldest.
    let server = Inferd::start_with(
        &["sh", "-c", "umask 022; exec \"$0\" \"$@\""],
        &args(&model, &state, &["--kv-pages", "30", "--min-free-mib", "0"]),
    );
    let client = Client::connect(&server.addr);
    let ids: Vec<String> = (0..3).map(|_| client.create()).collect();
    for (k, id) in ids.iter().enumerate() {
        client.append(id, &history(k as u32, 200)).expect("append");
    }
    assert_eq!(client.info(&ids[0]).expect("info").get_kv_pages_held(), 0);

    for d in [&state, &state.join("sessions"), &state.join("spill")] {
        assert_eq!(mode_of(d), 0o700, "{}", d.display());
    }
    // A journal and a hints file per session.
    let mut files = files_in(&state.join("sessions"));
    assert_eq!(files.len(), 6, "{files:?}");
    let spilled = files_in(&state.join("spill"));
    assert_eq!(spilled.len(), 1, "{spilled:?}");
    files.extend(spilled);
    files.push(state.join("kv.pages"));
    files.push(state.join("lock"));
    for f in &files {
        assert_eq!(mode_of(f), 0o600, "{}", f.display());
    }

    if !is_root() {
        eprintln!("\n!!! SKIPPED the second-user check: creating one needs root\n");
        return;
    }
    // A second local user (nobody) can neither list the sessions nor read
    // a journal, the page file or a spill file.
    let journal = files[0].to_str().expect("UTF-8").to_owned();
    let sessions = state.join("sessions");
    let pages = state.join("kv.pages");
    let spill = files[3].to_str().expect("UTF-8").to_owned();
    for what in [
        vec!["ls", sessions.to_str().expect("UTF-8")],
        vec!["cat", &journal],
        vec!["cat", pages.to_str().expect("UTF-8")],
        vec!["cat", &spill],
    ] {
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .args(&what)
            .stdin(Stdio::null())
            .output()
            .expect("run setpriv (util-linux)");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what:?} as uid 65534 succeeded");
        assert!(
            out.stdout.is_empty(),
            "{what:?} as uid 65534 read something"
        );
        assert!(stderr.contains("Permission denied"), "{what:?}: {stderr}");
    }
}

#[test]
fn a_state_directory_another_user_may_write_or_owns_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    std::fs::create_dir(&state).expect("state dir");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let (status, stderr) = refused_start(&args(&model, &state, &[]));
    assert!(!status.success());
    assert!(
        stderr.contains(&state.display().to_string())
            && stderr.contains("0777")
            && stderr.contains("writable by group or others"),
        "{stderr}"
    );
    assert!(!state.join("sessions").exists(), "nothing was made in it");

    // Group-writable sessions/ inside a private directory: refused too.
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    std::fs::create_dir(state.join("sessions")).expect("sessions");
    std::fs::set_permissions(
        state.join("sessions"),
        std::fs::Permissions::from_mode(0o770),
    )
    .expect("chmod");
    let (status, stderr) = refused_start(&args(&model, &state, &[]));
    assert!(!status.success());
    assert!(
        stderr.contains("sessions") && stderr.contains("0770"),
        "{stderr}"
    );

    if !is_root() {
        eprintln!("\n!!! SKIPPED the foreign-owner check: chown needs root\n");
        return;
    }
    std::fs::set_permissions(
        state.join("sessions"),
        std::fs::Permissions::from_mode(0o700),
    )
    .expect("chmod");
    std::os::unix::fs::chown(&state, Some(65534), Some(65534)).expect("chown");
    let (status, stderr) = refused_start(&args(&model, &state, &[]));
    assert!(!status.success());
    assert!(stderr.contains("owned by uid 65534"), "{stderr}");
}

#[test]
fn a_page_file_the_disk_cannot_hold_refuses_the_start_with_the_numbers() {
    let Some(disk) = Tmpfs::mount("2m") else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = disk.path.join("state");
    let (status, stderr) = refused_start(&args(
        &model,
        &state,
        &["--kv-mib", "256", "--min-free-mib", "0"],
    ));
    // An exit with the reason, not a signal (SIGBUS is 135) once pages
    // are written.
    assert_eq!(status.code(), Some(1), "{status:?} {stderr}");
    let pages = state.join("kv.pages");
    assert!(
        stderr.contains(&pages.display().to_string())
            && stderr.contains("cannot reserve the 268435456 bytes")
            && stderr.contains("free on its filesystem"),
        "{stderr}"
    );
    assert!(
        !pages.exists(),
        "a page file it could not reserve is removed"
    );
}

#[test]
fn a_restart_on_a_full_disk_serves_its_restored_sessions_and_refuses_new_work_typed() {
    let Some(disk) = Tmpfs::mount("8m") else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = disk.path.join("state");
    let flags = ["--kv-pages", "30", "--min-free-mib", "1"];
    let mut server = Inferd::start(&args(&model, &state, &flags));
    let client = Client::connect(&server.addr);
    let ids: Vec<String> = (0..2).map(|_| client.create()).collect();
    let mut digests = Vec::new();
    for (k, id) in ids.iter().enumerate() {
        client.append(id, &history(k as u32, 100)).expect("append");
        digests.push(client.info(id).expect("info").get_logits_digest());
    }
    server.signal("TERM");
    server.wait_exit(Duration::from_secs(30)).expect("exits");

    let filler = disk.fill();
    let server = Inferd::start(&args(
        &model,
        &state,
        &[&flags[..], &["--metrics-listen", "127.0.0.1:0"]].concat(),
    ));
    let client = Client::connect(&server.addr);
    for (id, digest) in ids.iter().zip(&digests) {
        let info = settled(&client, id);
        assert_eq!(info.get_history_length(), 100, "{id} is back");
        assert_eq!(info.get_logits_digest(), *digest, "{id} has its bits");
    }
    // The disk is below the floor: new durable work is refused, typed, and
    // changes nothing.
    let (code, message) = client.append(&ids[0], &[1, 2, 3]).expect_err("refused");
    assert_eq!(code, RpcStatusCode::RESOURCE_EXHAUSTED, "{message}");
    assert!(message.contains("--min-free-mib"), "{message}");
    let got = client.generate(&support::greedy(&ids[1], 4, 0));
    assert_eq!(
        got.error.as_ref().map(|e| e.0),
        Some(RpcStatusCode::RESOURCE_EXHAUSTED.into()),
        "{got:?}"
    );
    assert!(got.tokens.is_empty());
    let (code, _) = client.try_create().expect_err("refused");
    assert_eq!(code, RpcStatusCode::RESOURCE_EXHAUSTED);
    for id in &ids {
        assert_eq!(settled(&client, id).get_history_length(), 100);
    }
    let text = support::scrape(server.metrics.as_deref().expect("metrics"));
    assert_eq!(
        support::sample(&text, "inferd_state_refused_total{reason=\"free_space\"}"),
        Some(3.0),
        "{text}"
    );

    // Space back: the same server takes the work.
    std::fs::remove_file(filler).expect("free the disk");
    assert_eq!(client.append(&ids[0], &[1, 2, 3]).expect("append"), 103);
    assert!(client.try_create().is_ok());
}

#[test]
fn the_state_budget_refuses_new_durable_work_typed_changing_nothing_until_room_is_freed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let flags = [
        "--max-state-mib",
        "1",
        "--min-free-mib",
        "0",
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    let mut server = Inferd::start(&args(&model, &state, &flags));
    let client = Client::connect(&server.addr);
    let id = client.create();
    client.append(&id, &history(1, 1000)).expect("append");
    server.signal("TERM");
    server.wait_exit(Duration::from_secs(30)).expect("exits");
    let journal = state.join("sessions").join(format!("{id}.journal"));
    let journal_bytes = std::fs::metadata(&journal).expect("journal").len();
    assert!(journal_bytes > 4000, "{journal_bytes}");
    // A refused journal kept from earlier takes all but 2 KiB of the
    // budget: with this session's journal the budget is spent.
    let kept = state
        .join("sessions")
        .join("0123456789abcdef0123456789abcdef.journal.refused");
    std::fs::write(&kept, vec![0u8; (1 << 20) - 2048]).expect("refused journal");

    let server = Inferd::start(&args(&model, &state, &flags));
    let client = Client::connect(&server.addr);
    assert_eq!(settled(&client, &id).get_history_length(), 1000);
    let text = support::scrape(server.metrics.as_deref().expect("metrics"));
    let used = support::sample(&text, "inferd_state_bytes").expect("gauge");
    assert!(used >= ((1 << 20) - 2048 + journal_bytes) as f64, "{used}");

    let (code, message) = client.append(&id, &[5, 6]).expect_err("refused");
    assert_eq!(code, RpcStatusCode::RESOURCE_EXHAUSTED, "{message}");
    assert!(message.contains("--max-state-mib"), "{message}");
    let got = client.generate(&support::greedy(&id, 4, 0));
    assert_eq!(
        got.error.as_ref().map(|e| e.0),
        Some(RpcStatusCode::RESOURCE_EXHAUSTED.into()),
        "{got:?}"
    );
    let (code, _) = client.try_fork(&id, None).expect_err("refused");
    assert_eq!(code, RpcStatusCode::RESOURCE_EXHAUSTED);
    let (code, message) = client.try_create().expect_err("refused");
    assert_eq!(code, RpcStatusCode::RESOURCE_EXHAUSTED, "{message}");
    // Nothing changed: the history, the journal, the sessions on disk.
    assert_eq!(settled(&client, &id).get_history_length(), 1000);
    let journals = files_in(&state.join("sessions"))
        .into_iter()
        .filter(|p| p.extension().is_none_or(|x| x != "hints"))
        .count();
    assert_eq!(journals, 2, "the journal and the refused one");
    let text = support::scrape(server.metrics.as_deref().expect("metrics"));
    assert_eq!(
        support::sample(&text, "inferd_state_refused_total{reason=\"budget\"}"),
        Some(4.0),
        "{text}"
    );

    // Closing the session gives its bytes back: a new one fits.
    client.close(&id).expect("close");
    let fresh = client.try_create().expect("room again");
    client.append(&fresh, &[1, 2, 3]).expect("append");
}

#[test]
fn a_start_keeps_the_newest_refused_journals_and_deletes_the_rest() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let sessions = state.join("sessions");
    std::fs::create_dir_all(&sessions).expect("sessions");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let base = std::time::SystemTime::now() - Duration::from_secs(100_000);
    let name = |k: usize| format!("{k:032x}.journal.refused");
    for k in 0..20 {
        let path = sessions.join(name(k));
        std::fs::write(&path, b"damaged").expect("refused journal");
        let file = std::fs::File::options()
            .write(true)
            .open(&path)
            .expect("open");
        file.set_modified(base + Duration::from_secs(k as u64 * 60))
            .expect("mtime");
    }
    let _server = Inferd::start(&args(&model, &state, &["--min-free-mib", "0"]));
    let left: Vec<String> = files_in(&sessions)
        .iter()
        .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    let newest: Vec<String> = (4..20).map(name).collect();
    assert_eq!(left, newest);
}
