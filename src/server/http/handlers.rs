//! The handlers of the HTTP routes: each request read, converted into the
//! runtime's request (a [`Job`]), and answered whole or as a stream.
//!
//! The routes: `POST /v1/chat/completions` (the conversation rendered with
//! the model's chat template), `POST /v1/completions` (a prompt as text or
//! token ids), `GET /v1/models`, each answering whole or, with `stream:
//! true`, as server-sent events (`data: {...}` chunks, then `data:
//! [DONE]`). Every answer carries the usage counts: a streamed one in a
//! last chunk with no choices when `stream_options.include_usage` asks for
//! it (as OpenAI sends it), otherwise on the chunk that says why it
//! finished, so that every chunk of such a stream has a choice.
//!
//! A request's arguments are checked before anything changes: by the
//! runtime's own checks where it has them (the ones its admission runs),
//! here only for what OpenAI alone has (see `job_of`).

use std::collections::BTreeMap;
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

use super::completion::{self, Job, Piece};
use super::openai::{ApiError, ChatRequest, CompletionRequest, Prompt, Sampling};
use super::responses::{error_event, Chunks, Head, Kind, ModelList, Whole};
use super::tools::{finish_reason, ReplyFilter};
use super::Front;
use crate::runtime::limits::{
    MAX_CHAT_MESSAGES, MAX_HTTP_BODY_BYTES, MAX_OPENAI_LOGIT_BIAS, MAX_STOP_STRINGS,
    MAX_STOP_STRING_BYTES,
};
use crate::runtime::{AppendTokens, GenerateRequest, SamplingOptions, SessionId, Tenant};

/// `GET /v1/models`: the one model this server runs.
pub async fn models(State(front): State<Arc<Front>>) -> Response {
    Json(ModelList::one(&front.model_id, front.created)).into_response()
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_body(format!("the request body: {e}")))
}

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

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(front): State<Arc<Front>>,
    Extension(caller): Extension<Tenant>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let job = off_the_loop(&front, body, chat_job).await;
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
    let job = off_the_loop(&front, body, completion_job).await;
    match job.map(|job| bound(job, &headers)) {
        Ok((job, stream)) => respond(front, caller, job, stream, Kind::Text).await,
        Err(e) => e.into_response(),
    }
}

/// A request made into a job, or why it cannot run.
type Prepared = Result<(Job, Streaming), ApiError>;

/// A request made into a job on a blocking thread: tokenizing a long
/// prompt and compiling a constraint (up to 2 s) must not hold up the
/// threads that stream every other answer.
async fn off_the_loop(
    front: &Arc<Front>,
    body: Result<Bytes, BytesRejection>,
    make: fn(&Front, &Bytes) -> Prepared,
) -> Prepared {
    let body = body_of(body)?;
    let front = Arc::clone(front);
    tokio::task::spawn_blocking(move || make(&front, &body))
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::from(crate::runtime::RuntimeError::Internal(
                format!("preparing the request: {e}"),
            )))
        })
}

/// The header that runs a request in the client's own kakeya session.
pub const SESSION_HEADER: &str = "x-inferd-session";

/// Binds the job to the session `x-inferd-session` names, if any (an id
/// that is not one the server holds, or not one of the caller's tenant, is
/// a 404 when the request runs).
fn bound((mut job, stream): (Job, Streaming), headers: &HeaderMap) -> (Job, Streaming) {
    if let Some(value) = headers.get(SESSION_HEADER) {
        let text = value.to_str().unwrap_or_default();
        job.session = Some(SessionId::parse_or_never_issued(text.trim()));
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

/// A chat request as a job. Its own checks are the chat's: the messages
/// (their number bounded here, as the runtime only ever sees the tokens
/// they render to), the template, and `top_logprobs` without `logprobs`
/// (the runtime has the one count, 0 for none).
fn chat_job(front: &Front, body: &Bytes) -> Prepared {
    let mut req: ChatRequest = parse(body)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "at least one message is required",
        ));
    }
    if req.messages.len() > MAX_CHAT_MESSAGES {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "{} messages, at most {MAX_CHAT_MESSAGES}",
                req.messages.len()
            ),
        ));
    }
    let Some(template) = &front.template else {
        return Err(ApiError::invalid(
            "messages",
            "the model has no chat template: use /v1/completions",
        ));
    };
    let plan = super::tools::ToolPlan::new(front, &req)?;
    let input = &plan.input;
    let text = template
        .render_with_tools(&input.messages, input.tools.as_ref(), true)
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
    let asked = super::format::Asked::take(&mut req.sampling);
    let mut job = job_of(
        req.sampling,
        prompt,
        req.logprobs,
        top,
        "messages",
        Model::of(front),
    )?;
    job.generate.constraint = plan.constraint(front, asked)?;
    job.tools = plan.reply(front);
    Ok((job, stream))
}

/// A completions request as a job. Its own checks are OpenAI's fields the
/// runtime has no counterpart of: `echo` (unsupported) and a list of
/// prompts (one per request).
fn completion_job(front: &Front, body: &Bytes) -> Prepared {
    let mut req: CompletionRequest = parse(body)?;
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
    let top = req.logprobs.unwrap_or(0);
    let stream = Streaming::of(&req.sampling);
    let asked = super::format::Asked::take(&mut req.sampling);
    let mut job = job_of(
        req.sampling,
        prompt,
        req.logprobs.is_some(),
        top,
        "prompt",
        Model::of(front),
    )?;
    job.generate.constraint = super::format::constraint(asked, front)?;
    Ok((job, stream))
}

/// The job both endpoints make: the request's prompt and sampling fields
/// as the runtime's request, checked before anything changes (a 400
/// naming the field). The runtime's own checks decide whatever they cover
/// ([`AppendTokens::check_tokens`] on the prompt and
/// [`GenerateRequest::check`] on the rest: the checks its admission runs,
/// run here first because the request's session is created before its
/// Generate is admitted); the checks here are only those with no runtime
/// counterpart, each saying why it is here.
fn job_of(
    s: Sampling,
    prompt: Vec<u32>,
    logprobs: bool,
    top_logprobs: u32,
    prompt_param: &'static str,
    model: Model,
) -> Result<Job, ApiError> {
    // The runtime refuses to generate from an empty history only once the
    // request's session exists.
    if prompt.is_empty() {
        return Err(ApiError::invalid(prompt_param, "the prompt is empty"));
    }
    // OpenAI's `n`: the runtime generates one continuation per call.
    if s.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("n", "only n = 1 is supported"));
    }
    let room = model.room(prompt.len(), prompt_param)?;
    // The prompt's tokens: the runtime's check of an append.
    AppendTokens::check_tokens(&prompt, model.vocab).map_err(|e| ApiError {
        param: Some(prompt_param),
        ..ApiError::from(e)
    })?;
    // `max_completion_tokens` is OpenAI's newer name for `max_tokens`.
    // Past the context there is nothing to generate: the answer ends there
    // with finish_reason "length". (0 is the runtime's to refuse.)
    let asked = s.max_completion_tokens.or(s.max_tokens);
    let max_tokens = asked.map_or(room, |n| (n as usize).min(room)) as u32;
    check_openai_ranges(&s)?;
    let logit_bias = logit_bias(s.logit_bias.unwrap_or_default())?;
    let stops = s.stop.map(|s| s.strings()).unwrap_or_default();
    check_stops(&stops)?;
    let generate = GenerateRequest {
        constraint: None,
        speculate: s.speculate,
        // The request's session, once there is one.
        id: SessionId::NEVER_ISSUED,
        max_tokens,
        sampling: SamplingOptions {
            // OpenAI's default temperature is 1 (sampling); 0 is greedy.
            temperature: Some(s.temperature.unwrap_or(1.0)),
            top_p: s.top_p,
            frequency_penalty: s.frequency_penalty,
            presence_penalty: s.presence_penalty,
            logit_bias,
            seed: s.seed.map(|seed| seed as u64),
            top_logprobs: if logprobs { top_logprobs } else { 0 },
            ..SamplingOptions::default()
        },
        // Stop strings are text, matched on the text (`StopText`).
        stop_sequences: Vec::new(),
    };
    generate.check(model.vocab)?;
    Ok(Job {
        prompt,
        generate,
        stops,
        logprobs,
        session: None,
        tools: None,
    })
}

/// What [`job_of`] needs of the model.
#[derive(Clone, Copy, Debug)]
struct Model {
    vocab: usize,
    context: usize,
}

impl Model {
    fn of(front: &Front) -> Model {
        Model {
            vocab: front.vocab,
            context: front.context,
        }
    }

    /// What the context leaves after a prompt of `len` tokens. The runtime
    /// would truncate a history that outgrows the context; OpenAI refuses
    /// the prompt with `context_length_exceeded`.
    fn room(self, len: usize, prompt_param: &'static str) -> Result<usize, ApiError> {
        match self.context.saturating_sub(len) {
            0 => Err(ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid(
                    prompt_param,
                    format!(
                        "the prompt is {len} tokens; the model's context is {}",
                        self.context
                    ),
                )
            }),
            room => Ok(room),
        }
    }
}

/// OpenAI's ranges where they are narrower than the runtime's, which
/// refuses only what cannot be sampled with (a negative temperature, a
/// penalty that is not finite): `temperature` at most 2, the penalties in
/// [-2, 2].
fn check_openai_ranges(s: &Sampling) -> Result<(), ApiError> {
    if let Some(t) = s.temperature.filter(|&t| t > 2.0) {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature is {t}, it must lie in [0, 2]"),
        ));
    }
    for (param, v) in [
        ("frequency_penalty", s.frequency_penalty),
        ("presence_penalty", s.presence_penalty),
    ] {
        if let Some(x) = v.filter(|x| !(-2.0..=2.0).contains(x)) {
            return Err(ApiError::invalid(
                param,
                format!("{param} is {x}, it must lie in [-2, 2]"),
            ));
        }
    }
    Ok(())
}

/// `logit_bias` as the runtime takes it: OpenAI's keys are JSON strings
/// (one that is not a token id is a shape only JSON has), OpenAI allows
/// [`MAX_OPENAI_LOGIT_BIAS`] entries of biases in [-100, 100] (narrower
/// than the runtime's bounds); whether each token is in the vocabulary is
/// the runtime's check.
fn logit_bias(bias: BTreeMap<String, f32>) -> Result<Vec<(u32, f32)>, ApiError> {
    if bias.len() > MAX_OPENAI_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("{} entries, at most {MAX_OPENAI_LOGIT_BIAS}", bias.len()),
        ));
    }
    bias.into_iter()
        .map(|(token, b)| {
            let id: u32 = token.parse().map_err(|_| {
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
        .collect()
}

/// OpenAI's `stop` strings are text, matched by the front door on the
/// generated text; the runtime never sees them, so their bounds are
/// checked here.
fn check_stops(stops: &[String]) -> Result<(), ApiError> {
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
    Ok(())
}

async fn respond(
    front: Arc<Front>,
    caller: Tenant,
    job: Job,
    stream: Streaming,
    kind: Kind,
) -> Response {
    let logprobs = job.logprobs;
    let filter = job.tools.as_ref().map(ReplyFilter::new);
    let rx = completion::start(Arc::clone(&front), caller, job);
    if let Streaming::Events { usage_chunk } = stream {
        return Sse::new(events(front, rx, kind, logprobs, usage_chunk, filter))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    match completion::gather(rx).await {
        Ok(mut done) => {
            let id = kind.id();
            let head = Head {
                kind,
                id: &id,
                created: now(),
                model: &front.model_id,
            };
            let mut calls = Vec::new();
            if let Some(filter) = filter {
                (done.text, calls) = filter.whole(&done.text);
                done.finish = finish_reason(done.finish, &calls);
            }
            let lps = logprobs.then_some(done.logprobs.as_slice());
            Json(Whole::new(
                head,
                &done.text,
                &calls,
                lps,
                done.finish,
                &done.usage,
            ))
            .into_response()
        }
        Err(e) => e.into_response(),
    }
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
    mut filter: Option<ReplyFilter>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let answer = Streamed {
        id: kind.id(),
        created: now(),
        kind,
        logprobs,
        front,
    };
    let first = (kind == Kind::Chat).then(|| answer.chunks().role());
    // Where the next piece begins in the answer's text (the legacy
    // completions' `text_offset`).
    let mut text_offset = 0usize;
    let pieces = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|p| (p, rx)) });
    let body = pieces.flat_map(move |piece| {
        let chunks = answer.chunks();
        let mut out = Vec::new();
        // With tools, text is shown as the filter lets it through, and the
        // calls go out before the finishing chunk.
        let piece = match piece {
            Piece::Text { text, logprobs } => match filter.as_mut() {
                Some(f) => match f.push(&text, logprobs) {
                    Some((text, logprobs)) => Piece::Text { text, logprobs },
                    None => return stream::iter(out),
                },
                None => Piece::Text { text, logprobs },
            },
            Piece::Done { finish, usage } => match filter.take() {
                Some(f) => {
                    let (text, logprobs, calls) = f.finish();
                    if !text.is_empty() || !logprobs.is_empty() {
                        out.push(chunks.piece(&text, &logprobs, text_offset));
                    }
                    if !calls.is_empty() {
                        out.push(chunks.tool_calls(&calls));
                    }
                    let finish = finish_reason(finish, &calls);
                    Piece::Done { finish, usage }
                }
                None => Piece::Done { finish, usage },
            },
            failed => failed,
        };
        out.extend(match piece {
            Piece::Text { text, logprobs } => {
                let data = chunks.piece(&text, &logprobs, text_offset);
                text_offset += text.len();
                vec![data]
            }
            Piece::Done { finish, usage } if usage_chunk => vec![
                chunks.finish(finish, None),
                chunks.usage(&usage),
                "[DONE]".into(),
            ],
            Piece::Done { finish, usage } => {
                vec![chunks.finish(finish, Some(&usage)), "[DONE]".into()]
            }
            Piece::Failed(e) => vec![error_event(&e)],
        });
        stream::iter(out)
    });
    stream::iter(first)
        .chain(body)
        .map(|data| Ok(Event::default().data(data)))
}

/// What every chunk of one streamed answer names, held by the stream.
struct Streamed {
    front: Arc<Front>,
    kind: Kind,
    id: String,
    created: u64,
    logprobs: bool,
}

impl Streamed {
    fn chunks(&self) -> Chunks<'_> {
        Chunks {
            head: Head {
                kind: self.kind,
                id: &self.id,
                created: self.created,
                model: &self.front.model_id,
            },
            logprobs: self.logprobs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::limits::MAX_TOP_LOGPROBS;

    const MODEL: Model = Model {
        vocab: 320,
        context: 64,
    };

    fn sampling(json: &str) -> Sampling {
        serde_json::from_str(json).expect("sampling JSON")
    }

    fn job(json: &str, prompt: &[u32], top_logprobs: u32) -> Result<Job, ApiError> {
        job_of(
            sampling(json),
            prompt.to_vec(),
            top_logprobs > 0,
            top_logprobs,
            "prompt",
            MODEL,
        )
    }

    /// The sampling fields (JSON), the prompt, `top_logprobs`; the `param`
    /// and `code` of the 400.
    type Case = (
        &'static str,
        &'static [u32],
        u32,
        &'static str,
        Option<&'static str>,
    );

    /// Each bad argument is a 400 naming its field, whichever side checks
    /// it: the front door (OpenAI's own rules) or the runtime's check.
    #[test]
    fn every_bad_argument_is_a_400_naming_its_field() {
        let runtime = Some("invalid_value");
        let cases: [Case; 17] = [
            (r#"{}"#, &[], 0, "prompt", None),
            (r#"{"n": 2}"#, &[1], 0, "n", None),
            (
                r#"{}"#,
                &[1; 64],
                0,
                "prompt",
                Some("context_length_exceeded"),
            ),
            (r#"{}"#, &[1, 320], 0, "prompt", runtime),
            (r#"{"max_tokens": 0}"#, &[1], 0, "max_tokens", runtime),
            (
                r#"{"max_completion_tokens": 0, "max_tokens": 5}"#,
                &[1],
                0,
                "max_tokens",
                runtime,
            ),
            (r#"{"temperature": 2.5}"#, &[1], 0, "temperature", None),
            (r#"{"temperature": -0.5}"#, &[1], 0, "temperature", runtime),
            (r#"{"top_p": 0}"#, &[1], 0, "top_p", runtime),
            (r#"{"top_p": 1.5}"#, &[1], 0, "top_p", runtime),
            (
                r#"{"presence_penalty": 3}"#,
                &[1],
                0,
                "presence_penalty",
                None,
            ),
            (
                r#"{"frequency_penalty": -3}"#,
                &[1],
                0,
                "frequency_penalty",
                None,
            ),
            (r#"{}"#, &[1], 21, "top_logprobs", runtime),
            (r#"{"logit_bias": {"x": 1}}"#, &[1], 0, "logit_bias", None),
            (r#"{"logit_bias": {"5": 101}}"#, &[1], 0, "logit_bias", None),
            (
                r#"{"logit_bias": {"320": 1}}"#,
                &[1],
                0,
                "logit_bias",
                runtime,
            ),
            (
                r#"{"stop": ["a", "b", "c", "d", "e"]}"#,
                &[1],
                0,
                "stop",
                None,
            ),
        ];
        for (json, prompt, top, param, code) in cases {
            let err = job(json, prompt, top).expect_err(json);
            assert_eq!(err.status, axum::http::StatusCode::BAD_REQUEST, "{json}");
            assert_eq!(err.kind, "invalid_request_error", "{json}");
            assert_eq!(err.param, Some(param), "{json}: {}", err.message);
            assert_eq!(err.code, code, "{json}: {}", err.message);
        }
    }

    #[test]
    fn the_bounds_themselves_pass_and_one_more_is_refused() {
        let bias = |n: usize| {
            let entries: Vec<String> = (0..n).map(|i| format!("\"{i}\": 1")).collect();
            format!(r#"{{"logit_bias": {{{}}}}}"#, entries.join(","))
        };
        let stops = |n: usize, bytes: usize| {
            let one = format!("\"{}\"", "x".repeat(bytes));
            format!(r#"{{"stop": [{}]}}"#, vec![one; n].join(","))
        };
        let top = MAX_TOP_LOGPROBS as u32;
        let fine = [
            (bias(MAX_OPENAI_LOGIT_BIAS), 0),
            (stops(MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES), 0),
            ("{}".to_string(), top),
        ];
        for (json, top) in &fine {
            assert!(job(json, &[1], *top).is_ok(), "{json}");
        }
        let refused = [
            (bias(MAX_OPENAI_LOGIT_BIAS + 1), 0),
            (stops(MAX_STOP_STRINGS + 1, 1), 0),
            (stops(1, MAX_STOP_STRING_BYTES + 1), 0),
            ("{}".to_string(), top + 1),
        ];
        for (json, top) in &refused {
            assert!(job(json, &[1], *top).is_err(), "{json}");
        }
    }

    /// What a request asks, as the runtime's request: OpenAI's defaults,
    /// `max_tokens` capped at the context's room, the newer name first.
    #[test]
    fn a_request_becomes_the_runtimes_request() {
        let got = job(r#"{}"#, &[1, 2, 3, 4], 0).expect("a job");
        assert_eq!(got.generate.max_tokens, 60);
        assert_eq!(got.generate.sampling.temperature, Some(1.0));
        assert!(got.generate.stop_sequences.is_empty());
        let got = job(
            r#"{"max_tokens": 100, "max_completion_tokens": 7, "temperature": 0,
                "top_p": 0.9, "seed": 5, "logit_bias": {"9": -100}, "stop": "END"}"#,
            &[1],
            3,
        )
        .expect("a job");
        assert_eq!(got.generate.max_tokens, 7);
        let want = SamplingOptions {
            temperature: Some(0.0),
            top_p: Some(0.9),
            logit_bias: vec![(9, -100.0)],
            seed: Some(5),
            top_logprobs: 3,
            ..SamplingOptions::default()
        };
        assert_eq!(got.generate.sampling, want);
        assert_eq!(got.stops, vec!["END".to_string()]);
        assert!(got.logprobs);
        let long = job(r#"{"max_tokens": 1000}"#, &[1; 60], 0).expect("a job");
        assert_eq!(long.generate.max_tokens, 4);
    }
}
