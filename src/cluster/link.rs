//! The coordinator's end of one shard: handshake, then a Session stream on
//! which it sends hidden states through the shard's layers and reads back
//! the result. Every frame the shard sends passes the same fail-closed
//! checks the shard applies ([`super::frame::Inbound`]); a refused frame or
//! a `ShardError` from the shard fails the call with a typed error naming
//! the sessions concerned.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant, SystemTime};

use futures_executor::block_on;
use futures_util::{SinkExt, StreamExt};
use grpcio::{CallOption, ClientDuplexReceiver, ClientDuplexSender, Environment, WriteFlags};

use super::fingerprint::Fingerprint;
use super::frame::{
    Epochs, ErrorKind, FrameError, FrameKind, Inbound, OutboundFrames, Run, WireSessionId,
};
use super::handshake::{limits_to_wire, PROTOCOL_VERSION};
use super::payload::{decode_rows, encode_rows, Encoding};
use super::raw::SESSION_RAW;
use crate::proto::inferd_shard_v1::shard_runtime as pb;
use crate::proto::inferd_shard_v1::shard_runtime_grpc::ShardRuntimeClient;

/// Why a call through a shard failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("shard {addr}: handshake failed: {message}")]
    Handshake { addr: String, message: String },
    #[error("shard {addr}: transport failed: {message}")]
    Transport { addr: String, message: String },
    /// The shard refused a frame or failed sessions (its `ShardError`).
    #[error("shard {addr}: {error}")]
    Refused { addr: String, error: FrameError },
    /// A frame from the shard failed our checks.
    #[error("shard {addr} sent a frame we refuse: {error}")]
    BadReply { addr: String, error: FrameError },
}

impl LinkError {
    /// The failure kind, when the protocol named one.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            LinkError::Refused { error, .. } | LinkError::BadReply { error, .. } => {
                Some(error.kind)
            }
            _ => None,
        }
    }
}

/// Terms the coordinator asks for.
#[derive(Clone, Debug)]
pub struct LinkOptions {
    pub encoding: Encoding,
    pub max_frame_bytes: u32,
    pub credit_window: u32,
    /// Keep the SHA-256 of every frame sent and received (to compare with
    /// what a relay saw).
    pub record_hashes: bool,
    /// How long the handshake may take (connecting included).
    pub handshake_timeout: std::time::Duration,
}

/// What a shard can hold, from its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardCapacity {
    /// KV pages for all sessions together, in pages of positions over all
    /// the shard's layers.
    pub kv_pages: u64,
    /// Positions per page.
    pub page_positions: u32,
    /// Sessions at once (the agreed limit).
    pub max_sessions: u32,
    /// Rows one hidden-state frame may carry (the agreed limit; 0: none).
    pub max_frame_rows: u32,
    /// The shard keeps pages by their chains and answers Resume frames.
    pub keeps_pages: bool,
}

impl Default for LinkOptions {
    fn default() -> Self {
        LinkOptions {
            encoding: Encoding::F32,
            max_frame_bytes: 64 << 20,
            credit_window: 16,
            record_hashes: false,
            handshake_timeout: std::time::Duration::from_secs(30),
        }
    }
}

/// One connected shard; see the module docs.
pub struct ShardLink {
    addr: String,
    epochs: Epochs,
    hidden_size: usize,
    encoding: Encoding,
    sender: ClientDuplexSender<Vec<u8>>,
    receiver: ClientDuplexReceiver<Vec<u8>>,
    outbound: OutboundFrames,
    inbound: Inbound,
    credits: u64,
    served: Fingerprint,
    capacity: ShardCapacity,
    /// SHA-256 (hex) of frames sent and received, when recording.
    hashes: Option<(Vec<String>, Vec<String>)>,
    _client: ShardRuntimeClient,
}

/// How long past a frame's deadline the coordinator still waits for its
/// answer before it gives the link up: a shard that is connected (its
/// transport answers keepalive pings) but never answers must not hold a
/// worker forever.
const ANSWER_GRACE: Duration = Duration::from_secs(2);

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
    /// Connects, handshakes (the shard must serve `expected`), and opens
    /// the session stream.
    pub fn connect(
        addr: &str,
        expected: &Fingerprint,
        coordinator_epoch: u64,
        options: &LinkOptions,
    ) -> Result<ShardLink, LinkError> {
        let env = Arc::new(Environment::new(1));
        ShardLink::connect_in(&env, addr, expected, coordinator_epoch, options)
    }

    /// As [`ShardLink::connect`], on the completion queues of `env` (many
    /// links can share one).
    pub fn connect_in(
        env: &Arc<Environment>,
        addr: &str,
        expected: &Fingerprint,
        coordinator_epoch: u64,
        options: &LinkOptions,
    ) -> Result<ShardLink, LinkError> {
        let channel =
            super::transport::client(Arc::clone(env), options.max_frame_bytes).connect(addr);
        let client = ShardRuntimeClient::new(channel);
        let mut request = pb::HandshakeRequest::new();
        request.set_protocol_version(PROTOCOL_VERSION);
        request.set_expected(expected.to_wire());
        request.set_coordinator_epoch(coordinator_epoch);
        request.set_limits(limits_to_wire(
            options.max_frame_bytes,
            options.credit_window,
            0,
            &[options.encoding],
        ));
        let handshake_error = |message: String| LinkError::Handshake {
            addr: addr.to_owned(),
            message,
        };
        let response = client
            .handshake_opt(
                &request,
                CallOption::default().timeout(options.handshake_timeout),
            )
            .map_err(|e| match &e {
                // Refused terms are the handshake's; anything else never
                // reached a shard that could judge them.
                grpcio::Error::RpcFailure(status)
                    if matches!(
                        status.code(),
                        grpcio::RpcStatusCode::FAILED_PRECONDITION
                            | grpcio::RpcStatusCode::INVALID_ARGUMENT
                    ) =>
                {
                    handshake_error(e.to_string())
                }
                _ => LinkError::Transport {
                    addr: addr.to_owned(),
                    message: format!("handshake: {e}"),
                },
            })?;
        let served = Fingerprint::from_wire(response.get_served())
            .ok_or_else(|| handshake_error("the shard named no valid fingerprint".into()))?;
        if &served != expected {
            return Err(handshake_error(format!(
                "the shard serves layers {}..{} of {}, expected {}..{}",
                served.layer_begin,
                served.layer_end,
                served.hash_hex(),
                expected.layer_begin,
                expected.layer_end
            )));
        }
        let limits = response.get_limits();
        let epochs = Epochs {
            shard: response.get_shard_epoch(),
            coordinator: coordinator_epoch,
        };
        let (sender, receiver) = client
            .client
            .duplex_streaming(&SESSION_RAW, CallOption::default())
            .map_err(|e| LinkError::Transport {
                addr: addr.to_owned(),
                message: e.to_string(),
            })?;
        let hidden_size = served.hidden_size as usize;
        Ok(ShardLink {
            addr: addr.to_owned(),
            epochs,
            hidden_size,
            encoding: options.encoding,
            sender,
            receiver,
            outbound: OutboundFrames::new(epochs),
            inbound: Inbound::to_coordinator(
                epochs,
                limits.get_max_frame_bytes().max(1) as usize,
                hidden_size,
                vec![options.encoding],
            ),
            credits: u64::from(limits.get_credit_window()),
            served,
            capacity: ShardCapacity {
                kv_pages: response.get_kv_pages(),
                page_positions: response.get_page_positions(),
                max_sessions: limits.get_max_sessions(),
                max_frame_rows: limits.get_max_frame_rows(),
                keeps_pages: response.get_keeps_pages(),
            },
            hashes: options.record_hashes.then(|| (Vec::new(), Vec::new())),
            _client: client,
        })
    }

    /// SHA-256 (hex) of every frame sent and received on the stream so
    /// far, in order, when `record_hashes` was set.
    pub fn frame_hashes(&self) -> Option<(&[String], &[String])> {
        self.hashes
            .as_ref()
            .map(|(sent, received)| (sent.as_slice(), received.as_slice()))
    }

    /// The agreed epochs.
    pub fn epochs(&self) -> Epochs {
        self.epochs
    }

    /// What the shard serves.
    pub fn served(&self) -> &Fingerprint {
        &self.served
    }

    /// What the shard can hold.
    pub fn capacity(&self) -> ShardCapacity {
        self.capacity
    }

    /// The shard's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn transport(&self, message: String) -> LinkError {
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
    fn send(
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
    pub fn next_frame(&mut self) -> Result<super::frame::FrameCheck, LinkError> {
        self.next_frame_until(None)
    }

    /// As [`ShardLink::next_frame`], giving up at `deadline` (a transport
    /// failure: the stream can no longer be trusted to be in step).
    fn next_frame_until(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<super::frame::FrameCheck, LinkError> {
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
    fn answers_earlier(&self, checked: &super::frame::FrameCheck, current: u64) -> bool {
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

    fn refused(&self, error: &pb::ShardError) -> LinkError {
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

    /// Runs `hidden` (the rows of `runs`, in order) through the shard's
    /// layers, replacing it with the result. One run is a prefill fragment;
    /// several (one row each) are a decode batch.
    pub fn forward(
        &mut self,
        runs: &[Run],
        hidden: &mut [f32],
        deadline_unix_nanos: u64,
    ) -> Result<(), LinkError> {
        self.forward_chained(runs, &[], hidden, deadline_unix_nanos)
    }

    /// [`ShardLink::forward`], with each run's page chains (one per page
    /// it fills; `page_chains[i]` for `runs[i]`, none when shorter), sent
    /// only to a shard that keeps pages.
    pub fn forward_chained(
        &mut self,
        runs: &[Run],
        page_chains: &[Vec<u64>],
        hidden: &mut [f32],
        deadline_unix_nanos: u64,
    ) -> Result<(), LinkError> {
        // Answers are awaited until the frame's deadline (plus a grace);
        // 0 means none.
        let answer_by = (deadline_unix_nanos != 0).then(|| {
            let left =
                deadline_unix_nanos.saturating_sub(super::frame::unix_nanos(SystemTime::now()));
            Instant::now() + Duration::from_nanos(left) + ANSWER_GRACE
        });
        while self.credits == 0 {
            let checked = self.next_frame_until(answer_by)?;
            let upcoming = self.outbound.next_sequence();
            if checked.kind == FrameKind::Error && !self.answers_earlier(&checked, upcoming) {
                return Err(self.refused(checked.frame.get_error()));
            }
        }
        let mut body = super::frame::hidden_body(runs);
        if self.capacity.keeps_pages {
            for (rows, chains) in body.mut_runs().iter_mut().zip(page_chains) {
                rows.set_page_chains(chains.clone());
            }
        }
        let mut frame = pb::Frame::new();
        frame.set_payload(
            encode_rows(self.encoding, self.hidden_size, hidden)
                .map_err(|e| self.transport(format!("encoding hidden states: {e}")))?,
        );
        if runs.len() == 1 {
            frame.set_prefill(body);
        } else {
            frame.set_decode(body);
        }
        let sequence = self.send(frame, Some(self.encoding), deadline_unix_nanos)?;
        self.credits -= 1;
        loop {
            let checked = self.next_frame_until(answer_by)?;
            match checked.kind {
                FrameKind::Credit => continue,
                FrameKind::Error if self.answers_earlier(&checked, sequence) => continue,
                FrameKind::Error => {
                    // A refused frame's credit comes back with the refusal:
                    // the shard grants no credit frame for it (see
                    // `Answered` in shard.rs), so none is lost to refusals.
                    self.credits += 1;
                    return Err(self.refused(checked.frame.get_error()));
                }
                FrameKind::Output => {
                    let output = checked.frame.get_output();
                    let answers = output.get_answers_sequence();
                    if answers < sequence {
                        // The rest of a frame whose call already ended on
                        // the shard's error frame.
                        continue;
                    }
                    let same_rows = output.get_runs().len() == runs.len()
                        && output.get_runs().iter().zip(runs).all(|(got, sent)| {
                            got.get_session_id() == sent.session
                                && got.get_position() == sent.position
                                && got.get_count() == sent.rows
                        });
                    if answers > sequence || !same_rows {
                        return Err(LinkError::BadReply {
                            addr: self.addr.clone(),
                            error: FrameError {
                                kind: if answers > sequence {
                                    ErrorKind::Sequence
                                } else {
                                    ErrorKind::Malformed
                                },
                                message: format!(
                                    "an output for frame {answers} with {} runs, while frame \
                                     {sequence} with {} runs awaits its answer",
                                    output.get_runs().len(),
                                    runs.len()
                                ),
                                sessions: runs.iter().map(|r| r.session).collect(),
                                sequence: Some(checked.sequence),
                            },
                        });
                    }
                    let answered: usize = runs.iter().map(|r| r.rows as usize).sum();
                    let encoding = checked.encoding.unwrap_or(self.encoding);
                    let values = decode_rows(
                        encoding,
                        self.hidden_size,
                        answered,
                        checked.frame.get_payload(),
                    )
                    .map_err(|e| self.transport(e.to_string()))?;
                    hidden.copy_from_slice(&values);
                    return Ok(());
                }
                _ => continue,
            }
        }
    }

    /// Asks a shard that keeps pages to keep what it holds of `session`
    /// that matches a history of `length` positions whose full pages have
    /// these chains, and returns the positions it kept (a multiple of the
    /// page size, at most `length`).
    pub fn resume(
        &mut self,
        session: WireSessionId,
        length: u64,
        page_chains: &[u64],
        deadline_unix_nanos: u64,
    ) -> Result<u64, LinkError> {
        let answer_by = (deadline_unix_nanos != 0).then(|| {
            let left =
                deadline_unix_nanos.saturating_sub(super::frame::unix_nanos(SystemTime::now()));
            Instant::now() + Duration::from_nanos(left) + ANSWER_GRACE
        });
        let mut body = pb::Resume::new();
        body.set_session_id(session.to_vec());
        body.set_length(length);
        body.set_page_chains(page_chains.to_vec());
        body.set_encoding(self.encoding.to_wire());
        let mut frame = pb::Frame::new();
        frame.set_resume(body);
        let sequence = self.send(frame, None, deadline_unix_nanos)?;
        loop {
            let checked = self.next_frame_until(answer_by)?;
            match checked.kind {
                FrameKind::Error if self.answers_earlier(&checked, sequence) => continue,
                FrameKind::Error => return Err(self.refused(checked.frame.get_error())),
                FrameKind::Resumed => {
                    let resumed = checked.frame.get_resumed();
                    let page = u64::from(self.capacity.page_positions.max(1));
                    let kept = resumed.get_kept();
                    let fits = resumed.get_answers_sequence() == sequence
                        && resumed.get_session_id() == session
                        && kept <= length
                        && kept % page == 0;
                    if !fits {
                        return Err(LinkError::BadReply {
                            addr: self.addr.clone(),
                            error: FrameError {
                                kind: ErrorKind::Malformed,
                                message: format!(
                                    "a Resumed keeping {kept} positions for frame {}, while \
                                     frame {sequence} resumes {length} positions in pages of {page}",
                                    resumed.get_answers_sequence()
                                ),
                                sessions: vec![session],
                                sequence: Some(checked.sequence),
                            },
                        });
                    }
                    return Ok(kept);
                }
                _ => continue,
            }
        }
    }

    /// Frees the sessions' KV on the shard.
    pub fn release(&mut self, sessions: &[WireSessionId]) -> Result<(), LinkError> {
        let mut body = pb::Release::new();
        body.set_session_ids(sessions.iter().map(|s| s.to_vec()).collect());
        let mut frame = pb::Frame::new();
        frame.set_release(body);
        self.send(frame, None, 0).map(|_| ())
    }

    /// Tells the shard the sessions' generations ended (nothing of theirs
    /// is queued there: frames are answered in order).
    pub fn cancel(&mut self, sessions: &[WireSessionId]) -> Result<(), LinkError> {
        let mut body = pb::Cancel::new();
        body.set_session_ids(sessions.iter().map(|s| s.to_vec()).collect());
        let mut frame = pb::Frame::new();
        frame.set_cancel(body);
        self.send(frame, None, 0).map(|_| ())
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
