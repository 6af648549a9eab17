//! Whether the state directory can be written right now. Every journal
//! write reports here how it went; after a failure (a full disk, an I/O
//! error, a failed sync) new durable sessions are refused, the server's
//! health says NOT_SERVING, and a probe thread tries a small synced write
//! every second, so the directory is found writable again without a restart
//! once space is back (a journal write that succeeds says so too).

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the probe tries the directory while it is failing.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Bytes the probe writes and syncs: room for an ordinary call's records.
const PROBE_BYTES: usize = 64 * 1024;

/// Told whenever the directory turns writable (`true`) or not (`false`).
pub type HealthListener = Box<dyn Fn(bool) + Send + Sync>;

/// The state directory's writability, shared by every journal.
pub struct StateHealth {
    failing: AtomicBool,
    /// What the last failure said.
    reason: Mutex<String>,
    /// Writes that failed since the start (journal writes and syncs,
    /// `batch` flushes; the probe's tries are not counted).
    failures: AtomicU64,
    listeners: Mutex<Vec<HealthListener>>,
    /// Wakes the probe (a failure, or the store closing).
    wake: Condvar,
    stop: Mutex<bool>,
}

impl std::fmt::Debug for StateHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateHealth")
            .field("failing", &self.failing.load(Ordering::Relaxed))
            .finish()
    }
}

impl StateHealth {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(StateHealth {
            failing: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
            failures: AtomicU64::new(0),
            listeners: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            stop: Mutex::new(false),
        })
    }

    /// `Err(why)` while writes to the directory are failing.
    pub fn check(&self) -> Result<(), String> {
        if self.failing.load(Ordering::Acquire) {
            Err(self
                .reason
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone())
        } else {
            Ok(())
        }
    }

    /// Whether the directory is taking writes.
    pub fn writable(&self) -> bool {
        !self.failing.load(Ordering::Acquire)
    }

    /// Failed writes since the start.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Calls `listener` on every change from now on.
    pub fn listen(&self, listener: HealthListener) {
        self.listeners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(listener);
    }

    /// A write failed with `error`.
    pub(super) fn failed(&self, what: &str, error: &std::io::Error) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        *self.reason.lock().unwrap_or_else(|p| p.into_inner()) =
            format!("the state directory cannot be written ({what}: {error})");
        if !self.failing.swap(true, Ordering::AcqRel) {
            tracing::error!("state directory failing, durable work is refused until it is writable: {what}: {error}");
            self.tell(false);
            let _stop = self.stop.lock().unwrap_or_else(|p| p.into_inner());
            self.wake.notify_all();
        }
    }

    /// A write went through.
    pub(super) fn succeeded(&self) {
        if self.failing.swap(false, Ordering::AcqRel) {
            tracing::warn!("state directory writable again");
            self.tell(true);
        }
    }

    fn tell(&self, writable: bool) {
        for listener in self
            .listeners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            listener(writable);
        }
    }

    /// Starts the probe of `dir` (the sessions directory).
    pub(super) fn start_probe(self: &Arc<Self>, dir: PathBuf) -> std::io::Result<JoinHandle<()>> {
        let health = Arc::clone(self);
        std::thread::Builder::new()
            .name("inferd-state-probe".into())
            .spawn(move || health.probe_loop(&dir))
    }

    /// Stops the probe thread.
    pub(super) fn stop_probe(&self) {
        *self.stop.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.wake.notify_all();
    }

    fn probe_loop(&self, dir: &std::path::Path) {
        let path = dir.join(".probe");
        let mut stop = self.stop.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if *stop {
                return;
            }
            if !self.failing.load(Ordering::Acquire) {
                stop = self.wake.wait(stop).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            stop = self
                .wake
                .wait_timeout(stop, PROBE_INTERVAL)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if *stop || !self.failing.load(Ordering::Acquire) {
                continue;
            }
            drop(stop);
            if probe(&path).is_ok() {
                self.succeeded();
            }
            stop = self.stop.lock().unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Writes and syncs a file of [`PROBE_BYTES`], then deletes it.
fn probe(path: &std::path::Path) -> std::io::Result<()> {
    let written = (|| {
        let mut file = super::private::options()
            .create(true)
            .truncate(true)
            .write(true)
            .open(path)?;
        file.write_all(&[0u8; PROBE_BYTES])?;
        file.sync_data()
    })();
    let _ = std::fs::remove_file(path);
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_told_once_and_the_probe_finds_the_directory_again() {
        let dir = tempfile::tempdir().unwrap();
        let health = StateHealth::new();
        let told = Arc::new(Mutex::new(Vec::new()));
        let t = Arc::clone(&told);
        health.listen(Box::new(move |w| t.lock().unwrap().push(w)));
        let probe = health.start_probe(dir.path().to_owned()).unwrap();
        assert!(health.check().is_ok());
        let e = std::io::Error::from_raw_os_error(libc::ENOSPC);
        health.failed("append", &e);
        health.failed("append", &e);
        let why = health.check().unwrap_err();
        assert!(why.contains("No space left"), "{why}");
        assert_eq!(health.failures(), 2);
        // The directory is writable: the probe says so within its interval.
        let start = std::time::Instant::now();
        while !health.writable() && start.elapsed() < 5 * PROBE_INTERVAL {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(health.writable());
        assert_eq!(*told.lock().unwrap(), vec![false, true]);
        assert!(!dir.path().join(".probe").exists());
        health.stop_probe();
        probe.join().unwrap();
    }
}
