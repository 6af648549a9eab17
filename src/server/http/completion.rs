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
    AppendTokens, CreateSession, GenerateEvent, GenerateRequest, SessionId, Tenant,
};
use crate::stop::StopReason;
use crate::tokenizer::StreamDecoder;

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

async fn run(
    front: &Arc<Front>,
    caller: &Tenant,
    job: Job,
    tx: &mpsc::Sender<Piece>,
) -> Result<(), ApiError> {
    let runtime = &front.state.runtime;
    let prompt_tokens = job.prompt.len() as u64;
    let (id, held, _guard) = match job.session {
        Some(id) => {
            let history = runtime.session_history(caller, id, None)?.await?;
            if !job.prompt.starts_with(&history) {
                // Nothing about the session's history (not even its
                // length) is told: only that it is not this prompt's start.
                return Err(ApiError {
                    code: Some("session_history_mismatch"),
                    ..ApiError::invalid(
                        "x-inferd-session",
                        format!(
                            "the session's history does not begin this request's prompt \
                             ({} tokens)",
                            job.prompt.len()
                        ),
                    )
                });
            }
            (id, history.len(), None)
        }
        None => {
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
            (id, 0, Some(guard))
        }
    };
    let fresh = job.prompt[held..].to_vec();
    let reused = if fresh.is_empty() {
        0
    } else {
        runtime
            .append_tokens(caller, AppendTokens { id, tokens: fresh }, None)?
            .await?
            .reused_token_count
    };
    let request = GenerateRequest { id, ..job.generate };
    let mut stream = runtime.generate(caller, request, None)?;
    let tokenizer = &front.tokenizer;
    let mut decoder = StreamDecoder::new();
    let mut stop = StopText::new(job.stops);
    let mut generated = 0u64;
    let mut held_logprobs: Vec<TokenLogprob> = Vec::new();
    // A token's text waits for its log-probabilities when they were asked
    // for (they follow it as their own event).
    let mut waiting: Option<String> = None;
    let mut finish = FinishReason::Length;
    let mut stopped = false;
    while let Some(event) = stream.next().await {
        let text = match event {
            GenerateEvent::Token(token) => {
                generated += 1;
                let text = if tokenizer.is_eog(token) || tokenizer.is_control(token) {
                    String::new()
                } else {
                    decoder.push(tokenizer, token).map_err(|e| {
                        ApiError::from(crate::runtime::RuntimeError::Internal(e.to_string()))
                    })?
                };
                if job.logprobs {
                    waiting = Some(text);
                    continue;
                }
                text
            }
            GenerateEvent::Logprobs(lp) => {
                // An end-of-generation token is no part of the text, nor of
                // the log-probabilities that line up with it.
                if !tokenizer.is_eog(lp.token) {
                    held_logprobs.push(token_logprob(front, lp.token, lp.chosen, &lp.top));
                }
                waiting.take().unwrap_or_default()
            }
            GenerateEvent::Truncated { .. } => continue,
            GenerateEvent::Done(done) => {
                finish = match done.stop_reason {
                    StopReason::MaxTokens | StopReason::Truncated => FinishReason::Length,
                    StopReason::Eos | StopReason::StopSequence { .. } | StopReason::Cancelled => {
                        FinishReason::Stop
                    }
                };
                break;
            }
            GenerateEvent::Error(e) => return Err(e.into()),
        };
        let (out, hit) = stop.push(&text);
        if !out.is_empty() || hit {
            let piece = Piece::Text {
                text: out,
                logprobs: std::mem::take(&mut held_logprobs),
            };
            if tx.send(piece).await.is_err() {
                // The client went away: dropping the stream cancels.
                return Ok(());
            }
        }
        if hit {
            stream.cancel();
            finish = FinishReason::Stop;
            stopped = true;
            break;
        }
    }
    if !stopped {
        let mut rest = waiting.take().unwrap_or_default();
        rest.push_str(&decoder.finish());
        let (mut out, hit) = stop.push(&rest);
        if hit {
            finish = FinishReason::Stop;
        } else {
            out.push_str(&stop.finish());
        }
        if !out.is_empty() || !held_logprobs.is_empty() {
            let piece = Piece::Text {
                text: out,
                logprobs: std::mem::take(&mut held_logprobs),
            };
            let _ = tx.send(piece).await;
        }
    }
    let usage = Usage::new(prompt_tokens, generated, held as u64 + reused);
    let _ = tx.send(Piece::Done { finish, usage }).await;
    Ok(())
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
