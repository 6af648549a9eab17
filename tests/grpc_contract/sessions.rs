//! CONTRACT §2.1, §2.4 and §2.5 through the wire: server-owned ids, the
//! model described in the reply, appends that add up, unknown and closed
//! ids, and a second call on a busy session waiting its turn.

use super::*;

// ---------------------------------------------------------------- §2.1 --

#[test]
fn session_ids_are_server_owned_random_hex_and_the_reply_describes_the_model() {
    let served = Served::tiny(2);
    let label = "0123456789abcdef0123456789abcdef";
    let mut ids = std::collections::HashSet::new();
    let mut workers = std::collections::HashSet::new();
    let n = 200;
    for _ in 0..n {
        let reply = served.try_create(label, &[]).expect("created");
        let id = reply.get_session_id().to_owned();
        assert_eq!(id.len(), 32, "{id}");
        assert!(
            id.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "32 lowercase hex digits: {id}"
        );
        assert_ne!(id, label, "never the client's text");
        assert_eq!(reply.get_vocab_size(), TINY_VOCAB);
        assert_eq!(reply.get_context_length(), TINY_CONTEXT);
        assert!(reply.get_worker() < 2);
        workers.insert(reply.get_worker());
        let info = served.info(&id).expect("info");
        assert_eq!(info.get_worker(), reply.get_worker());
        assert_eq!(info.get_client_label(), label, "kept verbatim");
        ids.insert(id);
    }
    assert_eq!(ids.len(), n, "every id is new");
    assert_eq!(workers.len(), 2, "sessions are spread over the workers");
    // Random bits: every hex position past the first byte (which picks the
    // worker) takes many values over 200 ids, and no two ids share a long
    // common prefix.
    let ids: Vec<&String> = ids.iter().collect();
    for pos in 2..32 {
        let values: std::collections::HashSet<u8> =
            ids.iter().map(|id| id.as_bytes()[pos]).collect();
        assert!(values.len() >= 8, "position {pos} takes {values:?}");
    }
    let longest_shared = ids
        .iter()
        .enumerate()
        .flat_map(|(i, a)| ids[i + 1..].iter().map(move |b| (a, b)))
        .map(|(a, b)| a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count())
        .max()
        .unwrap_or(0);
    assert!(
        longest_shared < 8,
        "ids share {longest_shared} leading digits"
    );
    served.stop();
}

#[test]
fn session_info_echoes_the_eos_ids() {
    let served = Served::tiny(1);
    let id = served.create("eos", &[7, 9]);
    assert_eq!(served.info(&id).expect("info").get_eos_token_ids(), &[7, 9]);
    served.stop();
}

#[test]
fn appends_add_up_and_an_id_outside_the_vocabulary_changes_nothing() {
    let served = Served::tiny(1);
    let id = served.create("append", &[]);
    let empty = served.info(&id).expect("info");
    assert_eq!(empty.get_history_length(), 0);
    assert_eq!(empty.get_logits_digest(), 0, "no logits yet");
    assert_eq!(served.append(&id, &[1, 2, 3]).expect("append"), 3);
    assert_eq!(served.append(&id, &[0, 319]).expect("append"), 5);
    assert_eq!(
        served.append(&id, &[]).expect("append"),
        5,
        "an empty append is a no-op"
    );
    assert_eq!(served.append(&id, &prompt(40, 9)).expect("append"), 45);
    let before = served.info(&id).expect("info");
    assert_eq!(before.get_history_length(), 45);
    assert_ne!(before.get_logits_digest(), 0);

    let err = served
        .append(&id, &[4, TINY_VOCAB, 5])
        .expect_err("token == vocabulary size");
    assert_eq!(err.code, RpcStatusCode::INVALID_ARGUMENT, "{err:?}");
    assert!(err.message.contains("320"), "{err:?}");
    let err = served
        .append(&id, &[u32::MAX])
        .expect_err("far outside the vocabulary");
    assert_eq!(err.code, RpcStatusCode::INVALID_ARGUMENT, "{err:?}");
    let after = served.info(&id).expect("info");
    assert_eq!(after.get_history_length(), 45, "nothing was appended");
    assert_eq!(after.get_logits_digest(), before.get_logits_digest());
    assert_eq!(after.get_kv_live_bytes(), before.get_kv_live_bytes());

    assert_eq!(
        served.append(&id, &[6]).expect("append"),
        46,
        "later appends still work"
    );
    served.stop();
}

// ---------------------------------------------------------------- §2.4 --

#[test]
fn unknown_closed_and_twice_closed_ids_are_not_found() {
    let served = Served::tiny(2);
    // Any id the server does not hold is NOT_FOUND on every RPC, whatever
    // its form: the published SDKs' own tests send `sess-does-not-exist`.
    for unknown in [
        UNKNOWN_ID,
        "sess-does-not-exist",
        "",
        "xyz",
        "00112233445566778899AABBCCDDEEFF",
        "00112233445566778899aabbccddeef",
        "00112233445566778899aabbccddeeff0",
        "0011223344556677-899aabbccddeeff",
        "é0112233445566778899aabbccddeef",
    ] {
        let what = format!("id {unknown:?}");
        assert_code(served.info(unknown), RpcStatusCode::NOT_FOUND, &what);
        assert_code(
            served.append(unknown, &[1]),
            RpcStatusCode::NOT_FOUND,
            &what,
        );
        assert_code(served.close(unknown), RpcStatusCode::NOT_FOUND, &what);
        let outcome = served.generate(gen_req(unknown, 3)).finish(STREAM_TIMEOUT);
        assert_eq!(outcome.failure().code, RpcStatusCode::NOT_FOUND, "{what}");
    }

    let id = served.create("closing", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    assert_eq!(served.close(&id).expect("closed"), 3);
    assert_code(served.close(&id), RpcStatusCode::NOT_FOUND, "second close");
    assert_code(
        served.info(&id),
        RpcStatusCode::NOT_FOUND,
        "info after close",
    );
    assert_code(
        served.append(&id, &[4]),
        RpcStatusCode::NOT_FOUND,
        "append after close",
    );
    let outcome = served.generate(gen_req(&id, 3)).finish(STREAM_TIMEOUT);
    assert_eq!(outcome.failure().code, RpcStatusCode::NOT_FOUND);
    // The warm-up session and this one.
    let stats = served.server().runtime_stats();
    assert_eq!(stats.evicted_close, 2, "{stats:?}");
    assert_eq!(stats.kv_free_pages, stats.kv_total_pages, "KV freed");
    // A failed session (invariant violation) cannot be provoked through the
    // API; the worker's unit tests cover that it is removed and NOT_FOUND.
    served.stop();
}

// ---------------------------------------------------------------- §2.5 --

#[test]
fn a_second_generate_on_a_busy_session_waits_its_turn() {
    let served = Served::slow(1);
    let id = served.create("busy", &[]);
    let base = prompt(8, 1);
    served.append(&id, &base).expect("append");
    let mut first = served.generate(gen_req(&id, 120));
    first.first_token(STREAM_TIMEOUT);
    let second = served.generate(gen_req(&id, 15));
    thread::sleep(Duration::from_millis(20));
    assert!(served.info(&id).expect("info").get_busy());
    let first = first.finish(STREAM_TIMEOUT);
    let second = second.finish(STREAM_TIMEOUT);
    let (first_done, second_done) = (first.done(), second.done());
    assert_eq!(first.tokens().len(), 120);
    assert_eq!(second.tokens().len(), 15, "not rejected");
    assert_eq!(first_done.get_history_length(), 8 + 120);
    assert_eq!(second_done.get_history_length(), 8 + 120 + 15);
    // Never interleaved: the second stream is exactly the greedy
    // continuation of the history the first one left.
    let check = served.create("check", &[]);
    let mut history = base.clone();
    history.extend(first.tokens());
    served.append(&check, &history).expect("append");
    let (continued, _) = served.run(gen_req(&check, 15));
    assert_eq!(second.tokens(), continued);
    assert_eq!(served.digest(&check), served.digest(&id));
    served.stop();
}
