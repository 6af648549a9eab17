//! The long-lived wgpu context of the GPU sampler: one adapter, device,
//! queue, shader module and compute pipeline per process, created at
//! start-up and shared by every worker's [`super::GpuSampler`].

use std::sync::Arc;

use futures_executor::block_on;

use super::layout::{shader_source, WORKGROUP_SIZE};
pub use crate::gpu::adapter::AdapterKind;
use crate::gpu::adapter::{self, describe, is_hardware};

/// Why no GPU sampler could be had.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No Vulkan (or, on macOS, Metal) adapter is visible to this process.
    #[error(
        "no wgpu adapter found (looked for Vulkan and Metal devices{}): install a Vulkan driver \
         (on Debian: mesa-vulkan-drivers and libvulkan1) or use --sampler cpu",
        .seen
    )]
    NoAdapter { seen: String },
    /// The device could not be opened.
    #[error("opening the wgpu device on {adapter} failed: {message}")]
    Device { adapter: String, message: String },
    /// The shader or the pipeline failed validation on this device.
    #[error("building the sampler pipeline on {adapter} failed: {message}")]
    Pipeline { adapter: String, message: String },
}

/// Device, queue and the sampler pipeline; see the module docs.
pub struct GpuContext {
    pub(super) info: wgpu::AdapterInfo,
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    pub(super) pipeline: wgpu::ComputePipeline,
    pub(super) layout: wgpu::BindGroupLayout,
    pub(super) limits: wgpu::Limits,
    /// Samplers alive on this context (each holds a vocabulary's worth of
    /// rows in buffers: the count is what a worker costs in memory).
    pub(super) samplers: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuContext")
            .field("adapter", &self.describe())
            .finish()
    }
}

impl GpuContext {
    /// Finds the best adapter of the wanted kind and builds the pipeline.
    pub fn open(kind: AdapterKind) -> Result<Arc<GpuContext>, GpuError> {
        let adapter = adapter::choose(kind).map_err(|e| GpuError::NoAdapter { seen: e.seen })?;
        Self::with_adapter(adapter)
    }

    fn with_adapter(adapter: wgpu::Adapter) -> Result<Arc<GpuContext>, GpuError> {
        let info = adapter.get_info();
        let name = describe(&info);
        let limits = adapter.limits();
        let (device, queue) = block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("inferd sampler"),
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| GpuError::Device {
            adapter: name.clone(),
            message: e.to_string(),
        })?;
        // Errors inside a sampling step are caught by error scopes; anything
        // else is logged rather than panicking a worker thread.
        device.on_uncaptured_error(Arc::new(|error: wgpu::Error| {
            tracing::error!(%error, "wgpu sampler error");
        }));
        Self::build(info, device, queue, limits)
    }

    /// The sampler on the device the model runs on, so that it reads the
    /// logits the layers keep there (and the process drives one device).
    pub fn on_device(device: &crate::gpu::GpuDevice) -> Result<Arc<GpuContext>, GpuError> {
        Self::build(
            device.info().clone(),
            device.device.clone(),
            device.queue.clone(),
            device.limits().clone(),
        )
    }

    fn build(
        info: wgpu::AdapterInfo,
        device: wgpu::Device,
        queue: wgpu::Queue,
        limits: wgpu::Limits,
    ) -> Result<Arc<GpuContext>, GpuError> {
        let name = describe(&info);
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("sampler.wgsl"),
            source: wgpu::ShaderSource::Wgsl(shader_source().into()),
        });
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("sampler bindings"),
            entries: &bind_group_layout_entries(),
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("sampler pipeline layout"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("sample_rows"),
            layout: Some(&pipeline_layout),
            module: &module,
            entry_point: Some("sample_rows"),
            compilation_options: wgpu::PipelineCompilationOptions::default(),
            cache: None,
        });
        if let Some(error) = block_on(scope.pop()) {
            return Err(GpuError::Pipeline {
                adapter: name,
                message: error.to_string(),
            });
        }
        tracing::debug!(adapter = %name, workgroup = WORKGROUP_SIZE, "sampler pipeline built");
        Ok(Arc::new(GpuContext {
            info,
            device,
            queue,
            pipeline,
            layout,
            limits,
            samplers: std::sync::atomic::AtomicUsize::new(0),
        }))
    }

    /// Samplers alive on this context.
    pub fn samplers(&self) -> usize {
        self.samplers.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The adapter's name, backend, kind and driver, for logs and metrics.
    pub fn describe(&self) -> String {
        describe(&self.info)
    }

    /// Whether this context is on `device` (so it can read its buffers).
    pub fn shares_device(&self, device: &crate::gpu::GpuDevice) -> bool {
        self.device == device.device
    }

    /// Whether the adapter is a real GPU (not lavapipe or another CPU one).
    pub fn is_hardware(&self) -> bool {
        is_hardware(self.info.device_type)
    }

    /// Live GPU objects and memory of this device, from wgpu's counters:
    /// the evidence that sampling steps create nothing.
    pub fn resource_counts(&self) -> ResourceCounts {
        let counters = self.device.get_internal_counters();
        let hal = counters.hal;
        ResourceCounts {
            buffers: hal.buffers.read(),
            bind_groups: hal.bind_groups.read(),
            compute_pipelines: hal.compute_pipelines.read(),
            shader_modules: hal.shader_modules.read(),
            buffer_memory: hal.buffer_memory.read(),
            memory_allocations: hal.memory_allocations.read(),
        }
    }
}

/// A snapshot of [`GpuContext::resource_counts`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResourceCounts {
    pub buffers: isize,
    pub bind_groups: isize,
    pub compute_pipelines: isize,
    pub shader_modules: isize,
    pub buffer_memory: isize,
    pub memory_allocations: isize,
}

/// Bindings of `shaders/sampler.wgsl`, in its order.
fn bind_group_layout_entries() -> [wgpu::BindGroupLayoutEntry; 7] {
    let storage = |binding: u32, read_only: bool| wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    };
    [
        wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        },
        storage(1, true),
        storage(2, true),
        storage(3, false),
        storage(4, false),
        storage(5, false),
        storage(6, false),
    ]
}
