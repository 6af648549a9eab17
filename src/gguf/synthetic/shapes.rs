//! Model shapes: the architectures a synthetic model can take, and the
//! hyper-parameters of real checkpoints by name, as their config.json says.
//!
//! Each named shape is what `convert_hf_to_gguf.py` makes of the
//! checkpoint's published config.json: the same widths, head counts, layer
//! count, vocabulary size, context length, RoPE base and norm epsilon, the
//! same optional keys (`attention.key_length` only where the config has a
//! `head_dim`), tied embeddings where the checkpoint ties them, and Llama
//! 3's frequency factors as a `rope_freqs` tensor.

/// The architectures inferd's loader runs, by their GGUF name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyntheticArch {
    /// `llama` (Llama 2 and 3, Mistral, SmolLM2).
    Llama,
    /// `qwen2`: Q, K and V biases.
    Qwen2,
    /// `qwen3`: per-head Q and K norms.
    Qwen3,
    /// `gemma3`: Q/K norms, norms after attention and after the
    /// feed-forward block, sliding-window layers.
    Gemma3,
}

impl SyntheticArch {
    /// `general.architecture`, and the prefix of the model's keys.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma3 => "gemma3",
        }
    }

    /// `blk.N.attn_{q,k,v}.bias`.
    pub(super) fn qkv_bias(self) -> bool {
        self == Self::Qwen2
    }

    /// `blk.N.attn_{q,k}_norm.weight`.
    pub(super) fn qk_norm(self) -> bool {
        matches!(self, Self::Qwen3 | Self::Gemma3)
    }

    /// `blk.N.post_attention_norm.weight` and `blk.N.post_ffw_norm.weight`.
    pub(super) fn post_norms(self) -> bool {
        self == Self::Gemma3
    }

    /// The llama converter alone also writes `vocab_size` and
    /// `rope.dimension_count`.
    pub(super) fn llama_keys(self) -> bool {
        self == Self::Llama
    }
}

/// Llama 3's RoPE adjustment (`rope_scaling` of type `llama3`): the
/// converter writes no scaling keys for it but a `rope_freqs.weight` tensor
/// of one divisor per rotated pair.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Rope {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    /// `original_max_position_embeddings`.
    pub original_context: usize,
}

impl Llama3Rope {
    /// The divisor of each of the `head_dim / 2` frequencies of RoPE base
    /// `base`: 1 for wavelengths shorter than the original context over
    /// the high-frequency factor, `factor` for those longer than it over
    /// the low-frequency factor, and a smooth blend between; in f32 as
    /// the converter computes them.
    pub fn factors(&self, head_dim: usize, base: f32) -> Vec<f32> {
        let context = self.original_context as f32;
        let low_wavelen = context / self.low_freq_factor;
        let high_wavelen = context / self.high_freq_factor;
        (0..head_dim / 2)
            .map(|i| {
                let freq = 1.0 / base.powf((2 * i) as f32 / head_dim as f32);
                let wavelen = 2.0 * std::f32::consts::PI / freq;
                if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    self.factor
                } else {
                    let smooth = (context / wavelen - self.low_freq_factor)
                        / (self.high_freq_factor - self.low_freq_factor);
                    1.0 / ((1.0 - smooth) / self.factor + smooth)
                }
            })
            .collect()
    }
}

/// A model's hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    pub arch: SyntheticArch,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Width of one head when the checkpoint's config gives it (then
    /// `attention.key_length` and `value_length` are written); `None`:
    /// `hidden / n_heads`, and no such keys.
    pub head_dim: Option<usize>,
    /// Feed-forward width.
    pub ffn: usize,
    /// Vocabulary size, at least [`MIN_VOCAB`](super::MIN_VOCAB).
    pub vocab: usize,
    /// `context_length`.
    pub context: usize,
    /// `rope.freq_base`.
    pub rope_base: f32,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// The output projection is the embedding table (no `output.weight`).
    pub tied_output: bool,
    /// Llama 3 RoPE factors, written as `rope_freqs.weight`.
    pub llama3_rope: Option<Llama3Rope>,
    /// `attention.sliding_window` (Gemma 3; its layer pattern is the
    /// loader's default, every sixth layer global).
    pub sliding_window: Option<usize>,
}

impl ModelShape {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or_else(|| self.hidden / self.n_heads.max(1))
    }

    /// Width of the Q projection.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim()
    }

    /// Width of the K and V projections.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim()
    }

    /// The same shape with `n_layers` blocks.
    pub fn with_layers(self, n_layers: usize) -> Self {
        Self { n_layers, ..self }
    }

    /// The same shape with a `vocab`-token vocabulary.
    pub fn with_vocab(self, vocab: usize) -> Self {
        Self { vocab, ..self }
    }
}

/// A real checkpoint's shape, by the name `inferd make-model --shape` takes.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedShape {
    /// e.g. `llama-3.2-1b`.
    pub name: &'static str,
    /// The Hugging Face repository whose config.json the shape follows.
    pub checkpoint: &'static str,
    pub shape: ModelShape,
}

const LLAMA_BASE: ModelShape = ModelShape {
    arch: SyntheticArch::Llama,
    n_layers: 1,
    hidden: 0,
    n_heads: 0,
    n_kv_heads: 0,
    head_dim: None,
    ffn: 0,
    vocab: 0,
    context: 0,
    rope_base: 10_000.0,
    rms_eps: 1e-5,
    tied_output: true,
    llama3_rope: None,
    sliding_window: None,
};

/// The named shapes, smallest first.
pub const NAMED_SHAPES: [NamedShape; 6] = [
    NamedShape {
        name: "smollm2-135m",
        checkpoint: "HuggingFaceTB/SmolLM2-135M-Instruct",
        shape: ModelShape {
            n_layers: 30,
            hidden: 576,
            n_heads: 9,
            n_kv_heads: 3,
            ffn: 1536,
            vocab: 49152,
            context: 8192,
            rope_base: 100_000.0,
            ..LLAMA_BASE
        },
    },
    NamedShape {
        name: "gemma-3-270m",
        checkpoint: "google/gemma-3-270m",
        shape: ModelShape {
            arch: SyntheticArch::Gemma3,
            n_layers: 18,
            hidden: 640,
            n_heads: 4,
            n_kv_heads: 1,
            head_dim: Some(256),
            ffn: 2048,
            vocab: 262_144,
            context: 32_768,
            rope_base: 1_000_000.0,
            rms_eps: 1e-6,
            sliding_window: Some(512),
            ..LLAMA_BASE
        },
    },
    NamedShape {
        name: "qwen2.5-0.5b",
        checkpoint: "Qwen/Qwen2.5-0.5B",
        shape: ModelShape {
            arch: SyntheticArch::Qwen2,
            n_layers: 24,
            hidden: 896,
            n_heads: 14,
            n_kv_heads: 2,
            ffn: 4864,
            vocab: 151_936,
            context: 32_768,
            rope_base: 1_000_000.0,
            rms_eps: 1e-6,
            ..LLAMA_BASE
        },
    },
    NamedShape {
        name: "qwen3-0.6b",
        checkpoint: "Qwen/Qwen3-0.6B",
        shape: ModelShape {
            arch: SyntheticArch::Qwen3,
            n_layers: 28,
            hidden: 1024,
            n_heads: 16,
            n_kv_heads: 8,
            head_dim: Some(128),
            ffn: 3072,
            vocab: 151_936,
            context: 40_960,
            rope_base: 1_000_000.0,
            rms_eps: 1e-6,
            ..LLAMA_BASE
        },
    },
    NamedShape {
        name: "llama-3.2-1b",
        checkpoint: "meta-llama/Llama-3.2-1B",
        shape: ModelShape {
            n_layers: 16,
            hidden: 2048,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: Some(64),
            ffn: 8192,
            vocab: 128_256,
            context: 131_072,
            rope_base: 500_000.0,
            llama3_rope: Some(Llama3Rope {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: 8192,
            }),
            ..LLAMA_BASE
        },
    },
    NamedShape {
        name: "mistral-7b-v0.1",
        checkpoint: "mistralai/Mistral-7B-v0.1",
        shape: ModelShape {
            n_layers: 32,
            hidden: 4096,
            n_heads: 32,
            n_kv_heads: 8,
            ffn: 14_336,
            vocab: 32_000,
            context: 32_768,
            tied_output: false,
            ..LLAMA_BASE
        },
    },
];

/// The shape named `name` (see [`NAMED_SHAPES`]).
pub fn named_shape(name: &str) -> Option<&'static NamedShape> {
    NAMED_SHAPES.iter().find(|s| s.name == name)
}
