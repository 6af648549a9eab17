//! A shard's work is bounded, whatever a peer sends: a real `inferd shard`
//! on loopback, driven through a `ShardLink` by frames a hostile
//! coordinator would send.
//!
//! - A frame of more rows than the shard allows (the 20,000-row prefill of
//!   the hardening report), or one whose positions run past the model's
//!   context, is refused TOO_LARGE at once, before any compute.
//! - A long prefill fragment whose deadline passes midway is stopped
//!   between two steps (DEADLINE), and leaves nothing of itself in the
//!   shard's KV: the session starts afresh at position 0.
//! - A stream cancelled mid-prefill stops the computation: another stream
//!   is answered at once, not after the abandoned fragment.
//! - SIGTERM stops a shard mid-prefill within seconds, exit 0.
//!
//! Everything runs in one test, in sequence: the timings must not compete
//! with each other for the CPU.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use inferd::cluster::fingerprint::{sha256_of_file, Fingerprint};
use inferd::cluster::frame::unix_nanos;
use inferd::cluster::link::{LinkOptions, ShardLink};
use inferd::cluster::payload::encode_rows;
use inferd::cluster::{Encoding, ErrorKind, WireSessionId};
use inferd::model::Model;
use inferd::proto::inferd_shard_v1::shard_runtime as pb;
use protobuf::Message;
use support::Inferd;

const REFERENCE: &str = support::REFERENCE;
/// The whole model on one shard, one thread: a 2048-row fragment takes
/// many seconds, one step of 64 rows a fraction of one.
const LAYERS: (usize, usize) = (0, 30);
/// Rows of the long fragments (the shard's default bound).
const LONG: usize = 2048;
/// How soon a shard must react where it stops between steps.
const PROMPT: Duration = Duration::from_secs(5);

fn start_shard() -> Inferd {
    Inferd::start(&[
        "shard",
        "--model",
        REFERENCE,
        "--layers",
        "0..30",
        "--listen",
        "127.0.0.1:0",
        "--kv-mib",
        "128",
        "--threads",
        "1",
    ])
}

fn connect(model: &Model, shard: &Inferd, epoch: u64, encoding: Encoding) -> ShardLink {
    let hash = sha256_of_file(Path::new(REFERENCE)).expect("hash");
    let fingerprint = Fingerprint::of_layers(hash, &model.config, LAYERS.0..LAYERS.1);
    let options = LinkOptions {
        encoding,
        ..LinkOptions::default()
    };
    ShardLink::connect(&shard.addr, &fingerprint, epoch, &options).expect("handshake")
}

/// A prefill fragment of `rows` rows of `session` from `position`.
fn prefill(
    session: WireSessionId,
    position: u64,
    rows: usize,
    hidden: usize,
    encoding: Encoding,
) -> pb::Frame {
    let mut run = pb::Rows::new();
    run.set_session_id(session.to_vec());
    run.set_position(position);
    run.set_count(rows as u32);
    let mut body = pb::Hidden::new();
    body.set_runs(vec![run].into());
    let mut frame = pb::Frame::new();
    frame.set_prefill(body);
    let values: Vec<f32> = (0..rows * hidden)
        .map(|i| ((i % 97) as f32 - 48.0) / 64.0)
        .collect();
    frame.set_payload(encode_rows(encoding, hidden, &values).expect("rows"));
    frame
}

/// Seals and sends `frame`; its sequence number.
fn send(link: &mut ShardLink, frame: pb::Frame, encoding: Encoding, deadline: u64) -> u64 {
    let sealed = link.seal(frame, Some(encoding), deadline).expect("seal");
    let sequence = pb::Frame::parse_from_bytes(&sealed)
        .expect("a sealed frame parses")
        .get_header()
        .get_sequence();
    link.send_raw(sealed).expect("send");
    sequence
}

/// The reply to frame `sequence` (an output or an error), skipping credits.
fn reply_to(link: &mut ShardLink, sequence: u64) -> pb::Frame {
    loop {
        let checked = link.next_frame().expect("a reply");
        let f = checked.frame;
        if f.has_error() && f.get_error().get_refused_sequence() == sequence {
            return f;
        }
        if f.has_output() && f.get_output().get_answers_sequence() == sequence {
            return f;
        }
    }
}

fn kind(frame: &pb::Frame) -> Option<ErrorKind> {
    frame
        .has_error()
        .then(|| ErrorKind::from_wire(frame.get_error().get_kind()))
        .flatten()
}

#[test]
fn a_shard_bounds_its_work() {
    if !support::have_reference() {
        return;
    }
    let model = Arc::new(Model::load(REFERENCE).expect("model"));
    let hidden = model.config.hidden;
    let shard = start_shard();

    // 1. The report's 20,000-row prefill (f16, 23 MB, under the byte
    // limit): refused TOO_LARGE before any compute.
    let mut link = connect(&model, &shard, 0xa11ce, Encoding::F16);
    let huge: WireSessionId = [1; 16];
    let t0 = Instant::now();
    let seq = send(
        &mut link,
        prefill(huge, 0, 20_000, hidden, Encoding::F16),
        Encoding::F16,
        0,
    );
    let reply = reply_to(&mut link, seq);
    assert_eq!(kind(&reply), Some(ErrorKind::TooLarge), "{reply:?}");
    assert!(t0.elapsed() < PROMPT, "the refusal took {:?}", t0.elapsed());
    // Positions past the model's context: TOO_LARGE too (not computed,
    // not even looked up as a session).
    let context = model.config.context as u64;
    let seq = send(
        &mut link,
        prefill(huge, context - 2, 4, hidden, Encoding::F16),
        Encoding::F16,
        0,
    );
    let reply = reply_to(&mut link, seq);
    assert_eq!(kind(&reply), Some(ErrorKind::TooLarge), "{reply:?}");
    drop(link);

    // 2. A long fragment whose deadline passes midway: DEADLINE soon after
    // it, and nothing of the fragment stays in the shard's KV.
    let mut link = connect(&model, &shard, 0xa11ce, Encoding::F32);
    let late: WireSessionId = [2; 16];
    let deadline = SystemTime::now() + Duration::from_millis(700);
    let t0 = Instant::now();
    let seq = send(
        &mut link,
        prefill(late, 0, LONG, hidden, Encoding::F32),
        Encoding::F32,
        unix_nanos(deadline),
    );
    let reply = reply_to(&mut link, seq);
    assert_eq!(kind(&reply), Some(ErrorKind::Deadline), "{reply:?}");
    assert!(
        t0.elapsed() < Duration::from_millis(700) + PROMPT,
        "the deadline was noticed only after {:?}",
        t0.elapsed()
    );
    // Had it left its rows, position 0 would no longer continue the session.
    let seq = send(
        &mut link,
        prefill(late, 0, 3, hidden, Encoding::F32),
        Encoding::F32,
        0,
    );
    let reply = reply_to(&mut link, seq);
    assert!(reply.has_output(), "the session starts afresh: {reply:?}");

    // 3. A stream cancelled mid-prefill: the shard stops computing for it,
    // so another stream's frame is answered at once.
    let abandoned: WireSessionId = [3; 16];
    send(
        &mut link,
        prefill(abandoned, 0, LONG, hidden, Encoding::F32),
        Encoding::F32,
        0,
    );
    std::thread::sleep(Duration::from_millis(500));
    drop(link);
    let mut other = connect(&model, &shard, 0xa11ce, Encoding::F32);
    let t0 = Instant::now();
    let seq = send(
        &mut other,
        prefill([4; 16], 0, 1, hidden, Encoding::F32),
        Encoding::F32,
        0,
    );
    let reply = reply_to(&mut other, seq);
    assert!(reply.has_output(), "{reply:?}");
    assert!(
        t0.elapsed() < PROMPT,
        "the abandoned fragment held the shard for {:?}",
        t0.elapsed()
    );
    // ... and left nothing behind.
    let seq = send(
        &mut other,
        prefill(abandoned, 0, 1, hidden, Encoding::F32),
        Encoding::F32,
        0,
    );
    let reply = reply_to(&mut other, seq);
    assert!(
        reply.has_output(),
        "the abandoned session is gone: {reply:?}"
    );
    drop(other);
    drop(shard);

    // 4. SIGTERM mid-prefill: the shard exits within seconds, status 0.
    let mut shard = start_shard();
    let mut link = connect(&model, &shard, 0xbee, Encoding::F32);
    send(
        &mut link,
        prefill([5; 16], 0, LONG, hidden, Encoding::F32),
        Encoding::F32,
        0,
    );
    std::thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    shard.signal("TERM");
    let code = shard
        .wait_exit(PROMPT)
        .unwrap_or_else(|_| panic!("the shard still runs {PROMPT:?} after SIGTERM"));
    assert_eq!(code, Some(0), "after {:?}", t0.elapsed());
}
