//! The hyper-parameters of a llama-family model, read from GGUF metadata and
//! checked for consistency before any tensor is touched. Which keys an
//! architecture has comes from the table in `arch.rs`.

use crate::gguf::GgufFile;

use super::ModelError;

use super::arch::{ArchSpec, Architecture, RopeLayout};

/// Model shape and numerical constants.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub n_layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Width of one attention head (`attention.key_length`, else
    /// width / heads); Q is `n_heads * head_dim` wide, which need not be
    /// the residual width.
    pub head_dim: usize,
    /// Inner width of the SwiGLU feed-forward block.
    pub ffn: usize,
    pub vocab: usize,
    /// Longest history the model was trained for.
    pub context: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    /// Multiplies every rotation angle (1 / linear scaling factor).
    pub rope_freq_scale: f32,
    /// Dimensions of each head that RoPE rotates (the rest pass through).
    pub rope_dims: usize,
    /// Sliding-window layers attend to the last `window` positions only
    /// (the query's own included) and rotate with their own RoPE base.
    pub sliding_window: Option<SlidingWindow>,
    /// Embeddings are multiplied by this (Gemma: sqrt(width)).
    pub embedding_scale: Option<f32>,
    /// Queries are multiplied by this after RoPE and the attention score is
    /// left unscaled (Gemma); `None`: the score is scaled by 1/sqrt(head_dim).
    pub query_scale: Option<f32>,
    /// Logits become `cap * tanh(logits / cap)`.
    pub logit_softcap: Option<f32>,
}

/// The sliding-window layers of a model and their attention span.
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Positions a sliding layer's query sees, its own included.
    pub window: usize,
    /// `layers[i]`: layer `i` is a sliding-window layer (else global).
    pub layers: Vec<bool>,
    /// RoPE base of the sliding layers.
    pub rope_base: f32,
}

/// Caps that keep a hostile header from asking for absurd buffers.
const MAX_LAYERS: u64 = 1024;
const MAX_WIDTH: u64 = 1 << 17;
const MAX_VOCAB: u64 = 1 << 22;

impl ModelConfig {
    /// Reads and validates the configuration of `file`.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let architecture = architecture(file)?;
        let spec = architecture.spec();
        let p = spec.name;
        let n_layers = dimension(file, p, "block_count", MAX_LAYERS)?;
        let hidden = dimension(file, p, "embedding_length", MAX_WIDTH)?;
        let n_heads = dimension(file, p, "attention.head_count", MAX_WIDTH)?;
        let n_kv_heads = match file.get_u64_opt(&format!("{p}.attention.head_count_kv"))? {
            None => n_heads,
            Some(_) => dimension(file, p, "attention.head_count_kv", MAX_WIDTH)?,
        };
        let ffn = dimension(file, p, "feed_forward_length", MAX_WIDTH * 8)?;
        let context = dimension(file, p, "context_length", 1 << 24)?;
        let rms_eps = file.get_f32(&format!("{p}.attention.layer_norm_rms_epsilon"))?;
        let rope_base = file
            .get_f32_opt(&format!("{p}.rope.freq_base"))?
            .unwrap_or(10_000.0);
        let vocab = vocab_size(file, p)?;
        let (head_dim, rope_dims) = head_shape(file, p, hidden, n_heads, n_kv_heads)?;
        let rope_freq_scale = rope_scale(file, p)?;
        if !(rms_eps.is_finite() && rms_eps >= 0.0 && rope_base.is_finite() && rope_base > 0.0) {
            return Err(ModelError::BadConfig(format!(
                "rms epsilon {rms_eps} or rope base {rope_base} is not a usable number"
            )));
        }
        let sliding_window = if spec.sliding_window {
            sliding_window(file, p, n_layers, spec.sliding_pattern)?
        } else {
            None
        };
        let logit_softcap = match spec.logit_softcap {
            false => None,
            true => logit_softcap(file, p)?,
        };
        Ok(Self {
            architecture,
            n_layers,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn,
            vocab,
            context,
            rms_eps,
            rope_base,
            rope_freq_scale,
            rope_dims,
            sliding_window,
            embedding_scale: spec.scale_embeddings.then(|| (hidden as f32).sqrt()),
            // Gemma's 27B (62 layers) scales by the width per head rather
            // than the head dimension, as its reference implementation does.
            query_scale: spec.scale_queries.then(|| {
                let per_head = if n_layers == 62 {
                    hidden / n_heads
                } else {
                    head_dim
                };
                1.0 / (per_head as f32).sqrt()
            }),
            logit_softcap,
        })
    }

    /// The architecture's row of the table in `arch.rs`.
    pub fn spec(&self) -> &'static ArchSpec {
        self.architecture.spec()
    }

    /// How RoPE pairs the dimensions of a head.
    pub fn rope_layout(&self) -> RopeLayout {
        self.spec().rope_layout
    }

    /// Width of the Q projection (and of the attention output).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// The attention span of layer `layer`: `Some(window)` for a
    /// sliding-window layer, `None` for a global one.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let s = self.sliding_window.as_ref()?;
        s.layers
            .get(layer)
            .copied()
            .unwrap_or(false)
            .then_some(s.window)
    }

    /// Width of the K (and V) projection: KV heads times head dimension.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// The architecture `general.architecture` names, if inferd runs it.
fn architecture(file: &GgufFile) -> Result<Architecture, ModelError> {
    let arch_name = file.get_str("general.architecture")?;
    Architecture::from_name(arch_name).ok_or_else(|| ModelError::UnsupportedArchitecture {
        name: arch_name.to_owned(),
    })
}

/// The size stored under `{p}.{k}`, required, in `1..=cap`.
fn dimension(file: &GgufFile, p: &str, k: &str, cap: u64) -> Result<usize, ModelError> {
    let name = format!("{p}.{k}");
    let v = file.get_u64(&name)?;
    if v == 0 || v > cap {
        return Err(ModelError::BadConfig(format!(
            "{name} is {v}; expected 1..={cap}"
        )));
    }
    Ok(v as usize)
}

/// The vocabulary size: `{p}.vocab_size`, else the rows of the embedding
/// table, in `1..=MAX_VOCAB`.
fn vocab_size(file: &GgufFile, p: &str) -> Result<usize, ModelError> {
    let vocab = match file.get_u64_opt(&format!("{p}.vocab_size"))? {
        Some(v) => v,
        None => file
            .require_tensor("token_embd.weight")?
            .dims
            .get(1)
            .copied()
            .unwrap_or(0),
    };
    if vocab == 0 || vocab > MAX_VOCAB {
        return Err(ModelError::BadConfig(format!(
            "vocabulary size {vocab} is out of range"
        )));
    }
    Ok(vocab as usize)
}

/// The head dimension (`{p}.attention.key_length`, else width / heads,
/// even, the value width the same) and the dimensions RoPE rotates
/// (`{p}.rope.dimension_count`, else all), checked with the grouping of
/// the query heads over the KV heads.
fn head_shape(
    file: &GgufFile,
    p: &str,
    hidden: usize,
    n_heads: usize,
    n_kv_heads: usize,
) -> Result<(usize, usize), ModelError> {
    let head_dim = match file.get_u64_opt(&format!("{p}.attention.key_length"))? {
        Some(_) => dimension(file, p, "attention.key_length", MAX_WIDTH)?,
        None if !hidden.is_multiple_of(n_heads) => {
            return Err(ModelError::BadConfig(format!(
                "embedding length {hidden} is not a multiple of the head count {n_heads}"
            )))
        }
        None => hidden / n_heads,
    };
    if let Some(v) = file.get_u64_opt(&format!("{p}.attention.value_length"))? {
        if v as usize != head_dim {
            return Err(ModelError::BadConfig(format!(
                "value head width {v} differs from the key head width {head_dim}"
            )));
        }
    }
    if n_kv_heads > n_heads || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(ModelError::BadConfig(format!(
            "{n_heads} query heads cannot be grouped over {n_kv_heads} KV heads"
        )));
    }
    if head_dim % 2 != 0 {
        return Err(ModelError::BadConfig(format!(
            "head dimension {head_dim} is odd"
        )));
    }
    let rope_dims = match file.get_u64_opt(&format!("{p}.rope.dimension_count"))? {
        None => head_dim,
        Some(d) if d as usize <= head_dim && d % 2 == 0 && d > 0 => d as usize,
        Some(d) => {
            return Err(ModelError::BadConfig(format!(
                "rope.dimension_count {d} does not fit the head dimension {head_dim}"
            )))
        }
    };
    Ok((head_dim, rope_dims))
}

/// `{p}.final_logit_softcapping` for an architecture that has one (absent
/// or 0: none).
fn logit_softcap(file: &GgufFile, p: &str) -> Result<Option<f32>, ModelError> {
    match file.get_f32_opt(&format!("{p}.final_logit_softcapping"))? {
        None => Ok(None),
        Some(0.0) => Ok(None),
        Some(c) if c.is_finite() && c > 0.0 => Ok(Some(c)),
        Some(c) => Err(ModelError::BadConfig(format!(
            "final_logit_softcapping {c} is not a positive number"
        ))),
    }
}

/// RoPE frequency scale from `{arch}.rope.scaling.*`: linear scaling is
/// supported; other kinds (YaRN, ...) are refused rather than approximated.
fn rope_scale(file: &GgufFile, p: &str) -> Result<f32, ModelError> {
    let kind = file
        .get_str_opt(&format!("{p}.rope.scaling.type"))?
        .unwrap_or("none");
    let factor = file.get_f32_opt(&format!("{p}.rope.scaling.factor"))?;
    let legacy = file.get_f32_opt(&format!("{p}.rope.scale_linear"))?;
    if kind != "none" && kind != "linear" {
        return Err(ModelError::BadConfig(format!(
            "RoPE scaling '{kind}' is not supported (supported: none, linear)"
        )));
    }
    // As llama.cpp: a factor applies linearly whatever the declared type.
    match factor.or(legacy) {
        None => Ok(1.0),
        Some(0.0) => Ok(1.0),
        Some(f) if f.is_finite() && f > 0.0 => Ok(1.0 / f),
        Some(f) => Err(ModelError::BadConfig(format!(
            "RoPE scaling factor {f} is not a positive number"
        ))),
    }
}

/// The sliding-window layout from `{arch}.attention.sliding_window` and
/// `{arch}.attention.sliding_window_pattern` (a per-layer array of flags,
/// or `n`: every `n`-th layer global, `default_pattern` when absent), as
/// llama.cpp reads them. No window (or 0) means every layer is global.
fn sliding_window(
    file: &GgufFile,
    p: &str,
    n_layers: usize,
    default_pattern: usize,
) -> Result<Option<SlidingWindow>, ModelError> {
    let window = match file.get_u64_opt(&format!("{p}.attention.sliding_window"))? {
        None | Some(0) => return Ok(None),
        Some(w) if w > 1 << 24 => {
            return Err(ModelError::BadConfig(format!(
                "sliding window {w} is out of range"
            )))
        }
        Some(w) => w as usize,
    };
    let pattern_key = format!("{p}.attention.sliding_window_pattern");
    let layers = match file.get_bool_array_opt(&pattern_key)? {
        Some(flags) if flags.len() == n_layers => flags,
        Some(flags) => {
            return Err(ModelError::BadConfig(format!(
                "{pattern_key} has {} entries for {n_layers} layers",
                flags.len()
            )))
        }
        None => {
            let n = match file.get_u64_opt(&pattern_key)? {
                Some(n) => n as usize,
                None => default_pattern,
            };
            // Layer i is global when it ends a group of n (llama.cpp's rule).
            (0..n_layers).map(|i| n == 0 || i % n < n - 1).collect()
        }
    };
    let rope_base = file
        .get_f32_opt(&format!("{p}.rope.freq_base_swa"))?
        .unwrap_or(10_000.0);
    if !(rope_base.is_finite() && rope_base > 0.0) {
        return Err(ModelError::BadConfig(format!(
            "sliding-window RoPE base {rope_base} is not a usable number"
        )));
    }
    Ok(Some(SlidingWindow {
        window,
        layers,
        rope_base,
    }))
}
