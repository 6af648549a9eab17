//! The runtime's step interface on a GPU: [`GpuLayers`] holds the model's
//! weights and the KV pages on the device and gives each worker a runner;
//! sessions, queues, prefix sharing, forks, spill and eviction stay the
//! runtime's, as with the layers in this process. With a sampler on the
//! same device, a generating session's logits stay there: each worker's
//! runner keeps them in a row of its kept-logits buffer and samples them
//! where they are.

mod kept;

use std::sync::{Arc, Mutex, OnceLock};

use super::step::{Layers, StepError, StepFeed, StepRunner};
use super::{RuntimeConfig, RuntimeError, SessionId};
use crate::gpu::{
    device_kv_pool, DeviceKv, ForwardError, GpuDevice, GpuError, GpuFeed, GpuForward, GpuModel,
    StepCapacity,
};
use crate::kv::KvPool;
use crate::model::{LogitRows, LogitsWanted, Model, Scratch};
use crate::sampler::gpu::{GpuContext, GpuSampler, KeptRow, DEFAULT_MAX_ROWS};
use crate::sampler::{RowRequest, SampleRequest, Sampled, SamplerError};
use crate::threads::ThreadPool;
use kept::{KeptRows, Placed};

/// Every layer on one GPU; see the module docs.
pub struct GpuLayers {
    gpu: Arc<GpuModel>,
    kv: OnceLock<Arc<DeviceKv>>,
    /// The pool made ahead of the runtime ([`GpuLayers::with_kv`]).
    prepared: Mutex<Option<(usize, KvPool, Arc<DeviceKv>)>>,
    capacity: StepCapacity,
    /// The sampler on the model's device, when sessions sample there.
    sampler: Option<Arc<GpuContext>>,
}

impl GpuLayers {
    /// Uploads `model` to `device`.
    pub fn new(device: Arc<GpuDevice>, model: Arc<Model>) -> Result<Self, GpuError> {
        Ok(Self {
            gpu: GpuModel::new(device, model)?,
            kv: OnceLock::new(),
            prepared: Mutex::new(None),
            capacity: StepCapacity::default(),
            sampler: None,
        })
    }

    /// Generating sessions sample on the device with `sampler` (a context
    /// on the model's device: [`GpuContext::on_device`]); their logits
    /// never leave it.
    pub fn sampling_on(mut self, sampler: Arc<GpuContext>) -> Self {
        self.sampler = Some(sampler);
        self
    }

    /// Allocates the KV cache `cfg` asks for now, so that a model whose
    /// weights and KV do not both fit on the device fails here (where
    /// `--device auto` can still take the CPU), not at the first step.
    pub fn with_kv(self, cfg: &RuntimeConfig) -> Result<Self, GpuError> {
        let (pool, kv) = self.device_pool(cfg)?;
        *self.prepared.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((cfg.page_positions, pool, kv));
        Ok(self)
    }

    fn device_pool(&self, cfg: &RuntimeConfig) -> Result<(KvPool, Arc<DeviceKv>), GpuError> {
        let model = &self.gpu.model;
        let n_layers = model.config.n_layers;
        let layout = model.kv_layout(n_layers, cfg.page_positions);
        let wanted = KvPool::pages_for_bytes(&layout, cfg.kv_bytes).max(n_layers);
        let (pool, kv) = device_kv_pool(&self.gpu.device, layout, wanted)?;
        if kv.n_pages < wanted {
            tracing::warn!(
                wanted,
                pages = kv.n_pages,
                "the KV cache is smaller than asked: the attention kernels' {} bindings hold {} \
                 pages",
                self.gpu.device.kv_bindings(),
                kv.n_pages
            );
        }
        Ok((pool, kv))
    }

    /// Steps of at most `capacity` (a bigger batch runs as several).
    pub fn with_capacity(mut self, capacity: StepCapacity) -> Self {
        self.capacity = capacity;
        self
    }

    /// The model's device.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.gpu.device
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
        let prepared = self
            .prepared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .filter(|(page_positions, ..)| *page_positions == cfg.page_positions);
        let (pool, kv) = match prepared {
            Some((_, pool, kv)) => (pool, kv),
            None => self.device_pool(cfg).map_err(gpu_error)?,
        };
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
        let sampler = match &self.sampler {
            Some(context) => {
                let mut sampler = GpuSampler::new(
                    Arc::clone(context),
                    self.gpu.model.config.vocab,
                    DEFAULT_MAX_ROWS,
                    self.gpu.model.config.context,
                )
                .map_err(|e| RuntimeError::Internal(format!("the GPU sampler: {e}")))?;
                let (buffer, rows) = forward.kept();
                sampler.read_kept_from(forward.device(), buffer, rows as u32);
                Some(Box::new(sampler))
            }
            None => None,
        };
        let rows = KeptRows::new(forward.kept().1);
        Ok(Box::new(GpuRunner {
            forward,
            sampler,
            rows,
            vocab: self.gpu.model.config.vocab,
        }))
    }

    fn describe(&self) -> String {
        format!("layers on the GPU {}", self.gpu.device.describe())
    }

    fn backend(&self) -> &'static str {
        "gpu"
    }

    fn logit_rows_read(&self) -> Option<u64> {
        Some(
            self.gpu
                .logit_rows_read
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    fn gpu_submissions(&self) -> Option<u64> {
        Some(self.gpu.device.submissions())
    }
}

/// One worker's steps on the device.
struct GpuRunner {
    forward: GpuForward,
    /// Samples kept logits (none: the layers keep no logits).
    sampler: Option<Box<GpuSampler>>,
    rows: KeptRows,
    vocab: usize,
}

impl GpuRunner {
    /// Whether this runner holds `f`'s last row instead of returning it.
    fn keeps(&self, f: &StepFeed<'_>) -> bool {
        self.sampler.is_some() && f.keep_logits && f.logits == LogitsWanted::Last
    }

    /// Where each feed's kept logits go this step; a row taken from
    /// another session has that session's logits read out first.
    fn place_kept(&mut self, feeds: &[StepFeed<'_>]) -> Result<Vec<Option<u32>>, GpuError> {
        self.rows.begin_step();
        let mut places = Vec::with_capacity(feeds.len());
        for f in feeds {
            if !self.keeps(f) {
                places.push(None);
                continue;
            }
            places.push(match self.rows.place(f.session) {
                Placed::Row(row) => Some(row),
                Placed::Taken { row, from } => {
                    let values = self.forward.read_kept(row)?;
                    self.rows.evicted.insert(from, values);
                    Some(row)
                }
                Placed::Host => None,
            });
        }
        Ok(places)
    }
}

fn lost(e: ForwardError) -> StepError {
    StepError::SessionsLost(match e {
        ForwardError::Model(e) => e.into(),
        ForwardError::Gpu(e) => gpu_error(e),
    })
}

impl StepRunner for GpuRunner {
    fn forward(
        &mut self,
        feeds: &mut [StepFeed<'_>],
        _pool: &ThreadPool,
        scratch: &mut Scratch,
    ) -> Result<LogitRows, StepError> {
        let places = self
            .place_kept(feeds)
            .map_err(|e| lost(ForwardError::Gpu(e)))?;
        let mut gpu_feeds: Vec<GpuFeed<'_>> = feeds
            .iter_mut()
            .zip(&places)
            .map(|(f, &keep)| GpuFeed {
                kv: &mut *f.kv,
                tokens: f.tokens,
                logits: f.logits,
                keep,
            })
            .collect();
        let rows = self
            .forward
            .forward(&mut gpu_feeds, &mut scratch.logits)
            .map_err(lost)?;
        drop(gpu_feeds);
        // Kept logits that found no row this step are held on the host.
        let vocab = self.vocab;
        for ((f, place), range) in feeds.iter().zip(&places).zip(&rows.per_sequence) {
            if self.keeps(f) && place.is_none() {
                if let Some(last) = range.end.checked_sub(1) {
                    let row = scratch.logits[last * vocab..][..vocab].to_vec();
                    self.rows.evicted.insert(f.session, row);
                }
            }
        }
        Ok(rows)
    }

    fn release(&mut self, session: SessionId) {
        self.rows.release(session);
    }

    fn keeps_logits(&self) -> bool {
        self.sampler.is_some()
    }

    fn kept_logits(&self, session: SessionId) -> Result<Vec<f32>, RuntimeError> {
        if let Some(row) = self.rows.row(session) {
            return self.forward.read_kept(row).map_err(gpu_error);
        }
        self.rows.evicted.get(&session).cloned().ok_or_else(|| {
            RuntimeError::Internal(format!("no logits are kept for session {session}"))
        })
    }

    fn sample_host(
        &mut self,
        rows: &[SampleRequest<'_>],
        out: &mut Vec<Result<Sampled, SamplerError>>,
    ) {
        out.clear();
        let Some(sampler) = self.sampler.as_mut() else {
            out.extend(rows.iter().map(|_| {
                Err(SamplerError::Device {
                    message: "the layers keep no logits and hold no sampler".into(),
                })
            }));
            return;
        };
        sampler.sample_batch(rows, out);
    }

    fn sample_kept(
        &mut self,
        rows: &[(SessionId, RowRequest<'_>)],
        out: &mut Vec<Result<Sampled, SamplerError>>,
    ) {
        out.clear();
        if self.sampler.is_none() {
            out.extend(rows.iter().map(|_| {
                Err(SamplerError::Device {
                    message: "the layers keep no logits".into(),
                })
            }));
            return;
        }
        // Rows on the device in one dispatch; rows held on the host (their
        // row went to another session) uploaded in a second.
        let mut on_device = Vec::new();
        let mut on_host = Vec::new();
        let mut which = Vec::with_capacity(rows.len());
        let placed: Vec<Option<u32>> = rows.iter().map(|(id, _)| self.rows.touch(*id)).collect();
        for ((id, request), place) in rows.iter().zip(placed) {
            if let Some(row) = place {
                which.push(Where::Device);
                on_device.push(KeptRow {
                    row,
                    request: *request,
                });
            } else if let Some(logits) = self.rows.evicted.get(id) {
                which.push(Where::Host);
                on_host.push(SampleRequest {
                    logits,
                    params: request.params,
                    history: request.history,
                    position: request.position,
                    top_logprobs: request.top_logprobs,
                    mask: request.mask,
                });
            } else {
                which.push(Where::Missing);
            }
        }
        let mut device_out = Vec::new();
        let mut host_out = Vec::new();
        if let Some(sampler) = self.sampler.as_mut() {
            if !on_device.is_empty() {
                sampler.sample_kept(&on_device, &mut device_out);
            }
            if !on_host.is_empty() {
                sampler.sample_batch(&on_host, &mut host_out);
            }
        }
        let mut device_out = device_out.into_iter();
        let mut host_out = host_out.into_iter();
        for (w, (id, _)) in which.into_iter().zip(rows) {
            let missing = || {
                Err(SamplerError::Device {
                    message: format!("no logits are kept for session {id}"),
                })
            };
            out.push(match w {
                Where::Device => device_out.next().unwrap_or_else(missing),
                Where::Host => host_out.next().unwrap_or_else(missing),
                Where::Missing => missing(),
            });
        }
    }
}

/// Where a kept row is sampled.
enum Where {
    Device,
    Host,
    /// Nowhere: no logits are kept for its session.
    Missing,
}
