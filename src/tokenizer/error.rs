//! Errors from building a tokenizer out of GGUF metadata and from using it.

use thiserror::Error;

use crate::gguf::GgufError;

/// Why a tokenizer could not be built, or could not encode or decode.
#[derive(Debug, Error)]
pub enum TokenizerError {
    /// The tokenizer metadata could not be read from the GGUF file.
    #[error("reading tokenizer metadata: {0}")]
    Gguf(#[from] GgufError),
    /// `tokenizer.ggml.model` names a tokenizer family this crate does not
    /// implement.
    #[error("unsupported tokenizer model {model:?} (supported: \"gpt2\" byte-level BPE, \"llama\" SentencePiece BPE)")]
    UnsupportedModel { model: String },
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not
    /// implement.
    #[error("unsupported pre-tokenizer {pre:?} for a byte-level BPE vocabulary")]
    UnsupportedPreTokenizer { pre: String },
    /// A metadata array holds values of the wrong type.
    #[error("metadata key {key} holds an array of the wrong type (expected {expected})")]
    WrongArrayType {
        key: &'static str,
        expected: &'static str,
    },
    /// The vocabulary has no tokens at all, or more than token ids can name.
    #[error("vocabulary has {count} tokens; expected between 1 and {max}")]
    BadVocabSize { count: usize, max: usize },
    /// Two per-token arrays disagree on the vocabulary size.
    #[error("{key} has {found} entries but the vocabulary has {expected} tokens")]
    LengthMismatch {
        key: &'static str,
        found: usize,
        expected: usize,
    },
    /// A special-token id from the metadata lies outside the vocabulary.
    #[error("{key} is {id}, outside the vocabulary of {vocab_size} tokens")]
    SpecialIdOutOfRange {
        key: &'static str,
        id: u64,
        vocab_size: usize,
    },
    /// A caller passed a token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    /// The vocabulary lacks the single-byte token needed to encode a byte.
    #[error("the vocabulary has no token for byte 0x{byte:02x}, so this text cannot be encoded")]
    MissingByteToken { byte: u8 },
    /// Encoding with `add_special` asked for a BOS or EOS token that the
    /// model does not define.
    #[error("the model asks for a {which} token to be added but defines none")]
    MissingSpecialToken { which: &'static str },
}
