//! The GPU sampler as loom builds see it: loom model-checks the runtime's
//! concurrency, not a device, so there the types exist with no values and
//! [`GpuContext::open`] finds no adapter. Chosen by the module tree
//! (`sampler/mod.rs`), so the code around the sampler has no loom switches.

use std::sync::Arc;

use super::backend::SampleRequest;
use super::{Sampled, SamplerError};

/// Rows one dispatch samples (unused here).
pub const DEFAULT_MAX_ROWS: usize = 32;

/// Why no GPU sampler exists.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no wgpu adapter in a loom build{seen}")]
    NoAdapter { seen: String },
    /// Kept so matches written for the real sampler's errors hold here.
    #[error("opening the wgpu device on {adapter} failed: {message}")]
    Device { adapter: String, message: String },
}

/// Which adapters [`GpuContext::open`] may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterKind {
    Hardware,
    Any,
}

/// A device context: none can exist.
#[derive(Debug)]
pub enum GpuContext {}

impl GpuContext {
    pub fn open(_kind: AdapterKind) -> Result<Arc<GpuContext>, GpuError> {
        Err(GpuError::NoAdapter {
            seen: String::new(),
        })
    }

    pub fn describe(&self) -> String {
        match *self {}
    }
}

/// A GPU sampler: none can exist.
#[derive(Debug)]
pub enum GpuSampler {}

impl GpuSampler {
    pub fn new(
        context: Arc<GpuContext>,
        _vocab_size: usize,
        _max_rows: usize,
        _history_hint: usize,
    ) -> Result<GpuSampler, GpuError> {
        match *context {}
    }

    pub fn context(&self) -> &Arc<GpuContext> {
        match *self {}
    }

    pub fn sample_batch(
        &mut self,
        _rows: &[SampleRequest<'_>],
        _out: &mut Vec<Result<Sampled, SamplerError>>,
    ) {
        match *self {}
    }
}
