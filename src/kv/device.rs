//! Pages whose K and V live outside this process's memory (a GPU's): the
//! pool keeps allocating, counting and sharing them, and asks the store
//! to move their bytes when a fork copies, a spill reads or a restore writes.

use std::fmt;

use super::KvError;

/// Where a pool's page bytes live when not in a host map. Page `p` holds
/// `page_bytes` bytes laid out as a host page (see `pool.rs`).
pub trait PageStore: Send + Sync {
    /// Copies page `page`'s K and V bytes into `out` (the page's length).
    fn read(&self, page: u32, out: &mut [u8]) -> Result<(), KvError>;
    /// Overwrites page `page`'s K and V bytes with `bytes`.
    fn write(&self, page: u32, bytes: &[u8]) -> Result<(), KvError>;
    /// Copies page `from` over page `to`.
    fn copy(&self, from: u32, to: u32) -> Result<(), KvError>;
    /// Where the pages are, for logs.
    fn describe(&self) -> String;
}

impl fmt::Debug for dyn PageStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}
