//! Starting the runtime: the KV pool mapped (and the state directory's
//! kept pages taken back), the workers spawned and pinned, and every
//! journaled session handed to its worker to be restored.

use super::*;

/// Takes back the recovered sessions' pages that still verify in the kept
/// page file. A failure only costs speed: every session is then fed again
/// from its history alone. Returns how many hinted pages failed their
/// checksum.
fn take_back_pages(pool: &mut KvPool, recovered: &mut [crate::durable::Recovered]) -> usize {
    let started = Instant::now();
    match crate::durable::take_back(pool, recovered) {
        Ok(found) => {
            tracing::info!(
                pages = found.pages,
                positions = found.positions,
                rejected = found.rejected,
                took_ms = started.elapsed().as_secs_f64() * 1e3,
                "KV pages taken back from the state directory"
            );
            found.rejected
        }
        Err(e) => {
            tracing::error!("cannot take KV pages back, every session is computed again: {e}");
            for session in recovered.iter_mut() {
                session.pages.clear();
            }
            0
        }
    }
}

/// With a draft model to speculate with (and layers in this process to
/// verify its proposals), takes its KV out of the budget
/// ([`RuntimeConfig::draft_kv_bytes`]), split evenly over the workers.
/// Returns each worker's draft bytes.
fn split_for_draft(
    model: &Model,
    layers: &Arc<dyn Layers>,
    cfg: &mut RuntimeConfig,
) -> Option<u64> {
    if layers.backend() != "cpu" {
        return None;
    }
    let draft_share = cfg.draft_kv_bytes(model)?;
    cfg.kv_bytes -= draft_share;
    Some(draft_share / cfg.workers as u64)
}

/// Worker `index`'s connection to the replicas' store: the first brings
/// the schema up to date (and sweeps the store's idle orphans later), the
/// others find it so.
fn connect_seat(
    replica: &super::super::ReplicaConfig,
    index: usize,
) -> Result<ReplicaSeat, RuntimeError> {
    let connect = if index == 0 {
        crate::replica::Store::connect
    } else {
        crate::replica::Store::open
    };
    let store = connect(&replica.url, &replica.replica, replica.lease)
        .map_err(|e| RuntimeError::NotDurable(format!("worker {index}: {e}")))?
        .for_model(replica.model_sha256);
    Ok(ReplicaSeat::new(store, replica.lease, index == 0))
}

impl Runtime {
    /// Maps the KV pool and spawns `cfg.workers` worker threads, pinned one
    /// per core when asked (a failed pin is logged, not fatal).
    pub fn start(model: Arc<Model>, cfg: RuntimeConfig) -> Result<Runtime, RuntimeError> {
        let mut cfg = cfg;
        cfg.workers = cfg.workers.max(1);
        cfg.prefill_chunk = cfg.prefill_chunk.max(1);
        cfg.stream_capacity = cfg.stream_capacity.max(4);
        cfg.worker_queue = cfg.worker_queue.max(1);
        if cfg.state.is_some() && cfg.replica.is_some() {
            return Err(RuntimeError::invalid(
                "a state directory and a session store are alternatives: \
                 with a store, the store keeps the sessions",
            ));
        }
        let layers = Arc::clone(&cfg.layers);
        let draft_bytes = split_for_draft(&model, &layers, &mut cfg);
        let mut kv_pool = layers.kv_pool(&model, &mut cfg)?;
        // Sessions of the state directory come back before any worker
        // runs: the pages they take back from the kept page file are
        // claimed while nothing else can be handed out.
        let (recovered, refused, pages_rejected) = match &cfg.state {
            Some(store) => {
                let (mut recovered, refused) =
                    store.recover(model.config.vocab, model.config.context);
                let rejected = take_back_pages(&mut kv_pool, &mut recovered);
                (recovered, refused, rejected)
            }
            None => (Vec::new(), Vec::new(), 0),
        };
        let kv_pool = Arc::new(kv_pool);
        let kv_page_bytes = layers.kv_page_bytes(&model, &kv_pool);
        // Asked before any thread is pinned: a pinned thread sees only its core.
        let cores = if cfg.pin_cores {
            core_affinity::get_core_ids().unwrap_or_default()
        } else {
            Vec::new()
        };
        let (wakers, wake_receivers): (Vec<_>, Vec<_>) =
            (0..cfg.workers).map(|_| bounded::<()>(1)).unzip();
        let mut state = WorkersState::new(wakers, cfg.lend_cores);
        // A coordinator's pool only counts pages: the K and V are on the
        // shards, per session.
        state.prefix = kv_pool
            .holds_rows()
            .then(|| PrefixIndex::new(Arc::clone(&kv_pool), cfg.prefix_cache_pages));
        let shared = Arc::new(state);
        let mut workers = Vec::with_capacity(cfg.workers);
        for (index, wake) in wake_receivers.into_iter().enumerate() {
            let (tx, rx) = bounded(cfg.worker_queue);
            let gauges = Arc::new(WorkerGauges::default());
            let worker = Worker::new(
                index,
                Arc::clone(&model),
                layers.runner(index, &model, &cfg)?,
                Arc::clone(&kv_pool),
                cfg.clone(),
                Arc::clone(&shared),
                Arc::clone(&gauges),
            )?;
            let worker = match (&cfg.draft_model, draft_bytes) {
                (Some(draft), Some(bytes)) => worker.with_draft(DraftRunner::new(
                    Arc::clone(draft),
                    &model,
                    cfg.page_positions,
                    bytes,
                )?),
                _ => worker,
            };
            let worker = match &cfg.replica {
                Some(replica) => worker.with_replica(connect_seat(replica, index)?),
                None => worker,
            };
            let core = (!cores.is_empty()).then(|| cores[index % cores.len()]);
            let thread = std::thread::Builder::new()
                .name(format!("inferd-worker-{index}"))
                .spawn(move || {
                    if let Some(core) = core {
                        if !core_affinity::set_for_current(core) {
                            tracing::warn!(worker = index, core = core.id, "could not pin worker");
                        }
                    }
                    worker.run(rx, wake);
                })
                .map_err(|e| RuntimeError::Internal(format!("cannot spawn worker {index}: {e}")))?;
            workers.push(WorkerHandle {
                commands: tx,
                gauges,
                thread: Some(thread),
            });
        }
        if cfg.state.is_some() {
            shared
                .counters
                .restore_pages_rejected
                .fetch_add(pages_rejected as u64, Ordering::Relaxed);
            for r in &refused {
                tracing::error!(journal = %r.path.display(), reason = %r.reason, "session not restored");
            }
            shared
                .counters
                .restore_refused
                .fetch_add(refused.len() as u64, Ordering::Relaxed);
            tracing::info!(
                sessions = recovered.len(),
                refused = refused.len(),
                "restoring sessions from the state directory"
            );
            for session in recovered {
                let worker = session.id.worker_index(workers.len());
                // Blocking: the worker is running and drains its queue.
                if workers[worker]
                    .commands
                    .send(Command::Restore(Box::new(session)))
                    .is_err()
                {
                    return Err(RuntimeError::Internal(format!(
                        "worker {worker} stopped during the restore"
                    )));
                }
            }
        }
        let handoff = match &cfg.replica {
            Some(replica) => {
                let senders = workers.iter().map(|w| w.commands.clone()).collect();
                Some(handoff::HandoffEar::start(replica, senders)?)
            }
            None => None,
        };
        Ok(Runtime {
            handoff,
            kv_page_bytes,
            workers,
            kv_pool,
            shared,
            next_worker: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            cfg,
            vocab: model.config.vocab,
        })
    }
}
