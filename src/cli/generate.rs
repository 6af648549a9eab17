//! `inferd generate`: one prompt in, its continuation out, as text or as
//! space-separated token ids for scripts.

use std::io::Write;

use clap::{Args, ValueEnum};

use super::{CliError, ModelArgs, SamplingArgs};
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text (tokenized with the model's own vocabulary, special tokens parsed).
    #[arg(
        long,
        short = 'p',
        conflicts_with = "tokens",
        required_unless_present = "tokens"
    )]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u32>>,
    /// Most tokens to generate.
    #[arg(long, short = 'n', default_value_t = 64)]
    pub max_tokens: usize,
    /// Keep going past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Output: the continuation as text, or its token ids.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub format: OutputFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Text,
    Ids,
}

pub fn run(args: GenerateArgs) -> Result<(), CliError> {
    let mut engine = args.model.engine()?;
    let tokenizer = Tokenizer::from_gguf(engine.model().gguf())?;
    let prompt = match (&args.prompt, &args.tokens) {
        (Some(text), _) => tokenizer.encode(text, true, true)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => return Err(CliError::Usage("give --prompt or --tokens".into())),
    };
    if prompt.is_empty() {
        return Err(CliError::Usage("the prompt is empty".into()));
    }
    let params = args.sampling.params()?;
    params.validate(engine.model().config.vocab)?;
    if args.sampling.seed.is_none() && !params.is_greedy() {
        eprintln!("seed: {}", params.seed);
    }
    let stops: &[u32] = if args.ignore_eos {
        &[]
    } else {
        tokenizer.eog_tokens()
    };

    let mut session = engine.new_session();
    engine.append(&mut session, &prompt)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut decoder = StreamDecoder::new();
    let mut first = true;
    let mut io_error = None;
    engine.generate(&mut session, &params, args.max_tokens, stops, |id| {
        let written = match args.format {
            OutputFormat::Ids => {
                let sep = if first { "" } else { " " };
                write!(out, "{sep}{id}")
            }
            OutputFormat::Text if tokenizer.is_control(id) => Ok(()),
            OutputFormat::Text => match decoder.push(&tokenizer, id) {
                Ok(text) => out.write_all(text.as_bytes()).and_then(|_| out.flush()),
                Err(_) => Ok(()),
            },
        };
        first = false;
        match written {
            Ok(()) => true,
            Err(e) => {
                io_error = Some(e);
                false
            }
        }
    })?;
    if let Some(e) = io_error {
        return Err(e.into());
    }
    // A character cut off by the token limit comes out as U+FFFD, not lost.
    if args.format == OutputFormat::Text {
        out.write_all(decoder.finish().as_bytes())?;
    }
    writeln!(out)?;
    Ok(())
}
