//! A conversation with tools, made ready for the chat template.
//!
//! A native template is given the tools and the conversation as they are:
//! it writes both in its family's own form. For a template with no tool
//! syntax (the generic form) the tools are described at the end of the
//! system turn (one is added when there is none), an assistant turn's calls
//! become its text `{"tool_calls": [{"name": ..., "arguments": {...}}]}`,
//! and a run of tool results becomes one user turn `{"tool_results":
//! [{"name": ..., "content": ...}]}`, so that even a
//! template that insists on alternating user and assistant turns (Gemma's)
//! takes the conversation.

use serde_json::{json, Map, Value};

use super::{ToolChoice, Toolbox};
use crate::chat_template::Message;

/// What the template renders: the messages and its `tools`.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptInput {
    pub messages: Vec<Message>,
    pub tools: Option<Value>,
}

/// `messages` with `toolbox` as the template takes them.
pub fn prompt_messages(toolbox: &Toolbox, messages: Vec<Message>) -> PromptInput {
    if toolbox.syntax.is_native() {
        let tools = toolbox
            .active()
            .then(|| Value::Array(toolbox.tools.iter().map(|t| t.declared.clone()).collect()));
        return PromptInput { messages, tools };
    }
    let mut messages = generic_history(messages);
    if toolbox.shapes_reply() {
        let description = describe(toolbox);
        match messages.first_mut() {
            Some(first) if first.role == "system" => {
                if !first.content.is_empty() {
                    first.content.push_str("\n\n");
                }
                first.content.push_str(&description);
            }
            _ => messages.insert(0, Message::new("system", description)),
        }
    }
    PromptInput {
        messages,
        tools: None,
    }
}

/// An assistant's call as templates read it: the arguments an object
/// where they parse as one, else the text as given.
pub fn template_call(id: &str, name: &str, arguments: &str) -> Value {
    let arguments = serde_json::from_str::<Value>(arguments)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| Value::from(arguments));
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// The conversation's calls and results in the generic form.
fn generic_history(messages: Vec<Message>) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(messages.len());
    let mut results: Vec<Value> = Vec::new();
    // The function each earlier call id named, for results that omit it.
    let mut called: Vec<(String, String)> = Vec::new();
    for mut message in messages {
        if message.role == "tool" {
            let name = message.name.clone().or_else(|| {
                let id = message.tool_call_id.as_deref()?;
                called
                    .iter()
                    .rev()
                    .find(|(i, _)| i == id)
                    .map(|(_, n)| n.clone())
            });
            // No call id: the model is shown its calls without theirs, so
            // ids (drawn at random per reply) would only make one
            // conversation read differently each time it is sent.
            results.push(json!({
                "name": name,
                "content": message.content,
            }));
            continue;
        }
        flush_results(&mut out, &mut results);
        if let Some(calls) = message.tool_calls.take() {
            let mut reply = Map::new();
            if !message.content.is_empty() {
                reply.insert("content".into(), Value::from(message.content.clone()));
            }
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    let f = &c["function"];
                    if let (Some(id), Some(name)) = (c["id"].as_str(), f["name"].as_str()) {
                        called.push((id.to_owned(), name.to_owned()));
                    }
                    json!({"name": f["name"], "arguments": f["arguments"]})
                })
                .collect();
            reply.insert("tool_calls".into(), Value::Array(calls));
            message.content = Value::Object(reply).to_string();
        }
        out.push(message);
    }
    flush_results(&mut out, &mut results);
    out
}

/// A run of tool results as one user turn.
fn flush_results(out: &mut Vec<Message>, results: &mut Vec<Value>) {
    if results.is_empty() {
        return;
    }
    let text = json!({"tool_results": std::mem::take(results)}).to_string();
    out.push(Message::new("user", text));
}

/// The tools and the reply form, for the system turn.
fn describe(toolbox: &Toolbox) -> String {
    if toolbox.choice == ToolChoice::None {
        return "Reply with only this JSON: {\"content\": <your answer>}. Tool results come \
                back as {\"tool_results\": [...]}: use them to answer."
            .into();
    }
    let tools: Vec<Value> = toolbox
        .tools
        .iter()
        .map(|t| {
            let mut entry = Map::new();
            entry.insert("name".into(), Value::from(t.name.clone()));
            if let Some(d) = &t.description {
                entry.insert("description".into(), Value::from(d.clone()));
            }
            entry.insert("parameters".into(), t.parameters.clone());
            Value::Object(entry).to_string()
        })
        .map(Value::from)
        .collect();
    let list: Vec<&str> = tools.iter().filter_map(Value::as_str).collect();
    let mut text = format!(
        "You can call these tools (each with the JSON Schema of its arguments):\n{}\n\n",
        list.join("\n")
    );
    let form = "{\"tool_calls\": [{\"name\": <tool name>, \"arguments\": <arguments object>}]}";
    match &toolbox.choice {
        ToolChoice::Named(name) => text.push_str(&format!(
            "Call the tool {name:?} now: reply with only this JSON:\n{form}"
        )),
        ToolChoice::Required => {
            text.push_str(&format!("Call a tool now: reply with only this JSON:\n{form}"))
        }
        _ => text.push_str(&format!(
            "To call tools, reply with only this JSON:\n{form}\nTo answer without a tool, reply with only {{\"content\": <your answer>}}."
        )),
    }
    text.push_str(
        "\nTool results come back as {\"tool_results\": [...]}: use them to answer, and do not call a tool again for what they already say.",
    );
    text
}
