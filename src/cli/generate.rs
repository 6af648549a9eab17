//! `inferd generate`: one prompt in, its continuation out, as text or as
//! space-separated token ids for scripts. With `--server` the prompt is
//! tokenized here and continued in a throwaway session on an inferd server;
//! the output is the same either way.

use std::io::Write;

use clap::{Args, ValueEnum};

use super::client::{generate_request, GenerateEnd, RemoteClient};
use super::constrain::{to_proto, ConstraintArgs};
use super::remote::ConnectArgs;
use super::{CliError, ModelArgs, SamplingArgs};
use std::sync::Arc;

use crate::engine::{Draft, Engine, EngineConfig, Proposer};
use crate::model::Model;
use crate::sampler::SamplingParams;
use crate::speculate::Lookup;
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
    #[command(flatten)]
    pub constraint: ConstraintArgs,
    /// Speculative decoding: `lookup` verifies tokens the history proposes
    /// (prompt lookup) several per forward pass, `draft` the tokens a
    /// draft model (--draft-model) proposes, with the very tokens plain
    /// decoding gives either way (docs/PERFORMANCE.md); `none` decodes one
    /// token per pass. A constrained generation samples each proposed
    /// position under its own mask; one on a GPU decodes plainly
    /// [default: draft with --draft-model, else lookup; with
    /// --server, the server's default; there `lookup` and `draft` both ask
    /// the server to speculate its own way].
    #[arg(long, value_enum)]
    pub speculate: Option<Speculate>,
    /// A smaller GGUF model with the same vocabulary (the same tokens in
    /// the same order) that proposes tokens for `--speculate draft`.
    #[arg(long, conflicts_with = "server")]
    pub draft_model: Option<std::path::PathBuf>,
    /// Tokens the draft model proposes each step, 1-15 [default: as many
    /// as are expected to pay, from the acceptance and the draft's cost
    /// measured as it runs; none while drafting does not pay].
    #[arg(long, requires = "draft_model", value_parser = clap::value_parser!(u16).range(1..=15))]
    pub draft_tokens: Option<u16>,
    /// Output: the continuation as text, or its token ids.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub format: OutputFormat,
    /// Continue the prompt on an inferd server (`--server ADDR`) instead of
    /// loading the model here; --model then only supplies the tokenizer.
    #[command(flatten)]
    pub connect: ConnectArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Speculate {
    None,
    Lookup,
    Draft,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Text,
    Ids,
}

/// Writes a continuation as it streams, in the chosen format: ids
/// space-separated on one line, or text with control tokens hidden and
/// characters split across tokens held back until whole.
pub struct ContinuationWriter<'t, W: Write> {
    text: Option<(&'t Tokenizer, StreamDecoder)>,
    first: bool,
    out: W,
}

impl<'t, W: Write> ContinuationWriter<'t, W> {
    /// Writes ids.
    pub fn ids(out: W) -> Self {
        Self {
            text: None,
            first: true,
            out,
        }
    }

    /// Writes text decoded with `tokenizer`.
    pub fn text(tokenizer: &'t Tokenizer, out: W) -> Self {
        Self {
            text: Some((tokenizer, StreamDecoder::new())),
            first: true,
            out,
        }
    }

    /// Writes `format`, decoding text with `tokenizer`.
    pub fn new(format: OutputFormat, tokenizer: &'t Tokenizer, out: W) -> Self {
        match format {
            OutputFormat::Ids => Self::ids(out),
            OutputFormat::Text => Self::text(tokenizer, out),
        }
    }

    /// Writes one token and flushes, so a reader sees it at once.
    pub fn push(&mut self, id: u32) -> std::io::Result<()> {
        match &mut self.text {
            None => {
                let sep = if self.first { "" } else { " " };
                write!(self.out, "{sep}{id}")?;
            }
            Some((tokenizer, _)) if tokenizer.is_control(id) => {}
            Some((tokenizer, decoder)) => {
                // An id outside the vocabulary has no text to show.
                if let Ok(text) = decoder.push(tokenizer, id) {
                    self.out.write_all(text.as_bytes())?;
                }
            }
        }
        self.first = false;
        self.out.flush()
    }

    /// Writes what is held back and ends the line. A character cut off by
    /// the token limit comes out as U+FFFD, not lost.
    pub fn finish(mut self) -> std::io::Result<()> {
        if let Some((_, decoder)) = &mut self.text {
            self.out.write_all(decoder.finish().as_bytes())?;
        }
        writeln!(self.out)?;
        self.out.flush()
    }
}

/// The prompt's token ids: `--prompt` tokenized (BOS added, special
/// tokens parsed), or `--tokens` as given.
fn prompt_tokens(args: &GenerateArgs, tokenizer: &Tokenizer) -> Result<Vec<u32>, CliError> {
    let prompt = match (&args.prompt, &args.tokens) {
        (Some(text), _) => tokenizer.encode(text, true, true)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => return Err(CliError::Usage("give --prompt or --tokens".into())),
    };
    if prompt.is_empty() {
        return Err(CliError::Usage("the prompt is empty".into()));
    }
    Ok(prompt)
}

/// The sampler parameters, checked against `vocab`; announces a drawn seed
/// so a sampled run can be repeated.
fn sampling_params(args: &GenerateArgs, vocab: usize) -> Result<SamplingParams, CliError> {
    let params = args.sampling.params()?;
    params.validate(vocab)?;
    if args.sampling.seed.is_none() && !params.is_greedy() {
        eprintln!("seed: {}", params.seed);
    }
    Ok(params)
}

/// Runs `generate` through `writer`, keeping the first write error.
fn write_through<'a, 't, W: Write>(
    writer: &'a mut ContinuationWriter<'t, W>,
    io_error: &'a mut Option<std::io::Error>,
) -> impl FnMut(u32) -> bool + use<'a, 't, W> {
    move |id| match writer.push(id) {
        Ok(()) => true,
        Err(e) => {
            *io_error = Some(e);
            false
        }
    }
}

pub fn run(args: GenerateArgs) -> Result<(), CliError> {
    if args.connect.server.is_some() {
        return run_remote(args);
    }
    if let Some(flag) = args.connect.remote_only_flag_given() {
        return Err(CliError::Usage(format!("{flag} needs --server")));
    }
    let mut engine = args.model.engine()?;
    let tokenizer = Tokenizer::from_gguf(engine.model().gguf())?;
    let prompt = prompt_tokens(&args, &tokenizer)?;
    let params = sampling_params(&args, engine.model().config.vocab)?;
    let stops: &[u32] = if args.ignore_eos {
        &[]
    } else {
        tokenizer.eog_tokens()
    };

    let mut session = engine.new_session();
    engine.append(&mut session, &prompt)?;
    let stdout = std::io::stdout();
    let mut writer = ContinuationWriter::new(args.format, &tokenizer, stdout.lock());
    let mut io_error = None;
    let mut constraint = match args.constraint.spec()? {
        Some(spec) => {
            let vocab = engine.model().config.vocab;
            let compiler = crate::constraint::ConstraintCompiler::new(&tokenizer, vocab)
                .map_err(|e| CliError::Usage(e.to_string()))?;
            Some(
                compiler
                    .compile(&spec)
                    .map_err(|e| CliError::Usage(e.to_string()))?,
            )
        }
        None => None,
    };
    let mut proposer: Option<Box<dyn Proposer>> =
        match speculation_mode(args.speculate, args.draft_model.is_some())? {
            Speculate::None => None,
            Speculate::Lookup => Some(Box::new(Lookup::default())),
            Speculate::Draft => Some(Box::new(draft(&args, &engine)?)),
        };
    let on_token = write_through(&mut writer, &mut io_error);
    let generation = if let Some(proposer) = proposer.as_deref_mut() {
        let (generation, counts) = engine.generate_proposed(
            &mut session,
            proposer,
            &params,
            args.max_tokens,
            stops,
            constraint.as_mut(),
            on_token,
        )?;
        let costs = engine.verification_costs().lengths();
        tracing::info!(
            proposed = counts.proposed,
            accepted = counts.accepted,
            forward_passes = counts.steps,
            tokens = generation.tokens.len(),
            pass_costs = ?costs.map(|(_, cost)| (cost * 100.0).round() / 100.0),
            "speculation"
        );
        generation
    } else {
        engine.generate_constrained(
            &mut session,
            &params,
            args.max_tokens,
            stops,
            constraint.as_mut(),
            on_token,
        )?
    };
    if let Some(e) = io_error {
        return Err(e.into());
    }
    writer.finish()?;
    if generation.stop == crate::stop::StopReason::ConstraintUnfinished {
        eprintln!("(the output stopped before it could match its constraint)");
    }
    Ok(())
}

/// The speculation asked for: `--speculate`, else draft with a draft model
/// and lookup without; a draft mode without a draft model, or a draft
/// model for another mode, is a usage error.
pub(super) fn speculation_mode(
    asked: Option<Speculate>,
    draft_model: bool,
) -> Result<Speculate, CliError> {
    match (asked, draft_model) {
        (Some(Speculate::Draft), false) => Err(CliError::Usage(
            "--speculate draft needs --draft-model".into(),
        )),
        (Some(mode), true) if mode != Speculate::Draft => Err(CliError::Usage(format!(
            "--draft-model is for --speculate draft, not {}",
            format!("{mode:?}").to_lowercase()
        ))),
        (Some(mode), _) => Ok(mode),
        (None, true) => Ok(Speculate::Draft),
        (None, false) => Ok(Speculate::Lookup),
    }
}

/// Loads the draft model at `path`, checked to speak `main`'s vocabulary
/// token for token.
pub(super) fn load_draft(path: &std::path::Path, main: &Model) -> Result<Model, CliError> {
    let model = Model::load(path).map_err(|source| CliError::ModelLoad {
        path: path.display().to_string(),
        source,
    })?;
    let tokens = "tokenizer.ggml.tokens";
    if model.gguf().get(tokens) != main.gguf().get(tokens) {
        return Err(CliError::Usage(format!(
            "the draft model {} does not have the main model's vocabulary",
            path.display()
        )));
    }
    Ok(model)
}

/// The draft model of `--draft-model`, on the main engine's threads and
/// KV budget.
fn draft(args: &GenerateArgs, engine: &Engine) -> Result<Draft, CliError> {
    let path = args
        .draft_model
        .as_deref()
        .expect("checked by speculation_mode()");
    let model = load_draft(path, engine.model())?;
    let cfg = EngineConfig {
        threads: engine.threads(),
        kv_bytes: engine.kv_pool().mapped_bytes() as u64,
        ..EngineConfig::default()
    };
    let draft = Draft::new(Arc::new(model), &cfg, engine.model())?;
    Ok(draft.with_fixed_length(args.draft_tokens.map(usize::from)))
}

fn run_remote(args: GenerateArgs) -> Result<(), CliError> {
    let tokenizer = super::load_tokenizer(&args.model.path())?;
    let prompt = prompt_tokens(&args, &tokenizer)?;
    let params = sampling_params(&args, tokenizer.vocab_size())?;
    let stops: &[u32] = if args.ignore_eos {
        &[]
    } else {
        tokenizer.eog_tokens()
    };
    let client = RemoteClient::connect(&args.connect)?;
    let created = client.create_session("inferd generate", stops)?;
    let session_id = created.get_session_id();
    let continued = continue_remotely(&client, session_id, &prompt, &args, &params, &tokenizer);
    // The session was only for this prompt: free it whatever happened,
    // reporting the generation's own error first.
    let closed = client.close(session_id);
    continued?;
    closed?;
    Ok(())
}

/// Appends the prompt to the server session and streams its continuation.
fn continue_remotely(
    client: &RemoteClient,
    session_id: &str,
    prompt: &[u32],
    args: &GenerateArgs,
    params: &SamplingParams,
    tokenizer: &Tokenizer,
) -> Result<(), CliError> {
    let dropped = client.append(session_id, prompt)?.get_dropped_token_count();
    if dropped > 0 {
        eprintln!("(the server dropped {dropped} prompt tokens to fit the context)");
    }
    let mut req = generate_request(session_id, args.max_tokens, params, Some(params.seed));
    // The server speculates its own way (lookup, or its draft model):
    // a request can only ask for speculation or opt out of it.
    if let Some(speculate) = args.speculate {
        req.set_speculate(speculate != Speculate::None);
    }
    if let Some(spec) = args.constraint.spec()? {
        req.set_constraint(to_proto(&spec));
    }
    let stdout = std::io::stdout();
    let mut writer = ContinuationWriter::new(args.format, tokenizer, stdout.lock());
    let mut io_error = None;
    let end = client.generate(&req, write_through(&mut writer, &mut io_error), |dropped| {
        eprintln!("(the server dropped {dropped} prompt tokens to fit the context)")
    })?;
    if let Some(e) = io_error {
        return Err(e.into());
    }
    if let GenerateEnd::Done(done) = end {
        tracing::info!(
            stop = ?done.get_stop_reason(),
            tokens = done.get_generated_token_count(),
            prefill_s = done.get_prefill_duration_seconds(),
            total_s = done.get_total_duration_seconds(),
            "generated"
        );
    }
    writer.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::synthetic::{SyntheticLlama, EOS_TOKEN_ID};
    use crate::gguf::GgufFile;

    fn tokenizer() -> Tokenizer {
        let file = GgufFile::from_bytes(SyntheticLlama::tiny().build()).expect("synthetic gguf");
        Tokenizer::from_gguf(&file).expect("synthetic tokenizer")
    }

    #[test]
    fn ids_are_written_space_separated_on_one_line() {
        let mut out = Vec::new();
        let mut writer = ContinuationWriter::ids(&mut out);
        for id in [5, 0, EOS_TOKEN_ID] {
            writer.push(id).expect("push");
        }
        writer.finish().expect("finish");
        assert_eq!(out, format!("5 0 {EOS_TOKEN_ID}\n").into_bytes());
    }

    #[test]
    fn text_hides_control_tokens_and_marks_a_cut_off_character() {
        let tok = tokenizer();
        let mut out = Vec::new();
        let mut writer = ContinuationWriter::text(&tok, &mut out);
        // "é" is C3 A9 over two tokens; a lone C3 is cut off by the end.
        for id in [b'a' as u32, 0xC3, 0xA9, EOS_TOKEN_ID, 0xC3] {
            writer.push(id).expect("push");
        }
        writer.finish().expect("finish");
        assert_eq!(String::from_utf8(out).expect("utf-8"), "aé\u{FFFD}\n");
    }
}
