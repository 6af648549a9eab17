//! `inferd chat`: an interactive conversation rendered with the GGUF's own
//! chat template. One session lives for the whole conversation, so each
//! turn feeds only the tokens that are new since the last one. The session
//! lives in this process, or with `--server` on an inferd server; the
//! template and the tokenizer always run here.
//!
//! At a terminal the line is edited with history (`chat_input`); `/reset`,
//! `/save FILE`, `/load FILE`, `/help` and `/quit` are commands; a long
//! prompt is fed in chunks with its progress shown; each reply ends with
//! its tokens per second; Ctrl-C stops a reply (a second one ends the
//! process), and at the prompt ends the chat, whose server-side session is
//! closed on the way out.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use clap::Args;

use super::chat_input::{ChatInput, Line};
use super::client::{generate_request, RemoteClient};
use super::constrain::{to_proto, ConstraintArgs};
use super::remote::ConnectArgs;
use super::{CliError, ModelArgs, SamplingArgs};
use crate::chat_template::{ChatTemplate, Message};
use crate::constraint::{ConstraintCompiler, ConstraintSpec};
use crate::engine::{Engine, Session};
use crate::sampler::SamplingParams;
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Debug, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// System prompt (the template's default when absent).
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, short = 'n', default_value_t = 512)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// What every reply must match.
    #[command(flatten)]
    pub constraint: ConstraintArgs,
    /// Keep the session on an inferd server (`--server ADDR`) instead of
    /// loading the model here; --model then only supplies the tokenizer.
    #[command(flatten)]
    pub connect: ConnectArgs,
}

/// A minimal ChatML template for models whose GGUF carries none.
const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Gemma's turn format, for Gemma vocabularies whose GGUF carries no
/// template (the base models): no system role, so a system prompt opens
/// the first user turn, as Gemma 3's own template does.
const GEMMA: &str = "{{ bos_token }}\
{%- if messages and messages[0].role == 'system' -%}\
{%- set system = messages[0].content + '\\n\\n' -%}{%- set turns = messages[1:] -%}\
{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}\
{%- for m in turns -%}\
{{ '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\\n' }}\
{{- (system if loop.first else '') + (m.content | trim) + '<end_of_turn>\\n' }}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}";

/// The template for a GGUF without one: Gemma's format for a vocabulary
/// built around `<start_of_turn>`, else ChatML.
fn fallback_template(tokenizer: &Tokenizer) -> &'static str {
    let has = |text| tokenizer.token_id(text).is_some();
    if has("<start_of_turn>") && has("<end_of_turn>") {
        GEMMA
    } else {
        CHATML
    }
}

/// The conversation as messages, and the text the session's history
/// already stands for, so each turn feeds only what is new. Shared by the
/// local and the `--server` chat so both send exactly the same tokens.
pub struct Conversation<'t> {
    tokenizer: &'t Tokenizer,
    template: ChatTemplate,
    messages: Vec<Message>,
    /// What a new conversation starts with (the system prompt).
    initial: Vec<Message>,
    /// The rendered text the session's history holds, ending where the
    /// last reply ended.
    rendered: String,
}

/// The tokens one user turn appends to the session.
#[derive(Debug, PartialEq, Eq)]
pub struct TurnTokens {
    /// The template re-rendered earlier turns differently, so the history
    /// (append-only) no longer matches: the caller must start a fresh
    /// session, and `tokens` is then the whole conversation.
    pub fresh_session: bool,
    pub tokens: Vec<u32>,
}

impl<'t> Conversation<'t> {
    /// Starts a conversation with the tokenizer's own chat template (or
    /// [`fallback_template`] when the GGUF carries none).
    pub fn new(tokenizer: &'t Tokenizer, system: Option<&str>) -> Result<Self, CliError> {
        let source = tokenizer
            .chat_template()
            .unwrap_or_else(|| fallback_template(tokenizer));
        Self::with_template(tokenizer, source, system)
    }

    /// Starts a conversation rendered with the template `source`. A
    /// template that cannot render the start of this conversation (it does
    /// not parse, uses what `chat_template` lacks, or refuses the system
    /// prompt) is an error here, before anything is typed.
    pub fn with_template(
        tokenizer: &'t Tokenizer,
        source: &str,
        system: Option<&str>,
    ) -> Result<Self, CliError> {
        let text_of = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or("");
        let template =
            ChatTemplate::new(source, text_of(tokenizer.bos()), text_of(tokenizer.eos()))?;
        let messages: Vec<Message> = system
            .map(|s| vec![Message::new("system", s)])
            .unwrap_or_default();
        let mut probe = messages.clone();
        probe.push(Message::new("user", "Hello"));
        template.render(&probe, true)?;
        Ok(Self {
            tokenizer,
            template,
            initial: messages.clone(),
            messages,
            rendered: String::new(),
        })
    }

    /// The messages so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Replaces the conversation (a `/load`, or `/reset` with the initial
    /// messages); the caller starts a fresh session, which the next turn
    /// then feeds from the start.
    pub fn replace(&mut self, messages: Vec<Message>) {
        self.messages = messages;
        self.rendered.clear();
    }

    /// Back to how the conversation started.
    pub fn reset(&mut self) {
        self.replace(self.initial.clone());
    }

    /// Adds a user message and returns the tokens the session lacks: the
    /// rendered text past what it already holds, up to the opening of the
    /// assistant's turn.
    pub fn user_turn(&mut self, text: &str) -> Result<TurnTokens, CliError> {
        self.messages.push(Message::new("user", text));
        let full = self.template.render(&self.messages, true)?;
        let (fresh_session, new_text) = match full.strip_prefix(self.rendered.as_str()) {
            Some(suffix) => (false, suffix),
            None => (true, full.as_str()),
        };
        let add_bos = fresh_session || self.rendered.is_empty();
        let tokens = self.tokenizer.encode(new_text, add_bos, true)?;
        self.rendered = full;
        Ok(TurnTokens {
            fresh_session,
            tokens,
        })
    }

    /// Records the assistant's reply: `text` as shown, `generated` the ids
    /// the session committed (the end-of-turn token included when one was
    /// emitted), which is what the history now holds beyond the last turn.
    pub fn assistant_replied(&mut self, text: String, generated: &[u32]) -> Result<(), CliError> {
        let tail = self.tokenizer.decode(generated)?;
        self.rendered.push_str(&tail);
        self.messages.push(Message::new("assistant", text));
        Ok(())
    }
}

/// Prints a reply as it streams: control tokens are hidden, and a
/// character split across tokens is printed once whole.
pub struct ReplyPrinter<'t, W: Write> {
    tokenizer: &'t Tokenizer,
    decoder: StreamDecoder,
    reply: String,
    out: W,
}

impl<'t, W: Write> ReplyPrinter<'t, W> {
    pub fn new(tokenizer: &'t Tokenizer, out: W) -> Self {
        Self {
            tokenizer,
            decoder: StreamDecoder::new(),
            reply: String::new(),
            out,
        }
    }

    /// Prints the text `id` completes.
    pub fn push(&mut self, id: u32) -> std::io::Result<()> {
        if self.tokenizer.is_control(id) {
            return Ok(());
        }
        // An id the vocabulary lacks has no text to show; the history
        // still holds it, through the generated ids.
        if let Ok(text) = self.decoder.push(self.tokenizer, id) {
            self.reply.push_str(&text);
            self.out.write_all(text.as_bytes())?;
            self.out.flush()?;
        }
        Ok(())
    }

    /// Prints what is held back and ends the line; returns the reply text.
    pub fn finish(mut self) -> std::io::Result<String> {
        let rest = self.decoder.finish();
        self.reply.push_str(&rest);
        self.out.write_all(rest.as_bytes())?;
        writeln!(self.out)?;
        self.out.flush()?;
        Ok(self.reply)
    }
}

/// Where a chat's session lives: in this process, or on a server.
trait ChatBackend {
    /// Replaces the session with an empty one.
    fn restart(&mut self) -> Result<(), CliError>;
    /// Appends a turn's tokens to the session.
    fn append(&mut self, tokens: &[u32]) -> Result<(), CliError>;
    /// Generates a reply, streaming each token to `on_token` (false stops
    /// early); returns the ids committed to the session.
    fn reply(&mut self, on_token: &mut dyn FnMut(u32) -> bool) -> Result<Vec<u32>, CliError>;
}

/// Tokens fed per append of a turn; a longer prompt shows its progress.
const PREFILL_CHUNK: usize = 512;

const HELP: &str = "commands: /reset (a new conversation), /save FILE, /load FILE (the \
conversation as JSON messages), /help, /quit; Ctrl-C stops a reply; an empty line, Ctrl-D \
or Ctrl-C at the prompt ends the chat";

/// A line that is a chat command.
#[derive(Debug, PartialEq, Eq)]
enum Command<'a> {
    Reset,
    Save(&'a str),
    Load(&'a str),
    Help,
    Quit,
}

/// The command `line` is, if it is one (anything else is a message).
fn command(line: &str) -> Option<Command<'_>> {
    let line = line.trim();
    let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
    let rest = rest.trim();
    Some(match (word, rest.is_empty()) {
        ("/reset", true) => Command::Reset,
        ("/help", true) => Command::Help,
        ("/quit", true) | ("/exit", true) => Command::Quit,
        ("/save", false) => Command::Save(rest),
        ("/load", false) => Command::Load(rest),
        _ => return None,
    })
}

/// Set by Ctrl-C (SIGINT) while a reply runs: the reply stops at its next
/// token. A second Ctrl-C while it is set ends the process.
fn interrupt_flag() -> Result<Arc<AtomicBool>, CliError> {
    let flag = Arc::new(AtomicBool::new(false));
    let signal = signal_hook::consts::SIGINT;
    signal_hook::flag::register_conditional_shutdown(signal, 130, Arc::clone(&flag))?;
    signal_hook::flag::register(signal, Arc::clone(&flag))?;
    Ok(flag)
}

/// The conversation loop shared by every backend: a line is a user turn
/// or a command; an empty line or end of input ends the chat.
fn converse(
    tokenizer: &Tokenizer,
    system: Option<&str>,
    backend: &mut dyn ChatBackend,
) -> Result<(), CliError> {
    let mut conversation = Conversation::new(tokenizer, system)?;
    let mut input = ChatInput::new();
    let interrupted = interrupt_flag()?;
    let show_progress = std::io::stderr().is_terminal();
    let mut out = std::io::stdout();
    eprintln!("(type a message; /help lists the commands; an empty line or end of input quits)");
    loop {
        let line = match input.read("> ")? {
            Line::Text(text) if !text.trim().is_empty() => text,
            Line::Text(_) | Line::End | Line::Interrupted => break,
        };
        match command(&line) {
            Some(Command::Quit) => break,
            Some(Command::Help) => {
                eprintln!("({HELP})");
                continue;
            }
            Some(Command::Reset) => {
                conversation.reset();
                backend.restart()?;
                eprintln!("(a new conversation)");
                continue;
            }
            Some(Command::Save(path)) => {
                let json = serde_json::to_string_pretty(conversation.messages())
                    .map_err(|e| CliError::Usage(e.to_string()))?;
                match std::fs::write(path, json + "\n") {
                    Ok(()) => eprintln!(
                        "(saved {} messages to {path})",
                        conversation.messages().len()
                    ),
                    Err(e) => eprintln!("(cannot save to {path}: {e})"),
                }
                continue;
            }
            Some(Command::Load(path)) => {
                let loaded = std::fs::read_to_string(path)
                    .map_err(|e| e.to_string())
                    .and_then(|text| {
                        serde_json::from_str::<Vec<Message>>(&text).map_err(|e| e.to_string())
                    });
                match loaded {
                    Ok(messages) => {
                        let n = messages.len();
                        conversation.replace(messages);
                        backend.restart()?;
                        eprintln!(
                            "(loaded {n} messages from {path}; they are fed with the next turn)"
                        );
                    }
                    Err(e) => eprintln!("(cannot load {path}: {e})"),
                }
                continue;
            }
            None => {}
        }
        let turn = conversation.user_turn(line.trim_end())?;
        if turn.fresh_session {
            backend.restart()?;
        }
        feed(backend, &turn.tokens, show_progress)?;

        interrupted.store(false, Ordering::Release);
        let mut printer = ReplyPrinter::new(tokenizer, &mut out);
        let mut write_error = None;
        let mut first_token: Option<Instant> = None;
        let mut count = 0usize;
        let generated = backend.reply(&mut |id| {
            first_token.get_or_insert_with(Instant::now);
            count += 1;
            if let Err(e) = printer.push(id) {
                write_error = Some(e);
                return false;
            }
            !interrupted.load(Ordering::Acquire)
        })?;
        if let Some(e) = write_error {
            return Err(e.into());
        }
        let stopped = interrupted.swap(false, Ordering::AcqRel);
        let reply = printer.finish()?;
        conversation.assistant_replied(reply, &generated)?;
        let rate = first_token
            .map(|t| t.elapsed().as_secs_f64())
            .filter(|&s| s > 0.0 && count > 1)
            .map_or(String::new(), |s| {
                format!(", {:.1} tokens/s", (count - 1) as f64 / s)
            });
        let how = if stopped { "stopped: " } else { "" };
        eprintln!("({how}{count} tokens{rate})");
    }
    input.save_history();
    Ok(())
}

/// Appends a turn in chunks, showing how far a long one got.
fn feed(backend: &mut dyn ChatBackend, tokens: &[u32], show: bool) -> Result<(), CliError> {
    let show = show && tokens.len() > PREFILL_CHUNK;
    let mut done = 0;
    for chunk in tokens.chunks(PREFILL_CHUNK) {
        backend.append(chunk)?;
        done += chunk.len();
        if show {
            eprint!("\r(reading the prompt: {done}/{} tokens)", tokens.len());
        }
    }
    if show {
        eprint!("\r\x1b[K");
    }
    Ok(())
}

/// The chat's session in this process's own engine.
struct LocalChat {
    engine: Engine,
    session: Session,
    params: SamplingParams,
    max_tokens: usize,
    stops: Vec<u32>,
    /// Every reply's constraint, compiled afresh for each reply.
    constraint: Option<(Arc<ConstraintCompiler>, ConstraintSpec)>,
}

impl ChatBackend for LocalChat {
    fn restart(&mut self) -> Result<(), CliError> {
        self.session = self.engine.new_session();
        Ok(())
    }

    fn append(&mut self, tokens: &[u32]) -> Result<(), CliError> {
        Ok(self.engine.append(&mut self.session, tokens)?)
    }

    fn reply(&mut self, on_token: &mut dyn FnMut(u32) -> bool) -> Result<Vec<u32>, CliError> {
        let mut constraint = match &self.constraint {
            Some((compiler, spec)) => Some(
                compiler
                    .compile(spec)
                    .map_err(|e| CliError::Usage(e.to_string()))?,
            ),
            None => None,
        };
        let generation = self.engine.generate_constrained(
            &mut self.session,
            &self.params,
            self.max_tokens,
            &self.stops,
            constraint.as_mut(),
            on_token,
        )?;
        Ok(generation.tokens)
    }
}

pub fn run(args: ChatArgs) -> Result<(), CliError> {
    if args.connect.server.is_some() {
        return run_remote(args);
    }
    if let Some(flag) = args.connect.remote_only_flag_given() {
        return Err(CliError::Usage(format!("{flag} needs --server")));
    }
    let engine = args.model.engine()?;
    let tokenizer = Tokenizer::from_gguf(engine.model().gguf())?;
    let params = args.sampling.params()?;
    params.validate(engine.model().config.vocab)?;
    let session = engine.new_session();
    let constraint = match args.constraint.spec()? {
        Some(spec) => {
            let compiler = ConstraintCompiler::new(&tokenizer, engine.model().config.vocab)
                .map_err(|e| CliError::Usage(e.to_string()))?;
            // A constraint that does not compile is refused before the chat.
            compiler
                .compile(&spec)
                .map_err(|e| CliError::Usage(e.to_string()))?;
            Some((compiler, spec))
        }
        None => None,
    };
    let mut backend = LocalChat {
        engine,
        session,
        params,
        max_tokens: args.max_tokens,
        stops: tokenizer.eog_tokens().to_vec(),
        constraint,
    };
    converse(&tokenizer, args.system.as_deref(), &mut backend)
}

/// The chat's session on an inferd server: the template and the tokenizer
/// stay here, the server sees only token ids.
struct RemoteChat<'c> {
    client: &'c RemoteClient,
    session_id: String,
    params: SamplingParams,
    max_tokens: usize,
    stops: Vec<u32>,
    constraint: Option<ConstraintSpec>,
}

impl RemoteChat<'_> {
    const LABEL: &'static str = "inferd chat";
}

impl ChatBackend for RemoteChat<'_> {
    fn restart(&mut self) -> Result<(), CliError> {
        let old = std::mem::take(&mut self.session_id);
        // The old history is of no further use; if the server already let
        // it go (idle eviction), there is nothing left to close.
        if let Err(e) = self.client.close(&old) {
            tracing::warn!(session = %old, error = %e, "closing the replaced chat session");
        }
        let created = self.client.create_session(Self::LABEL, &self.stops)?;
        self.session_id = created.get_session_id().to_owned();
        Ok(())
    }

    fn append(&mut self, tokens: &[u32]) -> Result<(), CliError> {
        let appended = self.client.append(&self.session_id, tokens)?;
        let dropped = appended.get_dropped_token_count();
        if dropped > 0 {
            eprintln!("(the server dropped {dropped} old tokens to fit the context)");
        }
        Ok(())
    }

    fn reply(&mut self, on_token: &mut dyn FnMut(u32) -> bool) -> Result<Vec<u32>, CliError> {
        let mut req = generate_request(
            &self.session_id,
            self.max_tokens,
            &self.params,
            Some(self.params.seed),
        );
        if let Some(spec) = &self.constraint {
            req.set_constraint(to_proto(spec));
        }
        let mut generated = Vec::new();
        self.client.generate(
            &req,
            |id| {
                generated.push(id);
                on_token(id)
            },
            |dropped| eprintln!("(the server dropped {dropped} old tokens to fit the context)"),
        )?;
        Ok(generated)
    }
}

fn run_remote(args: ChatArgs) -> Result<(), CliError> {
    let tokenizer = super::load_tokenizer(&args.model.path())?;
    let params = args.sampling.params()?;
    params.validate(tokenizer.vocab_size())?;
    let client = RemoteClient::connect(&args.connect)?;
    let stops = tokenizer.eog_tokens().to_vec();
    let created = client.create_session(RemoteChat::LABEL, &stops)?;
    let mut backend = RemoteChat {
        client: &client,
        session_id: created.get_session_id().to_owned(),
        params,
        max_tokens: args.max_tokens,
        stops,
        constraint: args.constraint.spec()?,
    };
    let chatted = converse(&tokenizer, args.system.as_deref(), &mut backend);
    // The session is the server's memory: give it back even when the chat
    // failed, but report the chat's own error first.
    let session_id = std::mem::take(&mut backend.session_id);
    let closed = if session_id.is_empty() {
        Ok(0)
    } else {
        client.close(&session_id)
    };
    chatted?;
    closed?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat_template::TemplateError;
    use crate::gguf::synthetic::{SyntheticLlama, EOS_TOKEN_ID};
    use crate::gguf::GgufFile;

    fn tokenizer() -> Tokenizer {
        let file = GgufFile::from_bytes(SyntheticLlama::tiny().build()).expect("synthetic gguf");
        Tokenizer::from_gguf(&file).expect("synthetic tokenizer")
    }

    #[test]
    fn the_gemma_fallback_folds_the_system_prompt_into_the_first_turn() {
        let template = ChatTemplate::new(GEMMA, "<bos>", "<eos>").expect("parses");
        let messages = [
            Message::new("system", "Be brief."),
            Message::new("user", " Hi "),
            Message::new("assistant", "Hello."),
            Message::new("user", "Bye"),
        ];
        assert_eq!(
            template.render(&messages, true).expect("renders"),
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
             <start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            template.render(&messages[1..2], false).expect("renders"),
            "<bos><start_of_turn>user\nHi<end_of_turn>\n"
        );
        // The synthetic vocabulary has no Gemma turn tokens.
        assert_eq!(fallback_template(&tokenizer()), CHATML);
    }

    #[test]
    fn each_turn_feeds_only_what_the_history_lacks() {
        let tok = tokenizer();
        let mut chat = Conversation::new(&tok, Some("Be brief.")).expect("conversation");
        let first = chat.user_turn("Hi").expect("turn 1");
        assert!(!first.fresh_session);
        assert_eq!(
            tok.decode(&first.tokens).expect("decode"),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        // The reply as generated: its text, then the end-of-turn token.
        let mut reply = tok.encode("Hello!", false, false).expect("encode");
        reply.push(EOS_TOKEN_ID);
        chat.assistant_replied("Hello!".into(), &reply)
            .expect("reply");

        let second = chat.user_turn("Bye").expect("turn 2");
        assert!(!second.fresh_session);
        assert_eq!(
            tok.decode(&second.tokens).expect("decode"),
            "\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
        );
        // Everything fed, in order, is the whole conversation rendered once.
        let fed: Vec<u32> = [first.tokens, reply, second.tokens].concat();
        let whole = chat.template.render(&chat.messages, true).expect("render");
        assert_eq!(tok.decode(&fed).expect("decode"), whole);
    }

    #[test]
    fn a_reply_cut_off_before_its_end_token_is_closed_by_the_next_turn() {
        let tok = tokenizer();
        let mut chat = Conversation::new(&tok, None).expect("conversation");
        chat.user_turn("Hi").expect("turn 1");
        let reply = tok.encode("Hel", false, false).expect("encode");
        chat.assistant_replied("Hel".into(), &reply).expect("reply");
        let second = chat.user_turn("Go on").expect("turn 2");
        assert!(!second.fresh_session);
        assert_eq!(second.tokens[0], EOS_TOKEN_ID);
        assert_eq!(
            tok.decode(&second.tokens).expect("decode"),
            "<|im_end|>\n<|im_start|>user\nGo on<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn a_history_the_template_no_longer_renders_asks_for_a_fresh_session() {
        let tok = tokenizer();
        let mut chat = Conversation::new(&tok, None).expect("conversation");
        chat.user_turn("Hi").expect("turn 1");
        // The text recorded differs from what the session holds.
        let held = tok.encode("Hello", false, false).expect("encode");
        chat.assistant_replied("Howdy".into(), &held)
            .expect("reply");
        let second = chat.user_turn("Again").expect("turn 2");
        assert!(second.fresh_session);
        assert_eq!(
            tok.decode(&second.tokens).expect("decode"),
            chat.template.render(&chat.messages, true).expect("render")
        );
    }

    #[test]
    fn a_template_that_cannot_render_the_conversation_is_an_error_at_the_start() {
        let tok = tokenizer();
        let refuses_system = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}";
        let err = Conversation::with_template(&tok, refuses_system, Some("Be brief."))
            .err()
            .expect("a refused system prompt is an error");
        assert!(
            matches!(err, CliError::Template(TemplateError::Raised { .. })),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("System role not supported"),
            "{err}"
        );
        // Without a system prompt the same template is fine.
        Conversation::with_template(&tok, refuses_system, None).expect("no system prompt");
        // A filter minijinja lacks fails before any turn, naming it.
        let err = Conversation::with_template(&tok, "{{ messages | unknown_filter }}", None)
            .err()
            .expect("an unknown filter is an error");
        assert!(err.to_string().contains("unknown_filter"), "{err}");
    }

    #[test]
    fn commands_are_known_words_and_everything_else_is_a_message() {
        assert_eq!(command("/reset"), Some(Command::Reset));
        assert_eq!(
            command(" /save  chat.json "),
            Some(Command::Save("chat.json"))
        );
        assert_eq!(command("/load a b.json"), Some(Command::Load("a b.json")));
        assert_eq!(command("/quit"), Some(Command::Quit));
        assert_eq!(command("/help"), Some(Command::Help));
        assert_eq!(command("/save"), None, "a file is needed");
        assert_eq!(command("/reset now"), None);
        assert_eq!(command("/etc/hosts holds what?"), None);
        assert_eq!(command("hello /reset"), None);
    }

    #[test]
    fn the_reply_printer_hides_control_tokens_and_joins_split_characters() {
        let tok = tokenizer();
        let mut out = Vec::new();
        let mut printer = ReplyPrinter::new(&tok, &mut out);
        // Byte-level ids: é is C3 A9, split over two tokens.
        for id in [b'o' as u32, 0xC3, 0xA9, EOS_TOKEN_ID] {
            printer.push(id).expect("push");
        }
        let reply = printer.finish().expect("finish");
        assert_eq!(reply, "oé");
        assert_eq!(String::from_utf8(out).expect("utf-8"), "oé\n");
    }
}
