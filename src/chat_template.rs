//! Chat templates: a conversation -> the prompt text a model was trained on.
//!
//! A GGUF carries its model's chat template (`tokenizer.chat_template`), a
//! Jinja template written for Python's `jinja2` as Hugging Face
//! transformers renders it (`apply_chat_template`). [`ChatTemplate`]
//! renders it with minijinja set up the same way, so that the prompt is the
//! one the model's authors meant, byte for byte:
//!
//! - `trim_blocks` and `lstrip_blocks` on, the template's final newline
//!   dropped (`keep_trailing_newline` off), no auto-escaping;
//! - `{% break %}` / `{% continue %}` (jinja2's `loopcontrols` extension);
//! - the globals `raise_exception(message)` (the template refuses the
//!   conversation: [`TemplateError::Raised`] carries the message) and
//!   `strftime_now(format)` (the date from a [`Clock`], UTC);
//! - `tojson` as transformers overrides it: `json.dumps` with
//!   `ensure_ascii=False`, optional `indent`, `separators`, `sort_keys`;
//! - Python's string, dict and list methods (`.strip()`, `.split()`,
//!   `.startswith()`, `.items()`, `.get()`, ...) through minijinja-contrib's
//!   `pycompat`; maps keep their insertion order, as Python dicts do;
//! - printed values as Python's `str()` writes them (`None`, `True`,
//!   `1e-05`, `['a', 'b']`);
//! - the render context `apply_chat_template` passes: `messages`,
//!   `tools=None`, `documents=None`, `add_generation_prompt`, `bos_token`,
//!   `eos_token`.
//!
//! `tests/chat_templates.rs` checks this against `jinja2` itself for the
//! templates inferd claims. A template that uses what this does not
//! implement (transformers' `{% generation %}` tag, a Python method
//! pycompat lacks) fails with a [`TemplateError`] naming the problem; it
//! never renders a different prompt silently.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind, Output, State, UndefinedBehavior, Value};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The name the template is registered under (it shows in no message).
const NAME: &str = "chat_template";

/// One turn of a conversation, as transformers hands it to a template:
/// the tool fields are absent unless set, and an assistant turn that only
/// calls tools has `content` None (as OpenAI clients send it).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, or whatever the template
    /// knows.
    pub role: String,
    pub content: String,
    /// An assistant turn's calls: `{"id", "type": "function", "function":
    /// {"name", "arguments"}}`, the arguments an object where they parse as
    /// one (templates print them with `tojson`).
    #[serde(default)]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool turn: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// A tool turn: the function that answered.
    #[serde(default)]
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }

    /// An assistant turn with calls and no text.
    fn calls_only(&self) -> bool {
        self.tool_calls.is_some() && self.content.is_empty()
    }

    /// The turn as the template sees it; `null_content`: a calls-only
    /// turn's content is None rather than "".
    fn write<S: serde::Serializer>(
        &self,
        serializer: S,
        null_content: bool,
    ) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("role", &self.role)?;
        let content = (!(null_content && self.calls_only())).then_some(&self.content);
        map.serialize_entry("content", &content)?;
        if let Some(calls) = &self.tool_calls {
            map.serialize_entry("tool_calls", calls)?;
        }
        if let Some(id) = &self.tool_call_id {
            map.serialize_entry("tool_call_id", id)?;
        }
        if let Some(name) = &self.name {
            map.serialize_entry("name", name)?;
        }
        map.end()
    }
}

impl Serialize for Message {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.write(serializer, true)
    }
}

/// A turn whose content is a string even when it only calls tools.
struct WithText<'a>(&'a Message);

impl Serialize for WithText<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.write(serializer, false)
    }
}

/// Why a chat template gave no prompt.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TemplateError {
    /// The template text is not valid Jinja (as minijinja reads it).
    #[error("the chat template does not parse: {detail}")]
    Syntax { detail: String },
    /// The template called `raise_exception(message)`: it refuses this
    /// conversation (a role it does not support, turns out of order, ...).
    #[error("the chat template refuses this conversation: {message}")]
    Raised { message: String },
    /// Rendering failed otherwise: an unknown filter, function or method,
    /// an operation on values of the wrong type, a `strftime_now` format
    /// it cannot write, a value `tojson` cannot serialise.
    #[error("the chat template failed to render: {detail}")]
    Render { detail: String },
}

/// What `strftime_now` reads the time from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// The system clock, in UTC (transformers uses the local time; the
    /// date differs only near midnight outside UTC).
    System,
    /// A fixed instant, in seconds since the Unix epoch (UTC): for tests.
    Fixed(i64),
}

impl Clock {
    fn now(self) -> i64 {
        match self {
            Clock::Fixed(t) => t,
            Clock::System => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX)),
        }
    }
}

/// A compiled chat template with the model's special-token texts.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos` and `eos` are the texts of the model's
    /// begin- and end-of-sequence tokens. `strftime_now` reads the system
    /// clock.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self, TemplateError> {
        Self::with_clock(source, bos, eos, Clock::System)
    }

    /// As [`ChatTemplate::new`], with `strftime_now` reading `clock`.
    pub fn with_clock(
        source: &str,
        bos: &str,
        eos: &str,
        clock: Clock,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        // Errors carry the line; a copy of the template's state per error
        // (debug mode) is not needed for that.
        env.set_debug(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function(
            "strftime_now",
            move |format: &str| -> Result<String, Error> {
                strftime(format, clock.now())
                    .map_err(|detail| Error::new(ErrorKind::InvalidOperation, detail))
            },
        );
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| TemplateError::Syntax {
                detail: describe(&e),
            })?;
        Ok(Self {
            env,
            bos: bos.to_owned(),
            eos: eos.to_owned(),
        })
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends by
    /// opening the assistant's turn.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// As [`ChatTemplate::render`], with the template's `tools` set to
    /// `tools` (OpenAI's list of `{"type": "function", "function": {...}}`)
    /// instead of None.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let tools = tools.map(Value::from_serialize);
        let rendered = self.render_value(
            Value::from_serialize(messages),
            tools.clone(),
            add_generation_prompt,
        );
        match rendered {
            // Templates that test `'x' in message.content` fail on a None
            // content (transformers' too); llama.cpp and vLLM give those
            // "", and so does this.
            Err(TemplateError::Render { .. }) if messages.iter().any(Message::calls_only) => {
                let filled: Vec<WithText<'_>> = messages.iter().map(WithText).collect();
                self.render_value(Value::from_serialize(&filled), tools, add_generation_prompt)
            }
            rendered => rendered,
        }
    }

    fn render_value(
        &self,
        messages: Value,
        tools: Option<Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| TemplateError::Syntax {
                detail: describe(&e),
            })?;
        template
            .render(context! {
                messages => messages,
                tools => tools,
                documents => (),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos,
                eos_token => self.eos,
            })
            .map_err(|e| match raised_message(&e) {
                Some(message) => TemplateError::Raised { message },
                None => TemplateError::Render {
                    detail: describe(&e),
                },
            })
    }
}

/// The marker `raise_exception` attaches to its error, so a refusal is
/// told apart from a failure however deep in the template it happened.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// The message of the `raise_exception` call behind `err`, if any.
fn raised_message(err: &Error) -> Option<String> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cause {
        if let Some(raised) = e.downcast_ref::<Raised>() {
            return Some(raised.0.clone());
        }
        cause = e.source();
    }
    None
}

/// A minijinja error as one line: what went wrong, where, and why.
fn describe(err: &Error) -> String {
    let mut text = match err.detail() {
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    };
    if let Some(line) = err.line() {
        let _ = write!(text, " (line {line})");
    }
    let mut cause = std::error::Error::source(err);
    while let Some(e) = cause {
        let _ = write!(text, ": {e}");
        cause = e.source();
    }
    text
}

// ---------------------------------------------------------------------------
// Printing values as Python's str() does
// ---------------------------------------------------------------------------

/// `{{ value }}` as jinja2 prints it: Python's `str(value)`. Strings and
/// undefined print as minijinja does (the text; nothing).
fn python_formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            python_repr(&mut text, value, true)?;
            out.write_str(&text).map_err(Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr(value)` (or `str(value)` at the top level when `top`:
/// a string is then its text).
fn python_repr(out: &mut String, value: &Value, top: bool) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => match as_float(value) {
            Some(f) => out.push_str(&python_float(f, false)),
            None => {
                let _ = write!(out, "{value}");
            }
        },
        ValueKind::String if top => out.push_str(value.as_str().unwrap_or_default()),
        ValueKind::String => python_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &item, false)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &key, false)?;
                out.push_str(": ");
                python_repr(out, &value.get_item(&key)?, false)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// Python's `repr` of a string: single quotes unless the text has a single
/// quote and no double quote; backslash, the quote, and control characters
/// escaped.
fn python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// The value as an f64 when it is a float (not an integer).
fn as_float(value: &Value) -> Option<f64> {
    if value.kind() != ValueKind::Number || value.is_integer() {
        return None;
    }
    f64::try_from(value.clone()).ok()
}

/// Python's `repr(float)`: the shortest digits that read back the same,
/// positional from 1e-4 up to below 1e16, else `1e-05` / `1.5e+16`.
/// `json` spells the non-finite values as `json.dumps` does.
fn python_float(f: f64, json: bool) -> String {
    if f.is_nan() {
        return if json { "NaN" } else { "nan" }.to_owned();
    }
    if f.is_infinite() {
        let s = match (json, f > 0.0) {
            (true, true) => "Infinity",
            (true, false) => "-Infinity",
            (false, true) => "inf",
            (false, false) => "-inf",
        };
        return s.to_owned();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exp) {
        let mut m = digits[..1].to_owned();
        if digits.len() > 1 {
            m.push('.');
            m.push_str(&digits[1..]);
        }
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{m}e{esign}{:02}", exp.unsigned_abs());
    }
    // Positional: the point goes after digit `exp + 1` (may need zeros).
    let point = exp + 1;
    let text = if point <= 0 {
        format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
    } else {
        let point = point as usize;
        if digits.len() <= point {
            format!("{digits}{}.0", "0".repeat(point - digits.len()))
        } else {
            format!("{}.{}", &digits[..point], &digits[point..])
        }
    };
    format!("{sign}{text}")
}

// ---------------------------------------------------------------------------
// tojson, as transformers defines it
// ---------------------------------------------------------------------------

/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: the filter transformers installs in place of
/// jinja2's HTML-safe one. Arguments by name, or the first three by
/// position.
fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let arg = |positional: Option<Value>, name: &str| -> Result<Value, Error> {
        match kwargs.get::<Option<Value>>(name)? {
            Some(v) => Ok(v),
            None => Ok(positional.unwrap_or(Value::from(()))),
        }
    };
    let ensure_ascii = arg(ensure_ascii, "ensure_ascii")?.is_true();
    let indent = match arg(indent, "indent")? {
        v if v.is_none() || v.is_undefined() => None,
        v if v.is_integer() => {
            let n = v.as_i64().unwrap_or(0).max(0);
            Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
        }
        v if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
        v => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: indent must be an integer or a string, not {}",
                    v.kind()
                ),
            ))
        }
    };
    let (item_sep, key_sep) = match arg(separators, "separators")? {
        v if v.is_none() || v.is_undefined() => {
            let item = if indent.is_some() { "," } else { ", " };
            (item.to_owned(), ": ".to_owned())
        }
        v => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_owned(),
                    b.as_str().unwrap_or_default().to_owned(),
                ),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
    };
    let sort_keys = arg(None, "sort_keys")?.is_true();
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

/// How `json.dumps` was asked to write.
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonStyle {
    /// A newline and the indent for `level`, when indenting.
    fn newline(&self, out: &mut String, level: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }
}

fn not_serialisable(value: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "tojson: a value of type {} is not JSON serializable",
            value.kind()
        ),
    )
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    level: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match as_float(value) {
            Some(f) => out.push_str(&python_float(f, true)),
            None => {
                let _ = write!(out, "{value}");
            }
        },
        ValueKind::String => {
            json_string(out, value.as_str().unwrap_or_default(), style.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                style.newline(out, level + 1);
                write_json(out, item, style, level + 1)?;
            }
            style.newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                style.newline(out, level + 1);
                json_string(out, key, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, item, style, level + 1)?;
            }
            style.newline(out, level);
            out.push('}');
        }
        _ => return Err(not_serialisable(value)),
    }
    Ok(())
}

/// A map key as `json.dumps` writes it: strings as they are, numbers,
/// booleans and None as their JSON text.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::Number => Ok(match as_float(key) {
            Some(f) => python_float(f, true),
            None => key.to_string(),
        }),
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "tojson: keys must be str, int, float, bool or None, not {}",
                key.kind()
            ),
        )),
    }
}

/// A JSON string as Python's encoder writes it: `"`, `\` and control
/// characters escaped (`\n`, `\u001b`), and with `ensure_ascii` everything
/// outside printable ASCII as `\uXXXX` (surrogate pairs above U+FFFF).
pub(crate) fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------
// strftime_now
// ---------------------------------------------------------------------------

const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// The civil date (year, month 1-12, day 1-31) of a day count since
/// 1970-01-01 (proleptic Gregorian; Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11], March first
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

/// `time.strftime(format)` at `unix` seconds, UTC, C locale, for the
/// directives Python documents as portable (plus `%e`); any other
/// directive is an error naming it.
fn strftime(format: &str, unix: i64) -> Result<String, String> {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let month_index = (month - 1) as usize;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[month_index] + day + u32::from(month > 2 && is_leap(year));

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            return Err("strftime_now: the format ends in a lone '%'".to_owned());
        };
        let _ = match d {
            'a' => write!(out, "{}", &DAYS[weekday][..3]),
            'A' => write!(out, "{}", DAYS[weekday]),
            'b' | 'h' => write!(out, "{}", &MONTHS[month_index][..3]),
            'B' => write!(out, "{}", MONTHS[month_index]),
            'd' => write!(out, "{day:02}"),
            'e' => write!(out, "{day:2}"),
            'm' => write!(out, "{month:02}"),
            'y' => write!(out, "{:02}", year.rem_euclid(100)),
            'Y' => write!(out, "{year}"),
            'H' => write!(out, "{hour:02}"),
            'I' => write!(out, "{:02}", if hour % 12 == 0 { 12 } else { hour % 12 }),
            'p' => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            'M' => write!(out, "{minute:02}"),
            'S' => write!(out, "{second:02}"),
            'j' => write!(out, "{yday:03}"),
            'w' => write!(out, "{}", (weekday + 1) % 7),
            'u' => write!(out, "{}", weekday + 1),
            'F' => write!(out, "{year}-{month:02}-{day:02}"),
            'T' => write!(out, "{hour:02}:{minute:02}:{second:02}"),
            'Z' => write!(out, "UTC"),
            'z' => write!(out, "+0000"),
            '%' => write!(out, "%"),
            other => return Err(format!("strftime_now: unsupported directive '%{other}'")),
        };
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2024-07-26 12:34:56 UTC, a Friday.
    const FRIDAY: i64 = 1_721_997_296;

    fn render(source: &str, messages: &[Message], gen: bool) -> Result<String, TemplateError> {
        ChatTemplate::with_clock(source, "<s>", "</s>", Clock::Fixed(FRIDAY))?.render(messages, gen)
    }

    fn user(text: &str) -> Vec<Message> {
        vec![Message::new("user", text)]
    }

    #[test]
    fn blocks_trim_the_newline_after_them_and_strip_the_indent_before() {
        let source = "{% for m in messages %}\n    {% if true %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        assert_eq!(render(source, &user("hi"), false).unwrap(), "[hi]\n");
    }

    #[test]
    fn raise_exception_is_a_refusal_carrying_the_message() {
        let source = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok";
        let err = render(source, &[Message::new("system", "x")], true).unwrap_err();
        assert_eq!(
            err,
            TemplateError::Raised {
                message: "System role not supported".into()
            }
        );
        assert!(err.to_string().contains("System role not supported"));
        // Raised from inside a macro and a loop too.
        let source = "{% macro check(m) %}{% if m.role == 'tool' %}{{ raise_exception('no tools: ' ~ m.content) }}{% endif %}{% endmacro %}{% for m in messages %}{{ check(m) }}{% endfor %}";
        let err = render(source, &[Message::new("tool", "t1")], true).unwrap_err();
        assert_eq!(
            err,
            TemplateError::Raised {
                message: "no tools: t1".into()
            }
        );
    }

    #[test]
    fn a_template_that_does_not_parse_or_render_is_an_error_naming_the_problem() {
        let err = ChatTemplate::new("{% for m in messages %}", "", "").unwrap_err();
        assert!(matches!(err, TemplateError::Syntax { .. }), "{err:?}");
        assert!(err.to_string().contains("line 1"), "{err}");
        let err = render("\n{{ messages | no_such_filter }}", &user("x"), true).unwrap_err();
        assert!(matches!(err, TemplateError::Render { .. }), "{err:?}");
        assert!(err.to_string().contains("no_such_filter"), "{err}");
        assert!(err.to_string().contains("line 2"), "{err}");
        // transformers' generation tag is not known here: an error.
        let err = ChatTemplate::new("{% generation %}x{% endgeneration %}", "", "").unwrap_err();
        assert!(matches!(err, TemplateError::Syntax { .. }), "{err:?}");
    }

    #[test]
    fn strftime_now_reads_the_clock() {
        let source = "{{ strftime_now('%d %b %Y|%A %B %e %j %H:%M:%S %I%p %y %F %%') }}";
        assert_eq!(
            render(source, &user(""), false).unwrap(),
            "26 Jul 2024|Friday July 26 208 12:34:56 12PM 24 2024-07-26 %"
        );
        let err = render("{{ strftime_now('%Q') }}", &user(""), false).unwrap_err();
        assert!(err.to_string().contains("'%Q'"), "{err}");
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(strftime("%j", 1_735_603_200).unwrap(), "366"); // 2024-12-31
    }

    #[test]
    fn tojson_is_python_json_dumps_without_ascii_escapes() {
        let messages = vec![Message::new("user", "héllo \"<b>\" \\ \n\t\u{1}🙂")];
        assert_eq!(
            render("{{ messages[0] | tojson }}", &messages, false).unwrap(),
            r#"{"role": "user", "content": "héllo \"<b>\" \\ \n\t\u0001🙂"}"#
        );
        assert_eq!(
            render(
                "{{ messages[0].content | tojson(ensure_ascii=true) }}",
                &messages,
                false
            )
            .unwrap(),
            r#""h\u00e9llo \"<b>\" \\ \n\t\u0001\ud83d\ude42""#
        );
        assert_eq!(
            render(
                "{{ {'b': [1, 2.5, none, true], 'a': {}} | tojson(indent=2) }}",
                &[],
                false
            )
            .unwrap(),
            "{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": {}\n}"
        );
        assert_eq!(
            render(
                "{{ {'b': 1, 'a': []} | tojson(separators=(',', ':'), sort_keys=true) }}",
                &[],
                false
            )
            .unwrap(),
            r#"{"a":[],"b":1}"#
        );
    }

    #[test]
    fn values_print_as_python_str_writes_them() {
        assert_eq!(
            render("{{ none }} {{ true }} {{ false }} {{ 1.0 }} {{ 0.00001 }} {{ 1e16 }} {{ 3 }} {{ ['a', \"it's\", none] }} {{ {'k': 1.5} }} {{ undefined_name }}|", &[], false).unwrap(),
            "None True False 1.0 1e-05 1e+16 3 ['a', \"it's\", None] {'k': 1.5} |"
        );
        assert_eq!(python_float(0.0001, false), "0.0001");
        assert_eq!(python_float(123_456_789.125, false), "123456789.125");
        assert_eq!(python_float(1e15, false), "1000000000000000.0");
        assert_eq!(python_float(-2.5e-7, false), "-2.5e-07");
        assert_eq!(python_float(1.5e300, false), "1.5e+300");
        assert_eq!(python_float(f64::INFINITY, true), "Infinity");
    }

    #[test]
    fn python_methods_and_loop_controls_work() {
        let source = "{% for m in messages %}{% if loop.index0 == 2 %}{% break %}{% endif %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content.strip().split(' ')[-1] }}|{{ m.content.startswith(' a') }}|{% for k, v in m.items() %}{{ k }}={{ v.lstrip() }};{% endfor %}{{ m.get('missing', 'd') }}\n{% endfor %}";
        let messages = vec![
            Message::new("system", "skipped"),
            Message::new("user", " a b "),
            Message::new("user", "never"),
        ];
        assert_eq!(
            render(source, &messages, false).unwrap(),
            "b|True|role=user;content=a b ;d\n"
        );
    }

    #[test]
    fn the_context_is_what_transformers_passes() {
        let source = "{{ bos_token }}{{ tools is none }}{{ documents is none }}{{ add_generation_prompt }}{{ eos_token }}";
        assert_eq!(render(source, &[], true).unwrap(), "<s>TrueTrueTrue</s>");
    }
}
