//! `inferd relay`: forwards shard-protocol calls to one upstream shard
//! without decoding them, until SIGTERM or SIGINT. The first signal cancels
//! the calls it carries and exits 0; a second one, should that hang, ends
//! the process at once (128 + its number).

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
    #[arg(long, env = "INFERD_RELAY_LISTEN")]
    pub listen: String,
    /// The shard (or next relay) to forward to, HOST:PORT.
    #[arg(long, env = "INFERD_RELAY_UPSTREAM")]
    pub upstream: String,
    /// Append the SHA-256 of every message at ingress and egress to this
    /// file, one JSON line per message.
    #[arg(long, env = "INFERD_RELAY_RECORD")]
    pub record: Option<PathBuf>,
    /// Largest message forwarded, in MiB.
    #[arg(long, env = "INFERD_RELAY_MAX_MESSAGE_MIB", default_value_t = 64)]
    pub max_message_mib: u32,
    /// Listen on a non-loopback address (the shard protocol carries no
    /// credentials: only on a network that admits nothing else).
    #[arg(long, env = "INFERD_ALLOW_UNAUTHENTICATED")]
    pub allow_unauthenticated: bool,
}

/// Runs `inferd relay`.
pub fn run(args: RelayArgs) -> Result<(), CliError> {
    let mut signals = Signals::new([SIGTERM, SIGINT])?;
    super::shard::check_open_listen(&args.listen, args.allow_unauthenticated)?;
    let relay = Relay::start(&RelayConfig {
        listen: args.listen,
        upstream: args.upstream,
        record: args.record,
        max_message_bytes: args.max_message_mib.saturating_mul(1 << 20),
    })
    .map_err(|e| CliError::Usage(e.to_string()))?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", relay.addr())?;
        out.flush()?;
    }
    super::serve::notify_systemd(&[sd_notify::NotifyState::Ready]);
    let signal = signals.forever().next().unwrap_or(SIGTERM);
    tracing::info!(signal, "relay stopping");
    super::serve::exit_on_second_signal(signals, "the relay");
    super::serve::notify_systemd(&[sd_notify::NotifyState::Stopping]);
    relay.shutdown();
    Ok(())
}
