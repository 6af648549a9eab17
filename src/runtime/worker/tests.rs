//! The worker's own tests: one worker driven by hand, no threads, its
//! sessions looked at directly after each call.

use super::super::notify;
use super::super::session::digest;
use super::super::{CreateSession, GenerateRequest};
use super::*;
use crate::gguf::synthetic::SyntheticLlama;
use crate::gguf::GgufFile;
use crate::kv::KvPoolConfig;
use crate::runtime::Layers;

fn worker() -> Worker {
    worker_with_pages(8)
}

/// A worker whose pool holds `pages` pages of 16 positions over every
/// layer.
fn worker_with_pages(pages: usize) -> Worker {
    let file = GgufFile::from_bytes(SyntheticLlama::tiny().build()).expect("parses");
    let model = Arc::new(Model::from_gguf(Arc::new(file)).expect("loads"));
    let layout = model.kv_layout(model.config.n_layers, 16);
    let config = KvPoolConfig::anonymous(layout, pages * model.config.n_layers);
    let pool = Arc::new(KvPool::new(config).expect("pool"));
    let (wake, _) = crossbeam_channel::bounded(1);
    let runner = crate::runtime::LocalLayers
        .runner(0, &model, &RuntimeConfig::default())
        .expect("runner");
    Worker::new(
        0,
        model,
        runner,
        pool,
        RuntimeConfig::default(),
        Arc::new(WorkersState::new(vec![wake], false)),
        Arc::new(WorkerGauges::default()),
    )
    .expect("worker")
}

fn new_session(w: &mut Worker) -> SessionId {
    let id = SessionId::random().expect("id");
    let (tx, rx) = notify::channel(1);
    w.handle(Command::Create {
        id,
        owner: Tenant::NONE,
        req: CreateSession::default(),
        reply: tx,
        deadline: None,
        transient: false,
    });
    rx.recv().expect("reply").expect("created")
}

fn append(w: &mut Worker, id: SessionId, tokens: &[u32]) -> Result<AppendReply, RuntimeError> {
    let (tx, rx) = notify::channel(1);
    w.handle(Command::Enqueue {
        id,
        caller: Tenant::NONE,
        op: Op::Append {
            tokens: tokens.to_vec(),
            reply: tx,
        },
        deadline: None,
    });
    for _ in 0..100 {
        if let Ok(r) = rx.try_recv() {
            return r;
        }
        w.step();
    }
    Err(RuntimeError::Internal("no reply".into()))
}

#[test]
fn a_prefill_is_fed_in_chunks_one_step_each() {
    let mut w = worker();
    w.cfg.prefill_chunk = 4;
    let id = new_session(&mut w);
    let (tx, rx) = notify::channel(1);
    w.handle(Command::Enqueue {
        id,
        caller: Tenant::NONE,
        op: Op::Append {
            tokens: (1..=10).collect(),
            reply: tx,
        },
        deadline: None,
    });
    let mut lengths = Vec::new();
    while rx.is_empty() {
        w.step();
        lengths.push(w.sessions[&id].session.history().len());
    }
    assert_eq!(lengths, vec![4, 8, 10]);
    assert_eq!(rx.recv().expect("reply").expect("ok").history_length, 10);
}

/// History, logits digest and pages of a session: what an undone call
/// must leave as it found it.
fn snapshot(w: &Worker, id: SessionId) -> (Vec<u32>, u64, usize, usize) {
    let slot = &w.sessions[&id];
    (
        slot.session.history().to_vec(),
        digest(slot.session.next_logits()),
        slot.session.kv().len(),
        slot.session.kv().pages_held(),
    )
}

#[test]
fn an_append_past_its_deadline_is_undone_before_the_next_chunk() {
    let mut w = worker();
    w.cfg.prefill_chunk = 4;
    let id = new_session(&mut w);
    append(&mut w, id, &[1, 2, 3]).expect("append");
    let before = snapshot(&w, id);
    let free = w.kv_pool.free_pages();
    let (tx, rx) = notify::channel(1);
    w.handle(Command::Enqueue {
        id,
        caller: Tenant::NONE,
        op: Op::Append {
            tokens: (10..40).collect(),
            reply: tx,
        },
        deadline: Some(Instant::now() + Duration::from_millis(50)),
    });
    w.step();
    w.step();
    assert_eq!(w.sessions[&id].session.history().len(), 11, "two chunks in");
    std::thread::sleep(Duration::from_millis(60));
    w.step();
    assert_eq!(
        rx.try_recv().expect("answered"),
        Err(RuntimeError::DeadlineExceeded)
    );
    assert_eq!(snapshot(&w, id), before);
    assert_eq!(w.kv_pool.free_pages(), free, "the reserved pages are back");
    assert!(w.sessions[&id].idle());
    // The session goes on exactly as one that never saw the call.
    append(&mut w, id, &[4]).expect("append");
    let twin = new_session(&mut w);
    append(&mut w, twin, &[1, 2, 3, 4]).expect("append");
    assert_eq!(snapshot(&w, id).1, snapshot(&w, twin).1);
}

/// Runs a Generate of `max_tokens` until its window shift is halfway
/// through the kept window, then cancels it.
fn cancel_in_the_middle_of_a_shift(w: &mut Worker, id: SessionId) -> Vec<GenerateEvent> {
    let (events, rx) = notify::channel(64);
    let cancel = Arc::new(AtomicBool::new(false));
    w.handle(Command::Enqueue {
        id,
        caller: Tenant::NONE,
        op: Op::Generate {
            gen: Box::new(admitted(
                w.model.config.vocab,
                GenerateRequest {
                    constraint: None,
                    speculate: None,
                    id,
                    max_tokens: 40,
                    sampling: Default::default(),
                    stop_sequences: Vec::new(),
                },
            )),
            events,
            cancel: Arc::clone(&cancel),
        },
        deadline: None,
    });
    for _ in 0..200 {
        w.step();
        let shifting = w.sessions[&id]
            .active
            .as_ref()
            .is_some_and(|a| a.fed > 0 && a.fed < a.pending.len());
        if shifting {
            break;
        }
    }
    cancel.store(true, Ordering::Release);
    w.step();
    let mut got = Vec::new();
    while let Ok(e) = rx.try_recv() {
        got.push(e);
    }
    got
}

/// A worker with room for two windows and a session two tokens short of
/// the context, fed in chunks of 8.
fn two_tokens_short_of_the_context() -> (Worker, SessionId, Vec<u32>) {
    let mut w = worker_with_pages(40);
    w.cfg.prefill_chunk = 8;
    let context = w.model.config.context;
    let id = new_session(&mut w);
    let history: Vec<u32> = (0..context as u32 - 2).map(|i| i % 50 + 1).collect();
    append(&mut w, id, &history).expect("append");
    (w, id, history)
}

#[test]
fn a_generate_cancelled_while_its_window_shifts_keeps_the_old_window() {
    let (mut w, id, history) = two_tokens_short_of_the_context();
    let context = w.model.config.context;
    let events = cancel_in_the_middle_of_a_shift(&mut w, id);
    // Two tokens filled the context; the shift never finished, so it
    // was never reported, and the full history is back.
    let tokens: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            GenerateEvent::Token(t) => Some(*t),
            _ => None,
        })
        .collect();
    assert_eq!(tokens.len(), 2, "{events:?}");
    assert!(matches!(
        events.last(),
        Some(GenerateEvent::Done(GenerateDone {
            stop_reason: StopReason::Cancelled,
            ..
        }))
    ));
    assert!(!events
        .iter()
        .any(|e| matches!(e, GenerateEvent::Truncated { .. })));
    let slot = &w.sessions[&id];
    assert_eq!(slot.session.history().len(), context);
    assert_eq!(slot.session.history()[..context - 2], history[..]);
    assert_eq!(slot.session.kv().len(), context);
    assert_eq!(slot.session.truncated(), 0);
    assert!(slot.idle());
}

#[test]
fn a_cancelled_shift_in_the_sessions_own_pages_feeds_the_old_history_again() {
    let (mut w, id, _) = two_tokens_short_of_the_context();
    let context = w.model.config.context;
    // Take every free page, so the shift has to reuse the session's own.
    let mut hog = SessionKv::new(Arc::clone(&w.kv_pool));
    let free = w.kv_pool.free_pages() / w.model.config.n_layers;
    hog.reserve(free * 16).expect("the rest of the pool");
    cancel_in_the_middle_of_a_shift(&mut w, id);
    // Its old history (with the two tokens) is being fed again.
    for _ in 0..200 {
        if w.sessions[&id].idle() {
            break;
        }
        w.step();
    }
    let restored = snapshot(&w, id);
    assert_eq!(restored.0.len(), context);
    let twin_history = restored.0.clone();
    drop(hog);
    let twin = new_session(&mut w);
    append(&mut w, twin, &twin_history).expect("append");
    assert_eq!(restored.1, snapshot(&w, twin).1, "bit-identical logits");
}

#[test]
fn an_inv2_violation_fails_the_call_and_frees_the_session() {
    let mut w = worker();
    let id = new_session(&mut w);
    append(&mut w, id, &[1, 2, 3]).expect("append");
    let total = w.kv_pool.total_pages();
    assert!(w.kv_pool.free_pages() < total);
    // Pretend the cache once held more than it does now.
    if let Some(slot) = w.sessions.get_mut(&id) {
        slot.session.break_inv2_for_test();
    }
    let err = append(&mut w, id, &[4]).expect_err("violation");
    assert_eq!(err.code(), super::super::StatusKind::FailedPrecondition);
    assert!(err.to_string().contains("INV-2"), "{err}");
    assert!(!w.sessions.contains_key(&id));
    assert_eq!(w.shared.counters.inv2_violations.load(Ordering::Relaxed), 1);
    assert_eq!(w.shared.counters.sessions_failed.load(Ordering::Relaxed), 1);
    assert_eq!(w.kv_pool.free_pages(), total);
    assert_eq!(w.shared.live_sessions.load(Ordering::Relaxed), 0);
}

#[test]
fn an_inv1_violation_is_caught_after_the_mutation() {
    let mut w = worker();
    let id = new_session(&mut w);
    append(&mut w, id, &[1, 2, 3]).expect("append");
    if let Some(slot) = w.sessions.get_mut(&id) {
        slot.session.break_inv1_for_test();
    }
    let err = append(&mut w, id, &[4]).expect_err("violation");
    assert!(err.to_string().contains("INV-1"), "{err}");
    assert_eq!(w.shared.counters.inv1_violations.load(Ordering::Relaxed), 1);
    assert_eq!(
        append(&mut w, id, &[5]).expect_err("gone"),
        RuntimeError::NotFound
    );
}

#[test]
fn an_eviction_request_takes_the_lru_idle_session_never_a_busy_one() {
    let mut w = worker();
    let old = new_session(&mut w);
    let newer = new_session(&mut w);
    let busy = new_session(&mut w);
    append(&mut w, old, &[1]).expect("append");
    append(&mut w, newer, &[2]).expect("append");
    append(&mut w, busy, &[3]).expect("append");
    let (tx, _rx) = notify::channel(1);
    w.handle(Command::Enqueue {
        id: busy,
        caller: Tenant::NONE,
        op: Op::Append {
            tokens: vec![4],
            reply: tx,
        },
        deadline: None,
    });
    w.publish();
    let board = Arc::clone(&w.shared);
    let stamp = |id: SessionId, w: &Worker| w.stamp(w.sessions[&id].last_used);
    assert_eq!(board.board.oldest_idle(0), Some(stamp(old, &w)));
    let tickets = [0, 1, 2].map(|_| board.board.ask(0));
    w.serve_evictions();
    assert!(tickets.iter().all(|&t| board.board.is_answered(t)));
    // Two idle sessions for three requests: both go, the busy one stays.
    assert!(w.sessions.contains_key(&busy));
    assert_eq!(w.sessions.len(), 1);
    assert_eq!(w.shared.counters.evicted_lru.load(Ordering::Relaxed), 2);
    assert_eq!(board.board.oldest_idle(0), None);
}

#[test]
fn the_none_policy_makes_no_room() {
    let mut w = worker();
    w.cfg.eviction = EvictionPolicy::None;
    let idle = new_session(&mut w);
    append(&mut w, idle, &[1]).expect("append");
    assert!(matches!(w.make_room(None), Room::Nothing));
    assert!(w.sessions.contains_key(&idle));
    w.cfg.eviction = EvictionPolicy::Lru;
    assert!(matches!(w.make_room(None), Room::Retry));
    assert!(!w.sessions.contains_key(&idle));
}

#[test]
fn keep_window_keeps_the_sink_and_the_most_recent_tokens() {
    let h: Vec<u32> = (0..10).collect();
    assert_eq!(keep_window(&h, 2, 5), vec![0, 1, 7, 8, 9]);
    assert_eq!(keep_window(&h, 0, 3), vec![7, 8, 9]);
    assert_eq!(keep_window(&h, 9, 3), vec![0, 1, 2]);
    assert_eq!(keep_window(&h, 2, 10), h);
}

#[test]
fn digest_sees_every_bit() {
    assert_ne!(digest(&[0.0]), digest(&[-0.0]));
    assert_ne!(digest(&[1.0, 2.0]), digest(&[2.0, 1.0]));
    assert_eq!(digest(&[1.5]), digest(&[1.5]));
}

/// A Generate as the runtime's boundary admits it.
fn admitted(vocab: usize, req: GenerateRequest) -> AdmittedGenerate {
    let (params, seed_used) = req.admit(vocab).expect("valid request");
    AdmittedGenerate {
        req,
        params,
        seed_used,
    }
}

/// Runs `op` on session `id` as `caller` and steps until `rx` answers.
fn run_as<T>(
    w: &mut Worker,
    id: SessionId,
    caller: &Tenant,
    op: Op,
    rx: &notify::NotifyReceiver<Result<T, RuntimeError>>,
) -> Result<T, RuntimeError> {
    w.handle(Command::Enqueue {
        id,
        caller: caller.clone(),
        op,
        deadline: None,
    });
    for _ in 0..100 {
        if let Ok(r) = rx.try_recv() {
            return r;
        }
        w.step();
    }
    Err(RuntimeError::Internal("no reply".into()))
}

fn info_as(w: &mut Worker, id: SessionId, caller: &Tenant) -> Result<SessionInfo, RuntimeError> {
    let (tx, rx) = notify::channel(1);
    w.handle(Command::Info {
        id,
        caller: caller.clone(),
        reply: tx,
    });
    rx.recv().expect("reply")
}

#[test]
fn a_session_is_found_only_by_its_own_tenant() {
    let mut w = worker();
    let alice = Tenant::new("alice").expect("tenant");
    let bob = Tenant::new("bob").expect("tenant");
    let id = SessionId::random().expect("id");
    let (tx, rx) = notify::channel(1);
    w.handle(Command::Create {
        id,
        owner: alice.clone(),
        req: CreateSession::default(),
        reply: tx,
        deadline: None,
        transient: false,
    });
    rx.recv().expect("reply").expect("created");
    let append = |tokens: Vec<u32>| {
        let (tx, rx) = notify::channel(1);
        (Op::Append { tokens, reply: tx }, rx)
    };
    let (op, rx) = append(vec![1, 2, 3]);
    assert_eq!(
        run_as(&mut w, id, &alice, op, &rx)
            .expect("owner")
            .history_length,
        3
    );
    let (op, rx) = append(vec![4]);
    assert_eq!(
        run_as(&mut w, id, &bob, op, &rx),
        Err(RuntimeError::NotFound)
    );
    assert_eq!(info_as(&mut w, id, &bob), Err(RuntimeError::NotFound));
    let (tx, rx) = notify::channel(1);
    let close = Op::Close { reply: tx };
    assert_eq!(
        run_as(&mut w, id, &bob, close, &rx),
        Err(RuntimeError::NotFound)
    );
    let (tx, rx) = notify::channel(1);
    let fork = SessionId::random().expect("id");
    let op = Op::Fork {
        fork,
        owner: bob.clone(),
        at_length: None,
        client_label: None,
        reply: tx,
    };
    assert_eq!(
        run_as(&mut w, id, &bob, op, &rx),
        Err(RuntimeError::NotFound)
    );
    // Nothing of that touched the session; its owner, and a server
    // without tenants, still find it.
    assert_eq!(
        info_as(&mut w, id, &alice).expect("owner").history_length,
        3
    );
    assert_eq!(
        info_as(&mut w, id, &Tenant::NONE)
            .expect("no tenants")
            .history_length,
        3
    );
    // A fork belongs to the caller that made it.
    let (tx, rx) = notify::channel(1);
    let op = Op::Fork {
        fork,
        owner: alice.clone(),
        at_length: None,
        client_label: None,
        reply: tx,
    };
    assert_eq!(
        run_as(&mut w, id, &alice, op, &rx).expect("forked").id,
        fork
    );
    assert_eq!(info_as(&mut w, fork, &bob), Err(RuntimeError::NotFound));
    assert_eq!(
        info_as(&mut w, fork, &alice).expect("fork").history_length,
        3
    );
}
