//! A reply read back into text and tool calls, as it streams.
//!
//! [`ReplyReader`] passes text through until a call may be starting, then
//! holds the rest; at the end it reads what it held. For the marker
//! syntaxes (Hermes' `<tool_call>`, Mistral's `[TOOL_CALLS]`) the hold
//! starts at the marker (or at a tail of the text that could begin it);
//! for the whole-reply syntaxes (Llama 3's bare JSON call, the generic
//! form) it starts when the reply's first non-blank character is `{`. Held
//! text that is not a well-formed call is given back as text: nothing the
//! model wrote is dropped.

use serde_json::Value;

use super::{call_id, ToolCall, ToolSyntax};

/// A reply, read: its text and the calls it made.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedReply {
    /// The text still to show (what was not passed through already).
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// Reads one reply of a model writing `syntax`.
#[derive(Debug)]
pub struct ReplyReader {
    syntax: ToolSyntax,
    /// Text not passed through yet.
    held: String,
    /// Whether everything from here on is held (a call has begun).
    holding: bool,
    /// Whether any non-blank text was seen (the whole-reply syntaxes
    /// decide on the first).
    seen_text: bool,
    /// At most one call is kept (`parallel_tool_calls: false`).
    one_call: bool,
    /// Where a generic reply is as an answer in text.
    answer: Answer,
}

/// A generic reply as an answer in text (`{"content": "..."}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// Not known yet (the reply may still begin that way).
    Undecided,
    /// It is one: its string is being shown as it comes.
    Open,
    /// Its string closed.
    Closed,
    /// It is not one (calls, or something else).
    No,
}

/// How a generic reply that answers in text begins (the constraint writes
/// it compact).
const ANSWER_START: &str = "{\"content\": \"";

impl ReplyReader {
    pub fn new(syntax: ToolSyntax, parallel: bool) -> ReplyReader {
        ReplyReader {
            syntax,
            held: String::new(),
            holding: false,
            seen_text: false,
            one_call: !parallel || !syntax.allows_parallel(),
            answer: Answer::Undecided,
        }
    }

    /// Takes the next piece of the reply; returns the text that can be
    /// shown now.
    pub fn push(&mut self, piece: &str) -> String {
        self.held.push_str(piece);
        if self.holding {
            return self.answer_text();
        }
        match marker(self.syntax) {
            Some(marker) => {
                if let Some(at) = self.held.find(marker) {
                    self.holding = true;
                    let out = self.held[..at].to_owned();
                    self.held.drain(..at);
                    return out;
                }
                // Keep a tail that may be the marker's beginning.
                let keep = partial_tail(&self.held, marker);
                let cut = self.held.len() - keep;
                let out = self.held[..cut].to_owned();
                self.held.drain(..cut);
                out
            }
            None => {
                if self.seen_text {
                    return std::mem::take(&mut self.held);
                }
                let Some(first) = self.held.trim_start().chars().next() else {
                    return String::new();
                };
                self.seen_text = true;
                if first == '{' || self.held.trim_start().starts_with("<|python_tag|>") {
                    self.holding = true;
                    self.answer_text()
                } else {
                    std::mem::take(&mut self.held)
                }
            }
        }
    }

    /// The generic form's answer text as far as it has come (its JSON
    /// string decoded), once the reply is seen to be one.
    fn answer_text(&mut self) -> String {
        if self.syntax != ToolSyntax::Generic {
            return String::new();
        }
        if self.answer == Answer::Undecided {
            let start = self.held.len() - self.held.trim_start().len();
            let text = &self.held[start..];
            if text.starts_with(ANSWER_START) {
                self.held.drain(..start + ANSWER_START.len());
                self.answer = Answer::Open;
            } else if !ANSWER_START.starts_with(text) {
                self.answer = Answer::No;
            }
        }
        if self.answer != Answer::Open {
            return String::new();
        }
        let (text, used, closed) = json_string_prefix(&self.held);
        self.held.drain(..used);
        if closed {
            self.answer = Answer::Closed;
        }
        text
    }

    /// The end of the reply: what was held, read.
    pub fn finish(self) -> ParsedReply {
        if matches!(self.answer, Answer::Open | Answer::Closed) {
            // The answer was shown as it came; what is left is its closing
            // (or, cut short, a piece of an escape, given back as it is).
            let content = if self.answer == Answer::Closed {
                String::new()
            } else {
                self.held
            };
            return ParsedReply {
                content,
                calls: Vec::new(),
            };
        }
        let held = self.held;
        if !self.holding {
            return ParsedReply {
                content: held,
                calls: Vec::new(),
            };
        }
        let (content, mut calls) = match self.syntax {
            ToolSyntax::Hermes => hermes(&held),
            ToolSyntax::Mistral => mistral(&held),
            ToolSyntax::Llama3 => llama3(&held),
            ToolSyntax::Generic => generic(&held),
        };
        if self.one_call {
            calls.truncate(1);
        }
        let calls = calls
            .into_iter()
            .map(|(name, arguments)| ToolCall {
                id: call_id(self.syntax),
                name,
                arguments,
            })
            .collect();
        ParsedReply { content, calls }
    }
}

/// The start of a JSON string's body decoded: the text, the bytes of `raw`
/// used, and whether the closing quote came. An escape not yet whole
/// waits (unused).
fn json_string_prefix(raw: &str) -> (String, usize, bool) {
    let mut out = String::new();
    let mut used = 0;
    let bytes = raw.as_bytes();
    while used < raw.len() {
        let rest = &raw[used..];
        match bytes[used] {
            b'"' => return (out, used + 1, true),
            b'\\' => {
                // The escape (with a second \uXXXX for a surrogate pair) as
                // a JSON string of its own.
                let Some(len) = escape_len(rest) else {
                    break;
                };
                let decoded: String = serde_json::from_str(&format!("\"{}\"", &rest[..len]))
                    .unwrap_or_else(|_| rest[..len].to_owned());
                out.push_str(&decoded);
                used += len;
            }
            _ => {
                let c = rest.chars().next().unwrap_or_default();
                out.push(c);
                used += c.len_utf8();
            }
        }
    }
    (out, used, false)
}

/// The length of the escape `rest` begins with, or `None` while it is not
/// whole.
fn escape_len(rest: &str) -> Option<usize> {
    let kind = *rest.as_bytes().get(1)?;
    if kind != b'u' {
        return Some(2);
    }
    let code = u16::from_str_radix(rest.get(2..6)?, 16).unwrap_or(0);
    if (0xD800..0xDC00).contains(&code) {
        // A high surrogate: its low half follows as another \uXXXX.
        rest.get(6..12)?;
        return Some(12);
    }
    Some(6)
}

/// The text that starts a call, for the marker syntaxes.
fn marker(syntax: ToolSyntax) -> Option<&'static str> {
    match syntax {
        ToolSyntax::Hermes => Some("<tool_call>"),
        ToolSyntax::Mistral => Some("[TOOL_CALLS]"),
        ToolSyntax::Llama3 | ToolSyntax::Generic => None,
    }
}

/// The length of the longest tail of `text` that is a proper beginning of
/// `marker`.
fn partial_tail(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// A call's name and arguments (as JSON text) from `{"name": ...,
/// "arguments" | "parameters": {...}}`.
fn call_of(value: &Value) -> Option<(String, String)> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?;
    let arguments = match object.get("arguments").or_else(|| object.get("parameters")) {
        None => "{}".to_owned(),
        // Some models write the arguments as a JSON string already.
        Some(Value::String(text)) => text.clone(),
        Some(args) => args.to_string(),
    };
    Some((name.to_owned(), arguments))
}

/// `<tool_call>\n{...}\n</tool_call>` blocks; the text around them is
/// content. A block that does not parse stays in the content.
fn hermes(text: &str) -> (String, Vec<(String, String)>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        content.push_str(&rest[..at]);
        let body_start = at + OPEN.len();
        let (body, next) = match rest[body_start..].find(CLOSE) {
            Some(end) => (
                &rest[body_start..body_start + end],
                body_start + end + CLOSE.len(),
            ),
            None => (&rest[body_start..], rest.len()),
        };
        match serde_json::from_str::<Value>(body.trim())
            .ok()
            .as_ref()
            .and_then(call_of)
        {
            Some(call) => calls.push(call),
            None => content.push_str(&rest[at..next]),
        }
        rest = &rest[next..];
    }
    content.push_str(rest);
    (trim_between(content, !calls.is_empty()), calls)
}

/// `[TOOL_CALLS][{...}, ...]` (or one object), or the newer
/// `[TOOL_CALLS]name[ARGS]{...}`, repeated.
fn mistral(text: &str) -> (String, Vec<(String, String)>) {
    const MARK: &str = "[TOOL_CALLS]";
    let Some(at) = text.find(MARK) else {
        return (text.to_owned(), Vec::new());
    };
    let body = text[at + MARK.len()..].trim();
    let mut calls = Vec::new();
    match serde_json::from_str::<Value>(body) {
        Ok(Value::Array(list)) => calls.extend(list.iter().filter_map(call_of)),
        Ok(one) => calls.extend(call_of(&one)),
        Err(_) => {
            for part in body.split(MARK) {
                let parsed = part.split_once("[ARGS]").and_then(|(name, args)| {
                    let args: Value = serde_json::from_str(args.trim()).ok()?;
                    Some((name.trim().to_owned(), args.to_string()))
                });
                calls.extend(parsed);
            }
        }
    }
    if calls.is_empty() {
        return (text.to_owned(), calls);
    }
    (text[..at].trim_end().to_owned(), calls)
}

/// The whole reply as `{"name": ..., "parameters": {...}}` (after an
/// optional `<|python_tag|>`), or several such separated by `;`.
fn llama3(text: &str) -> (String, Vec<(String, String)>) {
    let body = text.trim();
    let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
    if let Some(call) = serde_json::from_str::<Value>(body)
        .ok()
        .as_ref()
        .and_then(call_of)
    {
        return (String::new(), vec![call]);
    }
    let several: Option<Vec<_>> = body
        .split(';')
        .map(|part| {
            serde_json::from_str::<Value>(part.trim())
                .ok()
                .as_ref()
                .and_then(call_of)
        })
        .collect();
    match several {
        Some(calls) if !calls.is_empty() => (String::new(), calls),
        _ => (text.to_owned(), Vec::new()),
    }
}

/// `{"tool_calls": [...]}` or `{"content": "..."}`.
fn generic(text: &str) -> (String, Vec<(String, String)>) {
    let Ok(Value::Object(reply)) = serde_json::from_str::<Value>(text.trim()) else {
        return (text.to_owned(), Vec::new());
    };
    let calls: Vec<_> = match reply.get("tool_calls") {
        Some(Value::Array(list)) => list.iter().filter_map(call_of).collect(),
        _ => Vec::new(),
    };
    let content = match reply.get("content") {
        Some(Value::String(s)) => s.clone(),
        _ if !calls.is_empty() => String::new(),
        _ => text.to_owned(),
    };
    (content, calls)
}

/// Content around calls loses the blank lines that separated it from
/// them.
fn trim_between(content: String, had_calls: bool) -> String {
    if had_calls {
        content.trim().to_owned()
    } else {
        content
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reply fed in pieces of `step` bytes: (text shown, parsed end).
    fn read(syntax: ToolSyntax, reply: &str, step: usize) -> (String, ParsedReply) {
        let mut reader = ReplyReader::new(syntax, true);
        let mut shown = String::new();
        let mut rest = reply;
        while !rest.is_empty() {
            let mut n = step.min(rest.len());
            while !rest.is_char_boundary(n) {
                n += 1;
            }
            shown.push_str(&reader.push(&rest[..n]));
            rest = &rest[n..];
        }
        (shown, reader.finish())
    }

    fn names(p: &ParsedReply) -> Vec<(&str, &str)> {
        p.calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect()
    }

    #[test]
    fn hermes_blocks_become_calls_whatever_the_pieces() {
        let reply = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        for step in [1, 3, 7, 1000] {
            let (shown, parsed) = read(ToolSyntax::Hermes, reply, step);
            assert_eq!(shown, "Let me check.\n", "step {step}");
            assert_eq!(parsed.content, "");
            assert_eq!(
                names(&parsed),
                [("get_weather", "{\"city\":\"Paris\"}"), ("get_time", "{}")]
            );
        }
    }

    #[test]
    fn text_that_only_looks_like_a_marker_is_shown() {
        let (shown, parsed) = read(ToolSyntax::Hermes, "a <tool_ca b < c", 1);
        assert_eq!(shown + &parsed.content, "a <tool_ca b < c");
        assert!(parsed.calls.is_empty());
        // A block that is not a call stays text.
        let (shown, parsed) = read(ToolSyntax::Hermes, "x<tool_call>not json</tool_call>y", 2);
        assert_eq!(shown + &parsed.content, "x<tool_call>not json</tool_call>y");
        assert!(parsed.calls.is_empty());
    }

    #[test]
    fn mistral_lists_and_args_forms() {
        let (_, p) = read(
            ToolSyntax::Mistral,
            "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", \"arguments\": \"{}\"}]",
            5,
        );
        assert_eq!(names(&p), [("f", "{\"a\":1}"), ("g", "{}")]);
        assert!(p.calls.iter().all(|c| c.id.len() == 9));
        let (_, p) = read(ToolSyntax::Mistral, "[TOOL_CALLS]f[ARGS]{\"a\": 2}", 4);
        assert_eq!(names(&p), [("f", "{\"a\":2}")]);
    }

    #[test]
    fn whole_reply_syntaxes_decide_on_the_first_character() {
        let (shown, p) = read(
            ToolSyntax::Llama3,
            "  {\"name\": \"f\", \"parameters\": {\"x\": \"y\"}}",
            3,
        );
        assert_eq!(
            (shown.as_str(), names(&p)),
            ("", vec![("f", "{\"x\":\"y\"}")])
        );
        let (shown, p) = read(ToolSyntax::Llama3, "Hello {there}", 2);
        assert_eq!((shown.as_str(), p.content.as_str()), ("Hello {there}", ""));
        for step in [1, 2, 4, 100] {
            let reply = "{\"content\": \"Hi {x} \\\"q\\\" \\u00e9\\ud83d\\ude00\\n.\"}";
            let (shown, p) = read(ToolSyntax::Generic, reply, step);
            assert_eq!(
                shown + &p.content,
                "Hi {x} \"q\" \u{e9}\u{1f600}\n.",
                "step {step}"
            );
            assert!(p.calls.is_empty());
        }
        let (_, p) = read(
            ToolSyntax::Generic,
            "{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {}}, {\"name\": \"g\", \"arguments\": {\"n\": 1}}]}",
            6,
        );
        assert_eq!(names(&p), [("f", "{}"), ("g", "{\"n\":1}")]);
        // Unfinished JSON (max_tokens) is text.
        let (_, p) = read(ToolSyntax::Generic, "{\"tool_calls\": [{\"na", 3);
        assert_eq!(p.content, "{\"tool_calls\": [{\"na");
    }

    #[test]
    fn one_call_when_parallel_calls_are_off() {
        let mut reader = ReplyReader::new(ToolSyntax::Generic, false);
        reader.push("{\"tool_calls\": [{\"name\": \"f\"}, {\"name\": \"g\"}]}");
        assert_eq!(reader.finish().calls.len(), 1);
    }
}
