//! Speculative decoding in the server, through a real `inferd serve` and a
//! stock gRPC client: with `GenerateRequest.speculate` on, a Generate
//! streams the tokens and log-probabilities plain decoding streams, ends
//! the same way (stop ids, stop sequences, max_tokens) and leaves the same
//! history and logits digest, for greedy and seeded sampling with
//! penalties, with prompts appended whole or in chunks, beside batch
//! neighbours and after a restart from the state directory; a cancelled
//! call leaves a history plain decoding could have left; GetSessionInfo and
//! the metrics count what was proposed and accepted. The same with a draft
//! model (`serve --draft-model`), also when drafts are dropped for room;
//! forks and sharers of a prompt's pages continue as plain decoding does;
//! a deadline mid-speculation leaves a whole session; and a model split
//! over shards (which decode plainly) answers what one speculating host
//! answers.

mod support;

use inferd::gguf::GgufFile;
use inferd::proto::kakeya_v1::runtime as pb;
use inferd::tokenizer::Tokenizer;
use std::time::Duration;
use support::{greedy, seeded, Client, Generated, Inferd, REFERENCE};

/// Prompts whose answers copy their context (so lookups propose and many
/// proposals are accepted), and one with nothing to copy.
const PROMPTS: [&str; 3] = [
    "Repeat this code exactly, renaming add to plus:\n\
     def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n\
     def mul(a, b):\n    return a * b\n",
    "Summarise this, quoting its key sentence word for word: The river Arno flows \
     through Florence. In November 1966 it flooded the city, and the water rose above \
     six metres in some streets. Volunteers from many countries came to save the books.",
    "Tell me about your favourite season.",
];

fn serve(extra: &[&str]) -> Inferd {
    support::serve_model(REFERENCE, extra)
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(REFERENCE).expect("model")).expect("tokenizer")
}

/// The chat-formatted tokens of `prompt` as the user's turn.
fn prompt_tokens(tokenizer: &Tokenizer, prompt: &str) -> Vec<u32> {
    let text = format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n");
    tokenizer.encode(&text, false, true).expect("encodes")
}

/// A session holding `tokens`, appended in pieces of `chunk`, with the
/// model's end-of-generation ids as its stop ids.
fn session(client: &Client, tokenizer: &Tokenizer, tokens: &[u32], chunk: usize) -> String {
    let mut req = pb::CreateSessionRequest::new();
    req.set_client_label("speculation test".into());
    req.set_eos_token_ids(tokenizer.eog_tokens().to_vec());
    let id = client
        .rpc
        .create_session(&req)
        .expect("created")
        .take_session_id();
    for piece in tokens.chunks(chunk) {
        client.append(&id, piece).expect("append");
    }
    id
}

/// The requests compared: greedy with log-probabilities, and seeded ones
/// through temperature, the filters and the penalties.
fn requests(id: &str, n: u32) -> Vec<pb::GenerateRequest> {
    let mut penalised = seeded(id, n, 11);
    penalised.set_presence_penalty(0.4);
    penalised.set_frequency_penalty(0.2);
    penalised.set_min_p(0.05);
    penalised.set_top_logprobs(3);
    let mut hot = seeded(id, n, 12);
    hot.set_temperature(1.0);
    vec![greedy(id, n, 2), seeded(id, n, 10), penalised, hot]
}

fn with_speculation(mut req: pb::GenerateRequest, on: bool) -> pb::GenerateRequest {
    req.set_speculate(on);
    req
}

/// What a finished call left: its stream, and the session's history
/// length, logits digest and speculation counts after it.
#[derive(Debug, PartialEq)]
struct Outcome {
    run: Generated,
    history_length: u64,
    digest: u64,
}

fn run(client: &Client, id: &str, req: &pb::GenerateRequest) -> (Outcome, (u64, u64)) {
    let run = client.generate(req);
    assert!(run.error.is_none(), "{:?}", run.error);
    let info = client.info(id).expect("info");
    let counts = (
        info.get_speculation_proposed_token_count(),
        info.get_speculation_accepted_token_count(),
    );
    let outcome = Outcome {
        run,
        history_length: info.get_history_length(),
        digest: info.get_logits_digest(),
    };
    (outcome, counts)
}

/// For each prompt and each of [`requests`]: one session decoding plainly
/// and one speculating (its prompt appended in chunks of 7), called twice
/// with a user turn between, each call's outcome the same in both. The
/// speculating sessions' (proposed, accepted) counts over both calls, per
/// request, prompt after prompt.
fn compare_with_plain(
    client: &Client,
    tokenizer: &Tokenizer,
    prompts: &[&str],
    n: u32,
    shape: impl Fn(pb::GenerateRequest) -> pb::GenerateRequest,
) -> Vec<(u64, u64)> {
    let turn = prompt_tokens(tokenizer, "Again, please.");
    let mut counts = Vec::new();
    for prompt in prompts {
        let tokens = prompt_tokens(tokenizer, prompt);
        for (k, req) in requests("", n).into_iter().map(&shape).enumerate() {
            let plain_id = session(client, tokenizer, &tokens, usize::MAX);
            let fast_id = session(client, tokenizer, &tokens, 7);
            let mut plain_req = with_speculation(req.clone(), false);
            plain_req.set_session_id(plain_id.clone());
            let mut fast_req = with_speculation(req, true);
            fast_req.set_session_id(fast_id.clone());
            let mut session_counts = (0, 0);
            for call in 0..2 {
                // The next call continues both the same way (a user turn,
                // then another answer).
                if call == 1 {
                    client.append(&plain_id, &turn).expect("append");
                    client.append(&fast_id, &turn).expect("append");
                }
                let (plain, none) = run(client, &plain_id, &plain_req);
                let (fast, fast_counts) = run(client, &fast_id, &fast_req);
                assert_eq!(none, (0, 0), "plain decoding proposed nothing");
                assert_eq!(fast, plain, "{prompt:?}, request {k}, call {call}");
                // The session's counts sum both calls'.
                session_counts = fast_counts;
            }
            counts.push(session_counts);
            client.close(&plain_id).expect("close");
            client.close(&fast_id).expect("close");
        }
    }
    counts
}

#[test]
fn speculation_streams_plain_decodings_tokens_and_leaves_the_same_session() {
    if !support::have_reference() {
        return;
    }
    let tokenizer = tokenizer();
    let server = serve(&["--metrics-listen", "127.0.0.1:0"]);
    let client = Client::connect(&server.addr);
    let counts = compare_with_plain(&client, &tokenizer, &PROMPTS, 96, |r| r);
    let (proposed, accepted) = counts.iter().fold((0, 0), |(p, a), c| (p + c.0, a + c.1));
    eprintln!("{accepted} of {proposed} proposed tokens accepted");
    assert!(
        accepted > 0 && proposed >= accepted,
        "{accepted} of {proposed}"
    );
    let scraped = support::scrape(server.metrics.as_deref().expect("metrics"));
    assert_eq!(
        support::sample(&scraped, "inferd_speculation_proposed_tokens_total"),
        Some(proposed as f64)
    );
    assert_eq!(
        support::sample(&scraped, "inferd_speculation_accepted_tokens_total"),
        Some(accepted as f64)
    );
}

/// A record to copy under a schema that holds it, and the schema.
const RECORD_PROMPTS: [&str; 2] = [
    "Copy this record exactly as JSON: {\"name\": \"Ada Lovelace\", \"born\": 1815, \
     \"field\": \"mathematics\", \"tags\": [\"engine\", \"notes\", \"poetry\"]}",
    "Tell me about your favourite season, as JSON.",
];
const RECORD_SCHEMA: &str = r#"{"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "born": {"type": "integer"},
    "field": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
    "required": ["name", "born", "field", "tags"], "additionalProperties": false}"#;

/// `req` held to [`RECORD_SCHEMA`].
fn constrained(mut req: pb::GenerateRequest) -> pb::GenerateRequest {
    let mut c = pb::OutputConstraint::new();
    c.set_json_schema(RECORD_SCHEMA.into());
    req.set_constraint(c);
    req
}

#[test]
fn constrained_calls_speculate_under_each_rows_mask() {
    if !support::have_reference() {
        return;
    }
    let tokenizer = tokenizer();
    let server = serve(&[]);
    let client = Client::connect(&server.addr);
    let counts = compare_with_plain(&client, &tokenizer, &RECORD_PROMPTS, 96, constrained);
    let (proposed, accepted) = counts.iter().fold((0, 0), |(p, a), c| (p + c.0, a + c.1));
    eprintln!("constrained: {accepted} of {proposed} proposed tokens accepted");
    // The record is copied through the grammar: most of it by proposals.
    assert!(
        accepted >= 20 && proposed >= accepted,
        "{accepted} of {proposed}"
    );
}

#[test]
fn stops_limits_and_cancels_end_where_plain_decoding_ends() {
    if !support::have_reference() {
        return;
    }
    let tokenizer = tokenizer();
    let server = serve(&[]);
    let client = Client::connect(&server.addr);
    let tokens = prompt_tokens(&tokenizer, PROMPTS[0]);
    let plain_id = session(&client, &tokenizer, &tokens, usize::MAX);
    let (whole, _) = run(
        &client,
        &plain_id,
        &with_speculation(greedy(&plain_id, 80, 0), false),
    );
    let generated = &whole.run.tokens;
    assert!(generated.len() > 30, "{} tokens", generated.len());

    // A stop sequence from the middle of the answer, and a max_tokens that
    // ends a proposal's run early.
    let mut stop = pb::StopSequence::new();
    stop.set_token_ids(generated[20..22].to_vec());
    for edit in [
        Box::new(move |r: &mut pb::GenerateRequest| r.set_stop_sequences(vec![stop.clone()].into()))
            as Box<dyn Fn(&mut pb::GenerateRequest)>,
        Box::new(|r: &mut pb::GenerateRequest| r.set_max_tokens(17)),
    ] {
        let mut outcomes = Vec::new();
        for on in [false, true] {
            let id = session(&client, &tokenizer, &tokens, usize::MAX);
            let mut req = with_speculation(greedy(&id, 80, 0), on);
            edit(&mut req);
            outcomes.push(run(&client, &id, &req).0);
        }
        assert_eq!(outcomes[1], outcomes[0]);
        assert!(outcomes[0].run.tokens.len() < generated.len());
    }

    // A client that goes away mid-stream: whatever the session kept is a
    // prefix of the answer, its last position computed (the digest of the
    // same history built by appending).
    let id = session(&client, &tokenizer, &tokens, usize::MAX);
    let cut =
        client.generate_watching(&with_speculation(greedy(&id, 80, 0), true), Some(9), |_| {});
    assert_eq!(cut.tokens, generated[..9]);
    let info = support::retry_unavailable(Duration::from_secs(30), || {
        let info = client.info(&id).expect("info");
        let mut done = Generated::default();
        if !info.get_busy() {
            done.done = Some((0, info.get_history_length()));
        } else {
            done.error = Some((14, "busy".into()));
        }
        done
    });
    let kept = info.done.expect("idle").1 as usize - tokens.len();
    assert!(kept >= 9 && kept <= generated.len(), "kept {kept}");
    let rebuilt = session(&client, &tokenizer, &tokens, usize::MAX);
    client.append(&rebuilt, &generated[..kept]).expect("append");
    assert_eq!(
        client.info(&id).expect("info").get_logits_digest(),
        client.info(&rebuilt).expect("info").get_logits_digest(),
        "the cancelled session's logits"
    );
}

#[test]
fn speculative_tokens_do_not_depend_on_neighbours_or_a_restart() {
    if !support::have_reference() {
        return;
    }
    let tokenizer = tokenizer();
    let tokens = prompt_tokens(&tokenizer, PROMPTS[1]);
    let dir = tempfile::tempdir().expect("temp dir");
    let state = dir.path().join("state");
    let state = state.to_str().expect("UTF-8 path");
    let mut server = serve(&["--state-dir", state]);
    let client = Client::connect(&server.addr);
    let kept = session(&client, &tokenizer, &tokens, usize::MAX);
    let alone_id = session(&client, &tokenizer, &tokens, usize::MAX);
    let mut req = seeded(&alone_id, 64, 5);
    req.set_top_logprobs(2);
    let alone = client.generate(&with_speculation(req.clone(), false));
    assert!(alone.error.is_none(), "{:?}", alone.error);

    // Four at once on two workers, speculating or not, in shared steps.
    std::thread::scope(|scope| {
        let runs: Vec<_> = (0..4)
            .map(|k| {
                let (addr, tokenizer, tokens, req) = (&server.addr, &tokenizer, &tokens, &req);
                scope.spawn(move || {
                    let client = Client::connect(addr);
                    let id = session(&client, tokenizer, tokens, 5 + k);
                    let mut req = with_speculation(req.clone(), k != 3);
                    req.set_session_id(id);
                    client.generate(&req)
                })
            })
            .collect();
        for run in runs {
            assert_eq!(run.join().expect("a run"), alone, "beside neighbours");
        }
    });

    // After a restart, in the session the state directory kept.
    server.signal("TERM");
    server.wait_exit(Duration::from_secs(60)).expect("stops");
    let server = serve(&["--state-dir", state]);
    let client = Client::connect(&server.addr);
    let mut again = with_speculation(req, true);
    again.set_session_id(kept.clone());
    let restored = support::retry_unavailable(Duration::from_secs(60), || client.generate(&again));
    assert_eq!(restored, alone, "after a restart");
    let info = client.info(&kept).expect("info");
    assert!(info.get_speculation_proposed_token_count() > 0);
}

/// Gemma 3 270M through the server, its history past the sliding window
/// (512), where the worker gives window pages back after each step: the
/// refused positions are dropped before that, and the answers stay plain
/// decoding's.
#[test]
fn gemma_past_its_window_gives_plain_decodings_answers() {
    if !support::have_gemma() {
        return;
    }
    let server = support::serve_model(support::GEMMA, &[]);
    let client = Client::connect(&server.addr);
    let tokenizer =
        Tokenizer::from_gguf(&GgufFile::open(support::GEMMA).expect("model")).expect("tokenizer");
    let passage = "The river Arno flows through Florence from east to west. In November \
                   1966 it flooded the city, and volunteers came to save the books. ";
    let mut tokens = tokenizer.encode(passage, true, true).expect("encodes");
    while tokens.len() < 540 {
        tokens.extend(tokenizer.encode(passage, false, true).expect("encodes"));
    }
    let mut accepted = 0;
    for (k, req) in requests("", 48).into_iter().enumerate() {
        let mut outcomes = Vec::new();
        for on in [false, true] {
            let id = session(&client, &tokenizer, &tokens, 100);
            let mut req = with_speculation(req.clone(), on);
            req.set_session_id(id.clone());
            let (outcome, counts) = run(&client, &id, &req);
            accepted += counts.1;
            outcomes.push(outcome);
        }
        assert_eq!(outcomes[1], outcomes[0], "request {k}");
    }
    assert!(accepted > 0, "nothing was accepted");
}

/// `serve --draft-model`: the reference model drafting for itself (three
/// tokens a step, so that it proposes although its steps cost as much as
/// the main model's) through the same checks as a lookup: the tokens,
/// log-probabilities, history and digest of plain decoding, over two calls
/// on a session, greedy (its proposals accepted) and seeded (refused more
/// often).
#[test]
fn a_draft_model_in_the_server_gives_plain_decodings_tokens() {
    if !support::have_reference() {
        return;
    }
    let tokenizer = tokenizer();
    let server = serve(&[
        "--draft-model",
        REFERENCE,
        "--draft-tokens",
        "3",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let client = Client::connect(&server.addr);
    let counts = compare_with_plain(&client, &tokenizer, &PROMPTS[..2], 64, |r| r);
    // Greedy (each prompt's first request): the draft proposes the main
    // model's own greedy tokens, so nearly all are accepted.
    for greedy_counts in counts.iter().step_by(requests("", 0).len()) {
        let (proposed, accepted) = greedy_counts;
        assert!(accepted * 10 >= proposed * 9, "greedy: {greedy_counts:?}");
    }
    let (proposed, accepted) = counts.iter().fold((0, 0), |(p, a), c| (p + c.0, a + c.1));
    eprintln!("draft: {accepted} of {proposed} proposed tokens accepted");
    assert!(
        accepted > 0 && proposed > accepted,
        "{accepted} of {proposed}"
    );
    let scraped = support::scrape(server.metrics.as_deref().expect("metrics"));
    assert_eq!(
        support::sample(&scraped, "inferd_speculation_proposed_tokens_total"),
        Some(proposed as f64)
    );
    // A draft knows nothing of a call's grammar: its proposals are cut to
    // what the grammar takes, then verified under each row's mask.
    let counts = compare_with_plain(&client, &tokenizer, &RECORD_PROMPTS[..1], 64, constrained);
    let (proposed, accepted) = counts.iter().fold((0, 0), |(p, a), c| (p + c.0, a + c.1));
    eprintln!("draft, constrained: {accepted} of {proposed} proposed tokens accepted");
    assert!(
        accepted > 0 && proposed >= accepted,
        "{accepted} of {proposed}"
    );
}

/// Drafts in a small pool: three sessions with one long prompt on two
/// workers, so that one worker holds two of them while its draft pages
/// (half of the draft's share, which holds as many positions as the main
/// model's) are enough for one. They generate one by one, staying open,
/// a call's draft dropping an idle session's; then all are called again
/// at once (a draft that finds no room proposes nothing, a dropped one is
/// fed again). Every stream is plain decoding's, and the metrics count the
/// drops.
#[test]
fn drafts_dropped_for_room_leave_the_tokens_unchanged() {
    if !support::have_reference() {
        return;
    }
    let tokenizer = tokenizer();
    let tokens = prompt_tokens(&tokenizer, &PROMPTS[1].repeat(6));
    let turn = prompt_tokens(&tokenizer, "Again, please.");
    // 64 MiB: 32 for the main model (about 1,450 positions: the three
    // sessions), 16 for each worker's drafts (about 720 positions: one of
    // these sessions, not two).
    let server = serve(&[
        "--kv-mib",
        "64",
        "--draft-model",
        REFERENCE,
        "--draft-tokens",
        "3",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let client = Client::connect(&server.addr);
    let generate = |client: &Client, id: &str, speculate: bool| {
        let run = client.generate(&with_speculation(greedy(id, 40, 0), speculate));
        assert!(run.error.is_none(), "{:?}", run.error);
        run
    };
    let plain_id = session(&client, &tokenizer, &tokens, usize::MAX);
    let first = generate(&client, &plain_id, false);
    client.append(&plain_id, &turn).expect("append");
    let second = generate(&client, &plain_id, false);
    client.close(&plain_id).expect("close");
    let ids: Vec<String> = (0..3)
        .map(|k| {
            let id = session(&client, &tokenizer, &tokens, 50 + k);
            assert_eq!(generate(&client, &id, true), first, "session {k}");
            client.append(&id, &turn).expect("append");
            id
        })
        .collect();
    std::thread::scope(|scope| {
        let runs: Vec<_> = (ids.iter())
            .map(|id| {
                let (addr, generate) = (&server.addr, &generate);
                scope.spawn(move || generate(&Client::connect(addr), id, true))
            })
            .collect();
        for run in runs {
            assert_eq!(run.join().expect("a run"), second, "at once");
        }
    });
    let scraped = support::scrape(server.metrics.as_deref().expect("metrics"));
    let dropped = support::sample(&scraped, "inferd_draft_kv_dropped_total").unwrap_or(0.0);
    let accepted = support::sample(&scraped, "inferd_speculation_accepted_tokens_total");
    eprintln!("{dropped} drafts dropped, {accepted:?} tokens accepted");
    assert!(dropped >= 1.0, "{dropped} drafts dropped");
    assert!(accepted.is_some_and(|a| a > 0.0));
    // The pools' size is the draft's half of the budget; the open
    // sessions' drafts hold some of it.
    let pool = support::sample(&scraped, "inferd_draft_kv_pool_bytes").unwrap_or(0.0);
    let held = support::sample(&scraped, "inferd_draft_kv_held_bytes").unwrap_or(0.0);
    assert!(
        pool > 30.0 * 1048576.0 && pool <= 32.0 * 1048576.0,
        "{pool}"
    );
    assert!(held > 0.0 && held <= pool, "{held} of {pool}");
}

/// A model split over two shards decodes plainly (the shards hold the KV
/// and take no rewind), so a Generate asking for speculation there gives
/// what one host gives while it speculates: the same tokens,
/// log-probabilities, history and digest, with nothing proposed.
#[test]
fn a_shard_split_gives_what_one_speculating_host_gives() {
    if !support::have_reference() {
        return;
    }
    let tokenizer = tokenizer();
    let one_host = serve(&[]);
    let (_shards, list) = Inferd::shards(&["0..15", "15..30"]);
    let split = serve(&["--shards", &list]);
    let (here, there) = (
        Client::connect(&one_host.addr),
        Client::connect(&split.addr),
    );
    let mut proposed = 0;
    for prompt in &PROMPTS[..2] {
        let tokens = prompt_tokens(&tokenizer, prompt);
        for (k, req) in requests("", 40).into_iter().enumerate() {
            let mut outcomes = Vec::new();
            for client in [&here, &there] {
                let id = session(client, &tokenizer, &tokens, 11);
                let mut req = with_speculation(req.clone(), true);
                req.set_session_id(id.clone());
                let (outcome, counts) = run(client, &id, &req);
                outcomes.push((outcome, counts));
                client.close(&id).expect("close");
            }
            assert_eq!(outcomes[1].0, outcomes[0].0, "{prompt:?}, request {k}");
            assert_eq!(outcomes[1].1, (0, 0), "the shards proposed nothing");
            proposed += outcomes[0].1 .0;
        }
    }
    assert!(proposed > 0, "the one host speculated");
}

/// A deadline that runs out while a session speculates: the call ends
/// DEADLINE_EXCEEDED within a step or so, and the session keeps a prefix of
/// plain decoding's answer with its last position computed (the digest of
/// that history built by appending) and takes the next call as usual.
#[test]
fn a_deadline_mid_speculation_leaves_a_whole_session() {
    if !support::have_reference() {
        return;
    }
    let tokenizer = tokenizer();
    let server = serve(&[]);
    let client = Client::connect(&server.addr);
    let tokens = prompt_tokens(&tokenizer, PROMPTS[1]);
    let plain_id = session(&client, &tokenizer, &tokens, usize::MAX);
    let whole = client.generate(&with_speculation(greedy(&plain_id, 300, 0), false));
    assert!(whole.error.is_none(), "{:?}", whole.error);

    let id = session(&client, &tokenizer, &tokens, usize::MAX);
    let req = with_speculation(greedy(&id, 300, 0), true);
    let started = std::time::Instant::now();
    let mut stream = client
        .rpc
        .generate_opt(
            &req,
            grpcio::CallOption::default().timeout(Duration::from_millis(400)),
        )
        .expect("stream");
    let mut streamed = Vec::new();
    let mut code = None;
    while let Some(item) = futures_executor::block_on(futures_util::StreamExt::next(&mut stream)) {
        match item {
            Ok(msg) if msg.has_done() => break,
            Ok(msg) if !msg.has_logprobs() && !msg.has_truncated() => {
                streamed.push(msg.get_token_id())
            }
            Ok(_) => {}
            Err(grpcio::Error::RpcFailure(status)) => {
                code = Some(status.code());
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(code, Some(grpcio::RpcStatusCode::DEADLINE_EXCEEDED));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(streamed.len() < whole.tokens.len(), "the deadline cut it");
    assert_eq!(streamed, whole.tokens[..streamed.len()]);
    let info = support::retry_unavailable(Duration::from_secs(30), || {
        let info = client.info(&id).expect("info");
        let mut done = Generated::default();
        if info.get_busy() {
            done.error = Some((14, "busy".into()));
        } else {
            done.done = Some((0, info.get_history_length()));
        }
        done
    });
    let kept = info.done.expect("idle").1 as usize - tokens.len();
    assert!(
        kept >= streamed.len() && kept <= whole.tokens.len(),
        "kept {kept}"
    );
    let rebuilt = session(&client, &tokenizer, &tokens, usize::MAX);
    client
        .append(&rebuilt, &whole.tokens[..kept])
        .expect("append");
    assert_eq!(
        client.info(&id).expect("info").get_logits_digest(),
        client.info(&rebuilt).expect("info").get_logits_digest(),
        "the session's logits after the deadline"
    );
    // The next call goes on from there as plain decoding would.
    let mut next = with_speculation(greedy(&id, 8, 0), true);
    next.set_session_id(id.clone());
    let mut plain_next = with_speculation(greedy(&rebuilt, 8, 0), false);
    plain_next.set_session_id(rebuilt.clone());
    assert_eq!(client.generate(&next), client.generate(&plain_next));
}

/// Forks and shared prefixes under speculation: a session that speculated
/// is forked at its end and short of it, and sessions with one prompt
/// share its pages; every fork and sharer, speculating (by lookup, and
/// with a draft model), continues as a plain session with the same
/// history does.
#[test]
fn forks_and_shared_prefixes_continue_as_plain_decoding_does() {
    if !support::have_reference() {
        return;
    }
    let tokenizer = tokenizer();
    let tokens = prompt_tokens(&tokenizer, PROMPTS[0]);
    for extra in [
        &[][..],
        &["--draft-model", REFERENCE, "--draft-tokens", "3"],
    ] {
        let server = serve(extra);
        let client = Client::connect(&server.addr);
        let source = session(&client, &tokenizer, &tokens, usize::MAX);
        let first = client.generate(&with_speculation(greedy(&source, 40, 0), true));
        assert!(first.error.is_none(), "{:?}", first.error);
        let length = client.info(&source).expect("info").get_history_length();
        for at in [length, length - 17] {
            let fork = client.fork(&source, at);
            // The same history built by appending, decoded plainly.
            let plain = session(&client, &tokenizer, &tokens, usize::MAX);
            let kept = at as usize - tokens.len();
            client
                .append(&plain, &first.tokens[..kept])
                .expect("append");
            let mut req = with_speculation(seeded(&fork, 40, 3), true);
            let forked = client.generate(&req);
            req = with_speculation(seeded(&plain, 40, 3), false);
            assert_eq!(forked, client.generate(&req), "{extra:?}, fork at {at}");
            assert_eq!(
                client.info(&fork).expect("info").get_logits_digest(),
                client.info(&plain).expect("info").get_logits_digest(),
            );
        }
        // Sharers of the prompt's pages, one after another, speculating.
        for k in 0..2 {
            let sharer = session(&client, &tokenizer, &tokens, 13 + k);
            let run = client.generate(&with_speculation(greedy(&sharer, 40, 0), true));
            assert_eq!(run, first, "{extra:?}, sharer {k}");
        }
    }
}
