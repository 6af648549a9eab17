//! The runtime's step interface on a GPU: [`GpuLayers`] holds the model's
//! weights and the KV pages on the device and gives each worker a runner;
//! sessions, queues, prefix sharing, forks, spill and eviction stay the
//! runtime's, as with the layers in this process.

use std::sync::{Arc, OnceLock};

use super::step::{Layers, StepError, StepFeed, StepRunner};
use super::{RuntimeConfig, RuntimeError};
use crate::gpu::{
    device_kv_pool, DeviceKv, ForwardError, GpuDevice, GpuError, GpuFeed, GpuForward, GpuModel,
    StepCapacity,
};
use crate::kv::KvPool;
use crate::model::{LogitRows, Model, Scratch};
use crate::threads::ThreadPool;

/// Every layer on one GPU; see the module docs.
pub struct GpuLayers {
    gpu: Arc<GpuModel>,
    kv: OnceLock<Arc<DeviceKv>>,
    capacity: StepCapacity,
}

impl GpuLayers {
    /// Uploads `model` to `device`.
    pub fn new(device: Arc<GpuDevice>, model: Arc<Model>) -> Result<Self, GpuError> {
        Ok(Self {
            gpu: GpuModel::new(device, model)?,
            kv: OnceLock::new(),
            capacity: StepCapacity::default(),
        })
    }

    /// Bytes the weights take on the device.
    pub fn weight_bytes(&self) -> u64 {
        self.gpu.weights.device_bytes()
    }
}

fn gpu_error(e: GpuError) -> RuntimeError {
    RuntimeError::Internal(format!("GPU: {e}"))
}

impl Layers for GpuLayers {
    fn kv_pool(&self, model: &Model, cfg: &mut RuntimeConfig) -> Result<KvPool, RuntimeError> {
        let n_layers = model.config.n_layers;
        let layout = model.kv_layout(n_layers, cfg.page_positions);
        let wanted = KvPool::pages_for_bytes(&layout, cfg.kv_bytes).max(n_layers);
        let (pool, kv) = device_kv_pool(&self.gpu.device, layout, wanted).map_err(gpu_error)?;
        if kv.n_pages < wanted {
            tracing::warn!(
                wanted,
                pages = kv.n_pages,
                "the KV cache is smaller than asked: one GPU binding holds {} pages",
                kv.n_pages
            );
        }
        self.kv
            .set(kv)
            .map_err(|_| RuntimeError::Internal("the GPU KV pool was built twice".into()))?;
        Ok(pool
            .with_layer_windows(model.kv_layer_windows(0..n_layers))?
            .with_window_slack(if cfg.state.is_some() {
                cfg.page_positions
            } else {
                0
            }))
    }

    fn runner(
        &self,
        _worker: usize,
        _model: &Arc<Model>,
        _cfg: &RuntimeConfig,
    ) -> Result<Box<dyn StepRunner>, RuntimeError> {
        let kv = self
            .kv
            .get()
            .ok_or_else(|| RuntimeError::Internal("GPU runner asked for before its KV".into()))?;
        let forward =
            GpuForward::new(Arc::clone(&self.gpu), kv, self.capacity).map_err(gpu_error)?;
        Ok(Box::new(GpuRunner { forward }))
    }

    fn describe(&self) -> String {
        format!("layers on the GPU {}", self.gpu.device.describe())
    }

    fn backend(&self) -> &'static str {
        "gpu"
    }
}

/// One worker's steps on the device.
struct GpuRunner {
    forward: GpuForward,
}

impl StepRunner for GpuRunner {
    fn forward(
        &mut self,
        feeds: &mut [StepFeed<'_>],
        _pool: &ThreadPool,
        scratch: &mut Scratch,
    ) -> Result<LogitRows, StepError> {
        let mut gpu_feeds: Vec<GpuFeed<'_>> = feeds
            .iter_mut()
            .map(|f| GpuFeed {
                kv: &mut *f.kv,
                tokens: f.tokens,
                logits: f.logits,
            })
            .collect();
        self.forward
            .forward(&mut gpu_feeds, &mut scratch.logits)
            .map_err(|e| {
                StepError::SessionsLost(match e {
                    ForwardError::Model(e) => e.into(),
                    ForwardError::Gpu(e) => gpu_error(e),
                })
            })
    }
}
