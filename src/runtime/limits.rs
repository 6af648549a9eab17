//! Bounds on what one request may carry, so that no client can make the
//! server keep (for a session's life) or copy around unbounded data. Each
//! is checked before anything changes (INVALID_ARGUMENT beyond, with the
//! numbers in the message), stated on its field in
//! `protos/kakeya/v1/runtime.proto`, and listed in the README's server
//! section.
//!
//! The OpenAI-compatible HTTP API's own bounds follow them: on what only
//! an HTTP request carries (its body, chat messages, stop strings as text)
//! or OpenAI's range where it is narrower than the runtime's. The HTTP
//! front door checks those (a 400 before anything changes, CONTRACT
//! §2.10a); everything it hands on is checked here, by the runtime.

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
/// `GenerateRequest.top_logprobs` (the sampler's own bound, defined with
/// the buffers it sizes), also OpenAI's `top_logprobs` bound.
pub const MAX_TOP_LOGPROBS: usize = crate::sampler::MAX_TOP_LOGPROBS;

/// Bytes of one HTTP request body (a long conversation, as JSON); beyond
/// it the answer is a 413.
pub const MAX_HTTP_BODY_BYTES: usize = 8 << 20;
/// Messages of one chat request (`/v1/chat/completions`).
pub const MAX_CHAT_MESSAGES: usize = 1024;
/// Entries of an HTTP request's `logit_bias`: OpenAI's bound, narrower
/// than the runtime's [`MAX_LOGIT_BIAS_ENTRIES`] (which a gRPC client
/// has), as CONTRACT §2.10a promises OpenAI's ranges.
pub const MAX_OPENAI_LOGIT_BIAS: usize = 300;
/// `stop` strings of one HTTP request (as OpenAI allows): matched on the
/// text by the front door, never seen by the runtime.
pub const MAX_STOP_STRINGS: usize = 4;
/// Bytes of one `stop` string.
pub const MAX_STOP_STRING_BYTES: usize = 256;

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
