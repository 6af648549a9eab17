//! Bounds on what one request may carry, so that no client can make the
//! server keep (for a session's life) or copy around unbounded data. Each
//! is checked before anything changes (INVALID_ARGUMENT beyond, with the
//! numbers in the message), stated on its field in
//! `protos/kakeya/v1/runtime.proto`, and listed in the README's server
//! section.

use super::RuntimeError;

/// Bytes of `CreateSessionRequest.client_label` (kept for the session's life).
pub const MAX_CLIENT_LABEL_BYTES: usize = 256;
/// Entries of `CreateSessionRequest.eos_token_ids` (kept for the session's life).
pub const MAX_EOS_TOKEN_IDS: usize = 64;
/// Token ids in one `AppendTokensRequest`.
pub const MAX_APPEND_TOKENS: usize = 65_536;
/// Entries of `GenerateRequest.stop_sequences`.
pub const MAX_STOP_SEQUENCES: usize = 16;
/// Token ids in one stop sequence.
pub const MAX_STOP_SEQUENCE_TOKENS: usize = 64;
/// Entries of `GenerateRequest.logit_bias`.
pub const MAX_LOGIT_BIAS_ENTRIES: usize = 1024;
/// `GenerateRequest.penalty_last_n`: the longest penalty window (0 still
/// means the whole history, which the context bounds).
pub const MAX_PENALTY_LAST_N: u32 = 65_536;
/// `GenerateRequest.top_logprobs` (the sampler's own bound).
pub const MAX_TOP_LOGPROBS: usize = crate::sampler::MAX_TOP_LOGPROBS;

/// `InvalidArgument` unless `got <= max`; the message names the field, the
/// count and the bound, e.g. "client_label has 300 bytes: at most 256".
pub(crate) fn at_most(field: &str, unit: &str, got: usize, max: usize) -> Result<(), RuntimeError> {
    if got <= max {
        return Ok(());
    }
    Err(RuntimeError::InvalidArgument(format!(
        "{field} has {got} {unit}: at most {max}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_itself_passes_and_one_more_names_the_numbers() {
        assert_eq!(
            at_most("eos_token_ids", "ids", 64, MAX_EOS_TOKEN_IDS),
            Ok(())
        );
        let err = at_most("eos_token_ids", "ids", 65, MAX_EOS_TOKEN_IDS).expect_err("65");
        assert_eq!(
            err.to_string(),
            "invalid argument: eos_token_ids has 65 ids: at most 64"
        );
    }
}
