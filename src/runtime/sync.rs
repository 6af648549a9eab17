//! The atomics the runtime's cross-worker structures are built from,
//! switched to loom's model-checked types under `--cfg loom` so the tests in
//! `tests/loom/` check the very code that runs in production.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};
