//! Tool calls on `/v1/chat/completions`: the request's messages (with
//! their calls and results) and `tools` / `tool_choice` /
//! `parallel_tool_calls` made into the prompt, the constraint and how the
//! reply is read (`crate::tools` does the work; this is the OpenAI side).
//!
//! A request that offers tools cannot also ask for a `response_format`,
//! `grammar` or `json_schema`: both would constrain the same reply.

use serde_json::Value;

use super::openai::{ApiError, ChatMessage, ChatRequest};
use super::responses::{FinishReason, TokenLogprob};
use super::Front;
use crate::chat_template::Message;
use crate::constraint::ConstraintSpec;
use crate::runtime::RequestConstraint;
use crate::tools::{self, PromptInput, ToolCall, ToolSyntax, Toolbox};

/// How a reply with tools is read, for the response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplyPlan {
    pub syntax: ToolSyntax,
    pub parallel: bool,
    /// Control tokens whose text is part of the reply (the family's call
    /// markers), which a reply otherwise leaves out.
    pub shown_tokens: Vec<u32>,
}

/// A chat request's tools, worked out.
pub(super) struct ToolPlan {
    pub input: PromptInput,
    toolbox: Toolbox,
}

impl ToolPlan {
    /// Reads the request's tools and makes its messages the template's.
    pub(super) fn new(front: &Front, req: &ChatRequest) -> Result<ToolPlan, ApiError> {
        let toolbox = tools::toolbox(
            req.tools.as_ref(),
            req.tool_choice.as_ref(),
            req.parallel_tool_calls,
            front.tool_syntax,
        )
        .map_err(|e| ApiError::invalid(e.param(), e.to_string()))?;
        let messages = messages(&req.messages, front.tool_syntax)?;
        Ok(ToolPlan {
            input: tools::prompt_messages(&toolbox, messages),
            toolbox,
        })
    }

    /// The reply's constraint: the tools' (compiled), or `asked` (the
    /// request's own) when the tools do not shape the reply.
    pub(super) fn constraint(
        &self,
        front: &Front,
        asked: super::format::Asked,
    ) -> Result<Option<RequestConstraint>, ApiError> {
        if !self.toolbox.shapes_reply() {
            return super::format::constraint(asked, front);
        }
        if asked.any() {
            return Err(ApiError::invalid(
                "tools",
                "tools cannot be combined with response_format, grammar or json_schema",
            ));
        }
        let Some(spec) = tools::call_constraint(&self.toolbox, &front.tokenizer) else {
            return Ok(None);
        };
        compile(front, &spec).map(Some)
    }

    /// How the reply is read; `None` when the tools do not shape it.
    pub(super) fn reply(&self, front: &Front) -> Option<ReplyPlan> {
        self.toolbox.shapes_reply().then(|| ReplyPlan {
            syntax: self.toolbox.syntax,
            parallel: self.toolbox.parallel,
            shown_tokens: tools::marker_tokens(self.toolbox.syntax, &front.tokenizer),
        })
    }
}

fn compile(front: &Front, spec: &ConstraintSpec) -> Result<RequestConstraint, ApiError> {
    front.state.constraints.compile(spec).map_err(|e| ApiError {
        param: Some("tools"),
        ..ApiError::from(e)
    })
}

/// The request's messages as the template's, with their calls and results.
fn messages(given: &[ChatMessage], syntax: ToolSyntax) -> Result<Vec<Message>, ApiError> {
    given
        .iter()
        .map(|m| {
            let content = m.content.as_ref().map(|c| c.text()).transpose()?;
            // OpenAI's newer name for the system role.
            let role = if m.role == "developer" {
                "system"
            } else {
                &m.role
            };
            if role == "tool" && content.is_none() {
                return Err(ApiError::invalid(
                    "messages",
                    "a tool message needs its content",
                ));
            }
            let mut message = Message::new(role, content.unwrap_or_default());
            message.tool_call_id = m.tool_call_id.clone();
            message.name = m.name.clone();
            if let Some(calls) = &m.tool_calls {
                if role != "assistant" {
                    return Err(ApiError::invalid(
                        "messages",
                        format!("a {role} message cannot carry tool_calls"),
                    ));
                }
                let calls = calls.iter().map(|c| {
                    let arguments = match &c.function.arguments {
                        None | Some(Value::Null) => "{}".to_owned(),
                        Some(Value::String(text)) => text.clone(),
                        Some(other) => other.to_string(),
                    };
                    let id = c.id.clone().unwrap_or_else(|| tools::call_id(syntax));
                    tools::template_call(&id, &c.function.name, &arguments)
                });
                message.tool_calls = Some(calls.collect());
            }
            Ok(message)
        })
        .collect()
}

/// A reply with tools on its way out: text shown as far as it cannot be
/// a call, the rest read into calls at the end.
pub(super) struct ReplyFilter {
    reader: tools::ReplyReader,
    /// Log-probabilities of tokens whose text is held.
    logprobs: Vec<TokenLogprob>,
}

impl ReplyFilter {
    pub(super) fn new(plan: &ReplyPlan) -> ReplyFilter {
        ReplyFilter {
            reader: tools::ReplyReader::new(plan.syntax, plan.parallel),
            logprobs: Vec::new(),
        }
    }

    /// A piece of the reply: the text to show now with its tokens'
    /// log-probabilities, or `None` while it is held.
    pub(super) fn push(
        &mut self,
        text: &str,
        logprobs: Vec<TokenLogprob>,
    ) -> Option<(String, Vec<TokenLogprob>)> {
        self.logprobs.extend(logprobs);
        let shown = self.reader.push(text);
        (!shown.is_empty()).then(|| (shown, std::mem::take(&mut self.logprobs)))
    }

    /// A whole reply (not streamed), read: its text and its calls.
    pub(super) fn whole(mut self, reply: &str) -> (String, Vec<ToolCall>) {
        let (mut text, _) = self.push(reply, Vec::new()).unwrap_or_default();
        let (rest, _, calls) = self.finish();
        text.push_str(&rest);
        (text, calls)
    }

    /// The end: the text still to show, its log-probabilities, the calls.
    pub(super) fn finish(self) -> (String, Vec<TokenLogprob>, Vec<ToolCall>) {
        let parsed = self.reader.finish();
        (parsed.content, self.logprobs, parsed.calls)
    }
}

/// Why a reply finished, counting its calls: a reply that ended by itself
/// having called tools finished with `tool_calls`.
pub(super) fn finish_reason(finish: FinishReason, calls: &[ToolCall]) -> FinishReason {
    if finish == FinishReason::Stop && !calls.is_empty() {
        FinishReason::ToolCalls
    } else {
        finish
    }
}
