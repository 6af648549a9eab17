//! A synthetic model of any supported architecture and weight recipe: its
//! tensor directory, metadata, and bytes, in memory or streamed to a writer.

use std::io::{self, Write};

use thiserror::Error;

use super::blocks::{random_weights, write_random};
use super::recipe::{Place, Role, TypeRecipe};
use super::rng::SplitMix64;
use super::shapes::{named_shape, ModelShape};
use super::vocab::{add_tokenizer_metadata, MIN_VOCAB};
use super::{SyntheticError, TensorSpec};
use crate::gguf::{GgufWriter, MetaValue};
use crate::quant::GgmlType;

/// `general.quantization_version`: the block layouts of ggml's current
/// quantization format, which these blocks follow.
const QUANTIZATION_VERSION: u32 = 2;

/// A model to write: a shape, how its matrices are stored, and the seed its
/// weights are drawn from.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticModel {
    /// `general.name`.
    pub name: String,
    pub shape: ModelShape,
    pub recipe: TypeRecipe,
    /// Seed of the weights; each tensor draws from its own stream (the seed
    /// and its name), so a model cut to fewer layers keeps its first ones.
    pub seed: u64,
}

/// Why a model could not be written.
#[derive(Debug, Error)]
pub enum WriteError {
    #[error(transparent)]
    Invalid(#[from] SyntheticError),
    #[error("writing the model: {0}")]
    Io(#[from] io::Error),
}

/// What a tensor holds, which decides how its values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Content {
    /// Uniform in ±`scale`.
    Weights { scale: f32 },
    /// Within 0.1 of 1.
    Norm,
    /// Llama 3 RoPE divisors.
    RopeFreqs,
}

/// One tensor: its directory entry and its content.
struct Planned {
    spec: TensorSpec,
    content: Content,
}

impl SyntheticModel {
    /// The shape named `shape` (see [`NAMED_SHAPES`](super::NAMED_SHAPES))
    /// with its real depth and vocabulary.
    pub fn named(shape: &str, recipe: TypeRecipe, seed: u64) -> Result<Self, SyntheticError> {
        let named = named_shape(shape).ok_or_else(|| SyntheticError::UnknownShape {
            name: shape.to_owned(),
        })?;
        Ok(Self {
            name: format!("{} shape, random weights", named.checkpoint),
            shape: named.shape.clone(),
            recipe,
            seed,
        })
    }

    /// Checks that the model can be built.
    pub fn validate(&self) -> Result<(), SyntheticError> {
        self.plan().map(|_| ())
    }

    /// Every tensor the model has, in file order, with shapes, types and sizes.
    pub fn tensor_specs(&self) -> Result<Vec<TensorSpec>, SyntheticError> {
        Ok(self.plan()?.into_iter().map(|p| p.spec).collect())
    }

    /// The model's own metadata (the `general.*` keys and the
    /// architecture's), without the vocabulary's.
    pub fn metadata(&self) -> Vec<(String, MetaValue)> {
        let s = &self.shape;
        let p = s.arch.name();
        // The sizes fit in u32 in any model that validates (every file
        // written is validated first).
        let u32_of = |n: usize| MetaValue::U32(n as u32);
        let mut meta = vec![
            (
                "general.architecture".to_owned(),
                MetaValue::String(p.into()),
            ),
            (
                "general.name".to_owned(),
                MetaValue::String(self.name.clone()),
            ),
        ];
        let mut key = |k: &str, v: MetaValue| meta.push((format!("{p}.{k}"), v));
        key("block_count", u32_of(s.n_layers));
        key("context_length", u32_of(s.context));
        key("embedding_length", u32_of(s.hidden));
        key("feed_forward_length", u32_of(s.ffn));
        key("attention.head_count", u32_of(s.n_heads));
        key("attention.head_count_kv", u32_of(s.n_kv_heads));
        key("rope.freq_base", MetaValue::F32(s.rope_base));
        key(
            "attention.layer_norm_rms_epsilon",
            MetaValue::F32(s.rms_eps),
        );
        if s.arch.llama_keys() {
            key("rope.dimension_count", u32_of(s.head_dim()));
            key("vocab_size", u32_of(s.vocab));
        }
        if let Some(hd) = s.head_dim {
            key("attention.key_length", u32_of(hd));
            key("attention.value_length", u32_of(hd));
        }
        if let Some(window) = s.sliding_window {
            key("attention.sliding_window", u32_of(window));
        }
        if let Some(file_type) = self.recipe.file_type() {
            meta.push(("general.file_type".to_owned(), MetaValue::U32(file_type)));
            meta.push((
                "general.quantization_version".to_owned(),
                MetaValue::U32(QUANTIZATION_VERSION),
            ));
        }
        meta
    }

    /// The complete GGUF image, in memory.
    pub fn try_build(&self) -> Result<Vec<u8>, SyntheticError> {
        let plan = self.plan()?;
        let mut w = self.writer();
        for p in &plan {
            let bytes = self.tensor_bytes(p);
            w.add_tensor(&p.spec.name, &p.spec.dims, p.spec.ty, bytes);
        }
        Ok(w.to_bytes())
    }

    /// Writes the GGUF image to `out` tensor by tensor (at most one chunk
    /// of a tensor is in memory at a time) and returns its length.
    pub fn write_to<W: Write>(&self, out: &mut W) -> Result<u64, WriteError> {
        let plan = self.plan()?;
        let mut w = self.writer();
        for p in &plan {
            w.add_tensor_streamed(
                &p.spec.name,
                &p.spec.dims,
                p.spec.ty,
                p.spec.byte_len as u64,
            );
        }
        Ok(w.write_streaming(out, |i, sink| self.write_tensor(&plan[i], sink))?)
    }

    /// A writer holding the metadata, vocabulary included.
    fn writer(&self) -> GgufWriter {
        let mut w = GgufWriter::new(3);
        for (k, v) in self.metadata() {
            w.add_meta(k, v);
        }
        add_tokenizer_metadata(&mut w, self.shape.vocab);
        w
    }

    fn tensor_bytes(&self, p: &Planned) -> Vec<u8> {
        let mut rng = SplitMix64::for_tensor(self.seed, &p.spec.name);
        match p.content {
            Content::Weights { scale } => {
                random_weights(&mut rng, p.spec.ty, count(&p.spec), scale)
            }
            _ => self.f32_content(p, &mut rng),
        }
    }

    fn write_tensor(&self, p: &Planned, out: &mut dyn Write) -> io::Result<()> {
        let mut rng = SplitMix64::for_tensor(self.seed, &p.spec.name);
        match p.content {
            Content::Weights { scale } => {
                write_random(&mut rng, p.spec.ty, count(&p.spec), scale, out)
            }
            _ => out.write_all(&self.f32_content(p, &mut rng)),
        }
    }

    /// Norms and RoPE factors (F32, and small).
    fn f32_content(&self, p: &Planned, rng: &mut SplitMix64) -> Vec<u8> {
        let values: Vec<f32> = match (p.content, self.shape.llama3_rope) {
            (Content::RopeFreqs, Some(rope)) => {
                rope.factors(self.shape.head_dim(), self.shape.rope_base)
            }
            _ => (0..count(&p.spec))
                .map(|_| 1.0 + 0.1 * rng.next_signed_unit())
                .collect(),
        };
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// Checks the shape, then lays out every tensor with its type.
    fn plan(&self) -> Result<Vec<Planned>, SyntheticError> {
        self.check_shape()?;
        if !self.recipe.is_supported() {
            return Err(SyntheticError::UnsupportedWeightType {
                ty: self.recipe.base(),
            });
        }
        let s = &self.shape;
        let (h, q, kv, ffn, hd) = (s.hidden, s.q_dim(), s.kv_dim(), s.ffn, s.head_dim());
        let arch = s.arch;
        // Each matrix's row, named as validation errors name it.
        let (by_hidden, by_q, by_ffn) = (("hidden", h), ("q_dim", q), ("ffn", ffn));
        let mut plan = Vec::new();
        let matrix =
            |name: String, role: Role, layer: usize, row: (&'static str, usize), rows: usize| {
                let place = Place {
                    role,
                    layer,
                    n_layers: s.n_layers,
                    gqa: s.n_heads / s.n_kv_heads,
                    tied_output: s.tied_output,
                    row_len: row.1,
                };
                let ty = self.recipe.tensor_type(&place);
                let scale = match role {
                    Role::TokenEmbd | Role::Output => 0.5,
                    _ => 0.5 / (row.1 as f32).sqrt(),
                };
                planned(name, &[row.1, rows], ty, Content::Weights { scale }, row.0)
            };
        plan.push(matrix(
            "token_embd.weight".into(),
            Role::TokenEmbd,
            0,
            by_hidden,
            s.vocab,
        )?);
        if s.llama3_rope.is_some() {
            plan.push(vector(
                "rope_freqs.weight".into(),
                hd / 2,
                Content::RopeFreqs,
            ));
        }
        for l in 0..s.n_layers {
            let name = |part: &str| format!("blk.{l}.{part}");
            let norm = |part: &str, len| vector(name(part), len, Content::Norm);
            let bias = |part: &str, len| vector(name(part), len, Content::Weights { scale: 0.5 });
            let layer_matrix = |part: &str, role, row, rows| matrix(name(part), role, l, row, rows);
            plan.push(norm("attn_norm.weight", h));
            plan.push(layer_matrix("attn_q.weight", Role::Other, by_hidden, q)?);
            if arch.qkv_bias() {
                plan.push(bias("attn_q.bias", q));
            }
            plan.push(layer_matrix("attn_k.weight", Role::Other, by_hidden, kv)?);
            if arch.qkv_bias() {
                plan.push(bias("attn_k.bias", kv));
            }
            plan.push(layer_matrix("attn_v.weight", Role::AttnV, by_hidden, kv)?);
            if arch.qkv_bias() {
                plan.push(bias("attn_v.bias", kv));
            }
            if arch.qk_norm() {
                plan.push(norm("attn_q_norm.weight", hd));
                plan.push(norm("attn_k_norm.weight", hd));
            }
            plan.push(layer_matrix("attn_output.weight", Role::Other, by_q, h)?);
            if arch.post_norms() {
                plan.push(norm("post_attention_norm.weight", h));
            }
            plan.push(norm("ffn_norm.weight", h));
            plan.push(layer_matrix(
                "ffn_gate.weight",
                Role::Other,
                by_hidden,
                ffn,
            )?);
            plan.push(layer_matrix("ffn_up.weight", Role::Other, by_hidden, ffn)?);
            plan.push(layer_matrix("ffn_down.weight", Role::FfnDown, by_ffn, h)?);
            if arch.post_norms() {
                plan.push(norm("post_ffw_norm.weight", h));
            }
        }
        plan.push(vector("output_norm.weight".into(), h, Content::Norm));
        if !s.tied_output {
            plan.push(matrix(
                "output.weight".into(),
                Role::Output,
                0,
                by_hidden,
                s.vocab,
            )?);
        }
        Ok(plan)
    }

    /// The sizes: positive, within u32, heads that group evenly, a vocabulary
    /// that holds the byte tokens.
    fn check_shape(&self) -> Result<(), SyntheticError> {
        let s = &self.shape;
        let mut sizes = vec![
            ("n_layers", s.n_layers),
            ("hidden", s.hidden),
            ("n_heads", s.n_heads),
            ("n_kv_heads", s.n_kv_heads),
            ("ffn", s.ffn),
            ("context", s.context),
        ];
        if let Some(hd) = s.head_dim {
            sizes.push(("head_dim", hd));
        }
        if let Some(w) = s.sliding_window {
            sizes.push(("sliding_window", w));
        }
        for (field, value) in sizes {
            if value == 0 {
                return Err(SyntheticError::Zero { field });
            }
            if u32::try_from(value).is_err() {
                return Err(SyntheticError::TooLarge { field, value });
            }
        }
        if s.vocab < MIN_VOCAB {
            return Err(SyntheticError::VocabTooSmall { vocab: s.vocab });
        }
        if u32::try_from(s.vocab).is_err() {
            return Err(SyntheticError::TooLarge {
                field: "vocab",
                value: s.vocab,
            });
        }
        if s.head_dim.is_none() && !s.hidden.is_multiple_of(s.n_heads) {
            return Err(SyntheticError::HeadsDoNotDivideHidden {
                hidden: s.hidden,
                n_heads: s.n_heads,
            });
        }
        if !s.n_heads.is_multiple_of(s.n_kv_heads) {
            return Err(SyntheticError::KvHeadsDoNotDivideHeads {
                n_heads: s.n_heads,
                n_kv_heads: s.n_kv_heads,
            });
        }
        if !s.head_dim().is_multiple_of(2) {
            return Err(SyntheticError::OddHeadDim {
                head_dim: s.head_dim(),
            });
        }
        Ok(())
    }
}

/// Elements of a tensor.
fn count(spec: &TensorSpec) -> usize {
    spec.dims.iter().map(|&d| d as usize).product()
}

/// A matrix entry: `dims[0]` (the row, named `field` in errors) must be
/// whole blocks of `ty`.
fn planned(
    name: String,
    dims: &[usize],
    ty: GgmlType,
    content: Content,
    field: &'static str,
) -> Result<Planned, SyntheticError> {
    let block = ty.block_len();
    let Some(row_bytes) = ty.row_bytes(dims[0]) else {
        return Err(SyntheticError::NotWholeBlocks {
            field,
            value: dims[0],
            ty,
            block,
        });
    };
    let rows: usize = dims[1..].iter().product();
    Ok(Planned {
        spec: TensorSpec {
            name,
            dims: dims.iter().map(|&d| d as u64).collect(),
            ty,
            byte_len: rows * row_bytes,
        },
        content,
    })
}

/// An F32 vector of `len`.
fn vector(name: String, len: usize, content: Content) -> Planned {
    Planned {
        spec: TensorSpec {
            name,
            dims: vec![len as u64],
            ty: GgmlType::F32,
            byte_len: len * 4,
        },
        content,
    }
}
