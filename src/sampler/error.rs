//! Errors from the sampler: bad sampling parameters, a history that does not
//! fit the vocabulary, or logits that leave nothing to choose from. Each
//! variant carries the offending numbers.

use thiserror::Error;

use super::params::MIN_TEMPERATURE;

/// Why a token could not be sampled.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SamplerError {
    /// The logits slice is empty: there is no vocabulary to choose from.
    #[error("the logits are empty: there is no token to choose from")]
    EmptyLogits,
    /// The vocabulary has more entries than a `u32` token id can name.
    #[error("vocabulary of {vocab_size} entries is too large: token ids are u32")]
    VocabTooLarge { vocab_size: usize },
    /// Temperature is negative, NaN, infinite, or above 0 but below
    /// [`MIN_TEMPERATURE`] (0 means greedy).
    #[error(
        "temperature {value} is invalid: it must be 0 (greedy) or finite and at least {min}",
        min = MIN_TEMPERATURE
    )]
    InvalidTemperature { value: f32 },
    /// `top_p` is outside (0, 1] (1 turns the filter off).
    #[error("top_p {value} is invalid: it must lie in (0, 1] (1 turns it off)")]
    InvalidTopP { value: f32 },
    /// `min_p` is outside [0, 1] (0 turns the filter off).
    #[error("min_p {value} is invalid: it must lie in [0, 1] (0 turns it off)")]
    InvalidMinP { value: f32 },
    /// The repetition penalty is zero, negative, NaN or infinite (1 turns it off).
    #[error("repetition_penalty {value} is invalid: it must be finite and > 0 (1 turns it off)")]
    InvalidRepetitionPenalty { value: f32 },
    /// The presence or frequency penalty is NaN or infinite.
    #[error("{name} {value} is invalid: it must be finite")]
    NonFinitePenalty { name: &'static str, value: f32 },
    /// A logit bias value is NaN or infinite.
    #[error("logit bias {value} for token {token} is invalid: it must be finite")]
    NonFiniteLogitBias { token: u32, value: f32 },
    /// A logit bias names a token outside the vocabulary.
    #[error("logit bias names token {token}, but the vocabulary has {vocab_size} tokens")]
    LogitBiasTokenOutOfRange { token: u32, vocab_size: usize },
    /// A token in the penalty window of the history is outside the vocabulary.
    #[error(
        "history token {token} at index {index} is outside the vocabulary of {vocab_size} tokens"
    )]
    HistoryTokenOutOfRange {
        token: u32,
        index: usize,
        vocab_size: usize,
    },
    /// After NaN handling, penalties and bias, every logit is NaN or -inf, so
    /// no token has any probability.
    #[error(
        "all {vocab_size} logits are NaN or -inf after penalties and bias: no token can be chosen"
    )]
    NoCandidate { vocab_size: usize },
    /// A backend built for one vocabulary size was handed logits of another.
    #[error("the sampler was built for {expected} logits per row, but a row has {got}")]
    VocabMismatch { expected: usize, got: usize },
    /// The GPU device failed (lost, out of memory, or a mapping error).
    #[error("a token mask of {got} words for a row that needs {expected}")]
    MaskLength { expected: usize, got: usize },
    #[error("the wgpu sampler failed: {message}")]
    Device { message: String },
}
