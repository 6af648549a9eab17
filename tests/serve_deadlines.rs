//! What a careless or hostile client found, through a real `inferd serve`
//! process on the reference model and a stock grpcio client: a call whose
//! deadline passes stops within one step and leaves the history exactly as
//! it was; a long prefill does not hold up the worker's other sessions;
//! `max_tokens` is a cap, never a reservation; and nothing is evicted for a
//! request that would fail anyway.

mod support;

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use grpcio::{CallOption, RpcStatusCode};

use inferd::proto::kakeya_v1::runtime as pb;
use support::{have_reference, sample, scrape, Client, Inferd, Status, REFERENCE};

fn serve(extra: &[&str]) -> Inferd {
    let mut args = vec![
        "serve",
        "--model",
        REFERENCE,
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--workers",
        "1",
    ];
    args.extend_from_slice(extra);
    Inferd::start(&args)
}

/// Token ids of a long, varied prompt (inside the 49,152-token vocabulary).
fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(7919) + salt) % 48_000 + 100)
        .collect()
}

fn status(err: grpcio::Error) -> Status {
    match err {
        grpcio::Error::RpcFailure(s) => (s.code(), s.message().to_owned()),
        other => (RpcStatusCode::UNKNOWN, other.to_string()),
    }
}

fn append_within(client: &Client, id: &str, tokens: &[u32], deadline: Duration) -> Status {
    let mut req = pb::AppendTokensRequest::new();
    req.set_session_id(id.into());
    req.set_token_ids(tokens.to_vec());
    match client
        .rpc
        .append_tokens_opt(&req, CallOption::default().timeout(deadline))
    {
        Ok(r) => (RpcStatusCode::OK, r.get_history_length().to_string()),
        Err(e) => status(e),
    }
}

/// An append the test needs done, however loaded the machine is.
fn append_ok(client: &Client, id: &str, tokens: &[u32]) -> u64 {
    let (code, length) = append_within(client, id, tokens, Duration::from_secs(300));
    assert_eq!(code, RpcStatusCode::OK, "{length}");
    length.parse().expect("a length")
}

/// History length and logits digest: what must not move when a call fails.
fn state(client: &Client, id: &str) -> (u64, u64) {
    let info = client.info(id).expect("info");
    (info.get_history_length(), info.get_logits_digest())
}

/// Polls until the session is idle again (its call's work is over).
fn settled(client: &Client, id: &str) -> (u64, u64) {
    let until = Instant::now() + Duration::from_secs(60);
    while client.info(id).expect("info").get_busy() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    state(client, id)
}

#[test]
fn an_append_past_its_deadline_is_undone_and_frees_the_worker() {
    if !have_reference() {
        return;
    }
    let server = serve(&[]);
    let client = Client::connect(&server.addr);
    let id = client.create();
    append_ok(&client, &id, &prompt(40, 1));
    let before = state(&client, &id);

    // Far more work than 50 ms allow: the call fails, nothing of it stays.
    let (code, _) = append_within(&client, &id, &prompt(3_000, 2), Duration::from_millis(50));
    assert_eq!(code, RpcStatusCode::DEADLINE_EXCEEDED);
    assert_eq!(
        settled(&client, &id),
        before,
        "history and logits as before"
    );
    // And it stays so: no work goes on behind the client's back.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(state(&client, &id), before);

    // Same with a deadline that passes in the middle of the prefill.
    let (code, _) = append_within(&client, &id, &prompt(3_000, 3), Duration::from_millis(700));
    assert_eq!(code, RpcStatusCode::DEADLINE_EXCEEDED);
    assert_eq!(settled(&client, &id), before);

    // Over the context (truncate policy): the kept window is re-prefilled
    // into fresh pages; stopped halfway, the old pages and history return.
    let (code, _) = append_within(&client, &id, &prompt(9_000, 4), Duration::from_secs(2));
    assert_eq!(code, RpcStatusCode::DEADLINE_EXCEEDED);
    let t0 = Instant::now();
    assert_eq!(settled(&client, &id), before);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the worker stopped within a step, not after the whole prefill"
    );

    // The session works on from where it was, exactly as a fresh one.
    assert_eq!(append_ok(&client, &id, &[504, 3575]), 42);
    let twin = client.create();
    let mut history = prompt(40, 1);
    history.extend_from_slice(&[504, 3575]);
    assert_eq!(append_ok(&client, &twin, &history), 42);
    assert_eq!(state(&client, &id), state(&client, &twin));

    let metrics = scrape(server.metrics.as_deref().expect("metrics"));
    assert_eq!(
        sample(&metrics, "inferd_session_active"),
        Some(2.0),
        "{metrics}"
    );
}

#[test]
fn a_long_prefill_leaves_room_for_the_other_sessions_calls() {
    if !have_reference() {
        return;
    }
    // One worker: both sessions share it.
    let server = serve(&[]);
    let client = Client::connect(&server.addr);
    let other = client.create();
    append_ok(&client, &other, &[1, 2, 3]);
    let long = client.create();
    // Deep into a long history, where attention makes every token dear.
    let deep = 2_000;
    append_ok(&client, &long, &prompt(deep, 4));
    let appender = {
        let client = client.clone();
        let long = long.clone();
        std::thread::spawn(move || {
            append_within(&client, &long, &prompt(1_000, 5), Duration::from_secs(6))
        })
    };
    let until = Instant::now() + Duration::from_secs(5);
    while client.info(&long).expect("info").get_history_length() == deep as u64
        && Instant::now() < until
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut slowest = Duration::ZERO;
    for _ in 0..10 {
        let t0 = Instant::now();
        client.info(&other).expect("info answers");
        slowest = slowest.max(t0.elapsed());
        std::thread::sleep(Duration::from_millis(150));
    }
    eprintln!(
        "GetSessionInfo of another session during a prefill at depth {deep}: slowest {slowest:?}"
    );
    assert!(
        slowest < Duration::from_millis(800),
        "GetSessionInfo waited {slowest:?} behind another session's prefill"
    );
    let (code, _) = appender.join().expect("appender");
    // Whatever the outcome, it is all or nothing.
    let length = settled(&client, &long).0;
    match code {
        RpcStatusCode::OK => assert_eq!(length, deep as u64 + 1_000),
        RpcStatusCode::DEADLINE_EXCEEDED => assert_eq!(length, deep as u64),
        other => panic!("unexpected {other:?}"),
    }
}

/// Every message of a Generate stream, and the status it ended with.
struct Stream {
    tokens: Vec<u32>,
    /// `(tokens before it, dropped_token_count)` of each HistoryTruncated.
    truncated: Vec<(usize, u64)>,
    done: Option<pb::GenerateDone>,
    error: Option<Status>,
}

fn generate(client: &Client, req: &pb::GenerateRequest, deadline: Duration) -> Stream {
    let mut out = Stream {
        tokens: Vec::new(),
        truncated: Vec::new(),
        done: None,
        error: None,
    };
    let mut stream = match client
        .rpc
        .generate_opt(req, CallOption::default().timeout(deadline))
    {
        Ok(s) => s,
        Err(e) => {
            out.error = Some(status(e));
            return out;
        }
    };
    while let Some(item) = futures_executor::block_on(stream.next()) {
        match item {
            Ok(mut msg) => {
                if msg.has_truncated() {
                    let dropped = msg.get_truncated().get_dropped_token_count();
                    out.truncated.push((out.tokens.len(), dropped));
                } else if msg.has_done() {
                    out.done = Some(msg.take_done());
                } else if !msg.has_logprobs() {
                    out.tokens.push(msg.get_token_id());
                }
            }
            Err(e) => {
                out.error = Some(status(e));
                break;
            }
        }
    }
    out
}

fn request(id: &str, max_tokens: u32) -> pb::GenerateRequest {
    let mut req = pb::GenerateRequest::new();
    req.set_session_id(id.into());
    req.set_max_tokens(max_tokens);
    req
}

#[test]
fn a_generate_past_its_deadline_changes_nothing() {
    if !have_reference() {
        return;
    }
    let server = serve(&[]);
    let client = Client::connect(&server.addr);
    let id = client.create();
    append_ok(&client, &id, &prompt(1_301, 6));
    let before = state(&client, &id);
    let got = generate(&client, &request(&id, 4_000), Duration::from_millis(1));
    let (code, _) = got.error.expect("failed");
    assert_eq!(code, RpcStatusCode::DEADLINE_EXCEEDED);
    assert!(got.truncated.is_empty(), "nothing truncated up front");
    // It stopped within one step: at most the token of the step that was
    // running when the deadline passed went unseen by the client.
    let after = settled(&client, &id).0;
    let seen = before.0 + got.tokens.len() as u64;
    assert!((seen..=seen + 1).contains(&after), "{before:?} -> {after}");
}

#[test]
fn max_tokens_is_a_cap_not_a_reservation() {
    if !have_reference() {
        return;
    }
    let server = serve(&[]);
    let client = Client::connect(&server.addr);
    let history = prompt(100, 7);
    // The greedy first token after this history, to stop on as EOS.
    let probe = client.create();
    append_ok(&client, &probe, &history);
    let first = generate(&client, &request(&probe, 1), Duration::from_secs(60)).tokens[0];

    for max_tokens in [8_093, 8_192, u32::MAX] {
        let mut create = pb::CreateSessionRequest::new();
        create.set_eos_token_ids(vec![first]);
        let id = client
            .rpc
            .create_session(&create)
            .expect("created")
            .take_session_id();
        append_ok(&client, &id, &history);
        let got = generate(&client, &request(&id, max_tokens), Duration::from_secs(60));
        assert!(got.error.is_none(), "{:?}", got.error);
        assert_eq!(
            got.truncated,
            vec![],
            "nothing dropped for tokens never made"
        );
        let done = got.done.expect("done");
        assert_eq!(
            done.get_stop_reason(),
            pb::GenerateDone_StopReason::STOP_REASON_EOS
        );
        assert_eq!(done.get_generated_token_count(), 1);
        assert_eq!(done.get_prefill_token_count(), 0);
        let info = client.info(&id).expect("info");
        assert_eq!(info.get_history_length(), 101);
        assert_eq!(info.get_truncated_token_count(), 0);
    }
}

#[test]
fn nothing_is_evicted_for_a_request_that_cannot_fit() {
    if !have_reference() {
        return;
    }
    // 4 MiB: 11 pages of 16 positions over the 30 layers (330 pages).
    let server = serve(&["--kv-mib", "4"]);
    let client = Client::connect(&server.addr);
    let idle = client.create();
    append_ok(&client, &idle, &prompt(30, 8));
    let before = state(&client, &idle);
    let greedy = client.create();
    let (code, message) =
        append_within(&client, &greedy, &prompt(5_000, 9), Duration::from_secs(30));
    assert_eq!(code, RpcStatusCode::RESOURCE_EXHAUSTED);
    assert!(message.contains("9390 asked"), "{message}");
    assert_eq!(state(&client, &idle), before, "the idle session stays");
    let metrics = scrape(server.metrics.as_deref().expect("metrics"));
    assert_eq!(
        sample(&metrics, "inferd_session_evicted_total{reason=\"lru\"}"),
        Some(0.0),
        "{metrics}"
    );
    // A request that eviction does make fit still evicts.
    client
        .append(&greedy, &prompt(150, 10))
        .expect("10 pages: evicts the idle one");
    assert_eq!(
        client.info(&idle).expect_err("evicted").0,
        RpcStatusCode::NOT_FOUND
    );
}
