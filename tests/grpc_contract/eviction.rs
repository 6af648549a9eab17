//! CONTRACT §2.6 through the wire: TTL and LRU eviction (never a busy
//! session) and context overflow under both policies.

use super::*;

// ---------------------------------------------------------------- §2.6 --

/// Tokens of the call that must outlive the idle TTL.
const LONG_CALL_TOKENS: u32 = 3000;

#[test]
fn idle_sessions_expire_after_the_ttl_but_never_mid_call() {
    let served = Served::start(
        slow_model(),
        loopback(RuntimeConfig {
            idle_ttl: Duration::from_millis(250),
            ..runtime_config(1)
        }),
    );
    let idle = served.create("idle", &[]);
    served.append(&idle, &[1, 2, 3]).expect("append");
    let kept_fresh = served.create("fresh", &[]);
    served.append(&kept_fresh, &[1]).expect("append");
    let working = served.create("working", &[]);
    served.append(&working, &[4, 5]).expect("append");
    // Long enough to outlive the TTL twice over on a fast machine (1,000
    // tokens took about 0.4 s on one): the point is a call running across
    // several sweeps.
    let long = served.generate(gen_req(&working, LONG_CALL_TOKENS));
    // Appends refresh the idle clock: keep one session fresh for as long as
    // the long call runs.
    thread::sleep(Duration::from_millis(20));
    while served
        .info(&working)
        .expect("never evicted mid-call")
        .get_busy()
    {
        served
            .append(&kept_fresh, &[2])
            .expect("refreshed session lives");
        thread::sleep(Duration::from_millis(50));
    }
    assert_code(served.info(&idle), RpcStatusCode::NOT_FOUND, "expired");
    assert_code(
        served.append(&idle, &[1]),
        RpcStatusCode::NOT_FOUND,
        "expired",
    );
    let done = long.finish(STREAM_TIMEOUT).done();
    assert!(
        done.get_total_duration_seconds() > 0.5,
        "the generate ran longer than the TTL ({} s)",
        done.get_total_duration_seconds()
    );
    assert_eq!(done.get_generated_token_count(), LONG_CALL_TOKENS);
    assert_eq!(
        served.history(&working),
        2 + u64::from(LONG_CALL_TOKENS),
        "not evicted mid-call"
    );
    assert!(served.info(&kept_fresh).is_ok());
    let stats = served.server().runtime_stats();
    assert_eq!(stats.evicted_ttl, 1, "{stats:?}");
    assert_eq!(stats.evicted_lru, 0, "{stats:?}");
    served.stop();
}

#[test]
fn the_session_limit_evicts_the_lru_idle_session_and_never_a_busy_one() {
    let served = Served::start(
        slow_model(),
        loopback(RuntimeConfig {
            max_sessions: 2,
            ..runtime_config(1)
        }),
    );
    let a = served.create("a", &[]);
    let b = served.create("b", &[]);
    served.append(&a, &[1]).expect("append");
    served.append(&b, &[2]).expect("append");
    served.append(&a, &[3]).expect("touch a");
    let c = served.create("c", &[]);
    assert_code(served.info(&b), RpcStatusCode::NOT_FOUND, "b was the LRU");
    assert_eq!(served.history(&a), 2, "a stays");
    assert_eq!(served.server().runtime_stats().evicted_lru, 1);

    // Both sessions mid-call: nothing may be evicted.
    served.append(&c, &[4, 5]).expect("append");
    let mut gen_a = served.generate(gen_req(&a, 4000));
    let mut gen_c = served.generate(gen_req(&c, 4000));
    gen_a.first_token(STREAM_TIMEOUT);
    gen_c.first_token(STREAM_TIMEOUT);
    let err = served.try_create("d", &[]).expect_err("all sessions busy");
    assert_eq!(err.code, RpcStatusCode::RESOURCE_EXHAUSTED, "{err:?}");
    assert!(
        err.message.contains("sessions exhausted: 1 asked, 0 free"),
        "{err:?}"
    );
    assert_eq!(served.server().runtime_stats().evicted_lru, 1);
    assert!(served.info(&a).expect("a lives").get_busy());
    assert!(served.info(&c).expect("c lives").get_busy());
    drop((gen_a, gen_c));
    served.wait_idle(&a, Duration::from_secs(2));
    served.wait_idle(&c, Duration::from_secs(2));
    served.create("d", &[]);
    assert_eq!(served.server().runtime_stats().evicted_lru, 2);
    served.stop();
}

#[test]
fn kv_pressure_evicts_the_lru_idle_session() {
    let served = Served::start(
        tiny_model(),
        loopback(RuntimeConfig {
            kv_bytes: 4 * 4096,
            ..runtime_config(1)
        }),
    );
    let a = served.create("a", &[]);
    served.append(&a, &prompt(40, 1)).expect("3 pages");
    let b = served.create("b", &[]);
    served
        .append(&b, &prompt(30, 2))
        .expect("2 pages, a evicted");
    assert_code(served.info(&a), RpcStatusCode::NOT_FOUND, "evicted");
    assert_eq!(served.history(&b), 30);
    let stats = served.server().runtime_stats();
    assert_eq!((stats.evicted_lru, stats.evicted_ttl), (1, 0), "{stats:?}");
    served.stop();
}

#[test]
fn overflow_truncates_when_the_context_fills_and_says_so_there() {
    let served = Served::tiny(1);
    let id = served.create("long", &[]);
    served.append(&id, &prompt(250, 5)).expect("append");
    let outcome = served.generate(gen_req(&id, 20)).finish(STREAM_TIMEOUT);
    let done = outcome.done();
    // Six tokens fill the context of 256; only then is room made, and only
    // as much as the other 14 need.
    assert!(
        outcome.messages[..6].iter().all(|m| m.has_token_id()),
        "{:?}",
        outcome.messages
    );
    assert!(
        outcome.messages[6].has_truncated(),
        "{:?}",
        outcome.messages[6]
    );
    assert_eq!(
        outcome.messages[6]
            .get_truncated()
            .get_dropped_token_count(),
        14
    );
    assert_eq!(
        outcome
            .messages
            .iter()
            .filter(|m| m.has_truncated())
            .count(),
        1
    );
    assert_eq!(outcome.tokens().len(), 20);
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_MAX_TOKENS);
    assert_eq!(done.get_history_length(), TINY_CONTEXT);
    let info = served.info(&id).expect("info");
    assert_eq!(info.get_history_length(), TINY_CONTEXT);

    // An append past the context truncates too, and says by how much.
    let reply = served
        .append_with(&id, &prompt(10, 6), served.opt())
        .expect("append");
    assert_eq!(reply.get_history_length(), TINY_CONTEXT);
    assert_eq!(reply.get_dropped_token_count(), 10);
    let fits = served
        .append_with(&served.create("short", &[]), &[1, 2], served.opt())
        .expect("append");
    assert_eq!(fits.get_dropped_token_count(), 0);
    served.stop();
}

#[test]
fn the_stop_overflow_policy_ends_with_truncated() {
    let served = Served::start(
        tiny_model(),
        loopback(RuntimeConfig {
            overflow: OverflowPolicy::Stop,
            ..runtime_config(1)
        }),
    );
    let id = served.create("long", &[]);
    served.append(&id, &prompt(250, 5)).expect("append");
    let outcome = served.generate(gen_req(&id, 20)).finish(STREAM_TIMEOUT);
    let done = outcome.done();
    assert!(outcome.messages.iter().all(|m| !m.has_truncated()));
    assert_eq!(outcome.tokens().len(), 6);
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_TRUNCATED);
    assert_eq!(done.get_generated_token_count(), 6);
    assert_eq!(served.history(&id), TINY_CONTEXT);
    assert_code(
        served.append(&id, &[1]),
        RpcStatusCode::INVALID_ARGUMENT,
        "full",
    );
    assert_eq!(served.history(&id), TINY_CONTEXT);
    served.stop();
}
