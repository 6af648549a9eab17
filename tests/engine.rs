//! The engine's session operations on a synthetic model: append-only
//! history, all-or-nothing appends, generation stop rules, and seeded
//! sampling that is reproducible whatever the thread count.

use inferd::engine::{Engine, EngineConfig, EngineError, StopReason};
use inferd::kv::KvError;
use inferd::model::ModelError;
use inferd::sampler::SamplingParams;

mod support;
use support::tiny_model;

fn engine(threads: usize, kv_bytes: u64) -> Engine {
    let cfg = EngineConfig {
        threads,
        kv_bytes,
        ..EngineConfig::default()
    };
    Engine::new(tiny_model(), &cfg).expect("engine")
}

fn sampled() -> SamplingParams {
    // A hot temperature: the synthetic model's random weights give peaked
    // distributions, and the test needs draws that depend on the seed.
    SamplingParams {
        temperature: 50.0,
        min_p: 0.01,
        seed: 1234,
        ..SamplingParams::greedy()
    }
}

#[test]
fn generated_tokens_are_committed_to_history() {
    let mut e = engine(2, 8 << 20);
    let mut s = e.new_session();
    e.append(&mut s, &[1, 2, 3]).expect("append");
    let g = e
        .generate(&mut s, &SamplingParams::greedy(), 5, &[], |_| true)
        .expect("generate");
    assert_eq!(g.stop, StopReason::MaxTokens);
    assert_eq!(g.tokens.len(), 5);
    assert_eq!(&s.history()[..3], &[1, 2, 3]);
    assert_eq!(&s.history()[3..], &g.tokens[..]);
    assert_eq!(s.kv_len(), 8);
    let per_position = s.kv_live_bytes() / 8;
    assert!(per_position > 0 && s.kv_live_bytes() == per_position * 8);
}

#[test]
fn a_stop_token_is_emitted_committed_and_ends_the_generation() {
    let mut e = engine(1, 8 << 20);
    let mut s = e.new_session();
    e.append(&mut s, &[5, 6, 7]).expect("append");
    // Find what greedy would say first, then make it a stop token.
    let mut probe = e.new_session();
    e.append(&mut probe, &[5, 6, 7]).expect("append");
    let first = e
        .generate(&mut probe, &SamplingParams::greedy(), 1, &[], |_| true)
        .expect("generate")
        .tokens[0];
    let g = e
        .generate(&mut s, &SamplingParams::greedy(), 10, &[first], |_| true)
        .expect("generate");
    assert_eq!(g.stop, StopReason::Eos);
    assert_eq!(g.tokens, vec![first]);
    assert_eq!(s.history(), &[5, 6, 7, first]);
}

#[test]
fn the_callback_can_stop_a_generation_keeping_what_was_emitted() {
    let mut e = engine(2, 8 << 20);
    let mut s = e.new_session();
    e.append(&mut s, &[9]).expect("append");
    let mut seen = 0;
    let g = e
        .generate(&mut s, &sampled(), 50, &[], |_| {
            seen += 1;
            seen < 3
        })
        .expect("generate");
    assert_eq!(g.stop, StopReason::Cancelled);
    assert_eq!(g.tokens.len(), 3);
    assert_eq!(s.history().len(), 4);
}

#[test]
fn seeded_sampling_is_reproducible_across_thread_counts_and_chunkings() {
    let prompt: Vec<u32> = (0..37).map(|i| (i * 13 + 3) % 300).collect();
    let mut runs = Vec::new();
    for (threads, split) in [(1, 37), (2, 1), (2, 20)] {
        let mut e = engine(threads, 8 << 20);
        let mut s = e.new_session();
        e.append(&mut s, &prompt[..split]).expect("append");
        e.append(&mut s, &prompt[split..]).expect("append");
        runs.push(
            e.generate(&mut s, &sampled(), 24, &[], |_| true)
                .expect("generate")
                .tokens,
        );
    }
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
    let mut other_seed = engine(2, 8 << 20);
    let mut s = other_seed.new_session();
    other_seed.append(&mut s, &prompt).expect("append");
    let params = SamplingParams {
        seed: 99,
        ..sampled()
    };
    let other = other_seed
        .generate(&mut s, &params, 24, &[], |_| true)
        .expect("generate")
        .tokens;
    assert_ne!(
        runs[0], other,
        "a different seed should give a different draw"
    );
}

#[test]
fn failed_appends_change_nothing() {
    // Room for a little over 16 positions (one page) in the whole pool.
    let mut e = engine(1, 1);
    let mut s = e.new_session();
    e.append(&mut s, &[1, 2, 3]).expect("append");
    let before = s.history().to_vec();

    let err = e
        .append(&mut s, &[4, 100_000])
        .expect_err("out of vocabulary");
    assert!(matches!(
        err,
        EngineError::Model(ModelError::TokenOutOfRange { token: 100_000, .. })
    ));
    assert_eq!(s.history(), &before[..]);

    let long: Vec<u32> = (0..40).collect();
    let err = e.append(&mut s, &long).expect_err("pool exhausted");
    match err {
        EngineError::Kv(KvError::Exhausted { wanted, free }) => {
            assert!(wanted > free, "wanted {wanted}, free {free}");
            assert!(err_message_has_numbers(&EngineError::Kv(
                KvError::Exhausted { wanted, free }
            )));
        }
        other => panic!("expected exhaustion, got {other:?}"),
    }
    assert_eq!(s.history(), &before[..]);
    assert_eq!(s.kv_len(), 3);

    let err = e
        .generate(
            &mut e.new_session(),
            &SamplingParams::greedy(),
            1,
            &[],
            |_| true,
        )
        .expect_err("empty history");
    assert!(matches!(err, EngineError::EmptyHistory));
    let bad = SamplingParams {
        temperature: -1.0,
        ..SamplingParams::greedy()
    };
    assert!(matches!(
        e.generate(&mut s, &bad, 1, &[], |_| true),
        Err(EngineError::Sampler(_))
    ));
    assert_eq!(s.history(), &before[..]);
}

fn err_message_has_numbers(e: &EngineError) -> bool {
    let text = e.to_string();
    text.chars().any(|c| c.is_ascii_digit()) && text.contains("wanted")
}
