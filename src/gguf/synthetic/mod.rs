//! Random-weight models in the layout llama.cpp writes, made by inferd
//! alone: for tests, and for machines that cannot download a model.
//!
//! A synthetic model has the metadata keys, tensor names, shapes and block
//! formats of a converted checkpoint of its architecture (`llama`, `qwen2`,
//! `qwen3` or `gemma3`: every one the loader runs), with weights drawn from
//! a seeded generator. [`SyntheticLlama`] is the small llama tests build in
//! milliseconds; [`SyntheticModel`] is any shape, the real checkpoints' by
//! name ([`NAMED_SHAPES`]: SmolLM2-135M, Gemma 3 270M, Qwen2.5-0.5B,
//! Qwen3-0.6B, Llama 3.2 1B, Mistral 7B), in any block type the matrix
//! kernels multiply or a mixed recipe such as Q4_K_M ([`TypeRecipe`]), and
//! streams to disk tensor by tensor (`inferd make-model`).
//!
//! Weight scales keep activations finite through many layers: matrices are
//! uniform in ±0.5/sqrt(row length), embeddings in ±0.5, norm weights within
//! 0.1 of 1.0. Quantized weights are written as valid random blocks directly
//! (`blocks.rs`), so no quantizer is involved.
//!
//! The vocabulary is byte-level: token id `b` for `b` in 0..256 is the GPT-2
//! byte-encoder character of byte `b` (see [`gpt2_byte_char`]), followed by
//! the specials `<|endoftext|>`, `<|im_start|>` (BOS) and `<|im_end|>` (EOS),
//! then `[PADn]` fillers up to the vocabulary size. The merge list is empty,
//! and the chat template is plain ChatML.

mod blocks;
mod model;
mod recipe;
mod rng;
mod shapes;
mod vocab;

#[cfg(test)]
mod shape_tests;
#[cfg(test)]
mod tests;

use thiserror::Error;

use crate::quant::GgmlType;

pub use blocks::WEIGHT_TYPES;
pub use model::{SyntheticModel, WriteError};
pub use recipe::{TypeRecipe, RECIPE_NAMES};
pub use shapes::{named_shape, Llama3Rope, ModelShape, NamedShape, SyntheticArch, NAMED_SHAPES};
pub use vocab::{gpt2_byte_char, BOS_TOKEN_ID, ENDOFTEXT_TOKEN_ID, EOS_TOKEN_ID, MIN_VOCAB};

/// The RMS-norm epsilon written to `llama.attention.layer_norm_rms_epsilon`.
pub const RMS_NORM_EPS: f32 = 1e-5;

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
    /// Weights can only be written in a format with a matrix kernel.
    #[error(
        "weight type {ty} has no matrix kernel (use one of {})",
        weight_type_list()
    )]
    UnsupportedWeightType { ty: GgmlType },
    /// No shape has this name.
    #[error("no shape is named '{name}' (known: {})", shape_list())]
    UnknownShape { name: String },
}

fn weight_type_list() -> String {
    WEIGHT_TYPES.map(|t| t.name()).join(", ")
}

fn shape_list() -> String {
    NAMED_SHAPES.map(|s| s.name).join(", ")
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
    /// Type of every matrix (norms are always F32): any of [`WEIGHT_TYPES`].
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

    /// The same model as a [`SyntheticModel`]: architecture `llama`, every
    /// matrix exactly `weight_type`.
    pub fn to_model(&self) -> SyntheticModel {
        SyntheticModel {
            name: "synthetic-llama".into(),
            shape: ModelShape {
                arch: SyntheticArch::Llama,
                n_layers: self.n_layers,
                hidden: self.hidden,
                n_heads: self.n_heads,
                n_kv_heads: self.n_kv_heads,
                head_dim: None,
                ffn: self.ffn,
                vocab: self.vocab,
                context: self.context,
                rope_base: self.rope_base,
                rms_eps: RMS_NORM_EPS,
                tied_output: self.tied_output,
                llama3_rope: None,
                sliding_window: None,
            },
            recipe: TypeRecipe::Exact(self.weight_type),
            seed: self.seed,
        }
    }

    /// Checks that the shape is buildable.
    pub fn validate(&self) -> Result<(), SyntheticError> {
        self.to_model().validate()
    }

    /// Every tensor the model has, in file order, with shapes and sizes.
    pub fn tensor_specs(&self) -> Result<Vec<TensorSpec>, SyntheticError> {
        self.to_model().tensor_specs()
    }

    /// The complete GGUF image.
    pub fn try_build(&self) -> Result<Vec<u8>, SyntheticError> {
        self.to_model().try_build()
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
}
