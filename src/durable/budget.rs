//! How much of the disk a state directory may take: a budget of bytes for
//! what grows with the sessions (journals, spill files and the refused
//! journals kept for inspection; `--max-state-mib`) and a floor of free
//! space on its filesystem (`--min-free-mib`) below which no new durable
//! work starts, so that the disk is never filled by the server and what
//! is written before the floor is reached always has room.
//!
//! The page file (`kv.pages`) is not counted: its blocks are reserved
//! whole when the server starts, so it never grows.
//!
//! Both are checked when durable work is admitted (a new session or fork,
//! an append or a Generate on a journaled session, a spill), never in the
//! middle of one: a call admitted just under the budget may take it over
//! by what that one call writes, and nothing admitted fails for the
//! budget's sake. Closing sessions and finished spills give bytes back.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use thiserror::Error;

use crate::base::free_bytes;

/// The free-space floor unless set: enough for the journal records of the
/// calls in flight and for the filesystem's own needs.
pub const DEFAULT_MIN_FREE_BYTES: u64 = 64 << 20;

/// `*.refused` journals kept at most; a start deletes the oldest (by
/// modification time) beyond them.
pub const KEEP_REFUSED: usize = 16;

/// The limits of one state directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of journals, spill files and refused journals at most
    /// (`None`: no budget).
    pub max_bytes: Option<u64>,
    /// Bytes that must stay free on the filesystem (0: no floor).
    pub min_free_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: None,
            min_free_bytes: DEFAULT_MIN_FREE_BYTES,
        }
    }
}

/// Why new durable work was refused. Nothing was written for it.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum Refusal {
    #[error(
        "the state directory's budget is spent: {used} bytes of journals and spill files, \
         {max} allowed (--max-state-mib); close sessions to free it"
    )]
    Budget { used: u64, max: u64 },
    #[error(
        "the state directory's filesystem has {free} bytes free, below the floor of {floor} \
         (--min-free-mib); free space on it"
    )]
    FreeSpace { free: u64, floor: u64 },
}

impl Refusal {
    /// The reason's label in metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Budget { .. } => "budget",
            Refusal::FreeSpace { .. } => "free_space",
        }
    }
}

/// What the budget has seen, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BudgetStats {
    /// Bytes of journals, spill files and refused journals now.
    pub used_bytes: u64,
    /// Work refused because the budget was spent.
    pub refused_budget: u64,
    /// Work refused because free space was below the floor.
    pub refused_free_space: u64,
}

/// The bytes a state directory's sessions hold on disk, against its limits.
#[derive(Debug)]
pub struct Budget {
    /// Where free space is asked about (a directory on the filesystem).
    probe: PathBuf,
    limits: Limits,
    used: AtomicU64,
    refused_budget: AtomicU64,
    refused_free_space: AtomicU64,
}

impl Budget {
    pub fn new(probe: &Path, limits: Limits) -> Budget {
        Budget {
            probe: probe.to_owned(),
            limits,
            used: AtomicU64::new(0),
            refused_budget: AtomicU64::new(0),
            refused_free_space: AtomicU64::new(0),
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Whether new work that writes about `bytes` (0 when not known
    /// beforehand) may start; a refusal is counted.
    pub fn admit(&self, bytes: u64) -> Result<(), Refusal> {
        let refused = self.check(bytes);
        match &refused {
            Err(Refusal::Budget { .. }) => self.refused_budget.fetch_add(1, Ordering::Relaxed),
            Err(Refusal::FreeSpace { .. }) => {
                self.refused_free_space.fetch_add(1, Ordering::Relaxed)
            }
            Ok(()) => 0,
        };
        refused
    }

    fn check(&self, bytes: u64) -> Result<(), Refusal> {
        if let Some(max) = self.limits.max_bytes {
            let used = self.used();
            if used.saturating_add(bytes.max(1)) > max {
                return Err(Refusal::Budget { used, max });
            }
        }
        let floor = self.limits.min_free_bytes;
        if floor > 0 {
            // A filesystem that cannot say is not refused for it: writing
            // to it will say more.
            if let Ok(free) = free_bytes(&self.probe) {
                if free < floor.saturating_add(bytes) {
                    return Err(Refusal::FreeSpace { free, floor });
                }
            }
        }
        Ok(())
    }

    /// `bytes` more are held on disk.
    pub fn grew(&self, bytes: u64) {
        self.used.fetch_add(bytes, Ordering::Relaxed);
    }

    /// `bytes` fewer are held on disk.
    pub fn shrank(&self, bytes: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                Some(u.saturating_sub(bytes))
            });
    }

    /// What a count of the files found (`measure`) says is held.
    pub fn set_used(&self, bytes: u64) {
        self.used.store(bytes, Ordering::Relaxed);
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> BudgetStats {
        BudgetStats {
            used_bytes: self.used(),
            refused_budget: self.refused_budget.load(Ordering::Relaxed),
            refused_free_space: self.refused_free_space.load(Ordering::Relaxed),
        }
    }
}

/// Bytes of the plain files directly in each of `dirs` (what a start
/// finds held; a directory that cannot be listed counts nothing).
pub fn measure(dirs: &[PathBuf]) -> u64 {
    dirs.iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flat_map(|entries| entries.flatten())
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// Deletes the oldest `*.refused` files in `dir` beyond [`KEEP_REFUSED`];
/// returns their paths.
pub fn trim_refused(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut refused: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "refused"))
        .filter_map(|p| {
            let meta = std::fs::symlink_metadata(&p).ok()?;
            Some((meta.modified().unwrap_or(std::time::UNIX_EPOCH), p))
        })
        .collect();
    if refused.len() <= KEEP_REFUSED {
        return Vec::new();
    }
    // Newest first; ties by name so the order is the same every time.
    refused.sort_by(|a, b| b.cmp(a));
    refused
        .split_off(KEEP_REFUSED)
        .into_iter()
        .filter_map(|(_, p)| std::fs::remove_file(&p).ok().map(|()| p))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_refuses_once_spent_and_counts_why() {
        let dir = tempfile::tempdir().unwrap();
        let budget = Budget::new(
            dir.path(),
            Limits {
                max_bytes: Some(1000),
                min_free_bytes: 0,
            },
        );
        budget.grew(900);
        assert_eq!(budget.admit(100), Ok(()));
        assert_eq!(
            budget.admit(101),
            Err(Refusal::Budget {
                used: 900,
                max: 1000
            })
        );
        budget.grew(100);
        assert!(budget.admit(0).is_err());
        budget.shrank(5000);
        assert_eq!(budget.used(), 0);
        assert_eq!(budget.admit(0), Ok(()));
        assert_eq!(budget.stats().refused_budget, 2);
        assert_eq!(budget.stats().refused_free_space, 0);
    }

    #[test]
    fn the_floor_refuses_below_free_space() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        let budget = Budget::new(
            dir.path(),
            Limits {
                max_bytes: None,
                min_free_bytes: free.saturating_mul(2).max(1 << 40),
            },
        );
        let refused = budget.admit(0).unwrap_err();
        assert_eq!(refused.reason(), "free_space");
        assert!(refused.to_string().contains("--min-free-mib"), "{refused}");
        assert_eq!(budget.stats().refused_free_space, 1);
        let open = Budget::new(
            dir.path(),
            Limits {
                max_bytes: None,
                min_free_bytes: 0,
            },
        );
        assert_eq!(open.admit(u64::MAX), Ok(()));
    }

    #[test]
    fn refused_journals_beyond_the_kept_number_go_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        let base = std::time::SystemTime::now() - std::time::Duration::from_secs(10_000);
        for k in 0..KEEP_REFUSED + 3 {
            let path = dir.path().join(format!("{k:02}.journal.refused"));
            std::fs::write(&path, b"x").unwrap();
            let file = std::fs::File::options().write(true).open(&path).unwrap();
            file.set_modified(base + std::time::Duration::from_secs(k as u64))
                .unwrap();
        }
        std::fs::write(dir.path().join("a.journal"), b"kept").unwrap();
        let mut gone = trim_refused(dir.path());
        gone.sort();
        let names: Vec<String> = gone
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "00.journal.refused",
                "01.journal.refused",
                "02.journal.refused"
            ]
        );
        assert_eq!(measure(&[dir.path().to_owned()]), KEEP_REFUSED as u64 + 4);
        assert!(trim_refused(dir.path()).is_empty());
    }
}
