//! Errors of the KV cache room. Every variant carries the numbers involved so
//! a caller (and, through it, a client) can see what was asked and what was
//! there.

use std::path::PathBuf;

use thiserror::Error;

/// Why a KV cache operation failed.
#[derive(Debug, Error)]
pub enum KvError {
    /// The pool has fewer free pages than the reservation needs. Nothing was
    /// taken: the pool and the session are exactly as they were.
    #[error("KV cache exhausted: {wanted} pages wanted, {free} pages free")]
    Exhausted { wanted: usize, free: usize },
    /// INV-2: the committed length of a session would decrease.
    #[error(
        "KV invariant INV-2 violated: committed length would go from {current} down to {requested}"
    )]
    InvariantViolation { current: usize, requested: usize },
    /// A commit asks for more positions than the session's pages back.
    #[error("cannot commit {requested} KV positions: only {capacity} are reserved")]
    CommitBeyondCapacity { requested: usize, capacity: usize },
    /// A position at or past the session's reserved capacity.
    #[error("KV position {pos} is out of range: {capacity} positions are reserved")]
    PositionOutOfRange { pos: usize, capacity: usize },
    /// A position a sliding-window layer no longer keeps: its window moved
    /// past it when the session settled.
    #[error("KV layer {layer} no longer keeps position {pos}: its window starts at {first_kept}")]
    OutsideWindow {
        layer: usize,
        pos: usize,
        first_kept: usize,
    },
    /// A roll-back below the length the session was settled at (window
    /// pages the shorter session would need may be gone).
    #[error("cannot roll the KV back to {requested} positions: it was settled at {settled}")]
    RollBackPastSettled { requested: usize, settled: usize },
    /// A fork longer than the session's committed length.
    #[error("cannot fork {requested} KV positions: only {len} are committed")]
    ForkBeyondLength { requested: usize, len: usize },
    /// Shared-prefix pages offered to a session that is not at the end of
    /// a page with nothing reserved past it.
    #[error("cannot map shared pages after {len} KV positions with {capacity} reserved")]
    AdoptNotAtPageEnd { len: usize, capacity: usize },
    /// Shared-prefix pages that do not have one pool page per layer.
    #[error("shared pages come {pages} to a position range, the cache has {layers} layers")]
    AdoptLayerMismatch { pages: usize, layers: usize },
    /// Kept pages of a layer with a missing page after a held one, or
    /// missing leading pages on a layer that sees every position.
    #[error("kept pages of layer {layer} leave a gap the layer would read")]
    KeptPagesGap { layer: usize },
    /// A write into a page another session also holds (a fork or a shared
    /// prefix): it must be copied first ([`SessionKv::reserve`] does).
    ///
    /// [`SessionKv::reserve`]: super::SessionKv::reserve
    #[error("KV page {page} is shared with another session and cannot be written")]
    WriteToSharedPage { page: u32 },
    /// A layer index at or past the number of layers in the layout.
    #[error("KV layer {layer} is out of range: the cache has {n_layers} layers")]
    LayerOutOfRange { layer: usize, n_layers: usize },
    /// A K or V row whose length is not the layout's `kv_dim`.
    #[error("KV row has {got} values, expected kv_dim = {expected}")]
    RowLength { expected: usize, got: usize },
    /// A page index that the pool never had.
    #[error("page {page} does not exist: the pool has {total} pages")]
    PageOutOfRange { page: u32, total: usize },
    /// A page freed while it was already free.
    #[error("page {page} freed twice")]
    DoubleFree { page: u32 },
    /// A second reference asked for a page nobody holds (it may already
    /// be someone else's): only a holder may share a page.
    #[error("page {page} shared while free")]
    ShareOfFreePage { page: u32 },
    /// A page already held by the most references the count can record.
    #[error("page {page} is held by too many references")]
    TooManyReferences { page: u32 },
    /// The allocator's free list contradicted its own accounting (a page
    /// came off the free list while marked in use, or the list ran dry under
    /// a reservation). Only a bug can cause this.
    #[error("page allocator corrupted: {detail}")]
    AllocatorCorrupted { detail: String },
    /// The layout or pool configuration is unusable.
    #[error("invalid KV cache configuration: {reason}")]
    InvalidConfig { reason: String },
    /// The pool is a ledger ([`KvPool::ledger`](super::KvPool::ledger)):
    /// its pages count positions whose K and V live elsewhere.
    #[error(
        "this KV pool's pages are not in this process's memory (a ledger, or pages on a device)"
    )]
    NoStorage,
    /// The device holding the pages failed to move one.
    #[error("the device holding the KV pages failed: {detail}")]
    Device { detail: String },
    /// The page file's blocks could not all be allocated (a full disk, a
    /// quota): writing its pages later would kill the process (SIGBUS).
    #[error(
        "cannot reserve the {bytes} bytes of the KV page file {} on disk: {needed} more are \
         needed, {} free on its filesystem ({source}); free space there or lower --kv-mib",
        .path.display(), free_text(.free)
    )]
    Reserve {
        path: PathBuf,
        bytes: u64,
        needed: u64,
        free: Option<u64>,
        #[source]
        source: std::io::Error,
    },
    /// Creating, sizing or mapping the backing memory failed.
    #[error("cannot map {bytes} bytes of KV memory{}: {source}", path_suffix(.path))]
    Map {
        bytes: u64,
        path: Option<PathBuf>,
        #[source]
        source: std::io::Error,
    },
}

fn free_text(free: &Option<u64>) -> String {
    free.map_or_else(
        || "an unknown number of bytes".into(),
        |f| format!("{f} bytes"),
    )
}

fn path_suffix(path: &Option<PathBuf>) -> String {
    match path {
        Some(path) => format!(" backed by file {}", path.display()),
        None => String::new(),
    }
}

impl KvError {
    /// Whether this error is a session invariant violation, which the caller
    /// must answer by removing the session rather than retrying.
    pub fn is_invariant_violation(&self) -> bool {
        matches!(
            self,
            KvError::InvariantViolation { .. } | KvError::CommitBeyondCapacity { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exhausted_message_carries_both_numbers() {
        let message = KvError::Exhausted { wanted: 7, free: 3 }.to_string();
        assert_eq!(message, "KV cache exhausted: 7 pages wanted, 3 pages free");
    }

    #[test]
    fn map_message_names_the_file_when_there_is_one() {
        let err = KvError::Map {
            bytes: 4096,
            path: Some(PathBuf::from("kv.bin")),
            source: std::io::Error::other("boom"),
        };
        assert_eq!(
            err.to_string(),
            "cannot map 4096 bytes of KV memory backed by file kv.bin: boom"
        );
        let anonymous = KvError::Map {
            bytes: 8,
            path: None,
            source: std::io::Error::other("boom"),
        };
        assert_eq!(
            anonymous.to_string(),
            "cannot map 8 bytes of KV memory: boom"
        );
    }

    #[test]
    fn invariant_errors_are_classified() {
        assert!(KvError::InvariantViolation {
            current: 5,
            requested: 4
        }
        .is_invariant_violation());
        assert!(!KvError::Exhausted { wanted: 1, free: 0 }.is_invariant_violation());
    }
}
