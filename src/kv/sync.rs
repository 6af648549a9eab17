//! The atomics the page allocator is built from, switched to loom's
//! model-checked types when the crate is compiled with `--cfg loom`.
//!
//! The allocator imports atomics only from here, so the loom tests under
//! `tests/loom/` check the very code that runs in production.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
