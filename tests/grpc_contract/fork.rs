//! CONTRACT §2.11 through the wire: `inferd.session.v1.SessionService/
//! ForkSession`. A fork holds exactly the state of a session fed the same
//! history from scratch (same logits digest, same greedy and seeded
//! tokens), shares its source's full pages instead of copying them, and
//! lives and dies independently of its source.

use super::*;

/// A session fed `history` in one append (none when it is empty).
fn fed(served: &Served, history: &[u32]) -> String {
    let id = served.create("independent", &[]);
    if !history.is_empty() {
        served.append(&id, history).expect("append");
    }
    id
}

/// Polls until the workers have published that no session holds KV.
fn wait_kv_empty(served: &Served) -> inferd::runtime::RuntimeStats {
    let t0 = Instant::now();
    loop {
        let stats = served.server().runtime_stats();
        if stats.kv_live_bytes == 0 && stats.kv_free_pages == stats.kv_total_pages {
            return stats;
        }
        assert!(t0.elapsed() < CALL_TIMEOUT, "KV still held: {stats:?}");
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_fork_at_any_length_continues_exactly_like_a_session_fed_its_history() {
    // Two workers: the independent sessions land on either, forks on their
    // source's.
    let served = Served::tiny(2);
    // 70 tokens, the last 30 generated: 4 full pages of 16 and 6 positions.
    let history = {
        let id = served.create("history", &[]);
        let mut history = prompt(40, 5);
        served.append(&id, &history).expect("append");
        history.extend(served.run(gen_req(&id, 30)).0);
        served.close(&id).expect("close");
        history
    };
    let source = fed(&served, &history);
    let source_digest = served.digest(&source);
    for at in [
        None,
        Some(70),
        Some(69),
        Some(64),
        Some(48),
        Some(45),
        Some(1),
    ] {
        let fork = served.fork(&source, at).expect("fork");
        let kept = at.unwrap_or(70) as usize;
        assert_eq!(fork.get_history_length(), kept as u64, "{at:?}");
        let fork_id = fork.get_session_id().to_owned();
        assert_ne!(fork_id, source);
        let info = served.info(&fork_id).expect("fork info");
        assert_eq!(info.get_history_length(), kept as u64);
        assert!(!info.get_busy(), "a fork is answered once complete");
        let independent = fed(&served, &history[..kept]);
        assert_eq!(
            continuation(&served, &fork_id),
            continuation(&served, &independent),
            "fork at {at:?}"
        );
        // The source is untouched by its fork and the fork's generation.
        assert_eq!(served.digest(&source), source_digest, "{at:?}");
        assert_eq!(served.history(&source), 70);
        served.close(&fork_id).expect("close fork");
        served.close(&independent).expect("close independent");
    }
    // A fork of nothing is an empty session: it generates nothing until fed.
    let empty = served.fork(&source, Some(0)).expect("fork at 0");
    let empty_id = empty.get_session_id().to_owned();
    assert_eq!(served.history(&empty_id), 0);
    let refused = served
        .generate(gen_req(&empty_id, 1))
        .finish(STREAM_TIMEOUT);
    assert_eq!(refused.failure().code, RpcStatusCode::INVALID_ARGUMENT);
    let other = prompt(20, 11);
    served
        .append(&empty_id, &other)
        .expect("append to the empty fork");
    let independent = fed(&served, &other);
    assert_eq!(
        continuation(&served, &empty_id),
        continuation(&served, &independent)
    );
    // Forks of forks, and the source's own continuation, still match.
    let first = served.fork(&source, Some(50)).expect("fork");
    let second = served
        .fork(first.get_session_id(), None)
        .expect("fork of a fork");
    let independent = fed(&served, &history[..50]);
    let expected = continuation(&served, &independent);
    assert_eq!(continuation(&served, second.get_session_id()), expected);
    assert_eq!(continuation(&served, first.get_session_id()), expected);
    let independent = fed(&served, &history);
    assert_eq!(
        continuation(&served, &source),
        continuation(&served, &independent)
    );
    served.stop();
}

#[test]
fn forks_share_full_pages_and_closing_any_session_never_disturbs_the_others() {
    let served = Served::tiny(1);
    let history = prompt(100, 9); // 6 full pages of 16 and 4 positions
    let source = fed(&served, &history);
    let layers = 2; // the tiny model's
    let source_pages = served.info(&source).expect("info").get_kv_pages_held();
    assert_eq!(source_pages, 7 * layers);
    let free_before = served.server().runtime_stats().kv_free_pages;
    let forks: Vec<String> = (0..4)
        .map(|_| {
            served
                .fork(&source, None)
                .expect("fork")
                .get_session_id()
                .to_owned()
        })
        .collect();
    // Each fork copied only its partial page, one per layer.
    let t0 = Instant::now();
    loop {
        let free = served.server().runtime_stats().kv_free_pages;
        if free == free_before - 4 * layers {
            break;
        }
        assert!(
            t0.elapsed() < CALL_TIMEOUT,
            "free pages {free}, expected {}",
            free_before - 4 * layers
        );
        thread::sleep(Duration::from_millis(10));
    }
    for fork in &forks {
        assert_eq!(
            served.info(fork).expect("info").get_kv_pages_held(),
            source_pages
        );
    }
    // Close the source first: the forks keep its pages.
    served.close(&source).expect("close source");
    assert_eq!(
        served.info(&source).expect_err("closed").code,
        RpcStatusCode::NOT_FOUND
    );
    let independent = fed(&served, &history);
    let expected = continuation(&served, &independent);
    served.close(&independent).expect("close");
    for fork in &forks[..2] {
        assert_eq!(continuation(&served, fork), expected);
    }
    // Closing one fork leaves the other forks as they were.
    served.close(&forks[0]).expect("close fork");
    assert_eq!(continuation(&served, &forks[2]), expected);
    for fork in &forks[1..] {
        served.close(fork).expect("close fork");
    }
    let stats = wait_kv_empty(&served);
    assert_eq!(stats.sessions_forked, 4, "{stats:?}");
    served.stop();
}

#[test]
fn a_bad_fork_is_refused_with_its_status_and_changes_nothing() {
    let served = Served::start(
        tiny_model(),
        loopback(RuntimeConfig {
            max_sessions: 3,
            eviction: inferd::runtime::EvictionPolicy::None,
            ..runtime_config(1)
        }),
    );
    let source = fed(&served, &prompt(30, 2));
    let digest = served.digest(&source);
    let refusals = [
        (UNKNOWN_ID, Some(1), RpcStatusCode::NOT_FOUND),
        ("not-an-id", None, RpcStatusCode::NOT_FOUND),
        (source.as_str(), Some(31), RpcStatusCode::INVALID_ARGUMENT),
        (
            source.as_str(),
            Some(u64::MAX),
            RpcStatusCode::INVALID_ARGUMENT,
        ),
    ];
    for (id, at, code) in refusals {
        let status = served.fork(id, at).expect_err("refused");
        assert_eq!(status.code, code, "{id} at {at:?}: {}", status.message);
    }
    let mut req = ext::ForkSessionRequest::new();
    req.set_session_id(source.clone());
    req.set_client_label("x".repeat(257));
    let status = served
        .sessions
        .fork_session_opt(&req, served.opt())
        .map_err(status_of)
        .expect_err("label too long");
    assert_eq!(status.code, RpcStatusCode::INVALID_ARGUMENT, "{status:?}");
    let status = served
        .raw_call(
            "/inferd.session.v1.SessionService/ForkSession",
            MethodType::Unary,
            b"\xff\xff\xff",
        )
        .expect_err("garbage");
    assert_eq!(status.code, RpcStatusCode::INVALID_ARGUMENT, "{status:?}");
    assert!(
        status
            .message
            .contains("inferd.session.v1.ForkSessionRequest"),
        "{status:?}"
    );
    // The session limit holds for forks: 3 sessions, then no more.
    let forked = served.fork(&source, Some(10)).expect("fork");
    let mut req = ext::ForkSessionRequest::new();
    req.set_session_id(source.clone());
    req.set_client_label("labelled".into());
    let labelled = served
        .sessions
        .fork_session_opt(&req, served.opt())
        .expect("labelled fork");
    assert_eq!(
        served
            .info(labelled.get_session_id())
            .expect("info")
            .get_client_label(),
        "labelled"
    );
    let status = served.fork(&source, None).expect_err("over the limit");
    assert_eq!(status.code, RpcStatusCode::RESOURCE_EXHAUSTED, "{status:?}");
    // Nothing above changed the source.
    assert_eq!(served.digest(&source), digest);
    assert_eq!(served.history(&source), 30);
    assert_eq!(served.history(forked.get_session_id()), 10);
    served.stop();
}

#[test]
fn fork_needs_the_bearer_token_like_every_other_call() {
    let mut cfg = loopback(runtime_config(1));
    cfg.auth_token = Some("secret-token".into());
    let served = Served::start(tiny_model(), cfg);
    let source = fed(&served, &prompt(5, 1));
    assert!(served.fork(&source, None).is_ok());
    let mut req = ext::ForkSessionRequest::new();
    req.set_session_id(source);
    let status = served
        .sessions
        .fork_session_opt(&req, CallOption::default().timeout(CALL_TIMEOUT))
        .map_err(status_of)
        .expect_err("no token");
    assert_eq!(status.code, RpcStatusCode::UNAUTHENTICATED, "{status:?}");
    served.stop();
}
