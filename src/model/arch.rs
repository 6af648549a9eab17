//! The one table of what distinguishes the architectures inferd runs: which
//! optional tensors each has, which hyper-parameters it reads, and which
//! variant of each block of the forward pass it uses. Everything else in
//! `model/` asks this table instead of matching on the architecture.

/// How RoPE pairs up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(x[2i], x[2i+1])` (GGUF `llama` checkpoints, whose
    /// Q/K rows were permuted by the converter to this layout).
    Normal,
    /// Split halves `(x[i], x[i + d/2])` (GPT-NeoX style; `qwen2`, `qwen3`,
    /// `gemma3`).
    Neox,
}

/// The gated activation of the feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnActivation {
    /// `silu(gate) * up` (SwiGLU).
    Silu,
    /// `gelu_tanh(gate) * up` (GeGLU), GELU read from ggml's f16 table.
    Gelu,
}

/// The architectures the forward pass implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `llama`: Llama 2, Llama 3.x (RoPE factors in `rope_freqs.weight`),
    /// Mistral, SmolLM2, TinyLlama.
    Llama,
    /// `qwen2`: llama with biases on the Q, K and V projections, NeoX RoPE.
    Qwen2,
    /// `qwen3`: per-head RMSNorm of Q and K before RoPE, no biases, NeoX RoPE.
    Qwen3,
    /// `gemma3`: embeddings scaled by sqrt(width), per-head Q/K RMSNorm,
    /// RMSNorm after attention and after the feed-forward block, GeGLU,
    /// interleaved sliding-window and global layers with two RoPE bases.
    Gemma3,
}

/// Everything the loader and the forward pass need to know about an
/// architecture beyond the llama baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArchSpec {
    pub architecture: Architecture,
    /// `general.architecture` and the metadata key prefix.
    pub name: &'static str,
    pub rope_layout: RopeLayout,
    /// `blk.N.attn_{q,k,v}.bias` are required.
    pub qkv_bias: bool,
    /// `blk.N.attn_{q,k}_norm.weight` (per-head RMSNorm before RoPE) are required.
    pub qk_norm: bool,
    /// `blk.N.post_attention_norm.weight` and `blk.N.post_ffw_norm.weight`
    /// (RMSNorm of each block's output before the residual add) are required.
    pub post_norms: bool,
    pub ffn_activation: FfnActivation,
    /// Embeddings are multiplied by sqrt(embedding width).
    pub scale_embeddings: bool,
    /// Queries are multiplied by 1/sqrt(head dimension) before attention
    /// (the score is then unscaled) rather than the score after it.
    pub scale_queries: bool,
    /// Reads `attention.sliding_window` (and its layer pattern, default
    /// `sliding_pattern`) and `rope.freq_base_swa`.
    pub sliding_window: bool,
    /// Every `sliding_pattern`-th layer is global when the file gives no pattern.
    pub sliding_pattern: usize,
    /// Reads `final_logit_softcapping`.
    pub logit_softcap: bool,
}

const LLAMA: ArchSpec = ArchSpec {
    architecture: Architecture::Llama,
    name: "llama",
    rope_layout: RopeLayout::Normal,
    qkv_bias: false,
    qk_norm: false,
    post_norms: false,
    ffn_activation: FfnActivation::Silu,
    scale_embeddings: false,
    scale_queries: false,
    sliding_window: false,
    sliding_pattern: 0,
    logit_softcap: false,
};

/// Every supported architecture, in the order error messages list them.
pub const ARCHITECTURES: [ArchSpec; 4] = [
    LLAMA,
    ArchSpec {
        architecture: Architecture::Qwen2,
        name: "qwen2",
        rope_layout: RopeLayout::Neox,
        qkv_bias: true,
        ..LLAMA
    },
    ArchSpec {
        architecture: Architecture::Qwen3,
        name: "qwen3",
        rope_layout: RopeLayout::Neox,
        qk_norm: true,
        ..LLAMA
    },
    ArchSpec {
        architecture: Architecture::Gemma3,
        name: "gemma3",
        rope_layout: RopeLayout::Neox,
        qk_norm: true,
        post_norms: true,
        ffn_activation: FfnActivation::Gelu,
        scale_embeddings: true,
        scale_queries: true,
        sliding_window: true,
        sliding_pattern: 6,
        logit_softcap: true,
        ..LLAMA
    },
];

impl Architecture {
    /// The architecture named `name` in `general.architecture`.
    pub fn from_name(name: &str) -> Option<Self> {
        ARCHITECTURES
            .iter()
            .find(|a| a.name == name)
            .map(|a| a.architecture)
    }

    /// The table row of this architecture.
    pub fn spec(self) -> &'static ArchSpec {
        &ARCHITECTURES[match self {
            Self::Llama => 0,
            Self::Qwen2 => 1,
            Self::Qwen3 => 2,
            Self::Gemma3 => 3,
        }]
    }

    /// The GGUF metadata key prefix.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// "llama, qwen2, ..." for error messages.
    pub fn supported_list() -> String {
        ARCHITECTURES
            .iter()
            .map(|a| a.name)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_architecture_has_one_row_found_by_name() {
        for spec in &ARCHITECTURES {
            assert_eq!(Architecture::from_name(spec.name), Some(spec.architecture));
            assert_eq!(spec.architecture.spec(), spec);
        }
        assert_eq!(Architecture::from_name("phi3"), None);
        assert_eq!(
            Architecture::supported_list(),
            "llama, qwen2, qwen3, gemma3"
        );
    }
}
