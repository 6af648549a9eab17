//! One session's open journal file and what every journal of a store
//! shares: writing a record durably as the policy says, cutting a failed
//! write back and rewriting the file whole after one, and the `batch`
//! flusher that syncs a window's journals together.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::budget::Budget;
use super::health::StateHealth;
use super::hints::HintsFile;
use super::journal::{self, PageHints, Record};
use super::private;
use super::store::BATCH_WINDOW;
use crate::base::Durability;

/// A journal written and waiting for the `batch` flusher, with the flag
/// that tells its journal a flush failed.
pub(super) type PendingFlush = (Arc<File>, Arc<AtomicBool>);

/// Flushes written journals in groups (`batch`).
pub(super) struct Flusher {
    pub(super) pending: Mutex<(Vec<PendingFlush>, bool)>,
    pub(super) wake: Condvar,
}

/// What every journal file of the store shares.
pub(super) struct Shared {
    pub(super) dir: PathBuf,
    pub(super) durability: Durability,
    pub(super) flusher: Option<Arc<Flusher>>,
    pub(super) health: Arc<StateHealth>,
    /// Journal bytes are counted here as they are written and removed.
    pub(super) budget: Budget,
}

impl Shared {
    /// Makes `file`'s writes durable as the policy says (`flush_failed` is
    /// set if a later `batch` flush of it fails).
    pub(super) fn commit(
        &self,
        file: &Arc<File>,
        flush_failed: &Arc<AtomicBool>,
    ) -> std::io::Result<()> {
        match self.durability {
            Durability::Sync => file.sync_data(),
            Durability::Batch => {
                if let Some(flusher) = &self.flusher {
                    let mut pending = flusher.pending.lock().unwrap_or_else(|p| p.into_inner());
                    pending.0.push((Arc::clone(file), Arc::clone(flush_failed)));
                    flusher.wake.notify_one();
                }
                Ok(())
            }
            Durability::None => Ok(()),
        }
    }

    /// Makes a file's creation or removal durable (`sync` only).
    pub(super) fn commit_dir(&self) -> std::io::Result<()> {
        if self.durability == Durability::Sync {
            File::open(&self.dir)?.sync_all()?;
        }
        Ok(())
    }
}

/// One session's open journal.
#[derive(Debug)]
pub struct JournalFile {
    pub(super) file: Arc<File>,
    pub(super) path: PathBuf,
    /// The header's bytes, for rewriting the file at a reset.
    pub(super) header: Vec<u8>,
    /// Bytes in the file (whole records only).
    pub(super) len: u64,
    /// A write or sync failed: what is on disk is not known to be the
    /// history, so the next change writes the file whole.
    pub(super) rewrite_next: bool,
    /// Set by the `batch` flusher when a flush of this file failed.
    pub(super) flush_failed: Arc<AtomicBool>,
    /// The page hints and digests beside it.
    pub(super) hints: HintsFile,
    pub(super) shared: Arc<SharedHandle>,
}

/// `Shared` behind a `Debug` that prints nothing of it.
pub(super) struct SharedHandle(pub(super) Shared);

impl std::fmt::Debug for SharedHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionStore")
    }
}

impl JournalFile {
    /// Adds a history record, durable as the store's policy says;
    /// `history` is the whole history with the record applied. A reset
    /// holds the whole history, so nothing before it is needed any more:
    /// the file is replaced (a new file renamed over it) by the header and
    /// the reset alone, which keeps a journal within about twice its
    /// history however often a long session's window moves. So is a
    /// journal whose last write or flush failed.
    ///
    /// On an error nothing of the record stays in the file (unless cutting
    /// it back failed too; then the next change rewrites the file before
    /// anything can follow it), and the caller must not acknowledge the
    /// change.
    pub fn append(&mut self, record: &Record, history: &[u32]) -> std::io::Result<()> {
        let flush_failed = self.flush_failed.swap(false, Ordering::AcqRel);
        let result = if flush_failed || self.rewrite_next || matches!(record, Record::Reset(_)) {
            self.rewrite(history)
        } else {
            self.add(record)
        };
        match &result {
            Ok(()) => {
                self.rewrite_next = false;
                self.shared.0.health.succeeded();
            }
            Err(e) => {
                self.rewrite_next = true;
                self.shared.0.health.failed("writing a session journal", e);
            }
        }
        result
    }

    /// Appends one record and commits it; on an error, cuts the file back.
    pub(super) fn add(&mut self, record: &Record) -> std::io::Result<()> {
        let bytes = journal::encode_record(record);
        let written = (&*self.file)
            .write_all(&bytes)
            .and_then(|()| self.shared.0.commit(&self.file, &self.flush_failed));
        match written {
            Ok(()) => {
                self.len += bytes.len() as u64;
                self.shared.0.budget.grew(bytes.len() as u64);
                Ok(())
            }
            Err(e) => {
                // A restart must not read back a change the caller is told
                // failed (a kill leaves the page cache as it is).
                let _ = self.file.set_len(self.len);
                Err(e)
            }
        }
    }

    /// Bytes in the file.
    pub fn file_bytes(&self) -> u64 {
        self.len
    }

    /// Records where full pages of the history lie (a hint: not synced,
    /// and losing it costs only a recompute).
    pub fn hint_pages(&mut self, hints: &PageHints) -> std::io::Result<()> {
        self.with_hints(|file| file.pages(hints))
    }

    /// Records the logits digest of `history` (a hint, like pages).
    pub fn hint_digest(&mut self, history: &[u32], digest: u64) -> std::io::Result<()> {
        self.with_hints(|file| file.digest(history, digest))
    }

    /// Bytes of hints written since they were last cleared.
    pub fn hint_bytes(&self) -> u64 {
        self.hints.file_bytes()
    }

    /// Throws the hints away: the next ones start afresh.
    pub fn clear_hints(&mut self) {
        let _ = self.with_hints(|file| {
            file.clear();
            Ok(())
        });
    }

    /// Does `what` to the hints file, its change of size counted in the
    /// budget like the journal's.
    pub(super) fn with_hints(
        &mut self,
        what: impl FnOnce(&mut HintsFile) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let before = self.hints.file_bytes();
        let done = what(&mut self.hints);
        let after = self.hints.file_bytes();
        let budget = &self.shared.0.budget;
        budget.grew(after.saturating_sub(before));
        budget.shrank(before.saturating_sub(after));
        done
    }

    pub(super) fn rewrite(&mut self, history: &[u32]) -> std::io::Result<()> {
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".new");
        let tmp = PathBuf::from(tmp);
        let reset = journal::encode_record(&Record::Reset(history.to_vec()));
        let written = (|| {
            let mut file = create_file(&tmp)?;
            file.write_all(&self.header)?;
            file.write_all(&reset)?;
            if self.shared.0.durability == Durability::Sync {
                file.sync_data()?;
            }
            std::fs::rename(&tmp, &self.path)?;
            private::options().append(true).open(&self.path)
        })();
        let file = match written {
            Ok(file) => file,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        self.file = Arc::new(file);
        self.shared.0.budget.shrank(self.len);
        self.len = (self.header.len() + reset.len()) as u64;
        self.shared.0.budget.grew(self.len);
        // The hints described the history the file held before.
        self.clear_hints();
        if self.shared.0.durability == Durability::Batch {
            self.shared.0.commit(&self.file, &self.flush_failed)?;
        }
        self.shared.0.commit_dir()
    }

    /// Deletes the journal: the session is gone for good.
    pub fn remove(mut self) -> std::io::Result<()> {
        self.clear_hints();
        std::fs::remove_file(&self.path)?;
        self.shared.0.budget.shrank(self.len);
        self.shared.0.commit_dir()
    }

    /// Closes the journal and leaves it on disk (the session goes on
    /// existing there, to be restored by a later start).
    pub fn keep(self) {}
}

/// Creates (or empties) a file of the state directory, readable by its
/// owner alone and never through a symbolic link.
pub(super) fn create_file(path: &Path) -> std::io::Result<File> {
    private::options()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)
}

/// The `batch` flusher: waits for written journals, lets a window's worth
/// gather, and syncs each once. A sync that fails cannot be retried (the
/// kernel may have dropped what it could not write): the journal is told,
/// and its next change rewrites it whole; until then the changes of that
/// window survive a killed process but not a power cut.
pub(super) fn flush_loop(flusher: &Flusher, health: &StateHealth) {
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
        for (file, failed) in &files {
            let key = Arc::as_ptr(file);
            if seen.contains(&key) {
                continue;
            }
            seen.push(key);
            match file.sync_data() {
                Ok(()) => health.succeeded(),
                Err(e) => {
                    failed.store(true, Ordering::Release);
                    health.failed("flushing a session journal", &e);
                }
            }
        }
        if stop {
            return;
        }
        std::thread::sleep(BATCH_WINDOW);
    }
}
