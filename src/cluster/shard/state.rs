//! Opening a shard: the layer range checked against the model, the KV
//! pool sized for it, and, with a state directory, the pages kept there.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use super::{random_epoch, Core, ShardConfig, ShardStartError, ShardState, DEFAULT_MAX_FRAME_ROWS};
use crate::cluster::fingerprint::Fingerprint;
use crate::cluster::handshake::limits_to_wire;
use crate::cluster::keeper::{self, Keeper};
use crate::cluster::kept::{Identity, StateDir};
use crate::gpu::{device_kv_pool, GpuForward, GpuModel, StepCapacity};
use crate::kv::{KvBacking, KvPool, KvPoolConfig, DEFAULT_PAGE_POSITIONS};
use crate::model::{Model, Scratch};
use crate::threads::ThreadPool;

impl ShardState {
    /// The layer range's KV pool, sized from `cfg.kv_bytes`, and the
    /// limits the handshake offers.
    pub(super) fn new(
        model: Arc<Model>,
        fingerprint: Fingerprint,
        cfg: &ShardConfig,
    ) -> Result<ShardState, ShardStartError> {
        let n_layers = model.config.n_layers;
        if cfg.layers.start >= cfg.layers.end || cfg.layers.end > n_layers {
            return Err(ShardStartError::Layers {
                start: cfg.layers.start,
                end: cfg.layers.end,
                n_layers,
            });
        }
        let layout = model.kv_layout(cfg.layers.len(), DEFAULT_PAGE_POSITIONS);
        let n_pages = KvPool::pages_for_bytes(&layout, cfg.kv_bytes).max(layout.n_layers);
        let identity = Identity {
            gguf_sha256: fingerprint.gguf_sha256,
            layer_begin: cfg.layers.start as u32,
            layer_end: cfg.layers.end as u32,
            page_positions: layout.page_positions as u32,
            kv_dim: layout.kv_dim as u32,
        };
        if let Some(device) = &cfg.gpu {
            if cfg.state_dir.is_some() {
                return Err(ShardStartError::StateDirOnDevice);
            }
            let (pool, kv) = device_kv_pool(device, layout, n_pages)?;
            let kv_pool =
                Arc::new(pool.with_layer_windows(model.kv_layer_windows(cfg.layers.clone()))?);
            let gpu = GpuModel::new_part(
                Arc::clone(device),
                Arc::clone(&model),
                cfg.layers.clone(),
                false,
            )?;
            tracing::info!(
                adapter = %device.describe(),
                weights_mib = gpu.weights.device_bytes() >> 20,
                kv_pages = kv.n_pages,
                "the shard's layers on the GPU"
            );
            let forward = GpuForward::new(gpu, &kv, StepCapacity::default())?;
            return Ok(Self::with_core(
                model,
                fingerprint,
                cfg,
                kv_pool,
                None,
                Some(forward),
            ));
        }
        let state = match &cfg.state_dir {
            Some(dir) => Some(StateDir::open(dir, identity)?),
            None => None,
        };
        let backing = match &state {
            Some((dir, _)) => KvBacking::Kept(dir.page_file()),
            None => KvBacking::Anonymous,
        };
        let mut kv_pool = KvPool::new(KvPoolConfig {
            layout,
            n_pages,
            backing,
            prefault: false,
        })?
        .with_layer_windows(model.kv_layer_windows(cfg.layers.clone()))?;
        let verified = match state {
            Some((dir, opened)) => {
                // A window layer keeps a page of slack, so that a session
                // cut back to a page boundary still has what it reads.
                kv_pool = kv_pool.with_window_slack(layout.page_positions);
                let verified = keeper::verify(&identity, opened, &mut kv_pool)?;
                Some((dir, verified))
            }
            None => None,
        };
        let kv_pool = Arc::new(kv_pool);
        let keeper = verified.map(|(dir, verified)| {
            let report = &verified.report;
            if let Some(why) = &report.refused {
                tracing::warn!(reason = %why, "the state directory's page log is not this shard's: starting without kept pages");
            }
            if let Some(offset) = report.damaged_at {
                tracing::warn!(offset, "the page log is damaged there: what follows is not used");
            }
            tracing::info!(
                sessions = report.sessions,
                positions = report.taken.positions,
                pages_rejected = report.taken.rejected,
                "pages kept from the state directory"
            );
            Keeper::new(dir, verified, &kv_pool)
        });
        Ok(Self::with_core(
            model,
            fingerprint,
            cfg,
            kv_pool,
            keeper,
            None,
        ))
    }

    /// The shared state around a core of `kv_pool`, `keeper` and `gpu`.
    fn with_core(
        model: Arc<Model>,
        fingerprint: Fingerprint,
        cfg: &ShardConfig,
        kv_pool: Arc<KvPool>,
        keeper: Option<Keeper>,
        gpu: Option<GpuForward>,
    ) -> ShardState {
        let context = model.config.context as u64;
        let keeps_pages = keeper.is_some();
        let backend = if gpu.is_some() { "gpu" } else { "cpu" };
        // Told to the coordinator in pages of positions over all the
        // shard's layers (a pool page holds one layer), as its ledger counts.
        let kv_pages = (kv_pool.total_pages() / cfg.layers.len().max(1)) as u64;
        let page_positions = kv_pool.layout().page_positions as u32;
        ShardState {
            core: Mutex::new(Core {
                model,
                layers: cfg.layers.clone(),
                kv_pool,
                sessions: HashMap::new(),
                pool: ThreadPool::new(cfg.threads.max(1)),
                scratch: Scratch::default(),
                max_sessions: cfg.max_sessions as usize,
                keeper,
                gpu,
            }),
            fingerprint,
            epoch: random_epoch(),
            limits: {
                let mut limits = limits_to_wire(
                    cfg.max_frame_bytes,
                    cfg.credit_window,
                    cfg.max_sessions,
                    &cfg.encodings,
                );
                limits.set_max_frame_rows(match cfg.max_frame_rows {
                    0 => DEFAULT_MAX_FRAME_ROWS,
                    n => n,
                });
                limits
            },
            agreed: Mutex::new(HashMap::new()),
            cancelled: std::sync::atomic::AtomicU64::new(0),
            streams: std::sync::atomic::AtomicUsize::new(0),
            max_streams: cfg.max_streams.max(1),
            context,
            stopping: AtomicBool::new(false),
            kv_pages,
            page_positions,
            keeps_pages,
            backend,
        }
    }
}
