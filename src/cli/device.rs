//! `--device cpu|gpu|auto`: where the model's layers run, resolved once at
//! start and said in the log, so a missing GPU is an error or a fallback
//! the user can see, never a silent change.

use std::sync::Arc;

use clap::ValueEnum;
use serde::Deserialize;

use super::CliError;
use crate::gpu::{AdapterKind, GpuDevice};
use crate::sampler::gpu::GpuContext;
use crate::sampler::SamplerChoice;

/// Where the model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// The CPU (the default).
    #[default]
    Cpu,
    /// A GPU through wgpu (Vulkan, Metal): any adapter, a software one such
    /// as lavapipe included; start-up fails without one.
    Gpu,
    /// A hardware GPU when there is one and the model fits on it; else the
    /// CPU, saying why.
    Auto,
}

impl DeviceChoice {
    fn flag(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Gpu => "gpu",
            Self::Auto => "auto",
        }
    }
}

/// The device `choice` names: `None` for the CPU.
pub(crate) fn open_device(choice: DeviceChoice) -> Result<Option<Arc<GpuDevice>>, CliError> {
    let kind = match choice {
        DeviceChoice::Cpu => return Ok(None),
        DeviceChoice::Gpu => AdapterKind::Any,
        DeviceChoice::Auto => AdapterKind::Hardware,
    };
    match GpuDevice::open(kind) {
        Ok(device) => {
            tracing::info!(device = choice.flag(), adapter = %device.describe(), "model on the GPU");
            Ok(Some(device))
        }
        Err(e) if choice == DeviceChoice::Auto => {
            tracing::info!(device = "auto", "model on the CPU: {e}");
            Ok(None)
        }
        Err(e) => Err(CliError::Usage(format!("--device gpu: {e}"))),
    }
}

/// Builds what runs on the GPU with `build`; under `auto` a failure (the
/// model does not fit, a kernel the adapter refuses) falls back to the CPU.
pub(crate) fn on_device<T, E: std::fmt::Display>(
    choice: DeviceChoice,
    device: Option<Arc<GpuDevice>>,
    build: impl FnOnce(Arc<GpuDevice>) -> Result<T, E>,
) -> Result<Option<T>, CliError> {
    let Some(device) = device else {
        return Ok(None);
    };
    match build(device) {
        Ok(built) => Ok(Some(built)),
        Err(e) if choice == DeviceChoice::Auto => {
            tracing::warn!(
                device = "auto",
                "model on the CPU: the GPU could not take it: {e}"
            );
            Ok(None)
        }
        Err(e) => Err(CliError::Usage(format!("--device {}: {e}", choice.flag()))),
    }
}

/// The sampler on the model's device (`--sampler wgpu`, or `auto` on a
/// hardware GPU): sessions then sample where their logits are, and only
/// token ids come back. `auto` on a software adapter samples on the CPU,
/// as without the model there: it is far faster at it.
pub(crate) fn device_sampler(
    choice: SamplerChoice,
    device: &GpuDevice,
) -> Result<Option<Arc<GpuContext>>, CliError> {
    let on_cpu = match choice {
        SamplerChoice::Cpu => true,
        SamplerChoice::Auto => !device.is_hardware(),
        SamplerChoice::Wgpu => false,
    };
    if on_cpu {
        tracing::info!(%choice, "sampler: cpu (the logits come back from the GPU every step)");
        return Ok(None);
    }
    let context = GpuContext::on_device(device)
        .map_err(|e| CliError::Usage(format!("--sampler {choice} on the model's GPU: {e}")))?;
    tracing::info!(%choice, adapter = %device.describe(), "sampler: wgpu, on the model's device");
    Ok(Some(context))
}
