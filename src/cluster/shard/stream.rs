//! A Session stream on the shard: admitted within the stream limit, then
//! a reader thread that checks frames as they arrive and a compute thread
//! that answers them in order, and the replies it sends back.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::SystemTime;

use futures_executor::block_on;
use futures_util::{Sink, SinkExt, StreamExt};
use grpcio::{DuplexSink, RequestStream, RpcContext, RpcStatus, RpcStatusCode, WriteFlags};

use super::answer::{answer, Answered};
use super::handshake::bind;
use super::{lock, ShardState};
use crate::cluster::frame::{Epochs, ErrorKind, FrameCheck, FrameError, Inbound, OutboundFrames};
use crate::cluster::handshake::Agreed;
use crate::cluster::payload::Encoding;
use crate::proto::inferd_shard_v1::shard_runtime as pb;

/// Frames (beyond the credit window) a stream's reader may queue ahead of
/// its compute: refusals and control frames. A full queue stops the reader,
/// and HTTP/2 flow control then stops the peer.
const QUEUE_SLACK: usize = 64;

/// One open session stream, counted in `ShardState::streams` while it lives.
struct StreamSlot(Arc<ShardState>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0
            .streams
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A Session stream arrived: refused when the shard already serves its
/// most streams, otherwise served on a thread of its own (compute blocks;
/// the completion queue must not).
pub(super) fn open_stream(
    shared: &Arc<ShardState>,
    ctx: &RpcContext<'_>,
    stream: RequestStream<Vec<u8>>,
    sink: DuplexSink<Vec<u8>>,
) {
    use std::sync::atomic::Ordering::AcqRel;
    let open = shared.streams.fetch_add(1, AcqRel);
    if open >= shared.max_streams {
        shared.streams.fetch_sub(1, AcqRel);
        let message = format!(
            "the shard serves at most {} streams at once",
            shared.max_streams
        );
        return refuse_stream(ctx, stream, sink, message);
    }
    // The sink is handed over only once the thread exists.
    let (hand, take) = sync_channel(1);
    let thread_shared = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("inferd-shard-stream".into())
        .spawn(move || {
            // Frees the slot however the thread ends.
            let _slot = StreamSlot(Arc::clone(&thread_shared));
            if let Ok((stream, sink)) = take.recv() {
                serve_stream(thread_shared, stream, sink);
            }
        });
    match spawned {
        Ok(_) => {
            let _ = hand.send((stream, sink));
        }
        Err(e) => {
            shared.streams.fetch_sub(1, AcqRel);
            let message = format!("cannot start a stream thread: {e}");
            refuse_stream(ctx, stream, sink, message);
        }
    }
}

/// Ends a Session stream with RESOURCE_EXHAUSTED and why. The request
/// stream lives until the status is sent: dropping it first would cancel
/// the call, and the coordinator would read CANCELLED instead of why.
fn refuse_stream(
    ctx: &RpcContext<'_>,
    stream: RequestStream<Vec<u8>>,
    sink: DuplexSink<Vec<u8>>,
    message: String,
) {
    tracing::warn!(%message, "session stream refused");
    let status = RpcStatus::with_message(RpcStatusCode::RESOURCE_EXHAUSTED, message);
    ctx.spawn(async move {
        let _ = sink.fail(status).await;
        drop(stream);
    });
}

pub(super) fn error_frame(error: &FrameError) -> pb::Frame {
    let mut frame = pb::Frame::new();
    frame.set_error(error.to_wire());
    frame
}

fn credit_frame(frames: u32) -> pb::Frame {
    let mut credit = pb::Credit::new();
    credit.set_frames(frames);
    let mut frame = pb::Frame::new();
    frame.set_credit(credit);
    frame
}

/// Sends frames to the coordinator; false once the stream is gone.
pub(super) struct Replies {
    sink: DuplexSink<Vec<u8>>,
    outbound: OutboundFrames,
    /// A send failed: the call is over, and grpcio's sink must not be
    /// polled again (it panics on a finished call).
    gone: bool,
}

impl Replies {
    fn new(sink: DuplexSink<Vec<u8>>, epochs: Epochs) -> Replies {
        Replies {
            sink,
            outbound: OutboundFrames::new(epochs),
            gone: false,
        }
    }

    pub(super) fn send(&mut self, frame: pb::Frame, encoding: Option<Encoding>) -> bool {
        if self.gone {
            return false;
        }
        let Ok(bytes) = self.outbound.seal(frame, encoding, 0) else {
            return false;
        };
        let sent = block_on(self.sink.send((bytes, WriteFlags::default()))).is_ok();
        self.gone = !sent;
        sent
    }

    /// Whether the call is over on the coordinator's side (cancelled,
    /// broken, past its deadline); never waits.
    pub(super) fn call_gone(&mut self) -> bool {
        if !self.gone {
            let mut cx = Context::from_waker(Waker::noop());
            // `poll_ready` looks at the call's completion first and reports
            // a finished call as an error; after that the sink is left alone.
            if let Poll::Ready(Err(_)) = Pin::new(&mut self.sink).poll_ready(&mut cx) {
                self.gone = true;
            }
        }
        self.gone
    }

    /// Ends the call cleanly after the frames sent so far (dropping the
    /// sink instead would cancel the call and could lose them).
    fn end(mut self) {
        if self.gone {
            return;
        }
        let _ = block_on(self.sink.close());
    }
}

/// What a stream's reader hands its compute thread, in arrival order.
enum Inbox {
    /// The stream's first valid frame named this handshake.
    Bound(Agreed),
    /// A frame that passed every check.
    Frame(Box<FrameCheck>),
    /// A frame the checks refused; `claimed` is the coordinator epoch to
    /// name in the answer while the stream is bound to no handshake.
    Refused { error: FrameError, claimed: u64 },
    /// No more frames. `lost`: the call was cancelled or broke (nothing can
    /// be answered); otherwise the coordinator half-closed, or `retired`
    /// says why the shard ends the stream, and the frames before are
    /// answered first. The request stream rides along so that it lives
    /// until the call's status is sent.
    End {
        stream: RequestStream<Vec<u8>>,
        lost: bool,
        retired: Option<FrameError>,
    },
}

/// What both threads of a stream share.
#[derive(Default)]
pub(super) struct StreamState {
    /// The call was cancelled or broke: computing for it stops.
    pub(super) lost: AtomicBool,
    /// Credits the compute thread granted that the reader has not yet
    /// added to its checks.
    granted: AtomicU32,
}

/// The reader: takes frames off the wire as they arrive and checks them,
/// until the call ends or the compute thread is gone.
fn read_frames(
    shared: &ShardState,
    state: &StreamState,
    mut stream: RequestStream<Vec<u8>>,
    inbox: &SyncSender<Inbox>,
) {
    let mut bound: Option<(Inbound, u64)> = None;
    loop {
        let bytes = match block_on(stream.next()) {
            Some(Ok(bytes)) => bytes,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "session stream lost");
                state.lost.store(true, Ordering::Release);
                let end = Inbox::End {
                    stream,
                    lost: true,
                    retired: None,
                };
                let _ = inbox.send(end);
                return;
            }
            None => {
                let end = Inbox::End {
                    stream,
                    lost: false,
                    retired: None,
                };
                let _ = inbox.send(end);
                return;
            }
        };
        if bound.is_none() {
            match bind(shared, &bytes) {
                Ok(agreed) => {
                    let checker = Inbound::to_shard(
                        agreed.epochs,
                        agreed.max_frame_bytes as usize,
                        agreed.fingerprint.hidden_size as usize,
                        agreed.encodings.clone(),
                        agreed.credit_window,
                    )
                    .with_row_bounds(agreed.max_frame_rows as usize, shared.context);
                    bound = Some((checker, agreed.epochs.coordinator));
                    if inbox.send(Inbox::Bound(agreed)).is_err() {
                        return;
                    }
                }
                Err((error, claimed)) => {
                    if inbox.send(Inbox::Refused { error, claimed }).is_err() {
                        return;
                    }
                    continue;
                }
            }
        }
        let Some((checker, coordinator)) = bound.as_mut() else {
            continue;
        };
        // A handshake by a newer coordinator retires this stream's epoch.
        if !lock(&shared.agreed).contains_key(coordinator) {
            let error = FrameError {
                kind: ErrorKind::StaleEpoch,
                message: "a newer coordinator has taken over this shard".into(),
                sessions: Vec::new(),
                sequence: None,
            };
            let end = Inbox::End {
                stream,
                lost: false,
                retired: Some(error),
            };
            let _ = inbox.send(end);
            return;
        }
        checker.grant(state.granted.swap(0, Ordering::AcqRel));
        let item = match checker.check(&bytes, SystemTime::now()) {
            Ok(checked) => Inbox::Frame(Box::new(checked)),
            Err(error) => {
                tracing::debug!(%error, "frame refused");
                Inbox::Refused {
                    error,
                    claimed: *coordinator,
                }
            }
        };
        if inbox.send(item).is_err() {
            return;
        }
    }
}

/// Serves one Session stream until the coordinator closes it, the call
/// breaks, or the shard stops: a reader thread checks frames as they
/// arrive, this thread answers them in order.
fn serve_stream(
    shared: Arc<ShardState>,
    stream: RequestStream<Vec<u8>>,
    sink: DuplexSink<Vec<u8>>,
) {
    let state = Arc::new(StreamState::default());
    let capacity = shared.limits.get_credit_window() as usize + QUEUE_SLACK;
    let (inbox, items) = sync_channel(capacity);
    let (reader_shared, reader_state) = (Arc::clone(&shared), Arc::clone(&state));
    let spawned = std::thread::Builder::new()
        .name("inferd-shard-read".into())
        .spawn(move || read_frames(&reader_shared, &reader_state, stream, &inbox));
    if let Err(e) = spawned {
        // The stream went with the closure; the call is cancelled.
        tracing::warn!(error = %e, "cannot start a stream reader");
        return;
    }
    let mut replies = Replies::new(
        sink,
        Epochs {
            shard: shared.epoch,
            coordinator: 0,
        },
    );
    let mut agreed: Option<Agreed> = None;
    while let Ok(item) = items.recv() {
        match item {
            Inbox::Bound(a) => {
                replies.outbound.set_epochs(a.epochs);
                agreed = Some(a);
            }
            Inbox::Refused { error, claimed } => {
                if agreed.is_none() {
                    replies.outbound.set_epochs(Epochs {
                        shard: shared.epoch,
                        coordinator: claimed,
                    });
                }
                if !replies.send(error_frame(&error), None) {
                    return;
                }
            }
            Inbox::Frame(checked) => {
                let Some(agreed) = agreed.as_ref() else {
                    continue;
                };
                let hidden = checked.kind.carries_hidden();
                let answered = answer(&shared, agreed, *checked, &mut replies, &state);
                if answered == Answered::Gone {
                    return;
                }
                if hidden {
                    // The frame's credit is back for the reader's checks; the
                    // coordinator's link takes a refusal as its credit, so a
                    // credit frame goes only with an answer it computed.
                    state.granted.fetch_add(1, Ordering::AcqRel);
                    if answered == Answered::Computed && !replies.send(credit_frame(1), None) {
                        return;
                    }
                }
            }
            Inbox::End {
                stream,
                lost,
                retired,
            } => {
                if lost {
                    return;
                }
                // The error frame says why; the call then ends cleanly (a
                // failing status could overtake the frame at the client).
                if let Some(error) = retired {
                    let _ = replies.send(error_frame(&error), None);
                }
                replies.end();
                drop(stream);
                return;
            }
        }
    }
}
