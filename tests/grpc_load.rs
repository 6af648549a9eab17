//! A bounded load test of the gRPC server: a real grpcio client against an
//! in-process `inferd::server::Server` on a synthetic model. 64 sessions,
//! 16 client threads running a seeded random mix of appends, Generates read
//! to the end, Generates the client cancels part way, and info checks; then
//! it proves nothing was lost: every stream ended properly, every history
//! equals what the client accounted for, and the KV pool and the counters
//! are back where they must be.

#![cfg(not(loom))]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_executor::block_on;
use futures_util::StreamExt;
use grpcio::{CallOption, ChannelBuilder, EnvBuilder, RpcStatusCode};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use inferd::proto::kakeya_v1::runtime as pb;
use inferd::proto::kakeya_v1::runtime_grpc::RuntimeServiceClient;
use inferd::runtime::RuntimeConfig;
use inferd::server::{ServeConfig, Server};

mod support;
use support::tiny_model;

const SESSIONS: usize = 64;
const CLIENT_THREADS: usize = 16;
const OPERATIONS: usize = 1000;
const SEED: u64 = 0x5eed_10ad;
/// The synthetic model's vocabulary and context.
const VOCAB: u32 = 320;
const CONTEXT: u64 = 256;
/// No history grows past this (below the context), so the truncate overflow
/// policy never kicks in and the accounting stays exact.
const HISTORY_CAP: u64 = 240;
/// Longest Generate read to its end.
const MAX_GENERATE: u32 = 32;
/// Longest Generate the client cancels: longer than a stream's buffer of 32
/// events, so the worker also waits on a slow reader before the cancel.
const MAX_CANCELLED_GENERATE: u32 = 96;
/// No single call may take longer than this; the whole run has its own bound.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
const RUN_BOUND: Duration = Duration::from_secs(120);

fn start_server() -> Server {
    let runtime = RuntimeConfig {
        workers: 2,
        pin_cores: false,
        kv_bytes: 8 << 20,
        ..RuntimeConfig::default()
    };
    Server::start(tiny_model(), ServeConfig::new("127.0.0.1:0", runtime)).expect("server starts")
}

fn client(server: &Server) -> RuntimeServiceClient {
    let env = Arc::new(EnvBuilder::new().cq_count(2).build());
    let channel = ChannelBuilder::new(env).connect(&server.addr().to_string());
    RuntimeServiceClient::new(channel)
}

fn call() -> CallOption {
    CallOption::default().timeout(CALL_TIMEOUT)
}

/// What the client knows about one session.
#[derive(Clone, Debug, Default)]
struct Book {
    id: String,
    /// History length the client accounted for.
    history: u64,
    appended: u64,
    /// Generated tokens committed to the history.
    generated: u64,
    /// A client thread is working on it.
    busy: bool,
}

/// Tallies over the whole run.
#[derive(Debug, Default)]
struct Tally {
    appends: usize,
    generates_completed: usize,
    generates_cancelled: usize,
    /// Cancelled by the client, but the server had already finished.
    cancels_after_done: usize,
    /// Cancelled streams that committed fewer tokens than asked.
    cancels_stopped_early: usize,
    info_checks: usize,
    tokens_received: u64,
}

fn info(client: &RuntimeServiceClient, id: &str) -> pb::GetSessionInfoResponse {
    let mut req = pb::GetSessionInfoRequest::new();
    req.set_session_id(id.to_owned());
    client
        .get_session_info_opt(&req, call())
        .unwrap_or_else(|e| panic!("GetSessionInfo {id}: {e}"))
}

fn append(client: &RuntimeServiceClient, id: &str, tokens: Vec<u32>) -> u64 {
    let mut req = pb::AppendTokensRequest::new();
    req.set_session_id(id.to_owned());
    req.set_token_ids(tokens);
    let reply = client
        .append_tokens_opt(&req, call())
        .unwrap_or_else(|e| panic!("AppendTokens {id}: {e}"));
    assert_eq!(
        reply.get_dropped_token_count(),
        0,
        "{id}: nothing truncated"
    );
    reply.get_history_length()
}

fn random_tokens(rng: &mut StdRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.gen_range(0..VOCAB)).collect()
}

fn generate_request(rng: &mut StdRng, id: &str, max_tokens: u32) -> pb::GenerateRequest {
    let mut req = pb::GenerateRequest::new();
    req.set_session_id(id.to_owned());
    req.set_max_tokens(max_tokens);
    if rng.gen_bool(0.5) {
        // Sampled, seeded; the other half is greedy.
        req.set_temperature(rng.gen_range(0.5..3.0));
        req.set_top_k(40);
        req.set_seed(rng.gen());
    }
    req
}

/// A Generate read to its end: exactly `max_tokens` tokens, one `done`
/// agreeing with them, then a clean end of stream. Returns the token count.
fn generate_to_end(client: &RuntimeServiceClient, rng: &mut StdRng, book: &Book) -> u64 {
    let max_tokens = rng.gen_range(1..=MAX_GENERATE);
    let req = generate_request(rng, &book.id, max_tokens);
    let mut stream = client
        .generate_opt(&req, call())
        .unwrap_or_else(|e| panic!("Generate {}: {e}", book.id));
    let mut tokens = 0u64;
    let mut done: Option<pb::GenerateDone> = None;
    block_on(async {
        while let Some(item) = stream.next().await {
            let message = item.unwrap_or_else(|e| {
                panic!(
                    "Generate {}: unexpected end after {tokens} tokens: {e}",
                    book.id
                )
            });
            assert!(done.is_none(), "{}: a message after done", book.id);
            if message.has_done() {
                done = Some(message.get_done().clone());
            } else {
                assert!(message.has_token_id(), "{}: {message:?}", book.id);
                assert!(message.get_token_id() < VOCAB);
                tokens += 1;
            }
        }
    });
    let done = done.unwrap_or_else(|| panic!("{}: stream ended without done", book.id));
    assert_eq!(
        done.get_stop_reason(),
        pb::GenerateDone_StopReason::STOP_REASON_MAX_TOKENS,
        "{}",
        book.id
    );
    assert_eq!(tokens, u64::from(max_tokens), "{}", book.id);
    assert_eq!(u64::from(done.get_generated_token_count()), tokens);
    assert_eq!(done.get_history_length(), book.history + tokens);
    tokens
}

/// How a Generate the client cancelled ended, as the client saw it.
struct Cancelled {
    max_tokens: u32,
    received: u64,
    /// The server finished (sent done) before the cancel reached it.
    finished_first: bool,
}

/// A Generate the client cancels after receiving `k >= 1` tokens (so the
/// server has surely started it); the stream must then end with CANCELLED,
/// or with the done the server had already sent.
fn generate_and_cancel(client: &RuntimeServiceClient, rng: &mut StdRng, book: &Book) -> Cancelled {
    let max_tokens = rng.gen_range(8..=MAX_CANCELLED_GENERATE);
    let cancel_after = rng.gen_range(1..=8u64);
    let req = generate_request(rng, &book.id, max_tokens);
    let mut stream = client
        .generate_opt(&req, call())
        .unwrap_or_else(|e| panic!("Generate {}: {e}", book.id));
    let mut received = 0u64;
    let mut cancelled = false;
    let mut done = None;
    let mut status = None;
    block_on(async {
        while let Some(item) = stream.next().await {
            match item {
                Ok(message) if message.has_token_id() => {
                    assert!(done.is_none(), "{}: a token after done", book.id);
                    received += 1;
                }
                Ok(message) if message.has_done() => {
                    assert!(done.is_none(), "{}: two dones", book.id);
                    done = Some(message.get_done().clone());
                }
                Ok(other) => panic!("{}: unexpected message {other:?}", book.id),
                Err(grpcio::Error::RpcFailure(s)) => {
                    status = Some(s);
                    break;
                }
                Err(e) => panic!("{}: {e}", book.id),
            }
            if !cancelled && received >= cancel_after {
                stream.cancel();
                cancelled = true;
            }
        }
    });
    assert!(cancelled, "{}: the stream ended before the cancel", book.id);
    match (status, done) {
        (Some(s), _) => {
            assert_eq!(
                s.code(),
                RpcStatusCode::CANCELLED,
                "{}: a cancelled stream must end CANCELLED, got {s:?}",
                book.id
            );
            Cancelled {
                max_tokens,
                received,
                finished_first: false,
            }
        }
        (None, Some(d)) => {
            assert_eq!(u64::from(d.get_generated_token_count()), received);
            Cancelled {
                max_tokens,
                received,
                finished_first: true,
            }
        }
        (None, None) => panic!("{}: stream ended with neither done nor status", book.id),
    }
}

/// Waits until the session has nothing running or queued and returns its
/// settled history length.
fn settled_history(client: &RuntimeServiceClient, id: &str) -> u64 {
    let give_up = Instant::now() + CALL_TIMEOUT;
    loop {
        let i = info(client, id);
        if !i.get_busy() {
            return i.get_history_length();
        }
        assert!(Instant::now() < give_up, "{id} stayed busy: {i:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Takes a random session no other thread holds.
fn take_session(books: &Mutex<Vec<Book>>, rng: &mut StdRng) -> Book {
    loop {
        {
            let mut all = books.lock().expect("books");
            let free: Vec<usize> = (0..all.len()).filter(|&i| !all[i].busy).collect();
            if !free.is_empty() {
                let i = free[rng.gen_range(0..free.len())];
                all[i].busy = true;
                return all[i].clone();
            }
        }
        std::thread::yield_now();
    }
}

fn give_back(books: &Mutex<Vec<Book>>, book: Book) {
    let mut all = books.lock().expect("books");
    let slot = all
        .iter_mut()
        .find(|b| b.id == book.id)
        .expect("known session");
    *slot = Book {
        busy: false,
        ..book
    };
}

/// One client thread: operations until the shared budget is spent.
fn client_thread(
    client: RuntimeServiceClient,
    books: Arc<Mutex<Vec<Book>>>,
    budget: Arc<AtomicUsize>,
    seed: u64,
) -> Tally {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tally = Tally::default();
    while budget.fetch_add(1, Ordering::Relaxed) < OPERATIONS {
        let mut book = take_session(&books, &mut rng);
        let roll = rng.gen_range(0..100);
        let full = book.history + u64::from(MAX_CANCELLED_GENERATE) + 8 > HISTORY_CAP;
        if roll < 10 || full {
            let i = info(&client, &book.id);
            assert_eq!(i.get_history_length(), book.history, "{}", book.id);
            assert!(!i.get_busy(), "{}: busy while no call runs", book.id);
            assert_eq!(i.get_cache_invariant_inv1_violations(), 0);
            assert_eq!(i.get_cache_invariant_inv2_violations(), 0);
            assert!(i.get_kv_pages_held() * i.get_kv_page_bytes() >= i.get_kv_live_bytes());
            tally.info_checks += 1;
        } else if roll < 35 {
            let n = rng.gen_range(1..=8);
            let got = append(&client, &book.id, random_tokens(&mut rng, n));
            book.history += n as u64;
            book.appended += n as u64;
            assert_eq!(got, book.history, "{}: history after append", book.id);
            tally.appends += 1;
        } else if roll < 75 {
            let tokens = generate_to_end(&client, &mut rng, &book);
            book.history += tokens;
            book.generated += tokens;
            tally.tokens_received += tokens;
            tally.generates_completed += 1;
        } else {
            let before = book.history;
            let outcome = generate_and_cancel(&client, &mut rng, &book);
            let after = settled_history(&client, &book.id);
            let committed = after
                .checked_sub(before)
                .unwrap_or_else(|| panic!("{}: history shrank {before} -> {after}", book.id));
            assert!(
                committed >= outcome.received,
                "{}: {} tokens received but only {committed} committed",
                book.id,
                outcome.received
            );
            assert!(committed <= u64::from(outcome.max_tokens), "{}", book.id);
            if committed < u64::from(outcome.max_tokens) {
                tally.cancels_stopped_early += 1;
            }
            if outcome.finished_first {
                assert_eq!(committed, outcome.received, "{}", book.id);
                tally.cancels_after_done += 1;
            }
            book.history = after;
            book.generated += committed;
            tally.tokens_received += outcome.received;
            tally.generates_cancelled += 1;
        }
        give_back(&books, book);
    }
    tally
}

#[test]
fn no_session_token_or_page_is_lost_under_concurrent_load() {
    let began = Instant::now();
    let server = start_server();
    let client = client(&server);
    let at_start = server.runtime_stats();
    assert_eq!(at_start.sessions_created, 1, "the warm-up session");
    assert_eq!(at_start.kv_free_pages, at_start.kv_total_pages);

    let mut rng = StdRng::seed_from_u64(SEED);
    let mut books = Vec::with_capacity(SESSIONS);
    for k in 0..SESSIONS {
        let mut req = pb::CreateSessionRequest::new();
        req.set_client_label(format!("load-{k}"));
        let created = client
            .create_session_opt(&req, call())
            .expect("CreateSession");
        assert_eq!(created.get_vocab_size(), VOCAB);
        assert_eq!(created.get_context_length(), CONTEXT);
        let id = created.get_session_id().to_owned();
        let n = rng.gen_range(4..=16);
        assert_eq!(append(&client, &id, random_tokens(&mut rng, n)), n as u64);
        books.push(Book {
            id,
            history: n as u64,
            appended: n as u64,
            ..Book::default()
        });
    }

    let books = Arc::new(Mutex::new(books));
    let budget = Arc::new(AtomicUsize::new(0));
    let (done_tx, done_rx) = crossbeam_channel::unbounded();
    let threads: Vec<_> = (0..CLIENT_THREADS)
        .map(|t| {
            let (client, books, budget) = (client.clone(), Arc::clone(&books), Arc::clone(&budget));
            let done_tx = done_tx.clone();
            std::thread::spawn(move || {
                let tally = client_thread(client, books, budget, SEED + 1 + t as u64);
                let _ = done_tx.send(());
                tally
            })
        })
        .collect();
    drop(done_tx);
    // A hang anywhere shows up here as a failure, not a stuck test. A thread
    // that panicked never reports; its join below shows the panic.
    let deadline = Instant::now() + RUN_BOUND;
    for finished in 0..CLIENT_THREADS {
        match done_rx.recv_deadline(deadline) {
            Ok(()) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => panic!(
                "only {finished} of {CLIENT_THREADS} client threads finished within \
                 {RUN_BOUND:?}: something hangs; runtime {:?}",
                server.runtime_stats()
            ),
        }
    }
    let mut tally = Tally::default();
    for t in threads {
        let part = t.join().expect("a client thread failed");
        tally.appends += part.appends;
        tally.generates_completed += part.generates_completed;
        tally.generates_cancelled += part.generates_cancelled;
        tally.cancels_after_done += part.cancels_after_done;
        tally.cancels_stopped_early += part.cancels_stopped_early;
        tally.info_checks += part.info_checks;
        tally.tokens_received += part.tokens_received;
    }
    let operations =
        tally.appends + tally.generates_completed + tally.generates_cancelled + tally.info_checks;
    assert_eq!(operations, OPERATIONS, "{tally:?}");
    assert!(
        tally.generates_cancelled > 0 && tally.generates_completed > 0,
        "{tally:?}"
    );

    let under_load = server.runtime_stats();
    let max_batch = under_load
        .workers
        .iter()
        .map(|w| w.max_batch_sequences)
        .max()
        .unwrap_or(0);
    eprintln!(
        "grpc_load: {tally:?}; max batch {max_batch} sequences; {:.1} s",
        began.elapsed().as_secs_f64()
    );
    assert!(
        max_batch > 1,
        "no step ever batched two sessions: {under_load:?}"
    );

    let books = books.lock().expect("books").clone();
    let (mut appended, mut generated) = (0u64, 0u64);
    for book in &books {
        let i = info(&client, &book.id);
        assert_eq!(i.get_history_length(), book.history, "{book:?}");
        assert_eq!(book.history, book.appended + book.generated, "{book:?}");
        assert!(!i.get_busy(), "{book:?}");
        let mut req = pb::CloseSessionRequest::new();
        req.set_session_id(book.id.clone());
        let closed = client
            .close_session_opt(&req, call())
            .expect("CloseSession");
        assert_eq!(closed.get_final_history_length(), book.history, "{book:?}");
        appended += book.appended;
        generated += book.generated;
    }
    assert!(generated >= tally.tokens_received);

    let end = server.runtime_stats();
    assert_eq!(end.sessions_active, 0, "{end:?}");
    assert_eq!(
        end.kv_free_pages, end.kv_total_pages,
        "KV pages leaked: {end:?}"
    );
    assert_eq!(end.sessions_created, SESSIONS as u64 + 1, "{end:?}");
    assert_eq!(end.evicted_close, SESSIONS as u64 + 1, "{end:?}");
    assert_eq!((end.evicted_ttl, end.evicted_lru), (0, 0), "{end:?}");
    assert_eq!(
        (end.inv1_violations, end.inv2_violations),
        (0, 0),
        "{end:?}"
    );
    assert_eq!(end.tokens_generated, generated, "{end:?}");
    assert!(end.tokens_generated >= tally.tokens_received);
    // Every appended token was prefilled once, plus the warm-up's one.
    assert_eq!(end.prefill_tokens, appended + 1, "{end:?}");
    assert!(end.workers.iter().all(|w| w.sessions == 0), "{end:?}");

    // Every stream task has ended; the calls were counted by their outcome.
    let stats = Arc::clone(server.server_stats());
    let give_up = Instant::now() + Duration::from_secs(10);
    while stats.active_streams() > 0 {
        assert!(Instant::now() < give_up, "Generate streams left open");
        std::thread::sleep(Duration::from_millis(5));
    }
    let calls = stats.calls();
    let count = |method: &str, code: &str| {
        calls
            .iter()
            .find(|(m, c, _)| *m == method && *c == code)
            .map_or(0, |(_, _, n)| *n)
    };
    for (method, code, n) in &calls {
        assert!(
            *code == "OK" || (*method == "Generate" && *code == "CANCELLED"),
            "unexpected {n} x {method} {code}: {calls:?}"
        );
    }
    let generates = (tally.generates_completed + tally.generates_cancelled) as u64;
    assert_eq!(
        count("Generate", "OK") + count("Generate", "CANCELLED"),
        generates,
        "{calls:?}"
    );
    // A stream the server finished just before the client's cancel arrived
    // counts OK on the server and CANCELLED on the client, never the reverse.
    assert!(
        count("Generate", "OK") >= (tally.generates_completed + tally.cancels_after_done) as u64,
        "{calls:?} {tally:?}"
    );
    assert_eq!(count("CreateSession", "OK"), SESSIONS as u64);
    assert_eq!(count("CloseSession", "OK"), SESSIONS as u64);
    assert_eq!(
        count("AppendTokens", "OK"),
        (SESSIONS + tally.appends) as u64
    );

    let report = server.shutdown(Duration::from_secs(5));
    assert!(report.drained, "{report:?}");
    assert!(began.elapsed() < RUN_BOUND, "took {:?}", began.elapsed());
}
