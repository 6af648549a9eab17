//! `inferd serve`: settings from flags, environment and a TOML file (in
//! that order of precedence), then the gRPC server until SIGTERM or SIGINT,
//! then a graceful drain; a second SIGTERM or SIGINT during the drain
//! stops the process at once (exit status 128 + the signal's number). Tells
//! systemd when it is ready and when it stops.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use serde::Deserialize;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use super::generate::Speculate;
use super::DeviceChoice;
use super::{CliError, DEFAULT_MODEL};
use crate::cluster::coordinator::{ShardPlan, ShardSpec};
use crate::cluster::fingerprint::sha256_of_file;
use crate::cluster::layers::ShardLayers;
use crate::cluster::payload::Encoding;
use crate::durable::{Durability, SessionStore};
use crate::durable::{StateLimits as Limits, DEFAULT_MIN_FREE_BYTES};
use crate::model::Model;
use crate::runtime::GpuLayers;
use crate::runtime::{EvictionPolicy, LocalLayers, OverflowPolicy, RuntimeConfig, Speculation};
use crate::sampler::{SamplerChoice, SelectedSampler};
use crate::server::http::HttpLimits;
use crate::server::tokens::AccessTokens;
use crate::server::{ServeConfig, Server, TlsIdentity};

/// `--grpc-connections` when not given.
pub const DEFAULT_GRPC_CONNECTIONS: usize = 256;

/// Which idle session makes room when memory or the session limit runs out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Eviction {
    /// The least recently used idle session is evicted.
    Lru,
    /// Nothing is evicted: the request fails with RESOURCE_EXHAUSTED.
    None,
}

/// When a session's journal write is on disk (with `--state-dir`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DurabilityArg {
    /// Before the call is answered: nothing acknowledged is lost.
    Sync,
    /// Within 5 ms after it (group commit): a crash loses at most that.
    Batch,
    /// When the operating system writes it back.
    None,
}

/// What happens when a history outgrows the model's context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Overflow {
    /// Keep the first `overflow-sink` tokens and the most recent window.
    Truncate,
    /// End the Generate with STOP_REASON_TRUNCATED (an Append is refused).
    Stop,
}

/// Flags of `inferd serve`. Every one can also come from the environment
/// (`INFERD_<NAME>`) or the TOML file (`name = value`, `-` written `_`).
#[derive(Debug, Args, Clone, Default)]
pub struct ServeArgs {
    /// TOML configuration file; flags and environment override it.
    #[arg(long, env = "INFERD_CONFIG")]
    pub config: Option<PathBuf>,
    /// GGUF model file [default: models/SmolLM2-135M-Instruct.Q4_1.gguf].
    #[arg(long, short = 'm', env = "INFERD_MODEL")]
    pub model: Option<PathBuf>,
    /// Address to listen on, IP:PORT or localhost:PORT (port 0: any free port)
    /// [default: 127.0.0.1:50051].
    #[arg(long, env = "INFERD_LISTEN")]
    pub listen: Option<String>,
    /// Worker threads, one pinned per core, each owning a shard of the
    /// sessions [default: one per core].
    #[arg(long, env = "INFERD_WORKERS")]
    pub workers: Option<usize>,
    /// A worker waiting for work helps another worker's step, so one busy
    /// session uses the idle cores (the results are the same bits); false
    /// keeps each worker's forward pass on its own core [default: true].
    #[arg(long, env = "INFERD_CORE_LENDING", value_name = "BOOL")]
    pub core_lending: Option<bool>,
    /// KV cache memory in MiB [default: 256].
    #[arg(long, env = "INFERD_KV_MIB", conflicts_with = "kv_pages")]
    pub kv_mib: Option<u64>,
    /// KV cache size in pages of 16 positions over all layers (the pool and
    /// its gauges count one page per layer of those), instead of --kv-mib.
    #[arg(long, env = "INFERD_KV_PAGES")]
    pub kv_pages: Option<u64>,
    /// Most sessions alive at once [default: 1024].
    #[arg(long, env = "INFERD_MAX_SESSIONS")]
    pub max_sessions: Option<usize>,
    /// Shared-prefix pages (16 positions over all layers each) kept after
    /// the last session holding them let go, for the next session whose
    /// history starts the same way; they give way first when the KV cache
    /// is full [default: a quarter of the KV cache with --http-listen, whose
    /// requests each run in a session of their own; otherwise 0: pages go
    /// back as soon as no session holds them].
    #[arg(long, env = "INFERD_PREFIX_CACHE_PAGES")]
    pub prefix_cache_pages: Option<u64>,
    /// Seconds a session may stay idle before it is evicted [default: 1800].
    #[arg(long, env = "INFERD_IDLE_TTL")]
    pub idle_ttl: Option<f64>,
    /// What makes room when KV memory or sessions run out [default: lru].
    #[arg(long, value_enum, env = "INFERD_EVICTION")]
    pub eviction: Option<Eviction>,
    /// What a history longer than the context does [default: truncate].
    #[arg(long, value_enum, env = "INFERD_OVERFLOW")]
    pub overflow: Option<Overflow>,
    /// Tokens kept at the start of the history when truncating [default: 4].
    #[arg(long, env = "INFERD_OVERFLOW_SINK")]
    pub overflow_sink: Option<usize>,
    /// Serve Prometheus metrics at http://ADDR/metrics [default: off]. Off
    /// loopback it needs --auth-token-file or --allow-unauthenticated, as
    /// --listen does.
    #[arg(long, env = "INFERD_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Serve the OpenAI-compatible HTTP API (/v1/chat/completions,
    /// /v1/completions, /v1/models) on ADDR [default: off]. Off loopback it
    /// needs --auth-token-file (clients send it as their API key) or
    /// --allow-unauthenticated, as --listen does.
    #[arg(long, env = "INFERD_HTTP_LISTEN")]
    pub http_listen: Option<String>,
    /// The chat template /v1/chat/completions renders conversations with,
    /// a Jinja file, instead of the model's own (`tokenizer.chat_template`);
    /// its tool-call syntax is read off it as off the model's.
    #[arg(long, env = "INFERD_CHAT_TEMPLATE_FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// HTTP API connections open at once; past it, new ones wait in the
    /// listen backlog until one closes [default: 512].
    #[arg(long, env = "INFERD_HTTP_MAX_CONNECTIONS")]
    pub http_max_connections: Option<usize>,
    /// Seconds an HTTP API connection has from its accept to send its
    /// first request head whole (TLS handshake included), else it is
    /// closed [default: 10].
    #[arg(long, env = "INFERD_HTTP_HEADER_TIMEOUT")]
    pub http_header_timeout: Option<f64>,
    /// Seconds an HTTP API connection may wait between requests (until the
    /// next request head is whole) before it is closed; at least
    /// --http-header-timeout [default: 60].
    #[arg(long, env = "INFERD_HTTP_IDLE_TIMEOUT")]
    pub http_idle_timeout: Option<f64>,
    /// gRPC connections the file-descriptor budget leaves room for; the
    /// gRPC core cannot cap them, this only sizes the budget checked
    /// against RLIMIT_NOFILE at start [default: 256].
    #[arg(long, env = "INFERD_GRPC_CONNECTIONS")]
    pub grpc_connections: Option<usize>,
    /// File of access tokens, one a line, each optionally named (`name:
    /// token`); every call (and every metrics scrape) must carry one as
    /// `authorization: Bearer <token>`. With several tokens each session
    /// belongs to the token that created it: other tokens get NOT_FOUND.
    #[arg(long, env = "INFERD_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,
    /// Accept a non-loopback --listen or --metrics-listen without an access
    /// token.
    #[arg(long, env = "INFERD_ALLOW_UNAUTHENTICATED")]
    pub allow_unauthenticated: bool,
    /// PEM certificate chain: serve TLS (needs --tls-key).
    #[arg(long, env = "INFERD_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "INFERD_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Keep sessions in this directory (their journals), so that they
    /// survive a restart or a crash: each comes back under its id with its
    /// history [default: off: sessions live as long as the process].
    #[arg(long, env = "INFERD_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// With --state-dir, an LRU eviction keeps the session (its KV freed,
    /// its history fed again by its next call) while fewer than this many
    /// are kept so [default: 4096].
    #[arg(long, env = "INFERD_MAX_SPILLED_SESSIONS")]
    pub max_spilled_sessions: Option<usize>,
    /// With --state-dir, MiB of KV pages spilled sessions may write out, so
    /// that their next call reads them back instead of computing them; a
    /// session spilled beyond it keeps only its history [default: 16384].
    #[arg(long, env = "INFERD_MAX_SPILL_MIB")]
    pub max_spill_mib: Option<u64>,
    /// With --state-dir, MiB that session journals, spill files and refused
    /// journals may take there in all (the page file, reserved whole at
    /// start, is not counted). Once reached, new sessions and appends,
    /// Generates and forks of journaled sessions are refused
    /// (RESOURCE_EXHAUSTED) and a spill keeps only the history
    /// [default: no limit].
    #[arg(long, env = "INFERD_MAX_STATE_MIB")]
    pub max_state_mib: Option<u64>,
    /// With --state-dir, MiB that must stay free on its filesystem: below
    /// it new durable work is refused as past --max-state-mib, before the
    /// disk is full; 0 turns the floor off [default: 64].
    #[arg(long, env = "INFERD_MIN_FREE_MIB")]
    pub min_free_mib: Option<u64>,
    /// When a session's change is on disk, with --state-dir [default: sync].
    #[arg(long, value_enum, env = "INFERD_DURABILITY")]
    pub durability: Option<DurabilityArg>,
    /// Keep every session's history in this PostgreSQL database
    /// (`postgres://USER:PASSWORD@HOST:PORT/DB?sslmode=...`), shared by
    /// replicas behind a proxy: a change is there before its call is
    /// answered, and a call for a session another replica held (dead,
    /// drained or out of reach) takes it over and rebuilds it. Not with
    /// --state-dir [default: off].
    #[arg(long, env = "INFERD_SESSION_STORE", hide_env_values = true)]
    pub session_store: Option<String>,
    /// With --session-store, this replica's name in the store's leases:
    /// unique among running replicas and stable across restarts (a pod's
    /// name), so that a replica started again takes its sessions back at
    /// once [default: HOSTNAME-PID].
    #[arg(long, env = "INFERD_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// With --session-store, seconds a session's lease lasts unless its
    /// replica renews it (every third of it): how long a dead replica's
    /// sessions wait before another takes them over [default: 10].
    #[arg(long, env = "INFERD_LEASE_SECS")]
    pub lease_secs: Option<f64>,
    /// Seconds to let calls finish after SIGTERM/SIGINT before cancelling
    /// them [default: 30].
    #[arg(long, env = "INFERD_DRAIN_TIMEOUT")]
    pub drain_timeout: Option<f64>,
    /// gRPC completion-queue threads [default: one per four cores].
    #[arg(long, env = "INFERD_COMPLETION_QUEUES")]
    pub completion_queues: Option<usize>,
    /// Sampler: `auto` (a hardware GPU through wgpu if there is one, else
    /// the CPU), `cpu`, or `wgpu` (any Vulkan/Metal adapter, lavapipe
    /// included; start-up fails if there is none) [default: auto].
    #[arg(long, env = "INFERD_SAMPLER", value_parser = super::sampler_choice_parser())]
    pub sampler: Option<SamplerChoice>,
    /// Speculative decoding for Generates that do not choose
    /// (GenerateRequest.speculate): `lookup` proposes tokens that followed
    /// the history's last tokens where they occurred before and verifies
    /// several per forward pass, emitting exactly plain decoding's tokens;
    /// `none` decodes one token per pass; `draft` has the --draft-model
    /// propose its greedy continuation. Layers on a GPU or on shards, and
    /// constrained calls, decode plainly [default: draft with a draft
    /// model, else lookup].
    #[arg(long, value_enum, env = "INFERD_SPECULATE")]
    pub speculate: Option<Speculate>,
    /// A smaller GGUF model with the main model's vocabulary (token for
    /// token) that proposes tokens for speculative decoding; its KV comes
    /// out of --kv-mib (the share that holds as many positions as the main
    /// model's).
    #[arg(long, env = "INFERD_DRAFT_MODEL")]
    pub draft_model: Option<PathBuf>,
    /// Tokens the draft model proposes every step, instead of the length
    /// that its acceptance and its cost against the main model say pays
    /// (1-15).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=15))]
    pub draft_tokens: Option<u16>,
    /// Where the model's layers run: `cpu`, `gpu` (any Vulkan/Metal
    /// adapter, lavapipe included; start-up fails if there is none) or
    /// `auto` (a hardware GPU if there is one and the model fits, else the
    /// CPU) [default: cpu].
    #[arg(long, env = "INFERD_DEVICE", value_enum)]
    pub device: Option<DeviceChoice>,
    /// Run the layers on these shards (`inferd shard`), in layer order:
    /// `HOST:PORT,...` splits the layers evenly; `HOST:PORT=A..B,...` names
    /// each range. This process then embeds, samples and serves clients.
    #[arg(long, env = "INFERD_SHARDS", value_delimiter = ',', value_parser = ShardSpec::parse)]
    pub shards: Option<Vec<ShardSpec>>,
    /// How hidden states travel to the shards: f32 (bit-identical to one
    /// host), f16 or q8_0 (smaller, approximate) [default: f32].
    #[arg(long, value_enum, env = "INFERD_SHARD_ENCODING")]
    pub shard_encoding: Option<ShardEncoding>,
    /// Check the configuration and the model file, print the settings, and
    /// exit without serving.
    #[arg(long)]
    pub check: bool,
}

/// How hidden states travel between the coordinator and its shards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardEncoding {
    #[default]
    F32,
    F16,
    #[value(name = "q8_0")]
    #[serde(rename = "q8_0")]
    Q8_0,
}

impl ShardEncoding {
    fn encoding(self) -> Encoding {
        match self {
            ShardEncoding::F32 => Encoding::F32,
            ShardEncoding::F16 => Encoding::F16,
            ShardEncoding::Q8_0 => Encoding::Q8_0,
        }
    }
}

/// The TOML file: the same names as the flags, `-` written `_`. Relative
/// paths in it are relative to the file's folder.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    model: Option<PathBuf>,
    listen: Option<String>,
    workers: Option<usize>,
    core_lending: Option<bool>,
    kv_mib: Option<u64>,
    kv_pages: Option<u64>,
    max_sessions: Option<usize>,
    prefix_cache_pages: Option<u64>,
    idle_ttl: Option<f64>,
    eviction: Option<Eviction>,
    overflow: Option<Overflow>,
    overflow_sink: Option<usize>,
    metrics_listen: Option<String>,
    http_listen: Option<String>,
    chat_template_file: Option<PathBuf>,
    http_max_connections: Option<usize>,
    http_header_timeout: Option<f64>,
    http_idle_timeout: Option<f64>,
    grpc_connections: Option<usize>,
    auth_token_file: Option<PathBuf>,
    allow_unauthenticated: Option<bool>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    drain_timeout: Option<f64>,
    state_dir: Option<PathBuf>,
    max_spilled_sessions: Option<usize>,
    max_spill_mib: Option<u64>,
    max_state_mib: Option<u64>,
    min_free_mib: Option<u64>,
    durability: Option<DurabilityArg>,
    session_store: Option<String>,
    replica_id: Option<String>,
    lease_secs: Option<f64>,
    completion_queues: Option<usize>,
    sampler: Option<SamplerChoice>,
    speculate: Option<Speculate>,
    draft_model: Option<PathBuf>,
    draft_tokens: Option<u16>,
    device: Option<DeviceChoice>,
    shards: Option<Vec<String>>,
    shard_encoding: Option<ShardEncoding>,
}

impl FileConfig {
    fn read(path: &Path) -> Result<Self, CliError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::Usage(format!("config {}: {e}", path.display())))?;
        let mut cfg: FileConfig = toml::from_str(&text)
            .map_err(|e| CliError::Usage(format!("config {}: {e}", path.display())))?;
        let base = path.parent().unwrap_or(Path::new("."));
        for p in [
            &mut cfg.model,
            &mut cfg.auth_token_file,
            &mut cfg.tls_cert,
            &mut cfg.tls_key,
            &mut cfg.state_dir,
        ]
        .into_iter()
        .flatten()
        {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        Ok(cfg)
    }
}

/// The merged settings, before anything is opened.
#[derive(Debug, Clone)]
pub struct Settings {
    pub model: PathBuf,
    pub listen: String,
    pub workers: usize,
    /// Idle workers help busy ones (`--core-lending false` turns it off).
    pub core_lending: bool,
    pub kv: KvSize,
    pub max_sessions: usize,
    /// Pages of positions over all layers (`--prefix-cache-pages`); `None`:
    /// the default, which depends on `http_listen`.
    pub prefix_cache_pages: Option<u64>,
    pub idle_ttl: Duration,
    pub eviction: Eviction,
    pub overflow: Overflow,
    pub overflow_sink: usize,
    pub metrics_listen: Option<String>,
    pub http_listen: Option<String>,
    pub chat_template_file: Option<PathBuf>,
    /// The HTTP API's connection limit and timeouts.
    pub http_limits: HttpLimits,
    /// gRPC connections the descriptor budget leaves room for.
    pub grpc_connections: usize,
    pub auth_token_file: Option<PathBuf>,
    pub allow_unauthenticated: bool,
    pub tls: Option<(PathBuf, PathBuf)>,
    pub drain_timeout: Duration,
    pub state_dir: Option<PathBuf>,
    pub max_spilled_sessions: usize,
    pub max_spill_bytes: u64,
    /// What the state directory may take of the disk.
    pub state_limits: Limits,
    pub durability: DurabilityArg,
    /// The replicas' session store, this replica's name and the lease.
    pub replica: Option<crate::runtime::ReplicaConfig>,
    pub completion_queues: Option<usize>,
    pub sampler: SamplerChoice,
    pub speculate: Speculate,
    pub draft_model: Option<PathBuf>,
    pub draft_tokens: Option<usize>,
    pub device: DeviceChoice,
    /// Empty: this process runs every layer.
    pub shards: Vec<ShardSpec>,
    pub shard_encoding: ShardEncoding,
    /// The model file's SHA-256, read once whoever asks first (the shards'
    /// handshake, the journals, the replicas' store).
    model_sha256: std::cell::OnceCell<[u8; 32]>,
}

/// KV memory, by size or by page count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSize {
    Mib(u64),
    Pages(u64),
}

fn seconds(name: &str, value: f64) -> Result<Duration, CliError> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        CliError::Usage(format!(
            "{name} must be a number of seconds >= 0, got {value}"
        ))
    })
}

/// TLS as a (certificate, key) pair: both or neither.
fn tls_pair(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> Result<Option<(PathBuf, PathBuf)>, CliError> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some((cert, key))),
        (None, None) => Ok(None),
        _ => Err(CliError::Usage(
            "TLS needs both a certificate (tls_cert) and a key (tls_key)".into(),
        )),
    }
}

/// The state directory's limits from `max-state-mib` (at least 1 when
/// given) and `min-free-mib` (a default when not).
fn state_limits(max_state_mib: Option<u64>, min_free_mib: Option<u64>) -> Result<Limits, CliError> {
    Ok(Limits {
        max_bytes: match max_state_mib {
            Some(mib) => {
                Some((positive("max-state-mib", mib as usize)? as u64).saturating_mul(1 << 20))
            }
            None => None,
        },
        min_free_bytes: match min_free_mib {
            Some(mib) => mib.saturating_mul(1 << 20),
            None => DEFAULT_MIN_FREE_BYTES,
        },
    })
}

/// The shards: the flag's (already parsed) over the file's entries.
fn shard_list(
    flag: Option<&[ShardSpec]>,
    file: Option<&[String]>,
) -> Result<Vec<ShardSpec>, CliError> {
    Ok(match (flag, file) {
        (Some(flag), _) => flag.to_vec(),
        (None, Some(entries)) => entries
            .iter()
            .map(|e| ShardSpec::parse(e))
            .collect::<Result<_, _>>()
            .map_err(|e| CliError::Usage(format!("config shards: {e}")))?,
        (None, None) => Vec::new(),
    })
}

fn positive(name: &str, value: usize) -> Result<usize, CliError> {
    if value == 0 {
        return Err(CliError::Usage(format!("{name} must be at least 1")));
    }
    Ok(value)
}

impl ServeArgs {
    /// Flags (with their environment variables) over the file over defaults.
    ///
    /// Past the settings checked together (KV size, HTTP limits, TLS), the
    /// body is one table, a field per setting, each `flag.or(file)` then
    /// its default; it is left whole so that every setting's precedence
    /// reads in one place.
    pub fn settings(&self) -> Result<Settings, CliError> {
        let file = match &self.config {
            Some(path) => FileConfig::read(path)?,
            None => FileConfig::default(),
        };
        let kv = self.kv_size(&file)?;
        let http_limits = self.http_limits(&file)?;
        let tls = tls_pair(
            self.tls_cert.clone().or(file.tls_cert),
            self.tls_key.clone().or(file.tls_key),
        )?;
        let workers = match self.workers.or(file.workers) {
            Some(n) => positive("workers", n)?,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        Ok(Settings {
            model: self
                .model
                .clone()
                .or(file.model)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL)),
            listen: self
                .listen
                .clone()
                .or(file.listen)
                .unwrap_or_else(|| "127.0.0.1:50051".into()),
            workers,
            core_lending: self.core_lending.or(file.core_lending).unwrap_or(true),
            kv,
            max_sessions: positive(
                "max-sessions",
                self.max_sessions.or(file.max_sessions).unwrap_or(1024),
            )?,
            prefix_cache_pages: self.prefix_cache_pages.or(file.prefix_cache_pages),
            idle_ttl: seconds(
                "idle-ttl",
                self.idle_ttl.or(file.idle_ttl).unwrap_or(1800.0),
            )?,
            eviction: self.eviction.or(file.eviction).unwrap_or(Eviction::Lru),
            overflow: self
                .overflow
                .or(file.overflow)
                .unwrap_or(Overflow::Truncate),
            overflow_sink: self.overflow_sink.or(file.overflow_sink).unwrap_or(4),
            metrics_listen: self.metrics_listen.clone().or(file.metrics_listen),
            http_listen: self.http_listen.clone().or(file.http_listen),
            chat_template_file: self.chat_template_file.clone().or(file.chat_template_file),
            http_limits,
            grpc_connections: self
                .grpc_connections
                .or(file.grpc_connections)
                .unwrap_or(DEFAULT_GRPC_CONNECTIONS),
            auth_token_file: self.auth_token_file.clone().or(file.auth_token_file),
            allow_unauthenticated: self.allow_unauthenticated
                || file.allow_unauthenticated.unwrap_or(false),
            tls,
            drain_timeout: seconds(
                "drain-timeout",
                self.drain_timeout.or(file.drain_timeout).unwrap_or(30.0),
            )?,
            replica: super::replica::settings(
                self.session_store.clone().or(file.session_store),
                self.replica_id.clone().or(file.replica_id),
                self.lease_secs.or(file.lease_secs),
                self.state_dir.is_some() || file.state_dir.is_some(),
            )?,
            state_dir: self.state_dir.clone().or(file.state_dir),
            max_spilled_sessions: self
                .max_spilled_sessions
                .or(file.max_spilled_sessions)
                .unwrap_or(4096),
            max_spill_bytes: self
                .max_spill_mib
                .or(file.max_spill_mib)
                .unwrap_or(16 << 10)
                .saturating_mul(1 << 20),
            state_limits: state_limits(
                self.max_state_mib.or(file.max_state_mib),
                self.min_free_mib.or(file.min_free_mib),
            )?,
            durability: self
                .durability
                .or(file.durability)
                .unwrap_or(DurabilityArg::Sync),
            completion_queues: match self.completion_queues.or(file.completion_queues) {
                Some(n) => Some(positive("completion-queues", n)?),
                None => None,
            },
            sampler: self.sampler.or(file.sampler).unwrap_or_default(),
            speculate: super::generate::speculation_mode(
                self.speculate.or(file.speculate),
                self.draft_model.is_some() || file.draft_model.is_some(),
            )?,
            draft_model: self.draft_model.clone().or(file.draft_model.clone()),
            draft_tokens: match self.draft_tokens.or(file.draft_tokens) {
                Some(_) if self.draft_model.is_none() && file.draft_model.is_none() => {
                    return Err(CliError::Usage("--draft-tokens needs --draft-model".into()))
                }
                Some(n) if !(1..=15).contains(&n) => {
                    return Err(CliError::Usage(format!(
                        "draft_tokens is {n}; it must be 1-15"
                    )))
                }
                tokens => tokens.map(usize::from),
            },
            device: self.device.or(file.device).unwrap_or_default(),
            shards: shard_list(self.shards.as_deref(), file.shards.as_deref())?,
            shard_encoding: self
                .shard_encoding
                .or(file.shard_encoding)
                .unwrap_or_default(),
            model_sha256: std::cell::OnceCell::new(),
        })
    }
}

impl ServeArgs {
    /// The KV cache's size: `--kv-mib` or `--kv-pages` over the file's
    /// `kv_mib` or `kv_pages` (not both) over 256 MiB; never 0.
    fn kv_size(&self, file: &FileConfig) -> Result<KvSize, CliError> {
        let kv = match (self.kv_mib, self.kv_pages) {
            (Some(mib), _) => KvSize::Mib(mib),
            (None, Some(pages)) => KvSize::Pages(pages),
            (None, None) => match (file.kv_mib, file.kv_pages) {
                (Some(_), Some(_)) => {
                    return Err(CliError::Usage(
                        "config: give kv_mib or kv_pages, not both".into(),
                    ))
                }
                (Some(mib), None) => KvSize::Mib(mib),
                (None, Some(pages)) => KvSize::Pages(pages),
                (None, None) => KvSize::Mib(256),
            },
        };
        if matches!(kv, KvSize::Mib(0) | KvSize::Pages(0)) {
            return Err(CliError::Usage(
                "the KV cache size must be at least 1".into(),
            ));
        }
        Ok(kv)
    }

    /// The HTTP API's limits: flags over the file over defaults. The idle
    /// timeout may not be shorter than the header timeout: hyper times
    /// every request head after the first with it.
    fn http_limits(&self, file: &FileConfig) -> Result<HttpLimits, CliError> {
        let default = HttpLimits::default();
        let timeout = |name: &str, value: Option<f64>, default: Duration| match value {
            Some(v) if v > 0.0 => seconds(name, v),
            Some(v) => Err(CliError::Usage(format!(
                "{name} must be a number of seconds > 0, got {v}"
            ))),
            None => Ok(default),
        };
        let limits = HttpLimits {
            max_connections: positive(
                "http-max-connections",
                self.http_max_connections
                    .or(file.http_max_connections)
                    .unwrap_or(default.max_connections),
            )?,
            header_timeout: timeout(
                "http-header-timeout",
                self.http_header_timeout.or(file.http_header_timeout),
                default.header_timeout,
            )?,
            idle_timeout: timeout(
                "http-idle-timeout",
                self.http_idle_timeout.or(file.http_idle_timeout),
                default.idle_timeout,
            )?,
        };
        if limits.idle_timeout < limits.header_timeout {
            return Err(CliError::Usage(format!(
                "http-idle-timeout ({} s) must be at least http-header-timeout ({} s)",
                limits.idle_timeout.as_secs_f64(),
                limits.header_timeout.as_secs_f64()
            )));
        }
        Ok(limits)
    }
}

fn read_file(what: &str, path: &Path) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|e| CliError::Usage(format!("{what} {}: {e}", path.display())))
}

impl Settings {
    /// The model file's SHA-256, hashed on first use.
    fn model_sha256(&self) -> Result<[u8; 32], CliError> {
        if let Some(hash) = self.model_sha256.get() {
            return Ok(*hash);
        }
        let hash = sha256_of_file(&self.model)?;
        Ok(*self.model_sha256.get_or_init(|| hash))
    }

    /// Where the layers run when shards are listed: every shard must serve
    /// its range of this very file (checked by SHA-256 at the handshake).
    fn shard_plan(&self, model: &Model) -> Result<Option<Arc<ShardPlan>>, CliError> {
        if self.shards.is_empty() {
            return Ok(None);
        }
        let hash = self.model_sha256()?;
        let plan = ShardPlan::new(
            model.config.n_layers,
            model.config.hidden,
            hash,
            &self.shards,
            self.shard_encoding.encoding(),
        )
        .map_err(|e| CliError::Usage(format!("shards: {e}")))?;
        Ok(Some(Arc::new(plan)))
    }

    /// The state directory's journals, opened (created) and locked, for
    /// sessions of this model file (its SHA-256 is in every journal). Not
    /// for `--check`, which changes nothing on disk.
    fn session_store(&self) -> Result<Option<Arc<SessionStore>>, CliError> {
        let Some(dir) = &self.state_dir else {
            return Ok(None);
        };
        let hash = self.model_sha256()?;
        let durability = match self.durability {
            DurabilityArg::Sync => Durability::Sync,
            DurabilityArg::Batch => Durability::Batch,
            DurabilityArg::None => Durability::None,
        };
        let store = SessionStore::open_limited(dir, hash, durability, self.state_limits)
            .map_err(|e| CliError::Usage(e.to_string()))?;
        Ok(Some(Arc::new(store)))
    }

    /// With the HTTP API, whose stateless requests each run in a session of
    /// their own, a quarter of the KV cache keeps released prefixes for the
    /// next turn of a conversation; without it, none.
    fn default_prefix_cache_pages(&self, kv_bytes: u64, layout: &crate::kv::KvLayout) -> u64 {
        if self.http_listen.is_none() {
            return 0;
        }
        let page = (layout.page_stride() as u64).saturating_mul(layout.n_layers as u64);
        kv_bytes / page.max(1) / 4
    }

    /// Opens the files the settings name and builds the server's
    /// configuration for `model`.
    fn serve_config(&self, model: &Model) -> Result<ServeConfig, CliError> {
        let layout = model.kv_layout(model.config.n_layers, crate::kv::DEFAULT_PAGE_POSITIONS);
        let kv_bytes = match self.kv {
            KvSize::Mib(mib) => mib.saturating_mul(1 << 20),
            // A page of positions over all layers: one pool page per layer.
            KvSize::Pages(pages) => pages
                .saturating_mul(layout.page_stride() as u64)
                .saturating_mul(layout.n_layers as u64),
        };
        let shards = self.shard_plan(model)?;
        if shards.is_none() {
            super::memory::check_kv_fits(
                kv_bytes,
                super::file_len(&self.model),
                super::memory::limits(),
            )?;
        }
        let runtime = RuntimeConfig {
            workers: self.workers,
            lend_cores: self.core_lending,
            kv_bytes,
            max_sessions: self.max_sessions,
            max_spilled_sessions: self.max_spilled_sessions,
            max_spill_bytes: self.max_spill_bytes,
            prefix_cache_pages: usize::try_from(
                self.prefix_cache_pages
                    .unwrap_or_else(|| self.default_prefix_cache_pages(kv_bytes, &layout))
                    .saturating_mul(layout.n_layers as u64),
            )
            .unwrap_or(usize::MAX),
            idle_ttl: self.idle_ttl,
            eviction: match self.eviction {
                Eviction::Lru => EvictionPolicy::Lru,
                Eviction::None => EvictionPolicy::None,
            },
            overflow: match self.overflow {
                Overflow::Truncate => OverflowPolicy::Truncate {
                    sink: self.overflow_sink,
                },
                Overflow::Stop => OverflowPolicy::Stop,
            },
            // With the model on a GPU the sampler goes on that device once
            // it is open (`serve`), not on a second one.
            sampler: if self.device == DeviceChoice::Cpu {
                super::resolve_sampler(self.sampler)?
            } else {
                SelectedSampler::Cpu
            },
            layers: match shards {
                Some(plan) => Arc::new(ShardLayers::new(plan)),
                None => Arc::new(LocalLayers),
            },
            speculation: match self.speculate {
                Speculate::None => Speculation::None,
                Speculate::Lookup => Speculation::Lookup,
                Speculate::Draft => Speculation::Draft,
            },
            draft_tokens: self.draft_tokens,
            ..RuntimeConfig::default()
        };
        let mut cfg = ServeConfig::new(self.listen.clone(), runtime);
        if let Some(n) = self.completion_queues {
            cfg.completion_queues = n;
        }
        cfg.allow_unauthenticated = self.allow_unauthenticated;
        cfg.metrics_listen = self.metrics_listen.clone();
        cfg.http_listen = self.http_listen.clone();
        if let Some(path) = &self.chat_template_file {
            let text = String::from_utf8(read_file("chat template file", path)?).map_err(|_| {
                CliError::Usage(format!("chat template file {}: not UTF-8", path.display()))
            })?;
            cfg.chat_template = Some(text);
        }
        cfg.http_limits = self.http_limits;
        cfg.model_name = self
            .model
            .file_stem()
            .map_or("inferd".into(), |s| s.to_string_lossy().into_owned());
        if let Some(path) = &self.auth_token_file {
            let token = String::from_utf8(read_file("auth token file", path)?).map_err(|_| {
                CliError::Usage(format!("auth token file {}: not UTF-8", path.display()))
            })?;
            warn_if_readable_by_others(path);
            // Parsed here too, so that a bad line is reported with the path.
            AccessTokens::parse(&token)
                .map_err(|e| CliError::Usage(format!("auth token file {}: {e}", path.display())))?;
            cfg.auth_token = Some(token);
        }
        if let Some((cert, key)) = &self.tls {
            cfg.tls = Some(TlsIdentity {
                cert_pem: read_file("TLS certificate", cert)?,
                key_pem: read_file("TLS key", key)?,
            });
        }
        cfg.check_security()
            .map_err(|e| CliError::Usage(e.to_string()))?;
        Ok(cfg)
    }
}

#[cfg(unix)]
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o044 != 0 {
            tracing::warn!(file = %path.display(), "the auth token file is readable by other users");
        }
    }
}

#[cfg(not(unix))]
fn warn_if_readable_by_others(_: &Path) {}

/// The exit status after a second SIGTERM or SIGINT cut a shutdown short:
/// 128 plus the signal's number (143 for SIGTERM, 130 for SIGINT), what a
/// shell reports for a process the signal ended.
fn forced_exit_status(signal: i32) -> i32 {
    128 + signal
}

/// Once the first signal has started a shutdown, a second one ends the
/// process at once (`forced_exit_status`), as operators expect from Ctrl-C
/// twice: whatever was still draining is cut off. The process exits
/// without running destructors or at-exit hooks, so no thread still
/// serving a call can be caught half-torn-down.
pub(super) fn exit_on_second_signal(mut signals: Signals, what: &'static str) {
    let watcher = std::thread::Builder::new()
        .name("inferd-signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                let status = forced_exit_status(signal);
                tracing::warn!(signal, status, "second signal: {what} stops at once");
                signal_hook::low_level::exit(status);
            }
        });
    if let Err(e) = watcher {
        tracing::warn!(error = %e, "cannot watch for a second signal");
    }
}

pub(super) fn notify_systemd(state: &[sd_notify::NotifyState]) {
    if let Err(e) = sd_notify::notify(false, state) {
        tracing::warn!(error = %e, "could not notify systemd");
    }
}

/// Checks the settings' file-descriptor budget against RLIMIT_NOFILE,
/// raising the soft limit when the budget needs it; refuses to start when
/// even the hard limit is too low (a server that started would fail with
/// EMFILE later, at its busiest).
fn check_fd_budget(settings: &Settings) -> Result<(), CliError> {
    let budget = settings.fd_budget();
    match budget.ensure() {
        Ok(crate::limits::FdFit::Fits { needed, soft }) => {
            tracing::info!(needed, limit = soft, "file-descriptor budget: {budget}");
        }
        Ok(crate::limits::FdFit::Raised { needed, from, to }) => {
            tracing::info!(
                needed,
                from,
                to,
                "file-descriptor budget {budget}: raised the soft RLIMIT_NOFILE"
            );
        }
        Err(e) => return Err(CliError::Usage(e.to_string())),
    }
    Ok(())
}

/// Runs `inferd serve`.
pub fn run(args: ServeArgs) -> Result<(), CliError> {
    // Registered first, so a signal that arrives during start-up is not the
    // default (fatal) action but a drain right after it.
    let mut signals = Signals::new([SIGTERM, SIGINT])?;
    let settings = args.settings()?;
    check_fd_budget(&settings)?;
    let t0 = Instant::now();
    let model = Model::load(&settings.model).map_err(|source| CliError::ModelLoad {
        path: settings.model.display().to_string(),
        source,
    })?;
    let model = Arc::new(model);
    let mut cfg = settings.serve_config(&model)?;
    if let Some(path) = &settings.draft_model {
        if settings.device != DeviceChoice::Cpu || !settings.shards.is_empty() {
            return Err(CliError::Usage(
                "--draft-model speculates with layers run here on the CPU (not with --device \
                 or --shards)"
                    .into(),
            ));
        }
        cfg.runtime.draft_model = Some(Arc::new(super::generate::load_draft(path, &model)?));
    }
    if settings.device != DeviceChoice::Cpu {
        if !settings.shards.is_empty() {
            return Err(CliError::Usage(
                "--device applies to layers run here; with --shards they run on the shards \
                 (give `inferd shard` the --device)"
                    .into(),
            ));
        }
        let gpu = super::device::open_device(settings.device)?;
        // The weights and the KV cache asked for are on the device before
        // the choice is final: `auto` takes the CPU if they do not fit.
        match super::device::on_device(settings.device, gpu, |device| {
            GpuLayers::new(device, Arc::clone(&model))?.with_kv(&cfg.runtime)
        })? {
            Some(mut layers) => {
                tracing::info!(
                    weights_mib = layers.weight_bytes() >> 20,
                    "model weights on the GPU"
                );
                if let Some(context) =
                    super::device::device_sampler(settings.sampler, layers.device())?
                {
                    cfg.runtime.sampler = SelectedSampler::Wgpu(Arc::clone(&context));
                    layers = layers.sampling_on(context);
                }
                cfg.runtime.layers = Arc::new(layers);
            }
            None => cfg.runtime.sampler = super::resolve_sampler(settings.sampler)?,
        }
    }
    if args.check {
        println!(
            "configuration ok: model {} ({} layers, vocabulary {}, context {}), listen {}, \
             {} workers, KV {}, tls {}, auth token {}, sampler {}, {}, {}, sessions {}",
            settings.model.display(),
            model.config.n_layers,
            model.config.vocab,
            model.config.context,
            settings.listen,
            settings.workers,
            if !settings.shards.is_empty() {
                "on the shards".to_owned()
            } else if let Some(draft) = cfg.runtime.draft_kv_bytes(&model) {
                format!(
                    "{} MiB ({} MiB of it for the draft model)",
                    cfg.runtime.kv_bytes >> 20,
                    draft >> 20
                )
            } else {
                format!("{} MiB", cfg.runtime.kv_bytes >> 20)
            },
            if cfg.tls.is_some() { "on" } else { "off" },
            match cfg.access_tokens().ok().flatten() {
                Some(tokens) if tokens.has_tenants() => {
                    format!("required (tenants: {})", tokens.len())
                }
                Some(_) => "required".into(),
                None => "none".into(),
            },
            match cfg.runtime.sampler.adapter() {
                Some(adapter) => format!("wgpu on {adapter}"),
                None => "cpu".into(),
            },
            cfg.runtime.layers.describe(),
            match (&settings.draft_model, settings.speculate) {
                (Some(path), _) => format!("speculation by draft model {}", path.display()),
                (None, mode) => format!("speculation {}", format!("{mode:?}").to_lowercase()),
            },
            match &settings.state_dir {
                Some(dir) => format!(
                    "kept in {} ({} durability)",
                    dir.display(),
                    format!("{:?}", settings.durability).to_lowercase()
                ),
                None => match &settings.replica {
                    Some(replica) => super::replica::describe(replica),
                    None => "in memory only".into(),
                },
            },
        );
        if !settings.shards.is_empty() {
            println!("{}", cfg.runtime.layers.describe());
        }
        return Ok(());
    }
    cfg.runtime.state = settings.session_store()?;
    if let Some(replica) = &settings.replica {
        super::replica::connect(replica)?;
        let model_sha256 = Some(settings.model_sha256()?);
        cfg.runtime.replica = Some(crate::runtime::ReplicaConfig {
            model_sha256,
            ..replica.clone()
        });
    }
    let server = Server::start(model, cfg).map_err(|e| CliError::Usage(e.to_string()))?;
    tracing::info!(
        model = %settings.model.display(),
        start_ms = t0.elapsed().as_secs_f64() * 1e3,
        "ready"
    );
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", server.addr())?;
        if let Some(addr) = server.metrics_addr() {
            writeln!(out, "metrics on {addr}")?;
        }
        if let Some(addr) = server.http_addr() {
            writeln!(out, "http on {addr}")?;
        }
        out.flush()?;
    }
    notify_systemd(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&format!("serving on {}", server.addr())),
    ]);
    let signal = signals.forever().next().unwrap_or(SIGTERM);
    tracing::info!(signal, "draining");
    exit_on_second_signal(signals, "the drain");
    notify_systemd(&[sd_notify::NotifyState::Stopping]);
    let report = server.shutdown(settings.drain_timeout);
    if !report.drained {
        tracing::warn!("some calls were cancelled at the drain timeout");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Harness {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> ServeArgs {
        Harness::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
            .expect("flags parse")
            .serve
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("inferd.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:7000\"\nworkers = 3\nkv_pages = 64\neviction = \"none\"\nmodel = \"m.gguf\"\n",
        )
        .expect("write config");
        let config = path.to_str().expect("utf-8 path");
        let s = parse(&["--config", config, "--workers", "2"])
            .settings()
            .expect("valid");
        assert_eq!(s.listen, "127.0.0.1:7000");
        assert_eq!(s.workers, 2);
        assert_eq!(s.kv, KvSize::Pages(64));
        assert_eq!(s.eviction, Eviction::None);
        assert_eq!(s.model, dir.path().join("m.gguf"), "relative to the file");
        assert_eq!(s.idle_ttl, Duration::from_secs(1800));
        let s = parse(&["--config", config, "--kv-mib", "8"])
            .settings()
            .expect("valid");
        assert_eq!(s.kv, KvSize::Mib(8), "a flag of the other kind wins too");
        assert!(s.core_lending, "lending is on by default");
    }

    #[test]
    fn core_lending_is_turned_off_by_the_flag_or_the_file() {
        assert!(
            !parse(&["--core-lending", "false"])
                .settings()
                .expect("valid")
                .core_lending
        );
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("inferd.toml");
        std::fs::write(&path, "core_lending = false\n").expect("write config");
        let config = path.to_str().expect("utf-8 path");
        let s = parse(&["--config", config]).settings().expect("valid");
        assert!(!s.core_lending);
        let s = parse(&["--config", config, "--core-lending", "true"])
            .settings()
            .expect("valid");
        assert!(s.core_lending, "the flag wins over the file");
    }

    #[test]
    fn http_limits_come_from_flags_or_the_file_and_are_checked() {
        let s = parse(&[]).settings().expect("valid");
        assert_eq!(s.http_limits, HttpLimits::default());
        assert_eq!(s.grpc_connections, DEFAULT_GRPC_CONNECTIONS);
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("inferd.toml");
        std::fs::write(
            &path,
            "http_max_connections = 8\nhttp_header_timeout = 2.5\nhttp_idle_timeout = 30\n\
             grpc_connections = 4\n",
        )
        .expect("write config");
        let config = path.to_str().expect("utf-8 path");
        let s = parse(&["--config", config, "--http-idle-timeout", "5"])
            .settings()
            .expect("valid");
        assert_eq!(s.http_limits.max_connections, 8);
        assert_eq!(s.http_limits.header_timeout, Duration::from_millis(2500));
        assert_eq!(s.http_limits.idle_timeout, Duration::from_secs(5));
        assert_eq!(s.grpc_connections, 4);
        for bad in [
            &["--http-max-connections", "0"][..],
            &["--http-header-timeout", "0"],
            &["--http-header-timeout", "20", "--http-idle-timeout", "10"],
        ] {
            let err = parse(bad).settings().expect_err("refused");
            assert!(err.to_string().contains("http-"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn the_descriptor_budget_counts_what_the_settings_allow() {
        let s = parse(&["--completion-queues", "1"])
            .settings()
            .expect("valid");
        let base = s.fd_budget().total();
        let s = parse(&[
            "--completion-queues",
            "1",
            "--http-listen",
            "127.0.0.1:0",
            "--http-max-connections",
            "100",
        ])
        .settings()
        .expect("valid");
        assert_eq!(s.fd_budget().total(), base + 101);
        let s = parse(&[
            "--completion-queues",
            "1",
            "--state-dir",
            "/nonexistent",
            "--max-sessions",
            "10",
            "--max-spilled-sessions",
            "20",
            "--workers",
            "2",
        ])
        .settings()
        .expect("valid");
        assert_eq!(
            s.fd_budget().total(),
            base + 10 + 20 + 2 * super::super::budget::PER_WORKER_WITH_STATE
        );
    }

    #[test]
    fn an_unknown_key_or_a_bad_value_is_refused_with_its_name() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "listen = \"127.0.0.1:1\"\nworker = 2\n").expect("write");
        let err = parse(&["--config", path.to_str().expect("utf-8")])
            .settings()
            .expect_err("unknown key");
        assert!(err.to_string().contains("worker"), "{err}");
        let err = parse(&["--idle-ttl=-1"]).settings().expect_err("negative");
        assert!(err.to_string().contains("idle-ttl"), "{err}");
        let err = parse(&["--workers", "0"]).settings().expect_err("zero");
        assert!(err.to_string().contains("workers"), "{err}");
        let err = parse(&["--max-state-mib", "0"])
            .settings()
            .expect_err("zero");
        assert!(err.to_string().contains("max-state-mib"), "{err}");
    }

    #[test]
    fn the_state_directory_limits_come_from_flags_or_the_file() {
        let s = parse(&[]).settings().expect("valid");
        assert_eq!(s.state_limits, Limits::default());
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("inferd.toml");
        std::fs::write(
            &path,
            "max_state_mib = 100
min_free_mib = 0
",
        )
        .expect("write");
        let config = path.to_str().expect("utf-8 path");
        let s = parse(&["--config", config]).settings().expect("valid");
        assert_eq!(
            s.state_limits,
            Limits {
                max_bytes: Some(100 << 20),
                min_free_bytes: 0
            }
        );
        let s = parse(&["--config", config, "--min-free-mib", "5"])
            .settings()
            .expect("valid");
        assert_eq!(s.state_limits.min_free_bytes, 5 << 20);
    }
}
