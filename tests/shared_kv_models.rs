//! Shared prefixes, forks and pages taken back after a restart on real
//! models, through the runtime: the reference model, and Gemma 3 270M,
//! whose sliding-window layers give pages back as a session grows
//! (CONTRACT §2.11, §2.12, §2.13). Every digest is compared with a runtime
//! that computed the same history from scratch and never shared a page.
//!
//! Without the model files the tests say so loudly and pass, unless
//! INFERD_REQUIRE_MODELS is set (scripts/test sets it).

use std::path::Path;
use std::sync::Arc;

use inferd::durable::{Durability, SessionStore};
use inferd::model::Model;
use inferd::runtime::{
    AppendTokens, CreateSession, ForkSession, Runtime, RuntimeConfig, RuntimeError, SessionId,
    Tenant,
};

fn load(path: &str) -> Option<Arc<Model>> {
    if !Path::new(path).exists() {
        assert!(
            std::env::var_os("INFERD_REQUIRE_MODELS").is_none(),
            "{path} is missing (scripts/fetch-model)"
        );
        eprintln!("\n!!! SKIPPED: {path} is missing (scripts/fetch-model)\n");
        return None;
    }
    Some(Arc::new(Model::load(path).expect("model loads")))
}

fn runtime(model: &Arc<Model>) -> Runtime {
    Runtime::start(
        Arc::clone(model),
        RuntimeConfig {
            workers: 2,
            pin_cores: false,
            kv_bytes: 256 << 20,
            ..RuntimeConfig::default()
        },
    )
    .expect("runtime starts")
}

fn session(rt: &Runtime, history: &[u32]) -> SessionId {
    let id = rt
        .create_session(&Tenant::NONE, CreateSession::default(), None)
        .expect("queued")
        .wait()
        .expect("created");
    rt.append_tokens(
        &Tenant::NONE,
        AppendTokens {
            id,
            tokens: history.to_vec(),
        },
        None,
    )
    .expect("queued")
    .wait()
    .expect("appended");
    id
}

fn digest(rt: &Runtime, id: SessionId) -> u64 {
    rt.session_info(&Tenant::NONE, id, None)
        .expect("queued")
        .wait()
        .expect("info")
        .logits_digest
}

fn fork(rt: &Runtime, source: SessionId, at: u64) -> Result<SessionId, RuntimeError> {
    rt.fork_session(
        &Tenant::NONE,
        ForkSession {
            source,
            at_length: Some(at),
            client_label: None,
        },
        None,
    )?
    .wait()
    .map(|reply| reply.id)
}

/// Digests of `history` computed from scratch, one runtime per history.
fn cold(model: &Arc<Model>, history: &[u32]) -> u64 {
    let rt = runtime(model);
    let id = session(&rt, history);
    let d = digest(&rt, id);
    assert_eq!(rt.stats().prefix_reused_tokens, 0);
    d
}

fn tokens(n: usize, salt: u32, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(7919) + 11 + salt * 104_729) % (vocab as u32 - 200) + 100)
        .collect()
}

/// A 700-token history shared to 600 tokens by a second session, and
/// forks of the first: every digest as computed from scratch.
fn check(model: &Arc<Model>) {
    let vocab = model.config.vocab;
    let history = tokens(700, 1, vocab);
    let mut branch = history[..600].to_vec();
    branch.extend(tokens(50, 2, vocab));

    let rt = runtime(model);
    let first = session(&rt, &history);
    let second = session(&rt, &branch);
    assert_eq!(rt.stats().prefix_reused_tokens, 592, "37 full pages mapped");
    assert_eq!(digest(&rt, first), cold(model, &history));
    assert_eq!(digest(&rt, second), cold(model, &branch));
    for at in [700, 699, 690] {
        let forked = fork(&rt, first, at).expect("fork");
        assert_eq!(
            digest(&rt, forked),
            cold(model, &history[..at as usize]),
            "fork at {at}"
        );
    }
    // A window layer that already gave back pages the fork would need.
    if let Some(window) = model
        .config
        .sliding_window
        .as_ref()
        .map(|s| s.window)
        .filter(|&w| w < 600)
    {
        let at = 100u64;
        assert!((700 - window) as u64 > at + 16);
        match fork(&rt, first, at) {
            Err(RuntimeError::InvalidArgument(why)) => {
                assert!(why.contains("sliding-window"), "{why}")
            }
            other => panic!("fork at {at} past the window: {other:?}"),
        }
    }
}

#[test]
fn the_reference_model_shares_prefixes_and_forks_with_the_bits_of_a_cold_prefill() {
    if let Some(model) = load("models/SmolLM2-135M-Instruct.Q4_1.gguf") {
        check(&model);
    }
}

#[test]
fn gemma_with_sliding_windows_shares_prefixes_and_forks_with_the_bits_of_a_cold_prefill() {
    if let Some(model) = load("models/gemma-3-270m-q4_k_m.gguf") {
        check(&model);
    }
}

/// A runtime whose sessions live in `dir` (journals and the page file).
fn durable_runtime(model: &Arc<Model>, dir: &Path) -> Runtime {
    let store = SessionStore::open(dir, [5; 32], Durability::None).expect("state dir");
    Runtime::start(
        Arc::clone(model),
        RuntimeConfig {
            workers: 2,
            pin_cores: false,
            kv_bytes: 256 << 20,
            state: Some(Arc::new(store)),
            ..RuntimeConfig::default()
        },
    )
    .expect("runtime starts")
}

/// A 1,000-token session (longer than Gemma's 512-position window) comes
/// back after a restart with every page below its last token's page taken
/// back from the page file, and the bits of a cold prefill, before and
/// after it grows.
fn check_restore(model: &Arc<Model>) {
    let vocab = model.config.vocab;
    let mut history = tokens(1000, 3, vocab);
    let dir = tempfile::tempdir().expect("temp dir");
    let id = {
        let rt = durable_runtime(model, dir.path());
        session(&rt, &history)
    };
    let rt = durable_runtime(model, dir.path());
    let t0 = std::time::Instant::now();
    while rt
        .session_info(&Tenant::NONE, id, None)
        .expect("queued")
        .wait()
        .expect("info")
        .busy
    {
        assert!(t0.elapsed().as_secs() < 300, "still restoring");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(rt.stats().restore_kept_tokens, 992, "62 full pages kept");
    assert_eq!(rt.stats().restore_pages_rejected, 0);
    assert_eq!(digest(&rt, id), cold(model, &history));
    assert_eq!(rt.stats().restore_digest_mismatches, 0);
    let more = tokens(40, 4, vocab);
    rt.append_tokens(
        &Tenant::NONE,
        AppendTokens {
            id,
            tokens: more.clone(),
        },
        None,
    )
    .expect("queued")
    .wait()
    .expect("appended");
    history.extend(more);
    assert_eq!(digest(&rt, id), cold(model, &history));
}

#[test]
fn the_reference_model_restores_from_kept_pages_with_the_bits_of_a_cold_prefill() {
    if let Some(model) = load("models/SmolLM2-135M-Instruct.Q4_1.gguf") {
        check_restore(&model);
    }
}

#[test]
fn gemma_restores_window_layers_from_kept_pages_with_the_bits_of_a_cold_prefill() {
    if let Some(model) = load("models/gemma-3-270m-q4_k_m.gguf") {
        check_restore(&model);
    }
}
