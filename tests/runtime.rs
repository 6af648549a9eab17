//! The runtime core on a synthetic model: the session contract (CONTRACT
//! §2.1-2.8) through the plain Rust API a transport will wrap.

use std::sync::Arc;
use std::time::{Duration, Instant};

use inferd::metrics::{render, MetricsEndpoint, ServerNumbers};
use inferd::runtime::{
    AppendTokens, CreateSession, EvictionPolicy, GenerateDone, GenerateEvent, GenerateRequest,
    OverflowPolicy, Runtime, RuntimeConfig, RuntimeError, RuntimeStats, SamplingOptions, SessionId,
    StatusKind, StopReason, Tenant,
};

mod support;
use support::tiny_model;

const CONTEXT: usize = 256;

fn config(workers: usize) -> RuntimeConfig {
    RuntimeConfig {
        workers,
        pin_cores: false,
        kv_bytes: 16 << 20,
        ..RuntimeConfig::default()
    }
}

fn start(cfg: RuntimeConfig) -> Runtime {
    Runtime::start(tiny_model(), cfg).expect("runtime starts")
}

fn create(rt: &Runtime, eos: &[u32]) -> SessionId {
    rt.create_session(
        &Tenant::NONE,
        CreateSession {
            client_label: "test".into(),
            eos_token_ids: eos.to_vec(),
        },
        None,
    )
    .expect("queued")
    .wait()
    .expect("created")
}

fn append(rt: &Runtime, id: SessionId, tokens: &[u32]) -> Result<u64, RuntimeError> {
    rt.append_tokens(
        &Tenant::NONE,
        AppendTokens {
            id,
            tokens: tokens.to_vec(),
        },
        None,
    )?
    .wait()
    .map(|r| r.history_length)
}

fn request(id: SessionId, max_tokens: u32, sampling: SamplingOptions) -> GenerateRequest {
    GenerateRequest {
        constraint: None,
        speculate: None,
        id,
        max_tokens,
        sampling,
        stop_sequences: Vec::new(),
    }
}

fn seeded() -> SamplingOptions {
    SamplingOptions {
        temperature: Some(50.0),
        min_p: Some(0.01),
        seed: Some(1234),
        ..SamplingOptions::default()
    }
}

/// Tokens and the terminal event of a finished stream.
fn split(events: Vec<GenerateEvent>) -> (Vec<u32>, GenerateEvent) {
    let mut tokens = Vec::new();
    let mut last = None;
    for e in events {
        match e {
            GenerateEvent::Token(t) => tokens.push(t),
            other => last = Some(other),
        }
    }
    (tokens, last.expect("a terminal event"))
}

fn generate(rt: &Runtime, id: SessionId, max: u32, s: SamplingOptions) -> (Vec<u32>, GenerateDone) {
    let events = rt
        .generate(&Tenant::NONE, request(id, max, s), None)
        .expect("queued")
        .collect();
    match split(events) {
        (tokens, GenerateEvent::Done(done)) => (tokens, done),
        (_, other) => panic!("generation failed: {other:?}"),
    }
}

fn info(rt: &Runtime, id: SessionId) -> Result<inferd::runtime::SessionInfo, RuntimeError> {
    rt.session_info(&Tenant::NONE, id, None)?.wait()
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt) % 300).collect()
}

/// A Generate whose stream is never read: it stalls once the stream is full
/// and keeps the session busy.
fn stalled(rt: &Runtime, id: SessionId) -> inferd::runtime::GenerateStream {
    stalled_at_most(rt, id, 200)
}

/// [`stalled`] with a token budget small enough not to truncate a long
/// history.
fn stalled_at_most(
    rt: &Runtime,
    id: SessionId,
    max_tokens: u32,
) -> inferd::runtime::GenerateStream {
    let s = rt
        .generate(
            &Tenant::NONE,
            request(id, max_tokens, SamplingOptions::default()),
            None,
        )
        .expect("queued");
    // The first token proves it left the queue; then the stream fills.
    assert!(matches!(s.recv(None), Some(GenerateEvent::Token(_))));
    std::thread::sleep(Duration::from_millis(20));
    s
}

#[test]
fn generated_tokens_are_committed_and_reported() {
    let rt = start(config(2));
    let id = create(&rt, &[]);
    assert_eq!(append(&rt, id, &[1, 2, 3]).expect("append"), 3);
    let (tokens, done) = generate(&rt, id, 5, SamplingOptions::default());
    assert_eq!(tokens.len(), 5);
    assert_eq!(done.stop_reason, StopReason::MaxTokens);
    assert_eq!(done.generated_token_count, 5);
    assert_eq!(done.history_length, 8);
    let i = info(&rt, id).expect("info");
    assert_eq!(i.history_length, 8);
    assert_eq!(
        i.kv_live_bytes,
        8 * rt.kv_pool().bytes_per_position() as u64
    );
    assert_eq!(i.client_label, "test");
    assert!(i.pages_held >= 1);
    assert_eq!((i.inv1_violations, i.inv2_violations), (0, 0));
    assert!(!i.busy);
}

#[test]
fn eos_is_emitted_committed_then_done() {
    let rt = start(config(1));
    let probe = create(&rt, &[]);
    append(&rt, probe, &[5, 6, 7]).expect("append");
    let first = generate(&rt, probe, 1, SamplingOptions::default()).0[0];
    let id = create(&rt, &[first]);
    append(&rt, id, &[5, 6, 7]).expect("append");
    let (tokens, done) = generate(&rt, id, 10, SamplingOptions::default());
    assert_eq!(tokens, vec![first]);
    assert_eq!(done.stop_reason, StopReason::Eos);
    assert_eq!(done.generated_token_count, 1);
    assert_eq!(info(&rt, id).expect("info").history_length, 4);
}

#[test]
fn a_stop_sequence_ends_the_generation_after_it_is_emitted() {
    let rt = start(config(1));
    let probe = create(&rt, &[]);
    append(&rt, probe, &[9, 8]).expect("append");
    let free = generate(&rt, probe, 8, seeded()).0;
    let stop = free[3..5].to_vec();
    let first_end = (2..=free.len())
        .find(|&k| free[..k].ends_with(&stop))
        .expect("the sequence occurs");
    let id = create(&rt, &[]);
    append(&rt, id, &[9, 8]).expect("append");
    let mut req = request(id, 8, seeded());
    req.stop_sequences = vec![vec![319, 319, 319], stop];
    let (tokens, done) = split(
        rt.generate(&Tenant::NONE, req, None)
            .expect("queued")
            .collect(),
    );
    assert_eq!(tokens, free[..first_end].to_vec());
    match done {
        GenerateEvent::Done(d) => assert!(matches!(d.stop_reason, StopReason::StopSequence { .. })),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        info(&rt, id).expect("info").history_length,
        2 + first_end as u64
    );
}

#[test]
fn bad_arguments_are_invalid_and_change_nothing() {
    let rt = start(config(1));
    let id = create(&rt, &[]);
    let empty = split(
        rt.generate(
            &Tenant::NONE,
            request(id, 4, SamplingOptions::default()),
            None,
        )
        .expect("q")
        .collect(),
    );
    assert!(
        matches!(
            empty.1,
            GenerateEvent::Error(RuntimeError::InvalidArgument(_))
        ),
        "{empty:?}"
    );
    append(&rt, id, &[1, 2]).expect("append");
    let err = append(&rt, id, &[3, 320, 4]).expect_err("out of vocabulary");
    assert_eq!(err.code(), StatusKind::InvalidArgument);
    assert!(err.to_string().contains("320"), "{err}");
    assert_eq!(info(&rt, id).expect("info").history_length, 2);
    let bad = [
        (0, SamplingOptions::default()),
        (
            4,
            SamplingOptions {
                temperature: Some(-1.0),
                ..Default::default()
            },
        ),
        (
            4,
            SamplingOptions {
                temperature: Some(f32::NAN),
                ..Default::default()
            },
        ),
        (
            4,
            SamplingOptions {
                top_p: Some(0.0),
                ..Default::default()
            },
        ),
        (
            4,
            SamplingOptions {
                top_p: Some(1.5),
                ..Default::default()
            },
        ),
    ];
    // Refused at the runtime's boundary, before any worker sees them, and
    // for an id no session has just the same.
    for (max, sampling) in bad {
        for target in [id, SessionId::NEVER_ISSUED] {
            let Err(err) = rt.generate(&Tenant::NONE, request(target, max, sampling.clone()), None)
            else {
                panic!("{sampling:?} was accepted");
            };
            assert_eq!(err.code(), StatusKind::InvalidArgument, "{sampling:?}");
        }
    }
    assert_eq!(info(&rt, id).expect("info").history_length, 2);
}

#[test]
fn unknown_closed_and_twice_closed_ids_are_not_found() {
    let rt = start(config(2));
    let unknown = SessionId::random().expect("id");
    assert_eq!(
        info(&rt, unknown).expect_err("unknown"),
        RuntimeError::NotFound
    );
    assert_eq!(
        append(&rt, unknown, &[1]).expect_err("unknown"),
        RuntimeError::NotFound
    );
    // What the gRPC layer makes of an id of any other form: a valid request
    // on it is NOT_FOUND, like an unknown id.
    assert_eq!(
        append(&rt, SessionId::NEVER_ISSUED, &[1]).expect_err("never issued"),
        RuntimeError::NotFound
    );
    let (tokens, end) = split(
        rt.generate(
            &Tenant::NONE,
            request(SessionId::NEVER_ISSUED, 4, SamplingOptions::default()),
            None,
        )
        .expect("queued")
        .collect(),
    );
    assert!(tokens.is_empty());
    assert!(
        matches!(end, GenerateEvent::Error(RuntimeError::NotFound)),
        "{end:?}"
    );
    let id = create(&rt, &[]);
    append(&rt, id, &[1, 2, 3]).expect("append");
    let closed = rt
        .close_session(&Tenant::NONE, id, None)
        .expect("q")
        .wait()
        .expect("closed");
    assert_eq!(closed.final_history_length, 3);
    let again = rt.close_session(&Tenant::NONE, id, None).expect("q").wait();
    assert_eq!(again.expect_err("second close"), RuntimeError::NotFound);
    assert_eq!(info(&rt, id).expect_err("closed"), RuntimeError::NotFound);
    let stats = rt.stats();
    assert_eq!(stats.evicted_close, 1);
    assert_eq!(stats.kv_free_pages, stats.kv_total_pages);
    assert_eq!(stats.sessions_active, 0);
}

#[test]
fn an_unset_seed_is_drawn_reported_and_reproduces() {
    let rt = start(config(1));
    let sampling = SamplingOptions {
        seed: None,
        ..seeded()
    };
    let a = create(&rt, &[]);
    append(&rt, a, &[4, 5, 6]).expect("append");
    let (tokens, done) = generate(&rt, a, 8, sampling);
    let b = create(&rt, &[]);
    append(&rt, b, &[4, 5, 6]).expect("append");
    let again = SamplingOptions {
        seed: Some(done.seed_used),
        ..seeded()
    };
    assert_eq!(generate(&rt, b, 8, again).0, tokens);
    let c = create(&rt, &[]);
    append(&rt, c, &[4, 5, 6]).expect("append");
    let other = generate(
        &rt,
        c,
        8,
        SamplingOptions {
            seed: None,
            ..seeded()
        },
    )
    .1;
    assert_ne!(other.seed_used, done.seed_used);
}

/// Tokens and final-logits digest of one session's history and generation.
fn reference_run(rt: &Runtime, appends: &[&[u32]], neighbours: usize) -> (Vec<u32>, u64) {
    // Neighbours decode while the session under test runs: each stream is
    // read slowly on its own thread, so it neither stalls on a full stream
    // nor finishes before the session under test has been batched with it.
    let others: Vec<_> = (0..neighbours)
        .map(|k| {
            let id = create(rt, &[]);
            append(rt, id, &prompt(20 + k * 7, k as u32)).expect("append");
            let stream = rt
                .generate(&Tenant::NONE, request(id, 100, seeded()), None)
                .expect("queued");
            std::thread::spawn(move || loop {
                match stream.recv(None) {
                    Some(GenerateEvent::Token(_)) => std::thread::sleep(Duration::from_millis(2)),
                    other => return other,
                }
            })
        })
        .collect();
    let id = create(rt, &[]);
    for a in appends {
        append(rt, id, a).expect("append");
    }
    let (tokens, _) = generate(rt, id, 24, seeded());
    for o in others {
        let end = o.join().expect("reader thread");
        assert!(matches!(end, Some(GenerateEvent::Done(_))), "{end:?}");
    }
    (tokens, info(rt, id).expect("info").logits_digest)
}

#[test]
fn tokens_do_not_depend_on_batching_chunking_worker_count_or_core_lending() {
    let p = prompt(90, 3);
    let reference = reference_run(&start(config(1)), &[&p], 0);
    assert_eq!(reference.0.len(), 24);
    let batched_rt = start(config(1));
    assert_eq!(reference_run(&batched_rt, &[&p], 3), reference);
    assert!(
        batched_rt.stats().workers[0].max_batch_sequences > 1,
        "sessions were batched together"
    );
    // Several workers lend each other their cores by default; not lending
    // must give the same bits.
    assert!(config(3).lend_cores);
    assert_eq!(reference_run(&start(config(3)), &[&p], 4), reference);
    let alone = RuntimeConfig {
        lend_cores: false,
        ..config(3)
    };
    assert_eq!(reference_run(&start(alone), &[&p], 4), reference);
    let small_chunks = RuntimeConfig {
        prefill_chunk: 5,
        ..config(2)
    };
    let pieces: Vec<&[u32]> = p.chunks(7).collect();
    assert_eq!(reference_run(&start(small_chunks), &pieces, 2), reference);
}

#[test]
fn a_reader_that_does_not_read_does_not_stall_another_session() {
    let rt = start(RuntimeConfig {
        stream_capacity: 4,
        ..config(1)
    });
    let slow = create(&rt, &[]);
    append(&rt, slow, &[1, 2, 3]).expect("append");
    let unread = rt
        .generate(
            &Tenant::NONE,
            request(slow, 50, SamplingOptions::default()),
            None,
        )
        .expect("q");
    std::thread::sleep(Duration::from_millis(50));
    let fast = create(&rt, &[]);
    append(&rt, fast, &[4, 5, 6]).expect("append");
    let t0 = Instant::now();
    let (tokens, done) = generate(&rt, fast, 30, SamplingOptions::default());
    assert_eq!(
        (tokens.len(), done.stop_reason),
        (30, StopReason::MaxTokens)
    );
    assert!(t0.elapsed() < Duration::from_secs(20));
    assert!(info(&rt, slow).expect("info").history_length <= 3 + 4);
    let (tokens, end) = split(unread.collect());
    assert_eq!(tokens.len(), 50);
    assert!(matches!(
        end,
        GenerateEvent::Done(GenerateDone {
            stop_reason: StopReason::MaxTokens,
            ..
        })
    ));
}

#[test]
fn cancellation_stops_within_a_step_and_keeps_the_session_usable() {
    let rt = start(RuntimeConfig {
        stream_capacity: 4,
        ..config(1)
    });
    let id = create(&rt, &[]);
    append(&rt, id, &[1, 2, 3]).expect("append");
    let stream = rt
        .generate(
            &Tenant::NONE,
            request(id, 200, SamplingOptions::default()),
            None,
        )
        .expect("q");
    for _ in 0..2 {
        assert!(matches!(stream.recv(None), Some(GenerateEvent::Token(_))));
    }
    stream.cancel();
    let mut after = 0;
    let end = loop {
        match stream.recv(None).expect("terminal event") {
            GenerateEvent::Token(_) => after += 1,
            other => break other,
        }
    };
    let done = match end {
        GenerateEvent::Done(d) => d,
        other => panic!("{other:?}"),
    };
    assert_eq!(done.stop_reason, StopReason::Cancelled);
    // Buffered tokens plus at most the one step that was in flight.
    assert!(after <= 4 + 1, "{after} tokens after cancel");
    assert_eq!(done.generated_token_count as usize, 2 + after);
    assert_eq!(
        info(&rt, id).expect("info").history_length,
        3 + 2 + after as u64
    );
    // Dropping the stream cancels too.
    let dropped = rt
        .generate(
            &Tenant::NONE,
            request(id, 200, SamplingOptions::default()),
            None,
        )
        .expect("q");
    assert!(matches!(dropped.recv(None), Some(GenerateEvent::Token(_))));
    drop(dropped);
    std::thread::sleep(Duration::from_millis(50));
    let len = info(&rt, id).expect("info").history_length;
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(info(&rt, id).expect("info").history_length, len);
    let (tokens, _) = generate(&rt, id, 3, SamplingOptions::default());
    assert_eq!(tokens.len(), 3);
    assert_eq!(info(&rt, id).expect("info").history_length, len + 3);
}

#[test]
fn operations_on_one_session_run_in_arrival_order() {
    let rt = start(config(1));
    let id = create(&rt, &[]);
    append(&rt, id, &[1, 2, 3]).expect("append");
    let a1 = rt
        .append_tokens(
            &Tenant::NONE,
            AppendTokens {
                id,
                tokens: vec![10],
            },
            None,
        )
        .expect("q");
    let g = rt
        .generate(
            &Tenant::NONE,
            request(id, 5, SamplingOptions::default()),
            None,
        )
        .expect("q");
    let a2 = rt
        .append_tokens(
            &Tenant::NONE,
            AppendTokens {
                id,
                tokens: vec![11, 12],
            },
            None,
        )
        .expect("q");
    let closed = rt.close_session(&Tenant::NONE, id, None).expect("q");
    assert_eq!(a1.wait().expect("a1").history_length, 4);
    let (tokens, done) = split(g.collect());
    assert_eq!(tokens.len(), 5);
    assert!(matches!(
        done,
        GenerateEvent::Done(GenerateDone {
            history_length: 9,
            ..
        })
    ));
    assert_eq!(a2.wait().expect("a2").history_length, 11);
    assert_eq!(closed.wait().expect("close").final_history_length, 11);
}

#[test]
fn a_full_session_queue_is_resource_exhausted() {
    let rt = start(RuntimeConfig {
        session_queue: 1,
        stream_capacity: 4,
        ..config(1)
    });
    let id = create(&rt, &[]);
    append(&rt, id, &[1, 2, 3]).expect("append");
    let _busy = stalled(&rt, id);
    let _waiting = rt
        .append_tokens(
            &Tenant::NONE,
            AppendTokens {
                id,
                tokens: vec![7],
            },
            None,
        )
        .expect("q");
    let err = append(&rt, id, &[8]).expect_err("queue full");
    assert_eq!(err.code(), StatusKind::ResourceExhausted);
    assert_eq!(
        err.to_string(),
        "session wait queue exhausted: 2 asked, 0 free"
    );
}

#[test]
fn deadlines_end_waiting_and_running_calls() {
    let rt = start(RuntimeConfig {
        stream_capacity: 4,
        ..config(1)
    });
    let id = create(&rt, &[]);
    append(&rt, id, &[1, 2, 3]).expect("append");
    let busy = rt
        .generate(
            &Tenant::NONE,
            request(id, 200, SamplingOptions::default()),
            Some(Instant::now() + Duration::from_millis(300)),
        )
        .expect("q");
    let waiting = rt
        .append_tokens(
            &Tenant::NONE,
            AppendTokens {
                id,
                tokens: vec![9],
            },
            Some(Instant::now() + Duration::from_millis(50)),
        )
        .expect("q");
    assert_eq!(
        waiting.wait().expect_err("deadline"),
        RuntimeError::DeadlineExceeded
    );
    std::thread::sleep(Duration::from_millis(350));
    let (tokens, end) = split(busy.collect());
    assert_eq!(end, GenerateEvent::Error(RuntimeError::DeadlineExceeded));
    let len = info(&rt, id).expect("info").history_length;
    assert_eq!(
        len,
        3 + tokens.len() as u64,
        "the late append never ran; emitted tokens stay"
    );
}

#[test]
fn idle_sessions_expire_after_the_ttl() {
    let rt = start(RuntimeConfig {
        idle_ttl: Duration::from_millis(60),
        ..config(1)
    });
    let id = create(&rt, &[]);
    append(&rt, id, &[1, 2, 3]).expect("append");
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(info(&rt, id).expect_err("expired"), RuntimeError::NotFound);
    let stats = rt.stats();
    assert_eq!((stats.evicted_ttl, stats.evicted_lru), (1, 0));
    assert_eq!(stats.kv_free_pages, stats.kv_total_pages);
}

#[test]
fn the_session_limit_evicts_the_least_recently_used_idle_session() {
    let rt = start(RuntimeConfig {
        max_sessions: 2,
        stream_capacity: 4,
        ..config(1)
    });
    let a = create(&rt, &[]);
    let b = create(&rt, &[]);
    append(&rt, a, &[1]).expect("append");
    append(&rt, b, &[2]).expect("append");
    append(&rt, a, &[3]).expect("touch a");
    let c = create(&rt, &[]);
    assert_eq!(info(&rt, b).expect_err("evicted"), RuntimeError::NotFound);
    assert_eq!(info(&rt, a).expect("a stays").history_length, 2);
    assert_eq!(rt.stats().evicted_lru, 1);
    // Busy sessions are never evicted.
    append(&rt, c, &[4, 5]).expect("append");
    append(&rt, a, &[6]).expect("append");
    let _ga = stalled(&rt, a);
    let _gc = stalled(&rt, c);
    let err = rt
        .create_session(&Tenant::NONE, CreateSession::default(), None)
        .expect("q")
        .wait()
        .expect_err("all busy");
    assert_eq!(err.to_string(), "sessions exhausted: 1 asked, 0 free");
    assert_eq!(rt.stats().evicted_lru, 1);
}

#[test]
fn kv_exhaustion_evicts_idle_sessions_only_when_that_makes_room() {
    // Tiny model: 2 layers x (K, V) x 32 values x 2 bytes = 256 bytes per
    // position; a page holds one layer's 16 positions (2048 bytes), so 8
    // pages = 64 positions.
    let rt = start(RuntimeConfig {
        kv_bytes: 4 * 4096,
        ..config(1)
    });
    assert_eq!(rt.stats().kv_total_pages, 8);
    let a = create(&rt, &[]);
    append(&rt, a, &prompt(40, 1)).expect("3 pages");
    let b = create(&rt, &[]);
    let err = append(&rt, b, &prompt(100, 2)).expect_err("too big");
    assert_eq!(err.to_string(), "KV pages exhausted: 14 asked, 2 free");
    assert_eq!(info(&rt, b).expect("b").history_length, 0);
    // Evicting `a` would not have made it fit: nothing was evicted.
    assert_eq!(info(&rt, a).expect("a stays").history_length, 40);
    assert_eq!(rt.stats().evicted_lru, 0);
    let b2 = create(&rt, &[]);
    append(&rt, b2, &prompt(40, 3)).expect("3 pages, a evicted");
    assert_eq!(info(&rt, a).expect_err("evicted"), RuntimeError::NotFound);
    append(&rt, b, &prompt(30, 4)).expect("evicts b2");
    assert_eq!(info(&rt, b2).expect_err("evicted"), RuntimeError::NotFound);
    assert_eq!(rt.stats().evicted_lru, 2);
}

#[test]
fn overflow_truncates_to_sink_plus_recent_once_the_context_fills() {
    let rt = start(RuntimeConfig {
        overflow: OverflowPolicy::Truncate { sink: 4 },
        ..config(1)
    });
    let history = prompt(250, 5);
    let id = create(&rt, &[]);
    append(&rt, id, &history).expect("append");
    let events = rt
        .generate(
            &Tenant::NONE,
            request(id, 20, SamplingOptions::default()),
            None,
        )
        .expect("q")
        .collect();
    // Six tokens fill the context; then the 14 still wanted are made room
    // for, and said so, between tokens.
    assert!(events[..6]
        .iter()
        .all(|e| matches!(e, GenerateEvent::Token(_))));
    assert_eq!(
        events[6],
        GenerateEvent::Truncated {
            dropped_token_count: 14
        }
    );
    let (tokens, _) = split(events);
    assert_eq!(tokens.len(), 20);
    assert_eq!(info(&rt, id).expect("info").history_length, CONTEXT as u64);
    // Same tokens as a session that was given the kept tokens directly.
    let mut full = history.clone();
    full.extend_from_slice(&tokens[..6]);
    let mut kept = full[..4].to_vec();
    kept.extend_from_slice(&full[256 - 238..]);
    let direct = create(&rt, &[]);
    append(&rt, direct, &kept).expect("append");
    assert_eq!(
        generate(&rt, direct, 14, SamplingOptions::default()).0,
        tokens[6..]
    );
    // An append past the context truncates too and says how much.
    let r = rt
        .append_tokens(
            &Tenant::NONE,
            AppendTokens {
                id: direct,
                tokens: prompt(10, 6),
            },
            None,
        )
        .expect("q")
        .wait()
        .expect("append");
    assert_eq!(
        (r.history_length, r.dropped_token_count),
        (CONTEXT as u64, 256 + 10 - 256)
    );
}

#[test]
fn the_stop_policy_ends_with_truncated() {
    let rt = start(RuntimeConfig {
        overflow: OverflowPolicy::Stop,
        ..config(1)
    });
    let id = create(&rt, &[]);
    append(&rt, id, &prompt(250, 5)).expect("append");
    let (tokens, done) = generate(&rt, id, 20, SamplingOptions::default());
    assert_eq!((tokens.len(), done.stop_reason), (6, StopReason::Truncated));
    let err = append(&rt, id, &[1]).expect_err("full");
    assert_eq!(err.code(), StatusKind::InvalidArgument);
    assert_eq!(info(&rt, id).expect("info").history_length, 256);
}

#[test]
fn pinned_workers_serve_and_count() {
    let rt = start(RuntimeConfig {
        pin_cores: true,
        ..config(2)
    });
    let ids: Vec<_> = (0..4).map(|_| create(&rt, &[])).collect();
    for &id in &ids {
        append(&rt, id, &[1, 2]).expect("append");
        generate(&rt, id, 3, SamplingOptions::default());
    }
    let stats = rt.stats();
    assert_eq!(stats.sessions_active, 4);
    assert_eq!(stats.sessions_created, 4);
    assert_eq!(stats.tokens_generated, 12);
    assert_eq!(stats.prefill_tokens, 8);
    assert_eq!(stats.workers.iter().map(|w| w.sessions).sum::<u64>(), 4);
    assert_eq!(
        stats
            .workers
            .iter()
            .map(|w| w.tokens_generated)
            .sum::<u64>(),
        12
    );
    assert!(stats.workers.iter().all(|w| w.sessions == 2), "{stats:?}");
}

#[test]
fn a_draining_runtime_is_unavailable() {
    let rt = start(config(1));
    let id = create(&rt, &[]);
    rt.drain();
    assert_eq!(
        append(&rt, id, &[1]).expect_err("draining"),
        RuntimeError::Unavailable
    );
    rt.shutdown();
}

/// Tiny model: 256 bytes per position, 4096 per 16 positions over both
/// layers (two pages of one layer each).
const PAGE_BYTES: u64 = 4096;

/// Waits (at most 5 s) for the gauges, which workers publish at the end of
/// each turn, to satisfy `ok`.
fn eventually(rt: &Runtime, ok: impl Fn(&RuntimeStats) -> bool) -> RuntimeStats {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let stats = rt.stats();
        if ok(&stats) || Instant::now() > until {
            return stats;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_truncating_append_that_cannot_get_pages_changes_nothing() {
    let rt = start(RuntimeConfig {
        kv_bytes: 20 * PAGE_BYTES,
        stream_capacity: 4,
        ..config(1)
    });
    // A busy neighbour holds 7 pages (96 prompt tokens plus a few generated).
    let busy = create(&rt, &[]);
    append(&rt, busy, &prompt(96, 7)).expect("6 pages");
    let _stalled = stalled_at_most(&rt, busy, 20);
    let id = create(&rt, &[]);
    append(&rt, id, &prompt(200, 3)).expect("13 pages");
    assert_eq!(rt.stats().kv_free_pages, 0);
    let before = info(&rt, id).expect("info");
    // Past the context: the kept window needs 16 fresh pages.
    let err = append(&rt, id, &prompt(100, 9)).expect_err("no pages");
    assert_eq!(err.code(), StatusKind::ResourceExhausted);
    assert_eq!(err.to_string(), "KV pages exhausted: 32 asked, 0 free");
    let after = info(&rt, id).expect("the session survives");
    let kept = |i: &inferd::runtime::SessionInfo| {
        (
            i.history_length,
            i.kv_live_bytes,
            i.pages_held,
            i.logits_digest,
        )
    };
    assert_eq!(
        kept(&after),
        kept(&before),
        "history and KV exactly as before"
    );
    assert_eq!(after.history_length, 200);
    assert_eq!(rt.stats().kv_free_pages, 0);
    assert_eq!(rt.stats().evicted_lru, 0);
    // And it still works from where it was.
    let (tokens, done) = generate(&rt, id, 3, SamplingOptions::default());
    assert_eq!((tokens.len(), done.history_length), (3, 203));
}

#[test]
fn a_truncating_generate_under_pressure_reuses_the_sessions_own_pages() {
    let rt = start(RuntimeConfig {
        kv_bytes: 23 * PAGE_BYTES,
        stream_capacity: 4,
        ..config(1)
    });
    let busy = create(&rt, &[]);
    append(&rt, busy, &prompt(96, 7)).expect("6 pages");
    let _stalled = stalled_at_most(&rt, busy, 20);
    let id = create(&rt, &[]);
    append(&rt, id, &prompt(250, 5)).expect("16 pages");
    assert_eq!(rt.stats().kv_free_pages, 0);
    // When the context fills (after 6 tokens) the kept window (16 pages)
    // fits only in the session's own pages.
    let events = rt
        .generate(
            &Tenant::NONE,
            request(id, 20, SamplingOptions::default()),
            None,
        )
        .expect("q")
        .collect();
    assert_eq!(
        events[6],
        GenerateEvent::Truncated {
            dropped_token_count: 14
        }
    );
    let (tokens, end) = split(events);
    assert!(matches!(end, GenerateEvent::Done(_)), "{end:?}");
    assert_eq!(tokens.len(), 20);
    assert_eq!(info(&rt, id).expect("info").history_length, CONTEXT as u64);
}

/// Two sessions on different workers, in the order (worker 0, worker 1).
fn one_per_worker(rt: &Runtime) -> (SessionId, SessionId) {
    let a = create(rt, &[]);
    let b = create(rt, &[]);
    assert_ne!(
        a.worker_index(2),
        b.worker_index(2),
        "placed on the least loaded worker"
    );
    if a.worker_index(2) == 0 {
        (a, b)
    } else {
        (b, a)
    }
}

#[test]
fn an_idle_session_on_another_worker_is_evicted_for_pages() {
    let rt = start(RuntimeConfig {
        kv_bytes: 4 * PAGE_BYTES,
        ..config(2)
    });
    let (a, b) = one_per_worker(&rt);
    append(&rt, a, &prompt(40, 1)).expect("3 pages");
    append(&rt, b, &prompt(40, 2)).expect("evicts a on the other worker");
    assert_eq!(info(&rt, a).expect_err("evicted"), RuntimeError::NotFound);
    assert_eq!(info(&rt, b).expect("b").history_length, 40);
    let stats = rt.stats();
    assert_eq!((stats.evicted_lru, stats.sessions_active), (1, 1));
    // The other way round as well.
    let c = create(&rt, &[]);
    assert_ne!(c.worker_index(2), b.worker_index(2));
    append(&rt, c, &prompt(40, 3)).expect("evicts b");
    assert_eq!(info(&rt, b).expect_err("evicted"), RuntimeError::NotFound);
    assert_eq!(rt.stats().evicted_lru, 2);
}

#[test]
fn a_busy_session_on_another_worker_is_never_evicted() {
    let rt = start(RuntimeConfig {
        kv_bytes: 4 * PAGE_BYTES,
        stream_capacity: 4,
        ..config(2)
    });
    let (a, b) = one_per_worker(&rt);
    append(&rt, a, &prompt(40, 1)).expect("3 pages");
    let _busy = stalled(&rt, a);
    let err = append(&rt, b, &prompt(40, 2)).expect_err("nothing idle");
    assert_eq!(err.to_string(), "KV pages exhausted: 6 asked, 2 free");
    assert!(info(&rt, a).expect("a stays").busy);
    assert_eq!(info(&rt, b).expect("b stays").history_length, 0);
    assert_eq!(rt.stats().evicted_lru, 0);
}

#[test]
fn the_session_limit_evicts_an_idle_session_of_another_worker() {
    let rt = start(RuntimeConfig {
        max_sessions: 2,
        stream_capacity: 4,
        ..config(2)
    });
    let (idle, busy) = one_per_worker(&rt);
    append(&rt, idle, &[1]).expect("append");
    append(&rt, busy, &[2]).expect("append");
    let _busy = stalled(&rt, busy);
    let c = create(&rt, &[]);
    assert_eq!(
        info(&rt, idle).expect_err("evicted"),
        RuntimeError::NotFound
    );
    assert!(info(&rt, busy).expect("busy stays").busy);
    assert_eq!(info(&rt, c).expect("c").history_length, 0);
    assert_eq!(rt.stats().evicted_lru, 1);
}

#[test]
fn a_create_whose_deadline_passed_creates_nothing() {
    let rt = start(config(1));
    let late = rt
        .create_session(
            &Tenant::NONE,
            CreateSession::default(),
            Some(Instant::now()),
        )
        .expect("queued");
    assert_eq!(
        late.wait().expect_err("late"),
        RuntimeError::DeadlineExceeded
    );
    // Commands to one worker run in order: once this one is answered, the
    // late one has been dealt with.
    create(&rt, &[]);
    let stats = rt.stats();
    assert_eq!((stats.sessions_created, stats.sessions_active), (1, 1));
}

#[test]
fn the_none_eviction_policy_never_evicts() {
    let rt = start(RuntimeConfig {
        kv_bytes: 4 * PAGE_BYTES,
        max_sessions: 2,
        eviction: EvictionPolicy::None,
        ..config(1)
    });
    let a = create(&rt, &[]);
    append(&rt, a, &prompt(40, 1)).expect("3 pages");
    let b = create(&rt, &[]);
    let err = append(&rt, b, &prompt(40, 2)).expect_err("pool full");
    assert_eq!(err.code(), StatusKind::ResourceExhausted);
    assert_eq!(err.to_string(), "KV pages exhausted: 6 asked, 2 free");
    let err = rt
        .create_session(&Tenant::NONE, CreateSession::default(), None)
        .expect("q")
        .wait()
        .expect_err("limit");
    assert_eq!(err.to_string(), "sessions exhausted: 1 asked, 0 free");
    assert_eq!(info(&rt, a).expect("a stays").history_length, 40);
    assert_eq!(rt.stats().evicted_lru, 0);
}

#[test]
fn stats_count_sessions_tokens_prefill_and_queues() {
    let rt = start(RuntimeConfig {
        stream_capacity: 4,
        ..config(1)
    });
    let a = create(&rt, &[]);
    append(&rt, a, &prompt(10, 1)).expect("append");
    generate(&rt, a, 5, SamplingOptions::default());
    let b = create(&rt, &[]);
    append(&rt, b, &[1, 2]).expect("append");
    rt.close_session(&Tenant::NONE, b, None)
        .expect("q")
        .wait()
        .expect("closed");
    let bytes = rt.kv_pool().bytes_per_position() as u64;
    let stats = eventually(&rt, |s| s.history_tokens == 15);
    assert_eq!(stats.sessions_created, 2);
    assert_eq!(stats.sessions_active, 1);
    assert_eq!(stats.evicted_close, 1);
    assert_eq!(stats.sessions_failed, 0);
    assert_eq!(stats.history_tokens, 15);
    assert_eq!(stats.kv_live_bytes, 15 * bytes);
    assert_eq!(stats.prefill_tokens, 12);
    assert_eq!(stats.prefill_duration.count, 2);
    assert_eq!(stats.prefill_duration.counts.iter().sum::<u64>(), 2);
    assert!(stats.prefill_duration.sum_seconds > 0.0);
    assert_eq!(stats.tokens_generated, 5);
    assert_eq!(stats.workers[0].tokens_generated, 5);
    assert!(stats.workers[0].steps >= 5);
    // A busy session with an append waiting behind it: one queued op.
    let _busy = stalled(&rt, a);
    let _waiting = rt
        .append_tokens(
            &Tenant::NONE,
            AppendTokens {
                id: a,
                tokens: vec![3],
            },
            None,
        )
        .expect("q");
    let stats = eventually(&rt, |s| s.workers[0].queued_ops == 1);
    assert_eq!(stats.workers[0].queued_ops, 1);
    assert!(stats.workers[0].queue_depth >= 1);
    // Decode rate counts whole seconds, so look once one has passed.
    std::thread::sleep(Duration::from_millis(1100));
    let rate = rt.stats().workers[0].decode_tokens_per_second;
    assert!(rate > 0.0, "{rate}");
}

/// The value of the sample line starting with `prefix` (name and labels).
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn metrics_move_with_real_traffic_and_are_served_over_http() {
    let rt = Arc::new(start(config(2)));
    let scrape = {
        let rt = Arc::clone(&rt);
        move || render(&rt.stats(), &ServerNumbers::default())
    };
    let created = r#"inferd_session_total{outcome="created"}"#;
    assert_eq!(sample(&scrape(), created), Some(0.0));
    assert_eq!(sample(&scrape(), "inferd_generate_tokens_total"), Some(0.0));
    let id = create(&rt, &[]);
    append(&rt, id, &[1, 2, 3]).expect("append");
    generate(&rt, id, 4, SamplingOptions::default());
    let endpoint = MetricsEndpoint::bind("127.0.0.1:0", Arc::new(scrape), None).expect("binds");
    let body = {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(endpoint.addr()).expect("connects");
        write!(stream, "GET /metrics HTTP/1.0\r\n\r\n").expect("sends");
        let mut reply = String::new();
        stream.read_to_string(&mut reply).expect("reads");
        reply
    };
    assert!(body.contains(" 200 "), "{body}");
    assert_eq!(sample(&body, created), Some(1.0));
    assert_eq!(sample(&body, "inferd_generate_tokens_total"), Some(4.0));
    assert_eq!(
        sample(&body, "inferd_generate_prefill_tokens_total"),
        Some(3.0)
    );
    assert_eq!(
        sample(&body, "inferd_generate_prefill_duration_seconds_count"),
        Some(1.0)
    );
    assert_eq!(sample(&body, "inferd_session_active"), Some(1.0));
}

#[test]
fn with_a_state_directory_an_evicted_session_is_spilled_and_its_next_call_brings_it_back() {
    use inferd::durable::{Durability, SessionStore};
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SessionStore::open(dir.path(), [1; 32], Durability::None).expect("store");
    let rt = start(RuntimeConfig {
        kv_bytes: 4 * PAGE_BYTES,
        state: Some(Arc::new(store)),
        ..config(1)
    });
    let a = create(&rt, &[]);
    append(&rt, a, &prompt(40, 1)).expect("3 pages");
    let before = info(&rt, a).expect("info");
    let b = create(&rt, &[]);
    append(&rt, b, &prompt(40, 2)).expect("room made by spilling a");
    let stats = rt.stats();
    assert_eq!(
        (stats.evicted_lru, stats.sessions_spilled, stats.spilled_now),
        (0, 1, 1)
    );
    assert_eq!(stats.sessions_active, 1, "a spilled session holds no place");
    // Still there: its history and digest, no pages.
    let spilled = info(&rt, a).expect("spilled, not gone");
    assert_eq!(
        (
            spilled.history_length,
            spilled.pages_held,
            spilled.logits_digest
        ),
        (40, 0, before.logits_digest)
    );
    // Its next call feeds its history again (spilling b) and goes on.
    append(&rt, a, &prompt(5, 3)).expect("back");
    let mut history = prompt(40, 1);
    history.extend(prompt(5, 3));
    let cold = {
        let rt = start(config(1));
        let id = create(&rt, &[]);
        append(&rt, id, &history).expect("append");
        info(&rt, id).expect("info").logits_digest
    };
    let back = info(&rt, a).expect("info");
    assert_eq!((back.history_length, back.logits_digest), (45, cold));
    assert_eq!(info(&rt, b).expect("b spilled").pages_held, 0);
    let stats = rt.stats();
    assert_eq!((stats.sessions_spilled, stats.spilled_now), (2, 1));
    // Closing a spilled session ends it as any other.
    rt.close_session(&Tenant::NONE, b, None)
        .and_then(|p| p.wait())
        .expect("close");
    assert_eq!(info(&rt, b).expect_err("closed"), RuntimeError::NotFound);
    assert_eq!(rt.stats().spilled_now, 0);
}

#[test]
fn a_spilled_session_maps_the_shared_pages_another_session_holds_when_it_comes_back() {
    use inferd::durable::{Durability, SessionStore};
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SessionStore::open(dir.path(), [1; 32], Durability::None).expect("store");
    let rt = start(RuntimeConfig {
        kv_bytes: 6 * PAGE_BYTES,
        state: Some(Arc::new(store)),
        ..config(1)
    });
    let shared = prompt(48, 1); // three full pages
    let a = create(&rt, &[]);
    append(&rt, a, &[shared.clone(), vec![7]].concat()).expect("4 pages");
    let b = create(&rt, &[]);
    append(&rt, b, &[shared.clone(), vec![8]].concat()).expect("maps 3, holds 1");
    append(&rt, b, &[9]).expect("b used after a");
    assert_eq!(rt.stats().prefix_reused_tokens, 48);
    let c = create(&rt, &[]);
    append(&rt, c, &prompt(20, 5)).expect("room made by spilling a");
    assert_eq!(info(&rt, a).expect("spilled").pages_held, 0);
    // a's next call maps the three pages b still holds and feeds one token.
    append(&rt, a, &[10]).expect("a back");
    assert_eq!(rt.stats().prefix_reused_tokens, 96);
    let cold = {
        let rt = start(config(1));
        let id = create(&rt, &[]);
        append(&rt, id, &[shared.clone(), vec![7, 10]].concat()).expect("append");
        info(&rt, id).expect("info").logits_digest
    };
    let back = info(&rt, a).expect("info");
    assert_eq!((back.history_length, back.logits_digest), (50, cold));
}
