//! One OpenAI-style request run on the runtime: a session of its own
//! (created, fed the prompt, asked to generate, closed however the request
//! ends), the generated tokens turned into text as they come (a token that
//! ends inside a UTF-8 sequence waits for the next; stop strings cut the
//! text), and what the response reports: text pieces with their
//! log-probabilities, why it finished, and the usage counts.
//!
//! A request that names a session (`x-inferd-session: ID`, a kakeya
//! session id) runs in that session instead and leaves it open: its
//! history must begin the request's prompt (else a 400
//! `session_history_mismatch`), and only the rest is appended.
//!
//! Every runtime call runs as the request's caller (its token's tenant,
//! CONTRACT §2.10): a session of another tenant is a 404 like an unknown
//! one, and the request's own session is the caller's.
//!
//! The API is stateless, the server is not: the prompt is appended to a
//! fresh session, and the runtime maps every full page of it that another
//! session, or the prefix cache (`--prefix-cache-pages`), already holds
//! (shared prefixes, CONTRACT §2.12), bit-identical to computing it. So a
//! conversation's next turn, which re-sends the whole conversation, costs
//! only its new tokens; the tokens mapped are reported as
//! `prompt_tokens_details.cached_tokens`.

use std::sync::Arc;

use futures_util::StreamExt;
use tokio::sync::mpsc;

use super::openai::ApiError;
use super::responses::{FinishReason, TokenLogprob, TopLogprob, Usage};
use super::stop_text::StopText;
use super::Front;
use crate::runtime::{
    AppendTokens, CreateSession, GenerateEvent, GenerateRequest, GenerateStream, SessionId, Tenant,
};
use crate::stop::StopReason;
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// A request, checked and tokenized: what to run.
#[derive(Clone, Debug)]
pub struct Job {
    pub prompt: Vec<u32>,
    /// The Generate to run (checked), its id set once the session is
    /// known.
    pub generate: GenerateRequest,
    pub stops: Vec<String>,
    /// Report each token's log-probability (and
    /// `generate.sampling.top_logprobs` alternatives).
    pub logprobs: bool,
    /// The client's own session to run in (`x-inferd-session`), if any.
    pub session: Option<SessionId>,
    /// How a reply with tools is read into calls (and which control
    /// tokens it shows); `None` without tools.
    pub tools: Option<super::tools::ReplyPlan>,
}

/// What a running job sends, in order: pieces of text, then one `Done` or
/// one `Failed`.
#[derive(Debug)]
pub enum Piece {
    Text {
        text: String,
        /// The log-probabilities of the tokens this text came from (empty
        /// unless asked for).
        logprobs: Vec<TokenLogprob>,
    },
    Done {
        finish: FinishReason,
        usage: Usage,
    },
    Failed(ApiError),
}

/// Closes the job's session however the job ends (a client that went away
/// included).
struct SessionGuard {
    front: Arc<Front>,
    caller: Tenant,
    id: SessionId,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        // The close runs after what is queued on the session; nobody waits
        // for its reply.
        let _ = self
            .front
            .state
            .runtime
            .close_session(&self.caller, self.id, None);
    }
}

/// Starts `job` on the HTTP runtime for `caller`; its pieces arrive on the
/// returned channel. Dropping the receiver stops the generation within a
/// step.
pub fn start(front: Arc<Front>, caller: Tenant, job: Job) -> mpsc::Receiver<Piece> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        if let Err(e) = run(&front, &caller, job, &tx).await {
            let _ = tx.send(Piece::Failed(e)).await;
        }
    });
    rx
}

/// Everything `start` sends, gathered (a response that does not stream).
pub async fn gather(mut rx: mpsc::Receiver<Piece>) -> Result<Gathered, ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    while let Some(piece) = rx.recv().await {
        match piece {
            Piece::Text {
                text: t,
                logprobs: l,
            } => {
                text.push_str(&t);
                logprobs.extend(l);
            }
            Piece::Done { finish, usage } => {
                return Ok(Gathered {
                    text,
                    logprobs,
                    finish,
                    usage,
                })
            }
            Piece::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::from(crate::runtime::RuntimeError::Unavailable))
}

/// A whole job's output.
#[derive(Debug)]
pub struct Gathered {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: FinishReason,
    pub usage: Usage,
}

/// The job's steps, in order: open its session, feed it the prompt,
/// generate, stream the text out, then report why it finished and the
/// usage.
async fn run(
    front: &Arc<Front>,
    caller: &Tenant,
    job: Job,
    tx: &mpsc::Sender<Piece>,
) -> Result<(), ApiError> {
    let prompt_tokens = job.prompt.len() as u64;
    // The guard closes the request's own session when the job ends.
    let (id, held, _guard) = open(front, caller, job.session, &job.prompt).await?;
    let reused = feed(front, caller, id, &job.prompt[held..]).await?;
    let request = GenerateRequest { id, ..job.generate };
    let stream = front.state.runtime.generate(caller, request, None)?;
    let shown_tokens = job.tools.map(|t| t.shown_tokens).unwrap_or_default();
    let Some(ended) = stream_out(front, stream, job.stops, shown_tokens, job.logprobs, tx).await?
    else {
        // The client went away.
        return Ok(());
    };
    let usage = Usage::new(prompt_tokens, ended.generated, held as u64 + reused);
    let finish = ended.finish;
    let _ = tx.send(Piece::Done { finish, usage }).await;
    Ok(())
}

/// The session the job runs in, the history it already holds, and the
/// guard that closes it: a new session of the job's own, or the client's
/// (`x-inferd-session`, which stays open), whose history must begin the
/// prompt.
async fn open(
    front: &Arc<Front>,
    caller: &Tenant,
    session: Option<SessionId>,
    prompt: &[u32],
) -> Result<(SessionId, usize, Option<SessionGuard>), ApiError> {
    let runtime = &front.state.runtime;
    if let Some(id) = session {
        let history = runtime.session_history(caller, id, None)?.await?;
        if !prompt.starts_with(&history) {
            // Nothing about the session's history (not even its length)
            // is told: only that it is not this prompt's start.
            return Err(ApiError {
                code: Some("session_history_mismatch"),
                ..ApiError::invalid(
                    "x-inferd-session",
                    format!(
                        "the session's history does not begin this request's prompt \
                         ({} tokens)",
                        prompt.len()
                    ),
                )
            });
        }
        return Ok((id, history.len(), None));
    }
    let create = CreateSession {
        client_label: "http".into(),
        eos_token_ids: front.eos.clone(),
    };
    let id = runtime.create_session(caller, create, None)?.await?;
    let guard = SessionGuard {
        front: Arc::clone(front),
        caller: caller.clone(),
        id,
    };
    Ok((id, 0, Some(guard)))
}

/// Appends what the session does not hold yet; returns how many of those
/// tokens were mapped from shared pages instead of computed.
async fn feed(
    front: &Front,
    caller: &Tenant,
    id: SessionId,
    fresh: &[u32],
) -> Result<u64, ApiError> {
    if fresh.is_empty() {
        return Ok(0);
    }
    let append = AppendTokens {
        id,
        tokens: fresh.to_vec(),
    };
    let reply = front
        .state
        .runtime
        .append_tokens(caller, append, None)?
        .await?;
    Ok(reply.reused_token_count)
}

/// How a generation's text ended.
struct Ended {
    finish: FinishReason,
    /// Tokens generated (an end-of-generation token included).
    generated: u64,
}

/// Sends the Generate's tokens on `tx` as text pieces (with their
/// log-probabilities when asked for), cut at the first stop string, which
/// cancels the Generate. `None`: the client went away (dropping the
/// stream cancels it).
async fn stream_out(
    front: &Front,
    mut stream: GenerateStream,
    stops: Vec<String>,
    shown_tokens: Vec<u32>,
    logprobs: bool,
    tx: &mpsc::Sender<Piece>,
) -> Result<Option<Ended>, ApiError> {
    let tokenizer = &front.tokenizer;
    let mut text = Text {
        decoder: StreamDecoder::new(),
        shown_tokens,
        stop: StopText::new(stops),
        logprobs: Vec::new(),
        waiting: None,
    };
    let mut generated = 0u64;
    let mut finish = FinishReason::Length;
    while let Some(event) = stream.next().await {
        let piece = match event {
            GenerateEvent::Token(token) => {
                generated += 1;
                let piece = text.decode(tokenizer, token)?;
                if logprobs {
                    // A token's text waits for its log-probabilities (they
                    // follow it as their own event).
                    text.waiting = Some(piece);
                    continue;
                }
                piece
            }
            GenerateEvent::Logprobs(lp) => {
                // An end-of-generation token is no part of the text, nor of
                // the log-probabilities that line up with it.
                if !tokenizer.is_eog(lp.token) {
                    let entry = token_logprob(front, lp.token, lp.chosen, &lp.top);
                    text.logprobs.push(entry);
                }
                text.waiting.take().unwrap_or_default()
            }
            GenerateEvent::Truncated { .. } => continue,
            GenerateEvent::Done(done) => {
                finish = finish_of(done.stop_reason);
                break;
            }
            GenerateEvent::Error(e) => return Err(e.into()),
        };
        let (out, hit) = text.stop.push(&piece);
        if (!out.is_empty() || hit) && tx.send(text.piece(out)).await.is_err() {
            return Ok(None);
        }
        if hit {
            stream.cancel();
            let finish = FinishReason::Stop;
            return Ok(Some(Ended { finish, generated }));
        }
    }
    let (rest, hit) = text.rest();
    if hit {
        finish = FinishReason::Stop;
    }
    if !rest.is_empty() || !text.logprobs.is_empty() {
        let _ = tx.send(text.piece(rest)).await;
    }
    Ok(Some(Ended { finish, generated }))
}

/// The text of a generation on its way out.
struct Text {
    decoder: StreamDecoder,
    /// Control tokens whose text is shown.
    shown_tokens: Vec<u32>,
    stop: StopText,
    /// Log-probabilities of the tokens not sent yet.
    logprobs: Vec<TokenLogprob>,
    /// The text of a token whose log-probabilities have not come yet.
    waiting: Option<String>,
}

/// Why a choice ended, as OpenAI names it, for why the Generate ended.
fn finish_of(reason: StopReason) -> FinishReason {
    match reason {
        StopReason::MaxTokens | StopReason::Truncated | StopReason::ConstraintUnfinished => {
            FinishReason::Length
        }
        StopReason::Eos
        | StopReason::StopSequence { .. }
        | StopReason::Cancelled
        | StopReason::ConstraintDone => FinishReason::Stop,
    }
}

impl Text {
    /// A generated token's text, as far as it is whole (an end-of-generation
    /// or control token has none, unless it is one of the shown ones).
    fn decode(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<String, ApiError> {
        let shown = self.shown_tokens.contains(&token);
        if tokenizer.is_eog(token) || (tokenizer.is_control(token) && !shown) {
            return Ok(String::new());
        }
        self.decoder
            .push(tokenizer, token)
            .map_err(|e| ApiError::from(crate::runtime::RuntimeError::Internal(e.to_string())))
    }

    /// `out` as a piece, with the log-probabilities held so far.
    fn piece(&mut self, out: String) -> Piece {
        Piece::Text {
            text: out,
            logprobs: std::mem::take(&mut self.logprobs),
        }
    }

    /// What is left when the generation ended without a stop string: the
    /// text still held, cut at a stop string it completes (then `true`).
    fn rest(&mut self) -> (String, bool) {
        let mut rest = self.waiting.take().unwrap_or_default();
        rest.push_str(&self.decoder.finish());
        let (mut out, hit) = self.stop.push(&rest);
        if !hit {
            out.push_str(&self.stop.finish());
        }
        (out, hit)
    }
}

/// A token's log-probability in OpenAI's shape.
fn token_logprob(front: &Front, token: u32, logprob: f32, top: &[(u32, f32)]) -> TokenLogprob {
    let (text, bytes) = token_text(front, token);
    TokenLogprob {
        token: text,
        logprob,
        bytes,
        top_logprobs: top
            .iter()
            .map(|&(t, lp)| {
                let (token, bytes) = token_text(front, t);
                TopLogprob {
                    token,
                    logprob: lp,
                    bytes,
                }
            })
            .collect(),
    }
}

/// A token's bytes, and their text (lossy where it ends inside a UTF-8
/// sequence).
fn token_text(front: &Front, token: u32) -> (String, Vec<u8>) {
    let bytes = front.tokenizer.decode_bytes(&[token]).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}
