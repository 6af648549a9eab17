//! Text <-> token ids, from the vocabulary stored in a GGUF file.
//!
//! Implemented: GPT-2 style byte-level BPE (`tokenizer.ggml.model = "gpt2"`)
//! with the GPT-2, SmolLM/StarCoder, Llama 3 (`llama-bpe`), Qwen2 and
//! DeepSeek LLM pre-tokenizers ([`PreTokenizer`]), and SentencePiece style
//! BPE for `llama` vocabularies (Llama 2, Mistral, Phi-3: scores, `▁` for
//! spaces, `<0xXX>` byte fallback). Other tokenizer families are refused
//! with [`TokenizerError::UnsupportedModel`], other pre-tokenizers with
//! [`TokenizerError::UnsupportedPreTokenizer`].
//!
//! Encoding follows llama.cpp's `llama_tokenize` so that token ids match it
//! exactly (checked against golden vectors in `tests/vectors/`, and against
//! llama.cpp's own test cases for each vocabulary in
//! `tests/tokenizer_vocabs.rs`):
//!
//! 1. Special-token text is cut out first. Every control, user-defined and
//!    unknown token is searched for, longest text first. User-defined tokens
//!    are always recognised; control and unknown tokens only with
//!    `parse_special`.
//! 2. Byte-level BPE: each remaining stretch of text is split into words by
//!    the pre-tokenizer ([`PreTokenizer`]), and each word's bytes become
//!    byte-level tokens that are merged by rank. Llama 3 vocabularies first
//!    look the whole word up and take it as one token if it is one
//!    (llama.cpp's "ignore merges").
//! 3. SentencePiece: each stretch that follows a special token (or starts
//!    the text) gets a leading space if the model asks for one
//!    (`tokenizer.ggml.add_space_prefix`), spaces become `▁`, and
//!    characters are merged by token score.
//!
//! Decoding concatenates each token's bytes (special tokens as their text)
//! and turns invalid UTF-8 into U+FFFD; [`StreamDecoder`] does the same
//! incrementally for streaming output.

mod bpe;
mod byte_level;
mod error;
mod pretokenize;
mod spm;
mod stream;
mod token_texts;

pub use error::TokenizerError;
pub use pretokenize::PreTokenizer;
pub use stream::StreamDecoder;

use crate::gguf::{GgufFile, MetaArray};
use bpe::{pair_key, BpeScratch, Merge, MergeTable};
use spm::{SpmScratch, SpmVocab};
use token_texts::TokenTexts;

/// How a token is treated, from `tokenizer.ggml.token_type` (numbered as in
/// llama.cpp), after llama.cpp's adjustments by token text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    /// Ordinary text produced by merging.
    Normal,
    /// The unknown-token placeholder.
    Unknown,
    /// A control token such as `<|im_start|>`: never produced from plain
    /// text unless special-token parsing is on.
    Control,
    /// An added token that is always matched as a whole in text.
    UserDefined,
    /// A reserved slot.
    Unused,
    /// A single raw byte written as `<0xXX>`.
    Byte,
    /// A type number outside the known set.
    Undefined,
}

impl TokenType {
    fn from_gguf(code: i32) -> Self {
        match code {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }
}

/// Token texts that llama.cpp treats as ending generation whatever their
/// stored type (it also forces them to control type).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle tokens that also end generation, found by key or,
/// failing that, by text (as llama.cpp does).
const FIM_EOG: &[(&str, &[&str])] = &[
    (
        "tokenizer.ggml.fim_pad_token_id",
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    ),
    (
        "tokenizer.ggml.fim_rep_token_id",
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
    ),
    ("tokenizer.ggml.fim_sep_token_id", &["<|file_sep|>"]),
];

/// Fill-in-the-middle texts llama.cpp forces to control type when found.
const FIM_CONTROL_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];

/// A token text that is cut out of input before pre-tokenization.
#[derive(Clone, Debug)]
struct SpecialText {
    text: String,
    id: u32,
    /// Control and unknown tokens are only matched with `parse_special`;
    /// user-defined ones always are.
    only_when_parsing: bool,
    /// Whitespace right after the token is dropped (llama.cpp sets this
    /// for Phi-3's special tokens, recognised by model name).
    rstrip: bool,
}

/// A piece of input after special tokens are cut out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// The merge algorithm and its tables.
#[derive(Clone, Debug)]
enum Kind {
    /// GPT-2 style byte-level BPE.
    ByteLevel {
        merges: MergeTable,
        pre: PreTokenizer,
        /// A word that is a token as a whole becomes that token without
        /// merging (Llama 3).
        ignore_merges: bool,
    },
    /// SentencePiece style BPE over characters, by token score.
    SentencePiece {
        scores: Vec<f32>,
        add_space_prefix: bool,
    },
}

/// A tokenizer built from GGUF metadata.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    texts: TokenTexts,
    types: Vec<TokenType>,
    /// `bytes[byte_offsets[i]..byte_offsets[i + 1]]` is what token `i`
    /// stands for.
    bytes: Vec<u8>,
    byte_offsets: Vec<usize>,
    kind: Kind,
    /// The token standing for each byte when text has no better one.
    byte_ids: [Option<u32>; 256],
    /// Longest text first.
    specials: Vec<SpecialText>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    eog: Vec<u32>,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's `tokenizer.*` metadata.
    ///
    /// Keys are read, and their errors reported, in a fixed order: model,
    /// token texts, token types, special ids and flags, the merge table or
    /// scores, then special texts and the chat template.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, TokenizerError> {
        let sentencepiece = is_sentencepiece(file)?;
        let text_list = read_token_texts(file)?;
        let n_vocab = text_list.len();
        let mut types = read_token_types(file, n_vocab)?;

        // Ids fit in u32: the vocabulary size was checked against i32::MAX.
        let texts = TokenTexts::new(text_list);

        // SentencePiece vocabularies default to llama's ids, as in llama.cpp.
        let default_id = |id: u32| (sentencepiece && (id as usize) < n_vocab).then_some(id);
        let bos = special_id(file, "tokenizer.ggml.bos_token_id", n_vocab)?.or(default_id(1));
        let eos = special_id(file, "tokenizer.ggml.eos_token_id", n_vocab)?.or(default_id(2));
        let eot = special_id(file, "tokenizer.ggml.eot_token_id", n_vocab)?;
        let eom = special_id(file, "tokenizer.ggml.eom_token_id", n_vocab)?;
        // Only byte-level BPE vocabularies have a pre-tokenizer.
        let pre_name = match sentencepiece {
            true => "default",
            false => file.get_str_opt("tokenizer.ggml.pre")?.unwrap_or("default"),
        };
        let llama3 = !sentencepiece && PreTokenizer::is_llama3_name(pre_name);
        // llama.cpp adds BOS by default for SentencePiece and Llama 3.
        let add_bos = file
            .get_bool_opt("tokenizer.ggml.add_bos_token")?
            .unwrap_or(sentencepiece || llama3);
        let add_eos = file
            .get_bool_opt("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false);

        let eog = end_of_generation(file, &texts, [eos, eot, eom], n_vocab)?;
        force_control_types(&mut types, &eog, &texts);
        let (bytes, byte_offsets) = token_bytes_table(&texts, &types, sentencepiece);
        let byte_ids = byte_token_ids(&texts, sentencepiece);

        let kind = if sentencepiece {
            sentencepiece_kind(file, n_vocab)?
        } else {
            byte_level_kind(file, pre_name, llama3, &texts)?
        };

        let specials = special_texts(file, &texts, &types)?;
        let chat_template = file
            .get_str_opt("tokenizer.chat_template")?
            .map(str::to_owned);

        Ok(Self {
            texts,
            types,
            bytes,
            byte_offsets,
            kind,
            byte_ids,
            specials,
            bos,
            eos,
            add_bos,
            add_eos,
            eog,
            chat_template,
        })
    }

    /// Encodes text. `add_special`: add BOS/EOS where the model asks for
    /// them (`tokenizer.ggml.add_bos_token` / `add_eos_token`);
    /// `parse_special`: recognise control-token text such as `<|im_end|>`
    /// as that token (user-defined tokens are recognised either way, as in
    /// llama.cpp).
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.push(
                self.bos
                    .ok_or(TokenizerError::MissingSpecialToken { which: "BOS" })?,
            );
        }
        let mut scratch = EncodeScratch::default();
        let mut after_special = true;
        for fragment in self.split_special(text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(piece) => {
                    self.encode_plain(piece, after_special, &mut scratch, &mut out)?;
                    after_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.push(
                self.eos
                    .ok_or(TokenizerError::MissingSpecialToken { which: "EOS" })?,
            );
        }
        Ok(out)
    }

    /// Decodes ids to text: each token's bytes in turn, special tokens as
    /// their text. Bytes that do not form valid UTF-8 (a character cut off
    /// at either end of `ids`) become U+FFFD; use [`Tokenizer::decode_bytes`]
    /// to get them unaltered. For SentencePiece vocabularies that add a
    /// space prefix, one leading space of the first token is dropped (as
    /// llama.cpp's detokenizer does), so plain text round-trips.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let bytes = self.decode_bytes(ids)?;
        Ok(match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The bytes the ids stand for, concatenated (with the same leading
    /// space rule as [`Tokenizer::decode`]).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let mut bytes = self
                .token_bytes(id)
                .ok_or(TokenizerError::TokenOutOfRange {
                    id,
                    vocab_size: self.vocab_size(),
                })?;
            if i == 0 && self.strips_leading_space() {
                bytes = bytes.strip_prefix(b" ").unwrap_or(bytes);
            }
            out.extend_from_slice(bytes);
        }
        Ok(out)
    }

    /// The raw bytes a token stands for (a special token's text for control
    /// and user-defined tokens; empty for unused slots).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let start = *self.byte_offsets.get(i)?;
        let end = *self.byte_offsets.get(i + 1)?;
        self.bytes.get(start..end)
    }

    /// The token's text exactly as stored in the vocabulary (byte-level
    /// encoded, e.g. "Ġthe" for " the").
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id)
    }

    /// The token's type.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether `encode(.., add_special = true, ..)` adds BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// End-of-generation ids, ascending: EOS, EOT and the tokens llama.cpp
    /// recognises by text (`<|im_end|>`, `<|endoftext|>`, FIM padding ...).
    pub fn eog_tokens(&self) -> &[u32] {
        &self.eog
    }

    /// Whether the id ends generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The id of the token whose vocabulary text is exactly `text` (for
    /// special tokens this is their plain text, e.g. "<|im_end|>").
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.texts.id_of(text)
    }

    /// Whether the id is a control token (not meant to be shown as text).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_type(id) == Some(TokenType::Control)
    }

    /// Whether decoding drops one leading space from the first token
    /// (SentencePiece vocabularies that add a space prefix when encoding).
    pub fn strips_leading_space(&self) -> bool {
        matches!(
            self.kind,
            Kind::SentencePiece {
                add_space_prefix: true,
                ..
            }
        )
    }

    /// The Jinja chat template stored with the model, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Cuts special-token text out of `text`, longest special text first.
    fn split_special<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut fragments = Vec::new();
        if !text.is_empty() {
            fragments.push(Fragment::Text(text));
        }
        let mut next = Vec::new();
        for special in &self.specials {
            if special.only_when_parsing && !parse_special {
                continue;
            }
            let needle = special.text.as_str();
            if !fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(needle)))
            {
                continue;
            }
            next.clear();
            for &fragment in &fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(at) = rest.find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(special.id));
                    rest = &rest[at + needle.len()..];
                    if special.rstrip {
                        // C `isspace`, as llama.cpp uses.
                        rest = rest.trim_start_matches([' ', '\t', '\n', '\u{0B}', '\u{0C}', '\r']);
                    }
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            std::mem::swap(&mut fragments, &mut next);
        }
        fragments
    }

    /// Encodes text that holds no special tokens; `after_special` says it
    /// starts the input or follows a special token.
    fn encode_plain(
        &self,
        text: &str,
        after_special: bool,
        scratch: &mut EncodeScratch,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        match &self.kind {
            Kind::ByteLevel {
                merges,
                pre,
                ignore_merges,
            } => {
                scratch.words.clear();
                pre.split(text, &mut scratch.words);
                let bytes = text.as_bytes();
                for &(start, end) in &scratch.words {
                    if *ignore_merges {
                        scratch.word_text.clear();
                        scratch.word_text.extend(
                            bytes[start..end]
                                .iter()
                                .map(|&b| byte_level::byte_to_char(b)),
                        );
                        if let Some(id) = self.texts.id_of(&scratch.word_text) {
                            out.push(id);
                            continue;
                        }
                    }
                    scratch.ids.clear();
                    for &b in &bytes[start..end] {
                        let id = self.byte_ids[usize::from(b)]
                            .ok_or(TokenizerError::MissingByteToken { byte: b })?;
                        scratch.ids.push(id);
                    }
                    scratch.bpe.merge_word(merges, &scratch.ids, out);
                }
                Ok(())
            }
            Kind::SentencePiece {
                scores,
                add_space_prefix,
            } => {
                let mut escaped = String::with_capacity(text.len() + 3);
                if *add_space_prefix && after_special {
                    escaped.push('\u{2581}');
                }
                escaped.push_str(&text.replace(' ', "\u{2581}"));
                let vocab = SpmVocab {
                    texts: &self.texts,
                    scores,
                    byte_ids: &self.byte_ids,
                };
                scratch.spm.encode(&vocab, &escaped, out)
            }
        }
    }
}

/// Buffers reused across the words of one `encode` call.
#[derive(Default)]
struct EncodeScratch {
    words: Vec<(usize, usize)>,
    /// A word in the byte-level alphabet, to look it up whole.
    word_text: String,
    ids: Vec<u32>,
    bpe: BpeScratch,
    spm: SpmScratch,
}

/// Whether `tokenizer.ggml.model` names a SentencePiece vocabulary
/// (`llama`) rather than byte-level BPE (`gpt2`); any other model is
/// refused.
fn is_sentencepiece(file: &GgufFile) -> Result<bool, TokenizerError> {
    let model = file.get_str("tokenizer.ggml.model")?;
    match model {
        "gpt2" => Ok(false),
        "llama" => Ok(true),
        _ => Err(TokenizerError::UnsupportedModel {
            model: model.to_owned(),
        }),
    }
}

/// `tokenizer.ggml.tokens`, checked to be a non-empty string array whose
/// ids fit in an `i32`.
fn read_token_texts(file: &GgufFile) -> Result<&[String], TokenizerError> {
    let text_list = match file.get_array("tokenizer.ggml.tokens")? {
        MetaArray::String(v) => v,
        _ => {
            return Err(TokenizerError::WrongArrayType {
                key: "tokenizer.ggml.tokens",
                expected: "string",
            })
        }
    };
    let max = i32::MAX as usize;
    if text_list.is_empty() || text_list.len() > max {
        return Err(TokenizerError::BadVocabSize {
            count: text_list.len(),
            max,
        });
    }
    Ok(text_list)
}

/// `tokenizer.ggml.token_type`, one per token (all normal when absent).
fn read_token_types(file: &GgufFile, n_vocab: usize) -> Result<Vec<TokenType>, TokenizerError> {
    let types: Vec<TokenType> = match file.get("tokenizer.ggml.token_type") {
        None => vec![TokenType::Normal; n_vocab],
        Some(_) => match file.get_array("tokenizer.ggml.token_type")? {
            MetaArray::I32(codes) => codes.iter().map(|&c| TokenType::from_gguf(c)).collect(),
            _ => {
                return Err(TokenizerError::WrongArrayType {
                    key: "tokenizer.ggml.token_type",
                    expected: "i32",
                })
            }
        },
    };
    if types.len() != n_vocab {
        return Err(TokenizerError::LengthMismatch {
            key: "tokenizer.ggml.token_type",
            found: types.len(),
            expected: n_vocab,
        });
    }
    Ok(types)
}

/// A special token id stored under `key`, if any, checked to be in the
/// vocabulary.
fn special_id(
    file: &GgufFile,
    key: &'static str,
    n_vocab: usize,
) -> Result<Option<u32>, TokenizerError> {
    match file.get_u64_opt(key)? {
        None => Ok(None),
        Some(id) if id < n_vocab as u64 => Ok(Some(id as u32)),
        Some(id) => Err(TokenizerError::SpecialIdOutOfRange {
            key,
            id,
            vocab_size: n_vocab,
        }),
    }
}

/// The end-of-generation set, sorted and without repeats, as llama.cpp
/// derives it: the EOS/EOT/EOM ids, the fill-in-the-middle ids (by key or,
/// failing that, by text) and the texts in [`EOG_TEXTS`].
fn end_of_generation(
    file: &GgufFile,
    texts: &TokenTexts,
    ids: [Option<u32>; 3],
    n_vocab: usize,
) -> Result<Vec<u32>, TokenizerError> {
    let mut eog: Vec<u32> = ids.into_iter().flatten().collect();
    for (key, candidates) in FIM_EOG {
        let id = match special_id(file, key, n_vocab)? {
            Some(id) => Some(id),
            None => candidates.iter().find_map(|t| texts.id_of(t)),
        };
        eog.extend(id);
    }
    for text in EOG_TEXTS {
        eog.extend(texts.id_of(text));
    }
    eog.sort_unstable();
    eog.dedup();
    Ok(eog)
}

/// llama.cpp's control-type overrides: every end-of-generation token and
/// every fill-in-the-middle text in [`FIM_CONTROL_TEXTS`] is a control
/// token whatever its stored type.
fn force_control_types(types: &mut [TokenType], eog: &[u32], texts: &TokenTexts) {
    let forced_control = eog
        .iter()
        .copied()
        .chain(FIM_CONTROL_TEXTS.iter().filter_map(|t| texts.id_of(t)));
    for id in forced_control {
        types[id as usize] = TokenType::Control;
    }
}

/// The bytes each token stands for, concatenated, and the offsets that cut
/// them apart (`bytes[offsets[i]..offsets[i + 1]]` is token `i`).
fn token_bytes_table(
    texts: &TokenTexts,
    types: &[TokenType],
    sentencepiece: bool,
) -> (Vec<u8>, Vec<usize>) {
    let n_vocab = types.len();
    let mut bytes = Vec::with_capacity(n_vocab * 8);
    let mut byte_offsets = Vec::with_capacity(n_vocab + 1);
    byte_offsets.push(0);
    for (text, ty) in texts.iter().zip(types) {
        match ty {
            TokenType::Normal if sentencepiece => {
                bytes.extend_from_slice(text.replace('\u{2581}', " ").as_bytes())
            }
            TokenType::Normal => byte_level::decode_text(text, &mut bytes),
            TokenType::Control | TokenType::UserDefined | TokenType::Unknown => {
                bytes.extend_from_slice(text.as_bytes())
            }
            TokenType::Byte => bytes.extend(parse_byte_token(text)),
            // llama.cpp renders these as nothing.
            TokenType::Unused | TokenType::Undefined => {}
        }
        byte_offsets.push(bytes.len());
    }
    (bytes, byte_offsets)
}

/// The token standing for each byte: `<0xXX>` (or the byte itself as text)
/// in SentencePiece vocabularies, the byte's GPT-2 character otherwise.
fn byte_token_ids(texts: &TokenTexts, sentencepiece: bool) -> [Option<u32>; 256] {
    let mut byte_ids = [None; 256];
    for (b, slot) in (0..=255u8).zip(byte_ids.iter_mut()) {
        *slot = if sentencepiece {
            texts.id_of(&format!("<0x{b:02X}>")).or_else(|| {
                // llama.cpp falls back to the byte itself as text.
                std::str::from_utf8(&[b]).ok().and_then(|t| texts.id_of(t))
            })
        } else {
            texts.id_of(byte_level::byte_to_char(b).encode_utf8(&mut [0; 4]))
        };
    }
    byte_ids
}

/// SentencePiece tables: `tokenizer.ggml.scores` (one per token) and
/// `tokenizer.ggml.add_space_prefix` (default on).
fn sentencepiece_kind(file: &GgufFile, n_vocab: usize) -> Result<Kind, TokenizerError> {
    let scores = match file.get_array("tokenizer.ggml.scores")? {
        MetaArray::F32(v) => v.clone(),
        _ => {
            return Err(TokenizerError::WrongArrayType {
                key: "tokenizer.ggml.scores",
                expected: "f32",
            })
        }
    };
    if scores.len() != n_vocab {
        return Err(TokenizerError::LengthMismatch {
            key: "tokenizer.ggml.scores",
            found: scores.len(),
            expected: n_vocab,
        });
    }
    let add_space_prefix = file
        .get_bool_opt("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    Ok(Kind::SentencePiece {
        scores,
        add_space_prefix,
    })
}

/// Byte-level BPE tables: the pre-tokenizer named `pre_name` and the merge
/// table from `tokenizer.ggml.merges` (empty when absent).
fn byte_level_kind(
    file: &GgufFile,
    pre_name: &str,
    llama3: bool,
    texts: &TokenTexts,
) -> Result<Kind, TokenizerError> {
    let pre = PreTokenizer::from_gguf_name(pre_name).ok_or_else(|| {
        TokenizerError::UnsupportedPreTokenizer {
            pre: pre_name.to_owned(),
        }
    })?;
    let merges = match file.get("tokenizer.ggml.merges") {
        None => MergeTable::default(),
        Some(_) => match file.get_array("tokenizer.ggml.merges")? {
            MetaArray::String(list) => build_merges(list, texts),
            _ => {
                return Err(TokenizerError::WrongArrayType {
                    key: "tokenizer.ggml.merges",
                    expected: "string",
                })
            }
        },
    };
    Ok(Kind::ByteLevel {
        merges,
        pre,
        ignore_merges: llama3,
    })
}

/// Every control, unknown and user-defined token text, longest first (ties
/// by id). Phi-3 models (recognised by `general.name`) drop whitespace
/// after most of them, as llama.cpp does.
fn special_texts(
    file: &GgufFile,
    texts: &TokenTexts,
    types: &[TokenType],
) -> Result<Vec<SpecialText>, TokenizerError> {
    let model_name = file
        .get_str_opt("general.name")?
        .unwrap_or_default()
        .to_lowercase();
    let phi3 = model_name.contains("phi-3") || model_name.contains("phi3");
    let mut specials: Vec<SpecialText> = texts
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (text, _))| !text.is_empty())
        .filter_map(|(id, (text, ty))| {
            let only_when_parsing = match ty {
                TokenType::Control | TokenType::Unknown => true,
                TokenType::UserDefined => false,
                _ => return None,
            };
            let rstrip = phi3 && !matches!(text, "<unk>" | "<s>" | "<|endoftext|>");
            Some(SpecialText {
                text: text.to_owned(),
                id: id as u32,
                only_when_parsing,
                rstrip,
            })
        })
        .collect();
    specials.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
    Ok(specials)
}

/// Builds the merge table from "left right" entries. Entries whose halves
/// or result are not tokens can never apply to token ids and are skipped.
fn build_merges(list: &[String], texts: &TokenTexts) -> MergeTable {
    let mut merges = MergeTable::with_capacity_and_hasher(list.len(), Default::default());
    let mut joined = String::new();
    for (rank, entry) in list.iter().enumerate() {
        // The separator is searched from the second byte on, so that a left
        // half that is itself a space still works.
        let Some(split) = entry.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
            continue;
        };
        let (left, right) = (&entry[..split], &entry[split + 1..]);
        joined.clear();
        joined.push_str(left);
        joined.push_str(right);
        let (Some(l), Some(r), Some(merged)) =
            (texts.id_of(left), texts.id_of(right), texts.id_of(&joined))
        else {
            continue;
        };
        let rank = u32::try_from(rank).unwrap_or(u32::MAX);
        merges
            .entry(pair_key(l, r))
            .or_insert(Merge { rank, merged });
    }
    merges
}

/// The byte of a `<0xXX>` token, if the text has that form.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A metadata value for the test GGUF writer.
    enum Value {
        Str(&'static str),
        U32(u32),
        Bool(bool),
        Strings(Vec<String>),
        I32s(Vec<i32>),
        F32s(Vec<f32>),
    }

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    /// A GGUF v3 file with no tensors and the given metadata.
    fn gguf(entries: &[(&str, Value)]) -> GgufFile {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
        out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        for (key, value) in entries {
            put_str(&mut out, key);
            match value {
                Value::Str(s) => {
                    out.extend_from_slice(&8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                Value::U32(v) => {
                    out.extend_from_slice(&4u32.to_le_bytes());
                    out.extend_from_slice(&v.to_le_bytes());
                }
                Value::Bool(b) => {
                    out.extend_from_slice(&7u32.to_le_bytes());
                    out.push(u8::from(*b));
                }
                Value::Strings(list) => {
                    out.extend_from_slice(&9u32.to_le_bytes());
                    out.extend_from_slice(&8u32.to_le_bytes());
                    out.extend_from_slice(&(list.len() as u64).to_le_bytes());
                    for s in list {
                        put_str(&mut out, s);
                    }
                }
                Value::I32s(list) => {
                    out.extend_from_slice(&9u32.to_le_bytes());
                    out.extend_from_slice(&5u32.to_le_bytes());
                    out.extend_from_slice(&(list.len() as u64).to_le_bytes());
                    for v in list {
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                }
                Value::F32s(list) => {
                    out.extend_from_slice(&9u32.to_le_bytes());
                    out.extend_from_slice(&6u32.to_le_bytes());
                    out.extend_from_slice(&(list.len() as u64).to_le_bytes());
                    for v in list {
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                }
            }
        }
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        GgufFile::from_bytes(out).expect("test GGUF must parse")
    }

    const EXTRA: &[(&str, i32)] = &[
        ("Ġt", 1),
        ("he", 1),
        ("Ġthe", 1),
        ("ll", 1),
        ("<|im_start|>", 3),
        ("<|im_end|>", 3),
        ("<tool>", 4),
        ("<|endoftext|>", 3),
    ];
    const MERGES: &[&str] = &["Ġ t", "h e", "Ġt he", "l l"];

    /// The 256 byte tokens (ids 0..=255 in byte order), then [`EXTRA`].
    fn vocab_entries() -> (Vec<String>, Vec<i32>) {
        let mut texts: Vec<String> = (0..=255u8)
            .map(|b| byte_level::byte_to_char(b).to_string())
            .collect();
        let mut types = vec![1; 256];
        for &(text, ty) in EXTRA {
            texts.push(text.to_owned());
            types.push(ty);
        }
        (texts, types)
    }

    fn tiny() -> Tokenizer {
        let (texts, types) = vocab_entries();
        let file = gguf(&[
            ("tokenizer.ggml.model", Value::Str("gpt2")),
            ("tokenizer.ggml.pre", Value::Str("smollm")),
            ("tokenizer.ggml.tokens", Value::Strings(texts)),
            ("tokenizer.ggml.token_type", Value::I32s(types)),
            (
                "tokenizer.ggml.merges",
                Value::Strings(MERGES.iter().map(|s| s.to_string()).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", Value::U32(261)),
            ("tokenizer.ggml.eos_token_id", Value::U32(261)),
            ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
            ("tokenizer.chat_template", Value::Str("{{ messages }}")),
        ]);
        Tokenizer::from_gguf(&file).expect("tiny vocabulary must load")
    }

    fn id(tok: &Tokenizer, text: &str) -> u32 {
        tok.token_id(text).expect("token must exist")
    }

    #[test]
    fn merges_by_rank() {
        let tok = tiny();
        let the = id(&tok, "Ġthe");
        assert_eq!(tok.encode(" the", false, false).unwrap(), [the]);
        assert_eq!(
            tok.encode("the", false, false).unwrap(),
            [u32::from(b't'), id(&tok, "he")]
        );
        assert_eq!(
            tok.encode("hello the", false, false).unwrap(),
            [id(&tok, "he"), id(&tok, "ll"), u32::from(b'o'), the]
        );
    }

    #[test]
    fn digits_are_single_tokens() {
        let tok = tiny();
        // Byte tokens have ids equal to their byte, so " " is 32.
        assert_eq!(
            tok.encode(" 42", false, false).unwrap(),
            [32, u32::from(b'4'), u32::from(b'2')]
        );
    }

    #[test]
    fn special_tokens_need_parse_special_but_user_defined_do_not() {
        let tok = tiny();
        let start = id(&tok, "<|im_start|>");
        let tool = id(&tok, "<tool>");
        let parsed = tok.encode("<|im_start|>the<tool>", false, true).unwrap();
        assert_eq!(parsed, [start, u32::from(b't'), id(&tok, "he"), tool]);
        let plain = tok.encode("<|im_start|>the<tool>", false, false).unwrap();
        assert!(!plain.contains(&start));
        assert_eq!(plain.last(), Some(&tool));
        assert_eq!(tok.decode(&plain).unwrap(), "<|im_start|>the<tool>");
    }

    #[test]
    fn add_special_respects_model_flags() {
        let tok = tiny();
        assert!(!tok.adds_bos());
        assert_eq!(tok.encode("a", true, false).unwrap(), [u32::from(b'a')]);
        assert!(tok.encode("", true, true).unwrap().is_empty());
    }

    #[test]
    fn decode_round_trips_and_reports_bad_ids() {
        let tok = tiny();
        for text in [
            "",
            " the hello",
            "naïve 東京 😀\n\n  x",
            "<|im_end|> 12 'll",
        ] {
            let ids = tok.encode(text, false, true).unwrap();
            assert_eq!(tok.decode(&ids).unwrap(), text);
        }
        let euro = tok.encode("€", false, false).unwrap();
        assert_eq!(euro.len(), 3);
        assert_eq!(tok.decode(&euro[..2]).unwrap(), "\u{fffd}");
        assert!(matches!(
            tok.decode(&[9999]),
            Err(TokenizerError::TokenOutOfRange { id: 9999, .. })
        ));
        assert_eq!(tok.token_bytes(u32::from(b' ')), Some(&b" "[..]));
        assert_eq!(tok.token_bytes(id(&tok, "Ġthe")), Some(&b" the"[..]));
    }

    #[test]
    fn special_token_facts() {
        let tok = tiny();
        let end = id(&tok, "<|im_end|>");
        let eot = id(&tok, "<|endoftext|>");
        assert_eq!(tok.vocab_size(), 256 + EXTRA.len());
        assert_eq!(tok.eos(), Some(261));
        assert_eq!(tok.bos(), Some(261));
        assert_eq!(tok.eog_tokens(), [end, eot]);
        assert!(tok.is_eog(end) && !tok.is_eog(id(&tok, "<|im_start|>")));
        assert!(tok.is_control(end));
        assert!(!tok.is_control(id(&tok, "<tool>")));
        assert!(!tok.is_control(u32::from(b'a')));
        assert_eq!(tok.chat_template(), Some("{{ messages }}"));
    }

    #[test]
    fn stream_decoder_matches_decode() {
        let tok = tiny();
        let text = "€ the 東京!";
        let ids = tok.encode(text, false, false).unwrap();
        let mut stream = StreamDecoder::new();
        let mut got = String::new();
        for &i in &ids {
            got.push_str(&stream.push(&tok, i).unwrap());
        }
        got.push_str(&stream.finish());
        assert_eq!(got, text);
    }

    #[test]
    fn rejects_unsupported_and_malformed_vocabularies() {
        let (texts, mut types) = vocab_entries();
        let file = gguf(&[
            ("tokenizer.ggml.model", Value::Str("bert")),
            ("tokenizer.ggml.tokens", Value::Strings(texts.clone())),
        ]);
        assert!(matches!(
            Tokenizer::from_gguf(&file),
            Err(TokenizerError::UnsupportedModel { model }) if model == "bert"
        ));

        let file = gguf(&[
            ("tokenizer.ggml.model", Value::Str("gpt2")),
            ("tokenizer.ggml.pre", Value::Str("gpt-4o")),
            ("tokenizer.ggml.tokens", Value::Strings(texts.clone())),
        ]);
        assert!(matches!(
            Tokenizer::from_gguf(&file),
            Err(TokenizerError::UnsupportedPreTokenizer { pre }) if pre == "gpt-4o"
        ));

        types.pop();
        let file = gguf(&[
            ("tokenizer.ggml.model", Value::Str("gpt2")),
            ("tokenizer.ggml.pre", Value::Str("gpt-2")),
            ("tokenizer.ggml.tokens", Value::Strings(texts.clone())),
            ("tokenizer.ggml.token_type", Value::I32s(types)),
        ]);
        assert!(matches!(
            Tokenizer::from_gguf(&file),
            Err(TokenizerError::LengthMismatch { found, expected, .. })
                if found + 1 == expected
        ));

        let file = gguf(&[
            ("tokenizer.ggml.model", Value::Str("gpt2")),
            ("tokenizer.ggml.pre", Value::Str("gpt-2")),
            ("tokenizer.ggml.tokens", Value::Strings(texts)),
            ("tokenizer.ggml.eos_token_id", Value::U32(100_000)),
        ]);
        assert!(matches!(
            Tokenizer::from_gguf(&file),
            Err(TokenizerError::SpecialIdOutOfRange { id: 100_000, .. })
        ));
    }

    /// A byte-level vocabulary with a whole-word token "hello" that the
    /// merges never build, under the given pre-tokenizer name.
    fn whole_word_vocab(pre: &'static str) -> Tokenizer {
        let (mut texts, mut types) = vocab_entries();
        texts.push("hello".to_owned());
        types.push(1);
        texts.push("<|begin_of_text|>".to_owned());
        types.push(3);
        let bos = (texts.len() - 1) as u32;
        let file = gguf(&[
            ("tokenizer.ggml.model", Value::Str("gpt2")),
            ("tokenizer.ggml.pre", Value::Str(pre)),
            ("tokenizer.ggml.tokens", Value::Strings(texts)),
            ("tokenizer.ggml.token_type", Value::I32s(types)),
            (
                "tokenizer.ggml.merges",
                Value::Strings(MERGES.iter().map(|s| s.to_string()).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", Value::U32(bos)),
        ]);
        Tokenizer::from_gguf(&file).expect("vocabulary loads")
    }

    #[test]
    fn llama3_takes_whole_words_and_adds_bos_by_default() {
        let llama3 = whole_word_vocab("llama-bpe");
        let hello = id(&llama3, "hello");
        let bos = id(&llama3, "<|begin_of_text|>");
        assert!(llama3.adds_bos());
        assert_eq!(llama3.encode("hello", false, false).unwrap(), [hello]);
        assert_eq!(llama3.encode("hello", true, false).unwrap(), [bos, hello]);
        // Other vocabularies merge by rank, and add no BOS unless told to.
        let qwen2 = whole_word_vocab("qwen2");
        assert!(!qwen2.adds_bos());
        assert_eq!(
            qwen2.encode("hello", false, false).unwrap(),
            [id(&qwen2, "he"), id(&qwen2, "ll"), u32::from(b'o')]
        );
    }

    #[test]
    fn missing_byte_token_is_an_error_not_a_panic() {
        let texts: Vec<String> = ["a", "b"].iter().map(|s| s.to_string()).collect();
        let file = gguf(&[
            ("tokenizer.ggml.model", Value::Str("gpt2")),
            ("tokenizer.ggml.pre", Value::Str("gpt-2")),
            ("tokenizer.ggml.tokens", Value::Strings(texts)),
        ]);
        let tok = Tokenizer::from_gguf(&file).unwrap();
        assert_eq!(tok.encode("ab", false, false).unwrap(), [0, 1]);
        assert!(matches!(
            tok.encode("c", false, false),
            Err(TokenizerError::MissingByteToken { byte: b'c' })
        ));
    }

    /// A SentencePiece vocabulary: <unk>, <s>, </s>, byte tokens for 'é'
    /// (0xC3 0xA9), then pieces with scores.
    fn tiny_spm() -> Tokenizer {
        let entries: &[(&str, f32, i32)] = &[
            ("<unk>", 0.0, 2),
            ("<s>", 0.0, 3),
            ("</s>", 0.0, 3),
            ("<0xC3>", 0.0, 6),
            ("<0xA9>", 0.0, 6),
            ("▁", -1.0, 1),
            ("h", -2.0, 1),
            ("i", -2.0, 1),
            ("▁h", -3.0, 1),
            ("hi", -1.5, 1),
            ("▁hi", -0.5, 1),
            ("x", -2.0, 1),
        ];
        let file = gguf(&[
            ("tokenizer.ggml.model", Value::Str("llama")),
            (
                "tokenizer.ggml.tokens",
                Value::Strings(entries.iter().map(|e| e.0.to_string()).collect()),
            ),
            (
                "tokenizer.ggml.scores",
                Value::F32s(entries.iter().map(|e| e.1).collect()),
            ),
            (
                "tokenizer.ggml.token_type",
                Value::I32s(entries.iter().map(|e| e.2).collect()),
            ),
        ]);
        Tokenizer::from_gguf(&file).expect("tiny SentencePiece vocabulary loads")
    }

    #[test]
    fn sentencepiece_encodes_with_space_prefix_and_byte_fallback() {
        let tok = tiny_spm();
        assert!(tok.adds_bos());
        assert_eq!(tok.bos(), Some(1));
        assert_eq!(tok.eos(), Some(2));
        // " hi" after the prefix: ▁hi outscores everything else.
        assert_eq!(tok.encode("hi", false, false).unwrap(), [10]);
        assert_eq!(tok.encode("hi", true, false).unwrap(), [1, 10]);
        // "é" has no piece: its bytes; "x hi" -> ▁ x ▁hi.
        assert_eq!(tok.encode("é", false, false).unwrap(), [5, 3, 4]);
        assert_eq!(tok.encode("x hi", false, false).unwrap(), [5, 11, 10]);
        // A special token is followed by a space prefix again.
        assert_eq!(tok.encode("hi</s>hi", false, true).unwrap(), [10, 2, 10]);
        assert!(matches!(
            tok.encode("q", false, false),
            Err(TokenizerError::MissingByteToken { byte: b'q' })
        ));
    }

    #[test]
    fn sentencepiece_decode_drops_the_prefix_space() {
        let tok = tiny_spm();
        for text in ["hi", "x hi", "é hi", " hi"] {
            let ids = tok.encode(text, false, false).unwrap();
            assert_eq!(tok.decode(&ids).unwrap(), text);
            let mut stream = StreamDecoder::new();
            let mut streamed = String::new();
            for &id in &ids {
                streamed.push_str(&stream.push(&tok, id).unwrap());
            }
            streamed.push_str(&stream.finish());
            assert_eq!(streamed, text);
        }
        assert_eq!(tok.token_bytes(10), Some(&b" hi"[..]));
        assert_eq!(tok.token_bytes(3), Some(&[0xC3][..]));
    }

    #[test]
    fn byte_token_text_parses() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xff>"), Some(255));
        assert_eq!(parse_byte_token("<0x1>"), None);
        assert_eq!(parse_byte_token("0x41"), None);
    }
}
