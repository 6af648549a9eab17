//! Where each weight of the model lives in the mapped GGUF, with every shape
//! checked against the configuration once at load time so the forward pass
//! can index without re-checking.

use crate::gguf::{GgufFile, TensorInfo};
use crate::quant::{activation_type, GgmlType};

use super::config::ModelConfig;
use super::ModelError;

/// A matrix of `rows` rows of `cols` elements stored in the map.
#[derive(Clone, Debug)]
pub struct Matrix {
    pub name: String,
    pub ty: GgmlType,
    /// The activation format this matrix multiplies with.
    pub act_ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// The tensor's directory entry (its bytes are in the map).
    pub info: TensorInfo,
    /// Bytes per row.
    pub row_bytes: usize,
}

/// A vector of f32 values (norm weights, biases), copied out of the map once.
pub type Vector = Vec<f32>;

/// One transformer block's weights.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Vector,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    /// Q, K and V biases (qwen2).
    pub bq: Option<Vector>,
    pub bk: Option<Vector>,
    pub bv: Option<Vector>,
    /// Per-head RMSNorm weights of Q and K, `[head_dim]` (qwen3, gemma3).
    pub q_norm: Option<Vector>,
    pub k_norm: Option<Vector>,
    pub wo: Matrix,
    /// RMSNorm of the attention output before the residual add (gemma3).
    pub attn_post_norm: Option<Vector>,
    pub ffn_norm: Vector,
    /// RMSNorm of the feed-forward output before the residual add (gemma3).
    pub ffn_post_norm: Option<Vector>,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
}

/// Every weight of the model.
#[derive(Clone, Debug)]
pub struct Weights {
    /// Token embedding table: `vocab` rows of `hidden`.
    pub token_embd: Matrix,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vector,
    /// Output projection: `vocab` rows of `hidden` (the embedding table when tied).
    pub output: Matrix,
    /// Per-dimension RoPE frequency divisors (Llama 3 style), if present.
    pub rope_freqs: Option<Vector>,
}

impl Weights {
    /// Locates and checks every tensor the configuration needs.
    pub fn locate(file: &GgufFile, cfg: &ModelConfig) -> Result<Self, ModelError> {
        let h = cfg.hidden;
        let kv = cfg.kv_dim();
        let token_embd = matrix(file, "token_embd.weight", cfg.vocab, h)?;
        let output = match file.tensor("output.weight") {
            Some(_) => matrix(file, "output.weight", cfg.vocab, h)?,
            None => token_embd.clone(),
        };
        let output_norm = vector(file, "output_norm.weight", h)?;
        let rope_freqs = match file.tensor("rope_freqs.weight") {
            Some(_) => Some(vector(file, "rope_freqs.weight", cfg.rope_dims / 2)?),
            None => None,
        };
        let spec = cfg.spec();
        let (q_dim, hd) = (cfg.q_dim(), cfg.head_dim);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            // A tensor the architecture requires must be there; a norm it
            // does not have is not read even when a file carries one.
            let optional = |required: bool, s: &str, len| -> Result<Option<Vector>, ModelError> {
                if required {
                    vector(file, &n(s), len).map(Some)
                } else {
                    Ok(None)
                }
            };
            // Q/K/V biases are used wherever a file has them (as llama.cpp
            // does for every architecture here); qwen2 requires them.
            let bias = |s: &str, len| -> Result<Option<Vector>, ModelError> {
                optional(spec.qkv_bias || file.tensor(&n(s)).is_some(), s, len)
            };
            layers.push(LayerWeights {
                attn_norm: vector(file, &n("attn_norm.weight"), h)?,
                wq: matrix(file, &n("attn_q.weight"), q_dim, h)?,
                wk: matrix(file, &n("attn_k.weight"), kv, h)?,
                wv: matrix(file, &n("attn_v.weight"), kv, h)?,
                bq: bias("attn_q.bias", q_dim)?,
                bk: bias("attn_k.bias", kv)?,
                bv: bias("attn_v.bias", kv)?,
                q_norm: optional(spec.qk_norm, "attn_q_norm.weight", hd)?,
                k_norm: optional(spec.qk_norm, "attn_k_norm.weight", hd)?,
                wo: matrix(file, &n("attn_output.weight"), h, q_dim)?,
                attn_post_norm: optional(spec.post_norms, "post_attention_norm.weight", h)?,
                ffn_norm: vector(file, &n("ffn_norm.weight"), h)?,
                ffn_post_norm: optional(spec.post_norms, "post_ffw_norm.weight", h)?,
                w_gate: matrix(file, &n("ffn_gate.weight"), cfg.ffn, h)?,
                w_up: matrix(file, &n("ffn_up.weight"), cfg.ffn, h)?,
                w_down: matrix(file, &n("ffn_down.weight"), h, cfg.ffn)?,
            });
        }
        Ok(Self {
            token_embd,
            layers,
            output_norm,
            output,
            rope_freqs,
        })
    }
}

fn check_dims(t: &TensorInfo, want: &[u64]) -> Result<(), ModelError> {
    if t.dims != want {
        return Err(ModelError::BadTensor {
            name: t.name.clone(),
            why: format!("shape {:?}, expected {:?}", t.dims, want),
        });
    }
    Ok(())
}

fn matrix(file: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
    let t = file.require_tensor(name)?;
    check_dims(t, &[cols as u64, rows as u64])?;
    let act_ty = activation_type(t.ty).map_err(|_| ModelError::BadTensor {
        name: name.to_owned(),
        why: format!("element type {} has no matrix kernel", t.ty),
    })?;
    let row_bytes = t.ty.row_bytes(cols).ok_or_else(|| ModelError::BadTensor {
        name: name.to_owned(),
        why: format!("rows of {cols} are not whole {} blocks", t.ty),
    })?;
    Ok(Matrix {
        name: name.to_owned(),
        ty: t.ty,
        act_ty,
        rows,
        cols,
        info: t.clone(),
        row_bytes,
    })
}

fn vector(file: &GgufFile, name: &str, len: usize) -> Result<Vector, ModelError> {
    let t = file.require_tensor(name)?;
    check_dims(t, &[len as u64])?;
    let mut out = vec![0f32; len];
    crate::quant::dequantize_row(t.ty, file.tensor_bytes(t), &mut out).map_err(|e| {
        ModelError::BadTensor {
            name: name.to_owned(),
            why: e.to_string(),
        }
    })?;
    Ok(out)
}
