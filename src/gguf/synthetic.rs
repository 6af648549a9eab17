//! Small random llama models, written as complete GGUF images in the layout
//! llama.cpp uses for architecture `llama`: the same metadata keys, tensor
//! names, shapes and block formats as a converted checkpoint, with weights
//! drawn from a seeded generator. Tests that need a whole model (forward
//! pass determinism, loading, the CLI) build one here in milliseconds
//! instead of depending on a downloaded file.
//!
//! Weight scales keep activations finite through many layers: matrices are
//! uniform in ±0.5/sqrt(row length), embeddings in ±0.5, norm weights within
//! 0.1 of 1.0. Quantized weights are written as valid random blocks directly
//! (a random f16 scale, and minimum for Q4_1, with random quants), so no
//! quantizer is involved.
//!
//! The vocabulary is byte-level: token id `b` for `b` in 0..256 is the GPT-2
//! byte-encoder character of byte `b` (see [`gpt2_byte_char`]), followed by
//! the specials `<|endoftext|>`, `<|im_start|>` (BOS) and `<|im_end|>` (EOS),
//! then `[PADn]` fillers up to the vocabulary size. The merge list is empty,
//! and the chat template is plain ChatML.

use half::f16;
use thiserror::Error;

use super::value::{MetaArray, MetaValue};
use super::writer::GgufWriter;
use crate::quant::GgmlType;

/// The RMS-norm epsilon written to `llama.attention.layer_norm_rms_epsilon`.
pub const RMS_NORM_EPS: f32 = 1e-5;
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

/// Why a synthetic model configuration cannot be built.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SyntheticError {
    /// A size that must be positive is zero.
    #[error("{field} must be at least 1")]
    Zero { field: &'static str },
    /// The hidden size does not split evenly into heads.
    #[error("hidden size {hidden} is not a multiple of the head count {n_heads}")]
    HeadsDoNotDivideHidden { hidden: usize, n_heads: usize },
    /// Query heads cannot be shared evenly among the KV heads.
    #[error("head count {n_heads} is not a multiple of the KV head count {n_kv_heads}")]
    KvHeadsDoNotDivideHeads { n_heads: usize, n_kv_heads: usize },
    /// RoPE rotates pairs, so the head dimension must be even.
    #[error("head dimension {head_dim} is odd; RoPE needs pairs")]
    OddHeadDim { head_dim: usize },
    /// A row length is not a whole number of the weight type's blocks.
    #[error("{field} is {value}, not a multiple of the {ty} block length {block}")]
    NotWholeBlocks {
        field: &'static str,
        value: usize,
        ty: GgmlType,
        block: usize,
    },
    /// Too few token ids for the byte tokens and specials.
    #[error(
        "vocabulary size {vocab} is below the minimum {MIN_VOCAB} (256 byte tokens and 3 specials)"
    )]
    VocabTooSmall { vocab: usize },
    /// A size that llama.cpp stores as u32 does not fit one.
    #[error("{field} is {value}, more than a u32 holds")]
    TooLarge { field: &'static str, value: usize },
    /// Weights can only be written as F32, F16, Q8_0 or Q4_1.
    #[error("weight type {ty} is not supported here (use F32, F16, Q8_0 or Q4_1)")]
    UnsupportedWeightType { ty: GgmlType },
}

/// A llama model shape and the seed its weights are drawn from.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticLlama {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Embedding width.
    pub hidden: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Feed-forward width.
    pub ffn: usize,
    /// Vocabulary size, at least [`MIN_VOCAB`].
    pub vocab: usize,
    /// Context length written to the metadata.
    pub context: usize,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// Type of every matrix (norms are always F32): F32, F16, Q8_0 or Q4_1.
    pub weight_type: GgmlType,
    /// Whether the output projection reuses `token_embd.weight` (then no
    /// `output.weight` is written).
    pub tied_output: bool,
    /// Seed of the weights.
    pub seed: u64,
}

/// One entry of the tensor directory a configuration produces.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    /// llama.cpp tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Shape in ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Bytes the tensor occupies.
    pub byte_len: usize,
}

impl SyntheticLlama {
    /// A two-layer model small enough for unit tests (hidden 64, 4 query
    /// heads of 16, 2 KV heads, FFN 128, vocabulary 320), F32 weights.
    pub fn tiny() -> Self {
        Self {
            n_layers: 2,
            hidden: 64,
            n_heads: 4,
            n_kv_heads: 2,
            ffn: 128,
            vocab: 320,
            context: 256,
            rope_base: 10_000.0,
            weight_type: GgmlType::F32,
            tied_output: false,
            seed: 1,
        }
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.n_heads.max(1)
    }

    /// Width of the key and value projections.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim()
    }

    /// Checks that the shape is buildable.
    pub fn validate(&self) -> Result<(), SyntheticError> {
        for (field, value) in [
            ("n_layers", self.n_layers),
            ("hidden", self.hidden),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("ffn", self.ffn),
            ("context", self.context),
        ] {
            if value == 0 {
                return Err(SyntheticError::Zero { field });
            }
            if u32::try_from(value).is_err() {
                return Err(SyntheticError::TooLarge { field, value });
            }
        }
        if self.vocab < MIN_VOCAB {
            return Err(SyntheticError::VocabTooSmall { vocab: self.vocab });
        }
        if u32::try_from(self.vocab).is_err() {
            return Err(SyntheticError::TooLarge {
                field: "vocab",
                value: self.vocab,
            });
        }
        if !self.hidden.is_multiple_of(self.n_heads) {
            return Err(SyntheticError::HeadsDoNotDivideHidden {
                hidden: self.hidden,
                n_heads: self.n_heads,
            });
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(SyntheticError::KvHeadsDoNotDivideHeads {
                n_heads: self.n_heads,
                n_kv_heads: self.n_kv_heads,
            });
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(SyntheticError::OddHeadDim {
                head_dim: self.head_dim(),
            });
        }
        let ty = self.weight_type;
        if !matches!(
            ty,
            GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0 | GgmlType::Q4_1
        ) {
            return Err(SyntheticError::UnsupportedWeightType { ty });
        }
        let block = ty.block_len();
        for (field, value) in [("hidden", self.hidden), ("ffn", self.ffn)] {
            if value % block != 0 {
                return Err(SyntheticError::NotWholeBlocks {
                    field,
                    value,
                    ty,
                    block,
                });
            }
        }
        Ok(())
    }

    /// Every tensor the model has, in file order, with shapes and sizes.
    pub fn tensor_specs(&self) -> Result<Vec<TensorSpec>, SyntheticError> {
        self.validate()?;
        let (h, ffn, kv, vocab) = (self.hidden, self.ffn, self.kv_dim(), self.vocab);
        let w = self.weight_type;
        let spec = |name: String, dims: &[usize], ty: GgmlType| {
            let rows: usize = dims[1..].iter().product();
            TensorSpec {
                name,
                dims: dims.iter().map(|&d| d as u64).collect(),
                ty,
                byte_len: rows * (dims[0] / ty.block_len()) * ty.block_bytes(),
            }
        };
        let mut specs = vec![spec("token_embd.weight".into(), &[h, vocab], w)];
        for layer in 0..self.n_layers {
            let name = |part: &str| format!("blk.{layer}.{part}.weight");
            specs.extend([
                spec(name("attn_norm"), &[h], GgmlType::F32),
                spec(name("attn_q"), &[h, h], w),
                spec(name("attn_k"), &[h, kv], w),
                spec(name("attn_v"), &[h, kv], w),
                spec(name("attn_output"), &[h, h], w),
                spec(name("ffn_norm"), &[h], GgmlType::F32),
                spec(name("ffn_gate"), &[h, ffn], w),
                spec(name("ffn_up"), &[h, ffn], w),
                spec(name("ffn_down"), &[ffn, h], w),
            ]);
        }
        specs.push(spec("output_norm.weight".into(), &[h], GgmlType::F32));
        if !self.tied_output {
            specs.push(spec("output.weight".into(), &[h, vocab], w));
        }
        Ok(specs)
    }

    /// The complete GGUF image.
    pub fn try_build(&self) -> Result<Vec<u8>, SyntheticError> {
        let specs = self.tensor_specs()?;
        let mut w = GgufWriter::new(3);
        self.add_model_metadata(&mut w);
        add_tokenizer_metadata(&mut w, self.vocab);
        for spec in specs {
            let bytes = self.tensor_bytes(&spec);
            w.add_tensor(spec.name, &spec.dims, spec.ty, bytes);
        }
        Ok(w.to_bytes())
    }

    /// The complete GGUF image.
    ///
    /// # Panics
    /// If the configuration is invalid (see [`validate`](Self::validate));
    /// use [`try_build`](Self::try_build) to get the error instead.
    pub fn build(&self) -> Vec<u8> {
        match self.try_build() {
            Ok(bytes) => bytes,
            Err(e) => panic!("invalid synthetic llama configuration: {e}"),
        }
    }

    fn add_model_metadata(&self, w: &mut GgufWriter) {
        // Validated to fit in u32 before any tensor or key is written.
        let u32_of = |n: usize| MetaValue::U32(n as u32);
        w.add_meta("general.architecture", MetaValue::String("llama".into()))
            .add_meta("general.name", MetaValue::String("synthetic-llama".into()))
            .add_meta("llama.block_count", u32_of(self.n_layers))
            .add_meta("llama.context_length", u32_of(self.context))
            .add_meta("llama.embedding_length", u32_of(self.hidden))
            .add_meta("llama.feed_forward_length", u32_of(self.ffn))
            .add_meta("llama.attention.head_count", u32_of(self.n_heads))
            .add_meta("llama.attention.head_count_kv", u32_of(self.n_kv_heads))
            .add_meta("llama.rope.freq_base", MetaValue::F32(self.rope_base))
            .add_meta(
                "llama.attention.layer_norm_rms_epsilon",
                MetaValue::F32(RMS_NORM_EPS),
            )
            .add_meta("llama.rope.dimension_count", u32_of(self.head_dim()))
            .add_meta("llama.vocab_size", u32_of(self.vocab));
    }

    /// Random weights for one tensor, seeded by the model seed and the name
    /// so each tensor is independent of the others and of their order.
    fn tensor_bytes(&self, spec: &TensorSpec) -> Vec<u8> {
        let mut rng = SplitMix64::new(self.seed ^ fnv1a(spec.name.as_bytes()));
        let count: usize = spec.dims.iter().map(|&d| d as usize).product();
        let is_norm = spec.dims.len() == 1;
        let is_vocab_matrix = spec.name == "token_embd.weight" || spec.name == "output.weight";
        if is_norm {
            return (0..count)
                .flat_map(|_| (1.0 + 0.1 * rng.next_signed_unit()).to_le_bytes())
                .collect();
        }
        let scale = if is_vocab_matrix {
            0.5
        } else {
            0.5 / (spec.dims[0] as f32).sqrt()
        };
        random_weights(&mut rng, spec.ty, count, scale)
    }
}

fn add_tokenizer_metadata(w: &mut GgufWriter, vocab: usize) {
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

/// `count` values uniform in about ±`scale`, encoded as `ty`.
fn random_weights(rng: &mut SplitMix64, ty: GgmlType, count: usize, scale: f32) -> Vec<u8> {
    let mut out = Vec::with_capacity(count / ty.block_len() * ty.block_bytes());
    match ty {
        GgmlType::F16 => {
            for _ in 0..count {
                out.extend(f16::from_f32(scale * rng.next_signed_unit()).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            // Block of 32: f16 scale d, then 32 i8 quants; x = d * q.
            for _ in 0..count / 32 {
                let d = scale / 127.0 * (0.5 + 0.5 * rng.next_unit());
                out.extend(f16::from_f32(d).to_le_bytes());
                // -127..=127: ggml never produces -128.
                out.extend((0..32).map(|_| ((rng.next_u64() % 255) as i32 - 127) as i8 as u8));
            }
        }
        GgmlType::Q4_1 => {
            // Block of 32: f16 scale d, f16 minimum m, then 16 bytes of
            // 4-bit quants (element j low nibble, j + 16 high); x = d * q + m.
            for _ in 0..count / 32 {
                let spread = scale * (0.5 + 0.5 * rng.next_unit());
                out.extend(f16::from_f32(2.0 * spread / 15.0).to_le_bytes());
                out.extend(f16::from_f32(-spread).to_le_bytes());
                out.extend((0..16).map(|_| rng.next_u64() as u8));
            }
        }
        // Validated: only F32 remains.
        _ => {
            for _ in 0..count {
                out.extend((scale * rng.next_signed_unit()).to_le_bytes());
            }
        }
    }
    out
}

/// A small, fast, well-mixed generator; its stream is fixed forever so a
/// seed names the same model in every build.
struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-1, 1).
    fn next_signed_unit(&mut self) -> f32 {
        2.0 * self.next_unit() - 1.0
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    fn parse(model: &SyntheticLlama) -> GgufFile {
        GgufFile::from_bytes(model.build()).unwrap()
    }

    #[test]
    fn byte_encoder_matches_gpt2() {
        assert_eq!(gpt2_byte_char(b'A'), 'A');
        assert_eq!(gpt2_byte_char(b' '), 'Ġ');
        assert_eq!(gpt2_byte_char(b'\n'), 'Ċ');
        assert_eq!(gpt2_byte_char(0), 'Ā');
        assert_eq!(gpt2_byte_char(0x7F), 'ġ');
        assert_eq!(gpt2_byte_char(0xAD), 'Ń');
        assert_eq!(gpt2_byte_char(0xFF), 'ÿ');
        let distinct: std::collections::HashSet<char> = (0..=255u8).map(gpt2_byte_char).collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn every_weight_type_builds_the_full_directory() {
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_1] {
            for tied_output in [false, true] {
                let model = SyntheticLlama {
                    weight_type: ty,
                    tied_output,
                    ..SyntheticLlama::tiny()
                };
                let file = parse(&model);
                let specs = model.tensor_specs().unwrap();
                assert_eq!(
                    specs.len(),
                    1 + 9 * model.n_layers + 1 + usize::from(!tied_output)
                );
                assert_eq!(file.tensors().len(), specs.len());
                for spec in &specs {
                    let t = file.require_tensor(&spec.name).unwrap();
                    assert_eq!(t.dims, spec.dims, "{}", spec.name);
                    assert_eq!(t.ty, spec.ty, "{}", spec.name);
                    assert_eq!(t.byte_len, spec.byte_len, "{}", spec.name);
                }
                assert_eq!(file.tensor("output.weight").is_some(), !tied_output);
            }
        }
    }

    #[test]
    fn shapes_follow_llama_cpp() {
        let model = SyntheticLlama {
            weight_type: GgmlType::Q4_1,
            ..SyntheticLlama::tiny()
        };
        let file = parse(&model);
        let dims = |name: &str| file.require_tensor(name).unwrap().dims.clone();
        assert_eq!(dims("token_embd.weight"), [64, 320]);
        assert_eq!(dims("blk.1.attn_q.weight"), [64, 64]);
        assert_eq!(dims("blk.1.attn_k.weight"), [64, 32]);
        assert_eq!(dims("blk.1.attn_v.weight"), [64, 32]);
        assert_eq!(dims("blk.1.ffn_gate.weight"), [64, 128]);
        assert_eq!(dims("blk.1.ffn_down.weight"), [128, 64]);
        assert_eq!(dims("output_norm.weight"), [64]);
        let q = file.require_tensor("blk.0.attn_q.weight").unwrap();
        assert_eq!(q.byte_len, 64 * 2 * 20);
        assert_eq!(
            file.require_tensor("blk.0.ffn_norm.weight").unwrap().ty,
            GgmlType::F32
        );
    }

    #[test]
    fn metadata_matches_the_configuration() {
        let model = SyntheticLlama::tiny();
        let file = parse(&model);
        assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
        for (key, want) in [
            ("llama.block_count", 2),
            ("llama.context_length", 256),
            ("llama.embedding_length", 64),
            ("llama.feed_forward_length", 128),
            ("llama.attention.head_count", 4),
            ("llama.attention.head_count_kv", 2),
            ("llama.rope.dimension_count", 16),
            ("llama.vocab_size", 320),
            ("tokenizer.ggml.bos_token_id", 257),
            ("tokenizer.ggml.eos_token_id", 258),
        ] {
            assert_eq!(file.get_u64(key).unwrap(), want, "{key}");
        }
        assert_eq!(file.get_f32("llama.rope.freq_base").unwrap(), 10_000.0);
        assert_eq!(
            file.get_f32("llama.attention.layer_norm_rms_epsilon")
                .unwrap(),
            1e-5
        );
        assert_eq!(file.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
        let MetaArray::String(tokens) = file.get_array("tokenizer.ggml.tokens").unwrap() else {
            panic!("tokens are not strings");
        };
        assert_eq!(tokens.len(), 320);
        assert_eq!(tokens[32], "Ġ");
        assert_eq!(tokens[257], "<|im_start|>");
        assert_eq!(tokens[319], "[PAD319]");
        let MetaArray::I32(types) = file.get_array("tokenizer.ggml.token_type").unwrap() else {
            panic!("token types are not i32");
        };
        assert_eq!((types[0], types[258], types[259]), (1, 3, 5));
        assert!(file.get_array("tokenizer.ggml.merges").unwrap().is_empty());
        assert_eq!(
            file.get_bool_opt("tokenizer.ggml.add_bos_token").unwrap(),
            Some(false)
        );
        let template = file.get_str("tokenizer.chat_template").unwrap();
        assert!(template
            .contains("<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"));
    }

    #[test]
    fn weights_are_deterministic_and_in_range() {
        let model = SyntheticLlama::tiny();
        assert_eq!(model.build(), model.build());
        assert_ne!(
            model.build(),
            SyntheticLlama {
                seed: 2,
                ..model.clone()
            }
            .build()
        );

        let file = parse(&model);
        let floats = |name: &str| -> Vec<f32> {
            let bytes = file.tensor_data(name).unwrap();
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let norm = floats("blk.0.attn_norm.weight");
        assert!(norm.iter().all(|&x| (0.9..=1.1).contains(&x)));
        let q = floats("blk.0.attn_q.weight");
        let bound = 0.5 / 8.0;
        assert!(q.iter().all(|&x| x.abs() <= bound));
        assert!(q.iter().any(|&x| x.abs() > bound / 2.0));
        assert_ne!(floats("blk.0.attn_k.weight"), floats("blk.1.attn_k.weight"));
    }

    #[test]
    fn quantized_blocks_decode_within_scale() {
        let q8 = SyntheticLlama {
            weight_type: GgmlType::Q8_0,
            ..SyntheticLlama::tiny()
        };
        let file = parse(&q8);
        let bound = 0.5 / 8.0 + 1e-3;
        for block in file
            .tensor_data("blk.0.attn_q.weight")
            .unwrap()
            .chunks_exact(34)
        {
            let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
            assert!(d > 0.0 && d.is_finite());
            assert!(block[2..].iter().all(|&q| q as i8 != i8::MIN));
            assert!(block[2..]
                .iter()
                .all(|&q| (d * f32::from(q as i8)).abs() <= bound));
        }
        let q4 = SyntheticLlama {
            weight_type: GgmlType::Q4_1,
            ..SyntheticLlama::tiny()
        };
        let file = parse(&q4);
        for block in file
            .tensor_data("blk.0.ffn_up.weight")
            .unwrap()
            .chunks_exact(20)
        {
            let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
            let m = f16::from_le_bytes([block[2], block[3]]).to_f32();
            for &byte in &block[4..] {
                for q in [byte & 0x0F, byte >> 4] {
                    assert!((d * f32::from(q) + m).abs() <= bound);
                }
            }
        }
    }

    #[test]
    fn invalid_configurations_are_errors() {
        let tiny = SyntheticLlama::tiny();
        let cases = [
            (
                SyntheticLlama {
                    n_layers: 0,
                    ..tiny.clone()
                },
                SyntheticError::Zero { field: "n_layers" },
            ),
            (
                SyntheticLlama {
                    n_heads: 3,
                    ..tiny.clone()
                },
                SyntheticError::HeadsDoNotDivideHidden {
                    hidden: 64,
                    n_heads: 3,
                },
            ),
            (
                SyntheticLlama {
                    n_kv_heads: 3,
                    ..tiny.clone()
                },
                SyntheticError::KvHeadsDoNotDivideHeads {
                    n_heads: 4,
                    n_kv_heads: 3,
                },
            ),
            (
                SyntheticLlama {
                    vocab: 258,
                    ..tiny.clone()
                },
                SyntheticError::VocabTooSmall { vocab: 258 },
            ),
            (
                SyntheticLlama {
                    ffn: 48,
                    weight_type: GgmlType::Q8_0,
                    ..tiny.clone()
                },
                SyntheticError::NotWholeBlocks {
                    field: "ffn",
                    value: 48,
                    ty: GgmlType::Q8_0,
                    block: 32,
                },
            ),
            (
                SyntheticLlama {
                    weight_type: GgmlType::Q4_K,
                    ..tiny.clone()
                },
                SyntheticError::UnsupportedWeightType { ty: GgmlType::Q4_K },
            ),
            (
                SyntheticLlama {
                    hidden: 12,
                    n_heads: 4,
                    n_kv_heads: 4,
                    ..tiny.clone()
                },
                SyntheticError::OddHeadDim { head_dim: 3 },
            ),
        ];
        for (model, want) in cases {
            assert_eq!(model.try_build(), Err(want));
        }
    }
}
