//! The small types every layer names: a session's id, the tenant it
//! belongs to, how durably it is kept, and the disk's free room.
//!
//! A leaf: it names nothing else of the crate, so `kv`, `durable`,
//! `cluster` and `runtime` share these without naming each other (the
//! allowed edges are listed in docs/ARCHITECTURE.md and checked by
//! tests/layers.rs).

// Needs libc, which loom builds leave out; they never map or keep files.
#[cfg(not(loom))]
mod disk;
mod durability;
mod id;
mod tenant;

#[cfg(not(loom))]
pub use disk::free_bytes;
pub use durability::Durability;
pub use id::{NoRandomness, NotAnId, SessionId};
pub use tenant::{BadTenant, Tenant};
