//! The layers in this process: the model's forward pass over KV pages
//! mapped here. The default [`Layers`] of a runtime.

use std::sync::Arc;

use super::step::{Layers, StepError, StepFeed, StepRunner};
use super::{RuntimeConfig, RuntimeError};
use crate::kv::{KvBacking, KvPool, KvPoolConfig};
use crate::model::{LogitRows, Model, Scratch, Sequence};
use crate::threads::ThreadPool;

/// Every layer runs here, its K and V in one shared pool of pages.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalLayers;

impl Layers for LocalLayers {
    fn kv_pool(&self, model: &Model, cfg: &mut RuntimeConfig) -> Result<KvPool, RuntimeError> {
        let n_layers = model.config.n_layers;
        let layout = model.kv_layout(n_layers, cfg.page_positions);
        let pool = KvPool::new(KvPoolConfig {
            layout,
            n_pages: KvPool::pages_for_bytes(&layout, cfg.kv_bytes).max(n_layers),
            // With a state directory the pages outlive the process, so a
            // restart can take back what still verifies.
            backing: match &cfg.state {
                Some(store) => KvBacking::Kept(store.page_file()),
                None => KvBacking::Anonymous,
            },
            prefault: false,
        })?
        .with_layer_windows(model.kv_layer_windows(0..n_layers))?
        // A restart feeds a restored session's last page again: its window
        // layers must still hold what that page's positions read.
        .with_window_slack(if cfg.state.is_some() {
            cfg.page_positions
        } else {
            0
        });
        Ok(pool)
    }

    fn runner(
        &self,
        _worker: usize,
        model: &Arc<Model>,
        _cfg: &RuntimeConfig,
    ) -> Result<Box<dyn StepRunner>, RuntimeError> {
        Ok(Box::new(LocalRunner {
            model: Arc::clone(model),
        }))
    }

    fn describe(&self) -> String {
        "layers in this process".into()
    }
}

/// One worker's handle on the model.
struct LocalRunner {
    model: Arc<Model>,
}

impl StepRunner for LocalRunner {
    fn forward(
        &mut self,
        feeds: &mut [StepFeed<'_>],
        pool: &ThreadPool,
        scratch: &mut Scratch,
    ) -> Result<LogitRows, StepError> {
        let mut seqs: Vec<Sequence<'_>> = feeds
            .iter_mut()
            .map(|f| Sequence {
                kv: &mut *f.kv,
                tokens: f.tokens,
                logits: f.logits,
            })
            .collect();
        self.model
            .forward(&mut seqs, pool, scratch)
            .map_err(|e| StepError::SessionsLost(e.into()))
    }

    fn verifies_proposals(&self) -> bool {
        true
    }
}
