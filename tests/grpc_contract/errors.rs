//! CONTRACT §2.3 and §2.4 through the wire: every bad argument is
//! INVALID_ARGUMENT naming the bound and changes nothing; exhaustion is
//! RESOURCE_EXHAUSTED with the numbers.

use super::*;

#[test]
fn every_bad_argument_is_invalid_argument_and_changes_nothing() {
    let served = Served::tiny(1);
    let id = served.create("bad", &[]);
    let outcome = served.generate(gen_req(&id, 4)).finish(STREAM_TIMEOUT);
    assert_eq!(
        outcome.failure().code,
        RpcStatusCode::INVALID_ARGUMENT,
        "Generate on an empty history"
    );
    served.append(&id, &[1, 2, 3]).expect("append");
    let digest = served.digest(&id);

    type Spoil = fn(&mut pb::GenerateRequest);
    let bad: [(&str, Spoil); 8] = [
        ("max_tokens 0", |r| r.set_max_tokens(0)),
        ("temperature -1", |r| r.set_temperature(-1.0)),
        ("temperature NaN", |r| r.set_temperature(f32::NAN)),
        // So small that 1/T overflows: refused, never INTERNAL.
        ("temperature 1e-45", |r| r.set_temperature(1e-45)),
        ("temperature below the bound", |r| {
            r.set_temperature(inferd::sampler::MIN_TEMPERATURE / 2.0)
        }),
        ("top_p 0", |r| r.set_top_p(0.0)),
        ("top_p 1.5", |r| r.set_top_p(1.5)),
        ("logit_bias token out of range", |r| {
            let mut bias = pb::LogitBias::new();
            bias.set_token_id(TINY_VOCAB);
            bias.set_bias(-5.0);
            r.mut_logit_bias().push(bias);
        }),
    ];
    // A bad argument is INVALID_ARGUMENT whatever the id: the arguments are
    // checked before the session is looked up, for ids of every form alike.
    for (what, set) in &bad {
        for target in [id.as_str(), UNKNOWN_ID, "sess-does-not-exist", ""] {
            let mut req = gen_req(target, 4);
            set(&mut req);
            let outcome = served.generate(req).finish(STREAM_TIMEOUT);
            assert!(outcome.tokens().is_empty(), "{what}");
            assert_eq!(
                outcome.failure().code,
                RpcStatusCode::INVALID_ARGUMENT,
                "{what}, id {target:?}"
            );
        }
    }
    for target in [UNKNOWN_ID, "sess-does-not-exist", ""] {
        assert_code(
            served.append(target, &[1, TINY_VOCAB]),
            RpcStatusCode::INVALID_ARGUMENT,
            &format!("token outside the vocabulary, id {target:?}"),
        );
    }
    let info = served.info(&id).expect("info");
    assert_eq!(info.get_history_length(), 3, "nothing changed");
    assert_eq!(info.get_logits_digest(), digest);
    assert!(!info.get_busy());
    served.stop();
}

#[test]
fn a_temperature_below_the_bound_names_it_and_the_bound_itself_samples() {
    let served = Served::tiny(1);
    let id = served.create("tiny-temperature", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let mut req = gen_req(&id, 2);
    req.set_temperature(1e-45);
    let outcome = served.generate(req).finish(STREAM_TIMEOUT);
    let status = outcome.failure();
    assert_eq!(status.code, RpcStatusCode::INVALID_ARGUMENT, "{status:?}");
    assert!(status.message.contains("0.00001"), "{status:?}");
    // At the bound it samples (from the argmax or its ties), never failing.
    let mut req = seeded_req(&id, 8, Some(7));
    req.set_temperature(inferd::sampler::MIN_TEMPERATURE);
    let (tokens, _) = served.run(req);
    assert_eq!(tokens.len(), 8);
    served.stop();
}

#[test]
fn a_request_body_that_does_not_parse_is_invalid_argument_on_every_method() {
    let served = Served::tiny(1);
    let runaway_varint = [&b"\x10"[..], &[0xff; 11], b"\x01"].concat();
    let bodies: [(&str, &[u8]); 5] = [
        ("garbage (field number 0)", b"\x00\x01\x02\x03"),
        ("a varint of 12 bytes", &runaway_varint),
        ("a truncated varint", b"\x10\x80"),
        ("field 1 as a fixed32", b"\x0d\x00\x00\x00\x00"),
        ("field 1 not UTF-8", b"\x0a\x02\xff\xfe"),
    ];
    for (method, ty, request_type) in RUNTIME_METHODS {
        for (what, body) in bodies {
            let status = served
                .raw_call(method, ty, body)
                .expect_err("a body that does not parse");
            assert_eq!(
                status.code,
                RpcStatusCode::INVALID_ARGUMENT,
                "{method} with {what}: {status:?}"
            );
            assert!(status.message.contains(request_type), "{status:?}");
        }
    }
    // Nothing was created, and well-formed bytes on the same path work.
    let stats = served.server().runtime_stats();
    assert_eq!(stats.sessions_created, 1, "only the warm-up: {stats:?}");
    let replies = served
        .raw_call(RUNTIME_METHODS[0].0, MethodType::Unary, b"")
        .expect("an empty body is a default request");
    let created =
        pb::CreateSessionResponse::parse_from_bytes(&replies[0]).expect("a response message");
    assert_eq!(created.get_session_id().len(), 32);
    assert!(served.info(created.get_session_id()).is_ok());
    served.stop();
}

/// Checks that `got` is INVALID_ARGUMENT and its message names `numbers`.
fn assert_refused<T: std::fmt::Debug>(got: Result<T, Status>, numbers: &[&str], what: &str) {
    match got {
        Err(s) => {
            assert_eq!(s.code, RpcStatusCode::INVALID_ARGUMENT, "{what}: {s:?}");
            for n in numbers {
                assert!(s.message.contains(n), "{what}: {n} missing from {s:?}");
            }
        }
        Ok(v) => panic!("{what}: expected INVALID_ARGUMENT, got {v:?}"),
    }
}

#[test]
fn fields_over_their_bounds_are_invalid_argument_and_keep_nothing() {
    use inferd::runtime::limits;
    let served = Served::tiny(1);
    let created_before = served.server().runtime_stats().sessions_created;
    // What a session keeps for its life: the label and the EOS ids.
    let long_label = "x".repeat(limits::MAX_CLIENT_LABEL_BYTES + 1);
    assert_refused(
        served.try_create(&long_label, &[]),
        &["257", "256"],
        "label",
    );
    let huge_label = "x".repeat(3_900_000);
    assert_refused(
        served.try_create(&huge_label, &[]),
        &["256"],
        "3.9 MB label",
    );
    let many_eos: Vec<u32> = (0..limits::MAX_EOS_TOKEN_IDS as u32 + 1).collect();
    assert_refused(
        served.try_create("eos", &many_eos),
        &["65", "64"],
        "EOS ids",
    );
    let huge_eos = vec![1u32; 900_000];
    assert_refused(
        served.try_create("eos", &huge_eos),
        &["900000", "64"],
        "EOS ids",
    );
    assert_eq!(
        served.server().runtime_stats().sessions_created,
        created_before,
        "no session was created"
    );
    // At the bounds, it is kept verbatim.
    let label = "é".repeat(limits::MAX_CLIENT_LABEL_BYTES / 2);
    let eos: Vec<u32> = (0..limits::MAX_EOS_TOKEN_IDS as u32).collect();
    let id = served.create(&label, &eos);
    let info = served.info(&id).expect("info");
    assert_eq!(info.get_client_label(), label);
    assert_eq!(info.get_eos_token_ids(), &eos[..]);
    served.close(&id).expect("closed");

    // One append carries at most MAX_APPEND_TOKENS ids.
    let id = served.create("bounds", &[]);
    let too_many = prompt(limits::MAX_APPEND_TOKENS + 1, 3);
    assert_refused(served.append(&id, &too_many), &["65537", "65536"], "append");
    assert_eq!(served.history(&id), 0, "nothing appended");
    served.append(&id, &[1, 2, 3]).expect("append");
    let digest = served.digest(&id);

    // Generate: stop sequences, logit bias, the penalty window.
    type Spoil = fn(&mut pb::GenerateRequest);
    let over: [(&str, &[&str], Spoil); 4] = [
        ("17 stop sequences", &["17", "16"], |r| {
            for _ in 0..=limits::MAX_STOP_SEQUENCES {
                let mut stop = pb::StopSequence::new();
                stop.set_token_ids(vec![7]);
                r.mut_stop_sequences().push(stop);
            }
        }),
        ("a stop sequence of 65 ids", &["65", "64"], |r| {
            let mut stop = pb::StopSequence::new();
            stop.set_token_ids(vec![7; limits::MAX_STOP_SEQUENCE_TOKENS + 1]);
            r.mut_stop_sequences().push(stop);
        }),
        ("1025 logit_bias entries", &["1025", "1024"], |r| {
            for _ in 0..=limits::MAX_LOGIT_BIAS_ENTRIES {
                let mut bias = pb::LogitBias::new();
                bias.set_token_id(5);
                bias.set_bias(0.5);
                r.mut_logit_bias().push(bias);
            }
        }),
        ("penalty_last_n 65537", &["65537", "65536"], |r| {
            r.set_repetition_penalty(1.1);
            r.set_penalty_last_n(limits::MAX_PENALTY_LAST_N + 1);
        }),
    ];
    for (what, numbers, spoil) in over {
        let mut req = gen_req(&id, 4);
        spoil(&mut req);
        let outcome = served.generate(req).finish(STREAM_TIMEOUT);
        assert!(outcome.tokens().is_empty(), "{what}");
        let status = outcome.failure().clone();
        assert_refused::<()>(Err(status), numbers, what);
    }
    let info = served.info(&id).expect("info");
    assert_eq!(info.get_history_length(), 3, "nothing changed");
    assert_eq!(info.get_logits_digest(), digest);

    // Every bound itself is accepted.
    let mut req = gen_req(&id, 2);
    for _ in 0..limits::MAX_STOP_SEQUENCES {
        let mut stop = pb::StopSequence::new();
        stop.set_token_ids(vec![7; limits::MAX_STOP_SEQUENCE_TOKENS]);
        req.mut_stop_sequences().push(stop);
    }
    for _ in 0..limits::MAX_LOGIT_BIAS_ENTRIES {
        let mut bias = pb::LogitBias::new();
        bias.set_token_id(5);
        bias.set_bias(0.001);
        req.mut_logit_bias().push(bias);
    }
    req.set_repetition_penalty(1.1);
    req.set_penalty_last_n(limits::MAX_PENALTY_LAST_N);
    let (tokens, _) = served.run(req);
    assert_eq!(tokens.len(), 2);
    let at_bound = prompt(limits::MAX_APPEND_TOKENS, 5);
    assert!(
        served.append(&id, &at_bound).is_ok(),
        "65536 ids in one append"
    );
    served.stop();
}

#[test]
fn kv_exhaustion_is_resource_exhausted_with_the_numbers_and_changes_nothing() {
    // Tiny model: 256 bytes per position, 4096 per 16 positions over its
    // two layers (a page holds one layer's 16 positions).
    let served = Served::start(
        tiny_model(),
        loopback(RuntimeConfig {
            kv_bytes: 4 * 4096,
            ..runtime_config(1)
        }),
    );
    assert_eq!(served.server().runtime_stats().kv_total_pages, 8);
    let id = served.create("big", &[]);
    served.append(&id, &[1, 2]).expect("append");
    let err = served.append(&id, &prompt(100, 2)).expect_err("too big");
    assert_eq!(err.code, RpcStatusCode::RESOURCE_EXHAUSTED, "{err:?}");
    assert!(
        err.message.contains("KV pages exhausted: 12 asked, 6 free"),
        "how much was asked and how much is free: {err:?}"
    );
    assert_eq!(served.history(&id), 2, "the failed append changed nothing");
    assert_eq!(served.append(&id, &[3]).expect("append"), 3);
    served.stop();
}

#[test]
fn a_full_session_queue_is_resource_exhausted_with_the_numbers() {
    let served = Served::start(
        slow_model(),
        loopback(RuntimeConfig {
            session_queue: 1,
            ..runtime_config(1)
        }),
    );
    let id = served.create("queue", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let mut busy = served.generate(gen_req(&id, 4000));
    busy.first_token(STREAM_TIMEOUT);
    let queued = {
        let client = served.client.clone();
        let (id, opt) = (id.clone(), served.opt());
        thread::spawn(move || {
            let mut req = pb::AppendTokensRequest::new();
            req.set_session_id(id);
            req.set_token_ids(vec![7]);
            client.append_tokens_opt(&req, opt).map_err(status_of)
        })
    };
    // Until the first append sits in the queue, a second one would be taken
    // in its place; wait for the worker to hold it.
    thread::sleep(Duration::from_millis(200));
    let err = served.append(&id, &[8]).expect_err("queue full");
    assert_eq!(err.code, RpcStatusCode::RESOURCE_EXHAUSTED, "{err:?}");
    assert!(
        err.message
            .contains("session wait queue exhausted: 2 asked, 0 free"),
        "{err:?}"
    );
    busy.cancel();
    let queued = queued.join().expect("thread").expect("queued append ran");
    assert!(queued.get_history_length() > 4);
    served.stop();
}
