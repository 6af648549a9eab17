//! `inferd shard`: serves one layer range of a model over the shard
//! protocol until SIGTERM or SIGINT. The first signal stops accepting,
//! cancels the open streams and stops computations at their next step
//! (exit 0); a second one ends the process at once (128 + its number).

use std::io::Write as _;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use super::{CliError, DeviceChoice, DEFAULT_MODEL};
use crate::cluster::coordinator::parse_layers;
use crate::cluster::fingerprint::{sha256_of_file, Fingerprint};
use crate::cluster::shard::{ShardConfig, ShardServer, DEFAULT_MAX_FRAME_ROWS};
use crate::model::Model;

/// Flags of `inferd shard`.
#[derive(Debug, Args, Clone)]
pub struct ShardArgs {
    /// GGUF model file (the same file every shard and the coordinator use).
    #[arg(long, short = 'm', env = "INFERD_MODEL", default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Layers to run, half-open: `10..20` runs layers 10 to 19.
    #[arg(long, env = "INFERD_SHARD_LAYERS", value_parser = parse_layers)]
    pub layers: Range<usize>,
    /// Address to listen on, IP:PORT (port 0: any free port).
    #[arg(long, env = "INFERD_SHARD_LISTEN", default_value = "127.0.0.1:50061")]
    pub listen: String,
    /// KV cache memory for this shard's layers, in MiB.
    #[arg(long, env = "INFERD_SHARD_KV_MIB", default_value_t = 256)]
    pub kv_mib: u64,
    /// Compute threads [default: one per core].
    #[arg(long, short = 't', env = "INFERD_SHARD_THREADS")]
    pub threads: Option<usize>,
    /// Rows (positions) one hidden-state frame may carry; larger frames are
    /// refused before any compute. Advertised in the handshake.
    #[arg(
        long,
        env = "INFERD_SHARD_MAX_FRAME_ROWS",
        default_value_t = DEFAULT_MAX_FRAME_ROWS,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub max_frame_rows: u32,
    /// Directory where this shard's KV pages and their log live, so that a
    /// restarted shard (or a restarted coordinator) takes back the pages
    /// its sessions had instead of having them fed again. Locked while the
    /// shard runs; a directory of another model or layer range is not used.
    #[arg(long, env = "INFERD_SHARD_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Where the layers run: `cpu`, `gpu` (any Vulkan/Metal adapter,
    /// lavapipe included; fails if there is none) or `auto` (a hardware GPU
    /// if there is one and the layers and their KV fit, else the CPU). The
    /// handshake tells the coordinator which.
    #[arg(long, env = "INFERD_DEVICE", value_enum, default_value_t = DeviceChoice::Cpu)]
    pub device: DeviceChoice,
    /// Listen on a non-loopback address. The shard protocol carries no
    /// credentials: only do this on a network that admits nothing but the
    /// coordinator (and relays).
    #[arg(long, env = "INFERD_ALLOW_UNAUTHENTICATED")]
    pub allow_unauthenticated: bool,
}

/// The shard protocol has no authentication: an address other machines can
/// reach must be asked for explicitly.
pub(super) fn check_open_listen(listen: &str, allowed: bool) -> Result<(), CliError> {
    if allowed || crate::server::is_loopback(listen) {
        return Ok(());
    }
    Err(CliError::Usage(format!(
        "refusing to listen on {listen}: it is not a loopback address and the shard protocol \
         carries no credentials; give --allow-unauthenticated on a network that admits only \
         the coordinator"
    )))
}

/// Runs `inferd shard`.
pub fn run(args: ShardArgs) -> Result<(), CliError> {
    let mut signals = Signals::new([SIGTERM, SIGINT])?;
    check_open_listen(&args.listen, args.allow_unauthenticated)?;
    let model = Model::load(&args.model).map_err(|source| CliError::ModelLoad {
        path: args.model.display().to_string(),
        source,
    })?;
    let hash = sha256_of_file(&args.model)?;
    let fingerprint = Fingerprint::of_layers(hash, &model.config, args.layers.clone());
    let mut cfg = ShardConfig::new(args.layers.clone(), args.listen.clone());
    cfg.kv_bytes = args.kv_mib.max(1) << 20;
    super::memory::check_kv_fits(
        cfg.kv_bytes,
        super::file_len(&args.model),
        super::memory::limits(),
    )?;
    if let Some(threads) = args.threads {
        cfg.threads = threads.max(1);
    }
    cfg.max_frame_rows = args.max_frame_rows;
    cfg.state_dir = args.state_dir.clone();
    let model = Arc::new(model);
    let gpu = super::device::open_device(args.device)?;
    let on_gpu = super::device::on_device(args.device, gpu, |device| {
        let cfg = ShardConfig {
            gpu: Some(device),
            ..cfg.clone()
        };
        ShardServer::start(Arc::clone(&model), fingerprint.clone(), &cfg)
    })?;
    let server = match on_gpu {
        Some(server) => server,
        None => ShardServer::start(model, fingerprint, &cfg)
            .map_err(|e| CliError::Usage(e.to_string()))?,
    };
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", server.addr())?;
        out.flush()?;
    }
    super::serve::notify_systemd(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&format!(
            "layers {}..{} on {}",
            args.layers.start,
            args.layers.end,
            server.addr()
        )),
    ]);
    let signal = signals.forever().next().unwrap_or(SIGTERM);
    tracing::info!(signal, "shard stopping");
    super::serve::exit_on_second_signal(signals, "the shard");
    super::serve::notify_systemd(&[sd_notify::NotifyState::Stopping]);
    server.shutdown();
    Ok(())
}
