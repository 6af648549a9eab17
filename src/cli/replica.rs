//! serve's replica settings (`--session-store`, `--replica-id`,
//! `--lease-secs`): merged and checked, and the store connected once at
//! start, which applies its schema migrations or refuses a newer schema.

use std::time::Duration;

use super::CliError;
use crate::replica::{Store, DEFAULT_LEASE};
use crate::runtime::ReplicaConfig;

/// Longest name a replica may take (it is in every lease row).
const MAX_REPLICA_ID: usize = 128;

/// The replica settings from flags, environment or file; `None` without a
/// store. The other two need one, and a state directory excludes it.
pub fn settings(
    url: Option<String>,
    replica: Option<String>,
    lease_secs: Option<f64>,
    state_dir: bool,
) -> Result<Option<ReplicaConfig>, CliError> {
    let Some(url) = url else {
        if replica.is_some() || lease_secs.is_some() {
            return Err(CliError::Usage(
                "--replica-id and --lease-secs need --session-store".into(),
            ));
        }
        return Ok(None);
    };
    if state_dir {
        return Err(CliError::Usage(
            "--session-store and --state-dir are alternatives: with a session store, \
             the store keeps the sessions"
                .into(),
        ));
    }
    let replica = match replica {
        Some(name) => name,
        None => default_replica_id(),
    };
    if replica.is_empty()
        || replica.len() > MAX_REPLICA_ID
        || !replica.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(CliError::Usage(format!(
            "--replica-id must be 1 to {MAX_REPLICA_ID} printable ASCII characters \
             without spaces, got {replica:?}"
        )));
    }
    let lease = match lease_secs {
        None => DEFAULT_LEASE,
        Some(secs) if (0.5..=3600.0).contains(&secs) => Duration::from_secs_f64(secs),
        Some(secs) => {
            return Err(CliError::Usage(format!(
                "--lease-secs must be 0.5 to 3600 seconds, got {secs}"
            )))
        }
    };
    Ok(Some(ReplicaConfig {
        url,
        replica,
        lease,
        // Hashed once the model is chosen (serve's start, not its check).
        model_sha256: None,
    }))
}

/// What `serve --check` says of where the sessions are kept (not the URL,
/// which may hold a password).
pub fn describe(replica: &ReplicaConfig) -> String {
    format!(
        "kept in the session store as replica {} (leases of {:?})",
        replica.replica, replica.lease
    )
}

/// Connects to the store once (its schema brought up to date, a newer one
/// refused): the runtime's workers then connect on their own.
pub fn connect(replica: &ReplicaConfig) -> Result<(), CliError> {
    Store::connect(&replica.url, &replica.replica, replica.lease)
        .map_err(|e| CliError::Usage(format!("--session-store: {e}")))?;
    tracing::info!(replica = %replica.replica, lease = ?replica.lease, "session store connected");
    Ok(())
}

/// `HOSTNAME-PID`: unique among running processes, not stable across
/// restarts (a restarted replica waits out its old leases like any other).
fn default_replica_id() -> String {
    let host = hostname().unwrap_or_else(|| "inferd".into());
    format!("{host}-{}", std::process::id())
}

fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length, which is passed.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name: String = String::from_utf8_lossy(&buf[..end])
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(MAX_REPLICA_ID - 12)
        .collect();
    (!name.is_empty()).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_settings_are_checked() {
        let url = || Some("postgres://u@localhost/db".to_owned());
        assert!(settings(None, None, None, false).unwrap().is_none());
        assert!(settings(None, Some("a".into()), None, false).is_err());
        assert!(settings(url(), None, None, true).is_err());
        assert!(settings(url(), Some("a b".into()), None, false).is_err());
        assert!(settings(url(), None, Some(0.1), false).is_err());
        let s = settings(url(), None, Some(2.0), false).unwrap().unwrap();
        assert_eq!(s.lease, Duration::from_secs(2));
        assert!(s.replica.ends_with(&format!("-{}", std::process::id())));
        assert!(!format!("{s:?}").contains("postgres://"));
    }
}
