//! The state directory's session journals: one file per session under
//! `DIR/sessions/`, named by its id, written by the worker that owns the
//! session and read back at start-up. How soon a write is on disk is the
//! [`Durability`]: `sync` makes it durable (data and, for a new or removed
//! file, the directory) before the call that made it is answered; `batch`
//! leaves that to a flusher thread every [`BATCH_WINDOW`]; `none` to the
//! operating system.
//!
//! The directory is locked (`DIR/lock`) for as long as the store is open,
//! so two servers never write one directory.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use thiserror::Error;

use super::journal::{self, Header, JournalError, PageHint, Record};
use crate::runtime::{SessionId, Tenant};

/// How long `batch` durability lets writes wait for their flush.
pub const BATCH_WINDOW: Duration = Duration::from_millis(5);

/// When a journal write is on disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// Before the call is answered: nothing acknowledged is ever lost.
    #[default]
    Sync,
    /// Within [`BATCH_WINDOW`] after it (group commit).
    Batch,
    /// When the operating system writes it back.
    None,
}

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

/// Flushes written journals in groups (`batch`).
struct Flusher {
    pending: Mutex<(Vec<Arc<File>>, bool)>,
    wake: Condvar,
}

/// What every journal file of the store shares.
struct Shared {
    dir: PathBuf,
    durability: Durability,
    flusher: Option<Arc<Flusher>>,
}

impl Shared {
    /// Makes `file`'s writes durable as the policy says.
    fn commit(&self, file: &Arc<File>) -> std::io::Result<()> {
        match self.durability {
            Durability::Sync => file.sync_data(),
            Durability::Batch => {
                if let Some(flusher) = &self.flusher {
                    let mut pending = flusher.pending.lock().unwrap_or_else(|p| p.into_inner());
                    pending.0.push(Arc::clone(file));
                    flusher.wake.notify_one();
                }
                Ok(())
            }
            Durability::None => Ok(()),
        }
    }

    /// Makes a file's creation or removal durable (`sync` only).
    fn commit_dir(&self) -> std::io::Result<()> {
        if self.durability == Durability::Sync {
            File::open(&self.dir)?.sync_all()?;
        }
        Ok(())
    }
}

/// One session's open journal.
#[derive(Debug)]
pub struct JournalFile {
    file: Arc<File>,
    path: PathBuf,
    /// The header's bytes, for rewriting the file at a reset.
    header: Vec<u8>,
    /// Bytes in the file (whole records only).
    len: u64,
    shared: Arc<SharedHandle>,
}

/// `Shared` behind a `Debug` that prints nothing of it.
struct SharedHandle(Shared);

impl std::fmt::Debug for SharedHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionStore")
    }
}

impl JournalFile {
    /// Adds a record, durable as the store's policy says. A reset holds the
    /// whole history, so nothing before it is needed any more: the file is
    /// replaced (a new file renamed over it) by the header and the reset
    /// alone, which keeps a journal within about twice its history however
    /// often a long session's window moves.
    pub fn append(&mut self, record: &Record) -> std::io::Result<()> {
        if let Record::Reset(_) = record {
            return self.rewrite(record);
        }
        let bytes = journal::encode_record(record);
        (&*self.file).write_all(&bytes)?;
        self.len += bytes.len() as u64;
        match record {
            // A hint is never waited for: losing one costs a recompute.
            Record::Pages(_) | Record::Digest(_) => Ok(()),
            _ => self.shared.0.commit(&self.file),
        }
    }

    /// Bytes in the file: what a caller weighs against what the history
    /// needs, to rewrite a journal that hints made long.
    pub fn file_bytes(&self) -> u64 {
        self.len
    }

    fn rewrite(&mut self, reset: &Record) -> std::io::Result<()> {
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".new");
        let tmp = PathBuf::from(tmp);
        let written = (|| {
            let mut file = OpenOptions::new()
                .create(true)
                .truncate(true)
                .write(true)
                .open(&tmp)?;
            file.write_all(&self.header)?;
            file.write_all(&journal::encode_record(reset))?;
            if self.shared.0.durability == Durability::Sync {
                file.sync_data()?;
            }
            std::fs::rename(&tmp, &self.path)?;
            OpenOptions::new().append(true).open(&self.path)
        })();
        match written {
            Ok(file) => {
                self.file = Arc::new(file);
                self.len = (self.header.len() + journal::encode_record(reset).len()) as u64;
                if self.shared.0.durability == Durability::Batch {
                    self.shared.0.commit(&self.file)?;
                }
                self.shared.0.commit_dir()
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Deletes the journal: the session is gone for good.
    pub fn remove(self) -> std::io::Result<()> {
        std::fs::remove_file(&self.path)?;
        self.shared.0.commit_dir()
    }

    /// Closes the journal and leaves it on disk (the session goes on
    /// existing there, to be restored by a later start).
    pub fn keep(self) {}
}

/// The state directory's journals.
pub struct SessionStore {
    shared: Arc<SharedHandle>,
    /// The state directory itself (journals are in its `sessions/`).
    root: PathBuf,
    model_sha256: [u8; 32],
    _lock: File,
    flusher_thread: Option<JoinHandle<()>>,
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
    /// to `model_sha256`, and locks it.
    pub fn open(
        dir: &Path,
        model_sha256: [u8; 32],
        durability: Durability,
    ) -> Result<Self, StoreError> {
        let sessions = dir.join("sessions");
        std::fs::create_dir_all(&sessions).map_err(io_error(&sessions))?;
        let spill = dir.join("spill");
        std::fs::create_dir_all(&spill).map_err(io_error(&spill))?;
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
        let flusher_thread = match &flusher {
            Some(f) => {
                let f = Arc::clone(f);
                Some(
                    std::thread::Builder::new()
                        .name("inferd-journal-flush".into())
                        .spawn(move || flush_loop(&f))
                        .map_err(io_error(dir))?,
                )
            }
            None => None,
        };
        Ok(SessionStore {
            shared: Arc::new(SharedHandle(Shared {
                dir: sessions,
                durability,
                flusher,
            })),
            root: dir.to_owned(),
            model_sha256,
            _lock: lock,
            flusher_thread,
        })
    }

    /// The durability policy in force.
    pub fn durability(&self) -> Durability {
        self.shared.0.durability
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

    /// Starts the journal of a new session of `owner` (with `history` as
    /// its first record when it has one: a fork).
    pub fn create(
        &self,
        id: SessionId,
        label: &str,
        eos: &[u32],
        owner: &Tenant,
        history: &[u32],
    ) -> std::io::Result<JournalFile> {
        let path = self.path_of(id);
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)?;
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
            shared: Arc::clone(&self.shared),
        };
        let committed = written
            .and_then(|()| self.shared.0.commit(&journal.file))
            .and_then(|()| self.shared.0.commit_dir());
        match committed {
            Ok(()) => Ok(journal),
            Err(e) => {
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
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| format!("cannot open for writing: {e}"))?;
        if replayed.torn_bytes > 0 {
            file.set_len(replayed.good_len as u64)
                .and_then(|()| file.sync_data())
                .map_err(|e| format!("cannot cut the torn tail: {e}"))?;
        }
        Ok(Recovered {
            id,
            label: header.label.clone(),
            eos: header.eos.clone(),
            owner: header.owner.clone(),
            history: replayed.history,
            hints: replayed.hints,
            digest: replayed.digest,
            spill: None,
            pages: Vec::new(),
            journal: JournalFile {
                file: Arc::new(file),
                path: path.to_owned(),
                header: bytes[..replayed.header_len].to_vec(),
                len: replayed.good_len as u64,
                shared: Arc::clone(&self.shared),
            },
            torn_bytes: replayed.torn_bytes,
        })
    }
}

impl Drop for SessionStore {
    fn drop(&mut self) {
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

/// The `batch` flusher: waits for written journals, lets a window's worth
/// gather, and syncs each once.
fn flush_loop(flusher: &Flusher) {
    loop {
        let (files, stop) = {
            let mut pending = flusher.pending.lock().unwrap_or_else(|p| p.into_inner());
            while pending.0.is_empty() && !pending.1 {
                pending = flusher
                    .wake
                    .wait(pending)
                    .unwrap_or_else(|p| p.into_inner());
            }
            (std::mem::take(&mut pending.0), pending.1)
        };
        let mut seen: Vec<*const File> = Vec::new();
        for file in &files {
            let key = Arc::as_ptr(file);
            if seen.contains(&key) {
                continue;
            }
            seen.push(key);
            if let Err(e) = file.sync_data() {
                tracing::error!("flushing a session journal: {e}");
            }
        }
        if stop {
            return;
        }
        std::thread::sleep(BATCH_WINDOW);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(dir: &Path, durability: Durability) -> SessionStore {
        SessionStore::open(dir, [3; 32], durability).expect("open")
    }

    #[test]
    fn journals_come_back_and_a_reset_rewrites_the_file_to_itself() {
        let dir = tempfile::tempdir().unwrap();
        let id = SessionId::random().unwrap();
        for durability in [Durability::Sync, Durability::Batch, Durability::None] {
            let path = {
                let store = store(dir.path(), durability);
                let mut journal = store.create(id, "l", &[2], &Tenant::NONE, &[]).unwrap();
                for k in 0..50u32 {
                    journal.append(&Record::Append(vec![k, k + 1])).unwrap();
                }
                let grown = std::fs::metadata(&journal.path).unwrap().len();
                journal.append(&Record::Reset(vec![7, 8, 9])).unwrap();
                journal.append(&Record::Append(vec![10])).unwrap();
                let expected = journal.header.len()
                    + journal::encode_record(&Record::Reset(vec![7, 8, 9])).len()
                    + journal::encode_record(&Record::Append(vec![10])).len();
                let now = std::fs::metadata(&journal.path).unwrap().len();
                assert_eq!(now as usize, expected);
                assert!(now < grown);
                assert_eq!(journal.file_bytes(), now);
                journal
                    .append(&Record::Pages(journal::PageHints {
                        first_block: 0,
                        n_layers: 1,
                        blocks: vec![[PageHint {
                            page: 4,
                            checksum: 9,
                        }]
                        .into()],
                    }))
                    .unwrap();
                let hinted = std::fs::metadata(&journal.path).unwrap().len();
                assert_eq!(journal.file_bytes(), hinted);
                assert!(hinted > now);
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
            assert_eq!(
                session.hints,
                vec![[PageHint {
                    page: 4,
                    checksum: 9
                }]
                .into()]
            );
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
        }
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
