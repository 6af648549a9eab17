//! Prompt-lookup speculation in the engine (`Engine::generate_speculative`)
//! gives plain decoding's tokens, to the bit, for greedy and seeded
//! sampling with penalties, on the reference model (where the history
//! repeats itself, so proposals are made and many accepted) and on the
//! synthetic model with random weights (where most are refused, so the
//! roll-back path runs every step); and it needs fewer forward passes where
//! the history repeats. A draft model's proposals (`Draft`) are verified
//! the same way: the same tokens whether the draft agrees with the main
//! model (itself) or not (another model of the same vocabulary). So are a
//! constrained generation's, each proposed position under its own mask.

mod support;

use inferd::engine::{Draft, Engine, EngineConfig, Proposer};
use inferd::gguf::synthetic::SyntheticLlama;
use inferd::gguf::GgufFile;
use inferd::model::Model;
use inferd::quant::GgmlType;
use inferd::sampler::SamplingParams;
use inferd::speculate::Lookup;
use inferd::tokenizer::Tokenizer;
use std::sync::Arc;

/// The sampling set-ups compared: greedy, and seeded ones through
/// temperature, the filters and the penalties.
fn setups() -> Vec<SamplingParams> {
    let seeded = |seed, temperature| SamplingParams {
        temperature,
        top_k: 40,
        top_p: 0.9,
        seed,
        ..SamplingParams::greedy()
    };
    vec![
        SamplingParams::greedy(),
        SamplingParams {
            repetition_penalty: 1.1,
            ..SamplingParams::greedy()
        },
        seeded(7, 0.7),
        seeded(8, 1.0),
        SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.3,
            min_p: 0.05,
            ..seeded(9, 0.8)
        },
    ]
}

/// Engines here compute on two threads.
fn two_threads() -> EngineConfig {
    EngineConfig {
        threads: 2,
        ..EngineConfig::default()
    }
}

/// The reference model and its tokenizer.
fn reference() -> (Arc<Model>, Tokenizer) {
    let model = Arc::new(Model::load(support::REFERENCE).expect("model"));
    let tokenizer = Tokenizer::from_gguf(model.gguf()).expect("tokenizer");
    (model, tokenizer)
}

/// A synthetic model, through the real loader.
fn synthetic(cfg: SyntheticLlama) -> Arc<Model> {
    let file = GgufFile::from_bytes(cfg.build()).expect("parses");
    Arc::new(Model::from_gguf(Arc::new(file)).expect("loads"))
}

/// Plain and prompt-lookup runs of `prompt` under every setup: see
/// [`compare_with`].
fn compare(model: Arc<Model>, prompt: &[u32], max: usize, stops: &[u32]) -> (u64, u64, u64, u64) {
    compare_with(model, prompt, max, stops, || Box::new(Lookup::default()))
}

/// Plain runs of `prompt` under every setup, and runs verifying what a
/// fresh proposer from `proposer` proposes: the same tokens and stop,
/// history, KV length and next logits; returns the proposed and accepted
/// counts and the forward passes (speculative, plain) over all of them.
fn compare_with(
    model: Arc<Model>,
    prompt: &[u32],
    max: usize,
    stops: &[u32],
    proposer: impl Fn() -> Box<dyn Proposer>,
) -> (u64, u64, u64, u64) {
    let mut engine = Engine::new(model, &two_threads()).expect("engine");
    let (mut proposed, mut accepted, mut steps, mut plain_steps) = (0, 0, 0, 0);
    for (k, params) in setups().iter().enumerate() {
        let mut plain = engine.new_session();
        engine.append(&mut plain, prompt).expect("append");
        let want = engine
            .generate(&mut plain, params, max, stops, |_| true)
            .expect("plain");
        let mut fast = engine.new_session();
        engine.append(&mut fast, prompt).expect("append");
        let mut streamed = Vec::new();
        let mut proposer = proposer();
        let (got, counts) = engine
            .generate_proposed(
                &mut fast,
                proposer.as_mut(),
                params,
                max,
                stops,
                None,
                |t| {
                    streamed.push(t);
                    true
                },
            )
            .expect("speculative");
        assert_eq!(got, want, "setup {k}");
        assert_eq!(streamed, want.tokens, "setup {k}: tokens as they came");
        assert_eq!(fast.history(), plain.history(), "setup {k}");
        assert_eq!(fast.kv_len(), plain.kv_len(), "setup {k}");
        assert_eq!(
            fast.next_logits(),
            plain.next_logits(),
            "setup {k}: the next logits"
        );
        proposed += counts.proposed;
        accepted += counts.accepted;
        steps += counts.steps;
        plain_steps += want.tokens.len() as u64;
    }
    // Later proposals were sized by what these passes took.
    let costs = engine.verification_costs();
    assert!(costs.step().is_some(), "no verification pass was timed");
    (proposed, accepted, steps, plain_steps)
}

#[test]
fn speculation_gives_plain_decodings_tokens_on_the_reference_model() {
    if !support::have_reference() {
        return;
    }
    let (model, tokenizer) = reference();
    let code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n\
                def mul(a, b):\n    return a * b\n";
    let text = format!(
        "<|im_start|>user\nRepeat this code exactly, renaming add to plus:\n{code}<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let prompt = tokenizer.encode(&text, false, true).expect("encode");
    let stops = tokenizer.eog_tokens().to_vec();
    let (proposed, accepted, steps, plain_steps) = compare(model, &prompt, 96, &stops);
    eprintln!(
        "reference: {accepted} of {proposed} proposed accepted; {steps} forward passes for \
         {plain_steps} tokens"
    );
    assert!(accepted > 0, "nothing was accepted");
    assert!(
        steps < plain_steps,
        "{steps} passes for {plain_steps} tokens"
    );
}

/// Gemma 3 270M, whose sliding-window layers give pages back as the
/// history grows past their window (512): a history past it, which the
/// model goes on copying, so that proposals are accepted and refused runs
/// are rolled back where window pages are being given back.
#[test]
fn speculation_gives_plain_decodings_tokens_on_gemma_past_its_window() {
    if !support::have_gemma() {
        return;
    }
    let path = support::GEMMA;
    let model = Arc::new(Model::load(path).expect("model"));
    let tokenizer = Tokenizer::from_gguf(&GgufFile::open(path).expect("gguf")).expect("tokenizer");
    let passage = "The river Arno flows through Florence from east to west. In November \
                   1966 it flooded the city, and volunteers came to save the books. ";
    let mut prompt = tokenizer.encode(passage, true, true).expect("encode");
    while prompt.len() < 540 {
        prompt.extend(tokenizer.encode(passage, false, true).expect("encode"));
    }
    let (proposed, accepted, steps, plain_steps) = compare(model, &prompt, 48, &[]);
    eprintln!(
        "gemma: {accepted} of {proposed} proposed accepted; {steps} forward passes for \
         {plain_steps} tokens"
    );
    assert!(accepted > 0, "nothing was accepted");
}

#[test]
fn speculation_gives_plain_decodings_tokens_when_proposals_fail() {
    // A prompt that repeats itself, so that lookups propose; the random
    // weights seldom agree, so roll-backs run.
    let prompt: Vec<u32> = (0..48).map(|i| 1 + (i % 12) as u32).collect();
    let (proposed, _, _, _) = compare(support::tiny_model(), &prompt, 40, &[]);
    assert!(proposed > 0, "nothing was proposed");
}

/// A draft engine for `model` drafting for `main` (two threads, the
/// default KV budget), proposing 3 tokens a step: a draft as costly as the
/// main model never pays, so sized proposals would be none.
fn draft_of(model: &Arc<Model>, main: &Model) -> Box<dyn Proposer> {
    let draft = Draft::new(Arc::clone(model), &two_threads(), main).expect("draft");
    Box::new(draft.with_fixed_length(Some(3)))
}

#[test]
fn a_draft_model_gives_plain_decodings_tokens_whether_it_agrees_or_not() {
    let main = support::tiny_model();
    let prompt: Vec<u32> = (0..24).map(|i| 1 + (i * 7 % 50) as u32).collect();
    // The main model as its own draft: greedy proposals are accepted.
    let (proposed, accepted, steps, plain_steps) =
        compare_with(Arc::clone(&main), &prompt, 40, &[], || {
            draft_of(&main, &main)
        });
    assert!(
        accepted > 0 && steps < plain_steps,
        "{accepted}/{proposed}, {steps} passes"
    );
    // Another model of the same vocabulary: most proposals are refused.
    let other = SyntheticLlama {
        n_layers: 1,
        seed: 99,
        weight_type: GgmlType::Q8_0,
        ..SyntheticLlama::tiny()
    };
    let other = synthetic(other);
    let (proposed, _, _, _) = compare_with(Arc::clone(&main), &prompt, 40, &[], || {
        draft_of(&other, &main)
    });
    assert!(proposed > 0, "nothing was proposed");
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused() {
    let main = support::tiny_model();
    let small = SyntheticLlama {
        vocab: 300,
        ..SyntheticLlama::tiny()
    };
    let small = synthetic(small);
    let err = Draft::new(small, &EngineConfig::default(), &main)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("300 tokens"), "{err}");
}

#[test]
fn the_reference_model_drafting_for_itself_gives_plain_decodings_tokens() {
    if !support::have_reference() {
        return;
    }
    let (model, tokenizer) = reference();
    let text = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n\
                <|im_start|>assistant\n";
    let prompt = tokenizer.encode(text, false, true).expect("encode");
    let stops = tokenizer.eog_tokens().to_vec();
    let (proposed, accepted, steps, plain_steps) =
        compare_with(Arc::clone(&model), &prompt, 64, &stops, || {
            draft_of(&model, &model)
        });
    eprintln!("draft: {accepted} of {proposed}; {steps} passes for {plain_steps} tokens");
    assert!(accepted > 0 && steps < plain_steps);
}

#[test]
fn a_draft_too_slow_to_pay_proposes_nothing() {
    // The main model drafting for itself costs a whole decode step per
    // proposed token: no proposal can pay, so sized proposals are none.
    let main = support::tiny_model();
    let prompt: Vec<u32> = (0..24).map(|i| 1 + (i * 7 % 50) as u32).collect();
    let cfg = two_threads();
    let (proposed, _, steps, plain_steps) =
        compare_with(Arc::clone(&main), &prompt, 40, &[], || {
            Box::new(Draft::new(Arc::clone(&main), &cfg, &main).expect("draft"))
        });
    assert_eq!((proposed, steps), (0, plain_steps));
}

#[test]
fn constrained_speculation_gives_plain_constrained_decodings_tokens() {
    if !support::have_reference() {
        return;
    }
    use inferd::constraint::{ConstraintCompiler, ConstraintSpec};
    let (model, tokenizer) = reference();
    let vocab = model.config.vocab;
    let compiler = ConstraintCompiler::new(&tokenizer, vocab).expect("compiler");
    let schema = ConstraintSpec::JsonSchema(
        r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
            "born": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string",
            "maxLength": 16}, "maxItems": 4}}, "required": ["name", "born", "tags"],
            "additionalProperties": false}"#
            .into(),
    );
    let text = "<|im_start|>user\nCopy this record exactly as JSON: {\"name\": \"Ada Lovelace\", \
                \"born\": 1815, \"tags\": [\"engine\", \"notes\", \"poetry\"]}<|im_end|>\n\
                <|im_start|>assistant\n";
    let prompt = tokenizer.encode(text, false, true).expect("encodes");
    let stops = tokenizer.eog_tokens().to_vec();
    let mut engine = Engine::new(model, &two_threads()).expect("engine");
    let (mut proposed, mut accepted) = (0, 0);
    for (k, params) in setups().iter().enumerate() {
        let mut plain = engine.new_session();
        engine.append(&mut plain, &prompt).expect("append");
        let mut c = compiler.compile(&schema).expect("compiles");
        let want = engine
            .generate_constrained(&mut plain, params, 96, &stops, Some(&mut c), |_| true)
            .expect("plain");
        let mut fast = engine.new_session();
        engine.append(&mut fast, &prompt).expect("append");
        let mut c = compiler.compile(&schema).expect("compiles");
        let mut lookup = Lookup::default();
        let (got, counts) = engine
            .generate_proposed(
                &mut fast,
                &mut lookup,
                params,
                96,
                &stops,
                Some(&mut c),
                |_| true,
            )
            .expect("speculative");
        assert_eq!(got, want, "setup {k}");
        assert_eq!(fast.history(), plain.history(), "setup {k}");
        assert_eq!(fast.next_logits(), plain.next_logits(), "setup {k}");
        proposed += counts.proposed;
        accepted += counts.accepted;
    }
    eprintln!("constrained: {accepted} of {proposed} proposed tokens accepted");
    assert!(
        accepted >= 10 && proposed >= accepted,
        "{accepted} of {proposed}"
    );
}
