//! The named shapes' tests: their published hyper-parameters, the block
//! types each recipe picks (llama-quantize's), and streaming to a writer.

use super::*;
use crate::gguf::{GgufFile, MetaValue};

/// `(name, type)` of every matrix of `model`.
fn types_of(model: &SyntheticModel) -> Vec<(String, GgmlType)> {
    let specs = model.tensor_specs().unwrap();
    specs
        .into_iter()
        .filter(|s| s.dims.len() == 2)
        .map(|s| (s.name, s.ty))
        .collect()
}

/// The matrix types of `shape` at `layers` layers under the recipe named `recipe`.
fn matrix_types(shape: &str, layers: usize, recipe: &str) -> Vec<(String, GgmlType)> {
    let mut model =
        SyntheticModel::named(shape, TypeRecipe::from_name(recipe).unwrap(), 1).unwrap();
    model.shape.n_layers = layers;
    types_of(&model)
}

/// Checks each matrix's type against the first pattern its name (without
/// `.weight`) matches; `*` matches any one part (`blk.*.attn_v`, `blk.*.*`).
fn assert_types(got: &[(String, GgmlType)], want: &[(&str, GgmlType)], what: &str) {
    let matches = |pattern: &str, stem: &str| {
        let (p, s): (Vec<&str>, Vec<&str>) =
            (pattern.split('.').collect(), stem.split('.').collect());
        p.len() == s.len() && p.iter().zip(&s).all(|(a, b)| *a == "*" || a == b)
    };
    for (name, ty) in got {
        let stem = name.trim_end_matches(".weight");
        let (_, expected) = want
            .iter()
            .find(|(pattern, _)| matches(pattern, stem))
            .unwrap_or_else(|| panic!("{what}: no expectation for {name}"));
        assert_eq!(ty, expected, "{what}: {name}");
    }
}

#[test]
fn recipes_pick_the_types_llama_quantize_picks() {
    use GgmlType as T;
    // As llama.cpp's quantizer wrote them for the same shapes at 2 layers
    // (the files scripts/make-models builds). Llama 3.2 1B: rows of 2048,
    // 4 query heads per KV head, tied embeddings.
    let llama = |recipe| matrix_types("llama-3.2-1b", 2, recipe);
    let k_m = |base| {
        [
            ("token_embd", T::Q6_K),
            ("blk.1.attn_v", T::Q6_K),
            ("blk.1.ffn_down", T::Q6_K),
            ("blk.*.*", base),
        ]
    };
    assert_types(&llama("q4_k_m"), &k_m(T::Q4_K), "llama q4_k_m");
    assert_types(&llama("q5_k_m"), &k_m(T::Q5_K), "llama q5_k_m");
    for (recipe, ty) in [("q4_0", T::Q4_0), ("q6_k", T::Q6_K)] {
        assert_types(
            &llama(recipe),
            &[("token_embd", T::Q6_K), ("blk.*.*", ty)],
            recipe,
        );
    }
    assert_types(
        &llama("q8_0"),
        &[("token_embd", T::Q8_0), ("blk.*.*", T::Q8_0)],
        "q8_0",
    );
    for (recipe, ty) in [("iq4_nl", T::IQ4_NL), ("iq4_xs", T::IQ4_XS)] {
        let want = [
            ("token_embd", T::Q6_K),
            ("blk.*.attn_v", T::Q5_K),
            ("blk.*.*", ty),
        ];
        assert_types(&llama(recipe), &want, recipe);
    }

    // Qwen2.5 0.5B: rows of 896 fall back to 32-element types; ffn_down's
    // rows of 4864 keep the K-quant; 7 query heads per KV head.
    let qwen = |recipe| matrix_types("qwen2.5-0.5b", 2, recipe);
    let k_m = |base, fallback| {
        [
            ("token_embd", T::Q8_0),
            ("blk.1.attn_v", T::Q8_0),
            ("blk.0.ffn_down", base),
            ("blk.1.ffn_down", T::Q6_K),
            ("blk.*.*", fallback),
        ]
    };
    assert_types(&qwen("q4_k_m"), &k_m(T::Q4_K, T::Q5_0), "qwen q4_k_m");
    assert_types(&qwen("q5_k_m"), &k_m(T::Q5_K, T::Q5_1), "qwen q5_k_m");
    let want = [
        ("token_embd", T::Q8_0),
        ("blk.*.ffn_down", T::Q6_K),
        ("blk.*.*", T::Q8_0),
    ];
    assert_types(&qwen("q6_k"), &want, "qwen q6_k");
    let want = [
        ("token_embd", T::Q8_0),
        ("blk.*.attn_v", T::Q5_1),
        ("blk.*.ffn_down", T::IQ4_XS),
        ("blk.*.*", T::IQ4_NL),
    ];
    assert_types(&qwen("iq4_xs"), &want, "qwen iq4_xs");
    assert_types(
        &qwen("q4_0"),
        &[("token_embd", T::Q8_0), ("blk.*.*", T::Q4_0)],
        "qwen q4_0",
    );

    // At the real depth, Q4_K_M gives half of Llama 3.2's 16 layers more
    // bits: the first and last two and every third between.
    let deep = matrix_types("llama-3.2-1b", 16, "q4_k_m");
    let q6: Vec<usize> = (0..16)
        .filter(|l| deep.contains(&(format!("blk.{l}.attn_v.weight"), T::Q6_K)))
        .collect();
    assert_eq!(q6, [0, 1, 4, 7, 10, 13, 14, 15]);
    // IQ4 recipes give the first eighth's ffn_down Q5_K.
    let iq4 = matrix_types("llama-3.2-1b", 16, "iq4_xs");
    assert!(iq4.contains(&("blk.1.ffn_down.weight".into(), T::Q5_K)));
    assert!(iq4.contains(&("blk.2.ffn_down.weight".into(), T::IQ4_XS)));
    // An untied model keeps its embedding table in the base type.
    let mistral = matrix_types("mistral-7b-v0.1", 1, "q4_k_m");
    assert!(mistral.contains(&("token_embd.weight".into(), T::Q4_K)));
    assert!(mistral.contains(&("output.weight".into(), T::Q6_K)));
    // Pure: the vocabulary matrices too, with the fallback where needed;
    // the float types everywhere.
    let mut pure = SyntheticModel::named("qwen2.5-0.5b", TypeRecipe::Pure(T::Q4_K), 1).unwrap();
    pure.shape.n_layers = 1;
    let want = [
        ("token_embd", T::Q5_0),
        ("blk.*.ffn_down", T::Q4_K),
        ("blk.*.*", T::Q5_0),
    ];
    assert_types(&types_of(&pure), &want, "qwen pure q4_k");
    for ty in [T::F32, T::F16, T::BF16] {
        let want = [("token_embd", ty), ("blk.*.*", ty)];
        assert_types(
            &matrix_types("gemma-3-270m", 2, &ty.name().to_lowercase()),
            &want,
            "float",
        );
    }
}

/// The keys `convert_hf_to_gguf.py` writes for each checkpoint's published
/// config.json, typed as it types them.
fn published(shape: &str) -> Vec<(&'static str, MetaValue)> {
    use MetaValue::{F32, U32};
    match shape {
        // HuggingFaceTB/SmolLM2-135M-Instruct
        "smollm2-135m" => vec![
            ("llama.block_count", U32(30)),
            ("llama.context_length", U32(8192)),
            ("llama.embedding_length", U32(576)),
            ("llama.feed_forward_length", U32(1536)),
            ("llama.attention.head_count", U32(9)),
            ("llama.attention.head_count_kv", U32(3)),
            ("llama.rope.freq_base", F32(100_000.0)),
            ("llama.attention.layer_norm_rms_epsilon", F32(1e-5)),
            ("llama.rope.dimension_count", U32(64)),
            ("llama.vocab_size", U32(49_152)),
        ],
        // google/gemma-3-270m
        "gemma-3-270m" => vec![
            ("gemma3.block_count", U32(18)),
            ("gemma3.context_length", U32(32_768)),
            ("gemma3.embedding_length", U32(640)),
            ("gemma3.feed_forward_length", U32(2048)),
            ("gemma3.attention.head_count", U32(4)),
            ("gemma3.attention.head_count_kv", U32(1)),
            ("gemma3.rope.freq_base", F32(1_000_000.0)),
            ("gemma3.attention.layer_norm_rms_epsilon", F32(1e-6)),
            ("gemma3.attention.key_length", U32(256)),
            ("gemma3.attention.value_length", U32(256)),
            ("gemma3.attention.sliding_window", U32(512)),
        ],
        // Qwen/Qwen2.5-0.5B
        "qwen2.5-0.5b" => vec![
            ("qwen2.block_count", U32(24)),
            ("qwen2.context_length", U32(32_768)),
            ("qwen2.embedding_length", U32(896)),
            ("qwen2.feed_forward_length", U32(4864)),
            ("qwen2.attention.head_count", U32(14)),
            ("qwen2.attention.head_count_kv", U32(2)),
            ("qwen2.rope.freq_base", F32(1_000_000.0)),
            ("qwen2.attention.layer_norm_rms_epsilon", F32(1e-6)),
        ],
        // Qwen/Qwen3-0.6B
        "qwen3-0.6b" => vec![
            ("qwen3.block_count", U32(28)),
            ("qwen3.context_length", U32(40_960)),
            ("qwen3.embedding_length", U32(1024)),
            ("qwen3.feed_forward_length", U32(3072)),
            ("qwen3.attention.head_count", U32(16)),
            ("qwen3.attention.head_count_kv", U32(8)),
            ("qwen3.rope.freq_base", F32(1_000_000.0)),
            ("qwen3.attention.layer_norm_rms_epsilon", F32(1e-6)),
            ("qwen3.attention.key_length", U32(128)),
            ("qwen3.attention.value_length", U32(128)),
        ],
        // meta-llama/Llama-3.2-1B (its llama3 RoPE scaling is a tensor)
        "llama-3.2-1b" => vec![
            ("llama.block_count", U32(16)),
            ("llama.context_length", U32(131_072)),
            ("llama.embedding_length", U32(2048)),
            ("llama.feed_forward_length", U32(8192)),
            ("llama.attention.head_count", U32(32)),
            ("llama.attention.head_count_kv", U32(8)),
            ("llama.rope.freq_base", F32(500_000.0)),
            ("llama.attention.layer_norm_rms_epsilon", F32(1e-5)),
            ("llama.rope.dimension_count", U32(64)),
            ("llama.vocab_size", U32(128_256)),
            ("llama.attention.key_length", U32(64)),
            ("llama.attention.value_length", U32(64)),
        ],
        // mistralai/Mistral-7B-v0.1
        "mistral-7b-v0.1" => vec![
            ("llama.block_count", U32(32)),
            ("llama.context_length", U32(32_768)),
            ("llama.embedding_length", U32(4096)),
            ("llama.feed_forward_length", U32(14_336)),
            ("llama.attention.head_count", U32(32)),
            ("llama.attention.head_count_kv", U32(8)),
            ("llama.rope.freq_base", F32(10_000.0)),
            ("llama.attention.layer_norm_rms_epsilon", F32(1e-5)),
            ("llama.rope.dimension_count", U32(128)),
            ("llama.vocab_size", U32(32_000)),
        ],
        _ => panic!("no published configuration for {shape}"),
    }
}

#[test]
fn named_shapes_have_the_published_hyper_parameters() {
    // Vocabulary size and tied embeddings, from each config.json.
    let vocab_and_tied = [
        ("smollm2-135m", 49_152, true),
        ("gemma-3-270m", 262_144, true),
        ("qwen2.5-0.5b", 151_936, true),
        ("qwen3-0.6b", 151_936, true),
        ("llama-3.2-1b", 128_256, true),
        ("mistral-7b-v0.1", 32_000, false),
    ];
    assert_eq!(NAMED_SHAPES.len(), vocab_and_tied.len());
    for (name, vocab, tied) in vocab_and_tied {
        let model = SyntheticModel::named(name, TypeRecipe::Flat(GgmlType::Q8_0), 1).unwrap();
        let mut want = published(name);
        want.push(("general.file_type", MetaValue::U32(7)));
        want.push(("general.quantization_version", MetaValue::U32(2)));
        let got: Vec<(String, MetaValue)> = model
            .metadata()
            .into_iter()
            .filter(|(k, _)| !matches!(k.as_str(), "general.architecture" | "general.name"))
            .collect();
        let mut got_keys: Vec<&str> = got.iter().map(|(k, _)| k.as_str()).collect();
        let mut want_keys: Vec<&str> = want.iter().map(|(k, _)| *k).collect();
        got_keys.sort_unstable();
        want_keys.sort_unstable();
        assert_eq!(got_keys, want_keys, "{name}: the keys written");
        for (key, value) in &want {
            let (_, v) = got.iter().find(|(k, _)| k == key).unwrap();
            assert_eq!(v, value, "{name}: {key}");
        }
        assert_eq!(model.shape.vocab, vocab, "{name}");
        assert_eq!(model.shape.tied_output, tied, "{name}");
        let specs = model.tensor_specs().unwrap();
        assert_eq!(
            specs.iter().any(|s| s.name == "output.weight"),
            !tied,
            "{name}"
        );
        assert_eq!(
            specs[0].dims,
            [model.shape.hidden as u64, vocab as u64],
            "{name}"
        );
        validate_all_layers_present(name, &specs, model.shape.n_layers);
    }
    let gemma = named_shape("gemma-3-270m").unwrap();
    assert_eq!(gemma.shape.arch, SyntheticArch::Gemma3);
    assert_eq!(
        named_shape("qwen2.5-0.5b").unwrap().shape.arch,
        SyntheticArch::Qwen2
    );
    assert!(named_shape("phi-3-mini").is_none());
    assert_eq!(
        SyntheticModel::named("gpt-2", TypeRecipe::Flat(GgmlType::Q8_0), 1),
        Err(SyntheticError::UnknownShape {
            name: "gpt-2".into()
        })
    );
}

fn validate_all_layers_present(name: &str, specs: &[TensorSpec], n_layers: usize) {
    let last = format!("blk.{}.ffn_down.weight", n_layers - 1);
    assert!(specs.iter().any(|s| s.name == last), "{name}: {last}");
    let beyond = format!("blk.{n_layers}.");
    assert!(!specs.iter().any(|s| s.name.starts_with(&beyond)), "{name}");
}

#[test]
fn llama_3_rope_factors_equal_the_converters() {
    // rope_freqs.weight of a Llama 3.2 1B GGUF: 15 unscaled frequencies,
    // three blended, 14 divided by the factor 32.
    let llama = &named_shape("llama-3.2-1b").unwrap().shape;
    let rope = llama.llama3_rope.unwrap();
    let got = rope.factors(64, 500_000.0);
    let mut want = vec![1.0f32; 15];
    want.extend([1.651_329_3, 3.292_262_8, 9.666_731]);
    want.extend([32.0; 14]);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= w * 1e-5, "factor {i}: {g}, expected {w}");
    }
    let model = SyntheticModel::named("llama-3.2-1b", TypeRecipe::Flat(GgmlType::Q8_0), 1).unwrap();
    let rope_spec = &model.tensor_specs().unwrap()[1];
    assert_eq!(
        (rope_spec.name.as_str(), rope_spec.dims.as_slice()),
        ("rope_freqs.weight", &[32u64][..])
    );
}

#[test]
fn streaming_writes_the_bytes_building_in_memory_makes() {
    for (shape, recipe) in [
        ("smollm2-135m", "q4_k_m"),
        ("gemma-3-270m", "iq4_xs"),
        ("qwen2.5-0.5b", "bf16"),
    ] {
        let mut model =
            SyntheticModel::named(shape, TypeRecipe::from_name(recipe).unwrap(), 9).unwrap();
        model.shape = model.shape.with_layers(1).with_vocab(300);
        let built = model.try_build().unwrap();
        let mut streamed = Vec::new();
        let n = model.write_to(&mut streamed).unwrap();
        assert_eq!(n, streamed.len() as u64);
        assert!(built == streamed, "{shape} {recipe}");
        let file = GgufFile::from_bytes(streamed).unwrap();
        assert_eq!(file.tensors().len(), model.tensor_specs().unwrap().len());
    }
    // The stream of a tensor does not depend on the layer count.
    let full = SyntheticModel::named("smollm2-135m", TypeRecipe::Flat(GgmlType::Q8_0), 3).unwrap();
    let [one, two] = [1, 2].map(|layers| {
        let mut m = full.clone();
        m.shape = m.shape.clone().with_layers(layers).with_vocab(300);
        GgufFile::from_bytes(m.try_build().unwrap()).unwrap()
    });
    for name in [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.ffn_norm.weight",
    ] {
        assert_eq!(
            one.tensor_data(name).unwrap(),
            two.tensor_data(name).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn recipe_names_are_llama_cpps() {
    for name in RECIPE_NAMES {
        let recipe = TypeRecipe::from_name(name).unwrap();
        assert_eq!(recipe.name(), name);
        assert_eq!(TypeRecipe::from_name(&name.to_uppercase()), Some(recipe));
        assert!(recipe.file_type().is_some(), "{name}");
    }
    assert_eq!(
        TypeRecipe::from_name("Q4_K_M"),
        Some(TypeRecipe::Medium(GgmlType::Q4_K))
    );
    assert_eq!(TypeRecipe::from_name("q8_k"), None);
    assert_eq!(TypeRecipe::from_name("q4_0_m"), None);
    let unsupported = SyntheticModel {
        recipe: TypeRecipe::Flat(GgmlType::Q8_K),
        ..SyntheticModel::named("smollm2-135m", TypeRecipe::Flat(GgmlType::Q8_0), 1).unwrap()
    };
    assert_eq!(
        unsupported.validate(),
        Err(SyntheticError::UnsupportedWeightType { ty: GgmlType::Q8_K })
    );
}
