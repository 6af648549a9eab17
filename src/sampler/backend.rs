//! Which sampler a process uses, and the one interface the runtime and the
//! engine sample through: the CPU reference, or the WGSL sampler with the
//! CPU as its fallback should the device fail.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use super::gpu::{AdapterKind, GpuContext, GpuError, GpuSampler, DEFAULT_MAX_ROWS};
use super::{CheckedParams, Sampled, Sampler, SamplerError};

/// One row to sample: its logits, parameters, history (for penalties), the
/// absolute position of the token being sampled (the RNG counter), and how
/// many top log-probabilities to report with it (0: none; at most
/// [`super::MAX_TOP_LOGPROBS`]).
#[derive(Clone, Copy, Debug)]
pub struct SampleRequest<'a> {
    pub logits: &'a [f32],
    /// Checked once per call ([`super::SamplingParams::checked`]), not per token.
    pub params: &'a CheckedParams,
    pub history: &'a [u32],
    pub position: u64,
    pub top_logprobs: usize,
    /// The tokens a constraint allows (see [`super::Sampler::sample_masked`]).
    pub mask: Option<&'a [u32]>,
}

impl<'a> SampleRequest<'a> {
    /// Everything but the logits.
    pub fn row(&self) -> RowRequest<'a> {
        RowRequest {
            params: self.params,
            history: self.history,
            position: self.position,
            top_logprobs: self.top_logprobs,
            mask: self.mask,
        }
    }
}

/// What a row is sampled with, wherever its logits are (on the host, or
/// kept on the device by the layers that computed them).
#[derive(Clone, Copy, Debug)]
pub struct RowRequest<'a> {
    pub params: &'a CheckedParams,
    pub history: &'a [u32],
    pub position: u64,
    pub top_logprobs: usize,
    pub mask: Option<&'a [u32]>,
}

/// The operator's choice (`--sampler`, `sampler =` in the config file).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SamplerChoice {
    /// A hardware GPU adapter if one exists, else the CPU.
    #[default]
    Auto,
    /// The CPU reference sampler.
    Cpu,
    /// The WGSL sampler on any wgpu adapter (lavapipe included); start-up
    /// fails when there is none.
    Wgpu,
}

impl SamplerChoice {
    pub const NAMES: [&'static str; 3] = ["auto", "cpu", "wgpu"];
}

impl fmt::Display for SamplerChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SamplerChoice::Auto => "auto",
            SamplerChoice::Cpu => "cpu",
            SamplerChoice::Wgpu => "wgpu",
        })
    }
}

impl FromStr for SamplerChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(SamplerChoice::Auto),
            "cpu" => Ok(SamplerChoice::Cpu),
            "wgpu" => Ok(SamplerChoice::Wgpu),
            other => Err(format!(
                "unknown sampler {other:?}: expected one of {}",
                SamplerChoice::NAMES.join(", ")
            )),
        }
    }
}

/// A resolved choice: the CPU, or a wgpu context every worker shares.
#[derive(Clone, Debug, Default)]
pub enum SelectedSampler {
    #[default]
    Cpu,
    Wgpu(Arc<GpuContext>),
}

impl SelectedSampler {
    /// Resolves the operator's choice once, at start-up. `auto` takes a
    /// hardware adapter only: on a CPU-only host a software Vulkan device
    /// samples far slower than the CPU sampler (docs/PERFORMANCE.md).
    pub fn resolve(choice: SamplerChoice) -> Result<SelectedSampler, GpuError> {
        match choice {
            SamplerChoice::Cpu => Ok(SelectedSampler::Cpu),
            SamplerChoice::Wgpu => Ok(SelectedSampler::Wgpu(GpuContext::open(AdapterKind::Any)?)),
            SamplerChoice::Auto => match GpuContext::open(AdapterKind::Hardware) {
                Ok(context) => Ok(SelectedSampler::Wgpu(context)),
                Err(GpuError::NoAdapter { seen }) => {
                    tracing::info!("no hardware GPU adapter{seen}; sampling on the CPU");
                    Ok(SelectedSampler::Cpu)
                }
                Err(error) => {
                    tracing::warn!(%error, "the GPU sampler is unavailable; sampling on the CPU");
                    Ok(SelectedSampler::Cpu)
                }
            },
        }
    }

    /// `cpu` or `wgpu`.
    pub fn backend_name(&self) -> &'static str {
        match self {
            SelectedSampler::Cpu => "cpu",
            SelectedSampler::Wgpu(_) => "wgpu",
        }
    }

    /// The adapter in use, described for logs and metrics (`None` on the CPU).
    pub fn adapter(&self) -> Option<String> {
        match self {
            SelectedSampler::Cpu => None,
            SelectedSampler::Wgpu(context) => Some(context.describe()),
        }
    }

    /// One worker's sampler for `vocab_size` logits per row; `history_hint`
    /// sizes the GPU's penalty-window buffers (the context length).
    pub fn backend(
        &self,
        vocab_size: usize,
        history_hint: usize,
    ) -> Result<SamplerBackend, SamplerError> {
        match self {
            SelectedSampler::Cpu => Ok(SamplerBackend::Cpu(Sampler::new())),
            SelectedSampler::Wgpu(context) => {
                let gpu = GpuSampler::new(
                    Arc::clone(context),
                    vocab_size,
                    DEFAULT_MAX_ROWS,
                    history_hint,
                )
                .map_err(|e| SamplerError::Device {
                    message: e.to_string(),
                })?;
                Ok(SamplerBackend::Wgpu {
                    gpu: Box::new(gpu),
                    cpu: Sampler::new(),
                    failed: false,
                })
            }
        }
    }
}

/// The sampler a worker or an engine owns.
#[derive(Debug)]
pub enum SamplerBackend {
    Cpu(Sampler),
    /// The GPU path; once the device fails, `cpu` takes over for good
    /// (logged once) rather than failing every later request.
    Wgpu {
        gpu: Box<GpuSampler>,
        cpu: Sampler,
        failed: bool,
    },
}

impl Default for SamplerBackend {
    fn default() -> Self {
        SamplerBackend::Cpu(Sampler::new())
    }
}

impl SamplerBackend {
    /// `cpu`, or `wgpu` while the device works.
    pub fn name(&self) -> &'static str {
        match self {
            SamplerBackend::Cpu(_) => "cpu",
            SamplerBackend::Wgpu { failed: false, .. } => "wgpu",
            SamplerBackend::Wgpu { failed: true, .. } => "cpu",
        }
    }

    /// The GPU sampler, while the device works (`None` on the CPU).
    pub fn gpu_mut(&mut self) -> Option<&mut GpuSampler> {
        match self {
            SamplerBackend::Wgpu {
                gpu, failed: false, ..
            } => Some(gpu),
            _ => None,
        }
    }

    /// Samples one row.
    pub fn sample(&mut self, request: SampleRequest<'_>) -> Result<Sampled, SamplerError> {
        match self {
            SamplerBackend::Cpu(cpu) => cpu_sample(cpu, &request),
            SamplerBackend::Wgpu { .. } => {
                let mut out = Vec::with_capacity(1);
                self.sample_batch(&[request], &mut out);
                out.pop().unwrap_or(Err(SamplerError::EmptyLogits))
            }
        }
    }

    /// Samples every row; `out[i]` answers `rows[i]`. On the GPU the whole
    /// batch is one dispatch (up to the sampler's row capacity).
    pub fn sample_batch(
        &mut self,
        rows: &[SampleRequest<'_>],
        out: &mut Vec<Result<Sampled, SamplerError>>,
    ) {
        match self {
            SamplerBackend::Cpu(cpu) => {
                out.clear();
                out.extend(rows.iter().map(|row| cpu_sample(cpu, row)));
            }
            SamplerBackend::Wgpu { gpu, cpu, failed } => {
                wgpu_batch(gpu, cpu, failed, rows, out);
            }
        }
    }
}

/// The GPU sampler's batch, falling back to the CPU for good once the
/// device fails.
fn wgpu_batch(
    gpu: &mut GpuSampler,
    cpu: &mut Sampler,
    failed: &mut bool,
    rows: &[SampleRequest<'_>],
    out: &mut Vec<Result<Sampled, SamplerError>>,
) {
    if !*failed {
        gpu.sample_batch(rows, out);
        let device_error = out.iter().find_map(|r| match r {
            Err(SamplerError::Device { message }) => Some(message.clone()),
            _ => None,
        });
        let Some(message) = device_error else {
            return;
        };
        tracing::error!(
            adapter = %gpu.context().describe(),
            error = %message,
            "the GPU sampler failed; this worker samples on the CPU from now on"
        );
        *failed = true;
    }
    out.clear();
    out.extend(rows.iter().map(|row| cpu_sample(cpu, row)));
}

/// One row on the CPU reference sampler.
fn cpu_sample(cpu: &mut Sampler, row: &SampleRequest<'_>) -> Result<Sampled, SamplerError> {
    cpu.sample_masked(
        row.logits,
        row.params,
        row.history,
        row.position,
        row.top_logprobs,
        row.mask,
    )
}
