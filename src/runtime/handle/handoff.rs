//! The replica's ear for hand-off requests (`--session-store`): a thread
//! with a store connection of its own that LISTENs for other replicas
//! asking this one to let a session go (a call for it reached them), and
//! passes each to the worker that holds the session. The worker lets it go
//! when nothing runs or waits on it; else the asker asks again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;

use super::super::worker::Command;
use super::super::{ReplicaConfig, RuntimeError, SessionId};
use crate::replica::Store;

/// How long one wait for requests lasts: how soon the thread sees a stop.
const LISTEN_WAIT: Duration = Duration::from_millis(250);
/// The pause after the store failed, before connecting again.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The listening thread; stopped (and joined) on drop.
pub(super) struct HandoffEar {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HandoffEar {
    /// Connects and starts listening, passing requests to `workers`.
    pub(super) fn start(
        replica: &ReplicaConfig,
        workers: Vec<Sender<Command>>,
    ) -> Result<HandoffEar, RuntimeError> {
        // The workers' first connection brought the schema up to date.
        let mut store = Store::open(&replica.url, &replica.replica, replica.lease)
            .map_err(|e| RuntimeError::NotDurable(format!("hand-off listener: {e}")))?;
        // Listening from now on, before any worker takes calls.
        store
            .handoff_requests(Duration::ZERO)
            .map_err(|e| RuntimeError::NotDurable(format!("hand-off listener: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("inferd-handoff".into())
            .spawn(move || listen(store, &workers, &stopping))
            .map_err(|e| {
                RuntimeError::Internal(format!("cannot spawn the hand-off listener: {e}"))
            })?;
        Ok(HandoffEar {
            stop,
            thread: Some(thread),
        })
    }
}

fn listen(mut store: Store, workers: &[Sender<Command>], stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        match store.handoff_requests(LISTEN_WAIT) {
            Ok(ids) => {
                for id in ids.iter().filter_map(|id| SessionId::parse(id).ok()) {
                    let worker = &workers[id.worker_index(workers.len())];
                    // A full queue: the asker asks again.
                    let _ = worker.try_send(Command::HandOff(id));
                }
            }
            Err(e) => {
                tracing::warn!("listening for hand-off requests: {e}");
                std::thread::sleep(RETRY_AFTER);
            }
        }
    }
}

impl Drop for HandoffEar {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
