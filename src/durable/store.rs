//! The state directory's session journals: one file per session under
//! `DIR/sessions/`, named by its id, written by the worker that owns the
//! session and read back at start-up. How soon a write is on disk is the
//! [`Durability`]: `sync` makes it durable (data and, for a new or removed
//! file, the directory) before the call that made it is answered; `batch`
//! leaves that to a flusher thread every [`BATCH_WINDOW`]; `none` to the
//! operating system.
//!
//! The directory is locked (`DIR/lock`) for as long as the store is open,
//! so two servers never write one directory. Its directories and files are
//! the server user's alone ([`super::private`]), and what its journals and
//! spill files hold is counted against its [`Budget`].
//!
//! A write that fails (a full disk, an I/O error, a failed sync) is taken
//! back before the error goes to the caller: the file is cut back to its
//! last whole record, and since a failed sync may have let the kernel drop
//! what it held unwritten, the journal's next change rewrites it whole from
//! the history in memory. The failure is reported to [`StateHealth`].

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use thiserror::Error;

use super::budget::{self, Budget, Limits, Refusal};
use super::health::StateHealth;
use super::hints::{self, HintsFile};
use super::journal::{self, Header, JournalError, PageHint, Record};
pub use super::journal_file::JournalFile;
use super::journal_file::{flush_loop, Flusher, Shared, SharedHandle};
use super::private::{self, PermissionError};
use crate::base::{Durability, SessionId, Tenant};

/// How long `batch` durability lets writes wait for their flush.
pub const BATCH_WINDOW: Duration = Duration::from_millis(5);

/// Why the state directory cannot be used.
#[derive(Debug, Error)]
pub enum StoreError {
    #[error("state directory {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("state directory {0} is in use by another inferd process")]
    Locked(String),
    #[error("state directory: {0}")]
    Permissions(#[from] PermissionError),
}

/// A session's journal that could not be restored, and why.
#[derive(Debug)]
pub struct Refused {
    pub path: PathBuf,
    pub reason: String,
}

/// A session read back from its journal.
#[derive(Debug)]
pub struct Recovered {
    pub id: SessionId,
    pub label: String,
    pub eos: Vec<u32>,
    /// The tenant it belongs to (none for a journal written before
    /// sessions had owners).
    pub owner: Tenant,
    pub history: Vec<u32>,
    /// What the journal says of where the history's full pages lie.
    pub hints: Vec<Box<[PageHint]>>,
    /// The history's logits digest, if the journal recorded it.
    pub digest: Option<u64>,
    /// The session's spill file from the last run, and its bytes.
    pub spill: Option<(PathBuf, u64)>,
    /// The pages verified against `hints` and claimed for this session, one
    /// row per block from block 0, `None` for a sliding-window layer's page
    /// no later position reads (filled in by `pages::adopt_verified`).
    pub pages: Vec<Box<[Option<u32>]>>,
    pub journal: JournalFile,
    /// Bytes of a torn last write dropped from the end.
    pub torn_bytes: usize,
}

/// The state directory's journals.
pub struct SessionStore {
    shared: Arc<SharedHandle>,
    /// The state directory itself (journals are in its `sessions/`).
    root: PathBuf,
    model_sha256: [u8; 32],
    _lock: File,
    flusher_thread: Option<JoinHandle<()>>,
    probe_thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for SessionStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SessionStore({}, {:?})",
            self.shared.0.dir.display(),
            self.shared.0.durability
        )
    }
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl SessionStore {
    /// Opens (creating) `dir` for sessions of the model whose file hashes
    /// to `model_sha256`, and locks it, with the default [`Limits`].
    pub fn open(
        dir: &Path,
        model_sha256: [u8; 32],
        durability: Durability,
    ) -> Result<Self, StoreError> {
        Self::open_limited(dir, model_sha256, durability, Limits::default())
    }

    /// Opens (creating, private) `dir` for sessions of the model whose
    /// file hashes to `model_sha256`, and locks it; what its sessions hold
    /// on disk is kept within `limits`. A directory another user owns or
    /// may write is refused.
    pub fn open_limited(
        dir: &Path,
        model_sha256: [u8; 32],
        durability: Durability,
        limits: Limits,
    ) -> Result<Self, StoreError> {
        private::state_dir(dir)?;
        let sessions = dir.join("sessions");
        private::inner_dir(&sessions)?;
        let spill = dir.join("spill");
        private::inner_dir(&spill)?;
        let lock_path = dir.join("lock");
        let lock = super::lock_directory(dir)
            .map_err(io_error(&lock_path))?
            .ok_or_else(|| StoreError::Locked(dir.display().to_string()))?;
        let flusher = (durability == Durability::Batch).then(|| {
            Arc::new(Flusher {
                pending: Mutex::new((Vec::new(), false)),
                wake: Condvar::new(),
            })
        });
        let health = StateHealth::new();
        let flusher_thread = match &flusher {
            Some(f) => {
                let f = Arc::clone(f);
                let health = Arc::clone(&health);
                Some(
                    std::thread::Builder::new()
                        .name("inferd-journal-flush".into())
                        .spawn(move || flush_loop(&f, &health))
                        .map_err(io_error(dir))?,
                )
            }
            None => None,
        };
        let probe_thread = Some(
            health
                .start_probe(sessions.clone())
                .map_err(io_error(dir))?,
        );
        let budget = Budget::new(dir, limits);
        budget.set_used(budget::measure(&[sessions.clone(), spill]));
        Ok(SessionStore {
            shared: Arc::new(SharedHandle(Shared {
                dir: sessions,
                durability,
                flusher,
                health,
                budget,
            })),
            root: dir.to_owned(),
            model_sha256,
            _lock: lock,
            flusher_thread,
            probe_thread,
        })
    }

    /// The durability policy in force.
    pub fn durability(&self) -> Durability {
        self.shared.0.durability
    }

    /// Whether the directory takes writes right now.
    pub fn health(&self) -> &Arc<StateHealth> {
        &self.shared.0.health
    }

    /// What the directory's sessions hold on disk, against its limits.
    pub fn budget(&self) -> &Budget {
        &self.shared.0.budget
    }

    /// Whether new durable work that writes about `bytes` (0: not known)
    /// may start ([`Budget::admit`]).
    pub fn admit(&self, bytes: u64) -> Result<(), Refusal> {
        self.shared.0.budget.admit(bytes)
    }

    /// Where a spilled session's KV pages are written out.
    pub fn spill_path(&self, id: SessionId) -> PathBuf {
        self.root.join("spill").join(format!("{id}.kv"))
    }

    /// The file that backs the KV page pool, so that pages outlive the
    /// process (the journals' hints say which page holds what).
    pub fn page_file(&self) -> PathBuf {
        self.root.join("kv.pages")
    }

    fn path_of(&self, id: SessionId) -> PathBuf {
        self.shared.0.dir.join(format!("{id}.journal"))
    }

    fn hints_of(&self, id: SessionId) -> HintsFile {
        let path = self.shared.0.dir.join(format!("{id}.hints"));
        HintsFile::new(path, id.bytes(), 0)
    }

    /// Starts the journal of a new session of `owner` (with `history` as
    /// its first record when it has one: a fork). Refused at once, with the
    /// last failure's reason, while the directory is failing writes.
    pub fn create(
        &self,
        id: SessionId,
        label: &str,
        eos: &[u32],
        owner: &Tenant,
        history: &[u32],
    ) -> std::io::Result<JournalFile> {
        let health = &self.shared.0.health;
        health.check().map_err(std::io::Error::other)?;
        let path = self.path_of(id);
        let file = private::options()
            .create_new(true)
            .append(true)
            .open(&path)
            .inspect_err(|e| {
                // Out of descriptors says nothing of the directory.
                if !matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
                    health.failed("creating a session journal", e);
                }
            })?;
        let header = journal::encode_header(&Header {
            model_sha256: self.model_sha256,
            session: id.bytes(),
            eos: eos.to_vec(),
            label: label.to_owned(),
            owner: owner.clone(),
        });
        let mut bytes = header.clone();
        if !history.is_empty() {
            bytes.extend(journal::encode_record(&Record::Reset(history.to_vec())));
        }
        let written = (&file).write_all(&bytes);
        let file = Arc::new(file);
        let journal = JournalFile {
            file,
            path,
            header,
            len: bytes.len() as u64,
            rewrite_next: false,
            flush_failed: Arc::new(AtomicBool::new(false)),
            hints: self.hints_of(id),
            shared: Arc::clone(&self.shared),
        };
        // Counted now: a failed write's `remove` below gives it back.
        self.shared.0.budget.grew(journal.len);
        let committed = written
            .and_then(|()| self.shared.0.commit(&journal.file, &journal.flush_failed))
            .and_then(|()| self.shared.0.commit_dir());
        match committed {
            Ok(()) => {
                health.succeeded();
                Ok(journal)
            }
            Err(e) => {
                health.failed("creating a session journal", &e);
                let _ = journal.remove();
                Err(e)
            }
        }
    }

    /// Reads every journal back. A journal that cannot be trusted (damaged,
    /// another model's, another format, tokens this model does not have, a
    /// history longer than its context) is renamed `*.refused` and reported;
    /// a torn last write is cut off (and reported in `torn_bytes`).
    pub fn recover(&self, vocab: usize, context: usize) -> (Vec<Recovered>, Vec<Refused>) {
        let mut recovered = Vec::new();
        let mut refused = Vec::new();
        let entries = match std::fs::read_dir(&self.shared.0.dir) {
            Ok(entries) => entries,
            Err(e) => {
                refused.push(Refused {
                    path: self.shared.0.dir.clone(),
                    reason: format!("cannot list: {e}"),
                });
                return (recovered, refused);
            }
        };
        let all: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        // A rewrite the crash cut off before its rename: the old journal
        // is still whole.
        for unfinished in all
            .iter()
            .filter(|p| p.extension().is_some_and(|x| x == "new"))
        {
            let _ = std::fs::remove_file(unfinished);
        }
        // Hints of a session whose journal is gone (or refused) describe
        // nothing.
        for orphan in all.iter().filter(|p| {
            p.extension().is_some_and(|x| x == "hints") && !p.with_extension("journal").exists()
        }) {
            let _ = std::fs::remove_file(orphan);
        }
        let mut paths: Vec<PathBuf> = all
            .into_iter()
            .filter(|p| p.extension().is_some_and(|x| x == "journal"))
            .collect();
        paths.sort();
        for path in paths {
            match self.recover_one(&path, vocab, context) {
                Ok(session) => recovered.push(session),
                Err(reason) => {
                    let mut kept = path.clone().into_os_string();
                    kept.push(".refused");
                    let _ = std::fs::rename(&path, &kept);
                    let _ = std::fs::remove_file(path.with_extension("hints"));
                    refused.push(Refused { path, reason });
                }
            }
        }
        // A session spilled when the last run ended reads its pages back
        // from its spill file; files of no session restored are deleted.
        let spill_dir = self.root.join("spill");
        for session in &mut recovered {
            let path = self.spill_path(session.id);
            if let Ok(meta) = std::fs::metadata(&path) {
                session.spill = Some((path, meta.len()));
            }
        }
        if let Ok(entries) = std::fs::read_dir(&spill_dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                let owned = recovered
                    .iter()
                    .any(|s| s.spill.as_ref().is_some_and(|(p, _)| *p == path));
                if !owned {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        // Refused journals are kept for inspection, but not without end.
        for gone in budget::trim_refused(&self.shared.0.dir) {
            tracing::info!(path = %gone.display(), kept = budget::KEEP_REFUSED, "deleted an old refused journal");
        }
        self.shared
            .0
            .budget
            .set_used(budget::measure(&[self.shared.0.dir.clone(), spill_dir]));
        (recovered, refused)
    }

    fn recover_one(&self, path: &Path, vocab: usize, context: usize) -> Result<Recovered, String> {
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
        let id = SessionId::parse(name).map_err(|_| "the file name is not a session id")?;
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
        let replayed = journal::replay(&bytes).map_err(|e: JournalError| e.to_string())?;
        let header = &replayed.header;
        if header.session != id.bytes() {
            return Err("the journal names another session".into());
        }
        if header.model_sha256 != self.model_sha256 {
            return Err("written for another model file (its SHA-256 differs)".into());
        }
        if let Some(bad) = replayed.history.iter().find(|&&t| t as usize >= vocab) {
            return Err(format!(
                "token {bad} is outside this model's vocabulary of {vocab}"
            ));
        }
        if replayed.history.len() > context {
            return Err(format!(
                "a history of {} tokens exceeds this model's context of {context}",
                replayed.history.len()
            ));
        }
        let file = private::options()
            .append(true)
            .open(path)
            .map_err(|e| format!("cannot open for writing: {e}"))?;
        // A torn tail is cut off before anything is appended after it (it
        // would turn into damage in the middle). Cutting it may need no
        // space, but if it fails the session still comes back: its next
        // change rewrites the file whole.
        let mut rewrite_next = false;
        if replayed.torn_bytes > 0 {
            if let Err(e) = file
                .set_len(replayed.good_len as u64)
                .and_then(|()| file.sync_data())
            {
                tracing::warn!(journal = %path.display(), "cannot cut the torn tail yet: {e}");
                rewrite_next = true;
            }
        }
        // Hints and the digest: from the file beside the journal, or, for a
        // journal written before they moved there, from the journal.
        let mut hints_file = self.hints_of(id);
        let (hints, digest) = match std::fs::read(path.with_extension("hints")) {
            Ok(side) => {
                let hinted = hints::read(&side, &id.bytes());
                let digest = hinted.digest_of(&replayed.history);
                hints_file =
                    HintsFile::new(path.with_extension("hints"), id.bytes(), side.len() as u64);
                (hinted.hints, digest)
            }
            Err(_) => (replayed.hints, replayed.digest),
        };
        Ok(Recovered {
            id,
            label: header.label.clone(),
            eos: header.eos.clone(),
            owner: header.owner.clone(),
            history: replayed.history,
            hints,
            digest,
            spill: None,
            pages: Vec::new(),
            journal: JournalFile {
                file: Arc::new(file),
                path: path.to_owned(),
                header: bytes[..replayed.header_len].to_vec(),
                len: replayed.good_len as u64,
                rewrite_next,
                flush_failed: Arc::new(AtomicBool::new(false)),
                hints: hints_file,
                shared: Arc::clone(&self.shared),
            },
            torn_bytes: replayed.torn_bytes,
        })
    }
}

impl Drop for SessionStore {
    fn drop(&mut self) {
        self.shared.0.health.stop_probe();
        if let Some(thread) = self.probe_thread.take() {
            let _ = thread.join();
        }
        if let Some(flusher) = &self.shared.0.flusher {
            let mut pending = flusher.pending.lock().unwrap_or_else(|p| p.into_inner());
            pending.1 = true;
            flusher.wake.notify_one();
        }
        if let Some(thread) = self.flusher_thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable::journal::PageHints;

    fn store(dir: &Path, durability: Durability) -> SessionStore {
        SessionStore::open(dir, [3; 32], durability).expect("open")
    }

    #[test]
    fn journals_come_back_and_a_reset_rewrites_the_file_to_itself() {
        let dir = tempfile::tempdir().unwrap();
        let id = SessionId::random().unwrap();
        let hint = |page| -> Box<[PageHint]> { [PageHint { page, checksum: 9 }].into() };
        for durability in [Durability::Sync, Durability::Batch, Durability::None] {
            let path = {
                let store = store(dir.path(), durability);
                let mut journal = store.create(id, "l", &[2], &Tenant::NONE, &[]).unwrap();
                let mut history = Vec::new();
                for k in 0..50u32 {
                    history.extend([k, k + 1]);
                    journal
                        .append(&Record::Append(vec![k, k + 1]), &history)
                        .unwrap();
                }
                let grown = std::fs::metadata(&journal.path).unwrap().len();
                journal
                    .append(&Record::Reset(vec![7, 8, 9]), &[7, 8, 9])
                    .unwrap();
                journal
                    .append(&Record::Append(vec![10]), &[7, 8, 9, 10])
                    .unwrap();
                let expected = journal.header.len()
                    + journal::encode_record(&Record::Reset(vec![7, 8, 9])).len()
                    + journal::encode_record(&Record::Append(vec![10])).len();
                let now = std::fs::metadata(&journal.path).unwrap().len();
                assert_eq!(now as usize, expected);
                assert!(now < grown);
                assert_eq!(journal.file_bytes(), now);
                // Hints and digests go beside the journal, not into it.
                journal
                    .hint_pages(&PageHints {
                        first_block: 0,
                        n_layers: 1,
                        blocks: vec![hint(4)],
                    })
                    .unwrap();
                journal.hint_digest(&[7, 8, 9, 10], 1234).unwrap();
                assert_eq!(std::fs::metadata(&journal.path).unwrap().len(), now);
                assert!(journal.hint_bytes() > 0);
                journal.path.clone()
            };
            // A rewrite cut off before its rename leaves a stray file.
            let mut stray = path.clone().into_os_string();
            stray.push(".new");
            std::fs::write(&stray, b"half").unwrap();
            let store = store(dir.path(), durability);
            let (mut back, refused) = store.recover(100, 100);
            assert!(refused.is_empty(), "{refused:?}");
            assert_eq!(back.len(), 1);
            let session = back.pop().unwrap();
            assert_eq!(session.id, id);
            assert_eq!(session.history, vec![7, 8, 9, 10]);
            assert_eq!(session.hints, vec![hint(4)]);
            assert_eq!(session.digest, Some(1234));
            assert_eq!(
                session.journal.file_bytes(),
                std::fs::metadata(&path).unwrap().len()
            );
            assert_eq!(
                (session.label.as_str(), session.eos.as_slice()),
                ("l", &[2][..])
            );
            assert!(!PathBuf::from(stray).exists());
            session.journal.remove().unwrap();
            assert!(!path.with_extension("hints").exists());
        }
    }

    /// Hints written unsynced and then lost, torn or garbled never cost
    /// the history: the journal comes back whole, the hints up to the
    /// damage.
    #[test]
    fn damaged_hints_cost_only_the_hints() {
        let dir = tempfile::tempdir().unwrap();
        let id = SessionId::random().unwrap();
        let path = {
            let store = store(dir.path(), Durability::Sync);
            let mut journal = store.create(id, "l", &[], &Tenant::NONE, &[]).unwrap();
            journal
                .append(&Record::Append(vec![1, 2]), &[1, 2])
                .unwrap();
            journal
                .hint_pages(&PageHints {
                    first_block: 0,
                    n_layers: 1,
                    blocks: vec![[PageHint {
                        page: 3,
                        checksum: 4,
                    }]
                    .into()],
                })
                .unwrap();
            journal.hint_digest(&[1, 2], 77).unwrap();
            journal.path.clone()
        };
        let side = path.with_extension("hints");
        let mut bytes = std::fs::read(&side).unwrap();
        let n = bytes.len();
        bytes[n - 5] ^= 0xff;
        bytes.extend([0u8; 300]);
        std::fs::write(&side, &bytes).unwrap();
        let store = store(dir.path(), Durability::Sync);
        let (back, refused) = store.recover(100, 100);
        assert!(refused.is_empty());
        assert_eq!(back[0].history, vec![1, 2]);
        assert_eq!(back[0].hints.len(), 1);
        assert_eq!(back[0].digest, None);
    }

    /// A write the disk refused is taken back: the file holds what it held
    /// before, the directory is reported failing (new journals refused with
    /// the reason), and the next change writes the journal whole.
    #[test]
    fn a_failed_write_leaves_the_file_as_it_was_and_the_next_change_rewrites_it() {
        let dir = tempfile::tempdir().unwrap();
        let id = SessionId::random().unwrap();
        let store = store(dir.path(), Durability::Sync);
        let mut journal = store.create(id, "l", &[], &Tenant::NONE, &[]).unwrap();
        journal
            .append(&Record::Append(vec![1, 2]), &[1, 2])
            .unwrap();
        let before = std::fs::read(&journal.path).unwrap();
        // A file that takes no writes stands for a disk that takes none.
        let good = std::mem::replace(
            &mut journal.file,
            Arc::new(File::open(&journal.path).unwrap()),
        );
        assert!(journal
            .append(&Record::Append(vec![3]), &[1, 2, 3])
            .is_err());
        assert_eq!(std::fs::read(&journal.path).unwrap(), before);
        assert!(store.health().check().is_err());
        let other = SessionId::random().unwrap();
        assert!(store.create(other, "x", &[], &Tenant::NONE, &[]).is_err());
        journal.file = good;
        journal
            .append(&Record::Append(vec![4]), &[1, 2, 4])
            .unwrap();
        assert!(store.health().check().is_ok());
        // Written whole: the header and one reset.
        let now = std::fs::read(&journal.path).unwrap();
        let reset = journal::encode_record(&Record::Reset(vec![1, 2, 4]));
        assert_eq!(now.len(), journal.header.len() + reset.len());
        assert_eq!(journal::replay(&now).unwrap().history, vec![1, 2, 4]);
        assert_eq!(store.health().failures(), 1);
    }

    #[test]
    fn files_are_private_and_a_link_planted_at_a_rewrite_is_not_followed() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: umask has no preconditions; 022 is the usual default.
        unsafe { libc::umask(0o022) };
        let root = dir.path().join("state");
        let store = store(&root, Durability::Sync);
        let id = SessionId::random().unwrap();
        let mut journal = store.create(id, "l", &[], &Tenant::NONE, &[]).unwrap();
        journal
            .append(&Record::Append(vec![1, 2]), &[1, 2])
            .unwrap();
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o777;
        for d in [&root, &root.join("sessions"), &root.join("spill")] {
            assert_eq!(mode(d), 0o700, "{}", d.display());
        }
        for f in [&journal.path, &root.join("lock")] {
            assert_eq!(mode(f), 0o600, "{}", f.display());
        }
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"keep").unwrap();
        let mut new = journal.path.clone().into_os_string();
        new.push(".new");
        std::os::unix::fs::symlink(&target, &new).unwrap();
        assert!(journal.append(&Record::Reset(vec![3]), &[3]).is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert_eq!(
            std::fs::metadata(&target).unwrap().permissions().mode() & 0o777,
            0o644
        );
        // The journal is as it was.
        drop(journal);
        drop(store);
        let store = super::SessionStore::open(&root, [3; 32], Durability::Sync).unwrap();
        let (back, refused) = store.recover(100, 100);
        assert!(refused.is_empty(), "{refused:?}");
        assert_eq!(back[0].history, vec![1, 2]);
    }

    #[test]
    fn journals_and_spill_files_are_counted_against_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let limits = Limits {
            max_bytes: Some(1 << 20),
            min_free_bytes: 0,
        };
        let store =
            SessionStore::open_limited(dir.path(), [3; 32], Durability::None, limits).unwrap();
        assert_eq!(store.budget().used(), 0);
        let id = SessionId::random().unwrap();
        let mut journal = store.create(id, "l", &[], &Tenant::NONE, &[]).unwrap();
        journal
            .append(&Record::Append(vec![1; 100]), &[1; 100])
            .unwrap();
        assert_eq!(store.budget().used(), journal.file_bytes());
        journal
            .append(&Record::Reset(vec![2; 10]), &[2; 10])
            .unwrap();
        assert_eq!(store.budget().used(), journal.file_bytes());
        std::fs::write(store.spill_path(id), vec![0; 1000]).unwrap();
        std::fs::write(dir.path().join("sessions/x.journal.refused"), vec![0; 500]).unwrap();
        let held = journal.file_bytes();
        drop(journal);
        drop(store);
        // A start counts what it finds.
        let store =
            SessionStore::open_limited(dir.path(), [3; 32], Durability::None, limits).unwrap();
        assert_eq!(store.budget().used(), held + 1500);
        let (mut back, _) = store.recover(100, 100);
        assert_eq!(store.budget().used(), held + 1500);
        back.pop().unwrap().journal.remove().unwrap();
        assert_eq!(store.budget().used(), 1500);
        assert!(store.admit((1 << 20) - 1500).is_ok());
        assert_eq!(
            store.admit((1 << 20) - 1499),
            Err(Refusal::Budget {
                used: 1500,
                max: 1 << 20
            })
        );
    }

    #[test]
    fn a_locked_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _first = store(dir.path(), Durability::Sync);
        assert!(matches!(
            SessionStore::open(dir.path(), [3; 32], Durability::Sync),
            Err(StoreError::Locked(_))
        ));
    }
}
