//! The runtime's one error enum. Each variant is one status of the client
//! contract (CONTRACT §2.4), so a transport maps it in exactly one place via
//! [`RuntimeError::code`].

use thiserror::Error;

use crate::base::{NoRandomness, NotAnId};
use crate::kv::KvError;
use crate::model::ModelError;
use crate::sampler::SamplerError;

/// The status kinds of the client contract, free of any transport's types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatusKind {
    NotFound,
    InvalidArgument,
    ResourceExhausted,
    FailedPrecondition,
    DeadlineExceeded,
    Unavailable,
    Internal,
    /// A frame between the coordinator and a shard arrived corrupted.
    DataLoss,
    /// A shard stream lost its frame order.
    Aborted,
}

/// Why a runtime call failed.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum RuntimeError {
    /// The session id is unknown, closed, evicted or was removed after a
    /// failure; the four cases are deliberately indistinguishable.
    #[error("session not found")]
    NotFound,
    /// A request argument is malformed or out of range; nothing changed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A bounded resource is full and nothing idle could be evicted.
    #[error("{what} exhausted: {asked} asked, {free} free")]
    ResourceExhausted { what: String, asked: u64, free: u64 },
    /// A session invariant (INV-1 or INV-2) broke; the session was removed
    /// and its KV freed.
    #[error("session invariant violated, session removed: {0}")]
    FailedPrecondition(String),
    /// The call's deadline passed while it waited or ran.
    #[error("deadline exceeded")]
    DeadlineExceeded,
    /// The state directory may not grow: its budget is spent or its
    /// filesystem is below the free-space floor (`--max-state-mib`,
    /// `--min-free-mib`). New durable work is refused before it changes
    /// anything; the message says which limit and its numbers.
    #[error("{0}")]
    StateDirFull(String),
    /// The runtime is draining for shutdown and takes no new work.
    #[error("runtime is shutting down")]
    Unavailable,
    /// A bug reached the top; the message says where.
    #[error("internal error: {0}")]
    Internal(String),
    /// The state directory did not take the call's change (a full or
    /// failing disk): the change is undone and nothing was kept.
    #[error("not made durable, nothing changed: {0}")]
    NotDurable(String),
    /// Another replica took the session over (this one's lease ran out
    /// while it was paused or cut off): nothing of the call was kept, and
    /// this replica dropped the session. Calling again reaches it where it
    /// is now.
    #[error("the session moved to another replica, nothing changed: {0}")]
    Moved(String),
    /// Another replica holds the session and did not let it go (nor did
    /// its lease run out) within the wait a take-over allows: nothing of
    /// the call was done. Calling again may find it free.
    #[error("the session is held by another replica, nothing changed: {0}")]
    HeldElsewhere(String),
    /// The session (in the replicas' store) was made with another model
    /// file than this replica serves: it is not continued here.
    #[error("{0}")]
    OtherModel(String),
    /// A shard of a split model failed this step (`inferd serve --shards`):
    /// the status says how, the message names the shard. The session is
    /// kept and rebuilt on the shards on its next call unless the message
    /// says it was removed.
    #[error("{message}")]
    Shard { status: StatusKind, message: String },
}

impl RuntimeError {
    /// The contract status this error is reported as.
    pub fn code(&self) -> StatusKind {
        match self {
            RuntimeError::NotFound => StatusKind::NotFound,
            RuntimeError::InvalidArgument(_) => StatusKind::InvalidArgument,
            RuntimeError::ResourceExhausted { .. } | RuntimeError::StateDirFull(_) => {
                StatusKind::ResourceExhausted
            }
            RuntimeError::FailedPrecondition(_) | RuntimeError::OtherModel(_) => {
                StatusKind::FailedPrecondition
            }
            RuntimeError::DeadlineExceeded => StatusKind::DeadlineExceeded,
            RuntimeError::Unavailable
            | RuntimeError::NotDurable(_)
            | RuntimeError::Moved(_)
            | RuntimeError::HeldElsewhere(_) => StatusKind::Unavailable,
            RuntimeError::Internal(_) => StatusKind::Internal,
            RuntimeError::Shard { status, .. } => *status,
        }
    }

    pub(crate) fn invalid(what: impl Into<String>) -> Self {
        RuntimeError::InvalidArgument(what.into())
    }

    /// A file a call needed (`what`: the session's journal) could not be
    /// opened: out of file descriptors is RESOURCE_EXHAUSTED, which a client
    /// may retry once connections or sessions close; anything else (a full
    /// or failing disk) is UNAVAILABLE with the system's reason: the call
    /// could not be made durable.
    pub(crate) fn file(what: &str, err: &std::io::Error) -> Self {
        // (libc is not linked in loom runs, which open no files.)
        #[cfg(not(loom))]
        if matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
            return RuntimeError::ResourceExhausted {
                what: format!("file descriptors (for {what})"),
                asked: 1,
                free: 0,
            };
        }
        RuntimeError::NotDurable(format!("cannot start {what}: {err}"))
    }
}

impl From<NotAnId> for RuntimeError {
    fn from(_: NotAnId) -> Self {
        RuntimeError::NotFound
    }
}

impl From<NoRandomness> for RuntimeError {
    fn from(err: NoRandomness) -> Self {
        RuntimeError::Internal(err.to_string())
    }
}

impl From<SamplerError> for RuntimeError {
    fn from(err: SamplerError) -> Self {
        match err {
            SamplerError::EmptyLogits
            | SamplerError::VocabTooLarge { .. }
            | SamplerError::HistoryTokenOutOfRange { .. }
            | SamplerError::NoCandidate { .. }
            | SamplerError::VocabMismatch { .. }
            | SamplerError::Device { .. } => RuntimeError::Internal(err.to_string()),
            _ => RuntimeError::InvalidArgument(err.to_string()),
        }
    }
}

impl From<KvError> for RuntimeError {
    fn from(err: KvError) -> Self {
        match err {
            KvError::Exhausted { wanted, free } => RuntimeError::ResourceExhausted {
                what: "KV pages".into(),
                asked: wanted as u64,
                free: free as u64,
            },
            e if e.is_invariant_violation() => RuntimeError::FailedPrecondition(e.to_string()),
            e => RuntimeError::Internal(e.to_string()),
        }
    }
}

impl From<ModelError> for RuntimeError {
    fn from(err: ModelError) -> Self {
        match err {
            ModelError::TokenOutOfRange { .. } | ModelError::ContextOverflow { .. } => {
                RuntimeError::InvalidArgument(err.to_string())
            }
            ModelError::Kv(kv) => kv.into(),
            e => RuntimeError::Internal(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_has_its_own_code() {
        let all = [
            RuntimeError::NotFound,
            RuntimeError::invalid("x"),
            RuntimeError::ResourceExhausted {
                what: "sessions".into(),
                asked: 1,
                free: 0,
            },
            RuntimeError::FailedPrecondition("INV-2".into()),
            RuntimeError::DeadlineExceeded,
            RuntimeError::Unavailable,
            RuntimeError::Internal("bug".into()),
        ];
        let codes: std::collections::HashSet<_> = all.iter().map(|e| e.code()).collect();
        assert_eq!(codes.len(), all.len());
    }

    #[cfg(not(loom))]
    #[test]
    fn out_of_descriptors_is_exhaustion_not_a_bug() {
        let e = RuntimeError::file(
            "the session's journal",
            &std::io::Error::from_raw_os_error(libc::EMFILE),
        );
        assert_eq!(e.code(), StatusKind::ResourceExhausted);
        assert_eq!(
            e.to_string(),
            "file descriptors (for the session's journal) exhausted: 1 asked, 0 free"
        );
        let e = RuntimeError::file(
            "the session's journal",
            &std::io::Error::from_raw_os_error(libc::EACCES),
        );
        assert_eq!(e.code(), StatusKind::Unavailable);
        assert!(e.to_string().contains("cannot start the session's journal"));
    }

    #[test]
    fn exhaustion_carries_the_numbers() {
        let e: RuntimeError = KvError::Exhausted { wanted: 7, free: 3 }.into();
        assert_eq!(e.code(), StatusKind::ResourceExhausted);
        assert_eq!(e.to_string(), "KV pages exhausted: 7 asked, 3 free");
    }

    #[test]
    fn kv_invariant_errors_are_failed_preconditions() {
        let e: RuntimeError = KvError::InvariantViolation {
            current: 5,
            requested: 4,
        }
        .into();
        assert_eq!(e.code(), StatusKind::FailedPrecondition);
        let e: RuntimeError = ModelError::TokenOutOfRange { token: 9, vocab: 5 }.into();
        assert_eq!(e.code(), StatusKind::InvalidArgument);
    }
}
