//! What keeps the listeners alive when clients or the system push back:
//! back-off after a failed `accept(2)` ([`backoff`]), log lines for
//! repeated failures rate-limited ([`log_limit`]), and the process's
//! file-descriptor budget checked against `RLIMIT_NOFILE` at start
//! ([`fd_budget`]).

pub mod backoff;
pub mod fd_budget;
pub mod log_limit;

pub use backoff::AcceptBackoff;
pub use fd_budget::{FdBudget, FdBudgetError, FdFit};
pub use log_limit::LogLimit;
