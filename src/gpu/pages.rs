//! The KV pool of a GPU: the host pool allocates, counts and shares pages
//! as ever, while their bytes live in one device buffer ([`DeviceKv`]) that
//! [`DevicePages`] reads, writes and copies when a fork, spill or restore asks.

use std::sync::Arc;

use super::forward::DeviceKv;
use super::{GpuDevice, GpuError};
use crate::kv::{KvBacking, KvError, KvLayout, KvPool, KvPoolConfig, PageStore};

/// A pool of up to `wanted` pages of `layout` on `device` (fewer when one
/// binding cannot hold them all), and the device buffer behind it.
pub fn device_kv_pool(
    device: &Arc<GpuDevice>,
    layout: KvLayout,
    wanted: usize,
) -> Result<(KvPool, Arc<DeviceKv>), GpuError> {
    let page_bytes = layout.page_stride();
    let fit = (device.max_binding_bytes() / page_bytes as u64) as usize * device.kv_bindings();
    let n_pages = wanted.min(fit).max(1);
    let kv = Arc::new(DeviceKv::new(device, &layout, n_pages)?);
    let store: Arc<dyn PageStore> = Arc::new(DevicePages {
        device: Arc::clone(device),
        kv: Arc::clone(&kv),
    });
    let pool = KvPool::new(KvPoolConfig {
        layout,
        n_pages,
        backing: KvBacking::Device(store),
        prefault: false,
    })
    .map_err(|e| GpuError::Device {
        adapter: device.describe(),
        message: e.to_string(),
    })?;
    Ok((pool, kv))
}

/// The pool's pages in the device buffer, moved when the pool must.
pub struct DevicePages {
    device: Arc<GpuDevice>,
    kv: Arc<DeviceKv>,
}

impl DevicePages {
    fn range(&self, page: u32) -> Result<(&wgpu::Buffer, u64), KvError> {
        if page as usize >= self.kv.n_pages {
            return Err(KvError::AllocatorCorrupted {
                detail: format!("page {page} is not on the device"),
            });
        }
        Ok(self.kv.locate(page))
    }

    fn lost(e: GpuError) -> KvError {
        KvError::Device {
            detail: e.to_string(),
        }
    }
}

impl PageStore for DevicePages {
    fn read(&self, page: u32, out: &mut [u8]) -> Result<(), KvError> {
        let (buffer, offset) = self.range(page)?;
        let len = out.len().min(self.kv.page_values_bytes);
        let bytes = self
            .device
            .read_bytes(buffer, offset, len)
            .map_err(Self::lost)?;
        out[..len].copy_from_slice(&bytes);
        Ok(())
    }

    fn write(&self, page: u32, bytes: &[u8]) -> Result<(), KvError> {
        let (buffer, offset) = self.range(page)?;
        if bytes.len() > self.kv.page_values_bytes || !bytes.len().is_multiple_of(4) {
            return Err(KvError::RowLength {
                expected: self.kv.page_values_bytes,
                got: bytes.len(),
            });
        }
        // Deferred layers may still write this page (a freed page's last
        // owner): they go first.
        self.device.flush();
        self.device.queue.write_buffer(buffer, offset, bytes);
        self.device
            .submit(self.device.encoder("page write"))
            .map_err(Self::lost)
    }

    fn copy(&self, from: u32, to: u32) -> Result<(), KvError> {
        if from == to {
            return Ok(());
        }
        let ((src, src_at), (dst, dst_at)) = (self.range(from)?, self.range(to)?);
        // A buffer cannot be both ends of one copy: through a page of its own.
        let bytes = self.kv.page_words as u64 * 4;
        let tmp = self.device.storage("page copy", bytes);
        let mut encoder = self.device.encoder("page copy");
        encoder.copy_buffer_to_buffer(src, src_at, &tmp, 0, bytes);
        encoder.copy_buffer_to_buffer(&tmp, 0, dst, dst_at, bytes);
        self.device.submit(encoder).map_err(Self::lost)
    }

    fn describe(&self) -> String {
        format!("KV pages on {}", self.device.describe())
    }
}
