//! Sessions that outlive the process (`inferd serve --state-dir DIR`).
//!
//! A session's committed token history is the truth: its KV is a pure
//! function of it (CONTRACT §2.2), so a restart rebuilds the KV from the
//! history and lands on the same bits. Each session has a journal in the
//! state directory ([`journal`] says its bytes, [`store`] where it lives and
//! when it is on disk); the workers write it as calls complete, and
//! `Runtime::start` reads every journal back and feeds each history again
//! before the session takes new calls. The KV pages themselves live in a
//! file there too ([`pages`]): a restart takes back every page whose bytes
//! still verify and computes only the rest. Only the server's user may
//! read or write any of it ([`private`]), and [`budget`] bounds what it
//! takes of the disk.

mod budget;
mod health;
mod hints;
mod journal;
mod journal_file;
mod pages;
mod private;
mod spill;
mod store;

// The one surface the rest of the crate uses; the files behind it are
// durable's own.
pub use crate::base::Durability;
pub use budget::{Limits as StateLimits, DEFAULT_MIN_FREE_BYTES};
pub use health::{HealthListener, StateHealth, PROBE_INTERVAL};
pub use journal::{replay as replay_journal, PageHint, PageHints, Record};
pub use pages::{
    chain as page_chain, extend_chain as extend_page_chain, hint_records, take_back,
    take_back_keyed, KeptHints, KeptRows, TakenBack,
};
pub use private::{options as private_options, state_dir as private_state_dir, PermissionError};
pub use spill::{estimate as spill_estimate, read as read_spill, write as write_spill, SpillError};
// The record framing and page-hint layout, which the shards' kept-page
// files share with the journal.
pub(crate) use journal::{
    decode_hints, encode_hints, hints_bytes, next_record, seal_record, start_record, NextRecord,
    Reader as RecordReader,
};
pub use store::{JournalFile, Recovered, Refused, SessionStore, StoreError, BATCH_WINDOW};

/// Locks `dir/lock` for as long as the returned file lives, so that one
/// process at a time writes the directory: `Ok(None)` when another holds
/// it.
pub fn lock_directory(dir: &std::path::Path) -> std::io::Result<Option<std::fs::File>> {
    let lock = private::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("lock"))?;
    match lock.try_lock() {
        Ok(()) => Ok(Some(lock)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}
