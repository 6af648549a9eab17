//! The model room: a llama-family network over a memory-mapped GGUF.
//!
//! Three pieces split by lifetime, as in llama2.c: [`ModelConfig`] (shape and
//! constants), [`Weights`] (immutable, views into the map), and the per-call
//! [`Scratch`] buffers. The forward pass itself is in `forward.rs`.

mod arch;
mod config;
mod forward;
pub mod phases;
mod rope;
mod weights;

#[cfg(test)]
mod synthetic_tests;

use std::path::Path;
use std::sync::Arc;

use thiserror::Error;

use crate::gguf::{GgufError, GgufFile};
use crate::kv::{KvError, KvLayout};

pub use arch::{ArchSpec, Architecture, FfnActivation, RopeLayout, ARCHITECTURES};
pub use config::{ModelConfig, SlidingWindow};
pub use forward::{LayerFeed, LogitRows, LogitsWanted, Scratch, Sequence, MAX_HEAD_DIM};
pub use weights::{LayerWeights, Matrix, Weights};

/// Why a model could not be loaded or run.
#[derive(Debug, Error)]
pub enum ModelError {
    /// The GGUF file itself is unreadable or lacks a key or tensor.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `general.architecture` names a network this forward pass does not implement.
    #[error(
        "architecture '{name}' is not supported (supported: {})",
        Architecture::supported_list()
    )]
    UnsupportedArchitecture { name: String },
    /// The hyper-parameters are inconsistent or out of range.
    #[error("bad model configuration: {0}")]
    BadConfig(String),
    /// A tensor has the wrong shape or an element type without a kernel.
    #[error("tensor '{name}': {why}")]
    BadTensor { name: String, why: String },
    /// A token id outside the vocabulary.
    #[error("token id {token} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { token: u32, vocab: usize },
    /// The history would exceed the model's context length.
    #[error("history of {wanted} tokens exceeds the model context of {context}")]
    ContextOverflow { wanted: usize, context: usize },
    /// A layer range outside the model.
    #[error("layer range {start}..{end} is not inside the model's {n_layers} layers")]
    BadLayerRange {
        start: usize,
        end: usize,
        n_layers: usize,
    },
    /// The KV cache refused (pool exhausted, invariant violated, ...).
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// A loaded model: its configuration, where its weights are, and the map
/// that holds them.
pub struct Model {
    file: Arc<GgufFile>,
    pub config: ModelConfig,
    weights: Weights,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .finish()
    }
}

impl Model {
    /// Maps the GGUF at `path` and checks every tensor the network needs.
    /// Weights are not copied: they stay in the page cache.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        Self::from_gguf(Arc::new(GgufFile::open(path)?))
    }

    /// Builds the model over an already-opened file.
    pub fn from_gguf(file: Arc<GgufFile>) -> Result<Self, ModelError> {
        let config = ModelConfig::from_gguf(&file)?;
        if config.head_dim > MAX_HEAD_DIM {
            return Err(ModelError::BadConfig(format!(
                "head dimension {} exceeds the supported {MAX_HEAD_DIM}",
                config.head_dim
            )));
        }
        let weights = Weights::locate(&file, &config)?;
        Ok(Self {
            file,
            config,
            weights,
        })
    }

    /// The mapped file (for the tokenizer and metadata).
    pub fn gguf(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// Bytes of the file's tensor data: what a decode step streams.
    pub fn weight_bytes(&self) -> u64 {
        self.file.file_len().saturating_sub(self.file.data_start()) as u64
    }

    /// The weights' locations.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The KV page layout for `layers` of this model with `page_positions`
    /// positions per page.
    pub fn kv_layout(&self, n_layers: usize, page_positions: usize) -> KvLayout {
        KvLayout {
            n_layers,
            kv_dim: self.config.kv_dim(),
            page_positions,
        }
    }

    /// Per layer of `layers`, the sliding window it attends over (`None`:
    /// every position), for the KV pool to give back what windows left
    /// behind.
    pub fn kv_layer_windows(&self, layers: std::ops::Range<usize>) -> Vec<Option<usize>> {
        layers.map(|l| self.config.layer_window(l)).collect()
    }

    /// Bytes of K and V one position holds over every layer.
    pub fn kv_bytes_per_position(&self) -> usize {
        self.kv_layout(self.config.n_layers, 1).bytes_per_position()
    }
}
