//! The hyper-parameters of a llama-family model, read from GGUF metadata and
//! checked for consistency before any tensor is touched.

use crate::gguf::GgufFile;

use super::ModelError;

/// How RoPE pairs up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(x[2i], x[2i+1])` (GGUF `llama` checkpoints, whose
    /// Q/K rows were permuted by the converter to this layout).
    Normal,
    /// Split halves `(x[i], x[i + d/2])` (GPT-NeoX style; `qwen2`).
    Neox,
}

/// The architectures the forward pass implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `llama`: SmolLM2, TinyLlama, Llama 2/3.
    Llama,
    /// `qwen2`: llama with biases on the Q, K and V projections, NeoX RoPE.
    Qwen2,
}

impl Architecture {
    fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }

    /// The GGUF metadata key prefix.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }
}

/// Model shape and numerical constants.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub n_layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
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
    pub rope_layout: RopeLayout,
}

/// Caps that keep a hostile header from asking for absurd buffers.
const MAX_LAYERS: u64 = 1024;
const MAX_WIDTH: u64 = 1 << 17;
const MAX_VOCAB: u64 = 1 << 22;

impl ModelConfig {
    /// Reads and validates the configuration of `file`.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let arch_name = file.get_str("general.architecture")?;
        let architecture = Architecture::from_name(arch_name)
            .ok_or_else(|| ModelError::UnsupportedArchitecture(arch_name.to_owned()))?;
        let p = architecture.name();
        let key = |k: &str| format!("{p}.{k}");
        let get = |k: &str, cap: u64| -> Result<usize, ModelError> {
            let name = key(k);
            let v = file.get_u64(&name)?;
            if v == 0 || v > cap {
                return Err(ModelError::BadConfig(format!(
                    "{name} is {v}; expected 1..={cap}"
                )));
            }
            Ok(v as usize)
        };
        let n_layers = get("block_count", MAX_LAYERS)?;
        let hidden = get("embedding_length", MAX_WIDTH)?;
        let n_heads = get("attention.head_count", MAX_WIDTH)?;
        let n_kv_heads = match file.get_u64_opt(&key("attention.head_count_kv"))? {
            None => n_heads,
            Some(_) => get("attention.head_count_kv", MAX_WIDTH)?,
        };
        let ffn = get("feed_forward_length", MAX_WIDTH * 8)?;
        let context = get("context_length", 1 << 24)?;
        let rms_eps = file.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let rope_base = file
            .get_f32_opt(&key("rope.freq_base"))?
            .unwrap_or(10_000.0);

        let vocab = match file.get_u64_opt(&key("vocab_size"))? {
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

        if hidden % n_heads != 0 {
            return Err(ModelError::BadConfig(format!(
                "embedding length {hidden} is not a multiple of the head count {n_heads}"
            )));
        }
        let head_dim = hidden / n_heads;
        if n_kv_heads > n_heads || n_heads % n_kv_heads != 0 {
            return Err(ModelError::BadConfig(format!(
                "{n_heads} query heads cannot be grouped over {n_kv_heads} KV heads"
            )));
        }
        if head_dim % 2 != 0 {
            return Err(ModelError::BadConfig(format!(
                "head dimension {head_dim} is odd"
            )));
        }
        let rope_dims = match file.get_u64_opt(&key("rope.dimension_count"))? {
            None => head_dim,
            Some(d) if d as usize <= head_dim && d % 2 == 0 && d > 0 => d as usize,
            Some(d) => {
                return Err(ModelError::BadConfig(format!(
                    "rope.dimension_count {d} does not fit the head dimension {head_dim}"
                )))
            }
        };
        let rope_freq_scale = rope_scale(file, p)?;
        if !(rms_eps.is_finite() && rms_eps >= 0.0 && rope_base.is_finite() && rope_base > 0.0) {
            return Err(ModelError::BadConfig(format!(
                "rms epsilon {rms_eps} or rope base {rope_base} is not a usable number"
            )));
        }
        Ok(Self {
            architecture,
            n_layers,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn,
            vocab: vocab as usize,
            context,
            rms_eps,
            rope_base,
            rope_freq_scale,
            rope_dims,
            rope_layout: match architecture {
                Architecture::Llama => RopeLayout::Normal,
                Architecture::Qwen2 => RopeLayout::Neox,
            },
        })
    }

    /// Width of the K (and V) projection: KV heads times head dimension.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
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
