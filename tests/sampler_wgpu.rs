//! The WGSL sampler held to the CPU reference on a real wgpu device (Mesa's
//! lavapipe in CI): greedy picks identical always, seeded draws
//! reproducible on each backend and in agreement with each other, the
//! filtered distribution right, and bad input refused the same way.
//!
//! Without any wgpu adapter these tests say so loudly and pass, unless
//! `INFERD_REQUIRE_WGPU=1` (set by `scripts/test`), when they fail.

use std::sync::{Arc, OnceLock};

use inferd::sampler::gpu::{AdapterKind, GpuContext, GpuError, GpuSampler};
use inferd::sampler::{
    CheckedParams, SampleRequest, Sampled, Sampler, SamplerError, SamplingParams,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The vocabulary sizes the issue names: tiny, SmolLM2's, Qwen's.
const VOCABS: [usize; 3] = [32, 49_152, 151_936];
const ROWS: usize = 32;

fn context() -> Option<Arc<GpuContext>> {
    static CONTEXT: OnceLock<Option<Arc<GpuContext>>> = OnceLock::new();
    CONTEXT
        .get_or_init(|| match GpuContext::open(AdapterKind::Any) {
            Ok(context) => {
                eprintln!("wgpu sampler tests on {}", context.describe());
                Some(context)
            }
            Err(GpuError::NoAdapter { seen }) => {
                let required = std::env::var("INFERD_REQUIRE_WGPU").is_ok_and(|v| v == "1");
                assert!(!required, "INFERD_REQUIRE_WGPU=1 but no wgpu adapter{seen}");
                eprintln!(
                    "\n!!! SKIPPING the wgpu sampler tests: no wgpu adapter{seen}.\n\
                     !!! Install mesa-vulkan-drivers and libvulkan1 (scripts/setup does).\n"
                );
                None
            }
            Err(other) => panic!("wgpu adapter present but unusable: {other}"),
        })
        .clone()
}

fn gpu(vocab: usize) -> Option<GpuSampler> {
    let context = context()?;
    Some(GpuSampler::new(context, vocab, ROWS, 256).expect("GPU sampler buffers"))
}

/// One test case: logits, parameters, history, position.
struct Case {
    logits: Vec<f32>,
    params: CheckedParams,
    history: Vec<u32>,
    position: u64,
}

impl Case {
    fn request(&self) -> SampleRequest<'_> {
        SampleRequest {
            mask: None,
            logits: &self.logits,
            params: &self.params,
            history: &self.history,
            position: self.position,
            top_logprobs: 0,
        }
    }
}

/// Logits of many shapes: smooth, heavy ties, huge magnitudes, and rows
/// sprinkled with NaN and infinities.
fn random_logits(rng: &mut StdRng, vocab: usize) -> Vec<f32> {
    let shape = rng.gen_range(0..8);
    let mut logits: Vec<f32> = match shape {
        // Model-like: a few strong tokens over a broad floor.
        0 | 1 => (0..vocab)
            .map(|_| rng.gen_range(-8.0f32..8.0) + if rng.gen_bool(0.001) { 10.0 } else { 0.0 })
            .collect(),
        // Ties everywhere: few distinct values.
        2 => (0..vocab)
            .map(|_| rng.gen_range(0..4) as f32 * 0.5)
            .collect(),
        // Huge and very negative magnitudes.
        3 => (0..vocab)
            .map(|_| match rng.gen_range(0..4) {
                0 => f32::MAX * rng.gen_range(0.5f32..1.0),
                1 => -f32::MAX * rng.gen_range(0.5f32..1.0),
                2 => rng.gen_range(-1e30f32..1e30),
                _ => rng.gen_range(-1.0f32..1.0),
            })
            .collect(),
        // Flat: top-p must sort deep.
        4 => (0..vocab).map(|_| rng.gen_range(-0.01f32..0.01)).collect(),
        // Signed zeros and small integers.
        5 => (0..vocab)
            .map(|_| match rng.gen_range(0..3) {
                0 => 0.0,
                1 => -0.0,
                _ => rng.gen_range(-3i32..3) as f32,
            })
            .collect(),
        _ => (0..vocab).map(|_| rng.gen_range(-20.0f32..20.0)).collect(),
    };
    // Non-finite sprinkles.
    let specials = rng.gen_range(0..4);
    for _ in 0..specials {
        let id = rng.gen_range(0..vocab);
        logits[id] = match rng.gen_range(0..5) {
            0 => f32::NAN,
            1 => -f32::NAN,
            2 => f32::NEG_INFINITY,
            3 => f32::INFINITY,
            _ => f32::from_bits(0x7fc0_0001), // a NaN payload
        };
    }
    if rng.gen_bool(0.01) {
        logits.fill(f32::NAN); // nothing to choose
    }
    logits
}

fn random_params(rng: &mut StdRng, vocab: usize, greedy: bool) -> SamplingParams {
    let mut params = SamplingParams::greedy();
    if !greedy {
        params.temperature = [0.2f32, 0.7, 1.0, 1.3, 2.5][rng.gen_range(0..5)];
        params.top_k = [0u32, 0, 1, 5, 40, 1000][rng.gen_range(0..6)];
        params.top_p = [1.0f32, 1.0, 0.95, 0.8, 0.3][rng.gen_range(0..5)];
        params.min_p = [0.0f32, 0.0, 0.05, 0.5][rng.gen_range(0..4)];
        params.seed = rng.gen();
    }
    if rng.gen_bool(0.3) {
        params.repetition_penalty = [1.1f32, 1.3, 0.9][rng.gen_range(0..3)];
        params.presence_penalty = [0.0f32, 0.5, -0.25][rng.gen_range(0..3)];
        params.frequency_penalty = [0.0f32, 0.2][rng.gen_range(0..2)];
        params.penalty_last_n = [0usize, 16, 64][rng.gen_range(0..3)];
    }
    if rng.gen_bool(0.2) {
        let entries = rng.gen_range(1..5);
        params.logit_bias = (0..entries)
            .map(|_| (rng.gen_range(0..vocab as u32), rng.gen_range(-5.0f32..5.0)))
            .collect();
    }
    params
}

fn random_case(rng: &mut StdRng, vocab: usize, greedy: bool) -> Case {
    let history_len = rng.gen_range(0..200);
    Case {
        logits: random_logits(rng, vocab),
        params: random_params(rng, vocab, greedy)
            .checked(vocab)
            .expect("valid"),
        history: (0..history_len)
            .map(|_| rng.gen_range(0..vocab as u32))
            .collect(),
        position: rng.gen_range(0..100_000),
    }
}

fn cpu_answers(cases: &[Case]) -> Vec<Result<u32, SamplerError>> {
    let mut sampler = Sampler::new();
    cases
        .iter()
        .map(|c| sampler.sample(&c.logits, &c.params, &c.history, c.position))
        .collect()
}

fn gpu_answers(gpu: &mut GpuSampler, cases: &[Case]) -> Vec<Result<u32, SamplerError>> {
    let mut all = Vec::with_capacity(cases.len());
    let mut out = Vec::new();
    for chunk in cases.chunks(ROWS) {
        let requests: Vec<SampleRequest<'_>> = chunk.iter().map(Case::request).collect();
        gpu.sample_batch(&requests, &mut out);
        all.extend(out.drain(..).map(|r| r.map(|s| s.token)));
    }
    all
}

/// Cases per vocabulary size: thousands in all, fewer for the big rows so
/// the software device finishes in CI's time.
fn case_count(vocab: usize) -> usize {
    match vocab {
        v if v <= 1024 => 4000,
        v if v <= 65_536 => 640,
        _ => 256,
    }
}

#[test]
fn greedy_picks_are_identical_to_the_cpu_always() {
    for vocab in VOCABS {
        let Some(mut gpu) = gpu(vocab) else { return };
        let mut rng = StdRng::seed_from_u64(0x6752_4545 ^ vocab as u64);
        let cases: Vec<Case> = (0..case_count(vocab))
            .map(|_| random_case(&mut rng, vocab, true))
            .collect();
        let cpu = cpu_answers(&cases);
        let gpu = gpu_answers(&mut gpu, &cases);
        for (i, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
            assert_eq!(
                c, g,
                "vocab {vocab}, case {i}: params {:?}",
                cases[i].params
            );
        }
        let errors = cpu.iter().filter(|r| r.is_err()).count();
        eprintln!(
            "vocab {vocab}: {} greedy cases identical ({errors} without a candidate)",
            cases.len()
        );
    }
}

/// Plain softmax probabilities (f64) of the CPU's adjusted logits, to size
/// a disagreement.
fn probability(case: &Case, token: u32) -> f64 {
    let t = f64::from(case.params.temperature);
    let finite: Vec<f64> = case
        .logits
        .iter()
        .map(|&x| {
            if x.is_nan() {
                f64::NEG_INFINITY
            } else {
                f64::from(x)
            }
        })
        .collect();
    let max = finite.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let total: f64 = finite.iter().map(|&x| ((x - max) / t).exp()).sum();
    ((finite[token as usize] - max) / t).exp() / total
}

#[test]
fn seeded_draws_are_reproducible_and_agree_with_the_cpu() {
    for vocab in VOCABS {
        let Some(mut gpu) = gpu(vocab) else { return };
        let mut rng = StdRng::seed_from_u64(0x5eed ^ vocab as u64);
        let cases: Vec<Case> = (0..case_count(vocab))
            .map(|_| random_case(&mut rng, vocab, false))
            .collect();
        let cpu = cpu_answers(&cases);
        assert_eq!(cpu, cpu_answers(&cases), "the CPU is not reproducible");
        let first = gpu_answers(&mut gpu, &cases);
        let second = gpu_answers(&mut gpu, &cases);
        assert_eq!(first, second, "vocab {vocab}: the GPU is not reproducible");
        let mut disagreements = 0usize;
        for (i, (c, g)) in cpu.iter().zip(&first).enumerate() {
            match (c, g) {
                (Ok(a), Ok(b)) if a != b => {
                    disagreements += 1;
                    let gap = (probability(&cases[i], *a) - probability(&cases[i], *b)).abs();
                    assert!(
                        gap < 1e-5,
                        "vocab {vocab}, case {i}: cpu {a} gpu {b}, probabilities differ by {gap}"
                    );
                }
                (Ok(_), Ok(_)) => {}
                _ => assert_eq!(c, g, "vocab {vocab}, case {i}: errors differ"),
            }
        }
        let agreement = 1.0 - disagreements as f64 / cases.len() as f64;
        eprintln!(
            "vocab {vocab}: {} seeded cases, {disagreements} disagreements (agreement {agreement})",
            cases.len()
        );
        assert!(agreement >= 0.999, "vocab {vocab}: agreement {agreement}");
    }
}

#[test]
fn a_batch_answers_each_row_as_if_alone() {
    let vocab = 49_152;
    let Some(mut gpu) = gpu(vocab) else { return };
    let mut rng = StdRng::seed_from_u64(77);
    let cases: Vec<Case> = (0..ROWS)
        .map(|i| random_case(&mut rng, vocab, i % 3 == 0))
        .collect();
    let batched = gpu_answers(&mut gpu, &cases);
    for (i, case) in cases.iter().enumerate() {
        let alone = gpu_answers(&mut gpu, std::slice::from_ref(case));
        assert_eq!(alone[0], batched[i], "row {i}");
    }
    assert_eq!(batched, cpu_answers(&cases));
}

/// Pearson chi-square of GPU draws against the f64 softmax of the survivors.
fn chi_square(counts: &[u64], expected: &[f64], draws: u64) -> f64 {
    counts
        .iter()
        .zip(expected)
        .map(|(&observed, &p)| {
            let e = p * draws as f64;
            (observed as f64 - e).powi(2) / e
        })
        .sum()
}

#[test]
fn gpu_draws_follow_the_filtered_distribution() {
    const DRAWS: u64 = 16_384;
    // df = 3 (four survivors), significance 0.001.
    const CRITICAL_DF3: f64 = 16.266;
    let Some(mut gpu) = gpu(8) else { return };
    // The CPU chi-square test's case: top-k 6, top-p 0.9 and min-p 0.2
    // leave ids 0-3.
    let logits = vec![2.0f32, 1.5, 1.0, 0.8, 0.5, 0.0, -1.0, -3.0];
    let params = SamplingParams {
        temperature: 0.8,
        top_k: 6,
        top_p: 0.9,
        min_p: 0.2,
        seed: 2024,
        ..SamplingParams::greedy()
    };
    let cases: Vec<Case> = (0..DRAWS)
        .map(|position| Case {
            logits: logits.clone(),
            params: params.clone().checked(logits.len()).expect("valid"),
            history: Vec::new(),
            position,
        })
        .collect();
    let answers = gpu_answers(&mut gpu, &cases);
    let mut counts = [0u64; 8];
    for answer in &answers {
        counts[*answer.as_ref().expect("a token") as usize] += 1;
    }
    assert_eq!(
        &counts[4..],
        &[0, 0, 0, 0],
        "filtered tokens drawn: {counts:?}"
    );
    let weights: Vec<f64> = logits[..4]
        .iter()
        .map(|&x| ((f64::from(x) - 2.0) / 0.8).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let expected: Vec<f64> = weights.iter().map(|w| w / total).collect();
    let statistic = chi_square(&counts[..4], &expected, DRAWS);
    assert!(
        statistic < CRITICAL_DF3,
        "chi-square {statistic} for {counts:?}"
    );
    assert_eq!(answers, cpu_answers(&cases), "GPU and CPU draws differ");
}

#[test]
fn bad_input_gets_the_cpu_samplers_error_and_the_good_rows_still_sample() {
    let vocab = 32;
    let Some(mut gpu) = gpu(vocab) else { return };
    let logits: Vec<f32> = (0..vocab).map(|i| i as f32).collect();
    let short = vec![0.0f32; 5];
    // Bad parameters never reach a sampler: they are refused once, where
    // they are checked, with the CPU sampler's own errors.
    let bad_top_p = SamplingParams {
        temperature: 1.0,
        top_p: 1.5,
        ..SamplingParams::greedy()
    };
    let bad_bias = SamplingParams {
        logit_bias: vec![(vocab as u32, 1.0)],
        ..SamplingParams::greedy()
    };
    for bad in [bad_top_p, bad_bias] {
        let cpu = Sampler::new().sample(&logits, &bad, &[], 0);
        assert_eq!(bad.checked(vocab).map(|_| ()), cpu.map(|_| ()));
    }
    let penalised = SamplingParams {
        presence_penalty: 1.0,
        ..SamplingParams::greedy()
    }
    .checked(vocab)
    .expect("valid");
    let greedy = SamplingParams::greedy().checked(vocab).expect("valid");
    let out_of_range_history = [1u32, vocab as u32 + 5];
    let rows = [
        SampleRequest {
            mask: None,
            logits: &logits,
            params: &greedy,
            history: &[],
            position: 0,
            top_logprobs: 0,
        },
        SampleRequest {
            mask: None,
            logits: &logits,
            params: &penalised,
            history: &out_of_range_history,
            position: 2,
            top_logprobs: 0,
        },
        SampleRequest {
            mask: None,
            logits: &short,
            params: &greedy,
            history: &[],
            position: 0,
            top_logprobs: 0,
        },
    ];
    let mut out = Vec::new();
    gpu.sample_batch(&rows, &mut out);
    let mut cpu = Sampler::new();
    for (i, row) in rows.iter().take(2).enumerate() {
        let expected = cpu.sample(row.logits, row.params, row.history, row.position);
        assert_eq!(out[i].clone().map(|s| s.token), expected, "row {i}");
    }
    assert_eq!(out[0], Ok(Sampled::token(31)));
    assert_eq!(
        out[2],
        Err(SamplerError::VocabMismatch {
            expected: vocab,
            got: 5
        })
    );
}

#[test]
fn a_penalty_window_longer_than_the_buffers_grows_them_once() {
    let vocab = 64;
    let Some(context) = context() else { return };
    // Room for 8 history tokens per row; the row below has 5000.
    let mut gpu = GpuSampler::new(context, vocab, 2, 8).expect("buffers");
    let logits: Vec<f32> = (0..vocab).map(|i| (i % 7) as f32).collect();
    let history: Vec<u32> = (0..5000u32).map(|i| (i * 13) % vocab as u32).collect();
    let params = SamplingParams {
        repetition_penalty: 1.3,
        frequency_penalty: 0.01,
        ..SamplingParams::greedy()
    }
    .checked(vocab)
    .expect("valid");
    let rows = [SampleRequest {
        mask: None,
        logits: &logits,
        params: &params,
        history: &history,
        position: 5000,
        top_logprobs: 0,
    }];
    let mut out = Vec::new();
    gpu.sample_batch(&rows, &mut out);
    let expected = Sampler::new().sample(&logits, &params, &history, 5000);
    assert_eq!(out[0].clone().map(|s| s.token), expected);
}

/// The worst cases for the shader's loop budget (Mesa's llvmpipe silently
/// ends loops after 65,535 iterations per invocation): the largest
/// vocabulary the shader takes, flat logits so top-p sorts every token,
/// a long penalty window and a long bias list.
#[test]
fn the_largest_vocabulary_with_a_full_sort_still_matches_the_cpu() {
    let vocab = inferd::sampler::gpu::MAX_VOCAB as usize;
    let Some(context) = context() else { return };
    let mut gpu = GpuSampler::new(context, vocab, 4, 8192).expect("buffers");
    let mut rng = StdRng::seed_from_u64(262_144);
    let flat: Vec<f32> = (0..vocab).map(|_| rng.gen_range(-0.01f32..0.01)).collect();
    let history: Vec<u32> = (0..8192).map(|_| rng.gen_range(0..vocab as u32)).collect();
    let sorted_everything = SamplingParams {
        temperature: 1.0,
        top_p: 0.999,
        seed: 5,
        ..SamplingParams::greedy()
    };
    let deep_top_k = SamplingParams {
        temperature: 0.9,
        top_k: 200_000,
        top_p: 0.99,
        min_p: 0.01,
        repetition_penalty: 1.2,
        frequency_penalty: 0.1,
        logit_bias: (0..2000).map(|i| (i * 97 % vocab as u32, 0.001)).collect(),
        seed: 6,
        ..SamplingParams::greedy()
    };
    let cases: Vec<Case> = [sorted_everything, deep_top_k]
        .into_iter()
        .enumerate()
        .map(|(i, params)| Case {
            logits: flat.clone(),
            params: params.checked(flat.len()).expect("valid"),
            history: history.clone(),
            position: 1000 + i as u64,
        })
        .collect();
    assert_eq!(gpu_answers(&mut gpu, &cases), cpu_answers(&cases));
}

#[test]
fn top_logprobs_come_back_from_the_gpu_as_the_cpu_computes_them() {
    for vocab in VOCABS {
        let Some(mut gpu) = gpu(vocab) else { return };
        let mut rng = StdRng::seed_from_u64(0x10_9b ^ vocab as u64);
        let cases: Vec<Case> = (0..ROWS * 2)
            .map(|i| random_case(&mut rng, vocab, i % 2 == 0))
            .collect();
        let asked = [1usize, 5, 20];
        let requests: Vec<SampleRequest<'_>> = cases
            .iter()
            .enumerate()
            .map(|(i, c)| SampleRequest {
                top_logprobs: asked[i % asked.len()],
                ..c.request()
            })
            .collect();
        let mut cpu = Sampler::new();
        let mut out = Vec::new();
        for chunk in requests.chunks(ROWS) {
            gpu.sample_batch(chunk, &mut out);
            for (row, got) in chunk.iter().zip(&out) {
                let expected = cpu.sample_with_logprobs(
                    row.logits,
                    row.params,
                    row.history,
                    row.position,
                    row.top_logprobs,
                );
                assert_eq!(got, &expected, "vocab {vocab}, params {:?}", row.params);
                if let Ok(sampled) = got {
                    let report = sampled.logprobs.as_ref().expect("asked for");
                    assert!(report.top.len() <= row.top_logprobs);
                }
            }
        }
    }
}

/// A constraint's token mask: the WGSL sampler applies it as the CPU does
/// (tokens and log-probabilities to the bit, greedy and seeded), with rows
/// of sparse, dense and single-token masks next to unmasked rows.
#[test]
fn token_masks_give_the_cpus_tokens_and_log_probabilities() {
    for vocab in [32usize, 49_152] {
        let Some(mut gpu) = gpu(vocab) else { return };
        let mut rng = StdRng::seed_from_u64(0x4d41_534b ^ vocab as u64);
        let words = vocab.div_ceil(32);
        let cases: Vec<Case> = (0..96)
            .map(|i| random_case(&mut rng, vocab, i % 2 == 0))
            .collect();
        let masks: Vec<Option<Vec<u32>>> = (0..cases.len())
            .map(|i| match i % 4 {
                0 => None,
                1 => Some(
                    (0..words)
                        .map(|_| rng.gen::<u32>() & rng.gen::<u32>())
                        .collect(),
                ),
                2 => Some(
                    (0..words)
                        .map(|_| !(rng.gen::<u32>() & rng.gen::<u32>()))
                        .collect(),
                ),
                _ => {
                    let mut m = vec![0u32; words];
                    let t = rng.gen_range(0..vocab);
                    m[t / 32] |= 1 << (t % 32);
                    Some(m)
                }
            })
            .collect();
        fn request<'a>((c, m): (&'a Case, &'a Option<Vec<u32>>)) -> SampleRequest<'a> {
            SampleRequest {
                mask: m.as_deref(),
                top_logprobs: 4,
                ..c.request()
            }
        }
        let mut cpu = Sampler::new();
        let want: Vec<Result<Sampled, SamplerError>> = cases
            .iter()
            .zip(&masks)
            .map(|(c, m)| {
                cpu.sample_masked(
                    &c.logits,
                    &c.params,
                    &c.history,
                    c.position,
                    4,
                    m.as_deref(),
                )
            })
            .collect();
        let mut got = Vec::new();
        let mut out = Vec::new();
        let pairs: Vec<(&Case, &Option<Vec<u32>>)> = cases.iter().zip(&masks).collect();
        for chunk in pairs.chunks(ROWS) {
            let requests: Vec<SampleRequest<'_>> = chunk.iter().copied().map(request).collect();
            gpu.sample_batch(&requests, &mut out);
            got.append(&mut out);
        }
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            match (w, g) {
                (Ok(w), Ok(g)) => {
                    assert_eq!(w.token, g.token, "vocab {vocab} row {i}");
                    if let Some(m) = &masks[i] {
                        assert!(m[g.token as usize / 32] >> (g.token % 32) & 1 == 1);
                    }
                    let bits = |s: &Sampled| {
                        s.logprobs.as_ref().map(|l| {
                            (
                                l.chosen.to_bits(),
                                l.top
                                    .iter()
                                    .map(|(t, p)| (*t, p.to_bits()))
                                    .collect::<Vec<_>>(),
                            )
                        })
                    };
                    assert_eq!(bits(w), bits(g), "vocab {vocab} row {i} log-probabilities");
                }
                (Err(w), Err(g)) => assert_eq!(
                    std::mem::discriminant(w),
                    std::mem::discriminant(g),
                    "vocab {vocab} row {i}"
                ),
                _ => panic!("vocab {vocab} row {i}: CPU {w:?}, GPU {g:?}"),
            }
        }
    }
}
