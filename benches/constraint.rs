//! What a constraint costs per decode step: the allowed-token mask and the
//! match's advance over a real JSON answer, at the reference vocabulary
//! (49,152 tokens) and, where its file is here, Qwen 2.5's (151,936), and
//! the sampler's greedy step with and without the mask. A schema's
//! compilation (with its first mask) is measured on its own.
//!
//! Run: `cargo bench --bench constraint`.

use std::path::Path;

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use inferd::constraint::{ConstraintCompiler, ConstraintSpec};
use inferd::gguf::GgufFile;
use inferd::sampler::{Sampler, SamplingParams};
use inferd::tokenizer::Tokenizer;

const SCHEMA: &str = r#"{"type": "object",
  "properties": {"name": {"type": "string", "maxLength": 40},
                 "age": {"type": "integer", "minimum": 0, "maximum": 150},
                 "colour": {"enum": ["red", "green", "blue"]},
                 "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
  "required": ["name", "age", "colour", "tags"], "additionalProperties": false}"#;
const ANSWER: &str =
    r#"{"name": "Ada Lovelace", "age": 36, "colour": "blue", "tags": ["chess", "tea", "maths"]}"#;

/// Model files whose vocabularies are measured: (label, path).
const VOCABULARIES: [(&str, &str); 2] = [
    ("49152", "models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    (
        "151936",
        "tests/vectors/models/qwen2.5-0.5b-rand-2l-q4_k_m.gguf",
    ),
];

fn bench_constraint(c: &mut Criterion) {
    for (label, path) in VOCABULARIES {
        let path = cached(path);
        let Some(path) = path else {
            eprintln!("constraint bench: {label} skipped (model file missing)");
            continue;
        };
        let file = GgufFile::open(&path).expect("model");
        let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
        let vocab = tokenizer.vocab_size();
        let compiler = ConstraintCompiler::new(&tokenizer, vocab).expect("compiler");
        let spec = ConstraintSpec::JsonSchema(SCHEMA.into());
        let answer = tokenizer.encode(ANSWER, false, false).expect("encodes");
        let stops = tokenizer.eog_tokens().to_vec();

        c.bench_function(&format!("constraint_compile_{label}"), |b| {
            b.iter(|| compiler.compile(black_box(&spec)).expect("compiles"))
        });

        let mut group = c.benchmark_group(format!("constraint_step_{label}"));
        group.throughput(Throughput::Elements(answer.len() as u64));
        group.bench_function("mask_and_advance", |b| {
            b.iter_batched(
                || compiler.compile(&spec).expect("compiles"),
                |mut constraint| {
                    let mut mask = Vec::new();
                    for &token in &answer {
                        constraint.allowed(&stops, &mut mask).expect("mask");
                        constraint.accept(token, &stops).expect("an allowed token");
                    }
                    mask
                },
                BatchSize::SmallInput,
            )
        });
        group.finish();

        // The sampler's own share: greedy over the row, masked or not.
        let logits: Vec<f32> = (0..vocab as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 8) as f32 / 16_777_216.0)
            .collect();
        let mut constraint = compiler.compile(&spec).expect("compiles");
        let mut mask = Vec::new();
        constraint.allowed(&stops, &mut mask).expect("mask");
        let params = SamplingParams::greedy().checked(vocab).expect("valid");
        let mut sampler = Sampler::new();
        c.bench_function(&format!("sample_greedy_{label}"), |b| {
            b.iter(|| sampler.sample_checked(black_box(&logits), &params, &[], 0, 0))
        });
        c.bench_function(&format!("sample_greedy_masked_{label}"), |b| {
            b.iter(|| sampler.sample_masked(black_box(&logits), &params, &[], 0, 0, Some(&mask)))
        });
    }
}

/// `path` here, or the model cache's copy of a vectors file.
fn cached(path: &str) -> Option<std::path::PathBuf> {
    let here = Path::new(path);
    if here.exists() {
        return Some(here.to_path_buf());
    }
    let name = here.file_name()?;
    let home = std::env::var_os("HOME")?;
    let cache = Path::new(&home).join(".cache/inferd/models").join(name);
    cache.exists().then_some(cache)
}

criterion_group!(benches, bench_constraint);
criterion_main!(benches);
