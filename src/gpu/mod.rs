//! The model on a GPU through wgpu (Vulkan, Metal): the device, weights
//! kept in their GGUF block formats, and the compute kernels of the forward pass.
//!
//! Determinism on one adapter comes from the kernels' shape, not from
//! luck: every output element is summed in one fixed order that depends
//! on the matrix alone, never on how many tokens or which sessions share
//! a step (see `shaders/matmul.wgsl`).

pub mod adapter;
mod device;
mod forward;
mod kernels;
mod matmul;
mod matrix;
mod pages;
mod record;
mod weights;

use crate::quant::GgmlType;

pub use adapter::AdapterKind;
pub use device::{GpuDevice, MAX_KV_BINDINGS, STEP_TIMEOUT};
pub use forward::{
    DeviceKv, ForwardError, GpuFeed, GpuForward, GpuLayerFeed, GpuModel, StepCapacity,
};
pub use matmul::{supports, MatmulCall, MatmulKernels};
pub use matrix::{DeviceMatrix, MatrixPart};
pub use pages::{device_kv_pool, DevicePages};
pub use weights::{Ends, GpuLayer, GpuWeights};

/// Why the GPU backend cannot do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No Vulkan (or, on macOS, Metal) adapter is visible to this process.
    #[error(
        "no GPU adapter found (looked for Vulkan and Metal devices{seen}): install a Vulkan \
         driver (on Debian: mesa-vulkan-drivers and libvulkan1) or run with --device cpu"
    )]
    NoAdapter { seen: String },
    /// The device could not be opened.
    #[error("opening the GPU device on {adapter} failed: {message}")]
    Device { adapter: String, message: String },
    /// A kernel failed validation on this device.
    #[error("building the {kernel} kernel on {adapter} failed: {message}")]
    Pipeline {
        adapter: String,
        kernel: String,
        message: String,
    },
    /// The kernels do not read this weight format.
    #[error("the GPU kernels do not read {ty} weights")]
    UnsupportedType { ty: GgmlType },
    /// A matrix whose bytes do not match its shape.
    #[error("matrix {name}: {why}")]
    BadMatrix { name: String, why: String },
    /// Something exceeds what the adapter can bind.
    #[error("{what} exceeds the adapter's limit of {limit} bytes per binding")]
    TooLarge { what: String, limit: u64 },
    /// The device has no memory left for it, or refused the buffers.
    #[error("{what} does not fit on {adapter}: {message}")]
    Allocation {
        what: String,
        adapter: String,
        message: String,
    },
    /// The device stopped answering or a buffer could not be mapped.
    #[error("the GPU failed while {what}: {message}")]
    Lost { what: &'static str, message: String },
}
