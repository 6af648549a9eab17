//! The crate's one loom switch. Code that threads share (the KV page
//! allocator, the eviction board, the decode-rate buckets, the awaitable
//! reply channels) takes its atomics, `Arc`, waker and bounded channel
//! from here and nowhere else. Under `--cfg loom` they are loom's
//! model-checked types, so `tests/loom` checks the very code that runs in
//! production; otherwise they are std's, futures' and crossbeam's.

#[cfg(loom)]
mod loom_channel;

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub use loom::sync::Arc;
#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub use std::sync::Arc;

/// A bounded multi-producer channel: crossbeam's, or a loom model of it
/// with the same API and error types.
pub mod channel {
    #[cfg(loom)]
    pub use super::loom_channel::{bounded, Receiver, Sender};
    #[cfg(not(loom))]
    pub use crossbeam_channel::{bounded, Receiver, Sender};
}

#[cfg(not(loom))]
use futures_util::task::AtomicWaker as Inner;
#[cfg(loom)]
use loom::future::AtomicWaker as Inner;

/// A task waker one side registers and the other wakes, lock-free.
#[derive(Debug, Default)]
pub struct AtomicWaker(Inner);

impl AtomicWaker {
    pub fn new() -> Self {
        AtomicWaker(Inner::new())
    }

    /// Registers `waker` to be woken by the next [`AtomicWaker::wake`].
    pub fn register(&self, waker: &std::task::Waker) {
        #[cfg(loom)]
        self.0.register_by_ref(waker);
        #[cfg(not(loom))]
        self.0.register(waker);
    }

    /// Wakes the registered task, if any.
    pub fn wake(&self) {
        self.0.wake();
    }
}
