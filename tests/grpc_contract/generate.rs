//! CONTRACT §2.1 and §2.8 through the wire: EOS, max_tokens, stop
//! sequences, top log-probabilities and the reported seed.

use super::*;

// ------------------------------------------------------- §2.1 EOS, §2.7 --

#[test]
fn eos_is_emitted_counted_committed_then_done() {
    let served = Served::tiny(1);
    let probe = served.create("probe", &[]);
    served.append(&probe, &[5, 6, 7]).expect("append");
    let (first, _) = served.run(gen_req(&probe, 1));
    let eos = first[0];
    let id = served.create("eos", &[eos]);
    served.append(&id, &[5, 6, 7]).expect("append");
    let (tokens, done) = served.run(gen_req(&id, 10));
    assert_eq!(tokens, vec![eos], "the EOS token itself is emitted");
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_EOS);
    assert_eq!(done.get_generated_token_count(), 1, "and counted");
    assert_eq!(done.get_history_length(), 4);
    assert_eq!(served.history(&id), 4, "and committed");
    served.stop();
}

#[test]
fn max_tokens_ends_with_one_done_and_every_token_committed() {
    let served = Served::tiny(1);
    let id = served.create("max", &[]);
    served.append(&id, &prompt(10, 1)).expect("append");
    for round in 0..3u64 {
        let before = served.history(&id);
        let outcome = served.generate(gen_req(&id, 7)).finish(STREAM_TIMEOUT);
        let done = outcome.done();
        assert_eq!(outcome.tokens().len(), 7);
        assert!(
            outcome.messages.iter().all(|m| !m.has_truncated()),
            "round {round}"
        );
        assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_MAX_TOKENS);
        assert_eq!(done.get_generated_token_count(), 7);
        assert_eq!(done.get_history_length(), before + 7);
        assert!(done.get_total_duration_seconds() > 0.0);
        assert!(done.get_total_duration_seconds() >= done.get_prefill_duration_seconds());
        let info = served.info(&id).expect("info");
        assert_eq!(info.get_history_length(), before + 7);
        // The invariant counters are reported, and zero.
        assert_eq!(info.get_cache_invariant_inv1_violations(), 0);
        assert_eq!(info.get_cache_invariant_inv2_violations(), 0);
        assert!(info.get_kv_pages_held() >= 1);
        assert_eq!(
            info.get_kv_live_bytes(),
            info.get_history_length() * 256,
            "tiny model: 256 KV bytes per position"
        );
        assert_eq!(info.get_kv_page_bytes(), 2048, "one layer's 16 positions");
        assert!(!info.get_busy());
    }
    let stats = served.server().runtime_stats();
    assert_eq!((stats.inv1_violations, stats.inv2_violations), (0, 0));
    served.stop();
}

// ---------------------------------------------------------------- §2.8 --

#[test]
fn an_unset_seed_is_reported_and_reproduces_the_stream() {
    let served = Served::tiny(1);
    let run_on_fresh = |seed: Option<u64>| {
        let id = served.create("seed", &[]);
        served.append(&id, &[4, 5, 6]).expect("append");
        let (tokens, done) = served.run(seeded_req(&id, 16, seed));
        (tokens, done.get_seed_used(), served.digest(&id))
    };
    let (tokens, seed_used, digest) = run_on_fresh(None);
    assert_eq!(tokens.len(), 16);
    let replay = run_on_fresh(Some(seed_used));
    assert_eq!(replay, (tokens.clone(), seed_used, digest), "bit for bit");
    let (other_tokens, other_seed, _) = run_on_fresh(None);
    assert_ne!(other_seed, seed_used, "a fresh seed each time");
    assert_ne!(other_tokens, tokens, "and a different stream");
    let (_, fixed, _) = run_on_fresh(Some(42));
    assert_eq!(fixed, 42, "a given seed is reported as used");
    served.stop();
}

#[test]
fn a_stop_sequence_ends_the_stream_with_eos_after_it_is_emitted() {
    let served = Served::tiny(1);
    let probe = served.create("probe", &[]);
    served.append(&probe, &[9, 8]).expect("append");
    let (free, _) = served.run(seeded_req(&probe, 8, Some(99)));
    let stop = free[3..5].to_vec();
    let first_end = (2..=free.len())
        .find(|&k| free[..k].ends_with(&stop))
        .expect("the sequence occurs");
    let id = served.create("stop", &[]);
    served.append(&id, &[9, 8]).expect("append");
    let mut req = seeded_req(&id, 8, Some(99));
    for seq in [vec![319, 319, 319], stop] {
        let mut s = pb::StopSequence::new();
        s.set_token_ids(seq);
        req.mut_stop_sequences().push(s);
    }
    let (tokens, done) = served.run(req);
    assert_eq!(tokens, free[..first_end].to_vec(), "emitted, then stopped");
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_EOS);
    assert_eq!(served.history(&id), 2 + first_end as u64);
    served.stop();
}

#[test]
fn generate_done_names_the_stop_sequence_that_ended_it() {
    let served = Served::tiny(1);
    let id = served.create("stop", &[]);
    served.append(&id, &[9, 8]).expect("append");
    let (free, _) = served.run(gen_req(&id, 2));
    let id = served.create("stop", &[]);
    served.append(&id, &[9, 8]).expect("append");
    let mut req = gen_req(&id, 8);
    for seq in [vec![319, 319], vec![free[0]]] {
        let mut s = pb::StopSequence::new();
        s.set_token_ids(seq);
        req.mut_stop_sequences().push(s);
    }
    let (_, done) = served.run(req);
    assert!(done.has_stop_sequence_index());
    assert_eq!(done.get_stop_sequence_index(), 1);
    served.stop();
}

#[test]
fn generate_done_counts_the_re_prefilled_tokens_of_a_truncation() {
    let served = Served::tiny(1);
    let id = served.create("long", &[]);
    served.append(&id, &prompt(250, 5)).expect("append");
    let (_, done) = served.run(gen_req(&id, 20));
    // When the context filled after 6 tokens, the 4 sink tokens and the
    // 238 most recent were computed again.
    assert_eq!(done.get_prefill_token_count(), 242);
    served.stop();
}

#[test]
fn top_logprobs_follow_every_token() {
    let served = Served::tiny(1);
    let id = served.create("logprobs", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let mut req = gen_req(&id, 3);
    req.set_top_logprobs(2);
    let outcome = served.generate(req).finish(STREAM_TIMEOUT);
    outcome.done();
    // Token, then its report, for every token.
    let payloads: Vec<_> = outcome
        .messages
        .iter()
        .filter(|m| m.has_token_id() || m.has_logprobs())
        .collect();
    assert_eq!(payloads.len(), 6);
    for pair in payloads.chunks(2) {
        assert!(pair[0].has_token_id() && pair[1].has_logprobs());
        let report = pair[1].get_logprobs();
        assert_eq!(report.get_chosen().get_token_id(), pair[0].get_token_id());
        let top = report.get_top();
        assert_eq!(top.len(), 2);
        assert!(top[0].get_logprob() >= top[1].get_logprob());
        assert!(top.iter().all(|t| t.get_logprob() <= 0.0));
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0].get_token_id(), pair[0].get_token_id());
        assert_eq!(top[0].get_logprob(), report.get_chosen().get_logprob());
    }
    served.stop();
}

#[test]
fn too_many_top_logprobs_are_refused() {
    let served = Served::tiny(1);
    let id = served.create("logprobs-refused", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let mut req = gen_req(&id, 3);
    req.set_top_logprobs(21);
    let outcome = served.generate(req).finish(STREAM_TIMEOUT);
    assert!(outcome.messages.is_empty(), "nothing may be generated");
    let status = outcome.failure();
    assert_eq!(status.code, RpcStatusCode::INVALID_ARGUMENT, "{status:?}");
    served.stop();
}
