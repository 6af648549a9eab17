//! Loading models from GGUF metadata: bad or unsupported configurations are
//! typed errors that name the problem; each architecture (qwen2 biases and
//! NeoX RoPE, qwen3 Q/K norms, gemma3 sliding windows) keeps the byte-exact
//! prefill promise, and a sliding-window session holds only its window.

use std::sync::Arc;

use inferd::gguf::synthetic::SyntheticLlama;
use inferd::gguf::{GgufFile, GgufWriter, MetaValue};
use inferd::kv::{KvPool, KvPoolConfig, SessionKv};
use inferd::model::{LogitsWanted, Model, ModelError, RopeLayout, Scratch, Sequence};
use inferd::quant::GgmlType;
use inferd::threads::ThreadPool;

fn synthetic() -> GgufFile {
    let cfg = SyntheticLlama {
        weight_type: GgmlType::Q8_0,
        ..SyntheticLlama::tiny()
    };
    GgufFile::from_bytes(cfg.build()).expect("synthetic model parses")
}

/// Rewrites a GGUF: `edit` may rename or replace each metadata entry (None
/// drops it); `extra_meta` and `extra_tensors` are appended; tensors named in
/// `drop_tensors` are left out.
fn rewrite(
    file: &GgufFile,
    edit: impl Fn(&str, &MetaValue) -> Option<(String, MetaValue)>,
    extra_meta: Vec<(&str, MetaValue)>,
    extra_tensors: Vec<(String, Vec<u64>, Vec<f32>)>,
    drop_tensors: &[&str],
) -> GgufFile {
    let mut w = GgufWriter::new(3);
    for (k, v) in file.metadata() {
        if let Some((k, v)) = edit(k, v) {
            w.add_meta(k, v);
        }
    }
    for (k, v) in extra_meta {
        w.add_meta(k, v);
    }
    for t in file.tensors() {
        if !drop_tensors.contains(&t.name.as_str()) {
            w.add_tensor(&t.name, &t.dims, t.ty, file.tensor_bytes(t).to_vec());
        }
    }
    for (name, dims, values) in extra_tensors {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.add_tensor(&name, &dims, GgmlType::F32, bytes);
    }
    GgufFile::from_bytes(w.to_bytes()).expect("rewritten model parses")
}

fn load(file: GgufFile) -> Result<Model, ModelError> {
    Model::from_gguf(Arc::new(file))
}

fn keep(k: &str, v: &MetaValue) -> Option<(String, MetaValue)> {
    Some((k.to_owned(), v.clone()))
}

#[test]
fn linear_rope_scaling_is_applied_and_yarn_is_refused() {
    let base = synthetic();
    let linear = rewrite(
        &base,
        keep,
        vec![
            (
                "llama.rope.scaling.type",
                MetaValue::String("linear".into()),
            ),
            ("llama.rope.scaling.factor", MetaValue::F32(4.0)),
        ],
        vec![],
        &[],
    );
    assert_eq!(load(linear).expect("loads").config.rope_freq_scale, 0.25);
    let yarn = rewrite(
        &base,
        keep,
        vec![("llama.rope.scaling.type", MetaValue::String("yarn".into()))],
        vec![],
        &[],
    );
    let err = load(yarn).expect_err("yarn is not supported");
    assert!(matches!(err, ModelError::BadConfig(_)), "{err:?}");
    assert!(err.to_string().contains("yarn"), "{err}");
}

#[test]
fn inconsistent_shapes_and_unknown_architectures_are_errors() {
    let base = synthetic();
    let bad_groups = rewrite(
        &base,
        |k, v| match k {
            "llama.attention.head_count_kv" => Some((k.to_owned(), MetaValue::U32(3))),
            _ => keep(k, v),
        },
        vec![],
        vec![],
        &[],
    );
    let err = load(bad_groups).expect_err("4 heads cannot be grouped over 3");
    assert!(err.to_string().contains("grouped"), "{err}");

    let missing = rewrite(&base, keep, vec![], vec![], &["blk.1.ffn_up.weight"]);
    let err = load(missing).expect_err("a missing tensor is an error");
    assert!(err.to_string().contains("blk.1.ffn_up.weight"), "{err}");

    let wrong_vocab = rewrite(
        &base,
        |k, v| match k {
            "llama.vocab_size" => Some((k.to_owned(), MetaValue::U32(400))),
            _ => keep(k, v),
        },
        vec![],
        vec![],
        &[],
    );
    let err = load(wrong_vocab).expect_err("embedding shape no longer matches");
    assert!(matches!(err, ModelError::BadTensor { .. }), "{err:?}");
    assert!(err.to_string().contains("token_embd.weight"), "{err}");

    let mamba = rewrite(
        &base,
        |k, v| match k {
            "general.architecture" => Some((k.to_owned(), MetaValue::String("mamba".into()))),
            _ => keep(k, v),
        },
        vec![],
        vec![],
        &[],
    );
    let err = load(mamba).expect_err("unknown architecture");
    assert!(
        matches!(err, ModelError::UnsupportedArchitecture { .. }),
        "{err:?}"
    );
}

/// A `qwen2` model: the llama tensors plus Q/K/V biases, keys renamed.
fn qwen2() -> Model {
    let base = synthetic();
    let tiny = SyntheticLlama::tiny();
    let mut biases = Vec::new();
    for layer in 0..tiny.n_layers {
        for (name, len) in [
            ("q", tiny.hidden),
            ("k", tiny.kv_dim()),
            ("v", tiny.kv_dim()),
        ] {
            let values = (0..len)
                .map(|i| ((i * 7 + layer) % 11) as f32 * 0.01 - 0.05)
                .collect();
            biases.push((
                format!("blk.{layer}.attn_{name}.bias"),
                vec![len as u64],
                values,
            ));
        }
    }
    let file = rewrite(
        &base,
        |k, v| match k {
            "general.architecture" => Some((k.to_owned(), MetaValue::String("qwen2".into()))),
            _ => Some((k.replacen("llama.", "qwen2.", 1), v.clone())),
        },
        vec![],
        biases,
        &[],
    );
    load(file).expect("qwen2 loads")
}

#[test]
fn qwen2_loads_with_biases_and_neox_rope_and_prefill_stays_exact() {
    let model = qwen2();
    assert_eq!(model.config.rope_layout(), RopeLayout::Neox);
    assert!(model
        .weights()
        .layers
        .iter()
        .all(|l| l.bq.is_some() && l.bk.is_some() && l.bv.is_some()));

    assert_prefill_is_chunking_invariant(&model);
}

/// All-at-once logits of a 60-token prompt (every position).
fn prompt_logits(model: &Model, tokens: &[u32]) -> Vec<u32> {
    let layout = model.kv_layout(model.config.n_layers, 16);
    let pool = Arc::new(KvPool::new(KvPoolConfig::anonymous(layout, 64)).expect("kv pool"));
    let mut kv = SessionKv::new(pool);
    let mut scratch = Scratch::default();
    model
        .forward(
            &mut [Sequence {
                kv: &mut kv,
                tokens,
                logits: LogitsWanted::All,
            }],
            &ThreadPool::new(2),
            &mut scratch,
        )
        .expect("forward");
    let vocab = model.config.vocab;
    scratch.logits[..tokens.len() * vocab]
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn prompt(model: &Model) -> Vec<u32> {
    (0..60)
        .map(|i| (i * 37 + 5) % model.config.vocab as u32)
        .collect()
}

/// The byte-exact prefill promise: one chunk, token by token, and a batch
/// shared with another sequence on one thread give the same logit bits at
/// every position.
///
/// The token-by-token session settles after every step, so on a model with
/// sliding-window layers it gives back the pages those layers left behind
/// while computing: the result must not change, and it must hold fewer pages.
fn assert_prefill_is_chunking_invariant(model: &Model) {
    let layout = model.kv_layout(model.config.n_layers, 16);
    let n_layers = model.config.n_layers;
    let pool = KvPool::new(KvPoolConfig::anonymous(layout, 64))
        .and_then(|p| p.with_layer_windows(model.kv_layer_windows(0..n_layers)))
        .expect("kv pool");
    let pool = Arc::new(pool);
    let threads = ThreadPool::new(2);
    let mut scratch = Scratch::default();
    let tokens = prompt(model);
    let vocab = model.config.vocab;

    let mut whole = SessionKv::new(Arc::clone(&pool));
    let rows = model
        .forward(
            &mut [Sequence {
                kv: &mut whole,
                tokens: &tokens,
                logits: LogitsWanted::All,
            }],
            &threads,
            &mut scratch,
        )
        .expect("forward");
    assert_eq!(rows.per_sequence[0], 0..tokens.len());
    let reference: Vec<u32> = scratch.logits[..tokens.len() * vocab]
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert!(reference.iter().all(|&b| f32::from_bits(b).is_finite()));

    let mut stepwise = SessionKv::new(Arc::clone(&pool));
    let mut got = Vec::new();
    for t in &tokens {
        model
            .forward(
                &mut [Sequence {
                    kv: &mut stepwise,
                    tokens: std::slice::from_ref(t),
                    logits: LogitsWanted::All,
                }],
                &threads,
                &mut scratch,
            )
            .expect("forward");
        stepwise.settle().expect("settle");
        got.extend(scratch.logits[..vocab].iter().map(|x| x.to_bits()));
    }
    assert!(
        got == reference,
        "token-by-token logits differ from one chunk"
    );

    // Batched with a neighbour (which goes first), on one thread, in two
    // chunks of 20 and 40.
    let one_thread = ThreadPool::new(1);
    let neighbour: Vec<u32> = tokens.iter().rev().copied().collect();
    let mut first = SessionKv::new(Arc::clone(&pool));
    let mut other = SessionKv::new(Arc::clone(&pool));
    let mut batched = Vec::new();
    for part in [&tokens[..20], &tokens[20..]] {
        let rows = model
            .forward(
                &mut [
                    Sequence {
                        kv: &mut other,
                        tokens: &neighbour[..part.len()],
                        logits: LogitsWanted::Last,
                    },
                    Sequence {
                        kv: &mut first,
                        tokens: part,
                        logits: LogitsWanted::All,
                    },
                ],
                &one_thread,
                &mut scratch,
            )
            .expect("forward");
        let mine = rows.per_sequence[1].clone();
        batched.extend(
            scratch.logits[mine.start * vocab..mine.end * vocab]
                .iter()
                .map(|x| x.to_bits()),
        );
    }
    assert!(
        batched == reference,
        "batched, one-thread logits differ from one chunk"
    );
    drop((first, other));

    let pages_per_layer = tokens.len().div_ceil(16);
    assert_eq!(whole.pages_held(), n_layers * pages_per_layer);
    // A window layer keeps the pages from the one holding position
    // len + 1 - window on.
    let expected: usize = (0..n_layers)
        .map(|l| match model.config.layer_window(l) {
            None => pages_per_layer,
            Some(w) => pages_per_layer - (tokens.len() + 1).saturating_sub(w) / 16,
        })
        .sum();
    assert_eq!(stepwise.pages_held(), expected);
    if (0..n_layers).any(|l| model.config.layer_window(l).is_some()) {
        assert!(stepwise.pages_held() < whole.pages_held());
    }
}

/// Per-head RMSNorm weights for Q and K of every layer (`[head_dim]`).
fn qk_norms(tiny: &SyntheticLlama) -> Vec<(String, Vec<u64>, Vec<f32>)> {
    let hd = tiny.head_dim();
    let mut out = Vec::new();
    for layer in 0..tiny.n_layers {
        for name in ["attn_q_norm", "attn_k_norm"] {
            let values = (0..hd)
                .map(|i| 0.5 + ((i * 5 + layer) % 7) as f32 * 0.1)
                .collect();
            out.push((
                format!("blk.{layer}.{name}.weight"),
                vec![hd as u64],
                values,
            ));
        }
    }
    out
}

/// `base` with its architecture renamed (metadata keys follow).
fn renamed(arch: &'static str) -> impl Fn(&str, &MetaValue) -> Option<(String, MetaValue)> {
    move |k, v| match k {
        "general.architecture" => Some((k.to_owned(), MetaValue::String(arch.into()))),
        _ => Some((k.replacen("llama.", &format!("{arch}."), 1), v.clone())),
    }
}

#[test]
fn qwen3_needs_its_qk_norms_and_keeps_prefill_exact() {
    let base = synthetic();
    let tiny = SyntheticLlama::tiny();
    let mut norms = qk_norms(&tiny);
    let model =
        load(rewrite(&base, renamed("qwen3"), vec![], norms.clone(), &[])).expect("qwen3 loads");
    assert_eq!(model.config.rope_layout(), RopeLayout::Neox);
    assert!(model
        .weights()
        .layers
        .iter()
        .all(|l| l.q_norm.is_some() && l.k_norm.is_some()));
    assert_prefill_is_chunking_invariant(&model);

    norms.retain(|(name, _, _)| name != "blk.1.attn_k_norm.weight");
    let err = load(rewrite(&base, renamed("qwen3"), vec![], norms, &[])).expect_err("missing norm");
    assert!(
        err.to_string().contains("blk.1.attn_k_norm.weight"),
        "{err}"
    );
}

/// A `gemma3` model over the tiny llama: Q/K norms, post-block norms, a
/// sliding window of `window` positions on layer 0 (pattern 2: every
/// second layer global), or no window at all.
fn gemma3(window: Option<u32>) -> Model {
    let base = synthetic();
    let tiny = SyntheticLlama::tiny();
    let mut tensors = qk_norms(&tiny);
    for layer in 0..tiny.n_layers {
        for name in ["post_attention_norm", "post_ffw_norm"] {
            let values = (0..tiny.hidden)
                .map(|i| 0.8 + ((i + layer) % 5) as f32 * 0.1)
                .collect();
            tensors.push((
                format!("blk.{layer}.{name}.weight"),
                vec![tiny.hidden as u64],
                values,
            ));
        }
    }
    let mut meta = vec![("gemma3.attention.sliding_window_pattern", MetaValue::U32(2))];
    if let Some(w) = window {
        meta.push(("gemma3.attention.sliding_window", MetaValue::U32(w)));
    }
    load(rewrite(&base, renamed("gemma3"), meta, tensors, &[])).expect("gemma3 loads")
}

#[test]
fn gemma3_sliding_layers_see_only_their_window_and_prefill_stays_exact() {
    let windowed = gemma3(Some(8));
    let cfg = &windowed.config;
    assert_eq!(cfg.layer_window(0), Some(8));
    assert_eq!(cfg.layer_window(1), None, "every second layer is global");
    assert_eq!(cfg.embedding_scale, Some(8.0), "sqrt of the width 64");
    assert_prefill_is_chunking_invariant(&windowed);

    // Until a query has more than 8 positions behind it the window hides
    // nothing; from then on it must change the result.
    let unbounded = gemma3(None);
    assert_eq!(unbounded.config.layer_window(0), None);
    let tokens = prompt(&windowed);
    let (a, b) = (
        prompt_logits(&windowed, &tokens),
        prompt_logits(&unbounded, &tokens),
    );
    let vocab = cfg.vocab;
    assert_eq!(
        a[..8 * vocab],
        b[..8 * vocab],
        "positions 0..8 fit the window"
    );
    for pos in 8..tokens.len() {
        assert_ne!(
            a[pos * vocab..][..vocab],
            b[pos * vocab..][..vocab],
            "position {pos}"
        );
    }
}

/// Greedy tokens computed the plain way: one session that keeps every
/// position (never settled), the whole history prefilled at once, then one
/// token at a time, argmax with the lowest id on ties.
fn greedy_keeping_everything(model: &Model, history: &[u32], n: usize) -> Vec<u32> {
    let layout = model.kv_layout(model.config.n_layers, 16);
    let pool = Arc::new(KvPool::new(KvPoolConfig::anonymous(layout, 64)).expect("kv pool"));
    let mut kv = SessionKv::new(pool);
    let threads = ThreadPool::new(2);
    let mut scratch = Scratch::default();
    let vocab = model.config.vocab;
    let mut feed = history.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        model
            .forward(
                &mut [Sequence {
                    kv: &mut kv,
                    tokens: &feed,
                    logits: LogitsWanted::Last,
                }],
                &threads,
                &mut scratch,
            )
            .expect("forward");
        let next = inferd::sampler::argmax(&scratch.logits[..vocab]).expect("logits");
        out.push(next);
        feed = vec![next];
    }
    out
}

/// Through the runtime, a long Gemma 3 session holds on its sliding-window
/// layer only the pages the window can still see (memory bounded by the
/// window, not the history), and generates exactly what a session keeping
/// every position generates.
#[test]
fn a_long_sliding_window_session_holds_only_its_window() {
    use inferd::runtime::{AppendTokens, CreateSession, GenerateEvent, GenerateRequest, Tenant};
    use inferd::runtime::{Runtime, RuntimeConfig, SamplingOptions};

    let model = Arc::new(gemma3(Some(8)));
    let rt = Runtime::start(
        Arc::clone(&model),
        RuntimeConfig {
            workers: 1,
            pin_cores: false,
            kv_bytes: 4 << 20,
            ..RuntimeConfig::default()
        },
    )
    .expect("runtime starts");
    let id = rt
        .create_session(
            &Tenant::NONE,
            CreateSession {
                client_label: "window".into(),
                eos_token_ids: Vec::new(),
            },
            None,
        )
        .expect("queued")
        .wait()
        .expect("created");
    let vocab = model.config.vocab as u32;
    let history: Vec<u32> = (0..160u32).map(|i| (i * 53 + 11) % vocab).collect();
    let row_pair = 2 * model.config.kv_dim() as u64 * 2;
    for (i, chunk) in history.chunks(16).enumerate() {
        let len = 16 * (i + 1);
        rt.append_tokens(
            &Tenant::NONE,
            AppendTokens {
                id,
                tokens: chunk.to_vec(),
            },
            None,
        )
        .expect("queued")
        .wait()
        .expect("appended");
        let info = rt
            .session_info(&Tenant::NONE, id, None)
            .expect("queued")
            .wait()
            .expect("info");
        // Layer 1 (global) keeps every page; layer 0 (window 8) keeps the
        // pages from the one holding position len - 7 on.
        let window_first_page = (len + 1 - 8) / 16;
        let window_pages = len / 16 - window_first_page;
        assert_eq!(
            info.pages_held as usize,
            len / 16 + window_pages,
            "after {len}"
        );
        assert!(
            window_pages <= 1,
            "after {len}: {window_pages} window pages"
        );
        let window_kept = (len - 16 * window_first_page) as u64;
        assert_eq!(info.kv_live_bytes, (len as u64 + window_kept) * row_pair);
    }
    let events: Vec<GenerateEvent> = rt
        .generate(
            &Tenant::NONE,
            GenerateRequest {
                constraint: None,
                speculate: None,
                id,
                max_tokens: 24,
                sampling: SamplingOptions::default(),
                stop_sequences: Vec::new(),
            },
            None,
        )
        .expect("queued")
        .collect();
    let tokens: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            GenerateEvent::Token(t) => Some(*t),
            _ => None,
        })
        .collect();
    assert!(
        matches!(events.last(), Some(GenerateEvent::Done(_))),
        "{:?}",
        events.last()
    );
    assert_eq!(tokens, greedy_keeping_everything(&model, &history, 24));
    let info = rt
        .session_info(&Tenant::NONE, id, None)
        .expect("queued")
        .wait()
        .expect("info");
    assert_eq!(info.history_length, 184);
    assert_eq!(info.pages_held, 184u64.div_ceil(16) + 1);
}
