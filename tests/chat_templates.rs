//! inferd's chat-template rendering (`inferd::chat_template`) against
//! Python's `jinja2` set up as Hugging Face transformers renders chat
//! templates (`tests/interop/render_template.py`), byte for byte.
//!
//! The templates are the ones inferd claims to support ([`CLAIMED`]):
//! model authors' templates as llama.cpp keeps them in `models/templates/`
//! of its source distribution (fetched by `scripts/fetch-vocabs` into the
//! `templates/` folder of `$INFERD_VOCAB_DIR` or `~/.cache/inferd/vocabs`),
//! and the templates GGUF files carry ([`GGUF_TEMPLATES`]: the reference
//! model's, and those of llama.cpp's vocabulary-only GGUFs for tokenizers
//! inferd supports), rendered with the special-token texts inferd's
//! tokenizer reads from the file, as `inferd chat` does.
//!
//! Every template renders every conversation of [`conversations`] (system
//! and user; user only; several turns; with and without the generation
//! prompt; non-ASCII, quotes and backslashes; reasoning in a reply; turns a
//! template may refuse). Where jinja2 renders text, inferd must render the
//! same bytes; where the template calls `raise_exception`, inferd must fail
//! with `TemplateError::Raised` carrying the same message; where jinja2
//! fails otherwise, inferd must fail too. `strftime_now` reads the same
//! fixed instant on both sides.
//!
//! A missing template file fails the test when `CI` or
//! `INFERD_REQUIRE_VOCABS` is set (scripts/test sets the latter) and is
//! skipped loudly otherwise; so is a missing Python environment
//! (`scripts/python-env`, which pins jinja2).

mod support;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use inferd::chat_template::{ChatTemplate, Clock, Message, TemplateError};
use inferd::gguf::GgufFile;
use inferd::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// The instant `strftime_now` formats on both sides: 2024-07-26 12:34:56
/// UTC (a Friday).
const NOW: i64 = 1_721_997_296;

/// A template from llama.cpp's `models/templates/`, with the texts of its
/// model's begin- and end-of-sequence tokens (as the model's GGUF and its
/// `tokenizer_config.json` name them).
struct Claimed {
    file: &'static str,
    bos: &'static str,
    eos: &'static str,
}

/// The chat templates inferd claims to render as their authors do.
const CLAIMED: &[Claimed] = &[
    Claimed {
        file: "meta-llama-Llama-3.1-8B-Instruct.jinja",
        bos: "<|begin_of_text|>",
        eos: "<|eot_id|>",
    },
    Claimed {
        // Reads the date through strftime_now.
        file: "meta-llama-Llama-3.2-3B-Instruct.jinja",
        bos: "<|begin_of_text|>",
        eos: "<|eot_id|>",
    },
    Claimed {
        file: "meta-llama-Llama-3.3-70B-Instruct.jinja",
        bos: "<|begin_of_text|>",
        eos: "<|eot_id|>",
    },
    Claimed {
        file: "Qwen-Qwen2.5-7B-Instruct.jinja",
        bos: "<|endoftext|>",
        eos: "<|im_end|>",
    },
    Claimed {
        file: "Qwen-Qwen3-0.6B.jinja",
        bos: "<|endoftext|>",
        eos: "<|im_end|>",
    },
    Claimed {
        file: "Qwen-QwQ-32B.jinja",
        bos: "<|endoftext|>",
        eos: "<|im_end|>",
    },
    Claimed {
        // Refuses turns that do not alternate (raise_exception).
        file: "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        bos: "<s>",
        eos: "</s>",
    },
    Claimed {
        file: "HuggingFaceTB-SmolLM3-3B.jinja",
        bos: "<|im_start|>",
        eos: "<|im_end|>",
    },
    Claimed {
        file: "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
        bos: "<｜begin▁of▁sentence｜>",
        eos: "<｜end▁of▁sentence｜>",
    },
    Claimed {
        file: "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        bos: "<｜begin▁of▁sentence｜>",
        eos: "<｜end▁of▁sentence｜>",
    },
    Claimed {
        file: "microsoft-Phi-3.5-mini-instruct.jinja",
        bos: "<s>",
        eos: "<|endoftext|>",
    },
];

/// GGUF files whose own template inferd renders: the reference model
/// (path relative to the repository) and llama.cpp's vocabulary-only
/// files (`ggml-vocab-NAME.gguf` in the vocabulary cache) that carry one.
const REFERENCE_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const GGUF_TEMPLATES: &[&str] = &["qwen2", "qwen35", "phi-3"];

/// A missing input: a failure when required, else a loud skip.
fn missing(what: &str) {
    assert!(!support::vocabs_required(), "{what}");
    eprintln!("\n*** SKIPPED: {what} ***\n");
}

/// The pinned virtualenv's python (scripts/python-env makes it once).
fn python() -> Option<PathBuf> {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let found = PYTHON.get_or_init(|| {
        let out = Command::new("scripts/python-env")
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("scripts/python-env did not run: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "scripts/python-env failed (exit {:?}); it needs python3 and pip access \
                 to PyPI the first time",
                out.status.code()
            ));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let python = PathBuf::from(stdout.lines().next_back().unwrap_or_default().trim());
        if python.is_file() {
            Ok(python)
        } else {
            Err(format!("scripts/python-env printed {python:?}, not a file"))
        }
    });
    match found {
        Ok(python) => Some(python.clone()),
        Err(e) => {
            missing(e);
            None
        }
    }
}

/// One conversation to render.
struct Conversation {
    what: &'static str,
    messages: Vec<Message>,
    add_generation_prompt: bool,
    /// The template's `tools` (None unless set).
    tools: Option<Value>,
}

/// The tools of the tool conversations, as an OpenAI request gives them.
fn offered_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The current weather of a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "get_time",
            "description": "The local time of a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}}, "required": ["city"]}}}
    ])
}

/// An assistant turn calling `calls` (id, function, arguments), as the
/// HTTP front door hands it to templates.
fn calling(calls: &[(&str, &str, &str)]) -> Message {
    let mut m = Message::new("assistant", "");
    m.tool_calls = Some(
        calls
            .iter()
            .map(|(id, name, args)| inferd::tools::template_call(id, name, args))
            .collect(),
    );
    m
}

/// A tool's result for the call `id`.
fn result(id: &str, name: &str, content: &str) -> Message {
    let mut m = Message::new("tool", content);
    m.tool_call_id = Some(id.to_owned());
    m.name = Some(name.to_owned());
    m
}

/// The conversations with tools: offered, called, answered.
fn tool_conversations() -> Vec<Conversation> {
    let m = Message::new;
    let with = |what, messages| Conversation {
        what,
        messages,
        add_generation_prompt: true,
        tools: Some(offered_tools()),
    };
    vec![
        with(
            "tools offered",
            vec![
                m("system", "You are a helpful assistant."),
                m("user", "What is the weather in Paris?"),
            ],
        ),
        with(
            "a tool call and its result",
            vec![
                m("user", "What is the weather in Paris?"),
                calling(&[("call1abcd", "get_weather", r#"{"city": "Paris"}"#)]),
                result("call1abcd", "get_weather", r#"{"temperature": 21}"#),
            ],
        ),
        with(
            "two calls at once and their results",
            vec![
                m("system", "Be brief."),
                m("user", "Weather and time in Oslo?"),
                calling(&[
                    (
                        "call1abcd",
                        "get_weather",
                        r#"{"city": "Oslo", "unit": "celsius"}"#,
                    ),
                    ("call2abcd", "get_time", r#"{"city": "Oslo"}"#),
                ]),
                result("call1abcd", "get_weather", "rain, 4 degrees"),
                result("call2abcd", "get_time", "14:05"),
                m("assistant", "It rains (4 °C); it is 14:05."),
                m("user", "Thanks!"),
            ],
        ),
    ]
}

fn conversations() -> Vec<Conversation> {
    let m = Message::new;
    let sys = || m("system", "You are a helpful assistant.");
    let conv = |what, messages, add_generation_prompt| Conversation {
        what,
        messages,
        add_generation_prompt,
        tools: None,
    };
    vec![
        conv(
            "system + user",
            vec![sys(), m("user", "What is the capital of France?")],
            true,
        ),
        conv("user only", vec![m("user", "Hello!")], true),
        conv(
            "user only, no generation prompt",
            vec![m("user", "Hello!")],
            false,
        ),
        conv(
            "system + user + assistant + user",
            vec![
                sys(),
                m("user", "Hi"),
                m("assistant", "Hello! How can I help?"),
                m("user", "Tell me a joke."),
            ],
            true,
        ),
        conv(
            "system + user + assistant, no generation prompt",
            vec![sys(), m("user", "Hi"), m("assistant", "Hello!")],
            false,
        ),
        conv(
            "user + assistant + user, no system",
            vec![
                m("user", "2+2?"),
                m("assistant", "4"),
                m("user", "And 3+3?"),
            ],
            true,
        ),
        conv(
            "non-ASCII, quotes and backslashes",
            vec![
                m("system", "Tu es « utile » ; réponds en français."),
                m(
                    "user",
                    "Qu'est-ce que \"naïveté\" ? 日本語 🙂 C:\\path\\n {{ x }} {% raw %}",
                ),
                m(
                    "assistant",
                    "C'est l'« ingénuité » — 'quoted' \"double\" \\ back.",
                ),
                m("user", "Merci ! ✓"),
            ],
            true,
        ),
        conv(
            "surrounding whitespace and empty content",
            vec![
                m("system", "  padded system \n"),
                m("user", "\n  padded user  \n"),
                m("assistant", ""),
                m("user", "\t"),
            ],
            true,
        ),
        conv(
            "a reply with its reasoning",
            vec![
                m("user", "Why?"),
                m("assistant", "<think>\nLet me think.\n</think>\n\nBecause."),
                m("user", "Sure?"),
            ],
            true,
        ),
        conv(
            "two user turns in a row",
            vec![m("user", "One."), m("user", "Two.")],
            true,
        ),
        conv(
            "a system message after the first turn",
            vec![
                m("user", "Hi"),
                m("assistant", "Hello"),
                m("system", "Be terse."),
                m("user", "Why?"),
            ],
            true,
        ),
    ]
    .into_iter()
    .chain(tool_conversations())
    .collect()
}

/// What one side made of one conversation.
#[derive(Debug)]
enum Outcome {
    Text(String),
    Raised(String),
    Failed(String),
}

/// jinja2's renderings of `conversations` with `template`, one process.
fn reference(python: &PathBuf, template: &str, bos: &str, eos: &str) -> Vec<Outcome> {
    let jobs: Vec<Value> = conversations()
        .iter()
        .map(|c| {
            json!({
                "template": template,
                "bos_token": bos,
                "eos_token": eos,
                "now": NOW,
                "messages": c.messages,
                "tools": c.tools,
                "add_generation_prompt": c.add_generation_prompt,
            })
        })
        .collect();
    let mut child = Command::new(python)
        .arg("tests/interop/render_template.py")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start render_template.py");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(serde_json::to_string(&jobs).expect("jobs").as_bytes())
        .expect("write jobs");
    let out = child.wait_with_output().expect("render_template.py ends");
    assert!(out.status.success(), "render_template.py failed");
    let results: Vec<Value> = serde_json::from_slice(&out.stdout).expect("results are JSON");
    assert_eq!(results.len(), jobs.len());
    results
        .into_iter()
        .map(|r| {
            let get = |k: &str| r.get(k).and_then(Value::as_str).map(str::to_owned);
            if let Some(text) = get("text") {
                Outcome::Text(text)
            } else if let Some(message) = get("raised") {
                Outcome::Raised(message)
            } else {
                Outcome::Failed(get("error").unwrap_or_else(|| r.to_string()))
            }
        })
        .collect()
}

/// inferd's renderings of `conversations` with `template`.
fn inferd(template: &str, bos: &str, eos: &str) -> Vec<Outcome> {
    let compiled = ChatTemplate::with_clock(template, bos, eos, Clock::Fixed(NOW));
    conversations()
        .iter()
        .map(|c| {
            let rendered = compiled.as_ref().map_err(Clone::clone).and_then(|t| {
                t.render_with_tools(&c.messages, c.tools.as_ref(), c.add_generation_prompt)
            });
            match rendered {
                Ok(text) => Outcome::Text(text),
                Err(TemplateError::Raised { message }) => Outcome::Raised(message),
                Err(e) => Outcome::Failed(e.to_string()),
            }
        })
        .collect()
}

/// Where two texts first differ, for the failure message.
fn first_difference(a: &str, b: &str) -> usize {
    a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
}

/// Compares both sides for every conversation; returns the failures and
/// how many conversations rendered to text.
fn compare(
    name: &str,
    template: &str,
    bos: &str,
    eos: &str,
    python: &PathBuf,
) -> (Vec<String>, usize) {
    let expected = reference(python, template, bos, eos);
    let got = inferd(template, bos, eos);
    let count = |f: fn(&Outcome) -> bool| expected.iter().filter(|o| f(o)).count();
    eprintln!(
        "{name}: jinja2 rendered {}, refused {}, failed {} of {} conversations",
        count(|o| matches!(o, Outcome::Text(_))),
        count(|o| matches!(o, Outcome::Raised(_))),
        count(|o| matches!(o, Outcome::Failed(_))),
        expected.len()
    );
    let mut failures = Vec::new();
    let mut texts = 0;
    for ((conv, want), have) in conversations().iter().zip(&expected).zip(&got) {
        let case = format!("{name} / {}", conv.what);
        match (want, have) {
            (Outcome::Text(w), Outcome::Text(h)) if w == h => texts += 1,
            (Outcome::Text(w), Outcome::Text(h)) => {
                let at = first_difference(w, h);
                failures.push(format!(
                    "{case}: renderings differ at byte {at}\n  jinja2: {w:?}\n  inferd: {h:?}"
                ));
            }
            (Outcome::Raised(w), Outcome::Raised(h)) if w == h => {
                // The message the user sees names the template's reason.
                let shown = TemplateError::Raised { message: h.clone() }.to_string();
                assert!(shown.contains(w.as_str()), "{case}: {shown}");
            }
            (Outcome::Failed(w), Outcome::Failed(h)) => {
                eprintln!("{case}: both fail\n  jinja2: {w}\n  inferd: {h}");
            }
            _ => failures.push(format!("{case}:\n  jinja2: {want:?}\n  inferd: {have:?}")),
        }
    }
    (failures, texts)
}

/// The special-token texts inferd's tokenizer gives for a GGUF, as
/// `inferd chat` passes them.
fn gguf_template(path: &PathBuf) -> (String, String, String) {
    let file = GgufFile::open(path).expect("GGUF opens");
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer loads");
    let text = |id: Option<u32>| {
        id.and_then(|i| tok.token_text(i))
            .unwrap_or_default()
            .to_owned()
    };
    let template = tok
        .chat_template()
        .unwrap_or_else(|| panic!("{} carries no chat template", path.display()))
        .to_owned();
    (template, text(tok.bos()), text(tok.eos()))
}

#[test]
fn claimed_templates_render_as_jinja2_renders_them() {
    let dir = support::vocab_dir().join("templates");
    let present: Vec<&Claimed> = CLAIMED
        .iter()
        .filter(|c| {
            let there = dir.join(c.file).is_file();
            if !there {
                missing(&format!(
                    "chat template {} not found in {} (run scripts/fetch-vocabs)",
                    c.file,
                    dir.display()
                ));
            }
            there
        })
        .collect();
    if present.is_empty() {
        return;
    }
    let Some(python) = python() else {
        return;
    };
    let mut failures = Vec::new();
    let mut raised = 0;
    for claimed in present {
        let template = std::fs::read_to_string(dir.join(claimed.file)).expect("template is UTF-8");
        let (mut f, texts) = compare(claimed.file, &template, claimed.bos, claimed.eos, &python);
        // Most conversations are ordinary: a template that renders few
        // of them is not one inferd can claim.
        if texts < 6 {
            f.push(format!(
                "{}: only {texts} conversations rendered",
                claimed.file
            ));
        }
        raised += inferd(&template, claimed.bos, claimed.eos)
            .iter()
            .filter(|o| matches!(o, Outcome::Raised(_)))
            .count();
        failures.extend(f);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    // The refusal path was exercised (Mistral Nemo refuses turns that do
    // not alternate).
    assert!(raised > 0, "no template refused any conversation");
}

#[test]
fn templates_carried_by_gguf_files_render_as_jinja2_renders_them() {
    let mut files = vec![(REFERENCE_MODEL.to_owned(), PathBuf::from(REFERENCE_MODEL))];
    for name in GGUF_TEMPLATES {
        let path = support::vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
        files.push((format!("ggml-vocab-{name}"), path));
    }
    let mut failures = Vec::new();
    let mut python_found = None;
    for (name, path) in files {
        if !path.is_file() {
            let hint = if name == REFERENCE_MODEL {
                "scripts/fetch-model"
            } else {
                "scripts/fetch-vocabs"
            };
            missing(&format!("{} not found (run {hint})", path.display()));
            continue;
        }
        if python_found.is_none() {
            python_found = python();
        }
        let Some(python) = &python_found else {
            return;
        };
        let (template, bos, eos) = gguf_template(&path);
        let (f, texts) = compare(&name, &template, &bos, &eos, python);
        failures.extend(f);
        assert!(texts >= 6, "{name}: only {texts} conversations rendered");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
