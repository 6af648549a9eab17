//! `inferd session create|append|generate|info|fork|close`: one gRPC call per
//! command, token ids and session ids in and out, so a shell script can
//! drive a server session step by step (`id=$(inferd session create)`).

use std::io::{Read, Write};
use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};

use super::client::{generate_request, GenerateEnd, RemoteClient};
use super::generate::{ContinuationWriter, OutputFormat};
use super::remote::{json_string, parse_token_list, ConnectArgs};
use super::{load_tokenizer, CliError, ModelArgs, SamplingArgs};
use crate::proto::kakeya_v1::runtime::{GenerateDone_StopReason, GetSessionInfoResponse};

#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// Create an empty session and print its id.
    Create(CreateArgs),
    /// Append token ids to a session and print its new history length.
    Append(AppendArgs),
    /// Generate after a session's history, printing tokens as they arrive.
    Generate(SessionGenerateArgs),
    /// Print a session's history length, memory and counters.
    Info(InfoArgs),
    /// Fork a session (its history up to --at, KV shared copy-on-write) and
    /// print the new session's id.
    Fork(ForkArgs),
    /// Close a session, freeing its memory, and print its final history length.
    Close(CloseArgs),
}

#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Label kept with the session for diagnostics.
    #[arg(long, default_value = "")]
    pub label: String,
    /// A token id that ends generation when emitted (repeatable).
    #[arg(long = "eos", value_name = "ID")]
    pub eos: Vec<u32>,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

#[derive(Debug, Args)]
pub struct AppendArgs {
    /// The session id.
    pub id: String,
    /// Token ids to append [default: read from stdin, separated by spaces,
    /// commas or newlines].
    #[arg(value_delimiter = ',')]
    pub tokens: Vec<u32>,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

#[derive(Debug, Args)]
pub struct SessionGenerateArgs {
    /// The session id.
    pub id: String,
    /// Most tokens to generate.
    #[arg(long, short = 'n')]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Output: token ids, or text (decoded with the --model's vocabulary).
    #[arg(long, value_enum, default_value_t = OutputFormat::Ids)]
    pub format: OutputFormat,
    /// GGUF model whose tokenizer decodes --format text [default: the
    /// reference model in models/, or $INFERD_MODEL].
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

#[derive(Debug, Args)]
pub struct InfoArgs {
    /// The session id.
    pub id: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = InfoFormat::Text)]
    pub format: InfoFormat,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum InfoFormat {
    /// One `name value` pair per line.
    Text,
    /// One JSON object.
    Json,
}

#[derive(Debug, Args)]
pub struct ForkArgs {
    /// The source session id.
    pub id: String,
    /// History tokens the fork keeps [default: all of them].
    #[arg(long, value_name = "LENGTH")]
    pub at: Option<u64>,
    /// The fork's label [default: the source's].
    #[arg(long, default_value = "")]
    pub label: String,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

#[derive(Debug, Args)]
pub struct CloseArgs {
    /// The session id.
    pub id: String,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

/// One value of a session's info.
#[derive(Debug, Clone, PartialEq)]
enum InfoValue {
    /// A number or a boolean, already written as JSON.
    Literal(String),
    Text(String),
    Ids(Vec<u32>),
}

/// Renders info fields as `name value` lines (text raw, ids
/// space-separated) or as one JSON object.
fn render_info(fields: &[(&str, InfoValue)], format: InfoFormat) -> String {
    match format {
        InfoFormat::Json => {
            let body: Vec<String> = fields
                .iter()
                .map(|(name, value)| {
                    let value = match value {
                        InfoValue::Literal(n) => n.clone(),
                        InfoValue::Text(t) => json_string(t),
                        InfoValue::Ids(ids) => format!("[{}]", join_ids(ids, ",")),
                    };
                    format!("{}: {value}", json_string(name))
                })
                .collect();
            format!("{{{}}}", body.join(", "))
        }
        InfoFormat::Text => {
            let width = fields.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
            let lines: Vec<String> = fields
                .iter()
                .map(|(name, value)| {
                    let value = match value {
                        InfoValue::Literal(n) => n.clone(),
                        InfoValue::Text(t) => t.clone(),
                        InfoValue::Ids(ids) => join_ids(ids, " "),
                    };
                    format!("{name:<width$}  {value}").trim_end().to_owned()
                })
                .collect();
            lines.join("\n")
        }
    }
}

fn join_ids(ids: &[u32], sep: &str) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(sep)
}

/// Runs one `inferd session` command.
pub fn run(command: SessionCommand) -> Result<(), CliError> {
    match command {
        SessionCommand::Create(args) => create(args),
        SessionCommand::Append(args) => append(args),
        SessionCommand::Generate(args) => generate(args),
        SessionCommand::Info(args) => info(args),
        SessionCommand::Fork(args) => fork(args),
        SessionCommand::Close(args) => close(args),
    }
}

fn create(args: CreateArgs) -> Result<(), CliError> {
    let client = RemoteClient::connect(&args.connect)?;
    let created = client.create_session(&args.label, &args.eos)?;
    tracing::info!(
        vocab = created.get_vocab_size(),
        context = created.get_context_length(),
        worker = created.get_worker(),
        "session created"
    );
    println!("{}", created.get_session_id());
    Ok(())
}

fn fork(args: ForkArgs) -> Result<(), CliError> {
    let client = RemoteClient::connect(&args.connect)?;
    let forked = client.fork(&args.id, args.at, &args.label)?;
    tracing::info!(
        history_length = forked.get_history_length(),
        worker = forked.get_worker(),
        "session forked"
    );
    println!("{}", forked.get_session_id());
    Ok(())
}

fn append(args: AppendArgs) -> Result<(), CliError> {
    let tokens = if args.tokens.is_empty() {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text)?;
        parse_token_list(&text).map_err(|e| CliError::Usage(format!("stdin: {e}")))?
    } else {
        args.tokens
    };
    if tokens.is_empty() {
        return Err(CliError::Usage(
            "no token ids to append (give them as arguments or on stdin)".into(),
        ));
    }
    let client = RemoteClient::connect(&args.connect)?;
    let appended = client.append(&args.id, &tokens)?;
    let dropped = appended.get_dropped_token_count();
    if dropped > 0 {
        eprintln!("truncated dropped_token_count={dropped}");
    }
    println!("{}", appended.get_history_length());
    Ok(())
}

fn generate(args: SessionGenerateArgs) -> Result<(), CliError> {
    // The text format needs the vocabulary; ids need nothing local.
    let tokenizer = match args.format {
        OutputFormat::Text => {
            let model = ModelArgs {
                model: args.model.clone(),
                threads: None,
                kv_mib: 0,
                kv_file: None,
                sampler: crate::sampler::SamplerChoice::Cpu,
                device: super::DeviceChoice::Cpu,
            };
            Some(load_tokenizer(&model.path())?)
        }
        OutputFormat::Ids => None,
    };
    if args.max_tokens == 0 {
        return Err(CliError::Usage("--max-tokens must be at least 1".into()));
    }
    let params = args.sampling.params()?;
    let req = generate_request(&args.id, args.max_tokens, &params, args.sampling.seed);
    let client = RemoteClient::connect(&args.connect)?;

    let stdout = std::io::stdout();
    let mut writer = match &tokenizer {
        Some(t) => ContinuationWriter::text(t, stdout.lock()),
        None => ContinuationWriter::ids(stdout.lock()),
    };
    let mut io_error = None;
    let end = client.generate(
        &req,
        |id| match writer.push(id) {
            Ok(()) => true,
            Err(e) => {
                io_error = Some(e);
                false
            }
        },
        |dropped| eprintln!("truncated dropped_token_count={dropped}"),
    )?;
    if let Some(e) = io_error {
        return Err(e.into());
    }
    writer.finish()?;
    if let GenerateEnd::Done(done) = end {
        eprintln!(
            "done stop_reason={} generated_token_count={} seed_used={} history_length={} \
             prefill_token_count={} prefill_seconds={:.3} total_seconds={:.3}",
            stop_reason_name(done.get_stop_reason()),
            done.get_generated_token_count(),
            done.get_seed_used(),
            done.get_history_length(),
            done.get_prefill_token_count(),
            done.get_prefill_duration_seconds(),
            done.get_total_duration_seconds(),
        );
    }
    Ok(())
}

fn info(args: InfoArgs) -> Result<(), CliError> {
    let client = RemoteClient::connect(&args.connect)?;
    let info = client.info(&args.id)?;
    let fields = info_fields(&args.id, &info);
    let mut out = std::io::stdout();
    writeln!(out, "{}", render_info(&fields, args.format))?;
    Ok(())
}

fn close(args: CloseArgs) -> Result<(), CliError> {
    let client = RemoteClient::connect(&args.connect)?;
    println!("{}", client.close(&args.id)?);
    Ok(())
}

fn stop_reason_name(reason: GenerateDone_StopReason) -> &'static str {
    match reason {
        GenerateDone_StopReason::STOP_REASON_UNSPECIFIED => "unspecified",
        GenerateDone_StopReason::STOP_REASON_MAX_TOKENS => "max_tokens",
        GenerateDone_StopReason::STOP_REASON_EOS => "eos",
        GenerateDone_StopReason::STOP_REASON_CANCELLED => "cancelled",
        GenerateDone_StopReason::STOP_REASON_TRUNCATED => "truncated",
        GenerateDone_StopReason::STOP_REASON_CONSTRAINT_DONE => "constraint_done",
        GenerateDone_StopReason::STOP_REASON_CONSTRAINT_UNFINISHED => "constraint_unfinished",
    }
}

/// The info fields, in a fixed order.
fn info_fields(id: &str, info: &GetSessionInfoResponse) -> Vec<(&'static str, InfoValue)> {
    let n = |v: u64| InfoValue::Literal(v.to_string());
    vec![
        ("session_id", InfoValue::Text(id.to_owned())),
        ("history_length", n(info.get_history_length())),
        ("kv_live_bytes", n(info.get_kv_live_bytes())),
        ("kv_pages_held", n(info.get_kv_pages_held())),
        ("kv_page_bytes", n(info.get_kv_page_bytes())),
        (
            "cache_invariant_inv1_violations",
            n(info.get_cache_invariant_inv1_violations()),
        ),
        (
            "cache_invariant_inv2_violations",
            n(info.get_cache_invariant_inv2_violations()),
        ),
        (
            "idle_seconds",
            InfoValue::Literal(format!("{:.3}", info.get_idle_seconds())),
        ),
        ("truncated_token_count", n(info.get_truncated_token_count())),
        ("worker", n(u64::from(info.get_worker()))),
        (
            "client_label",
            InfoValue::Text(info.get_client_label().to_owned()),
        ),
        (
            "eos_token_ids",
            InfoValue::Ids(info.get_eos_token_ids().to_vec()),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<(&'static str, InfoValue)> {
        vec![
            ("history_length", InfoValue::Literal("12".into())),
            ("client_label", InfoValue::Text("say \"hi\"".into())),
            ("eos_token_ids", InfoValue::Ids(vec![2, 7])),
        ]
    }

    #[test]
    fn info_as_json_is_one_object_with_typed_values() {
        assert_eq!(
            render_info(&sample(), InfoFormat::Json),
            r#"{"history_length": 12, "client_label": "say \"hi\"", "eos_token_ids": [2,7]}"#
        );
    }

    #[test]
    fn info_as_text_is_one_aligned_pair_per_line() {
        assert_eq!(
            render_info(&sample(), InfoFormat::Text),
            "history_length  12\nclient_label    say \"hi\"\neos_token_ids   2 7"
        );
    }
}
