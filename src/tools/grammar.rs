//! The constraint that holds a reply to tool calls: the family's call
//! syntax around JSON held to each function's parameter schema. Native
//! families are constrained only when a call is required (`"required"` or
//! a named function); the generic form always is, since a model whose
//! template has no tool syntax was never taught one: with `"auto"` its
//! reply is either calls or `{"content": "..."}`, with `"none"` only the
//! latter.

use serde_json::{json, Value};

use super::{ToolChoice, ToolSyntax, Toolbox};
use crate::constraint::{with_separators, ConstraintSpec};
use crate::tokenizer::Tokenizer;

/// The constraint the request's tools put on the reply; `None` when the
/// reply is free.
pub fn call_constraint(toolbox: &Toolbox, tokenizer: &Tokenizer) -> Option<ConstraintSpec> {
    if !toolbox.shapes_reply() {
        return None;
    }
    let required = !matches!(toolbox.choice, ToolChoice::Auto);
    let call = one_call(toolbox);
    let calls = call_list(call.clone(), toolbox.many());
    let spec = match toolbox.syntax {
        ToolSyntax::Generic => {
            let calls = object(&[("tool_calls", calls)]);
            let answer = object(&[("content", json!({"type": "string"}))]);
            let schema = match toolbox.choice {
                ToolChoice::None => answer,
                ToolChoice::Auto => json!({"anyOf": [calls, answer]}),
                ToolChoice::Required | ToolChoice::Named(_) => calls,
            };
            ConstraintSpec::JsonSchema(schema.to_string())
        }
        _ if !required => return None,
        ToolSyntax::Llama3 => ConstraintSpec::JsonSchema(call.to_string()),
        ToolSyntax::Mistral => {
            let open = marker(tokenizer, "[TOOL_CALLS]");
            ConstraintSpec::Lark(format!("start: {open} %json {}\n", inline(calls)))
        }
        ToolSyntax::Hermes => {
            let open = marker(tokenizer, "<tool_call>");
            let close = marker(tokenizer, "</tool_call>");
            let start = if toolbox.many() {
                "start: call (\"\\n\" call)*"
            } else {
                "start: call"
            };
            ConstraintSpec::Lark(format!(
                "{start}\ncall: {open} \"\\n\" %json {} \"\\n\" {close}\n",
                inline(call)
            ))
        }
    };
    Some(spec)
}

/// The schema of one call: `{"name": <a callable function>, <arguments
/// key>: <its parameters>}`.
fn one_call(toolbox: &Toolbox) -> Value {
    let key = toolbox.syntax.arguments_key();
    let each: Vec<Value> = toolbox
        .callable()
        .into_iter()
        .map(|t| {
            object(&[
                ("name", json!({"const": t.name})),
                (key, t.parameters.clone()),
            ])
        })
        .collect();
    match <[Value; 1]>::try_from(each) {
        Ok([one]) => one,
        Err(each) => json!({"anyOf": each}),
    }
}

/// A list of one call, or of one or more.
fn call_list(call: Value, many: bool) -> Value {
    if many {
        json!({"type": "array", "items": call, "minItems": 1})
    } else {
        json!({"type": "array", "items": call, "minItems": 1, "maxItems": 1})
    }
}

/// A closed object schema with these properties, all required, in order.
fn object(properties: &[(&str, Value)]) -> Value {
    let mut props = serde_json::Map::new();
    for (key, schema) in properties {
        props.insert((*key).to_owned(), schema.clone());
    }
    let required: Vec<&str> = properties.iter().map(|(k, _)| *k).collect();
    json!({
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": false,
    })
}

/// A schema as Lark's `%json` takes it, with the compact separators every
/// constrained JSON reply has.
fn inline(schema: Value) -> String {
    with_separators(schema).to_string()
}

/// `text` in a Lark rule: the special token it names, by id (a control
/// token matches no text), or the literal text.
fn marker(tokenizer: &Tokenizer, text: &str) -> String {
    match tokenizer.token_id(text) {
        Some(id) if tokenizer.is_control(id) || tokenizer.is_eog(id) => format!("<[{id}]>"),
        // A JSON string is a Lark string literal.
        _ => Value::from(text).to_string(),
    }
}

/// The control tokens among the family's call markers: a reply shows
/// them (they are part of the call syntax) where it leaves other control
/// tokens out.
pub fn marker_tokens(syntax: ToolSyntax, tokenizer: &Tokenizer) -> Vec<u32> {
    let markers: &[&str] = match syntax {
        ToolSyntax::Hermes => &["<tool_call>", "</tool_call>"],
        ToolSyntax::Mistral => &["[TOOL_CALLS]", "[ARGS]"],
        ToolSyntax::Llama3 => &["<|python_tag|>"],
        ToolSyntax::Generic => &[],
    };
    markers
        .iter()
        .filter_map(|m| tokenizer.token_id(m))
        .filter(|&id| tokenizer.is_control(id))
        .collect()
}
