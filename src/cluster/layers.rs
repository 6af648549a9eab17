//! The runtime's [`Layers`] when the model is split over shards: each
//! worker drives its own [`ShardChain`]; the KV lives on the shards, and
//! the runtime's pool is a [`KvPool::ledger`]: it counts pages of
//! positions (sized like the smallest shard's, so eviction makes room
//! here before any shard runs out) and maps nothing.

use std::sync::Arc;
use std::time::Duration;

use super::coordinator::{ChainError, FailureKind, ShardChain, ShardPlan};
use super::ErrorKind;
use crate::kv::{KvPool, SessionKv};
use crate::model::{LogitRows, Model, Scratch};
use crate::runtime::{
    Layers, RuntimeConfig, RuntimeError, SessionId, ShardStatsSnapshot, StatusKind, StepError,
    StepFeed, StepRunner,
};
use crate::threads::ThreadPool;

/// How long a coordinator waits at start-up for a shard it cannot reach
/// yet (hosts start in any order; a unit's start timeout is 120 s).
const SHARD_START_WAIT: Duration = Duration::from_secs(60);

/// The layers run by the shards of a plan.
pub struct ShardLayers {
    plan: Arc<ShardPlan>,
}

impl ShardLayers {
    pub fn new(plan: Arc<ShardPlan>) -> ShardLayers {
        ShardLayers { plan }
    }

    pub fn plan(&self) -> &Arc<ShardPlan> {
        &self.plan
    }
}

impl Layers for ShardLayers {
    fn kv_pool(&self, model: &Model, cfg: &mut RuntimeConfig) -> Result<KvPool, RuntimeError> {
        let capacity = self
            .plan
            .probe(SHARD_START_WAIT)
            .map_err(|e| RuntimeError::Internal(e.to_string()))?;
        cfg.page_positions = capacity.page_positions as usize;
        if capacity.max_sessions > 0 {
            cfg.max_sessions = cfg.max_sessions.min(capacity.max_sessions as usize);
        }
        // A ledger pages like a local pool (a page per layer, so page
        // counts read the same either way) and holds nothing.
        let n_layers = model.config.n_layers;
        let pages = (capacity.kv_pages.max(1) as usize).saturating_mul(n_layers);
        Ok(KvPool::ledger(n_layers, cfg.page_positions, pages)?)
    }

    fn kv_page_bytes(&self, model: &Model, pool: &KvPool) -> u64 {
        let layout = pool.layout();
        model.kv_bytes_per_position() as u64 * layout.page_positions as u64
            / layout.n_layers.max(1) as u64
    }

    fn runner(
        &self,
        _worker: usize,
        model: &Arc<Model>,
        cfg: &RuntimeConfig,
    ) -> Result<Box<dyn StepRunner>, RuntimeError> {
        Ok(Box::new(ShardRunner {
            chain: ShardChain::new(Arc::clone(&self.plan)),
            model: Arc::clone(model),
            kv_bytes_per_position: model.kv_bytes_per_position() as u64,
            rebuild_chunk: cfg.prefill_chunk,
        }))
    }

    fn shard_stats(&self) -> Option<ShardStatsSnapshot> {
        Some(self.plan.stats().snapshot())
    }

    fn backend(&self) -> &'static str {
        "shards"
    }

    fn describe(&self) -> String {
        let shards: Vec<String> = self.plan.shards().iter().map(|s| s.label()).collect();
        format!(
            "layers on {} shards ({:?} hidden states): {}",
            shards.len(),
            self.plan.encoding(),
            shards.join(", ")
        )
    }
}

/// One worker's chain of links.
struct ShardRunner {
    chain: ShardChain,
    model: Arc<Model>,
    kv_bytes_per_position: u64,
    /// Most history tokens one rebuild frame carries.
    rebuild_chunk: usize,
}

impl StepRunner for ShardRunner {
    fn forward(
        &mut self,
        feeds: &mut [StepFeed<'_>],
        pool: &ThreadPool,
        scratch: &mut Scratch,
    ) -> Result<LogitRows, StepError> {
        // A failed step leaves the sessions marked for a rebuild on the
        // shards and their ledgers unmoved: their calls fail, they stay.
        self.chain
            .forward(&self.model, feeds, pool, scratch, self.rebuild_chunk)
            .map_err(|e| StepError::NothingCommitted(chain_error(e)))
    }

    fn release(&mut self, session: SessionId) {
        self.chain.release(&[session.bytes()]);
    }

    fn cancel(&mut self, session: SessionId) {
        self.chain.cancel(&[session.bytes()]);
    }

    fn resume(&mut self, session: SessionId, history: &[u32]) -> usize {
        self.chain.resume(session.bytes(), history)
    }

    /// Every layer of every committed position, over the shards together.
    fn kv_live_bytes(&self, kv: &SessionKv) -> u64 {
        kv.len() as u64 * self.kv_bytes_per_position
    }
}

/// The client's status for a step the shards failed: retryable
/// (UNAVAILABLE) unless the protocol names something worse.
fn chain_error(err: ChainError) -> RuntimeError {
    let failure = match err {
        ChainError::Shard(failure) => failure,
        ChainError::Kv(e) => return e.into(),
        ChainError::Model(e) => return RuntimeError::Internal(e.to_string()),
    };
    let status = match failure.kind {
        FailureKind::Protocol(ErrorKind::Checksum) => StatusKind::DataLoss,
        FailureKind::Protocol(ErrorKind::Sequence) => StatusKind::Aborted,
        FailureKind::Protocol(ErrorKind::Deadline) => StatusKind::DeadlineExceeded,
        FailureKind::Protocol(ErrorKind::TooLarge | ErrorKind::FlowControl) => {
            StatusKind::ResourceExhausted
        }
        FailureKind::Protocol(ErrorKind::Malformed) => StatusKind::Internal,
        FailureKind::Transport
        | FailureKind::Handshake
        | FailureKind::Protocol(
            ErrorKind::StaleEpoch | ErrorKind::UnknownSession | ErrorKind::Internal,
        ) => StatusKind::Unavailable,
    };
    RuntimeError::Shard {
        status,
        message: format!("{} failure at {failure}", failure.kind.name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::coordinator::ShardFailure;
    use crate::kv::KvError;

    #[test]
    fn a_failed_shard_step_reaches_the_client_as_its_kind_says() {
        let status = |kind: FailureKind| {
            let err = chain_error(ChainError::Shard(ShardFailure {
                shard: "10.0.0.2:7000 (layers 0..15)".into(),
                kind,
                message: "why".into(),
            }));
            assert!(err.to_string().contains("10.0.0.2:7000"), "{err}");
            err.code()
        };
        use StatusKind as S;
        for (kind, want) in [
            (FailureKind::Transport, S::Unavailable),
            (FailureKind::Handshake, S::Unavailable),
            (FailureKind::Protocol(ErrorKind::Checksum), S::DataLoss),
            (FailureKind::Protocol(ErrorKind::StaleEpoch), S::Unavailable),
            (FailureKind::Protocol(ErrorKind::Sequence), S::Aborted),
            (
                FailureKind::Protocol(ErrorKind::TooLarge),
                S::ResourceExhausted,
            ),
            (
                FailureKind::Protocol(ErrorKind::FlowControl),
                S::ResourceExhausted,
            ),
            (FailureKind::Protocol(ErrorKind::Malformed), S::Internal),
            (
                FailureKind::Protocol(ErrorKind::UnknownSession),
                S::Unavailable,
            ),
            (
                FailureKind::Protocol(ErrorKind::Deadline),
                S::DeadlineExceeded,
            ),
            (FailureKind::Protocol(ErrorKind::Internal), S::Unavailable),
        ] {
            assert_eq!(status(kind), want, "{kind:?}");
        }
        let kv = chain_error(ChainError::Kv(KvError::Exhausted { wanted: 3, free: 1 }));
        assert_eq!(kv.code(), S::ResourceExhausted);
    }
}
