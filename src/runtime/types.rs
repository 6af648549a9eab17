//! Plain request, reply and event types of the runtime API (its
//! configuration is in `config`). A transport converts its messages to and
//! from these.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

#[cfg(not(loom))]
use crossbeam_channel::Receiver;
use futures_core::Stream;

use super::notify::NotifyReceiver;

use super::limits::{
    self, at_most, MAX_APPEND_TOKENS, MAX_CLIENT_LABEL_BYTES, MAX_EOS_TOKEN_IDS,
    MAX_LOGIT_BIAS_ENTRIES, MAX_PENALTY_LAST_N, MAX_STOP_SEQUENCES, MAX_STOP_SEQUENCE_TOKENS,
};
use super::{RequestConstraint, RuntimeError, SessionId};
use crate::sampler::{CheckedParams, SamplingParams, TokenLogprobs};

/// CreateSession.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CreateSession {
    /// Kept verbatim for diagnostics (at most
    /// [`limits::MAX_CLIENT_LABEL_BYTES`] bytes).
    pub client_label: String,
    /// Emitting one of these ends a Generate with [`StopReason::Eos`] (at
    /// most [`limits::MAX_EOS_TOKEN_IDS`]).
    pub eos_token_ids: Vec<u32>,
}

impl CreateSession {
    /// Checks what the session would keep for its life against its bounds.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        at_most(
            "client_label",
            "bytes",
            self.client_label.len(),
            MAX_CLIENT_LABEL_BYTES,
        )?;
        at_most(
            "eos_token_ids",
            "ids",
            self.eos_token_ids.len(),
            MAX_EOS_TOKEN_IDS,
        )
    }
}

/// AppendTokens: raw token ids to add to the history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppendTokens {
    pub id: SessionId,
    pub tokens: Vec<u32>,
}

impl AppendTokens {
    /// Checks the token ids of an append: at most
    /// [`limits::MAX_APPEND_TOKENS`], each inside a vocabulary of `vocab`
    /// tokens. Needs no session: the runtime's boundary
    /// (`Runtime::append_tokens`) runs it before any worker looks the
    /// session up.
    pub fn check_tokens(tokens: &[u32], vocab: usize) -> Result<(), RuntimeError> {
        at_most("token_ids", "ids", tokens.len(), MAX_APPEND_TOKENS)?;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(RuntimeError::invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        Ok(())
    }
}

/// What an append did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendReply {
    pub history_length: u64,
    /// Tokens dropped by the truncate overflow policy (0 normally).
    pub dropped_token_count: u64,
    /// Of the appended tokens, those whose KV was mapped from pages other
    /// sessions (or the prefix cache) held instead of computed.
    pub reused_token_count: u64,
}

/// ForkSession: a new session on the source's worker holding the source's
/// first `at_length` history tokens, its KV shared page by page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForkSession {
    pub source: SessionId,
    /// History tokens the fork keeps; `None`: all of them.
    pub at_length: Option<u64>,
    /// The fork's label; `None`: the source's (at most
    /// [`limits::MAX_CLIENT_LABEL_BYTES`] bytes).
    pub client_label: Option<String>,
}

impl ForkSession {
    /// Checks what needs no session.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        let label = self.client_label.as_deref().unwrap_or_default();
        at_most("client_label", "bytes", label.len(), MAX_CLIENT_LABEL_BYTES)
    }
}

/// What a fork made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForkReply {
    pub id: SessionId,
    pub history_length: u64,
}

/// The sampling knobs of a Generate; `None` means "not set".
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingOptions {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub penalty_last_n: Option<u32>,
    pub logit_bias: Vec<(u32, f32)>,
    /// Unset: one is drawn from the OS and reported as `seed_used`.
    pub seed: Option<u64>,
    /// Report with every token its log-probability and those of the
    /// `top_logprobs` most likely tokens (0: none; at most
    /// [`limits::MAX_TOP_LOGPROBS`]).
    pub top_logprobs: u32,
}

impl SamplingOptions {
    /// The sampler parameters these options mean with `seed`. Greedy when
    /// the temperature is 0, or unset with no other knob set; an unset
    /// temperature with other knobs set means 1.
    fn params(&self, seed: u64) -> SamplingParams {
        let other_knobs = self.top_p.is_some() || self.top_k.is_some() || self.min_p.is_some();
        let greedy = SamplingParams::greedy();
        SamplingParams {
            temperature: self
                .temperature
                .unwrap_or(if other_knobs { 1.0 } else { 0.0 }),
            top_k: self.top_k.unwrap_or(greedy.top_k),
            top_p: self.top_p.unwrap_or(greedy.top_p),
            min_p: self.min_p.unwrap_or(greedy.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(greedy.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(greedy.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(greedy.frequency_penalty),
            penalty_last_n: self.penalty_last_n.unwrap_or(0) as usize,
            logit_bias: self.logit_bias.clone(),
            seed,
        }
    }

    /// The bounds of [`limits`] on the options' counts.
    fn check_limits(&self) -> Result<(), RuntimeError> {
        at_most(
            "logit_bias",
            "entries",
            self.logit_bias.len(),
            MAX_LOGIT_BIAS_ENTRIES,
        )?;
        if let Some(n) = self.penalty_last_n.filter(|&n| n > MAX_PENALTY_LAST_N) {
            return Err(RuntimeError::InvalidArgument(format!(
                "penalty_last_n {n} is too long: at most {MAX_PENALTY_LAST_N} (0: the whole history)"
            )));
        }
        if self.top_logprobs as usize > limits::MAX_TOP_LOGPROBS {
            return Err(RuntimeError::InvalidArgument(format!(
                "top_logprobs {} is too many: at most {}",
                self.top_logprobs,
                limits::MAX_TOP_LOGPROBS
            )));
        }
        Ok(())
    }

    /// The one check of the options: every knob against its documented
    /// range (the sampler's checks, plus the bounds of [`limits`]) for a
    /// vocabulary of `vocab` tokens; the parameters come back checked.
    fn checked(&self, seed: u64, vocab: usize) -> Result<CheckedParams, RuntimeError> {
        self.check_limits()?;
        Ok(self.params(seed).checked(vocab)?)
    }

    /// Checks the options as [`SamplingOptions::resolve`] does, drawing no
    /// seed (the seed plays no part in any check).
    pub fn check(&self, vocab: usize) -> Result<(), RuntimeError> {
        self.checked(0, vocab).map(drop)
    }

    /// Checks every knob (as [`SamplingOptions::check`]) and returns the
    /// sampler parameters the options mean, checked once for the whole
    /// call, with the seed used: the request's, or one drawn from the OS.
    pub fn resolve(&self, vocab: usize) -> Result<(CheckedParams, u64), RuntimeError> {
        let seed = match self.seed {
            Some(seed) => seed,
            None => {
                let mut bytes = [0u8; 8];
                getrandom::getrandom(&mut bytes)
                    .map_err(|e| RuntimeError::Internal(format!("OS random source failed: {e}")))?;
                u64::from_le_bytes(bytes)
            }
        };
        Ok((self.checked(seed, vocab)?, seed))
    }
}

/// Generate: continue the history by up to `max_tokens` tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    pub id: SessionId,
    pub max_tokens: u32,
    pub sampling: SamplingOptions,
    /// Token sequences that end the generation once the generated tokens
    /// end with one (the sequence is emitted and committed first).
    pub stop_sequences: Vec<Vec<u32>>,
    /// What the output must match, compiled by the front door.
    pub constraint: Option<RequestConstraint>,
    /// Whether to speculate (prompt lookup): `None` takes the server's
    /// [`RuntimeConfig::speculation`]. The tokens are the same either way;
    /// only the number of forward passes differs.
    pub speculate: Option<bool>,
}

impl GenerateRequest {
    /// Checks every argument of a Generate that needs no session state
    /// against a vocabulary of `vocab` tokens (`max_tokens`, the sampling
    /// knobs, the stop sequences; `id` plays no part). The one check of
    /// them: [`GenerateRequest::admit`] runs the same checks, and a front
    /// door that must refuse a request before it changes anything (the
    /// HTTP API creates a session of its own before its Generate) runs
    /// this first.
    pub fn check(&self, vocab: usize) -> Result<(), RuntimeError> {
        self.check_length_and_stops(vocab)?;
        self.sampling.check(vocab)
    }

    /// [`GenerateRequest::check`], returning what the worker runs: the
    /// sampler parameters, checked here once for the whole call, and the
    /// seed used. The runtime runs it before it looks the session up, so a
    /// bad argument is `InvalidArgument` whatever the id.
    pub fn admit(&self, vocab: usize) -> Result<(CheckedParams, u64), RuntimeError> {
        self.check_length_and_stops(vocab)?;
        self.sampling.resolve(vocab)
    }

    /// `max_tokens` and the stop sequences.
    fn check_length_and_stops(&self, vocab: usize) -> Result<(), RuntimeError> {
        let stop_sequences = &self.stop_sequences;
        if self.max_tokens == 0 {
            return Err(RuntimeError::invalid("max_tokens must be at least 1"));
        }
        at_most(
            "stop_sequences",
            "sequences",
            stop_sequences.len(),
            MAX_STOP_SEQUENCES,
        )?;
        if let Some(longest) = stop_sequences
            .iter()
            .map(Vec::len)
            .find(|&n| n > MAX_STOP_SEQUENCE_TOKENS)
        {
            at_most(
                "a stop sequence",
                "token ids",
                longest,
                MAX_STOP_SEQUENCE_TOKENS,
            )?;
        }
        if let Some(bad) = stop_sequences
            .iter()
            .flatten()
            .find(|&&t| t as usize >= vocab)
        {
            return Err(RuntimeError::invalid(format!(
                "stop sequence token {bad} is outside the vocabulary of {vocab}"
            )));
        }
        if stop_sequences.iter().any(|s| s.is_empty()) {
            return Err(RuntimeError::invalid("stop sequences must not be empty"));
        }
        Ok(())
    }
}

pub use crate::stop::StopReason;

/// The terminal event of a Generate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenerateDone {
    pub stop_reason: StopReason,
    pub generated_token_count: u32,
    /// Time spent re-prefilling a truncated history (0 otherwise).
    pub prefill_duration: Duration,
    /// History tokens computed before the first sampled token (a
    /// re-prefilled truncation window; 0 when the cache was complete).
    pub prefill_token_count: u64,
    pub total_duration: Duration,
    pub seed_used: u64,
    pub history_length: u64,
    /// Tokens speculation proposed in this call, and how many of them were
    /// the tokens sampled (and emitted).
    pub speculation: SpeculationCounts,
}

/// What speculation did: proposed tokens (each computed in a verification
/// pass) and accepted ones (emitted without a pass of their own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpeculationCounts {
    pub proposed: u64,
    pub accepted: u64,
}

/// One event of a Generate stream. A stream ends with exactly one `Done`
/// or one `Error`.
#[derive(Clone, Debug, PartialEq)]
pub enum GenerateEvent {
    /// The context was full, so the oldest tokens after the sink were
    /// dropped and the kept window computed again; sent once that is done,
    /// before the next token.
    Truncated {
        dropped_token_count: u64,
    },
    /// A generated token, already committed to the history.
    Token(u32),
    /// The log-probabilities of the token just sent (only when the request
    /// asked for `top_logprobs`).
    Logprobs(TokenLogprobs),
    Done(GenerateDone),
    /// The call failed; tokens emitted before it stay committed.
    Error(RuntimeError),
}

/// The receiving end of a Generate. Dropping it cancels the generation
/// within one decode step.
pub struct GenerateStream {
    pub(crate) events: NotifyReceiver<GenerateEvent>,
    /// Set once the terminal event was handed out, so the stream then ends.
    pub(crate) finished: bool,
    pub(crate) cancel: Arc<AtomicBool>,
}

impl GenerateStream {
    #[cfg(not(loom))]
    /// The event channel (for `select!` in a transport).
    pub fn events(&self) -> &Receiver<GenerateEvent> {
        self.events.inner()
    }

    /// Asks the worker to stop; it does within one decode step and sends a
    /// `Done(Cancelled)` if the stream is still held.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }

    #[cfg(not(loom))]
    /// Next event, waiting at most until `deadline` (`None`: forever).
    pub fn recv(&self, deadline: Option<Instant>) -> Option<GenerateEvent> {
        match deadline {
            Some(d) => self.events.recv_deadline(d).ok(),
            None => self.events.recv().ok(),
        }
    }

    #[cfg(not(loom))]
    /// Reads every event up to the terminal one.
    pub fn collect(self) -> Vec<GenerateEvent> {
        let mut all = Vec::new();
        while let Ok(event) = self.events.recv() {
            let terminal = matches!(event, GenerateEvent::Done(_) | GenerateEvent::Error(_));
            all.push(event);
            if terminal {
                break;
            }
        }
        all
    }
}

/// The async face of the stream: yields every event up to and including the
/// terminal `Done` or `Error`, then ends. A runtime that went away mid-call
/// yields an `Unavailable` error rather than ending silently.
impl Stream for GenerateStream {
    type Item = GenerateEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<GenerateEvent>> {
        if self.finished {
            return Poll::Ready(None);
        }
        let event = match self.events.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(event)) => event,
            Poll::Ready(None) => GenerateEvent::Error(RuntimeError::Unavailable),
        };
        if matches!(event, GenerateEvent::Done(_) | GenerateEvent::Error(_)) {
            self.finished = true;
        }
        Poll::Ready(Some(event))
    }
}

impl Drop for GenerateStream {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Release);
    }
}

/// What CloseSession reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CloseReply {
    pub final_history_length: u64,
}

/// GetSessionInfo.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionInfo {
    pub history_length: u64,
    pub kv_live_bytes: u64,
    pub inv1_violations: u64,
    pub inv2_violations: u64,
    /// Seconds since the last Append or Generate ended (0 while busy).
    pub idle_seconds: f64,
    pub pages_held: u64,
    pub client_label: String,
    /// The stop ids given at CreateSession.
    pub eos_token_ids: Vec<u32>,
    /// Tokens dropped so far by context-overflow truncation.
    pub truncated_token_count: u64,
    /// Whether an operation is running or queued on the session.
    pub busy: bool,
    /// FNV-1a over the bits of the logits predicting the next token, for
    /// checking determinism from outside.
    pub logits_digest: u64,
    /// Journaled in the state directory: its acknowledged history survives
    /// a restart.
    pub durable: bool,
    /// Where its layers are computed: "cpu", "gpu" or "shards".
    pub backend: &'static str,
    /// Speculation's counts over every Generate of the session since this
    /// process has held it.
    pub speculation: SpeculationCounts,
}

/// A unary reply on its way from a worker.
pub struct Pending<T> {
    pub(crate) reply: NotifyReceiver<Result<T, RuntimeError>>,
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) deadline: Option<Instant>,
}

impl<T> Pending<T> {
    #[cfg(not(loom))]
    /// Waits for the reply, at most until the call's deadline.
    pub fn wait(self) -> Result<T, RuntimeError> {
        let got = match self.deadline {
            Some(d) => self.reply.recv_deadline(d).map_err(|e| match e {
                crossbeam_channel::RecvTimeoutError::Timeout => RuntimeError::DeadlineExceeded,
                crossbeam_channel::RecvTimeoutError::Disconnected => RuntimeError::Unavailable,
            }),
            None => self.reply.recv().map_err(|_| RuntimeError::Unavailable),
        };
        got?
    }

    #[cfg(not(loom))]
    /// The reply channel (for `select!` with other channels).
    pub fn receiver(&self) -> &Receiver<Result<T, RuntimeError>> {
        self.reply.inner()
    }
}

/// The async face of a reply: resolves when the worker answers. The call's
/// deadline is the transport's to enforce here (the worker enforces it on
/// work that waits in a session's queue).
impl<T> Future for Pending<T> {
    type Output = Result<T, RuntimeError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.reply.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(reply)) => Poll::Ready(reply),
            Poll::Ready(None) => Poll::Ready(Err(RuntimeError::Unavailable)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(edit: impl FnOnce(&mut GenerateRequest)) -> GenerateRequest {
        let mut req = GenerateRequest {
            constraint: None,
            speculate: None,
            id: SessionId::NEVER_ISSUED,
            max_tokens: 4,
            sampling: SamplingOptions::default(),
            stop_sequences: Vec::new(),
        };
        edit(&mut req);
        req
    }

    /// `check` (run up front by a front door) and `admit` (run by the
    /// runtime) refuse the same arguments with the same error.
    #[test]
    fn check_refuses_what_admission_refuses_with_the_same_error() {
        let bad: [fn(&mut GenerateRequest); 10] = [
            |r| r.max_tokens = 0,
            |r| r.sampling.temperature = Some(-0.5),
            |r| r.sampling.temperature = Some(1e-9),
            |r| r.sampling.top_p = Some(0.0),
            |r| r.sampling.frequency_penalty = Some(f32::INFINITY),
            |r| r.sampling.top_logprobs = 21,
            |r| r.sampling.logit_bias = vec![(320, 1.0)],
            |r| r.sampling.logit_bias = vec![(1, 0.0); MAX_LOGIT_BIAS_ENTRIES + 1],
            |r| r.sampling.penalty_last_n = Some(MAX_PENALTY_LAST_N + 1),
            |r| r.stop_sequences = vec![vec![]],
        ];
        for (i, edit) in bad.iter().enumerate() {
            let req = request(edit);
            let admitted = req.admit(320).map(|_| ()).expect_err("refused");
            assert_eq!(req.check(320), Err(admitted), "case {i}");
        }
        let good = request(|r| {
            r.sampling.temperature = Some(0.7);
            r.sampling.top_logprobs = 20;
            r.sampling.logit_bias = vec![(319, -100.0)];
        });
        assert_eq!(good.check(320), Ok(()));
        assert!(good.admit(320).is_ok());
    }
}
