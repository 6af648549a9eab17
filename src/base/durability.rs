//! How soon a session's journal write is on disk: the one choice the
//! operator makes (`--durability`), named by the store and the server.

/// When a journal write is on disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// Before the call is answered: nothing acknowledged is ever lost.
    #[default]
    Sync,
    /// Within `BATCH_WINDOW` (5 ms) after it (group commit).
    Batch,
    /// When the operating system writes it back.
    None,
}
