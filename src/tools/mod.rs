//! Tool calls: the functions a chat request offers the model (OpenAI's
//! `tools`, `tool_choice`, `parallel_tool_calls`), how they reach the
//! prompt, how the model's calls are constrained, and how its reply is read
//! back into calls.
//!
//! Each model family writes calls its own way; [`ToolSyntax`] is read off
//! the chat template ([`ToolSyntax::of_template`]):
//!
//! - **Hermes** (`<tool_call>` in the template: Qwen 2.5 / 3, Hermes 2 / 3,
//!   SmolLM3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//!   one block per call;
//! - **Mistral** (`[TOOL_CALLS]`): `[TOOL_CALLS][{"name": ..., "arguments":
//!   {...}}, ...]`;
//! - **Llama 3** (the `ipython` role, Llama 3.1 / 3.2 / 3.3): the whole reply
//!   is `{"name": ..., "parameters": {...}}`, one call;
//! - **Generic**, every other template (the reference SmolLM2 and Gemma 3
//!   among them: their templates have no tool syntax): the tools are
//!   described in the system turn, the reply is `{"tool_calls": [{"name":
//!   ..., "arguments": {...}}]}` (or, when the model may answer instead,
//!   `{"content": "..."}`, the only form under `"none"`), always under a
//!   constraint, and earlier calls and
//!   their results are written into the conversation in the same JSON form
//!   (`prompt.rs`).
//!
//! With `tool_choice` `"required"` or a named function, the reply is
//! constrained to the family's call syntax with the arguments held to each
//! function's parameter schema (`grammar.rs`); with `"auto"` the native
//! families answer freely and a call is recognised when the model writes
//! one (`parse.rs`).

mod grammar;
mod parse;
mod prompt;

use serde_json::Value;
use thiserror::Error;

pub use grammar::{call_constraint, marker_tokens};
pub use parse::{ParsedReply, ReplyReader};
pub use prompt::{prompt_messages, template_call, PromptInput};

/// The most tools one request may offer.
pub const MAX_TOOLS: usize = 128;

/// The longest function name (OpenAI's rule).
pub const MAX_TOOL_NAME_BYTES: usize = 64;

/// How the model's chat template writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolSyntax {
    Hermes,
    Mistral,
    Llama3,
    Generic,
}

impl ToolSyntax {
    /// The syntax of the template `source`: native where the template both
    /// takes `tools` and writes calls in a form [`ReplyReader`] reads back,
    /// [`ToolSyntax::Generic`] otherwise.
    pub fn of_template(source: &str) -> ToolSyntax {
        if !source.contains("tools") {
            return ToolSyntax::Generic;
        }
        // Qwen3-Coder's XML calls (`<function=...>`) are another syntax.
        if source.contains("<tool_call>") && !source.contains("<function=") {
            ToolSyntax::Hermes
        } else if source.contains("[TOOL_CALLS]") {
            ToolSyntax::Mistral
        } else if source.contains("ipython") && source.contains("\"parameters\"") {
            ToolSyntax::Llama3
        } else {
            ToolSyntax::Generic
        }
    }

    /// Whether the template is given the tools and the conversation's
    /// calls as they are (else they are written in the generic form).
    pub fn is_native(self) -> bool {
        self != ToolSyntax::Generic
    }

    /// Whether one reply may hold several calls (Llama 3's templates
    /// refuse more than one call per turn).
    pub fn allows_parallel(self) -> bool {
        self != ToolSyntax::Llama3
    }

    /// The name of the key a call's arguments are under.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolSyntax::Llama3 => "parameters",
            _ => "arguments",
        }
    }
}

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The JSON Schema of its arguments (an object schema).
    pub parameters: Value,
    /// The request's entry as given (`{"type": "function", "function":
    /// {...}}`), which native templates are given.
    pub declared: Value,
}

/// Whether and which tools the model must call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// No call: the tools are not offered.
    None,
    /// The model decides.
    Auto,
    /// At least one call.
    Required,
    /// A call of this function.
    Named(String),
}

/// The tools of one request, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Toolbox {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Whether one reply may hold several calls.
    pub parallel: bool,
    pub syntax: ToolSyntax,
}

impl Toolbox {
    /// Whether calls are offered at all.
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }

    /// Whether the tools shape this reply: calls are offered, or (the
    /// generic form, `"none"`) the reply is held to the form's answer, so
    /// that a model shown earlier calls as JSON answers in text.
    pub fn shapes_reply(&self) -> bool {
        self.active() || (!self.tools.is_empty() && self.syntax == ToolSyntax::Generic)
    }

    /// The tools a call may name: the named one, or all.
    fn callable(&self) -> Vec<&Tool> {
        match &self.choice {
            ToolChoice::Named(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
            _ => self.tools.iter().collect(),
        }
    }

    /// Whether this reply may hold several calls.
    fn many(&self) -> bool {
        self.parallel
            && self.syntax.allows_parallel()
            && !matches!(self.choice, ToolChoice::Named(_))
    }
}

/// A call the model made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_` and 24 random letters and digits; 9 letters and digits for
    /// the Mistral syntax, whose templates require that form.
    pub id: String,
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// Why a request's tools were refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ToolError {
    #[error("tools: {0}")]
    Tools(String),
    #[error("tool_choice: {0}")]
    Choice(String),
    #[error("messages: {0}")]
    Messages(String),
}

impl ToolError {
    /// The request field the error is about.
    pub fn param(&self) -> &'static str {
        match self {
            ToolError::Tools(_) => "tools",
            ToolError::Choice(_) => "tool_choice",
            ToolError::Messages(_) => "messages",
        }
    }
}

/// Checks OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.
/// `tool_choice` defaults to `"auto"` with tools and `"none"` without, as
/// OpenAI's does.
pub fn toolbox(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<bool>,
    syntax: ToolSyntax,
) -> Result<Toolbox, ToolError> {
    let tools = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => {
            if list.len() > MAX_TOOLS {
                return Err(ToolError::Tools(format!(
                    "{} tools, at most {MAX_TOOLS}",
                    list.len()
                )));
            }
            let mut tools: Vec<Tool> = Vec::with_capacity(list.len());
            for (i, entry) in list.iter().enumerate() {
                let tool = tool(entry).map_err(|e| ToolError::Tools(format!("tools[{i}]: {e}")))?;
                if tools.iter().any(|t| t.name == tool.name) {
                    return Err(ToolError::Tools(format!(
                        "two tools are named {:?}",
                        tool.name
                    )));
                }
                tools.push(tool);
            }
            tools
        }
        Some(_) => return Err(ToolError::Tools("must be a list".into())),
    };
    let choice = match choice {
        None | Some(Value::Null) if tools.is_empty() => ToolChoice::None,
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ToolError::Choice(format!(
                    "{other:?}: expected \"none\", \"auto\", \"required\" or a function"
                )))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ToolError::Choice(
                        "a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}"
                            .into(),
                    )
                })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(ToolError::Choice(format!("no tool is named {name:?}")));
            }
            ToolChoice::Named(name.to_owned())
        }
        Some(_) => return Err(ToolError::Choice("must be a string or an object".into())),
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required) {
        return Err(ToolError::Choice("\"required\" needs tools".into()));
    }
    Ok(Toolbox {
        tools,
        choice,
        parallel: parallel.unwrap_or(true),
        syntax,
    })
}

/// One entry of `tools`, checked.
fn tool(entry: &Value) -> Result<Tool, String> {
    let kind = entry.get("type").and_then(Value::as_str);
    if kind != Some("function") {
        return Err("only tools of type \"function\" are supported".into());
    }
    let function = entry
        .get("function")
        .and_then(Value::as_object)
        .ok_or("`function` is required")?;
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .ok_or("`function.name` is required")?;
    let valid = !name.is_empty()
        && name.len() <= MAX_TOOL_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !valid {
        return Err(format!(
            "function name {name:?}: 1 to {MAX_TOOL_NAME_BYTES} letters, digits, '_' or '-'"
        ));
    }
    let description = match function.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err("`function.description` must be a string".into()),
    };
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err("`function.parameters` must be a JSON Schema object".into()),
    };
    Ok(Tool {
        name: name.to_owned(),
        description,
        parameters,
        declared: entry.clone(),
    })
}

/// A fresh call id for `syntax`.
pub fn call_id(syntax: ToolSyntax) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let len = if syntax == ToolSyntax::Mistral { 9 } else { 24 };
    let mut bytes = [0u8; 24];
    // Without randomness the ids are still distinct within a reply.
    let _ = getrandom::getrandom(&mut bytes);
    let random: String = bytes[..len]
        .iter()
        .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
        .collect();
    if syntax == ToolSyntax::Mistral {
        random
    } else {
        format!("call_{random}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    #[test]
    fn syntax_is_read_off_the_template() {
        let hermes = "{% if tools %}<tools>{% endif %}<tool_call>";
        assert_eq!(ToolSyntax::of_template(hermes), ToolSyntax::Hermes);
        let coder = "{% if tools %}{% endif %}<tool_call><function=x>";
        assert_eq!(ToolSyntax::of_template(coder), ToolSyntax::Generic);
        let mistral = "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]";
        assert_eq!(ToolSyntax::of_template(mistral), ToolSyntax::Mistral);
        let llama = "{% if tools %}{% endif %}ipython \"parameters\"";
        assert_eq!(ToolSyntax::of_template(llama), ToolSyntax::Llama3);
        assert_eq!(ToolSyntax::of_template("<|im_start|>"), ToolSyntax::Generic);
    }

    #[test]
    fn choices_default_as_openai_does() {
        let tools = json!([weather()]);
        let g = ToolSyntax::Generic;
        assert_eq!(
            toolbox(None, None, None, g).unwrap().choice,
            ToolChoice::None
        );
        let auto = toolbox(Some(&tools), None, None, g).unwrap();
        assert_eq!(auto.choice, ToolChoice::Auto);
        assert!(auto.parallel && auto.active());
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let named = toolbox(Some(&tools), Some(&named), Some(false), g).unwrap();
        assert_eq!(named.choice, ToolChoice::Named("get_weather".into()));
        assert!(!named.parallel);
    }

    #[test]
    fn bad_tools_are_refused_naming_the_field() {
        let g = ToolSyntax::Generic;
        let cases: [(Value, Option<Value>, &str); 7] = [
            (json!({}), None, "tools"),
            (json!([{"type": "retrieval"}]), None, "tools"),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                None,
                "tools",
            ),
            (json!([weather(), weather()]), None, "tools"),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
                None,
                "tools",
            ),
            (json!([weather()]), Some(json!("sometimes")), "tool_choice"),
            (
                json!([weather()]),
                Some(json!({"type": "function", "function": {"name": "nope"}})),
                "tool_choice",
            ),
        ];
        for (tools, choice, param) in cases {
            let err = toolbox(Some(&tools), choice.as_ref(), None, g).unwrap_err();
            assert_eq!(err.param(), param, "{err}");
        }
        let err = toolbox(None, Some(&json!("required")), None, g).unwrap_err();
        assert_eq!(err.param(), "tool_choice");
        let many = Value::Array(vec![weather(); MAX_TOOLS + 1]);
        assert!(toolbox(Some(&many), None, None, g).is_err());
    }

    #[test]
    fn call_ids_have_their_syntax_form() {
        let id = call_id(ToolSyntax::Hermes);
        assert!(id.starts_with("call_") && id.len() == 29, "{id}");
        let id = call_id(ToolSyntax::Mistral);
        assert!(id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()));
    }
}
