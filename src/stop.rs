//! Why a generation ended: one type for the engine (`inferd generate`,
//! `chat`) and the runtime (the server's Generate), which report the same
//! causes.

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `max_tokens` tokens were generated.
    MaxTokens,
    /// A stop id (the session's EOS ids) was emitted, and committed.
    Eos,
    /// The caller stopped it: a client cancelled or dropped the stream, or
    /// the engine's token callback asked to stop.
    Cancelled,
    /// The context is full and the overflow policy says stop (runtime only).
    Truncated,
    /// The generated tokens ended with one of the request's stop sequences
    /// (runtime only).
    StopSequence {
        /// Which of the request's stop sequences matched.
        index: u32,
    },
    /// The constrained text is complete: it matches, and nothing may follow
    /// (or a stop id came where it may end, and was committed).
    ConstraintDone,
    /// The constraint can no longer be met: `max_tokens` came with the text
    /// unfinished, or no token of the vocabulary continues it.
    ConstraintUnfinished,
}
