//! The shard's side of the handshake: the terms it agrees to, kept by
//! coordinator epoch, and which of them a Session stream's first frame names.

use grpcio::{RpcContext, RpcStatus, RpcStatusCode, UnarySink};
use protobuf::Message;

use super::{lock, ShardState};
use crate::cluster::frame::{ErrorKind, FrameError};
use crate::cluster::handshake::{agree, limits_to_wire, Agreed, PROTOCOL_VERSION};
use crate::cluster::keeper::SessionKey;
use crate::proto::inferd_shard_v1::shard_runtime as pb;

/// Answers a `Handshake` whose body is read here, so that a body that does
/// not parse is the caller's error (INVALID_ARGUMENT), not grpcio's
/// INTERNAL.
pub(super) fn answer(
    shared: &ShardState,
    ctx: RpcContext<'_>,
    body: &[u8],
    sink: UnarySink<Vec<u8>>,
) {
    let fail = |ctx: RpcContext<'_>, sink: UnarySink<Vec<u8>>, code, message: String| {
        tracing::warn!(%message, "handshake refused");
        let status = RpcStatus::with_message(code, message);
        ctx.spawn(async move {
            let _ = sink.fail(status).await;
        });
    };
    let req = match pb::HandshakeRequest::parse_from_bytes(body) {
        Ok(req) => req,
        Err(e) => {
            return fail(
                ctx,
                sink,
                RpcStatusCode::INVALID_ARGUMENT,
                format!(
                    "the request ({} bytes) is not a HandshakeRequest: {e}",
                    body.len()
                ),
            )
        }
    };
    let result = agree(&req, &shared.fingerprint, &shared.limits, shared.epoch);
    match result {
        Ok(agreed) => {
            let mut response = pb::HandshakeResponse::new();
            response.set_protocol_version(PROTOCOL_VERSION);
            response.set_served(shared.fingerprint.to_wire());
            response.set_shard_epoch(shared.epoch);
            // Read without the core's lock, which a computation holds.
            response.set_kv_pages(shared.kv_pages);
            response.set_page_positions(shared.page_positions);
            response.set_keeps_pages(shared.keeps_pages);
            response.set_backend(shared.backend.into());
            let mut limits = limits_to_wire(
                agreed.max_frame_bytes,
                agreed.credit_window,
                agreed.max_sessions,
                &agreed.encodings,
            );
            limits.set_max_frame_rows(agreed.max_frame_rows);
            response.set_limits(limits);
            let bytes = match response.write_to_bytes() {
                Ok(bytes) => bytes,
                Err(e) => {
                    return fail(
                        ctx,
                        sink,
                        RpcStatusCode::INTERNAL,
                        format!("serializing the handshake response: {e}"),
                    )
                }
            };
            let coordinator = agreed.epochs.coordinator;
            {
                let mut all = lock(&shared.agreed);
                // A new coordinator epoch means its predecessors restarted.
                let stale: Vec<u64> = all.keys().copied().filter(|&e| e != coordinator).collect();
                for epoch in &stale {
                    all.remove(epoch);
                }
                all.insert(coordinator, agreed);
                if !stale.is_empty() {
                    let mut core = lock(&shared.core);
                    let core = &mut *core;
                    let gone: Vec<SessionKey> = core
                        .sessions
                        .keys()
                        .filter(|(epoch, _)| *epoch != coordinator)
                        .copied()
                        .collect();
                    for key in gone {
                        let Some(kv) = core.sessions.remove(&key) else {
                            continue;
                        };
                        // Kept for the new coordinator to resume, with a
                        // state dir; freed (dropped) otherwise.
                        if let Some(keeper) = core.keeper.as_mut() {
                            keeper.detach(key, kv);
                        }
                    }
                }
            }
            tracing::info!(
                coordinator = format_args!("{coordinator:#018x}"),
                "handshake agreed"
            );
            ctx.spawn(async move {
                let _ = sink.success(bytes).await;
            });
        }
        Err(e) => fail(ctx, sink, RpcStatusCode::FAILED_PRECONDITION, e.to_string()),
    }
}

/// The handshake a stream's first frame names. A frame too large or that
/// does not parse is refused as such (`TooLarge`, `Malformed`); one naming
/// no live handshake is stale, with the coordinator epoch it claimed.
pub(super) fn bind(shared: &ShardState, bytes: &[u8]) -> Result<Agreed, (FrameError, u64)> {
    let unbound = |kind, message: String| FrameError {
        kind,
        message,
        sessions: Vec::new(),
        sequence: None,
    };
    let max = shared.limits.get_max_frame_bytes() as usize;
    if bytes.len() > max {
        let message = format!("frame of {} bytes, limit {max}", bytes.len());
        return Err((unbound(ErrorKind::TooLarge, message), 0));
    }
    let frame = pb::Frame::parse_from_bytes(bytes).map_err(|e| {
        let message = format!("the stream's first frame is not a Frame: {e}");
        (unbound(ErrorKind::Malformed, message), 0)
    })?;
    if !frame.has_header() {
        let message = "the stream's first frame has no header".to_owned();
        return Err((unbound(ErrorKind::Malformed, message), 0));
    }
    let coordinator = frame.get_header().get_coordinator_epoch();
    lock(&shared.agreed)
        .get(&coordinator)
        .cloned()
        .ok_or_else(|| {
            let message = "no handshake with this coordinator epoch on this shard epoch".to_owned();
            (unbound(ErrorKind::StaleEpoch, message), coordinator)
        })
}
