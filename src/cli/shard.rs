//! `inferd shard`: serves one layer range of a model over the shard
//! protocol until SIGTERM or SIGINT.

use std::io::Write as _;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use super::{CliError, DEFAULT_MODEL};
use crate::cluster::coordinator::parse_layers;
use crate::cluster::fingerprint::{sha256_of_file, Fingerprint};
use crate::cluster::shard::{ShardConfig, ShardServer};
use crate::model::Model;

/// Flags of `inferd shard`.
#[derive(Debug, Args, Clone)]
pub struct ShardArgs {
    /// GGUF model file (the same file every shard and the coordinator use).
    #[arg(long, short = 'm', env = "INFERD_MODEL", default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Layers to run, half-open: `10..20` runs layers 10 to 19.
    #[arg(long, value_parser = parse_layers)]
    pub layers: Range<usize>,
    /// Address to listen on, IP:PORT (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:50061")]
    pub listen: String,
    /// KV cache memory for this shard's layers, in MiB.
    #[arg(long, default_value_t = 256)]
    pub kv_mib: u64,
    /// Compute threads [default: one per core].
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
}

/// Runs `inferd shard`.
pub fn run(args: ShardArgs) -> Result<(), CliError> {
    let mut signals = Signals::new([SIGTERM, SIGINT])?;
    let model = Model::load(&args.model).map_err(|source| CliError::ModelLoad {
        path: args.model.display().to_string(),
        source,
    })?;
    let hash = sha256_of_file(&args.model)?;
    let fingerprint = Fingerprint {
        gguf_sha256: hash,
        layer_begin: args.layers.start as u32,
        layer_end: args.layers.end as u32,
        layer_count: model.config.n_layers as u32,
        hidden_size: model.config.hidden as u32,
    };
    let mut cfg = ShardConfig::new(args.layers.clone(), args.listen.clone());
    cfg.kv_bytes = args.kv_mib.max(1) << 20;
    if let Some(threads) = args.threads {
        cfg.threads = threads.max(1);
    }
    let server = ShardServer::start(Arc::new(model), fingerprint, &cfg)
        .map_err(|e| CliError::Usage(e.to_string()))?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", server.addr())?;
        out.flush()?;
    }
    let signal = signals.forever().next().unwrap_or(SIGTERM);
    tracing::info!(signal, "shard stopping");
    server.shutdown();
    Ok(())
}
