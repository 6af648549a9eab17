//! `inferd serve --shards` as a stock gRPC client sees it, every piece a
//! real process on loopback (or, where the test must look inside a shard,
//! a real shard listener in this process):
//!
//! - the reference model split over 2 and over 3 `inferd shard` processes,
//!   directly and through `inferd relay` processes, answers exactly what
//!   one host answers: tokens, log-probability bits and logits digests,
//!   greedy and seeded, with several sessions decoding in one frame;
//! - close, idle expiry and cancel reach every shard;
//! - a shard killed mid-generation fails the call in flight with
//!   UNAVAILABLE (the tokens already sent stay committed), counts it in the
//!   metrics, and the coordinator keeps serving; once the shard is back,
//!   every session, the interrupted one and an idle one, continues exactly
//!   as on one host (rebuilt by feeding its history again);
//! - an output frame corrupted on its way back from a shard fails that call
//!   with DATA_LOSS (a flipped payload bit) or ABORTED (an answer to a
//!   frame never sent), and the session continues as on one host.

mod support;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use grpcio::RpcStatusCode;

use inferd::cluster::fingerprint::{sha256_of_file, Fingerprint};
use inferd::cluster::raw::SESSION_RAW;
use inferd::cluster::shard::{ShardConfig, ShardServer};
use inferd::model::Model;
use inferd::proto::inferd_shard_v1::shard_runtime::Frame as ShardFrame;
use support::{
    greedy, have_reference, retry_unavailable, sample, scrape, seeded, Client, Generated, Inferd,
};

/// Three prompts of the reference vocabulary.
fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 504, 3575, 282, 4649, 314, 9, 45, 2, 17, 330],
        vec![
            1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308,
        ],
        vec![1, 18061, 30, 1789, 2, 49152 - 7, 6418],
    ]
}

/// What one session went through: digests after each stage, the greedy
/// tokens with their log-probability bits, and the seeded tokens.
#[derive(Debug, PartialEq, Eq)]
struct Transcript {
    digests: Vec<u64>,
    /// KV bytes the history holds and one page's bytes, over all layers
    /// (on a coordinator: what the shards hold together).
    kv: (u64, u64),
    greedy: Generated,
    seeded: Generated,
}

fn digest(client: &Client, id: &str) -> u64 {
    client.info(id).expect("info").get_logits_digest()
}

/// Builds each prompt's history in two appends, then generates greedily and
/// seeded, all sessions at once (so the shards see decode frames of several
/// sessions).
fn transcripts(addr: &str) -> Vec<Transcript> {
    let client = Client::connect(addr);
    let workers: Vec<_> = prompts()
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| {
            let client = client.clone();
            thread::spawn(move || {
                let id = client.create();
                let half = prompt.len() / 2;
                client.append(&id, &prompt[..half]).expect("append");
                client.append(&id, &prompt[half..]).expect("append");
                let info = client.info(&id).expect("info");
                let kv = (info.get_kv_live_bytes(), info.get_kv_page_bytes());
                let mut digests = vec![digest(&client, &id)];
                let greedy = client.generate(&greedy(&id, 24, 3));
                digests.push(digest(&client, &id));
                let seeded = client.generate(&seeded(&id, 16, 7 + i as u64));
                digests.push(digest(&client, &id));
                client.close(&id).expect("close");
                Transcript {
                    digests,
                    kv,
                    greedy,
                    seeded,
                }
            })
        })
        .collect();
    workers
        .into_iter()
        .map(|w| w.join().expect("session thread"))
        .collect()
}

fn serve(extra: &[&str]) -> Inferd {
    let mut args = vec![
        "serve",
        "--model",
        support::REFERENCE,
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "2",
        "--kv-mib",
        "32",
        "--sampler",
        "cpu",
    ];
    args.extend_from_slice(extra);
    Inferd::start(&args)
}

#[test]
fn a_model_split_over_two_or_three_shards_answers_bit_for_bit_like_one_host() {
    if !have_reference() {
        return;
    }
    let one_host = {
        let server = serve(&[]);
        transcripts(&server.addr)
    };
    for t in &one_host {
        assert_eq!(t.greedy.tokens.len(), 24, "{t:?}");
        assert!(
            t.greedy.error.is_none() && t.seeded.error.is_none(),
            "{t:?}"
        );
        assert_eq!(t.greedy.logprob_bits.len(), 24 * 4);
    }

    let (_two, list) = Inferd::shards(&["0..15", "15..30"]);
    let coordinator = serve(&["--shards", &list]);
    assert_eq!(transcripts(&coordinator.addr), one_host, "2 shards");
    drop(coordinator);

    let three: Vec<Inferd> = ["0..10", "10..20", "20..30"]
        .iter()
        .map(|l| Inferd::shard(l, "127.0.0.1:0"))
        .collect();
    let named = format!(
        "{}=0..10,{}=10..20,{}=20..30",
        three[0].addr, three[1].addr, three[2].addr
    );
    let coordinator = serve(&["--shards", &named]);
    assert_eq!(transcripts(&coordinator.addr), one_host, "3 shards");
    // The coordinator holds one shard set at a time: the next one takes
    // over these shards only after this one stopped.
    drop(coordinator);

    let relays: Vec<Inferd> = three
        .iter()
        .map(|s| Inferd::start(&["relay", "--listen", "127.0.0.1:0", "--upstream", &s.addr]))
        .collect();
    let via = format!("{},{},{}", relays[0].addr, relays[1].addr, relays[2].addr);
    let coordinator = serve(&["--shards", &via]);
    assert_eq!(
        transcripts(&coordinator.addr),
        one_host,
        "3 shards through relays"
    );
}

/// Shards in this process, so the test can see what they hold.
fn local_shards(model: &Arc<Model>, ranges: &[(usize, usize)]) -> Vec<ShardServer> {
    ranges
        .iter()
        .map(|&range| local_shard(model, range, "127.0.0.1:0"))
        .collect()
}

fn local_shard(model: &Arc<Model>, (a, b): (usize, usize), listen: &str) -> ShardServer {
    let hash = sha256_of_file(std::path::Path::new(support::REFERENCE)).expect("hash");
    let fingerprint = Fingerprint::of_layers(hash, &model.config, a..b);
    let mut cfg = ShardConfig::new(a..b, listen);
    cfg.kv_bytes = 16 << 20;
    cfg.threads = 1;
    ShardServer::start(Arc::clone(model), fingerprint, &cfg).expect("shard starts")
}

/// Polls `what` until it holds, for at most five seconds.
fn eventually(what: &str, mut holds: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !holds() {
        assert!(t0.elapsed() < Duration::from_secs(5), "never: {what}");
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn close_idle_expiry_and_cancel_reach_every_shard() {
    if !have_reference() {
        return;
    }
    let model = Arc::new(Model::load(support::REFERENCE).expect("model"));
    let shards = local_shards(&model, &[(0, 12), (12, 30)]);
    let list = format!("{}=0..12,{}=12..30", shards[0].addr(), shards[1].addr());
    let coordinator = serve(&["--shards", &list, "--idle-ttl", "3"]);
    let client = Client::connect(&coordinator.addr);
    let held = |n: usize| shards.iter().all(|s| s.sessions() == n);

    let ids: Vec<String> = (0..3).map(|_| client.create()).collect();
    for (id, prompt) in ids.iter().zip(prompts()) {
        client.append(id, &prompt).expect("append");
    }
    eventually("both shards hold the 3 sessions", || held(3));

    client.close(&ids[0]).expect("close");
    eventually("a closed session is released on both shards", || held(2));

    let before: Vec<u64> = shards.iter().map(|s| s.cancelled_sessions()).collect();
    let cut = client.generate_watching(&greedy(&ids[1], 400, 0), Some(3), |_| {});
    assert_eq!(cut.tokens.len(), 3);
    eventually("a cancelled Generate is cancelled on both shards", || {
        shards
            .iter()
            .zip(&before)
            .all(|(s, &b)| s.cancelled_sessions() == b + 1)
    });
    eventually("the cancelled session is still held", || held(2));

    // Both left idle: the idle TTL (3 s) releases them everywhere.
    let t0 = Instant::now();
    while !held(0) {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "idle sessions were never released on the shards"
        );
        thread::sleep(Duration::from_millis(50));
    }
    drop(coordinator);
    for s in shards {
        s.shutdown();
    }
}

#[test]
fn a_killed_shard_fails_the_call_in_flight_and_its_sessions_come_back_with_it() {
    if !have_reference() {
        return;
    }
    let reference = serve(&[]);
    let one_host = Client::connect(&reference.addr);
    let first = Inferd::shard("0..15", "127.0.0.1:0");
    let mut second = Inferd::shard("15..30", "127.0.0.1:0");
    let second_listen = second.addr.clone();
    let list = format!("{},{}", first.addr, second.addr);
    let coordinator = serve(&["--shards", &list, "--metrics-listen", "127.0.0.1:0"]);
    let metrics = coordinator.metrics.clone().expect("metrics address");
    let client = Client::connect(&coordinator.addr);
    let second_label = format!("shard=\"{second_listen}\"");

    assert_eq!(
        sample(
            &scrape(&metrics),
            &format!("inferd_shard_up{{{second_label}}}")
        ),
        Some(1.0)
    );
    let prompts = prompts();
    let busy = client.create();
    let idle = client.create();
    client.append(&busy, &prompts[0]).expect("append");
    client.append(&idle, &prompts[1]).expect("append");
    let warm = client.generate(&greedy(&busy, 4, 0));
    assert_eq!(warm.tokens.len(), 4);

    // Kill the second shard after a few tokens of a long Generate.
    let mut killer = Some(&mut second);
    let cut = client.generate_watching(&greedy(&busy, 400, 0), None, |n| {
        if n == 5 {
            if let Some(shard) = killer.take() {
                shard.kill();
            }
        }
    });
    let (code, message) = cut.error.clone().expect("the call fails");
    assert_eq!(code, i32::from(RpcStatusCode::UNAVAILABLE), "{message}");
    assert!(
        message.contains(&second_listen),
        "names the shard: {message}"
    );
    assert!(cut.done.is_none());
    assert!(cut.tokens.len() >= 5, "{cut:?}");
    let committed = client.info(&busy).expect("info").get_history_length();
    assert_eq!(
        committed as usize,
        prompts[0].len() + 4 + cut.tokens.len(),
        "the tokens sent stay committed"
    );

    // While the shard is down calls fail fast and typed; nothing else breaks.
    let down = client.generate(&greedy(&idle, 4, 0));
    assert_eq!(
        down.error.as_ref().map(|e| e.0),
        Some(i32::from(RpcStatusCode::UNAVAILABLE)),
        "{down:?}"
    );
    let text = scrape(&metrics);
    assert_eq!(
        sample(&text, &format!("inferd_shard_up{{{second_label}}}")),
        Some(0.0)
    );
    let transport = sample(
        &text,
        &format!("inferd_shard_failures_total{{{second_label},kind=\"transport\"}}"),
    )
    .unwrap_or(0.0);
    assert!(transport >= 2.0, "{text}");
    assert_eq!(
        client.info(&idle).expect("idle kept").get_history_length() as usize,
        prompts[1].len()
    );

    // The shard comes back (a new process: a new epoch, no sessions).
    let _second = Inferd::shard("15..30", &second_listen);
    let mut history: Vec<u32> = prompts[0].clone();
    history.extend(&warm.tokens);
    history.extend(&cut.tokens);
    for (id, history) in [(&busy, history), (&idle, prompts[1].clone())] {
        let twin = one_host.create();
        one_host.append(&twin, &history).expect("append");
        let expected = one_host.generate(&greedy(&twin, 12, 2));
        // Calls fail (UNAVAILABLE, nothing changed) until the coordinator's
        // next connect finds the shard; a client retries them.
        let got = retry_unavailable(Duration::from_secs(10), || {
            client.generate(&greedy(id, 12, 2))
        });
        assert_eq!(got, expected, "continues as one host would");
        assert_eq!(digest(&client, id), digest(&one_host, &twin));
    }
    let text = scrape(&metrics);
    assert!(
        sample(&text, "inferd_shard_session_rebuilds_total").unwrap_or(0.0) >= 2.0,
        "{text}"
    );
    assert!(
        sample(
            &text,
            &format!("inferd_shard_restarts_total{{{second_label}}}")
        )
        .unwrap_or(0.0)
            >= 1.0,
        "{text}"
    );
    // A new session works as well.
    let fresh = client.create();
    client
        .append(&fresh, &prompts[2])
        .expect("append after the restart");
    assert_eq!(client.generate(&greedy(&fresh, 3, 0)).tokens.len(), 3);
}

#[test]
fn a_coordinator_waits_for_a_late_shard_and_refuses_a_mismatched_one() {
    if !have_reference() {
        return;
    }
    // A port nothing listens on yet.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let late = format!("127.0.0.1:{port}");
    let shards = late.clone();
    let coordinator = thread::spawn(move || serve(&["--shards", &shards]));
    thread::sleep(Duration::from_secs(2));
    let shard = Inferd::shard("0..30", &late);
    let coordinator = coordinator.join().expect("the coordinator started");
    let client = Client::connect(&coordinator.addr);
    let id = client.create();
    client.append(&id, &prompts()[0]).expect("append");
    assert_eq!(client.generate(&greedy(&id, 3, 0)).tokens.len(), 3);
    drop(coordinator);

    // A shard serving other layers than the list says: refused at once.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args([
            "serve",
            "--model",
            support::REFERENCE,
            "--listen",
            "127.0.0.1:0",
            "--shards",
            &format!("{}=0..12,127.0.0.1:1=12..30", shard.addr),
        ])
        .output()
        .expect("run inferd serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("fingerprint mismatch"), "{stderr}");
    assert!(stderr.contains("layers 0..12"), "{stderr}");
}

/// A forwarder in front of one shard that, once armed, tampers with the
/// next output frame on its way to the coordinator: a link that corrupts
/// data. It forwards both methods as opaque bytes otherwise, like
/// `inferd relay`.
struct Corrupter {
    server: grpcio::Server,
    addr: String,
    armed: Arc<std::sync::atomic::AtomicU8>,
}

const OFF: u8 = 0;
/// Flip a bit of the next output's payload (its CRC32C no longer matches).
const FLIP_PAYLOAD: u8 = 1;
/// Make the next output claim to answer a frame not sent yet.
const FLIP_ANSWERS_SEQUENCE: u8 = 2;

/// The frame tampered with as `mode` says; `None` when it is not an output
/// frame (the trigger waits for one) or `mode` is off.
fn tamper(bytes: &[u8], mode: u8) -> Option<Vec<u8>> {
    use protobuf::Message;
    if mode == OFF {
        return None;
    }
    let mut frame = ShardFrame::parse_from_bytes(bytes).ok()?;
    if !frame.has_output() {
        return None;
    }
    if mode == FLIP_PAYLOAD {
        let mut payload = frame.take_payload();
        let middle = payload.len() / 2;
        *payload.get_mut(middle)? ^= 0x10;
        frame.set_payload(payload);
    } else {
        let output = frame.mut_output();
        output.set_answers_sequence(output.get_answers_sequence() + 16);
    }
    frame.write_to_bytes().ok()
}

const HANDSHAKE_RAW: grpcio::Method<Vec<u8>, Vec<u8>> = grpcio::Method {
    ty: grpcio::MethodType::Unary,
    name: "/inferd.shard.v1.ShardRuntime/Handshake",
    req_mar: SESSION_RAW.req_mar,
    resp_mar: SESSION_RAW.resp_mar,
};

impl Corrupter {
    fn start(upstream: &str) -> Corrupter {
        use futures_util::{SinkExt, StreamExt};
        use grpcio::{
            CallOption, ChannelBuilder, DuplexSink, Environment, RequestStream, RpcContext,
            ServerBuilder, ServerCredentials, ServiceBuilder, UnarySink, WriteFlags,
        };
        let env = Arc::new(Environment::new(1));
        let client = Arc::new(grpcio::Client::new(
            ChannelBuilder::new(Arc::clone(&env)).connect(upstream),
        ));
        let armed = Arc::new(std::sync::atomic::AtomicU8::new(OFF));
        let unary_client = Arc::clone(&client);
        let trigger = Arc::clone(&armed);
        let service = ServiceBuilder::new()
            .add_unary_handler(
                &HANDSHAKE_RAW,
                move |ctx: RpcContext<'_>, req: Vec<u8>, sink: UnarySink<Vec<u8>>| {
                    let reply =
                        unary_client.unary_call_async(&HANDSHAKE_RAW, &req, CallOption::default());
                    ctx.spawn(async move {
                        let reply = match reply {
                            Ok(receiver) => receiver.await,
                            Err(e) => Err(e),
                        };
                        let _ = match reply {
                            Ok(bytes) => sink.success(bytes).await,
                            Err(grpcio::Error::RpcFailure(s)) => sink.fail(s).await,
                            Err(e) => {
                                sink.fail(grpcio::RpcStatus::with_message(
                                    RpcStatusCode::UNAVAILABLE,
                                    e.to_string(),
                                ))
                                .await
                            }
                        };
                    });
                },
            )
            .add_duplex_streaming_handler(
                &SESSION_RAW,
                move |ctx: RpcContext<'_>,
                      mut incoming: RequestStream<Vec<u8>>,
                      mut sink: DuplexSink<Vec<u8>>| {
                    let (mut up_tx, mut up_rx) = client
                        .duplex_streaming(&SESSION_RAW, CallOption::default())
                        .expect("upstream call");
                    let trigger = Arc::clone(&trigger);
                    ctx.spawn(async move {
                        let up = async move {
                            while let Some(Ok(bytes)) = incoming.next().await {
                                if up_tx.send((bytes, WriteFlags::default())).await.is_err() {
                                    return;
                                }
                            }
                            let _ = up_tx.close().await;
                        };
                        let down = async move {
                            while let Some(Ok(mut bytes)) = up_rx.next().await {
                                let mode = trigger.load(std::sync::atomic::Ordering::Acquire);
                                if let Some(tampered) = tamper(&bytes, mode) {
                                    trigger.store(OFF, std::sync::atomic::Ordering::Release);
                                    bytes = tampered;
                                }
                                if sink.send((bytes, WriteFlags::default())).await.is_err() {
                                    return;
                                }
                            }
                            let _ = sink.close().await;
                        };
                        futures_util::future::join(up, down).await;
                    });
                },
            )
            .build();
        let args = inferd::cluster::transport::server(Arc::clone(&env), 64 << 20).build_args();
        let mut server = ServerBuilder::new(env)
            .channel_args(args)
            .register_service(service)
            .build()
            .expect("server");
        let port = server
            .add_listening_port("127.0.0.1:0", ServerCredentials::insecure())
            .expect("listen");
        server.start();
        Corrupter {
            server,
            addr: format!("127.0.0.1:{port}"),
            armed,
        }
    }
}

#[test]
fn a_corrupted_frame_fails_its_call_typed_and_the_session_goes_on() {
    if !have_reference() {
        return;
    }
    let reference = serve(&[]);
    let one_host = Client::connect(&reference.addr);
    let first = Inferd::shard("0..15", "127.0.0.1:0");
    let second = Inferd::shard("15..30", "127.0.0.1:0");
    let corrupter = Corrupter::start(&second.addr);
    let list = format!("{},{}", first.addr, corrupter.addr);
    let coordinator = serve(&["--shards", &list, "--metrics-listen", "127.0.0.1:0"]);
    let client = Client::connect(&coordinator.addr);
    let prompt = prompts().remove(1);
    let id = client.create();
    client.append(&id, &prompt).expect("append");
    let mut history = prompt.clone();
    let before = client.generate(&greedy(&id, 3, 0));
    history.extend(&before.tokens);

    for (mode, code, kind) in [
        (FLIP_PAYLOAD, RpcStatusCode::DATA_LOSS, "checksum"),
        (FLIP_ANSWERS_SEQUENCE, RpcStatusCode::ABORTED, "sequence"),
    ] {
        corrupter
            .armed
            .store(mode, std::sync::atomic::Ordering::Release);
        let hit = client.generate(&greedy(&id, 5, 0));
        let (got, message) = hit.error.clone().expect("the tampered step fails");
        assert_eq!(got, i32::from(code), "{message}");
        assert!(message.contains(kind), "{message}");
        assert!(hit.tokens.is_empty(), "{hit:?}");
        assert_eq!(
            client.info(&id).expect("kept").get_history_length() as usize,
            history.len()
        );
    }
    let metrics = scrape(coordinator.metrics.as_deref().expect("metrics"));
    assert_eq!(
        sample(
            &metrics,
            &format!(
                "inferd_shard_failures_total{{shard=\"{}\",kind=\"checksum\"}}",
                corrupter.addr
            )
        ),
        Some(1.0),
        "{metrics}"
    );

    // The session was rebuilt and continues as one host would.
    let twin = one_host.create();
    one_host.append(&twin, &history).expect("append");
    assert_eq!(
        client.generate(&greedy(&id, 6, 2)),
        one_host.generate(&greedy(&twin, 6, 2))
    );
    drop(coordinator);
    let mut corrupter = corrupter;
    let _ = futures_executor::block_on(corrupter.server.shutdown());
}

#[test]
fn a_release_owed_to_a_shard_behind_a_broken_link_is_sent_when_the_link_is_back() {
    if !have_reference() {
        return;
    }
    let model = Arc::new(Model::load(support::REFERENCE).expect("model"));
    let mut shards = local_shards(&model, &[(0, 12), (12, 30)]);
    let second_addr = shards[1].addr().to_string();
    let relay_args =
        |listen: &str| ["relay", "--listen", listen, "--upstream", &second_addr].map(String::from);
    let start_relay = |listen: &str| {
        let args = relay_args(listen);
        Inferd::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let mut relay = start_relay("127.0.0.1:0");
    let relay_addr = relay.addr.clone();
    let list = format!("{}=0..12,{relay_addr}=12..30", shards[0].addr());
    let coordinator = Inferd::start(&[
        "serve",
        "--model",
        support::REFERENCE,
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "1",
        "--sampler",
        "cpu",
        "--shards",
        &list,
    ]);
    let client = Client::connect(&coordinator.addr);
    let held = |shards: &[ShardServer], i: usize| shards[i].sessions();
    let closed = client.create();
    let kept = client.create();
    let closed_later = client.create();
    client.append(&closed, &prompts()[0]).expect("append");
    client.append(&kept, &prompts()[1]).expect("append");
    client.append(&closed_later, &prompts()[2]).expect("append");
    eventually("both shards hold the 3 sessions", || {
        held(&shards, 0) == 3 && held(&shards, 1) == 3
    });

    // The link to the second shard breaks (its relay dies); a close then
    // reaches the first shard only, and the second is owed the release.
    relay.kill();
    client.close(&closed).expect("close while a link is down");
    eventually("the reachable shard released it", || held(&shards, 0) == 2);
    assert_eq!(held(&shards, 1), 3, "the unreachable shard still holds it");

    // Meanwhile the first shard restarts (a new epoch: it lost everything,
    // which does not cancel what the second is owed).
    let first = shards.remove(0);
    let first_addr = first.addr().to_string();
    first.shutdown();
    shards.insert(0, local_shard(&model, (0, 12), &first_addr));
    // Another close finds the first link broken too: both shards are owed.
    client
        .close(&closed_later)
        .expect("close while both links are down");
    // A call now reconnects the restarted shard (a new epoch) and finds the
    // second still away.
    let away = client.generate(&greedy(&kept, 2, 0));
    assert_eq!(
        away.error.as_ref().map(|e| e.0),
        Some(i32::from(RpcStatusCode::UNAVAILABLE)),
        "{away:?}"
    );

    // The link comes back (same shard, same epoch): the next step pays the
    // release before anything else, and rebuilds the kept session on the
    // restarted shard.
    let _relay = start_relay(&relay_addr);
    let resumed = support::retry_unavailable(Duration::from_secs(10), || {
        client.generate(&greedy(&kept, 2, 0))
    });
    assert_eq!(resumed.tokens.len(), 2, "{resumed:?}");
    eventually("the owed release reached the second shard", || {
        held(&shards, 1) == 1
    });
    assert_eq!(held(&shards, 0), 1);
    drop(coordinator);
    for s in shards {
        s.shutdown();
    }
}

/// `inferd shard` for `layers` with its pages kept in `dir`.
fn kept_shard(layers: &str, listen: &str, dir: &str) -> Inferd {
    let mut args = support::shard_args(layers, listen);
    args.extend(["--state-dir", dir]);
    Inferd::start(&args)
}

/// The coordinator's counters of what its rebuilds fed again and what the
/// shards kept: (`rebuilt_tokens`, `resumed_positions`).
fn rebuild_counts(metrics: &str) -> (f64, f64) {
    let text = scrape(metrics);
    let get = |name: &str| sample(&text, name).unwrap_or(0.0);
    (
        get("inferd_shard_rebuilt_tokens_total"),
        get("inferd_shard_resumed_positions_total"),
    )
}

/// One more turn of `id` (after whatever restart came before), which must
/// equal one host's answer for the same history; `history` grows by it.
fn next_turn_like_one_host(client: &Client, one_host: &Client, id: &str, history: &mut Vec<u32>) {
    let twin = one_host.create();
    one_host.append(&twin, history).expect("append");
    let expected = one_host.generate(&greedy(&twin, 6, 2));
    let got = retry_unavailable(Duration::from_secs(10), || {
        client.generate(&greedy(id, 6, 2))
    });
    assert_eq!(got, expected, "continues as one host would");
    assert_eq!(digest(client, id), digest(one_host, &twin));
    one_host.close(&twin).expect("close");
    history.extend(&got.tokens);
}

#[test]
fn shards_with_a_state_dir_keep_their_pages_across_their_restart_and_the_coordinators() {
    if !have_reference() {
        return;
    }
    let reference = serve(&[]);
    let one_host = Client::connect(&reference.addr);
    let dirs: Vec<tempfile::TempDir> = (0..3)
        .map(|_| tempfile::tempdir().expect("temp dir"))
        .collect();
    let dir = |i: usize| dirs[i].path().to_str().expect("utf-8 path").to_owned();
    let (first_dir, second_dir, coordinator_dir) = (dir(0), dir(1), dir(2));
    let _first = kept_shard("0..15", "127.0.0.1:0", &first_dir);
    let mut second = kept_shard("15..30", "127.0.0.1:0", &second_dir);
    let second_listen = second.addr.clone();
    let list = format!("{},{}", _first.addr, second_listen);
    let coordinator_args = [
        "--shards",
        &list,
        "--metrics-listen",
        "127.0.0.1:0",
        "--state-dir",
        &coordinator_dir,
    ];
    let mut coordinator = serve(&coordinator_args);
    let metrics = coordinator.metrics.clone().expect("metrics address");
    let client = Client::connect(&coordinator.addr);

    // A history of 300 prompt tokens (18 full pages of 16) and a reply.
    let mut history: Vec<u32> = (0..300u32).map(|i| 200 + (i * 7919) % 40000).collect();
    let id = client.create();
    client.append(&id, &history).expect("append");
    next_turn_like_one_host(&client, &one_host, &id, &mut history);
    assert_eq!(rebuild_counts(&metrics), (0.0, 0.0));

    // Killed and started again on its state dir, the shard takes its pages
    // back: the rebuild feeds only what lies past the last full page that
    // every shard kept.
    second.kill();
    let mut second = kept_shard("15..30", &second_listen, &second_dir);
    next_turn_like_one_host(&client, &one_host, &id, &mut history);
    let (fed, kept) = rebuild_counts(&metrics);
    assert!(kept >= 288.0, "the prompt's full pages were kept: {kept}");
    assert!(fed < 16.0, "less than a page fed again: {fed}");
    assert_eq!((fed + kept) % 16.0, fed % 16.0);

    // Pages that no longer verify (every page of the file damaged while
    // the shard was down) are computed again, and the answers stay exact.
    second.kill();
    let pages = std::path::Path::new(&second_dir).join("kv.pages");
    let mut bytes = std::fs::read(&pages).expect("page file");
    for at in (0..bytes.len()).step_by(4096) {
        bytes[at] ^= 0x5a;
    }
    std::fs::write(&pages, &bytes).expect("damage the page file");
    let _second = kept_shard("15..30", &second_listen, &second_dir);
    let before = rebuild_counts(&metrics);
    let length = history.len();
    next_turn_like_one_host(&client, &one_host, &id, &mut history);
    let (fed, kept) = rebuild_counts(&metrics);
    assert_eq!(kept, before.1, "nothing damaged was kept");
    assert!(
        fed - before.0 >= (length - 16) as f64,
        "the history was fed again: {} of {length}",
        fed - before.0
    );

    // The coordinator killed and started again on its state dir restores
    // the session from its journal; the shards kept its pages for the
    // coordinator's successor, so the restore feeds only the positions
    // after the last full page before the history's last token.
    coordinator.kill();
    let coordinator = serve(&coordinator_args);
    let metrics = coordinator.metrics.clone().expect("metrics address");
    let client = Client::connect(&coordinator.addr);
    let length = history.len();
    next_turn_like_one_host(&client, &one_host, &id, &mut history);
    let (fed, kept) = rebuild_counts(&metrics);
    let resumed = ((length - 1) / 16 * 16) as f64;
    assert_eq!(kept, resumed, "of {length}");
    assert_eq!(fed, 0.0, "a restore is no rebuild");
    // And the restore did not feed them.
    assert_eq!(
        sample(&scrape(&metrics), "inferd_restore_kept_tokens_total"),
        Some(resumed)
    );
    client.close(&id).expect("close");
}
