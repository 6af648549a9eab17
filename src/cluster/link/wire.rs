//! Frames on a link's stream: sealing and sending them (bounded in time),
//! reading and checking what the shard sends, and turning its error frames
//! into typed refusals.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant, SystemTime};

use futures_executor::block_on;
use futures_util::{SinkExt, StreamExt};
use grpcio::WriteFlags;

use super::{LinkError, ShardLink, ANSWER_GRACE};
use crate::cluster::frame::{ErrorKind, FrameCheck, FrameError, FrameKind, WireSessionId};
use crate::cluster::payload::Encoding;
use crate::proto::inferd_shard_v1::shard_runtime as pb;

/// How long a frame may wait to be written (the shard reads nothing, so
/// flow control holds it) before the link is given up.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a failed send waits for the error frame that says why the
/// shard ended the call (it was sent before the end, so it is already
/// there or never comes).
const END_REASON_WAIT: Duration = Duration::from_secs(1);

/// Wakes a parked thread.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `future` on this thread until it is ready (`Some`) or `deadline`
/// passes (`None`); without a deadline it waits as long as it takes.
fn block_on_until<F: Future>(future: F, deadline: Option<Instant>) -> Option<F::Output> {
    let Some(deadline) = deadline else {
        return Some(block_on(future));
    };
    let mut future = std::pin::pin!(future);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(value) = future.as_mut().poll(&mut cx) {
            return Some(value);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        // A spurious unpark only polls again.
        std::thread::park_timeout(deadline - now);
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl ShardLink {
    pub(super) fn transport(&self, message: String) -> LinkError {
        LinkError::Transport {
            addr: self.addr.clone(),
            message,
        }
    }

    /// Sends one already-serialized frame as it is (tests use it to send
    /// frames the protocol must refuse).
    pub fn send_raw(&mut self, bytes: Vec<u8>) -> Result<(), LinkError> {
        if let Some((sent, _)) = &mut self.hashes {
            sent.push(sha256_hex(&bytes));
        }
        let sent = block_on_until(
            self.sender.send((bytes, WriteFlags::default())),
            Some(Instant::now() + SEND_TIMEOUT),
        );
        match sent {
            Some(result) => result.map_err(|e| self.transport(e.to_string())),
            None => Err(self.transport(format!(
                "the shard took no frame for {} s",
                SEND_TIMEOUT.as_secs()
            ))),
        }
    }

    /// Seals and sends a frame.
    pub(super) fn send(
        &mut self,
        frame: pb::Frame,
        encoding: Option<Encoding>,
        deadline: u64,
    ) -> Result<u64, LinkError> {
        let sequence = self.outbound.next_sequence();
        let bytes = self
            .outbound
            .seal(frame, encoding, deadline)
            .map_err(|e| self.transport(format!("serializing a frame: {e}")))?;
        if let Err(closed) = self.send_raw(bytes) {
            // A shard that ends the call first sends an error frame saying
            // why (a newer coordinator took over): report that reason, not
            // the closed stream it left behind.
            return Err(self.reason_for_end().unwrap_or(closed));
        }
        Ok(sequence)
    }

    /// The shard's error frame among what it sent before ending the call,
    /// if it sent one.
    fn reason_for_end(&mut self) -> Option<LinkError> {
        let give_up = Instant::now() + END_REASON_WAIT;
        loop {
            let checked = self.next_frame_until(Some(give_up)).ok()?;
            if checked.kind == FrameKind::Error {
                return Some(self.refused(checked.frame.get_error()));
            }
        }
    }

    /// Reads the next frame and checks it; credits are counted here.
    pub fn next_frame(&mut self) -> Result<FrameCheck, LinkError> {
        self.next_frame_until(None)
    }

    /// As [`ShardLink::next_frame`], giving up at `deadline` (a transport
    /// failure: the stream can no longer be trusted to be in step).
    pub(super) fn next_frame_until(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<FrameCheck, LinkError> {
        let bytes = match block_on_until(self.receiver.next(), deadline) {
            Some(Some(Ok(bytes))) => bytes,
            Some(Some(Err(e))) => return Err(self.transport(e.to_string())),
            Some(None) => return Err(self.transport("the shard closed the stream".into())),
            None => {
                return Err(self.transport(format!(
                    "no answer within {} s past the frame's deadline",
                    ANSWER_GRACE.as_secs()
                )))
            }
        };
        if let Some((_, received)) = &mut self.hashes {
            received.push(sha256_hex(&bytes));
        }
        let checked = self
            .inbound
            .check(&bytes, SystemTime::now())
            .map_err(|error| LinkError::BadReply {
                addr: self.addr.clone(),
                error,
            })?;
        if checked.kind == FrameKind::Credit {
            self.credits += u64::from(checked.frame.get_credit().get_frames());
        }
        Ok(checked)
    }

    /// Whether an error frame is about a frame sent before `current`: that
    /// frame's call already ended (or it had no answer to wait
    /// for, like a release), so it is logged rather than failing this one.
    pub(super) fn answers_earlier(&self, checked: &FrameCheck, current: u64) -> bool {
        let refused = checked.frame.get_error().get_refused_sequence();
        let earlier = refused != 0 && refused < current;
        if earlier {
            tracing::warn!(
                shard = %self.addr,
                error = %self.refused(checked.frame.get_error()),
                "a shard refused an earlier frame"
            );
        }
        earlier
    }

    pub(super) fn refused(&self, error: &pb::ShardError) -> LinkError {
        LinkError::Refused {
            addr: self.addr.clone(),
            error: FrameError {
                kind: ErrorKind::from_wire(error.get_kind()).unwrap_or(ErrorKind::Internal),
                message: error.get_message().to_owned(),
                sessions: error
                    .get_session_ids()
                    .iter()
                    .filter_map(|id| WireSessionId::try_from(id.as_slice()).ok())
                    .collect(),
                sequence: Some(error.get_refused_sequence()),
            },
        }
    }

    /// Seals a frame with this link's numbering without sending it (tests
    /// corrupt it, then `send_raw` it).
    pub fn seal(
        &mut self,
        frame: pb::Frame,
        encoding: Option<Encoding>,
        deadline: u64,
    ) -> Result<Vec<u8>, LinkError> {
        self.outbound
            .seal(frame, encoding, deadline)
            .map_err(|e| self.transport(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiting_for_an_answer_ends_at_the_deadline() {
        let t0 = Instant::now();
        let never = futures_util::future::pending::<()>();
        assert_eq!(
            block_on_until(never, Some(t0 + Duration::from_millis(50))),
            None
        );
        assert!(t0.elapsed() >= Duration::from_millis(50));
        let ready = futures_util::future::ready(7);
        assert_eq!(block_on_until(ready, Some(t0)), Some(7));
        assert_eq!(
            block_on_until(futures_util::future::ready(8), None),
            Some(8)
        );
    }

    #[test]
    fn a_wake_from_another_thread_ends_the_wait_early() {
        let (tx, rx) = futures_channel::oneshot::channel::<u8>();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            let _ = tx.send(3);
        });
        let t0 = Instant::now();
        let got = block_on_until(rx, Some(t0 + Duration::from_secs(10)));
        assert_eq!(got, Some(Ok(3)));
        assert!(t0.elapsed() < Duration::from_secs(5));
        sender.join().expect("sender");
    }
}
