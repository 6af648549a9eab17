//! Every synthetic shape in every weight recipe through the loader and a
//! forward pass: the files `inferd make-model` writes are models inferd runs.

use std::io::BufWriter;
use std::sync::Arc;

use crate::gguf::synthetic::{SyntheticArch, SyntheticModel, TypeRecipe, RECIPE_NAMES};
use crate::kv::{KvPool, KvPoolConfig, SessionKv};
use crate::quant::GgmlType;
use crate::threads::ThreadPool;

use super::{Architecture, LogitsWanted, Model, Scratch, Sequence};

/// `shape` cut to `layers` layers and a 512-token vocabulary (the real
/// vocabularies' tables would be most of the time and none of the point),
/// written through the streaming writer and loaded from the file.
fn load(shape: &str, layers: usize, recipe: TypeRecipe) -> Model {
    let mut model = SyntheticModel::named(shape, recipe, 5).expect("named shape");
    model.shape = model.shape.with_layers(layers).with_vocab(512);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("model.gguf");
    let file = std::fs::File::create(&path).expect("create");
    let mut out = BufWriter::new(file);
    let len = model.write_to(&mut out).expect("write");
    drop(out);
    assert_eq!(std::fs::metadata(&path).expect("stat").len(), len);
    // The map keeps the file's pages after the directory goes.
    Model::load(&path).unwrap_or_else(|e| panic!("{shape} {}: {e}", recipe.name()))
}

/// Logits of a 5-token prompt at every position.
fn logits(model: &Model) -> Vec<f32> {
    let layout = model.kv_layout(model.config.n_layers, 16);
    let pool = KvPool::new(KvPoolConfig::anonymous(layout, 4 * model.config.n_layers))
        .and_then(|p| p.with_layer_windows(model.kv_layer_windows(0..model.config.n_layers)))
        .expect("kv pool");
    let mut kv = SessionKv::new(Arc::new(pool));
    let mut scratch = Scratch::default();
    let tokens = [257, 72, 105, 33, 10];
    model
        .forward(
            &mut [Sequence {
                kv: &mut kv,
                tokens: &tokens,
                logits: LogitsWanted::All,
            }],
            &ThreadPool::new(2),
            &mut scratch,
        )
        .expect("forward");
    scratch.logits[..tokens.len() * model.config.vocab].to_vec()
}

/// Every recipe of `shape` at `layers` layers loads and gives finite,
/// varied logits at every position.
fn every_recipe_runs(shape: &str, layers: usize, arch: Architecture) {
    for name in RECIPE_NAMES {
        let recipe = TypeRecipe::from_name(name).expect("recipe");
        let model = load(shape, layers, recipe);
        assert_eq!(model.config.architecture, arch);
        assert_eq!(model.config.n_layers, layers);
        let x = logits(&model);
        assert!(
            x.iter().all(|v| v.is_finite()),
            "{shape} {name}: logits not finite"
        );
        let vocab = model.config.vocab;
        for row in x.chunks_exact(vocab) {
            let (min, max) = row
                .iter()
                .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            assert!(max - min > 1e-3, "{shape} {name}: flat logits {min}..{max}");
        }
    }
}

#[test]
fn smollm2_runs_in_every_recipe() {
    every_recipe_runs("smollm2-135m", 2, Architecture::Llama);
}

#[test]
fn gemma3_runs_in_every_recipe() {
    every_recipe_runs("gemma-3-270m", 2, Architecture::Gemma3);
}

#[test]
fn qwen2_runs_in_every_recipe() {
    every_recipe_runs("qwen2.5-0.5b", 1, Architecture::Qwen2);
}

#[test]
fn qwen3_runs_in_every_recipe() {
    every_recipe_runs("qwen3-0.6b", 1, Architecture::Qwen3);
}

#[test]
fn llama_3_2_runs_in_every_recipe() {
    every_recipe_runs("llama-3.2-1b", 1, Architecture::Llama);
}

#[test]
fn the_loader_reads_each_shape_as_its_checkpoint() {
    // Gemma 3 at six layers: five sliding-window layers, then a global one,
    // with the architecture's extras in place.
    let gemma = load("gemma-3-270m", 6, TypeRecipe::Medium(GgmlType::Q4_K));
    let cfg = &gemma.config;
    assert_eq!((cfg.hidden, cfg.head_dim, cfg.q_dim()), (640, 256, 1024));
    assert_eq!((cfg.n_heads, cfg.n_kv_heads, cfg.ffn), (4, 1, 2048));
    assert_eq!(cfg.context, 32_768);
    assert_eq!(cfg.embedding_scale, Some(640f32.sqrt()));
    assert_eq!(
        (0..6).map(|l| cfg.layer_window(l)).collect::<Vec<_>>(),
        [Some(512), Some(512), Some(512), Some(512), Some(512), None]
    );
    let layer = &gemma.weights().layers[0];
    assert!(
        layer.q_norm.is_some() && layer.attn_post_norm.is_some() && layer.ffn_post_norm.is_some()
    );
    // Tied, quantized as Q4_K_M does: Q8_0 for rows of 640.
    assert_eq!(gemma.weights().output.name, "token_embd.weight");
    assert_eq!(gemma.weights().output.ty, GgmlType::Q8_0);
    assert!(logits(&gemma).iter().all(|v| v.is_finite()));

    // Llama 3.2: its RoPE factors, a head width from key_length.
    let llama = load("llama-3.2-1b", 1, TypeRecipe::Flat(GgmlType::Q4_0));
    let freqs = llama.weights().rope_freqs.as_ref().expect("rope_freqs");
    assert_eq!((freqs.len(), freqs[0], freqs[31]), (32, 1.0, 32.0));
    assert_eq!(
        (llama.config.rope_base, llama.config.context),
        (500_000.0, 131_072)
    );
    assert_eq!(llama.weights().output.ty, GgmlType::Q6_K);

    // Qwen2.5's biases; Qwen3's norms and a head wider than width / heads.
    let qwen2 = load("qwen2.5-0.5b", 1, TypeRecipe::Flat(GgmlType::Q8_0));
    let layer = &qwen2.weights().layers[0];
    assert!(layer.bq.is_some() && layer.bk.is_some() && layer.bv.is_some());
    let qwen3 = load("qwen3-0.6b", 1, TypeRecipe::Flat(GgmlType::Q8_0));
    assert_eq!((qwen3.config.head_dim, qwen3.config.q_dim()), (128, 2048));
    assert!(qwen3.weights().layers[0].k_norm.is_some());
    assert_eq!(
        SyntheticArch::Qwen3.name(),
        qwen3.config.architecture.name()
    );
}

#[test]
fn an_untied_seven_billion_shape_runs() {
    // Mistral 7B's layer at its real width, with its own output matrix.
    let mistral = load("mistral-7b-v0.1", 1, TypeRecipe::Medium(GgmlType::Q4_K));
    assert_eq!(mistral.weights().output.name, "output.weight");
    assert_eq!(mistral.weights().output.ty, GgmlType::Q6_K);
    assert_eq!(mistral.weights().token_embd.ty, GgmlType::Q4_K);
    assert!(logits(&mistral).iter().all(|v| v.is_finite()));
}

#[test]
fn small_shapes_stay_finite_at_their_full_depth() {
    // The weight scales are meant to keep activations finite through every
    // layer of a real model, not only one or two.
    for shape in ["smollm2-135m", "gemma-3-270m"] {
        let model = load_full(shape, TypeRecipe::Medium(GgmlType::Q4_K));
        assert!(logits(&model).iter().all(|v| v.is_finite()), "{shape}");
    }
}

/// Every named shape at its real depth (a 4 GB file for Mistral 7B, so
/// run by hand: `cargo test --lib full_depth -- --ignored`).
#[test]
#[ignore]
fn every_named_shape_stays_finite_at_its_full_depth() {
    for named in crate::gguf::synthetic::NAMED_SHAPES {
        let model = load_full(named.name, TypeRecipe::Medium(GgmlType::Q4_K));
        let x = logits(&model);
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(x.iter().all(|v| v.is_finite()), "{}", named.name);
        eprintln!(
            "{}: {} layers, largest |logit| {max}",
            named.name, model.config.n_layers
        );
    }
}

/// `shape` at its real depth with a 512-token vocabulary.
fn load_full(shape: &str, recipe: TypeRecipe) -> Model {
    let layers = crate::gguf::synthetic::named_shape(shape)
        .expect("named shape")
        .shape
        .n_layers;
    load(shape, layers, recipe)
}
