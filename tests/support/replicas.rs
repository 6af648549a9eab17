//! What the replica tests share: `inferd serve --session-store` processes
//! of a test's PostgreSQL, the store's row of a session, a replica's
//! metrics, and prompts inside the synthetic model's vocabulary.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use grpcio::RpcStatusCode;

use super::postgres::Postgres;
use super::{greedy, sample, scrape, Client, Generated, Inferd};

/// `inferd serve` as replica `name` of the store at `pg`, leases of `lease`
/// seconds, with a metrics endpoint, and `extra` arguments.
pub fn replica(model: &Path, pg: &Postgres, name: &str, lease: &str, extra: &[&str]) -> Inferd {
    replica_of(model, &pg.url, name, lease, extra)
}

/// [`replica`] of the store at `url`.
pub fn replica_of(model: &Path, url: &str, name: &str, lease: &str, extra: &[&str]) -> Inferd {
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--workers",
        "2",
        "--model",
        model.to_str().expect("UTF-8 path"),
        "--session-store",
        url,
        "--replica-id",
        name,
        "--lease-secs",
        lease,
    ];
    args.extend_from_slice(extra);
    Inferd::start(&args)
}

/// The store's row of session `id`: its history, owner and epoch.
pub fn row(pg: &Postgres, id: &str) -> Option<(Vec<u32>, String, i64)> {
    let row = pg
        .client()
        .query_opt(
            "SELECT history, owner, epoch FROM inferd_sessions WHERE id = $1",
            &[&id],
        )
        .expect("reads the store")?;
    let bytes: Vec<u8> = row.get(0);
    let history = bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Some((history, row.get(1), row.get(2)))
}

pub fn metric(process: &Inferd, name: &str) -> f64 {
    let text = scrape(process.metrics.as_deref().expect("a metrics endpoint"));
    sample(&text, name).unwrap_or_else(|| panic!("{name} not in the metrics"))
}

pub fn unavailable(g: &Generated) -> bool {
    matches!(&g.error, Some((code, _)) if *code == i32::from(RpcStatusCode::UNAVAILABLE))
}

/// Prompt tokens of session `n`'s round `k` (inside the model's vocabulary).
pub fn prompt(n: usize, k: usize) -> Vec<u32> {
    (0..6)
        .map(|i| ((n * 37 + k * 11 + i * 5) % 300) as u32 + 3)
        .collect()
}

/// Conversation `n` on session `id`: rounds of an append of [`prompt`]s
/// and a greedy Generate(3), until `stop` (after two rounds at least) or a
/// call fails. Returns the tokens the calls acknowledged, in order.
pub fn converse(client: &Client, id: &str, n: usize, stop: &AtomicBool) -> Vec<u32> {
    let mut acknowledged = Vec::new();
    for k in 0.. {
        if stop.load(Ordering::Relaxed) && k >= 2 {
            break;
        }
        let tokens = prompt(n, k);
        if client.append(id, &tokens).is_err() {
            break;
        }
        acknowledged.extend_from_slice(&tokens);
        let got = client.generate(&greedy(id, 3, 0));
        if got.done.is_none() {
            break;
        }
        acknowledged.extend_from_slice(&got.tokens);
    }
    acknowledged
}

/// After the replica holding session `id` was killed mid-conversation: the
/// store holds every `acknowledged` token, and beyond them at most the
/// call the kill cut off; the next greedy Generate of `n` tokens through
/// `client` answers after at most one UNAVAILABLE. Returns the stored
/// history and that Generate.
pub fn after_a_kill(
    pg: &Postgres,
    client: &Client,
    id: &str,
    acknowledged: &[u32],
    n: u32,
) -> (Vec<u32>, Generated) {
    assert!(
        acknowledged.len() >= 6,
        "{id}: the conversation never began"
    );
    let (stored, _, _) = row(pg, id).expect("the session is in the store");
    assert_eq!(
        &stored[..acknowledged.len()],
        acknowledged,
        "{id}: acknowledged tokens missing from the store"
    );
    assert!(stored.len() - acknowledged.len() <= 6, "{id}: {stored:?}");
    let mut got = client.generate(&greedy(id, n, 0));
    if unavailable(&got) {
        got = client.generate(&greedy(id, n, 0));
    }
    assert!(got.error.is_none(), "{id}: {got:?}");
    (stored, got)
}
