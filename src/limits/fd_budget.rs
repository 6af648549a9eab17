//! The process's file-descriptor budget: how many descriptors the server
//! may hold at once with its configuration, checked against
//! `RLIMIT_NOFILE` before it starts.
//!
//! The budget is a sum of parts, each bounded by a setting: connections
//! (the HTTP limit, the metrics endpoint's table, the room left for gRPC
//! connections), journals (one open file per durable session, live or
//! spilled), the files a worker opens for a moment (a spill file, a
//! journal being rewritten), and a fixed reserve for what the process
//! itself holds (standard streams, the state lock, event loops, the
//! signal pipe, a GPU driver's files).
//!
//! When the budget is over the soft limit, the soft limit is raised (up to
//! the hard limit, which an unprivileged process may do). When it is over
//! the hard limit too, the server refuses to start, naming the numbers and
//! the settings that lower them: a server that starts anyway fails later,
//! at the busiest moment, with `EMFILE` on whatever opens a file next (a
//! session's journal, a connection). Lowering a limit behind the
//! operator's back instead would hide the misconfiguration until then.

use std::fmt;
use std::io;

/// One part of the budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// What holds the descriptors.
    pub what: String,
    pub count: u64,
    /// The setting that lowers it, if one does.
    pub lowered_by: Option<&'static str>,
}

/// The descriptors a configuration may hold at once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FdBudget {
    pub parts: Vec<Part>,
}

impl FdBudget {
    /// Adds a part (nothing when `count` is 0).
    pub fn add(&mut self, what: impl Into<String>, count: u64, lowered_by: Option<&'static str>) {
        if count > 0 {
            self.parts.push(Part {
                what: what.into(),
                count,
                lowered_by,
            });
        }
    }

    pub fn total(&self) -> u64 {
        self.parts
            .iter()
            .fold(0u64, |sum, p| sum.saturating_add(p.count))
    }

    /// Checks the budget against this process's `RLIMIT_NOFILE`, raising
    /// the soft limit to the hard one when the budget needs it.
    pub fn ensure(&self) -> Result<FdFit, FdBudgetError> {
        let (soft, hard) = nofile_limit().map_err(|e| self.refusal(0, 0, Some(e)))?;
        let needed = self.total();
        match plan(needed, soft, hard) {
            Plan::Fits => Ok(FdFit::Fits { needed, soft }),
            Plan::Raise(to) => match set_soft_limit(to, hard) {
                Ok(()) => Ok(FdFit::Raised {
                    needed,
                    from: soft,
                    to,
                }),
                Err(e) => Err(self.refusal(soft, hard, Some(e))),
            },
            Plan::Refuse => Err(self.refusal(soft, hard, None)),
        }
    }

    fn refusal(&self, soft: u64, hard: u64, os: Option<io::Error>) -> FdBudgetError {
        FdBudgetError {
            needed: self.total(),
            soft,
            hard,
            parts: self.parts.clone(),
            os: os.map(|e| e.to_string()),
        }
    }
}

impl fmt::Display for FdBudget {
    /// `1234 (512 HTTP connections + ...)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (", self.total())?;
        for (i, p) in self.parts.iter().enumerate() {
            if i > 0 {
                f.write_str(" + ")?;
            }
            write!(f, "{} {}", p.count, p.what)?;
        }
        f.write_str(")")
    }
}

/// How the budget fits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FdFit {
    /// Under the soft limit as it was.
    Fits { needed: u64, soft: u64 },
    /// The soft limit was raised from `from` to `to` (the hard limit).
    Raised { needed: u64, from: u64, to: u64 },
}

/// The budget is over the hard limit (or the limit could not be read or
/// raised).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FdBudgetError {
    pub needed: u64,
    pub soft: u64,
    pub hard: u64,
    pub parts: Vec<Part>,
    /// The system call's error, when one failed.
    pub os: Option<String>,
}

impl std::error::Error for FdBudgetError {}

impl fmt::Display for FdBudgetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let budget = FdBudget {
            parts: self.parts.clone(),
        };
        if let Some(os) = &self.os {
            return write!(
                f,
                "cannot check the file-descriptor budget {budget} against RLIMIT_NOFILE: {os}"
            );
        }
        write!(
            f,
            "this configuration may hold {budget} file descriptors at once, more than the \
             hard limit of {} (RLIMIT_NOFILE, soft {}); raise the limit (`ulimit -n`, \
             systemd LimitNOFILE=) or lower",
            self.hard, self.soft
        )?;
        let mut flags: Vec<&str> = self.parts.iter().filter_map(|p| p.lowered_by).collect();
        flags.dedup();
        if flags.is_empty() {
            return f.write_str(" nothing: no setting lowers it");
        }
        write!(f, " {}", flags.join(", "))
    }
}

/// What to do with a budget of `needed` under limits `soft` and `hard`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    Fits,
    /// Raise the soft limit to this (the hard limit: the budget is an
    /// estimate, and the room past it costs nothing).
    Raise(u64),
    Refuse,
}

fn plan(needed: u64, soft: u64, hard: u64) -> Plan {
    if needed <= soft {
        Plan::Fits
    } else if needed <= hard {
        Plan::Raise(hard)
    } else {
        Plan::Refuse
    }
}

/// `RLIMIT_NOFILE` as (soft, hard); unlimited reads as `u64::MAX`.
// `rlim_t` is 64 bits on most targets but not all (32-bit glibc).
#[allow(clippy::useless_conversion)]
pub fn nofile_limit() -> io::Result<(u64, u64)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit struct for the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let value = |v: libc::rlim_t| {
        if v == libc::RLIM_INFINITY {
            u64::MAX
        } else {
            u64::try_from(v).unwrap_or(u64::MAX)
        }
    };
    Ok((value(limit.rlim_cur), value(limit.rlim_max)))
}

#[allow(clippy::useless_conversion)]
fn set_soft_limit(soft: u64, hard: u64) -> io::Result<()> {
    let raw = |v: u64| {
        if v == u64::MAX {
            libc::RLIM_INFINITY
        } else {
            libc::rlim_t::try_from(v).unwrap_or(libc::RLIM_INFINITY)
        }
    };
    let limit = libc::rlimit {
        rlim_cur: raw(soft),
        rlim_max: raw(hard),
    };
    // SAFETY: `limit` is a valid rlimit struct the call only reads.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> FdBudget {
        let mut b = FdBudget::default();
        b.add("HTTP connections", 512, Some("--http-max-connections"));
        b.add("session journals", 0, Some("--max-sessions"));
        b.add("reserved for the process", 64, None);
        b
    }

    #[test]
    fn the_total_is_the_sum_of_the_parts_left_non_empty() {
        let b = budget();
        assert_eq!(b.total(), 576);
        assert_eq!(b.parts.len(), 2, "an empty part is left out");
        assert_eq!(
            b.to_string(),
            "576 (512 HTTP connections + 64 reserved for the process)"
        );
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one_only_when_needed() {
        assert_eq!(plan(576, 1024, 4096), Plan::Fits);
        assert_eq!(plan(1024, 1024, 4096), Plan::Fits);
        assert_eq!(plan(2000, 1024, 4096), Plan::Raise(4096));
        assert_eq!(plan(2000, 1024, u64::MAX), Plan::Raise(u64::MAX));
        assert_eq!(plan(5000, 1024, 4096), Plan::Refuse);
    }

    #[test]
    fn the_refusal_names_the_numbers_and_the_flags() {
        let err = FdBudgetError {
            needed: 576,
            soft: 256,
            hard: 256,
            parts: budget().parts,
            os: None,
        };
        let text = err.to_string();
        for needle in [
            "576",
            "512 HTTP connections",
            "hard limit of 256",
            "--http-max-connections",
        ] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
    }

    #[test]
    fn this_process_has_a_limit_and_a_small_budget_fits_it() {
        let (soft, hard) = nofile_limit().expect("getrlimit");
        assert!(soft <= hard && soft > 0);
        let mut b = FdBudget::default();
        b.add("a few", 8, None);
        assert_eq!(b.ensure(), Ok(FdFit::Fits { needed: 8, soft }));
    }
}
