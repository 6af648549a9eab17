//! Which wgpu adapter a process takes: Vulkan or Metal only, real GPUs
//! before software ones, and how an adapter is named in logs and errors.

use futures_executor::block_on;

/// Which adapters may be taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterKind {
    /// A discrete, integrated or virtual GPU; software rasterisers refused.
    Hardware,
    /// Any adapter, a CPU implementation such as lavapipe included.
    Any,
}

/// No adapter of the wanted kind; `seen` lists the others, if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoAdapter {
    /// Empty, or "; only software adapters: ..." naming what was refused.
    pub seen: String,
}

/// Preference among adapters: real GPUs first, software last.
fn rank(device_type: wgpu::DeviceType) -> u8 {
    match device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// Whether the adapter is a real GPU rather than a CPU implementation.
pub fn is_hardware(device_type: wgpu::DeviceType) -> bool {
    !matches!(device_type, wgpu::DeviceType::Cpu)
}

/// The adapter's name, backend, kind and driver, for logs and metrics.
pub fn describe(info: &wgpu::AdapterInfo) -> String {
    format!(
        "{} ({:?} {:?}, driver {} {})",
        info.name, info.backend, info.device_type, info.driver, info.driver_info
    )
}

fn backends() -> wgpu::Backends {
    // Vulkan and Metal only: GL would be taken silently when no Vulkan
    // driver is installed, and is far slower for compute.
    wgpu::Backends::VULKAN | wgpu::Backends::METAL
}

/// The best adapter of the wanted kind.
pub fn choose(kind: AdapterKind) -> Result<wgpu::Adapter, NoAdapter> {
    let mut descriptor = wgpu::InstanceDescriptor::new_without_display_handle();
    descriptor.backends = backends();
    descriptor.flags = wgpu::InstanceFlags::empty();
    let instance = wgpu::Instance::new(descriptor);
    let mut adapters = block_on(instance.enumerate_adapters(backends()));
    let seen: Vec<String> = adapters.iter().map(|a| describe(&a.get_info())).collect();
    adapters.retain(|a| kind == AdapterKind::Any || is_hardware(a.get_info().device_type));
    adapters.sort_by_key(|a| rank(a.get_info().device_type));
    adapters.into_iter().next().ok_or_else(|| NoAdapter {
        seen: if seen.is_empty() {
            String::new()
        } else {
            format!("; only software adapters: {}", seen.join(", "))
        },
    })
}
