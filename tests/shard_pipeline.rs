//! The reference model split over three `inferd shard` processes on
//! loopback, driven through `ShardLink`s by a coordinator in the test:
//! logits bit-identical to the single-process engine through prefill and
//! greedy decode, and the failures the protocol must contain: a corrupted
//! frame (DATA_LOSS, the stream goes on), an unknown session (NOT_FOUND),
//! a coordinator that restarted (its predecessor's stream is stale), and a
//! shard killed mid-generation (transport failure on that link only). The
//! same again through `inferd relay` processes: the same logits, and the
//! relays' ingress and egress hashes equal the frames the coordinator sent
//! and received, frame by frame, both ways.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use inferd::cluster::fingerprint::{sha256_of_file, Fingerprint};
use inferd::cluster::frame::Run;
use inferd::cluster::link::{LinkError, LinkOptions, ShardLink};
use inferd::cluster::payload::encode_rows;
use inferd::cluster::{Encoding, ErrorKind, WireSessionId};
use inferd::engine::{Engine, EngineConfig};
use inferd::model::{Model, Scratch};
use inferd::proto::inferd_shard_v1::shard_runtime as pb;
use inferd::threads::ThreadPool;
use support::Inferd;

const REFERENCE: &str = support::REFERENCE;
const RANGES: [(usize, usize); 3] = [(0, 10), (10, 20), (20, 30)];

fn start_shard(layers: (usize, usize)) -> Inferd {
    Inferd::shard(&format!("{}..{}", layers.0, layers.1), "127.0.0.1:0")
}

struct Coordinator {
    model: Arc<Model>,
    links: Vec<ShardLink>,
    pool: ThreadPool,
    scratch: Scratch,
}

fn fingerprint(model: &Model, hash: [u8; 32], layers: (usize, usize)) -> Fingerprint {
    Fingerprint::of_layers(hash, &model.config, layers.0..layers.1)
}

impl Coordinator {
    fn connect(model: Arc<Model>, shards: &[Inferd], epoch: u64) -> Coordinator {
        Self::connect_with(model, shards, epoch, &LinkOptions::default())
    }

    fn connect_with(
        model: Arc<Model>,
        shards: &[Inferd],
        epoch: u64,
        options: &LinkOptions,
    ) -> Coordinator {
        let hash = sha256_of_file(Path::new(REFERENCE)).expect("hash");
        let links = shards
            .iter()
            .zip(RANGES)
            .map(|(shard, range)| {
                ShardLink::connect(
                    &shard.addr,
                    &fingerprint(&model, hash, range),
                    epoch,
                    options,
                )
                .expect("handshake")
            })
            .collect();
        Coordinator {
            model,
            links,
            pool: ThreadPool::new(1),
            scratch: Scratch::default(),
        }
    }

    /// Feeds `tokens` of `session` starting at `position`; the last row's logits.
    fn feed(
        &mut self,
        session: WireSessionId,
        position: u64,
        tokens: &[u32],
    ) -> Result<Vec<f32>, LinkError> {
        let hidden = self.model.config.hidden;
        let mut x = vec![0f32; tokens.len() * hidden];
        self.model.embed(tokens, &mut x).expect("embed");
        for link in &mut self.links {
            link.forward(
                &[Run {
                    session,
                    position,
                    rows: tokens.len() as u32,
                }],
                &mut x,
                0,
            )?;
        }
        let mut logits = Vec::new();
        let last = &x[(tokens.len() - 1) * hidden..];
        self.model
            .logits_from_hidden(&self.pool, last, &mut logits, &mut self.scratch);
        Ok(logits)
    }
}

/// The single-process reference the shards are held to.
fn one_host(model: &Arc<Model>) -> Engine {
    Engine::new(
        Arc::clone(model),
        &EngineConfig {
            threads: 1,
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

fn argmax(logits: &[f32]) -> u32 {
    inferd::sampler::argmax(logits).expect("a token")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn three_shards_match_one_host_and_contain_every_failure() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let model = Arc::new(Model::load(REFERENCE).expect("model"));
    let mut engine = one_host(&model);
    let mut shards: Vec<Inferd> = RANGES.iter().map(|&r| start_shard(r)).collect();
    let mut coordinator = Coordinator::connect(Arc::clone(&model), &shards, 0xc0ffee);

    // Prefill in three fragments, then greedy decode: the same logits bits.
    let prompt: Vec<u32> = vec![
        1, 504, 3575, 282, 4649, 314, 9, 45, 1095, 30, 216, 3458, 282, 4667, 30,
    ];
    let session: WireSessionId = [7; 16];
    let mut local = engine.new_session();
    let mut position = 0u64;
    let mut logits = Vec::new();
    for chunk in prompt.chunks(6) {
        logits = coordinator
            .feed(session, position, chunk)
            .expect("prefill through the shards");
        position += chunk.len() as u64;
    }
    engine.append(&mut local, &prompt).expect("local prefill");
    assert_eq!(
        bits(&logits),
        bits(local.next_logits()),
        "prefill logits differ"
    );
    for step in 0..6 {
        let token = argmax(&logits);
        logits = coordinator
            .feed(session, position, &[token])
            .expect("decode through the shards");
        position += 1;
        engine.append(&mut local, &[token]).expect("local decode");
        assert_eq!(
            bits(&logits),
            bits(local.next_logits()),
            "decode step {step} differs"
        );
    }

    // A corrupted payload: DATA_LOSS, nothing computed, the stream goes on.
    let hidden = model.config.hidden;
    let mut frame = pb::Frame::new();
    let mut body = pb::Hidden::new();
    let mut run = pb::Rows::new();
    run.set_session_id(session.to_vec());
    run.set_position(position);
    run.set_count(1);
    body.set_runs(vec![run].into());
    frame.set_prefill(body);
    frame.set_payload(encode_rows(Encoding::F32, hidden, &vec![0.5; hidden]).expect("rows"));
    let link = &mut coordinator.links[0];
    let mut sealed = link.seal(frame, Some(Encoding::F32), 0).expect("seal");
    // Flip a bit inside the payload (0.5f32 is 00 00 00 3f), not the header.
    let at = sealed
        .windows(4)
        .position(|w| w == [0, 0, 0, 0x3f])
        .expect("payload bytes");
    sealed[at + 3] ^= 0x01;
    link.send_raw(sealed).expect("send");
    let refusal = loop {
        let checked = link.next_frame().expect("a reply");
        if checked.frame.has_error() {
            break checked.frame.get_error().clone();
        }
    };
    assert_eq!(
        ErrorKind::from_wire(refusal.get_kind()),
        Some(ErrorKind::Checksum)
    );
    let token = argmax(&logits);
    logits = coordinator
        .feed(session, position, &[token])
        .expect("the stream goes on");
    position += 1;
    engine.append(&mut local, &[token]).expect("local decode");
    assert_eq!(bits(&logits), bits(local.next_logits()));

    // Refused frames cost the link no credit: many more than the credit
    // window (16), each refused at once for its passed deadline, and the
    // stream still goes on at full speed.
    for attempt in 0..40 {
        let mut x = vec![0.5f32; hidden];
        let t0 = std::time::Instant::now();
        match coordinator.links[0].forward(
            &[Run {
                session,
                position,
                rows: 1,
            }],
            &mut x,
            1,
        ) {
            Err(e) => assert_eq!(e.kind(), Some(ErrorKind::Deadline), "{attempt}: {e}"),
            Ok(()) => panic!("a frame past its deadline was computed"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "refusal {attempt} waited {:?} for a credit",
            t0.elapsed()
        );
    }
    let token = argmax(&logits);
    logits = coordinator
        .feed(session, position, &[token])
        .expect("the stream goes on after the refusals");
    position += 1;
    engine.append(&mut local, &[token]).expect("local decode");
    assert_eq!(bits(&logits), bits(local.next_logits()));

    // A session the shard never saw, continuing at position 5: NOT_FOUND.
    let stranger: WireSessionId = [9; 16];
    match coordinator.feed(stranger, 5, &[17]) {
        Err(e) => assert_eq!(e.kind(), Some(ErrorKind::UnknownSession), "{e}"),
        Ok(_) => panic!("an unknown session was computed"),
    }

    // A restarted coordinator (new epoch) takes over; the old stream is stale.
    let mut successor = Coordinator::connect(Arc::clone(&model), &shards, 0xbeef);
    match coordinator.feed(session, position, &[argmax(&logits)]) {
        Err(e) => assert_eq!(e.kind(), Some(ErrorKind::StaleEpoch), "{e}"),
        Ok(_) => panic!("a stale coordinator was served"),
    }
    // ... and its predecessor's sessions are gone: the new one starts afresh.
    let fresh = successor
        .feed(session, 0, &prompt[..4])
        .expect("a new session at 0");
    let mut again = engine.new_session();
    engine.append(&mut again, &prompt[..4]).expect("local");
    assert_eq!(bits(&fresh), bits(again.next_logits()));

    // Kill the middle shard: that link fails with a transport error.
    let killed = shards.remove(1);
    drop(killed);
    let err = successor
        .feed(session, 4, &prompt[4..6])
        .expect_err("the middle shard is gone");
    assert!(matches!(err, LinkError::Transport { .. }), "{err}");
    // The first shard still serves.
    let mut x = vec![0f32; hidden];
    model.embed(&[5], &mut x).expect("embed");
    successor.links[0]
        .forward(
            &[Run {
                session: [3; 16],
                position: 0,
                rows: 1,
            }],
            &mut x,
            0,
        )
        .expect("the first shard still answers");
}

#[test]
fn through_relays_the_answer_and_every_frame_are_the_same() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let model = Arc::new(Model::load(REFERENCE).expect("model"));
    let mut engine = one_host(&model);
    let shards: Vec<Inferd> = RANGES.iter().map(|&r| start_shard(r)).collect();
    let records = tempfile::tempdir().expect("tempdir");
    let relays: Vec<Inferd> = shards
        .iter()
        .enumerate()
        .map(|(i, shard)| {
            let record = records.path().join(format!("relay-{i}.jsonl"));
            Inferd::start(&[
                "relay",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                &shard.addr,
                "--record",
                record.to_str().expect("utf-8 path"),
            ])
        })
        .collect();
    let options = LinkOptions {
        record_hashes: true,
        ..LinkOptions::default()
    };
    let mut coordinator = Coordinator::connect_with(Arc::clone(&model), &relays, 0xfeed, &options);
    let prompt: Vec<u32> = vec![1, 504, 3575, 282, 4649, 314, 9, 45];
    let session: WireSessionId = [4; 16];
    let mut logits = coordinator
        .feed(session, 0, &prompt)
        .expect("prefill via relays");
    let mut local = engine.new_session();
    engine.append(&mut local, &prompt).expect("local");
    assert_eq!(bits(&logits), bits(local.next_logits()));
    for position in prompt.len() as u64..prompt.len() as u64 + 4 {
        let token = argmax(&logits);
        logits = coordinator
            .feed(session, position, &[token])
            .expect("decode via relays");
        engine.append(&mut local, &[token]).expect("local");
        assert_eq!(bits(&logits), bits(local.next_logits()));
    }
    for (i, link) in coordinator.links.iter().enumerate() {
        let (sent, received) = link.frame_hashes().expect("recording");
        let text = std::fs::read_to_string(records.path().join(format!("relay-{i}.jsonl")))
            .expect("relay record");
        let hops: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("json line"))
            .collect();
        let session_hops = |way: &str| -> Vec<(String, String)> {
            hops.iter()
                .filter(|h| h["method"] == "Session" && h["way"] == way)
                .map(|h| {
                    (
                        h["ingress_sha256"].as_str().unwrap_or("").to_owned(),
                        h["egress_sha256"].as_str().unwrap_or("").to_owned(),
                    )
                })
                .collect()
        };
        let up = session_hops("upstream");
        let down = session_hops("downstream");
        assert_eq!(up.len(), sent.len(), "relay {i}: frames up");
        // The shard's last credit may be forwarded and not read yet.
        assert!(
            down.len() >= received.len() && down.len() <= received.len() + 1,
            "relay {i}: {} frames down, the coordinator read {}",
            down.len(),
            received.len()
        );
        for (k, ((ingress, egress), ours)) in up.iter().zip(sent).enumerate() {
            assert_eq!(
                ingress, ours,
                "relay {i}: upstream frame {k} arrived changed"
            );
            assert_eq!(egress, ours, "relay {i}: upstream frame {k} left changed");
        }
        for (k, ((ingress, egress), ours)) in down.iter().zip(received).enumerate() {
            assert_eq!(
                ingress, egress,
                "relay {i}: downstream frame {k} changed inside"
            );
            assert_eq!(
                egress, ours,
                "relay {i}: downstream frame {k} arrived changed"
            );
        }
        assert!(hops.iter().any(|h| h["method"] == "Handshake"));
    }
    drop(relays);
    drop(shards);
}

#[test]
fn a_shard_refuses_streams_beyond_its_limit_and_takes_one_when_another_ends() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let model = Arc::new(Model::load(REFERENCE).expect("model"));
    let hash = sha256_of_file(Path::new(REFERENCE)).expect("hash");
    let served = fingerprint(&model, hash, (0, 30));
    let mut cfg = inferd::cluster::shard::ShardConfig::new(0..30, "127.0.0.1:0");
    cfg.threads = 1;
    cfg.kv_bytes = 8 << 20;
    cfg.max_streams = 1;
    let shard =
        inferd::cluster::shard::ShardServer::start(Arc::clone(&model), served.clone(), &cfg)
            .expect("shard");
    let addr = shard.addr().to_string();
    let hidden = model.config.hidden;
    let step = |link: &mut ShardLink, session: WireSessionId| {
        let mut x = vec![0f32; hidden];
        model.embed(&[1], &mut x).expect("embed");
        link.forward(
            &[Run {
                session,
                position: 0,
                rows: 1,
            }],
            &mut x,
            0,
        )
    };
    let options = LinkOptions::default();
    let mut first = ShardLink::connect(&addr, &served, 0x51, &options).expect("first");
    step(&mut first, [1; 16]).expect("the first stream is served");
    let mut second = ShardLink::connect(&addr, &served, 0x51, &options).expect("handshake");
    let err = step(&mut second, [2; 16]).expect_err("a second stream is over the limit");
    assert!(
        matches!(&err, LinkError::Transport { message, .. } if message.contains("at most 1 streams")),
        "{err}"
    );
    drop(first);
    // The first stream's thread ends once its call is gone.
    let t0 = std::time::Instant::now();
    loop {
        let mut third = ShardLink::connect(&addr, &served, 0x51, &options).expect("handshake");
        match step(&mut third, [3; 16]) {
            Ok(()) => break,
            Err(e) => assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the freed stream slot was never reused: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    shard.shutdown();
}
