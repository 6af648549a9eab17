//! What the tests of sessions kept in a state directory share: a small
//! synthetic model with a long context, `inferd serve --state-dir`
//! processes, a reference server that never crashes (for cold recomputes),
//! and readers of the journal files.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use inferd::gguf::synthetic::SyntheticLlama;
use inferd::quant::GgmlType;
use inferd::runtime::RuntimeConfig;
use inferd::server::{ServeConfig, Server};

use super::{Client, Inferd};

/// A small model with a long context, written where the server can load it.
pub fn model_spec() -> SyntheticLlama {
    SyntheticLlama {
        weight_type: GgmlType::Q4_1,
        tied_output: true,
        context: 4096,
        ..SyntheticLlama::tiny()
    }
}

pub fn write_model(dir: &Path) -> PathBuf {
    let path = dir.join("model.gguf");
    std::fs::write(&path, model_spec().build()).expect("write the model");
    path
}

/// A server that never crashes, for cold recomputes.
pub fn reference_server() -> (Server, Client) {
    let file = inferd::gguf::GgufFile::from_bytes(model_spec().build()).expect("parses");
    let model = inferd::model::Model::from_gguf(Arc::new(file)).expect("loads");
    let cfg = ServeConfig::new(
        "127.0.0.1:0",
        RuntimeConfig {
            workers: 1,
            pin_cores: false,
            kv_bytes: 64 << 20,
            ..RuntimeConfig::default()
        },
    );
    let server = Server::start(Arc::new(model), cfg).expect("reference server");
    let client = Client::connect(&server.addr().to_string());
    (server, client)
}

/// The digest of `history` computed from scratch.
pub fn cold_digest(reference: &Client, history: &[u32]) -> u64 {
    let id = reference.create();
    if !history.is_empty() {
        reference.append(&id, history).expect("reference append");
    }
    let digest = reference.info(&id).expect("info").get_logits_digest();
    reference.close(&id).expect("close");
    digest
}

/// The greedy continuation of `history`, `n` tokens, computed from scratch.
pub fn cold_greedy(reference: &Client, history: &[u32], n: u32) -> Vec<u32> {
    let id = reference.create();
    reference.append(&id, history).expect("reference append");
    let got = reference.generate(&super::greedy(&id, n, 0));
    reference.close(&id).expect("close");
    assert!(got.error.is_none(), "{got:?}");
    got.tokens
}

pub fn serve(model: &Path, state: &Path, durability: &str) -> Inferd {
    serve_with(model, state, durability, &[])
}

pub fn serve_with(model: &Path, state: &Path, durability: &str, extra: &[&str]) -> Inferd {
    serve_env(model, state, durability, extra, &[])
}

/// As [`serve_with`], with these environment variables set.
pub fn serve_env(
    model: &Path,
    state: &Path,
    durability: &str,
    extra: &[&str],
    envs: &[(String, String)],
) -> Inferd {
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "2",
        "--model",
        model.to_str().expect("UTF-8 path"),
        "--state-dir",
        state.to_str().expect("UTF-8 path"),
        "--durability",
        durability,
    ];
    args.extend_from_slice(extra);
    Inferd::start_full(&[], &args, envs)
}

/// The session's info once its history is fed again after a start.
pub fn restored(
    server: &Client,
    id: &str,
) -> inferd::proto::kakeya_v1::runtime::GetSessionInfoResponse {
    let t0 = std::time::Instant::now();
    loop {
        let info = server
            .info(id)
            .unwrap_or_else(|e| panic!("session {id} lost after a restart: {e:?}"));
        if !info.get_busy() {
            return info;
        }
        assert!(t0.elapsed() < super::CALL_TIMEOUT, "{id} still restoring");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The records of a journal's bytes: start, end and kind of each.
pub fn records(bytes: &[u8]) -> Vec<(usize, usize, u8)> {
    let mut at = inferd::durable::replay_journal(bytes)
        .expect("a journal")
        .header_len;
    let mut found = Vec::new();
    while at < bytes.len() {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        found.push((at, at + 13 + len, bytes[at + 12]));
        at += 13 + len;
    }
    found
}

pub fn journals(state: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(state.join("sessions"))
        .expect("sessions dir")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files
}
