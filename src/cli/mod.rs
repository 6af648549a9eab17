//! The command-line front end: `inferd generate`, `inferd chat`,
//! `inferd bench`, `inferd serve`, `inferd session` (a client of
//! `inferd serve`), `inferd tokenize` (the vocabulary alone), and
//! `inferd make-model` (a random-weight model of a real shape).
//! Flags become plain values here; the work is done by the engine, the
//! tokenizer and the sampler, or by a server reached over gRPC.

mod budget;
mod chat;
mod chat_input;
mod client;
mod constrain;
mod device;
mod generate;
mod make_model;
mod memory;
mod relay;
pub mod remote;
mod replica;
mod serve;
mod session;
mod shard;
mod tokenize;

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};
use thiserror::Error;

use crate::engine::{Engine, EngineConfig, EngineError};
use crate::model::{Model, ModelError};
use crate::sampler::{SamplerChoice, SamplerError, SamplingParams, SelectedSampler};
use crate::tokenizer::{Tokenizer, TokenizerError};
use clap::builder::TypedValueParser as _;
pub use device::DeviceChoice;

/// Where the reference model lands (see `scripts/fetch-model`).
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// inferd: session-bound LLM inference on the CPU.
#[derive(Debug, Parser)]
#[command(name = "inferd", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Continue a prompt and print the continuation.
    Generate(generate::GenerateArgs),
    /// Chat with the model in the terminal, using the GGUF's chat template.
    Chat(chat::ChatArgs),
    /// Measure prefill and decode speed (the llama-bench equivalent).
    Bench(BenchArgs),
    /// Serve kakeya.v1.RuntimeService over gRPC.
    Serve(Box<serve::ServeArgs>),
    /// Drive a session on an inferd server by token ids, for scripts.
    #[command(subcommand)]
    Session(session::SessionCommand),
    /// Serve one layer range of a model over the shard protocol.
    Shard(shard::ShardArgs),
    /// Forward shard-protocol calls to a shard without decoding them.
    Relay(relay::RelayArgs),
    /// Turn text into token ids or ids into text with a model's vocabulary
    /// (vocabulary-only GGUF files work too).
    Tokenize(tokenize::TokenizeArgs),
    /// Write a model of a real checkpoint's shape with random weights, in
    /// any block type (no download, no llama.cpp).
    MakeModel(make_model::MakeModelArgs),
}

impl Command {
    /// The log level when `RUST_LOG` is unset: a server logs each session's
    /// lifecycle, the one-shot commands only warnings.
    pub fn default_log_level(&self) -> &'static str {
        match self {
            Command::Serve(_) | Command::Shard(_) | Command::Relay(_) => "info",
            _ => "warn",
        }
    }
}

/// Options shared by every command that loads a model.
#[derive(Debug, Args, Clone)]
pub struct ModelArgs {
    /// GGUF model file [default: the reference model in models/, or $INFERD_MODEL].
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Compute threads [default: one per core].
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// KV cache memory in MiB.
    #[arg(long, default_value_t = 256)]
    pub kv_mib: u64,
    /// Back the KV cache with this file instead of anonymous memory
    /// (created or truncated, then sized to the cache).
    #[arg(long)]
    pub kv_file: Option<PathBuf>,
    /// Sampler: `auto` (a hardware GPU through wgpu if there is one, else
    /// the CPU), `cpu`, or `wgpu` (any Vulkan/Metal adapter, lavapipe
    /// included; fails if there is none).
    #[arg(long, env = "INFERD_SAMPLER", default_value = "auto", value_parser = sampler_choice_parser())]
    pub sampler: SamplerChoice,
    /// Where the model runs: `cpu`, `gpu` (any Vulkan/Metal adapter,
    /// lavapipe included; fails if there is none) or `auto` (a hardware
    /// GPU if there is one and the model fits, else the CPU).
    #[arg(long, env = "INFERD_DEVICE", value_enum, default_value_t = DeviceChoice::Cpu)]
    pub device: DeviceChoice,
}

/// `auto|cpu|wgpu`, listed in `--help`.
pub(crate) fn sampler_choice_parser() -> impl clap::builder::TypedValueParser<Value = SamplerChoice>
{
    clap::builder::PossibleValuesParser::new(SamplerChoice::NAMES)
        .try_map(|name| name.parse::<SamplerChoice>())
}

/// Resolves `--sampler` once and logs what it chose.
pub(crate) fn resolve_sampler(choice: SamplerChoice) -> Result<SelectedSampler, CliError> {
    let selected = SelectedSampler::resolve(choice)
        .map_err(|e| CliError::Usage(format!("--sampler {choice}: {e}")))?;
    match selected.adapter() {
        Some(adapter) => tracing::info!(%choice, %adapter, "sampler: wgpu"),
        None => tracing::info!(%choice, "sampler: cpu"),
    }
    Ok(selected)
}

/// Sampling flags (all off by default: greedy decoding).
#[derive(Debug, Args, Clone)]
pub struct SamplingArgs {
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens below this fraction of the top probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Presence penalty (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Frequency penalty (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Penalise only the last N tokens (0 = the whole history).
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Add BIAS to token ID's logit, as ID=BIAS (repeatable).
    #[arg(long = "logit-bias", value_parser = parse_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Random seed [default: drawn from the OS and printed to stderr].
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampler parameters, with a seed drawn from the OS when none was given.
    pub fn params(&self) -> Result<SamplingParams, CliError> {
        let seed = match self.seed {
            Some(s) => s,
            None => {
                let mut b = [0u8; 8];
                getrandom::getrandom(&mut b)
                    .map_err(|e| CliError::Usage(format!("no OS randomness: {e}")))?;
                u64::from_le_bytes(b)
            }
        };
        Ok(SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            penalty_last_n: self.repeat_last_n,
            logit_bias: self.logit_bias.clone(),
            seed,
        })
    }
}

fn parse_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s.split_once('=').ok_or("expected ID=BIAS")?;
    let id = id
        .trim()
        .parse()
        .map_err(|_| format!("'{id}' is not a token id"))?;
    let bias = bias
        .trim()
        .parse()
        .map_err(|_| format!("'{bias}' is not a number"))?;
    Ok((id, bias))
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Tokens already in the session before each test (llama-bench -d).
    #[arg(long, default_value_t = 0)]
    pub depth: usize,
    /// Prompt tokens prefilled in one batch (llama-bench -p).
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens decoded one at a time (llama-bench -n).
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Runs of each test; the mean is reported.
    #[arg(long, default_value_t = 3)]
    pub repetitions: usize,
    /// Output format.
    #[arg(long, value_enum, default_value_t = BenchFormat::Text)]
    pub format: BenchFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchFormat {
    Text,
    Json,
}

/// For a model file that is not there, how to get the reference model; a
/// file that is there but does not load gets no such hint.
fn fetch_hint(path: &str) -> &'static str {
    if std::path::Path::new(path).exists() {
        ""
    } else {
        "\n(run scripts/fetch-model to download the reference model)"
    }
}

/// Why a command failed; printed by `main`.
#[derive(Debug, Error)]
pub enum CliError {
    #[error("{0}")]
    Usage(String),
    #[error("model {path}: {source}{hint}", hint = fetch_hint(.path))]
    ModelLoad { path: String, source: ModelError },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    /// The model's chat template cannot render the conversation.
    #[error(transparent)]
    Template(#[from] crate::chat_template::TemplateError),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A call to an inferd server failed.
    #[error(transparent)]
    Remote(#[from] remote::RemoteError),
    /// The model file could not be read for its tokenizer.
    #[error(
        "model {path}: {source}\n(the client needs the served model's file for its vocabulary)"
    )]
    TokenizerLoad {
        path: String,
        source: crate::gguf::GgufError,
    },
}

/// Sets up `tracing` output on stderr, filtered by `RUST_LOG` (else `default`).
pub fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Bench(args) => bench(args),
        Command::Serve(args) => serve::run(*args),
        Command::Session(command) => session::run(command),
        Command::Shard(args) => shard::run(args),
        Command::Relay(args) => relay::run(args),
        Command::Tokenize(args) => tokenize::run(args),
        Command::MakeModel(args) => make_model::run(args),
    }
}

/// The tokenizer of the model file at `path`, without loading its weights:
/// what a client needs to speak the served model's vocabulary.
pub fn load_tokenizer(path: &std::path::Path) -> Result<Tokenizer, CliError> {
    let gguf = crate::gguf::GgufFile::open(path).map_err(|source| CliError::TokenizerLoad {
        path: path.display().to_string(),
        source,
    })?;
    Ok(Tokenizer::from_gguf(&gguf)?)
}

impl ModelArgs {
    /// The model path: the flag, else `$INFERD_MODEL`, else the reference model.
    pub fn path(&self) -> PathBuf {
        self.model
            .clone()
            .or_else(|| std::env::var_os("INFERD_MODEL").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL))
    }

    /// Loads the model and builds an engine around it.
    pub fn engine(&self) -> Result<Engine, CliError> {
        let path = self.path();
        let t0 = std::time::Instant::now();
        let model = Model::load(&path).map_err(|source| CliError::ModelLoad {
            path: path.display().to_string(),
            source,
        })?;
        let mut cfg = EngineConfig::default();
        if let Some(t) = self.threads {
            if t == 0 {
                return Err(CliError::Usage("--threads must be at least 1".into()));
            }
            cfg.threads = t;
        }
        cfg.kv_bytes = self.kv_mib.max(1) << 20;
        match &self.kv_file {
            Some(file) => cfg.kv_backing = crate::kv::KvBacking::File(file.clone()),
            None => memory::check_kv_fits(cfg.kv_bytes, file_len(&path), memory::limits())?,
        }
        let model = Arc::new(model);
        let gpu = device::open_device(self.device)?;
        // On a GPU the sampler goes on that device (unless --sampler cpu),
        // where it reads the logits a decode step leaves there.
        let sampler = match &gpu {
            Some(device) => {
                device::device_sampler(self.sampler, device)?.map(SelectedSampler::Wgpu)
            }
            None => None,
        };
        let engine = match device::on_device(self.device, gpu, |device| {
            Engine::new(
                Arc::clone(&model),
                &EngineConfig {
                    gpu: Some(device),
                    sampler: sampler.clone().unwrap_or(SelectedSampler::Cpu),
                    ..cfg.clone()
                },
            )
        })? {
            Some(engine) => engine,
            None => {
                cfg.sampler = resolve_sampler(self.sampler)?;
                Engine::new(model, &cfg)?
            }
        };
        tracing::info!(
            model = %path.display(),
            threads = engine.threads(),
            simd = crate::quant::simd_level(),
            amx = crate::quant::amx_status(),
            device = engine.gpu_adapter().as_deref().unwrap_or("cpu"),
            load_ms = t0.elapsed().as_secs_f64() * 1e3,
            "model loaded"
        );
        Ok(engine)
    }
}

/// The size of the file at `path` (0 if it cannot be read: the model
/// loaded from it already, so this only feeds a memory estimate).
fn file_len(path: &std::path::Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

fn bench(args: BenchArgs) -> Result<(), CliError> {
    let mut engine = args.model.engine()?;
    let reps = args.repetitions.max(1);
    // One untimed warm-up so page faults and first-touch costs are not measured.
    engine.bench(0, args.prompt_tokens.min(16), args.gen_tokens.min(4))?;
    crate::model::phases::reset();
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let r = engine.bench(args.depth, args.prompt_tokens, args.gen_tokens)?;
        if r.prompt_tokens > 0 {
            pp.push(r.prompt_tokens as f64 / r.prefill.as_secs_f64());
        }
        if r.gen_tokens > 0 {
            tg.push(r.gen_tokens as f64 / r.decode.as_secs_f64());
        }
    }
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let (pp, tg) = (mean(&pp), mean(&tg));
    match args.format {
        BenchFormat::Json => println!(
            "{{\"pp_tokens_per_s\": {pp:.2}, \"tg_tokens_per_s\": {tg:.2}, \"threads\": {}, \"simd\": \"{}\"}}",
            engine.threads(),
            crate::quant::simd_level()
        ),
        BenchFormat::Text => {
            println!("model    {}", args.model.path().display());
            println!(
                "threads  {}   simd {}   amx {}",
                engine.threads(),
                crate::quant::simd_level(),
                crate::quant::amx_status()
            );
            let at = if args.depth > 0 { format!(" @ d{}", args.depth) } else { String::new() };
            println!("pp{:<6} {pp:>8.2} tokens/s{at}", args.prompt_tokens);
            println!("tg{:<6} {tg:>8.2} tokens/s{at}", args.gen_tokens);
        }
    }
    if crate::model::phases::enabled() {
        eprint!("{}", crate::model::phases::report(engine.threads()));
    }
    Ok(())
}
