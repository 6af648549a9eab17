//! The paged KV cache: an mmap-backed slab pool of fixed-size pages handed
//! out by a lock-free allocator, and per-session page tables over it.
//!
//! - [`KvPool`] maps one region (anonymous, or a file when asked) and carves
//!   it into pages; each page holds one layer's K and V as f16 for
//!   `page_positions` positions (layout in [`pool`]).
//! - [`PageAllocator`] is the only structure shared by worker threads: a
//!   tagged-index Treiber stack, model-checked with loom under `tests/loom/`.
//! - [`SessionKv`] is one session's page tables (one per layer):
//!   reservations are all-or-nothing, the committed length never decreases
//!   (INV-2), a sliding-window layer gives back the pages its window left
//!   behind once the session is settled, and [`SessionKv::live_bytes`] is
//!   exactly the K and V kept for the committed positions.
//! - [`PrefixIndex`] lists full pages by the exact tokens before and in
//!   them, so sessions with the same history prefix map one set of pages.

mod alloc;
mod device;
mod error;
pub mod pool;
// Needs libc, which loom builds leave out; they never map a file.
#[cfg(not(loom))]
mod reserve;
// The index is a mutex-guarded map, not part of what loom checks.
#[cfg(not(loom))]
mod prefix;
mod session;

pub use alloc::{PageAllocator, MAX_PAGES};
pub use device::PageStore;
pub use error::KvError;
pub use pool::{KvBacking, KvLayout, KvPool, KvPoolConfig, DEFAULT_PAGE_POSITIONS};
#[cfg(not(loom))]
pub use prefix::{EntryId, PrefixIndex, PrefixMatch, PrefixStats};
pub use session::{KvBlocks, SessionKv};
