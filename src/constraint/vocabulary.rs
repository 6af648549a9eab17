//! The model's vocabulary as llguidance sees it: each token's bytes, with
//! control and end-of-generation tokens marked special so that no grammar
//! matches them as text.

use std::sync::Arc;

use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::tokenizer::Tokenizer;

/// The token environment for rows of `vocab` logits: ids past the
/// tokenizer's own have no bytes and are never allowed.
pub(super) fn token_env(tokenizer: &Tokenizer, vocab: usize) -> TokEnv {
    let mut words = Vec::with_capacity(vocab);
    for id in 0..vocab as u32 {
        let bytes = tokenizer.token_bytes(id).unwrap_or_default();
        if tokenizer.is_control(id) || tokenizer.is_eog(id) {
            // llguidance's marker for a special token: bytes no text has.
            let mut special = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            special.extend_from_slice(bytes);
            words.push(special);
        } else {
            words.push(bytes.to_vec());
        }
    }
    let eos = tokenizer
        .eos()
        .or_else(|| tokenizer.eog_tokens().first().copied())
        .filter(|&id| (id as usize) < vocab)
        .unwrap_or(0);
    let info = TokRxInfo::new(vocab as u32, eos);
    Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)))
}
