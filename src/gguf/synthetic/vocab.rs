//! The byte-level vocabulary every synthetic model carries: 256 byte tokens,
//! three ChatML specials and fillers up to the vocabulary size.

use crate::gguf::{GgufWriter, MetaArray, MetaValue};

/// Id of `<|endoftext|>`.
pub const ENDOFTEXT_TOKEN_ID: u32 = 256;
/// Id of `<|im_start|>`, written as `tokenizer.ggml.bos_token_id`.
pub const BOS_TOKEN_ID: u32 = 257;
/// Id of `<|im_end|>`, written as `tokenizer.ggml.eos_token_id`.
pub const EOS_TOKEN_ID: u32 = 258;
/// Smallest vocabulary: 256 byte tokens and the three specials.
pub const MIN_VOCAB: usize = 259;

const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// A plain ChatML template over the specials above.
const CHAT_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n\
{{ message['content'] }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
/// llama.cpp's token types.
const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_UNUSED: i32 = 5;

/// Adds the `tokenizer.*` keys of a `vocab`-token vocabulary.
pub(super) fn add_tokenizer_metadata(w: &mut GgufWriter, vocab: usize) {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| gpt2_byte_char(b).to_string()).collect();
    let mut types = vec![TOKEN_TYPE_NORMAL; 256];
    tokens.extend(SPECIAL_TOKENS.iter().map(|s| s.to_string()));
    types.extend([TOKEN_TYPE_CONTROL; SPECIAL_TOKENS.len()]);
    for id in tokens.len()..vocab {
        tokens.push(format!("[PAD{id}]"));
        types.push(TOKEN_TYPE_UNUSED);
    }
    w.add_meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .add_meta("tokenizer.ggml.pre", MetaValue::String("smollm".into()))
        .add_meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(MetaArray::String(tokens)),
        )
        .add_meta(
            "tokenizer.ggml.token_type",
            MetaValue::Array(MetaArray::I32(types)),
        )
        .add_meta(
            "tokenizer.ggml.merges",
            MetaValue::Array(MetaArray::String(Vec::new())),
        )
        .add_meta("tokenizer.ggml.bos_token_id", MetaValue::U32(BOS_TOKEN_ID))
        .add_meta("tokenizer.ggml.eos_token_id", MetaValue::U32(EOS_TOKEN_ID))
        .add_meta(
            "tokenizer.ggml.unknown_token_id",
            MetaValue::U32(ENDOFTEXT_TOKEN_ID),
        )
        .add_meta(
            "tokenizer.ggml.padding_token_id",
            MetaValue::U32(EOS_TOKEN_ID),
        )
        .add_meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false))
        .add_meta("tokenizer.ggml.add_space_prefix", MetaValue::Bool(false))
        .add_meta(
            "tokenizer.chat_template",
            MetaValue::String(CHAT_TEMPLATE.into()),
        );
}

/// The character GPT-2's byte-level BPE uses for byte `b`: printable
/// Latin-1 bytes stand for themselves; the other 68 bytes (controls, space,
/// DEL, NBSP, soft hyphen) are shifted, in byte order, to U+0100 onwards,
/// so that a space is `Ġ` and a newline `Ċ`.
pub fn gpt2_byte_char(b: u8) -> char {
    let stands_for_itself = |x: u8| matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if stands_for_itself(b) {
        return char::from(b);
    }
    let shifted_before = (0..b).filter(|&x| !stands_for_itself(x)).count() as u32;
    // 256 + at most 67: always a valid scalar value.
    char::from_u32(256 + shifted_before).unwrap_or(char::REPLACEMENT_CHARACTER)
}
