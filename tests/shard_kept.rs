//! A shard with a state directory (`inferd shard --state-dir`), driven
//! through a real `ShardLink` over loopback: what a Resume keeps (the
//! pages whose chains match, cut back to the first that differs), that a
//! session cut back and fed again, or taken back after a restart, answers
//! the same bits as before, that a coordinator's restart leaves its
//! sessions detached for its successor to resume, and that every bad
//! Resume and every run with the wrong number of page chains is refused
//! with its kind while the stream goes on.

mod support;

use std::path::Path;
use std::sync::Arc;

use inferd::cluster::fingerprint::{sha256_of_file, Fingerprint};
use inferd::cluster::frame::Run;
use inferd::cluster::link::{LinkError, LinkOptions, ShardLink};
use inferd::cluster::shard::{ShardConfig, ShardServer};
use inferd::cluster::{Encoding, ErrorKind, WireSessionId};
use inferd::durable::page_chain as chain;
use inferd::model::Model;

const LAYERS: (usize, usize) = (0, 4);
const PAGE: usize = 16;

fn start(model: &Arc<Model>, listen: &str, state: Option<&Path>) -> ShardServer {
    let hash = sha256_of_file(Path::new(support::REFERENCE)).expect("hash");
    let fingerprint = Fingerprint::of_layers(hash, &model.config, LAYERS.0..LAYERS.1);
    let mut cfg = ShardConfig::new(LAYERS.0..LAYERS.1, listen);
    cfg.kv_bytes = 8 << 20;
    cfg.threads = 1;
    cfg.state_dir = state.map(Path::to_owned);
    ShardServer::start(Arc::clone(model), fingerprint, &cfg).expect("shard starts")
}

fn connect(model: &Model, shard: &ShardServer, epoch: u64, encoding: Encoding) -> ShardLink {
    let hash = sha256_of_file(Path::new(support::REFERENCE)).expect("hash");
    let fingerprint = Fingerprint::of_layers(hash, &model.config, LAYERS.0..LAYERS.1);
    let options = LinkOptions {
        encoding,
        ..LinkOptions::default()
    };
    ShardLink::connect(&shard.addr().to_string(), &fingerprint, epoch, &options).expect("handshake")
}

fn run(session: WireSessionId, position: usize, rows: usize) -> Run {
    Run {
        session,
        position: position as u64,
        rows: rows as u32,
    }
}

/// The shard's output for `tokens[from..to]` of a session at `from`, with
/// the chains of the pages those positions fill.
fn feed(
    link: &mut ShardLink,
    model: &Model,
    session: WireSessionId,
    tokens: &[u32],
    from: usize,
    to: usize,
) -> Result<Vec<u32>, LinkError> {
    let hidden = model.config.hidden;
    let mut x = vec![0f32; (to - from) * hidden];
    model.embed(&tokens[from..to], &mut x).expect("embed");
    let chains = chain(tokens, PAGE, to / PAGE)[from / PAGE..].to_vec();
    link.forward_chained(&[run(session, from, to - from)], &[chains], &mut x, 0)?;
    Ok(x.iter().map(|v| v.to_bits()).collect())
}

fn refused_kind(result: Result<u64, LinkError>) -> Option<ErrorKind> {
    match result {
        Err(LinkError::Refused { error, .. }) => Some(error.kind),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_shard_keeps_what_matches_takes_it_back_after_a_restart_and_refuses_bad_resumes() {
    if !support::have_reference() {
        return;
    }
    let model = Arc::new(Model::load(support::REFERENCE).expect("model"));
    let hidden = model.config.hidden;
    let state = tempfile::tempdir().expect("temp dir");
    let tokens: Vec<u32> = (0..40u32).map(|i| 300 + i * 97).collect();
    let chains = chain(&tokens, PAGE, 2);
    let session = [7u8; 16];

    let shard = start(&model, "127.0.0.1:0", Some(state.path()));
    let mut link = connect(&model, &shard, 11, Encoding::F32);
    assert!(link.capacity().keeps_pages);
    let whole = feed(&mut link, &model, session, &tokens, 0, 40).expect("prefill");
    let tail = |from: usize| whole[from * hidden..].to_vec();

    // A run that names the wrong number of page chains is refused whole.
    let mut x = vec![0f32; 40 * hidden];
    model.embed(&tokens, &mut x).expect("embed");
    let other = [8u8; 16];
    let wrong = link.forward_chained(&[run(other, 0, 40)], &[vec![chains[0]]], &mut x, 0);
    assert!(
        matches!(&wrong, Err(LinkError::Refused { error, .. }) if error.kind == ErrorKind::Malformed),
        "{wrong:?}"
    );
    // So are Resumes that contradict themselves or run past the context,
    // and the stream goes on.
    assert_eq!(
        refused_kind(link.resume(session, 40, &chains[..1], 0)),
        Some(ErrorKind::Malformed)
    );
    assert_eq!(
        refused_kind(link.resume(session, 1 << 40, &[], 0)),
        Some(ErrorKind::TooLarge)
    );
    // A session the shard never saw keeps nothing.
    assert_eq!(link.resume(other, 40, &chains, 0).expect("resume"), 0);

    // The second page's chain differs: only the first page is kept, and
    // the positions fed again after it are the same bits as before.
    let differs = [chains[0], chains[1] ^ 1];
    assert_eq!(link.resume(session, 40, &differs, 0).expect("resume"), 16);
    let again = feed(&mut link, &model, session, &tokens, 16, 40).expect("feed");
    assert_eq!(again, tail(16), "cut back and fed again: the same bits");
    assert_eq!(link.resume(session, 40, &chains, 0).expect("resume"), 32);

    // A restarted shard takes its pages back from the state directory:
    // detached until a coordinator resumes them.
    let listen = shard.addr().to_string();
    drop(link);
    shard.shutdown();
    let shard = start(&model, &listen, Some(state.path()));
    assert_eq!(shard.detached(), (1, 32));
    let link = connect(&model, &shard, 11, Encoding::F32);
    // Pages computed from hidden states in another encoding do not count.
    let mut f16 = connect(&model, &shard, 12, Encoding::F16);
    assert_eq!(f16.resume(session, 40, &chains, 0).expect("resume"), 0);
    assert_eq!(shard.detached(), (0, 0), "the mismatched session was freed");
    drop(f16);
    drop(link);
    shard.shutdown();

    // Once more, from the log as the last start rewrote it.
    let shard = start(&model, &listen, Some(state.path()));
    assert_eq!(shard.detached(), (0, 0), "nothing freed comes back");
    let mut link = connect(&model, &shard, 13, Encoding::F32);
    feed(&mut link, &model, session, &tokens, 0, 40).expect("prefill");
    drop(link);
    shard.shutdown();
    let shard = start(&model, &listen, Some(state.path()));
    assert_eq!(shard.detached(), (1, 32));
    let mut link = connect(&model, &shard, 14, Encoding::F32);
    assert_eq!(link.resume(session, 40, &chains, 0).expect("resume"), 32);
    let rest = feed(&mut link, &model, session, &tokens, 32, 40).expect("feed");
    assert_eq!(rest, tail(32), "taken back after a restart: the same bits");

    // A coordinator that restarts (a new epoch) leaves its sessions
    // detached, whole pages only, for its successor to resume.
    let mut successor = connect(&model, &shard, 15, Encoding::F32);
    assert_eq!(shard.sessions(), 0);
    assert_eq!(shard.detached(), (1, 32));
    assert_eq!(
        successor.resume(session, 40, &chains, 0).expect("resume"),
        32
    );
    assert_eq!(shard.sessions(), 1);
    drop(link);
    drop(successor);
    shard.shutdown();

    // A shard without a state directory keeps nothing and says so.
    let plain = start(&model, "127.0.0.1:0", None);
    let mut link = connect(&model, &plain, 16, Encoding::F32);
    assert!(!link.capacity().keeps_pages);
    assert_eq!(
        refused_kind(link.resume(session, 40, &chains, 0)),
        Some(ErrorKind::Malformed)
    );
    feed(&mut link, &model, session, &tokens, 0, 40).expect("prefill without chains");
    drop(link);
    plain.shutdown();
}
