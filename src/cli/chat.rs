//! `inferd chat`: an interactive conversation rendered with the GGUF's own
//! chat template. One session lives for the whole conversation, so each
//! turn feeds only the tokens that are new since the last one.

use std::io::{BufRead, Write};

use clap::Args;
use minijinja::{context, Environment};

use super::{CliError, ModelArgs, SamplingArgs};
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
}

/// Renders a conversation with a GGUF chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos`/`eos` are the texts of the model's special tokens.
    pub fn new(source: &str, bos: String, eos: String) -> Result<Self, CliError> {
        let mut env = Environment::new();
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| CliError::Template(e.to_string()))?;
        Ok(Self { env, bos, eos })
    }

    /// Renders `messages` as (role, content) pairs, optionally opening an
    /// assistant turn at the end.
    pub fn render(
        &self,
        messages: &[(String, String)],
        add_generation_prompt: bool,
    ) -> Result<String, CliError> {
        let messages: Vec<_> = messages
            .iter()
            .map(|(role, content)| context! { role => role, content => content })
            .collect();
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| CliError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| CliError::Template(e.to_string()))
    }
}

/// A minimal ChatML template for models whose GGUF carries none.
const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

pub fn run(args: ChatArgs) -> Result<(), CliError> {
    let mut engine = args.model.engine()?;
    let tokenizer = Tokenizer::from_gguf(engine.model().gguf())?;
    let text_of = |id: Option<u32>| {
        id.and_then(|i| tokenizer.token_text(i))
            .unwrap_or("")
            .to_owned()
    };
    let template = ChatTemplate::new(
        tokenizer.chat_template().unwrap_or(CHATML),
        text_of(tokenizer.bos()),
        text_of(tokenizer.eos()),
    )?;
    let params = args.sampling.params()?;
    params.validate(engine.model().config.vocab)?;

    let mut messages: Vec<(String, String)> = Vec::new();
    if let Some(system) = &args.system {
        messages.push(("system".into(), system.clone()));
    }
    let mut session = engine.new_session();
    // The text the session's history stands for, to find each turn's new part.
    let mut rendered = String::new();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    eprintln!("(type a message; an empty line or end of input quits)");
    loop {
        write!(out, "> ")?;
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        messages.push(("user".into(), line.trim_end().to_owned()));
        let full = template.render(&messages, true)?;
        let new_text = match full.strip_prefix(rendered.as_str()) {
            Some(suffix) => suffix.to_owned(),
            None => {
                // The template re-rendered earlier turns differently; history
                // is append-only, so start a fresh session with the whole text.
                session = engine.new_session();
                full.clone()
            }
        };
        let add_bos = session.history().is_empty();
        let tokens = tokenizer.encode(&new_text, add_bos, true)?;
        engine.append(&mut session, &tokens)?;
        rendered = full;

        let mut decoder = StreamDecoder::new();
        let mut reply = String::new();
        let generation = engine.generate(
            &mut session,
            &params,
            args.max_tokens,
            tokenizer.eog_tokens(),
            |id| {
                if !tokenizer.is_control(id) {
                    if let Ok(text) = decoder.push(&tokenizer, id) {
                        reply.push_str(&text);
                        let _ = out.write_all(text.as_bytes());
                        let _ = out.flush();
                    }
                }
                true
            },
        )?;
        let rest = decoder.finish();
        reply.push_str(&rest);
        write!(out, "{rest}")?;
        writeln!(out)?;
        // What the history now holds beyond `rendered`: the reply tokens,
        // including the end-of-turn token when one was emitted.
        let tail = tokenizer.decode(&generation.tokens)?;
        rendered.push_str(&tail);
        messages.push(("assistant".into(), reply));
    }
    Ok(())
}
