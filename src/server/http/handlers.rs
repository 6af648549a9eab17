//! The routes: `POST /v1/chat/completions` (the conversation rendered with
//! the model's chat template), `POST /v1/completions` (a prompt as text or
//! token ids), `GET /v1/models`, each answering whole or, with `stream:
//! true`, as server-sent events (`data: {...}` chunks, then `data:
//! [DONE]`). Every answer carries the usage counts: a streamed one in a
//! last chunk with no choices when `stream_options.include_usage` asks for
//! it (as OpenAI sends it), otherwise on the chunk that says why it
//! finished, so that every chunk of such a stream has a choice.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};

use super::completion::{self, Gathered, Job, Piece};
use super::openai::{
    ApiError, ChatRequest, CompletionRequest, Prompt, Sampling, TokenLogprob, Usage,
};
use super::Front;
use crate::chat_template::Message;
use crate::runtime::limits::{
    MAX_CHAT_MESSAGES, MAX_HTTP_BODY_BYTES, MAX_OPENAI_LOGIT_BIAS, MAX_STOP_STRINGS,
    MAX_STOP_STRING_BYTES, MAX_TOP_LOGPROBS,
};
use crate::runtime::{SamplingOptions, Tenant};

/// `GET /v1/models`: the one model this server runs.
pub async fn models(State(front): State<Arc<Front>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": front.model_id,
            "object": "model",
            "created": front.created,
            "owned_by": "inferd",
        }],
    }))
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_body(format!("the request body: {e}")))
}

/// `POST /v1/chat/completions`.
/// The body, or why it could not be read (over the limit: 413), as an
/// OpenAI error.
fn body_of(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(format!(
                "the request body: {e} (at most {MAX_HTTP_BODY_BYTES} bytes)"
            ))
        } else {
            ApiError::bad_body(format!("the request body: {e}"))
        }
    })
}

pub async fn chat(
    State(front): State<Arc<Front>>,
    Extension(caller): Extension<Tenant>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let job = body_of(body).and_then(|body| chat_job(&front, &body));
    match job.map(|job| bound(job, &headers)) {
        Ok((job, stream)) => respond(front, caller, job, stream, Kind::Chat).await,
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/completions`.
pub async fn completions(
    State(front): State<Arc<Front>>,
    Extension(caller): Extension<Tenant>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let job = body_of(body).and_then(|body| completion_job(&front, &body));
    match job.map(|job| bound(job, &headers)) {
        Ok((job, stream)) => respond(front, caller, job, stream, Kind::Text).await,
        Err(e) => e.into_response(),
    }
}

/// The header that runs a request in the client's own kakeya session.
pub const SESSION_HEADER: &str = "x-inferd-session";

/// Binds the job to the session `x-inferd-session` names, if any (an id
/// that is not one the server holds, or not one of the caller's tenant, is
/// a 404 when the request runs).
fn bound((mut job, stream): (Job, Streaming), headers: &HeaderMap) -> (Job, Streaming) {
    if let Some(value) = headers.get(SESSION_HEADER) {
        let text = value.to_str().unwrap_or_default();
        job.session = Some(crate::runtime::SessionId::parse_or_never_issued(
            text.trim(),
        ));
    }
    (job, stream)
}

/// Whether and how a response streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Streaming {
    Whole,
    /// Server-sent events; `usage_chunk`: the usage in a chunk of its own.
    Events {
        usage_chunk: bool,
    },
}

impl Streaming {
    fn of(s: &Sampling) -> Streaming {
        if !s.stream {
            return Streaming::Whole;
        }
        Streaming::Events {
            usage_chunk: s.stream_options.as_ref().is_some_and(|o| o.include_usage),
        }
    }
}

fn chat_job(front: &Front, body: &Bytes) -> Result<(Job, Streaming), ApiError> {
    let req: ChatRequest = parse(body)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "at least one message is required",
        ));
    }
    if req.messages.len() > MAX_CHAT_MESSAGES {
        return Err(ApiError::invalid(
            "messages",
            format!("{} messages, at most {MAX_CHAT_MESSAGES}", req.messages.len()),
        ));
    }
    let Some(template) = &front.template else {
        return Err(ApiError::invalid(
            "messages",
            "the model has no chat template: use /v1/completions",
        ));
    };
    let messages = req
        .messages
        .iter()
        .map(|m| {
            let content = m.content.as_ref().map(|c| c.text()).transpose()?;
            // OpenAI's newer name for the system role.
            let role = if m.role == "developer" {
                "system"
            } else {
                &m.role
            };
            Ok(Message::new(role, content.unwrap_or_default()))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let text = template
        .render(&messages, true)
        .map_err(|e| ApiError::invalid("messages", format!("the chat template: {e}")))?;
    let prompt = front
        .tokenizer
        .encode(&text, true, true)
        .map_err(|e| ApiError::invalid("messages", format!("tokenizing: {e}")))?;
    let top = match (req.logprobs, req.top_logprobs) {
        (false, Some(n)) if n > 0 => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        (_, top) => top.unwrap_or(0),
    };
    let stream = Streaming::of(&req.sampling);
    let job = job_of(front, req.sampling, prompt, req.logprobs, top, "messages")?;
    Ok((job, stream))
}

fn completion_job(front: &Front, body: &Bytes) -> Result<(Job, Streaming), ApiError> {
    let req: CompletionRequest = parse(body)?;
    if req.echo {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    let one = |n: usize| {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::invalid(
                "prompt",
                format!("{n} prompts: one prompt per request"),
            ))
        }
    };
    let encode = |text: &str| {
        front
            .tokenizer
            .encode(text, true, true)
            .map_err(|e| ApiError::invalid("prompt", format!("tokenizing: {e}")))
    };
    let prompt = match req.prompt {
        Prompt::Text(text) => encode(&text)?,
        Prompt::Texts(texts) => {
            one(texts.len())?;
            encode(&texts[0])?
        }
        Prompt::Tokens(ids) => ids,
        Prompt::TokenLists(mut lists) => {
            one(lists.len())?;
            lists.swap_remove(0)
        }
    };
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= front.vocab) {
        return Err(ApiError::invalid(
            "prompt",
            format!("token {bad} is outside the vocabulary of {}", front.vocab),
        ));
    }
    let top = req.logprobs.unwrap_or(0);
    let stream = Streaming::of(&req.sampling);
    let job = job_of(
        front,
        req.sampling,
        prompt,
        req.logprobs.is_some(),
        top,
        "prompt",
    )?;
    Ok((job, stream))
}

/// The checks both endpoints share, and the job they make.
fn job_of(
    front: &Front,
    s: Sampling,
    prompt: Vec<u32>,
    logprobs: bool,
    top_logprobs: u32,
    prompt_param: &'static str,
) -> Result<Job, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid(prompt_param, "the prompt is empty"));
    }
    if s.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("n", "only n = 1 is supported"));
    }
    let room = front.context.saturating_sub(prompt.len());
    if room == 0 {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(
                prompt_param,
                format!(
                    "the prompt is {} tokens; the model's context is {}",
                    prompt.len(),
                    front.context
                ),
            )
        });
    }
    let asked = s.max_completion_tokens.or(s.max_tokens);
    if asked == Some(0) {
        return Err(ApiError::invalid(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    // Past the context there is nothing to generate: the answer ends there
    // with finish_reason "length".
    let max_tokens = asked.map_or(room, |n| (n as usize).min(room)) as u32;
    let range = |param: &'static str, v: Option<f32>, lo: f32, hi: f32| match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::invalid(
            param,
            format!("{param} is {x}, it must lie in [{lo}, {hi}]"),
        )),
        _ => Ok(v),
    };
    let temperature = range("temperature", s.temperature, 0.0, 2.0)?;
    let top_p = range("top_p", s.top_p, 0.0, 1.0)?;
    if top_p == Some(0.0) {
        return Err(ApiError::invalid("top_p", "top_p must be above 0"));
    }
    let frequency_penalty = range("frequency_penalty", s.frequency_penalty, -2.0, 2.0)?;
    let presence_penalty = range("presence_penalty", s.presence_penalty, -2.0, 2.0)?;
    if top_logprobs as usize > MAX_TOP_LOGPROBS {
        return Err(ApiError::invalid(
            "top_logprobs",
            format!("at most {MAX_TOP_LOGPROBS}"),
        ));
    }
    let bias = s.logit_bias.unwrap_or_default();
    if bias.len() > MAX_OPENAI_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("{} entries, at most {MAX_OPENAI_LOGIT_BIAS}", bias.len()),
        ));
    }
    let logit_bias = bias
        .into_iter()
        .map(|(token, b)| {
            let id: u32 = token
                .parse()
                .ok()
                .filter(|&id: &u32| (id as usize) < front.vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!("{token:?} is not a token id of this model's vocabulary"),
                    )
                })?;
            if !(-100.0..=100.0).contains(&b) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("bias {b} for token {id}: it must lie in [-100, 100]"),
                ));
            }
            Ok((id, b))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let stops = s.stop.map(|s| s.strings()).unwrap_or_default();
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!("{} stop strings, at most {MAX_STOP_STRINGS}", stops.len()),
        ));
    }
    if stops.iter().any(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return Err(ApiError::invalid(
            "stop",
            format!("a stop string is longer than {MAX_STOP_STRING_BYTES} bytes"),
        ));
    }
    let sampling = SamplingOptions {
        // OpenAI's default temperature is 1 (sampling); 0 is greedy.
        temperature: Some(temperature.unwrap_or(1.0)),
        top_p,
        frequency_penalty,
        presence_penalty,
        logit_bias,
        seed: s.seed.map(|seed| seed as u64),
        top_logprobs: if logprobs { top_logprobs } else { 0 },
        ..SamplingOptions::default()
    };
    Ok(Job {
        prompt,
        max_tokens,
        sampling,
        stops,
        logprobs,
        session: None,
    })
}

/// Which endpoint's shapes to answer in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

impl Kind {
    fn id(self) -> String {
        let mut bytes = [0u8; 12];
        let _ = getrandom::getrandom(&mut bytes);
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        match self {
            Kind::Chat => format!("chatcmpl-{hex}"),
            Kind::Text => format!("cmpl-{hex}"),
        }
    }

    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }
}

async fn respond(
    front: Arc<Front>,
    caller: Tenant,
    job: Job,
    stream: Streaming,
    kind: Kind,
) -> Response {
    let logprobs = job.logprobs;
    let rx = completion::start(Arc::clone(&front), caller, job);
    if let Streaming::Events { usage_chunk } = stream {
        return Sse::new(events(front, rx, kind, logprobs, usage_chunk))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    match completion::gather(rx).await {
        Ok(done) => Json(whole(&front, kind, done, logprobs)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A whole answer.
fn whole(front: &Front, kind: Kind, done: Gathered, logprobs: bool) -> Value {
    let choice = match kind {
        Kind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": done.text},
            "logprobs": logprobs.then(|| chat_logprobs(&done.logprobs)),
            "finish_reason": done.finish,
        }),
        Kind::Text => json!({
            "index": 0,
            "text": done.text,
            "logprobs": logprobs.then(|| text_logprobs(&done.logprobs, 0)),
            "finish_reason": done.finish,
        }),
    };
    json!({
        "id": kind.id(),
        "object": kind.object(false),
        "created": now(),
        "model": front.model_id,
        "system_fingerprint": Value::Null,
        "choices": [choice],
        "usage": done.usage,
    })
}

fn chat_logprobs(tokens: &[TokenLogprob]) -> Value {
    json!({ "content": tokens })
}

/// The legacy completions shape: parallel lists, offsets into the text.
fn text_logprobs(tokens: &[TokenLogprob], offset: usize) -> Value {
    let mut at = offset;
    let offsets: Vec<usize> = tokens
        .iter()
        .map(|t| {
            let here = at;
            at += t.token.len();
            here
        })
        .collect();
    json!({
        "tokens": tokens.iter().map(|t| &t.token).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens
            .iter()
            .map(|t| t.top_logprobs.iter().map(|top| (top.token.clone(), json!(top.logprob))).collect::<serde_json::Map<_, _>>())
            .collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A streamed answer: a chunk per piece of text, a last chunk with the
/// finish reason (and the usage, unless `usage_chunk` puts it in a chunk of
/// its own after it), then `[DONE]`; an error mid-stream is sent as an
/// `{"error": ...}` event and ends it.
fn events(
    front: Arc<Front>,
    rx: tokio::sync::mpsc::Receiver<Piece>,
    kind: Kind,
    logprobs: bool,
    usage_chunk: bool,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let id = kind.id();
    let created = now();
    let chunk = move |choices: Value, usage: Option<&Usage>| {
        let mut body = json!({
            "id": id,
            "object": kind.object(true),
            "created": created,
            "model": front.model_id,
            "system_fingerprint": Value::Null,
            "choices": choices,
        });
        if let Some(usage) = usage {
            body["usage"] = json!(usage);
        }
        Event::default().data(body.to_string())
    };
    let first = (kind == Kind::Chat).then(|| {
        chunk(
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": Value::Null, "finish_reason": Value::Null}]),
            None,
        )
    });
    let mut text_offset = 0usize;
    let pieces = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|p| (p, rx)) });
    let body = pieces
        .flat_map(move |piece| {
            let out: Vec<Event> = match piece {
                Piece::Text { text, logprobs: lps } => {
                    let choice = match kind {
                        Kind::Chat => json!({
                            "index": 0,
                            "delta": {"content": text},
                            "logprobs": logprobs.then(|| chat_logprobs(&lps)),
                            "finish_reason": Value::Null,
                        }),
                        Kind::Text => {
                            let lp = logprobs.then(|| text_logprobs(&lps, text_offset));
                            text_offset += text.len();
                            json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": Value::Null})
                        }
                    };
                    vec![chunk(json!([choice]), None)]
                }
                Piece::Done { finish, usage } => {
                    let last = match kind {
                        Kind::Chat => json!({"index": 0, "delta": {}, "logprobs": Value::Null, "finish_reason": finish}),
                        Kind::Text => json!({"index": 0, "text": "", "logprobs": Value::Null, "finish_reason": finish}),
                    };
                    if usage_chunk {
                        vec![
                            chunk(json!([last]), None),
                            chunk(json!([]), Some(&usage)),
                            Event::default().data("[DONE]"),
                        ]
                    } else {
                        vec![
                            chunk(json!([last]), Some(&usage)),
                            Event::default().data("[DONE]"),
                        ]
                    }
                }
                Piece::Failed(e) => vec![Event::default().data(json!(e.body()).to_string())],
            };
            stream::iter(out)
        })
        .map(Ok);
    stream::iter(first.map(Ok)).chain(body)
}
