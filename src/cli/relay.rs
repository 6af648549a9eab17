//! `inferd relay`: forwards shard-protocol calls to one upstream shard
//! without decoding them, until SIGTERM or SIGINT.

use std::io::Write as _;
use std::path::PathBuf;

use clap::Args;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use super::CliError;
use crate::cluster::relay::{Relay, RelayConfig};

/// Flags of `inferd relay`.
#[derive(Debug, Args, Clone)]
pub struct RelayArgs {
    /// Address to listen on, IP:PORT (port 0: any free port).
    #[arg(long)]
    pub listen: String,
    /// The shard (or next relay) to forward to, HOST:PORT.
    #[arg(long)]
    pub upstream: String,
    /// Append the SHA-256 of every message at ingress and egress to this
    /// file, one JSON line per message.
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// Largest message forwarded, in MiB.
    #[arg(long, default_value_t = 64)]
    pub max_message_mib: u32,
}

/// Runs `inferd relay`.
pub fn run(args: RelayArgs) -> Result<(), CliError> {
    let mut signals = Signals::new([SIGTERM, SIGINT])?;
    let relay = Relay::start(&RelayConfig {
        listen: args.listen,
        upstream: args.upstream,
        record: args.record,
        max_message_bytes: args.max_message_mib.saturating_mul(1 << 20),
    })
    .map_err(CliError::Usage)?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", relay.addr())?;
        out.flush()?;
    }
    let signal = signals.forever().next().unwrap_or(SIGTERM);
    tracing::info!(signal, "relay stopping");
    relay.shutdown();
    Ok(())
}
