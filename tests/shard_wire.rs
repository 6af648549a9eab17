//! What a real `inferd shard` answers to bytes a hostile peer sends over a
//! real channel:
//!
//! - a Handshake body that does not parse (garbage, a truncated varint, a
//!   wrong wire type, a nested message that does not parse) is
//!   INVALID_ARGUMENT, not grpcio's INTERNAL;
//! - a garbage first frame on a Session stream, before any valid frame,
//!   is MALFORMED (not STALE_EPOCH), and the stream goes on;
//! - flow control is enforced: 40 hidden-state frames sent at once against
//!   a credit window of 16, while the shard is busy with the first, get 16
//!   answers and 24 FLOW_CONTROL refusals.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use grpcio::{CallOption, ChannelBuilder, Client, EnvBuilder, RpcStatusCode, WriteFlags};
use inferd::cluster::fingerprint::{sha256_of_file, Fingerprint};
use inferd::cluster::link::{LinkOptions, ShardLink};
use inferd::cluster::payload::encode_rows;
use inferd::cluster::raw::{HANDSHAKE_RAW, SESSION_RAW};
use inferd::cluster::{Encoding, ErrorKind, WireSessionId};
use inferd::model::Model;
use inferd::proto::inferd_shard_v1::shard_runtime as pb;
use protobuf::Message;
use support::Inferd;

const REFERENCE: &str = support::REFERENCE;
const CALL: Duration = Duration::from_secs(30);

fn raw_client(addr: &str) -> Client {
    let env = Arc::new(EnvBuilder::new().cq_count(1).build());
    Client::new(ChannelBuilder::new(env).connect(addr))
}

#[test]
fn a_handshake_body_that_does_not_parse_is_invalid_argument() {
    if !support::have_reference() {
        return;
    }
    let shard = Inferd::shard("0..2", "127.0.0.1:0");
    let client = raw_client(&shard.addr);
    let bodies: [(&str, &[u8]); 4] = [
        ("garbage", b"\xff\xff\xff\xff not a message"),
        // Field 1 (varint) whose varint never ends.
        ("a truncated varint", &[0x08, 0x80, 0x80]),
        // Field 1 is an enum (varint), sent length-delimited.
        ("a wrong wire type", &[0x0a, 0x01, 0x00]),
        // Field 2 (the fingerprint) holding bytes that are no message.
        (
            "a nested message that does not parse",
            &[0x12, 0x02, 0xff, 0xff],
        ),
    ];
    for (what, body) in bodies {
        let got = client.unary_call(
            &HANDSHAKE_RAW,
            &body.to_vec(),
            CallOption::default().timeout(CALL),
        );
        match got {
            Err(grpcio::Error::RpcFailure(status)) => assert_eq!(
                status.code(),
                RpcStatusCode::INVALID_ARGUMENT,
                "{what}: {}",
                status.message()
            ),
            other => panic!("{what}: {other:?}"),
        }
    }
    // A well-formed request the shard does not serve is still refused by
    // its terms (FAILED_PRECONDITION), not by the parser.
    let mut request = pb::HandshakeRequest::new();
    request.set_protocol_version(pb::ProtocolVersion::PROTOCOL_VERSION_1);
    let body = request.write_to_bytes().expect("serialize");
    match client.unary_call(&HANDSHAKE_RAW, &body, CallOption::default().timeout(CALL)) {
        Err(grpcio::Error::RpcFailure(status)) => {
            assert_eq!(status.code(), RpcStatusCode::FAILED_PRECONDITION)
        }
        other => panic!("a request without a fingerprint: {other:?}"),
    }
}

#[test]
fn a_garbage_first_frame_is_malformed() {
    if !support::have_reference() {
        return;
    }
    let shard = Inferd::shard("0..2", "127.0.0.1:0");
    let client = raw_client(&shard.addr);
    let (mut tx, mut rx) = client
        .duplex_streaming(&SESSION_RAW, CallOption::default().timeout(CALL))
        .expect("open a stream");
    let kinds: Vec<Option<ErrorKind>> = futures_executor::block_on(async {
        let mut kinds = Vec::new();
        // Garbage, then a frame with no header: both malformed.
        for bytes in [
            b"\xff\xfe garbage".to_vec(),
            pb::Frame::new().write_to_bytes().unwrap(),
        ] {
            tx.send((bytes, WriteFlags::default())).await.expect("send");
            let reply = rx
                .next()
                .await
                .expect("a reply")
                .expect("the stream goes on");
            let frame = pb::Frame::parse_from_bytes(&reply).expect("a frame");
            assert!(frame.has_error(), "{frame:?}");
            kinds.push(ErrorKind::from_wire(frame.get_error().get_kind()));
        }
        // A well-formed frame of a coordinator that never shook hands: stale.
        let mut frame = pb::Frame::new();
        let mut header = pb::FrameHeader::new();
        header.set_coordinator_epoch(77);
        header.set_sequence(1);
        frame.set_header(header);
        let mut release = pb::Release::new();
        release.set_session_ids(vec![vec![0; 16]].into());
        frame.set_release(release);
        let bytes = frame.write_to_bytes().expect("serialize");
        tx.send((bytes, WriteFlags::default())).await.expect("send");
        let reply = rx
            .next()
            .await
            .expect("a reply")
            .expect("the stream goes on");
        let frame = pb::Frame::parse_from_bytes(&reply).expect("a frame");
        kinds.push(ErrorKind::from_wire(frame.get_error().get_kind()));
        let _ = tx.close().await;
        kinds
    });
    assert_eq!(
        kinds,
        vec![
            Some(ErrorKind::Malformed),
            Some(ErrorKind::Malformed),
            Some(ErrorKind::StaleEpoch)
        ]
    );
}

fn prefill(session: WireSessionId, rows: usize, hidden: usize) -> pb::Frame {
    let mut run = pb::Rows::new();
    run.set_session_id(session.to_vec());
    run.set_position(0);
    run.set_count(rows as u32);
    let mut body = pb::Hidden::new();
    body.set_runs(vec![run].into());
    let mut frame = pb::Frame::new();
    frame.set_prefill(body);
    let values = vec![0.25f32; rows * hidden];
    frame.set_payload(encode_rows(Encoding::F32, hidden, &values).expect("rows"));
    frame
}

#[test]
fn frames_beyond_the_credit_window_are_refused() {
    if !support::have_reference() {
        return;
    }
    let model = Model::load(REFERENCE).expect("model");
    let hidden = model.config.hidden;
    let shard = Inferd::shard("0..30", "127.0.0.1:0");
    let hash = sha256_of_file(Path::new(REFERENCE)).expect("hash");
    let fingerprint = Fingerprint::of_layers(hash, &model.config, 0..30);
    let options = LinkOptions {
        credit_window: 16,
        ..LinkOptions::default()
    };
    let mut link = ShardLink::connect(&shard.addr, &fingerprint, 0xf10, &options).expect("link");
    assert_eq!(link.capacity().max_frame_rows, 2048, "advertised");
    // The first frame keeps the shard busy (512 rows through 30 layers on
    // one thread) while the other 39 arrive.
    let mut frames = vec![prefill([0; 16], 512, hidden)];
    for i in 1..40u8 {
        frames.push(prefill([i; 16], 1, hidden));
    }
    for frame in frames {
        let sealed = link.seal(frame, Some(Encoding::F32), 0).expect("seal");
        link.send_raw(sealed).expect("send");
    }
    let (done, counted) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (mut outputs, mut refused, mut other) = (0, 0, Vec::new());
        while outputs + refused + other.len() < 40 {
            let Ok(checked) = link.next_frame() else {
                break;
            };
            let f = checked.frame;
            if f.has_output() {
                outputs += 1;
            } else if f.has_error() {
                match ErrorKind::from_wire(f.get_error().get_kind()) {
                    Some(ErrorKind::FlowControl) => refused += 1,
                    kind => other.push(kind),
                }
            }
        }
        let _ = done.send((outputs, refused, other));
    });
    let (outputs, refused, other) = counted
        .recv_timeout(Duration::from_secs(120))
        .expect("every frame answered");
    assert!(other.is_empty(), "other refusals: {other:?}");
    assert_eq!(
        (outputs, refused),
        (16, 24),
        "answers and FLOW_CONTROL refusals"
    );
}
