//! The OpenAI request shapes the HTTP front door reads (`/v1/chat/completions`,
//! `/v1/completions`), and its errors in OpenAI's shape with their HTTP status.
//! The bodies it answers with are in `responses.rs`.
//!
//! Fields a request may carry that inferd does not act on (`user`,
//! `stream_options` beyond `include_usage`, ...)
//! are accepted and ignored, as other OpenAI-compatible servers do; every
//! field it acts on is checked, and a value it cannot honour (`n` other
//! than 1, a penalty out of range, a logit bias for a token outside the
//! vocabulary) is a 400 naming the field, whether the front door or the
//! runtime refused it (a runtime refusal's field is read off its message).

use std::collections::BTreeMap;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use crate::runtime::{RuntimeError, StatusKind};

/// A message's content: a string, or text parts.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

impl Content {
    /// The text of the message: its string, or its text parts joined. An
    /// image or audio part is refused (the model reads text only).
    pub fn text(&self) -> Result<String, ApiError> {
        match self {
            Content::Text(text) => Ok(text.clone()),
            Content::Parts(parts) => parts
                .iter()
                .map(|p| match (p.kind.as_str(), &p.text) {
                    ("text", Some(text)) => Ok(text.as_str()),
                    (kind, _) => Err(ApiError::invalid(
                        "messages",
                        format!("a content part of type {kind:?}: this model reads text only"),
                    )),
                })
                .collect::<Result<Vec<&str>, _>>()
                .map(|texts| texts.concat()),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's calls.
    #[serde(default)]
    pub tool_calls: Option<Vec<RequestToolCall>>,
    /// A tool turn: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// A tool turn: the function that answered.
    #[serde(default)]
    pub name: Option<String>,
}

/// A call in an assistant turn the client sends back.
#[derive(Clone, Debug, Deserialize)]
pub struct RequestToolCall {
    #[serde(default)]
    pub id: Option<String>,
    pub function: RequestFunctionCall,
}

#[derive(Clone, Debug, Deserialize)]
pub struct RequestFunctionCall {
    pub name: String,
    /// JSON text, as OpenAI sends it (an object is taken too).
    #[serde(default)]
    pub arguments: Option<serde_json::Value>,
}

/// `stop`: one string or several.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn strings(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// What both endpoints take to sample.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Sampling {
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub logit_bias: Option<BTreeMap<String, f32>>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// `text` (the default), `json_object` or `json_schema`: the latter two
    /// constrain the output (see `format.rs`).
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    /// llama.cpp's server extensions: a GBNF grammar, or a JSON Schema
    /// given directly (each alone, or instead of `response_format`).
    #[serde(default)]
    pub grammar: Option<String>,
    #[serde(default)]
    pub json_schema: Option<serde_json::Value>,
    /// inferd's extension, as `GenerateRequest.speculate`: `false` decodes
    /// one token per forward pass, `true` speculates; absent, the server's
    /// default. The output is the same either way.
    #[serde(default)]
    pub speculate: Option<bool>,
}

/// OpenAI's `response_format`.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

/// `response_format.json_schema`: the schema and its name (`strict` is
/// always honoured: the output is constrained either way).
#[derive(Clone, Debug, Deserialize)]
pub struct JsonSchemaFormat {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
    #[serde(default)]
    pub strict: Option<bool>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub logprobs: bool,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    /// The functions the model may call (`tools.rs` in inferd's library).
    #[serde(default)]
    pub tools: Option<serde_json::Value>,
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// `prompt`: text, or token ids (one prompt only).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Prompt,
    /// Legacy: how many top log-probabilities to report per token.
    #[serde(default)]
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// An error in OpenAI's shape, with its HTTP status.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A request the server will not run as it is (400).
    pub fn invalid(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param),
            code: None,
        }
    }

    /// A body that is not the JSON this endpoint reads (400).
    pub fn bad_body(message: impl Into<String>) -> ApiError {
        ApiError {
            param: None,
            ..ApiError::invalid("", message)
        }
    }

    /// No or a wrong bearer token (401).
    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            kind: "invalid_request_error",
            message: "a valid `Authorization: Bearer <token>` header is required".into(),
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// A body over the limit (413).
    pub fn too_large(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: Some("request_too_large"),
        }
    }

    /// A method the route does not take (405).
    pub fn method_not_allowed(message: String) -> ApiError {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            kind: "invalid_request_error",
            message,
            param: None,
            code: Some("method_not_allowed"),
        }
    }

    /// A path or method this server does not serve (404).
    pub fn not_found(what: String) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: what,
            param: None,
            code: Some("not_found"),
        }
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> ApiError {
        let (status, kind, code) = match e.code() {
            StatusKind::InvalidArgument => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("invalid_value"),
            ),
            StatusKind::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error", None),
            StatusKind::ResourceExhausted => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("resources_exhausted"),
            ),
            StatusKind::DeadlineExceeded => (
                StatusCode::GATEWAY_TIMEOUT,
                "timeout_error",
                Some("timeout"),
            ),
            StatusKind::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("unavailable"),
            ),
            StatusKind::FailedPrecondition
            | StatusKind::Internal
            | StatusKind::DataLoss
            | StatusKind::Aborted => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        ApiError {
            status,
            kind,
            param: param_of(&e),
            message: e.to_string(),
            code,
        }
    }
}

/// The request fields the runtime may refuse that an OpenAI request sets,
/// each with the message prefix that names it (the runtime's argument
/// errors begin with the field: "top_p 0 is invalid: ...", "logit_bias has
/// 1025 entries: ...", the sampler's "logit bias 7 for token ...").
const RUNTIME_FIELDS: [(&str, &str); 8] = [
    ("max_tokens", "max_tokens"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("frequency_penalty", "frequency_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("logit_bias", "logit_bias"),
    ("logit bias", "logit_bias"),
    ("top_logprobs", "top_logprobs"),
];

/// The OpenAI `param` a runtime refusal is about, read off the start of
/// its message; `None` for anything but an argument error, or one about a
/// field an OpenAI request does not set.
fn param_of(e: &RuntimeError) -> Option<&'static str> {
    let RuntimeError::InvalidArgument(message) = e else {
        return None;
    };
    RUNTIME_FIELDS.iter().find_map(|&(prefix, param)| {
        let rest = message.strip_prefix(prefix)?;
        (rest.is_empty() || rest.starts_with(' ')).then_some(param)
    })
}

/// `{"error": {...}}`, the body of every error.
#[derive(Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

#[derive(Serialize)]
pub struct ErrorDetail<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

impl ApiError {
    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind,
                param: self.param.filter(|p| !p.is_empty()),
                code: self.code,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
