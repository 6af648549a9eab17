//! The JSON bodies the HTTP front door answers with, as typed serde
//! structs: the model list, whole chat and text completions, their
//! streamed chunks, and the usage and log-probabilities they carry.
//!
//! The bytes are those the API has always sent: each struct declares its
//! fields in alphabetical order (the order serde_json's maps wrote them
//! in), a field the API sends as `null` is an `Option` that is serialized
//! (`logprobs`, `finish_reason`, `system_fingerprint`), only what a body
//! leaves out is skipped, and a log-probability is written widened to f64
//! (the same f32 read back). The tests pin each body.

use std::collections::BTreeMap;

use serde::{Serialize, Serializer};

use super::openai::ApiError;

/// Which endpoint's shapes to answer in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Text,
}

impl Kind {
    /// A fresh response id (`chatcmpl-…`, `cmpl-…`: 24 random hex digits).
    pub fn id(self) -> String {
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

/// `GET /v1/models`: the one model this server runs.
#[derive(Debug, Serialize)]
pub struct ModelList<'a> {
    pub data: Vec<ModelCard<'a>>,
    pub object: &'static str,
}

#[derive(Debug, Serialize)]
pub struct ModelCard<'a> {
    pub created: u64,
    pub id: &'a str,
    pub object: &'static str,
    pub owned_by: &'static str,
}

impl ModelList<'_> {
    pub fn one(id: &str, created: u64) -> ModelList<'_> {
        ModelList {
            data: vec![ModelCard {
                created,
                id,
                object: "model",
                owned_by: "inferd",
            }],
            object: "list",
        }
    }
}

/// A whole completion or one chunk of a streamed one, of either endpoint;
/// `C` is the shape of its choices.
#[derive(Debug, Serialize)]
pub struct Completion<'a, C> {
    pub choices: Vec<C>,
    pub created: u64,
    pub id: &'a str,
    pub model: &'a str,
    pub object: &'static str,
    /// Always `null`: no fingerprint is named.
    pub system_fingerprint: Option<&'a str>,
    /// A whole completion's always; only the chunk that carries it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<&'a Usage>,
}

/// What every body of one response shares.
#[derive(Clone, Copy, Debug)]
pub struct Head<'a> {
    pub kind: Kind,
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
}

impl<'a> Head<'a> {
    fn body<C>(self, chunk: bool, choices: Vec<C>, usage: Option<&'a Usage>) -> Completion<'a, C> {
        Completion {
            choices,
            created: self.created,
            id: self.id,
            model: self.model,
            object: self.kind.object(chunk),
            system_fingerprint: None,
            usage,
        }
    }
}

/// A whole answer, in its endpoint's shape.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Whole<'a> {
    Chat(Completion<'a, ChatChoice<'a>>),
    Text(Completion<'a, TextChoice<'a>>),
}

impl<'a> Whole<'a> {
    /// The answer `text`, with the log-probabilities of its tokens when
    /// they were asked for.
    pub fn new(
        head: Head<'a>,
        text: &'a str,
        calls: &'a [crate::tools::ToolCall],
        logprobs: Option<&'a [TokenLogprob]>,
        finish: FinishReason,
        usage: &'a Usage,
    ) -> Whole<'a> {
        match head.kind {
            Kind::Chat => Whole::Chat(head.body(
                false,
                vec![ChatChoice {
                    finish_reason: finish,
                    index: 0,
                    logprobs: logprobs.map(|content| ChatLogprobs { content }),
                    message: ChatMessage {
                        content: (calls.is_empty() || !text.is_empty()).then_some(text),
                        role: "assistant",
                        tool_calls: (!calls.is_empty()).then(|| ToolCallOut::list(calls, false)),
                    },
                }],
                Some(usage),
            )),
            Kind::Text => Whole::Text(head.body(
                false,
                vec![TextChoice {
                    finish_reason: Some(finish),
                    index: 0,
                    logprobs: logprobs.map(|tokens| TextLogprobs::new(tokens, 0)),
                    text,
                }],
                Some(usage),
            )),
        }
    }
}

/// The choice of a whole chat completion.
#[derive(Debug, Serialize)]
pub struct ChatChoice<'a> {
    pub finish_reason: FinishReason,
    pub index: u32,
    pub logprobs: Option<ChatLogprobs<'a>>,
    pub message: ChatMessage<'a>,
}

#[derive(Debug, Serialize)]
pub struct ChatMessage<'a> {
    /// None (`null`) when the reply is only tool calls.
    pub content: Option<&'a str>,
    pub role: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut<'a>>>,
}

/// A call in a reply: whole, or (with its `index`) in a chunk's delta,
/// which carries each call whole.
#[derive(Debug, Serialize)]
pub struct ToolCallOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    pub id: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionOut<'a>,
}

#[derive(Debug, Serialize)]
pub struct FunctionOut<'a> {
    pub name: &'a str,
    pub arguments: &'a str,
}

impl<'a> ToolCallOut<'a> {
    /// `calls` in OpenAI's shape; numbered for a chunk when `indexed`.
    pub fn list(calls: &'a [crate::tools::ToolCall], indexed: bool) -> Vec<ToolCallOut<'a>> {
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| ToolCallOut {
                index: indexed.then_some(i),
                id: &c.id,
                kind: "function",
                function: FunctionOut {
                    name: &c.name,
                    arguments: &c.arguments,
                },
            })
            .collect()
    }
}

/// The choice of a chat completion chunk.
#[derive(Debug, Serialize)]
pub struct ChatChunkChoice<'a> {
    pub delta: Delta<'a>,
    pub finish_reason: Option<FinishReason>,
    pub index: u32,
    pub logprobs: Option<ChatLogprobs<'a>>,
}

/// What a chat chunk adds: the role (first chunk), text, or nothing (the
/// finishing chunk: `{}`).
#[derive(Debug, Default, Serialize)]
pub struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut<'a>>>,
}

/// Chat log-probabilities: one entry per token.
#[derive(Debug, Serialize)]
pub struct ChatLogprobs<'a> {
    pub content: &'a [TokenLogprob],
}

/// The choice of a text completion, whole or a chunk (whose
/// `finish_reason` is `null` until the last).
#[derive(Debug, Serialize)]
pub struct TextChoice<'a> {
    pub finish_reason: Option<FinishReason>,
    pub index: u32,
    pub logprobs: Option<TextLogprobs<'a>>,
    pub text: &'a str,
}

/// The legacy completions shape of log-probabilities: parallel lists,
/// offsets into the text.
#[derive(Debug, Serialize)]
pub struct TextLogprobs<'a> {
    pub text_offset: Vec<usize>,
    pub token_logprobs: Vec<Widened>,
    pub tokens: Vec<&'a str>,
    /// Per token, its alternatives by text (tokens that read the same
    /// keep one entry).
    pub top_logprobs: Vec<BTreeMap<&'a str, Widened>>,
}

impl<'a> TextLogprobs<'a> {
    /// `tokens`, the first of which begins at byte `offset` of the text.
    pub fn new(tokens: &'a [TokenLogprob], offset: usize) -> TextLogprobs<'a> {
        let mut at = offset;
        let text_offset = tokens
            .iter()
            .map(|t| {
                let here = at;
                at += t.token.len();
                here
            })
            .collect();
        TextLogprobs {
            text_offset,
            token_logprobs: tokens.iter().map(|t| Widened(t.logprob)).collect(),
            tokens: tokens.iter().map(|t| t.token.as_str()).collect(),
            top_logprobs: tokens
                .iter()
                .map(|t| {
                    t.top_logprobs
                        .iter()
                        .map(|top| (top.token.as_str(), Widened(top.logprob)))
                        .collect()
                })
                .collect(),
        }
    }
}

/// The bodies of one streamed answer, each the `data` of one server-sent
/// event.
#[derive(Clone, Copy, Debug)]
pub struct Chunks<'a> {
    pub head: Head<'a>,
    /// Whether the log-probabilities were asked for.
    pub logprobs: bool,
}

impl Chunks<'_> {
    fn json<C: Serialize>(&self, choices: Vec<C>, usage: Option<&Usage>) -> String {
        // Plain data: serializing it cannot fail.
        serde_json::to_string(&self.head.body(true, choices, usage)).unwrap_or_default()
    }

    /// Chat's first chunk: the assistant's role and no text.
    pub fn role(&self) -> String {
        let delta = Delta {
            content: Some(""),
            role: Some("assistant"),
            tool_calls: None,
        };
        self.json(vec![chat_chunk(delta, None, None)], None)
    }

    /// A piece of text, from byte `offset` of the answer.
    pub fn piece(&self, text: &str, logprobs: &[TokenLogprob], offset: usize) -> String {
        let logprobs = self.logprobs.then_some(logprobs);
        match self.head.kind {
            Kind::Chat => {
                let delta = Delta {
                    content: Some(text),
                    role: None,
                    tool_calls: None,
                };
                let logprobs = logprobs.map(|content| ChatLogprobs { content });
                self.json(vec![chat_chunk(delta, logprobs, None)], None)
            }
            Kind::Text => {
                let logprobs = logprobs.map(|tokens| TextLogprobs::new(tokens, offset));
                self.json(vec![text_chunk(text, logprobs, None)], None)
            }
        }
    }

    /// A chat chunk with the reply's tool calls, each whole.
    pub fn tool_calls(&self, calls: &[crate::tools::ToolCall]) -> String {
        let delta = Delta {
            tool_calls: Some(ToolCallOut::list(calls, true)),
            ..Delta::default()
        };
        self.json(vec![chat_chunk(delta, None, None)], None)
    }

    /// The chunk that says why the answer finished, carrying `usage` when
    /// it is given.
    pub fn finish(&self, finish: FinishReason, usage: Option<&Usage>) -> String {
        match self.head.kind {
            Kind::Chat => self.json(
                vec![chat_chunk(Delta::default(), None, Some(finish))],
                usage,
            ),
            Kind::Text => self.json(vec![text_chunk("", None, Some(finish))], usage),
        }
    }

    /// The usage in a chunk of its own, with no choices.
    pub fn usage(&self, usage: &Usage) -> String {
        self.json(Vec::<TextChoice>::new(), Some(usage))
    }
}

fn chat_chunk<'a>(
    delta: Delta<'a>,
    logprobs: Option<ChatLogprobs<'a>>,
    finish_reason: Option<FinishReason>,
) -> ChatChunkChoice<'a> {
    ChatChunkChoice {
        delta,
        finish_reason,
        index: 0,
        logprobs,
    }
}

fn text_chunk<'a>(
    text: &'a str,
    logprobs: Option<TextLogprobs<'a>>,
    finish_reason: Option<FinishReason>,
) -> TextChoice<'a> {
    TextChoice {
        finish_reason,
        index: 0,
        logprobs,
        text,
    }
}

/// Why a choice ended, as OpenAI names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
    /// The reply called tools.
    ToolCalls,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub completion_tokens: u64,
    pub prompt_tokens: u64,
    pub prompt_tokens_details: PromptDetails,
    pub total_tokens: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PromptDetails {
    /// Prompt tokens whose KV was mapped, not computed (or a bound
    /// session's history).
    pub cached_tokens: u64,
}

impl Usage {
    pub fn new(prompt: u64, completion: u64, cached: u64) -> Usage {
        Usage {
            completion_tokens: completion,
            prompt_tokens: prompt,
            prompt_tokens_details: PromptDetails {
                cached_tokens: cached,
            },
            total_tokens: prompt + completion,
        }
    }
}

/// A generated token's log-probability, with its most likely alternatives.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub bytes: Vec<u8>,
    #[serde(serialize_with = "widened")]
    pub logprob: f32,
    pub token: String,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TopLogprob {
    pub bytes: Vec<u8>,
    #[serde(serialize_with = "widened")]
    pub logprob: f32,
    pub token: String,
}

/// An f32 log-probability, written as the f64 it widens to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Widened(pub f32);

impl Serialize for Widened {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        widened(&self.0, s)
    }
}

fn widened<S: Serializer>(x: &f32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(f64::from(*x))
}

/// An error after the stream began: the error's body as one event, its
/// keys sorted (through a JSON map) as this event has always had them;
/// the error response's body keeps its declared order.
pub fn error_event(error: &ApiError) -> String {
    // Plain data: serializing it cannot fail.
    serde_json::to_value(error.body())
        .unwrap_or_default()
        .to_string()
}

#[cfg(test)]
mod tests {
    //! Each body against the JSON the API sent before its bodies were
    //! typed (built then with `serde_json::json!`), byte for byte.

    use super::*;

    fn head(kind: Kind) -> Head<'static> {
        Head {
            kind,
            id: match kind {
                Kind::Chat => "chatcmpl-0123",
                Kind::Text => "cmpl-0123",
            },
            created: 1_700_000_000,
            model: "SmolLM2",
        }
    }

    fn top(token: &str, logprob: f32) -> TopLogprob {
        TopLogprob {
            bytes: token.as_bytes().to_vec(),
            logprob,
            token: token.into(),
        }
    }

    /// "Hi" then "!", each with two alternatives.
    fn tokens() -> Vec<TokenLogprob> {
        vec![
            TokenLogprob {
                bytes: b"Hi".to_vec(),
                logprob: -0.1,
                token: "Hi".into(),
                top_logprobs: vec![top("Hi", -0.1), top("Hello", -2.5)],
            },
            TokenLogprob {
                bytes: b"!".to_vec(),
                logprob: -0.75,
                token: "!".into(),
                top_logprobs: vec![top("!", -0.75), top(".", -1.3)],
            },
        ]
    }

    fn json<T: Serialize>(body: &T) -> String {
        serde_json::to_string(body).expect("JSON")
    }

    fn chunks(kind: Kind, logprobs: bool) -> Chunks<'static> {
        Chunks {
            head: head(kind),
            logprobs,
        }
    }

    #[test]
    fn the_model_list() {
        assert_eq!(
            json(&ModelList::one("SmolLM2", 1_700_000_000)),
            r#"{"data":[{"created":1700000000,"id":"SmolLM2","object":"model","owned_by":"inferd"}],"object":"list"}"#
        );
    }

    #[test]
    fn whole_chat_completions() {
        let (tokens, usage) = (tokens(), Usage::new(9, 3, 4));
        let chat = head(Kind::Chat);
        assert_eq!(
            json(&Whole::new(
                chat,
                "Hi!",
                &[],
                Some(&tokens),
                FinishReason::Stop,
                &usage
            )),
            r#"{"choices":[{"finish_reason":"stop","index":0,"logprobs":{"content":[{"bytes":[72,105],"logprob":-0.10000000149011612,"token":"Hi","top_logprobs":[{"bytes":[72,105],"logprob":-0.10000000149011612,"token":"Hi"},{"bytes":[72,101,108,108,111],"logprob":-2.5,"token":"Hello"}]},{"bytes":[33],"logprob":-0.75,"token":"!","top_logprobs":[{"bytes":[33],"logprob":-0.75,"token":"!"},{"bytes":[46],"logprob":-1.2999999523162842,"token":"."}]}]},"message":{"content":"Hi!","role":"assistant"}}],"created":1700000000,"id":"chatcmpl-0123","model":"SmolLM2","object":"chat.completion","system_fingerprint":null,"usage":{"completion_tokens":3,"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4},"total_tokens":12}}"#
        );
        assert_eq!(
            json(&Whole::new(
                chat,
                "Hi!",
                &[],
                None,
                FinishReason::Length,
                &usage
            )),
            r#"{"choices":[{"finish_reason":"length","index":0,"logprobs":null,"message":{"content":"Hi!","role":"assistant"}}],"created":1700000000,"id":"chatcmpl-0123","model":"SmolLM2","object":"chat.completion","system_fingerprint":null,"usage":{"completion_tokens":3,"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4},"total_tokens":12}}"#
        );
    }

    #[test]
    fn whole_text_completions() {
        let (tokens, usage) = (tokens(), Usage::new(9, 3, 4));
        let text = head(Kind::Text);
        assert_eq!(
            json(&Whole::new(
                text,
                "Hi!",
                &[],
                Some(&tokens),
                FinishReason::Stop,
                &usage
            )),
            r#"{"choices":[{"finish_reason":"stop","index":0,"logprobs":{"text_offset":[0,2],"token_logprobs":[-0.10000000149011612,-0.75],"tokens":["Hi","!"],"top_logprobs":[{"Hello":-2.5,"Hi":-0.10000000149011612},{"!":-0.75,".":-1.2999999523162842}]},"text":"Hi!"}],"created":1700000000,"id":"cmpl-0123","model":"SmolLM2","object":"text_completion","system_fingerprint":null,"usage":{"completion_tokens":3,"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4},"total_tokens":12}}"#
        );
        assert_eq!(
            json(&Whole::new(
                text,
                "Hi!",
                &[],
                None,
                FinishReason::Length,
                &usage
            )),
            r#"{"choices":[{"finish_reason":"length","index":0,"logprobs":null,"text":"Hi!"}],"created":1700000000,"id":"cmpl-0123","model":"SmolLM2","object":"text_completion","system_fingerprint":null,"usage":{"completion_tokens":3,"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4},"total_tokens":12}}"#
        );
    }

    #[test]
    fn chat_chunks() {
        let (tokens, usage) = (tokens(), Usage::new(9, 3, 4));
        let (with, without) = (chunks(Kind::Chat, true), chunks(Kind::Chat, false));
        assert_eq!(
            with.role(),
            r#"{"choices":[{"delta":{"content":"","role":"assistant"},"finish_reason":null,"index":0,"logprobs":null}],"created":1700000000,"id":"chatcmpl-0123","model":"SmolLM2","object":"chat.completion.chunk","system_fingerprint":null}"#
        );
        assert_eq!(
            with.piece("Hi", &tokens[..1], 0),
            r#"{"choices":[{"delta":{"content":"Hi"},"finish_reason":null,"index":0,"logprobs":{"content":[{"bytes":[72,105],"logprob":-0.10000000149011612,"token":"Hi","top_logprobs":[{"bytes":[72,105],"logprob":-0.10000000149011612,"token":"Hi"},{"bytes":[72,101,108,108,111],"logprob":-2.5,"token":"Hello"}]}]}}],"created":1700000000,"id":"chatcmpl-0123","model":"SmolLM2","object":"chat.completion.chunk","system_fingerprint":null}"#
        );
        assert_eq!(
            without.piece("Hi", &[], 0),
            r#"{"choices":[{"delta":{"content":"Hi"},"finish_reason":null,"index":0,"logprobs":null}],"created":1700000000,"id":"chatcmpl-0123","model":"SmolLM2","object":"chat.completion.chunk","system_fingerprint":null}"#
        );
        assert_eq!(
            with.finish(FinishReason::Stop, Some(&usage)),
            r#"{"choices":[{"delta":{},"finish_reason":"stop","index":0,"logprobs":null}],"created":1700000000,"id":"chatcmpl-0123","model":"SmolLM2","object":"chat.completion.chunk","system_fingerprint":null,"usage":{"completion_tokens":3,"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4},"total_tokens":12}}"#
        );
        assert_eq!(
            with.finish(FinishReason::Stop, None),
            r#"{"choices":[{"delta":{},"finish_reason":"stop","index":0,"logprobs":null}],"created":1700000000,"id":"chatcmpl-0123","model":"SmolLM2","object":"chat.completion.chunk","system_fingerprint":null}"#
        );
        assert_eq!(
            with.usage(&usage),
            r#"{"choices":[],"created":1700000000,"id":"chatcmpl-0123","model":"SmolLM2","object":"chat.completion.chunk","system_fingerprint":null,"usage":{"completion_tokens":3,"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4},"total_tokens":12}}"#
        );
    }

    #[test]
    fn text_chunks() {
        let (tokens, usage) = (tokens(), Usage::new(9, 3, 4));
        let (with, without) = (chunks(Kind::Text, true), chunks(Kind::Text, false));
        assert_eq!(
            with.piece("!", &tokens[1..], 2),
            r#"{"choices":[{"finish_reason":null,"index":0,"logprobs":{"text_offset":[2],"token_logprobs":[-0.75],"tokens":["!"],"top_logprobs":[{"!":-0.75,".":-1.2999999523162842}]},"text":"!"}],"created":1700000000,"id":"cmpl-0123","model":"SmolLM2","object":"text_completion","system_fingerprint":null}"#
        );
        assert_eq!(
            without.piece("!", &[], 2),
            r#"{"choices":[{"finish_reason":null,"index":0,"logprobs":null,"text":"!"}],"created":1700000000,"id":"cmpl-0123","model":"SmolLM2","object":"text_completion","system_fingerprint":null}"#
        );
        assert_eq!(
            with.finish(FinishReason::Length, Some(&usage)),
            r#"{"choices":[{"finish_reason":"length","index":0,"logprobs":null,"text":""}],"created":1700000000,"id":"cmpl-0123","model":"SmolLM2","object":"text_completion","system_fingerprint":null,"usage":{"completion_tokens":3,"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4},"total_tokens":12}}"#
        );
        assert_eq!(
            with.usage(&usage),
            r#"{"choices":[],"created":1700000000,"id":"cmpl-0123","model":"SmolLM2","object":"text_completion","system_fingerprint":null,"usage":{"completion_tokens":3,"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4},"total_tokens":12}}"#
        );
    }

    #[test]
    fn an_error_after_the_stream_began() {
        let invalid = ApiError {
            param: Some("top_p"),
            code: Some("invalid_value"),
            ..ApiError::invalid("", "invalid argument: top_p 0 is invalid")
        };
        assert_eq!(
            error_event(&invalid),
            r#"{"error":{"message":"invalid argument: top_p 0 is invalid","type":"invalid_request_error","param":"top_p","code":"invalid_value"}}"#
        );
        let unavailable = ApiError {
            status: axum::http::StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: "the runtime is unavailable".into(),
            param: None,
            code: Some("unavailable"),
        };
        assert_eq!(
            error_event(&unavailable),
            r#"{"error":{"message":"the runtime is unavailable","type":"server_error","param":null,"code":"unavailable"}}"#
        );
    }
}
