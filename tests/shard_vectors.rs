//! Captured shard-protocol vectors (CONTRACT §4): serialized frames of every
//! kind, and bad ones (corrupted checksum, repeat and gap sequence numbers,
//! stale epoch, over the size limit, malformed, wrong direction, expired
//! deadline, no credit, an encoding not agreed, a Resume with more page
//! chains than positions or for an encoding not agreed), kept as golden
//! files under
//! `tests/vectors/shard/` with `manifest.json` naming each case's receiver
//! and expected outcome.
//!
//! The frames are built deterministically (fixed epochs, clock, ids and
//! values), so encoding must reproduce the files byte for byte, and every
//! bad frame must be refused with its kind. Regenerate after a deliberate
//! schema change with `INFERD_REGEN=1 cargo test --test shard_vectors`.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inferd::cluster::payload::encode_rows;
use inferd::cluster::{
    Direction, Encoding, Epochs, ErrorKind, FrameError, Inbound, OutboundFrames, WireSessionId,
};
use inferd::proto::inferd_shard_v1::shard_runtime as pb;
use protobuf::Message;
use serde_json::{json, Value};

const HIDDEN: usize = 64;
const EPOCHS: Epochs = Epochs {
    shard: 0x5a5a_0001_0000_0001,
    coordinator: 0xc0c0_0002_0000_0002,
};
/// 2100-01-01T00:00:00Z: a deadline that never passes in these tests.
const FAR_DEADLINE: u64 = 4_102_444_800_000_000_000;
/// 2001-09-09T01:46:40Z: a deadline long past.
const PAST_DEADLINE: u64 = 1_000_000_000_000_000_000;
const MAX_FRAME_BYTES: usize = 16 << 10;
const SESSION_A: WireSessionId = [0xa1; 16];
const SESSION_B: WireSessionId = [0xb2; 16];

/// The receiving clock of every case: 2030-01-01T00:00:00Z.
fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_893_456_000)
}

fn values(rows: usize, salt: u32) -> Vec<f32> {
    (0..(rows * HIDDEN) as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ salt) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

fn run(session: WireSessionId, position: u64, count: u32) -> pb::Rows {
    let mut r = pb::Rows::new();
    r.set_session_id(session.to_vec());
    r.set_position(position);
    r.set_count(count);
    r
}

fn hidden(runs: Vec<pb::Rows>, answers: u64) -> pb::Hidden {
    let mut h = pb::Hidden::new();
    h.set_runs(runs.into());
    h.set_answers_sequence(answers);
    h
}

/// A prefill fragment of `rows` rows of session A from position 0.
fn prefill(rows: u32, encoding: Encoding) -> (pb::Frame, Encoding) {
    let mut f = pb::Frame::new();
    f.set_prefill(hidden(vec![run(SESSION_A, 0, rows)], 0));
    f.set_payload(encode_rows(encoding, HIDDEN, &values(rows as usize, 1)).expect("encodes"));
    (f, encoding)
}

fn decode(encoding: Encoding) -> (pb::Frame, Encoding) {
    let mut f = pb::Frame::new();
    f.set_decode(hidden(vec![run(SESSION_A, 3, 1), run(SESSION_B, 7, 1)], 0));
    f.set_payload(encode_rows(encoding, HIDDEN, &values(2, 2)).expect("encodes"));
    (f, encoding)
}

fn release() -> pb::Frame {
    let mut body = pb::Release::new();
    body.set_session_ids(vec![SESSION_B.to_vec()].into());
    let mut f = pb::Frame::new();
    f.set_release(body);
    f
}

fn cancel() -> pb::Frame {
    let mut body = pb::Cancel::new();
    body.set_session_ids(vec![SESSION_A.to_vec()].into());
    let mut f = pb::Frame::new();
    f.set_cancel(body);
    f
}

fn output() -> (pb::Frame, Encoding) {
    let mut f = pb::Frame::new();
    f.set_output(hidden(vec![run(SESSION_A, 0, 3)], 1));
    f.set_payload(encode_rows(Encoding::F32, HIDDEN, &values(3, 3)).expect("encodes"));
    (f, Encoding::F32)
}

/// A Resume of session A's first `length` positions, with `chains` page
/// chains.
fn resume(length: u64, chains: u64, encoding: Encoding) -> pb::Frame {
    let mut body = pb::Resume::new();
    body.set_session_id(SESSION_A.to_vec());
    body.set_length(length);
    body.set_page_chains((0..chains).map(|i| 0x1234_5678_9abc_0000 | i).collect());
    body.set_encoding(encoding.to_wire());
    let mut f = pb::Frame::new();
    f.set_resume(body);
    f
}

fn resumed() -> pb::Frame {
    let mut body = pb::Resumed::new();
    body.set_session_id(SESSION_A.to_vec());
    body.set_kept(32);
    body.set_answers_sequence(6);
    let mut f = pb::Frame::new();
    f.set_resumed(body);
    f
}

fn credit(frames: u32) -> pb::Frame {
    let mut body = pb::Credit::new();
    body.set_frames(frames);
    let mut f = pb::Frame::new();
    f.set_credit(body);
    f
}

fn error_frame() -> pb::Frame {
    let mut f = pb::Frame::new();
    f.set_error(
        FrameError {
            kind: ErrorKind::Deadline,
            message: "deadline passed 5 µs before the frame was read".into(),
            sessions: vec![SESSION_A],
            sequence: Some(2),
        }
        .to_wire(),
    );
    f
}

/// Seals frames in order on one outbound stream with the given epochs.
fn seal_all(epochs: Epochs, frames: Vec<(pb::Frame, Option<Encoding>, u64)>) -> Vec<Vec<u8>> {
    let mut out = OutboundFrames::new(epochs);
    frames
        .into_iter()
        .map(|(f, e, d)| out.seal(f, e, d).expect("serializes"))
        .collect()
}

fn hidden_frame(
    (f, e): (pb::Frame, Encoding),
    deadline: u64,
) -> (pb::Frame, Option<Encoding>, u64) {
    (f, Some(e), deadline)
}

fn plain(f: pb::Frame) -> (pb::Frame, Option<Encoding>, u64) {
    (f, None, FAR_DEADLINE)
}

/// One case: frames fed in order to a fresh receiver, each with its
/// expected outcome ("ok" or an error kind's name).
struct Case {
    name: &'static str,
    direction: Direction,
    credits: u32,
    encodings: Vec<Encoding>,
    frames: Vec<(String, Vec<u8>, &'static str)>,
}

fn all_encodings() -> Vec<Encoding> {
    vec![Encoding::F32, Encoding::F16, Encoding::Q8_0]
}

fn cases() -> Vec<Case> {
    let to_shard = seal_all(
        EPOCHS,
        vec![
            hidden_frame(prefill(3, Encoding::F32), FAR_DEADLINE),
            hidden_frame(decode(Encoding::F16), FAR_DEADLINE),
            hidden_frame(decode(Encoding::Q8_0), FAR_DEADLINE),
            plain(release()),
            plain(cancel()),
            plain(resume(40, 2, Encoding::F32)),
        ],
    );
    let to_coordinator = seal_all(
        EPOCHS,
        vec![
            hidden_frame(output(), FAR_DEADLINE),
            plain(credit(4)),
            plain(error_frame()),
            plain(resumed()),
        ],
    );
    let named = |prefix: &str, frames: &[Vec<u8>], outcomes: &[&'static str]| {
        frames
            .iter()
            .zip(outcomes)
            .enumerate()
            .map(|(i, (bytes, outcome))| (format!("{prefix}_{}", i + 1), bytes.clone(), *outcome))
            .collect::<Vec<_>>()
    };
    // A corrupted payload byte under an intact header.
    let mut corrupted = pb::Frame::parse_from_bytes(&to_shard[0]).expect("parses");
    let mut payload = corrupted.get_payload().to_vec();
    payload[5] ^= 0x40;
    corrupted.set_payload(payload);
    let corrupted = corrupted.write_to_bytes().expect("serializes");
    // A payload one row short of what the run says.
    let mut short = prefill(3, Encoding::F32).0;
    let mut payload = short.get_payload().to_vec();
    payload.truncate(2 * HIDDEN * 4);
    short.set_payload(payload);
    let short = seal_all(EPOCHS, vec![(short, Some(Encoding::F32), FAR_DEADLINE)]);
    let stale = seal_all(
        Epochs {
            shard: EPOCHS.shard - 1,
            ..EPOCHS
        },
        vec![hidden_frame(prefill(3, Encoding::F32), FAR_DEADLINE)],
    );
    let huge = seal_all(
        EPOCHS,
        vec![hidden_frame(prefill(80, Encoding::F32), FAR_DEADLINE)],
    );
    let expired = seal_all(
        EPOCHS,
        vec![hidden_frame(prefill(3, Encoding::F32), PAST_DEADLINE)],
    );
    let bad_resumes = seal_all(
        EPOCHS,
        vec![
            plain(resume(2, 3, Encoding::F32)),
            plain(resume(40, 2, Encoding::F16)),
        ],
    );
    let mut truncated = to_shard[0].clone();
    truncated.truncate(truncated.len() - 7);
    vec![
        Case {
            name: "to_shard",
            direction: Direction::ToShard,
            credits: 8,
            encodings: all_encodings(),
            frames: named("to_shard", &to_shard, &["ok", "ok", "ok", "ok", "ok", "ok"]),
        },
        Case {
            name: "to_coordinator",
            direction: Direction::ToCoordinator,
            credits: 0,
            encodings: all_encodings(),
            frames: named("to_coordinator", &to_coordinator, &["ok", "ok", "ok", "ok"]),
        },
        Case {
            name: "corrupted_checksum",
            direction: Direction::ToShard,
            credits: 8,
            encodings: all_encodings(),
            frames: vec![("corrupted_checksum".into(), corrupted, "checksum")],
        },
        Case {
            name: "duplicate_sequence",
            direction: Direction::ToShard,
            credits: 8,
            encodings: all_encodings(),
            frames: vec![
                ("to_shard_1".into(), to_shard[0].clone(), "ok"),
                ("to_shard_1".into(), to_shard[0].clone(), "sequence"),
                ("to_shard_2".into(), to_shard[1].clone(), "ok"),
            ],
        },
        Case {
            name: "out_of_order",
            direction: Direction::ToShard,
            credits: 8,
            encodings: all_encodings(),
            frames: vec![
                ("to_shard_2".into(), to_shard[1].clone(), "sequence"),
                ("to_shard_1".into(), to_shard[0].clone(), "ok"),
                ("to_shard_3".into(), to_shard[2].clone(), "sequence"),
            ],
        },
        Case {
            name: "stale_epoch",
            direction: Direction::ToShard,
            credits: 8,
            encodings: all_encodings(),
            frames: vec![("stale_epoch".into(), stale[0].clone(), "stale_epoch")],
        },
        Case {
            name: "too_large",
            direction: Direction::ToShard,
            credits: 8,
            encodings: all_encodings(),
            frames: vec![("too_large".into(), huge[0].clone(), "too_large")],
        },
        Case {
            name: "malformed",
            direction: Direction::ToShard,
            credits: 8,
            encodings: all_encodings(),
            frames: vec![
                ("truncated".into(), truncated, "malformed"),
                ("garbage".into(), vec![0xff; 40], "malformed"),
                ("short_payload".into(), short[0].clone(), "malformed"),
            ],
        },
        Case {
            name: "malformed_resume",
            direction: Direction::ToShard,
            credits: 8,
            encodings: vec![Encoding::F32],
            frames: vec![
                (
                    "resume_more_chains".into(),
                    bad_resumes[0].clone(),
                    "malformed",
                ),
                (
                    "resume_encoding".into(),
                    bad_resumes[1].clone(),
                    "malformed",
                ),
            ],
        },
        Case {
            name: "wrong_direction",
            direction: Direction::ToShard,
            credits: 8,
            encodings: all_encodings(),
            frames: vec![(
                "to_coordinator_1".into(),
                to_coordinator[0].clone(),
                "malformed",
            )],
        },
        Case {
            name: "expired_deadline",
            direction: Direction::ToShard,
            credits: 8,
            encodings: all_encodings(),
            frames: vec![("expired_deadline".into(), expired[0].clone(), "deadline")],
        },
        Case {
            name: "no_credit",
            direction: Direction::ToShard,
            credits: 1,
            encodings: all_encodings(),
            frames: vec![
                ("to_shard_1".into(), to_shard[0].clone(), "ok"),
                ("to_shard_2".into(), to_shard[1].clone(), "flow_control"),
            ],
        },
        Case {
            name: "encoding_not_agreed",
            direction: Direction::ToShard,
            credits: 8,
            encodings: vec![Encoding::F32],
            frames: vec![
                ("to_shard_1".into(), to_shard[0].clone(), "ok"),
                ("to_shard_2".into(), to_shard[1].clone(), "malformed"),
            ],
        },
    ]
}

fn receiver(case: &Case) -> Inbound {
    match case.direction {
        Direction::ToShard => Inbound::to_shard(
            EPOCHS,
            MAX_FRAME_BYTES,
            HIDDEN,
            case.encodings.clone(),
            case.credits,
        ),
        Direction::ToCoordinator => {
            Inbound::to_coordinator(EPOCHS, MAX_FRAME_BYTES, HIDDEN, case.encodings.clone())
        }
    }
}

fn outcome(result: &Result<inferd::cluster::FrameCheck, FrameError>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(e) => e.kind.name(),
    }
}

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/shard")
}

fn manifest(cases: &[Case]) -> Value {
    let cases: Vec<Value> = cases
        .iter()
        .map(|c| {
            json!({
                "name": c.name,
                "direction": format!("{:?}", c.direction),
                "credits": c.credits,
                "encodings": c.encodings.iter().map(|e| format!("{e:?}")).collect::<Vec<_>>(),
                "frames": c.frames.iter().map(|(file, _, expect)| json!({
                    "file": format!("{file}.bin"),
                    "expect": expect,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "hidden_size": HIDDEN,
        "shard_epoch": EPOCHS.shard,
        "coordinator_epoch": EPOCHS.coordinator,
        "max_frame_bytes": MAX_FRAME_BYTES,
        "now_unix_nanos": 1_893_456_000_000_000_000u64,
        "cases": cases,
    })
}

fn regenerating() -> bool {
    std::env::var("INFERD_REGEN").is_ok_and(|v| v == "1")
}

/// Writes the golden files once per test process when regenerating, before
/// any test reads them.
fn regenerate_once() {
    static DONE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        if !regenerating() {
            return;
        }
        let cases = cases();
        std::fs::create_dir_all(dir()).expect("vector folder");
        for case in &cases {
            for (file, bytes, _) in &case.frames {
                std::fs::write(dir().join(format!("{file}.bin")), bytes).expect("write vector");
            }
        }
        let text = serde_json::to_string_pretty(&manifest(&cases)).expect("json") + "\n";
        std::fs::write(dir().join("manifest.json"), text).expect("write manifest");
    });
}

#[test]
fn encoding_reproduces_the_golden_frames_byte_for_byte() {
    regenerate_once();
    let cases = cases();
    let mut seen = std::collections::BTreeMap::new();
    for case in &cases {
        for (file, bytes, _) in &case.frames {
            if let Some(previous) = seen.insert(file.clone(), bytes.clone()) {
                assert_eq!(&previous, bytes, "{file} built two ways");
            }
        }
    }
    for (file, bytes) in &seen {
        let path = dir().join(format!("{file}.bin"));
        let golden = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (INFERD_REGEN=1 makes it)", path.display()));
        assert_eq!(&golden, bytes, "{file} differs from its golden file");
    }
    let manifest_text = serde_json::to_string_pretty(&manifest(&cases)).expect("json") + "\n";
    let path = dir().join("manifest.json");
    assert_eq!(
        std::fs::read_to_string(&path).expect("manifest.json"),
        manifest_text
    );
}

#[test]
fn every_golden_frame_gets_its_expected_outcome() {
    regenerate_once();
    for case in cases() {
        let mut inbound = receiver(&case);
        for (file, _, expect) in &case.frames {
            let bytes = std::fs::read(dir().join(format!("{file}.bin"))).expect("golden frame");
            let result = inbound.check(&bytes, now());
            assert_eq!(
                outcome(&result),
                *expect,
                "{}: {file}: {result:?}",
                case.name
            );
        }
    }
}

#[test]
fn refusals_name_the_sessions_and_sequence_they_concern() {
    let cases = cases();
    let expired = &cases
        .iter()
        .find(|c| c.name == "expired_deadline")
        .expect("case")
        .frames[0]
        .1;
    let mut inbound = Inbound::to_shard(EPOCHS, MAX_FRAME_BYTES, HIDDEN, all_encodings(), 8);
    let err = inbound.check(expired, now()).expect_err("expired");
    assert_eq!(err.kind, ErrorKind::Deadline);
    assert_eq!(err.sessions, vec![SESSION_A]);
    assert_eq!(err.sequence, Some(1));
    assert_eq!(err.kind.status_name(), "DEADLINE_EXCEEDED");
    // The wire report decodes back to the same kind.
    let wire = err.to_wire();
    assert_eq!(
        ErrorKind::from_wire(wire.get_kind()),
        Some(ErrorKind::Deadline)
    );
    assert_eq!(wire.get_session_ids(), &[SESSION_A.to_vec()]);

    let corrupted = &cases
        .iter()
        .find(|c| c.name == "corrupted_checksum")
        .expect("case")
        .frames[0]
        .1;
    let mut inbound = Inbound::to_shard(EPOCHS, MAX_FRAME_BYTES, HIDDEN, all_encodings(), 8);
    let err = inbound.check(corrupted, now()).expect_err("corrupted");
    assert_eq!(err.kind.status_name(), "DATA_LOSS");
    // A refused frame still counts: the next one is not a gap.
    let second = &cases[0].frames[1].1;
    assert!(inbound.check(second, now()).is_ok());
}

#[test]
fn credits_granted_later_let_frames_through_again() {
    let cases = cases();
    let frames = &cases[0].frames;
    let mut inbound = Inbound::to_shard(EPOCHS, MAX_FRAME_BYTES, HIDDEN, all_encodings(), 1);
    assert!(inbound.check(&frames[0].1, now()).is_ok());
    assert_eq!(inbound.credits(), Some(0));
    inbound.grant(2);
    assert!(inbound.check(&frames[1].1, now()).is_ok());
    assert!(inbound.check(&frames[2].1, now()).is_ok());
    // Release and cancel need no credit.
    assert!(inbound.check(&frames[3].1, now()).is_ok());
    assert!(inbound.check(&frames[4].1, now()).is_ok());
}
