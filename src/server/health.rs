//! The standard `grpc.health.v1.Health` service. The server starts
//! NOT_SERVING, turns SERVING once the model answered a one-token forward,
//! and NOT_SERVING again when it starts draining, and while its state
//! directory fails writes. `Watch` streams every change.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};

use futures_channel::mpsc;
use futures_util::{SinkExt, StreamExt};
use grpcio::{RpcContext, RpcStatus, RpcStatusCode, ServerStreamingSink, UnarySink, WriteFlags};

use crate::proto::grpc_health_v1::health::{
    HealthCheckRequest, HealthCheckResponse, HealthCheckResponse_ServingStatus as Status,
};
use crate::proto::grpc_health_v1::health_grpc::Health;

/// The service names this server answers for ("" is the server as a whole).
pub const SERVICES: [&str; 3] = [
    "",
    "kakeya.v1.RuntimeService",
    "inferd.session.v1.SessionService",
];

/// The serving status, shared by the server and every health call: what
/// the server set (starting, serving, draining), read as NOT_SERVING while
/// the state directory fails writes (durable work is refused then).
#[derive(Default)]
pub struct HealthState {
    status: AtomicI32,
    state_dir_failing: AtomicBool,
    watchers: Mutex<Vec<mpsc::Sender<Status>>>,
}

impl HealthState {
    pub fn new() -> Arc<Self> {
        let state = Self::default();
        state
            .status
            .store(Status::NOT_SERVING as i32, Ordering::Release);
        Arc::new(state)
    }

    pub fn status(&self) -> Status {
        match self.status.load(Ordering::Acquire) {
            1 if self.state_dir_failing.load(Ordering::Acquire) => Status::NOT_SERVING,
            1 => Status::SERVING,
            2 => Status::NOT_SERVING,
            _ => Status::UNKNOWN,
        }
    }

    /// Sets the status and tells every watcher (a watcher too slow to take
    /// it still sees the latest status on its next read).
    pub fn set(&self, status: Status) {
        self.status.store(status as i32, Ordering::Release);
        self.tell();
    }

    /// The state directory stopped (`false`) or resumed taking writes.
    pub fn set_state_dir_writable(&self, writable: bool) {
        self.state_dir_failing.store(!writable, Ordering::Release);
        self.tell();
    }

    fn tell(&self) {
        let status = self.status();
        let mut watchers = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        watchers.retain_mut(|w| match w.try_send(status) {
            Ok(()) => true,
            Err(e) => e.is_full(),
        });
    }

    fn watch(&self) -> mpsc::Receiver<Status> {
        let (tx, rx) = mpsc::channel(4);
        self.watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(tx);
        rx
    }
}

#[derive(Clone)]
pub struct HealthService {
    pub state: Arc<HealthState>,
}

fn response(status: Status) -> HealthCheckResponse {
    let mut msg = HealthCheckResponse::new();
    msg.set_status(status);
    msg
}

impl Health for HealthService {
    fn check(
        &mut self,
        ctx: RpcContext,
        req: HealthCheckRequest,
        sink: UnarySink<HealthCheckResponse>,
    ) {
        let reply = if SERVICES.contains(&req.get_service()) {
            sink.success(response(self.state.status()))
        } else {
            sink.fail(RpcStatus::with_message(
                RpcStatusCode::NOT_FOUND,
                format!("unknown service {:?}", req.get_service()),
            ))
        };
        ctx.spawn(async move {
            let _ = reply.await;
        });
    }

    fn watch(
        &mut self,
        ctx: RpcContext,
        req: HealthCheckRequest,
        mut sink: ServerStreamingSink<HealthCheckResponse>,
    ) {
        let known = SERVICES.contains(&req.get_service());
        let state = Arc::clone(&self.state);
        let mut changes = state.watch();
        ctx.spawn(async move {
            let first = if known {
                state.status()
            } else {
                Status::SERVICE_UNKNOWN
            };
            if sink
                .send((response(first), WriteFlags::default()))
                .await
                .is_err()
            {
                return;
            }
            let mut last = first;
            while let Some(status) = changes.next().await {
                if !known || status == last {
                    continue;
                }
                last = status;
                if sink
                    .send((response(status), WriteFlags::default()))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            let _ = sink.close().await;
        });
    }
}
