//! The tiny llama's tests: its directory, metadata, weights and errors, and
//! its bytes, which moving it onto `SyntheticModel` must not change.

use std::collections::HashSet;

use half::f16;

use super::*;
use crate::gguf::{GgufFile, MetaArray};

fn parse(model: &SyntheticLlama) -> GgufFile {
    GgufFile::from_bytes(model.build()).unwrap()
}
#[test]
fn byte_encoder_matches_gpt2() {
    assert_eq!(gpt2_byte_char(b'A'), 'A');
    assert_eq!(gpt2_byte_char(b' '), 'Ġ');
    assert_eq!(gpt2_byte_char(b'\n'), 'Ċ');
    assert_eq!(gpt2_byte_char(0), 'Ā');
    assert_eq!(gpt2_byte_char(0x7F), 'ġ');
    assert_eq!(gpt2_byte_char(0xAD), 'Ń');
    assert_eq!(gpt2_byte_char(0xFF), 'ÿ');
    let distinct: HashSet<char> = (0..=255u8).map(gpt2_byte_char).collect();
    assert_eq!(distinct.len(), 256);
}

#[test]
fn every_weight_type_builds_the_full_directory() {
    for ty in WEIGHT_TYPES {
        for tied_output in [false, true] {
            // Rows of 256-element blocks need a wider model than tiny's.
            let (hidden, ffn) = if ty.block_len() == 256 {
                (256, 512)
            } else {
                (64, 128)
            };
            let model = SyntheticLlama {
                weight_type: ty,
                tied_output,
                hidden,
                ffn,
                ..SyntheticLlama::tiny()
            };
            let file = parse(&model);
            let specs = model.tensor_specs().unwrap();
            assert_eq!(
                specs.len(),
                1 + 9 * model.n_layers + 1 + usize::from(!tied_output)
            );
            assert_eq!(file.tensors().len(), specs.len());
            for spec in &specs {
                let t = file.require_tensor(&spec.name).unwrap();
                assert_eq!(t.dims, spec.dims, "{}", spec.name);
                assert_eq!(t.ty, spec.ty, "{}", spec.name);
                assert_eq!(t.byte_len, spec.byte_len, "{}", spec.name);
            }
            assert_eq!(file.tensor("output.weight").is_some(), !tied_output);
        }
    }
}

#[test]
fn shapes_follow_llama_cpp() {
    let model = SyntheticLlama {
        weight_type: GgmlType::Q4_1,
        ..SyntheticLlama::tiny()
    };
    let file = parse(&model);
    let dims = |name: &str| file.require_tensor(name).unwrap().dims.clone();
    assert_eq!(dims("token_embd.weight"), [64, 320]);
    assert_eq!(dims("blk.1.attn_q.weight"), [64, 64]);
    assert_eq!(dims("blk.1.attn_k.weight"), [64, 32]);
    assert_eq!(dims("blk.1.attn_v.weight"), [64, 32]);
    assert_eq!(dims("blk.1.ffn_gate.weight"), [64, 128]);
    assert_eq!(dims("blk.1.ffn_down.weight"), [128, 64]);
    assert_eq!(dims("output_norm.weight"), [64]);
    let q = file.require_tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.byte_len, 64 * 2 * 20);
    assert_eq!(
        file.require_tensor("blk.0.ffn_norm.weight").unwrap().ty,
        GgmlType::F32
    );
}

#[test]
fn metadata_matches_the_configuration() {
    let model = SyntheticLlama::tiny();
    let file = parse(&model);
    assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
    for (key, want) in [
        ("llama.block_count", 2),
        ("llama.context_length", 256),
        ("llama.embedding_length", 64),
        ("llama.feed_forward_length", 128),
        ("llama.attention.head_count", 4),
        ("llama.attention.head_count_kv", 2),
        ("llama.rope.dimension_count", 16),
        ("llama.vocab_size", 320),
        ("tokenizer.ggml.bos_token_id", 257),
        ("tokenizer.ggml.eos_token_id", 258),
    ] {
        assert_eq!(file.get_u64(key).unwrap(), want, "{key}");
    }
    assert_eq!(file.get_f32("llama.rope.freq_base").unwrap(), 10_000.0);
    assert_eq!(
        file.get_f32("llama.attention.layer_norm_rms_epsilon")
            .unwrap(),
        1e-5
    );
    assert_eq!(file.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    let MetaArray::String(tokens) = file.get_array("tokenizer.ggml.tokens").unwrap() else {
        panic!("tokens are not strings");
    };
    assert_eq!(tokens.len(), 320);
    assert_eq!(tokens[32], "Ġ");
    assert_eq!(tokens[257], "<|im_start|>");
    assert_eq!(tokens[319], "[PAD319]");
    let MetaArray::I32(types) = file.get_array("tokenizer.ggml.token_type").unwrap() else {
        panic!("token types are not i32");
    };
    assert_eq!((types[0], types[258], types[259]), (1, 3, 5));
    assert!(file.get_array("tokenizer.ggml.merges").unwrap().is_empty());
    assert_eq!(
        file.get_bool_opt("tokenizer.ggml.add_bos_token").unwrap(),
        Some(false)
    );
    let template = file.get_str("tokenizer.chat_template").unwrap();
    assert!(template
        .contains("<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"));
}

#[test]
fn weights_are_deterministic_and_in_range() {
    let model = SyntheticLlama::tiny();
    assert_eq!(model.build(), model.build());
    assert_ne!(
        model.build(),
        SyntheticLlama {
            seed: 2,
            ..model.clone()
        }
        .build()
    );

    let file = parse(&model);
    let floats = |name: &str| -> Vec<f32> {
        let bytes = file.tensor_data(name).unwrap();
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let norm = floats("blk.0.attn_norm.weight");
    assert!(norm.iter().all(|&x| (0.9..=1.1).contains(&x)));
    let q = floats("blk.0.attn_q.weight");
    let bound = 0.5 / 8.0;
    assert!(q.iter().all(|&x| x.abs() <= bound));
    assert!(q.iter().any(|&x| x.abs() > bound / 2.0));
    assert_ne!(floats("blk.0.attn_k.weight"), floats("blk.1.attn_k.weight"));
}

#[test]
fn quantized_blocks_decode_within_scale() {
    let q8 = SyntheticLlama {
        weight_type: GgmlType::Q8_0,
        ..SyntheticLlama::tiny()
    };
    let file = parse(&q8);
    let bound = 0.5 / 8.0 + 1e-3;
    for block in file
        .tensor_data("blk.0.attn_q.weight")
        .unwrap()
        .chunks_exact(34)
    {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        assert!(d > 0.0 && d.is_finite());
        assert!(block[2..].iter().all(|&q| q as i8 != i8::MIN));
        assert!(block[2..]
            .iter()
            .all(|&q| (d * f32::from(q as i8)).abs() <= bound));
    }
    let q4 = SyntheticLlama {
        weight_type: GgmlType::Q4_1,
        ..SyntheticLlama::tiny()
    };
    let file = parse(&q4);
    for block in file
        .tensor_data("blk.0.ffn_up.weight")
        .unwrap()
        .chunks_exact(20)
    {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let m = f16::from_le_bytes([block[2], block[3]]).to_f32();
        for &byte in &block[4..] {
            for q in [byte & 0x0F, byte >> 4] {
                assert!((d * f32::from(q) + m).abs() <= bound);
            }
        }
    }
}

#[test]
fn invalid_configurations_are_errors() {
    let tiny = SyntheticLlama::tiny();
    let cases = [
        (
            SyntheticLlama {
                n_layers: 0,
                ..tiny.clone()
            },
            SyntheticError::Zero { field: "n_layers" },
        ),
        (
            SyntheticLlama {
                n_heads: 3,
                ..tiny.clone()
            },
            SyntheticError::HeadsDoNotDivideHidden {
                hidden: 64,
                n_heads: 3,
            },
        ),
        (
            SyntheticLlama {
                n_kv_heads: 3,
                ..tiny.clone()
            },
            SyntheticError::KvHeadsDoNotDivideHeads {
                n_heads: 4,
                n_kv_heads: 3,
            },
        ),
        (
            SyntheticLlama {
                vocab: 258,
                ..tiny.clone()
            },
            SyntheticError::VocabTooSmall { vocab: 258 },
        ),
        (
            SyntheticLlama {
                ffn: 48,
                weight_type: GgmlType::Q8_0,
                ..tiny.clone()
            },
            SyntheticError::NotWholeBlocks {
                field: "ffn",
                value: 48,
                ty: GgmlType::Q8_0,
                block: 32,
            },
        ),
        (
            SyntheticLlama {
                weight_type: GgmlType::Q4_K,
                ..tiny.clone()
            },
            SyntheticError::NotWholeBlocks {
                field: "hidden",
                value: 64,
                ty: GgmlType::Q4_K,
                block: 256,
            },
        ),
        (
            // An activation-only format: no matrix kernel takes it.
            SyntheticLlama {
                weight_type: GgmlType::Q8_K,
                ..tiny.clone()
            },
            SyntheticError::UnsupportedWeightType { ty: GgmlType::Q8_K },
        ),
        (
            SyntheticLlama {
                hidden: 12,
                n_heads: 4,
                n_kv_heads: 4,
                ..tiny.clone()
            },
            SyntheticError::OddHeadDim { head_dim: 3 },
        ),
    ];
    for (model, want) in cases {
        assert_eq!(model.try_build(), Err(want));
    }
}

#[test]
fn the_tiny_llama_keeps_its_bytes() {
    // SHA-256 of the images the first synthetic.rs wrote: tests pin logits
    // and hashes of these files, so moving SyntheticLlama onto
    // SyntheticModel must not change a byte.
    use sha2::{Digest, Sha256};
    let want = [
        (
            GgmlType::F32,
            false,
            "02fe69121d0eea0f37f7c9c422a9b218508361045ec3d1eca19f457423b0d207",
        ),
        (
            GgmlType::F32,
            true,
            "57eb48d9777a30c1c95532ebb95a72a76d7c2e945a4940c70e976fb8f8b5d742",
        ),
        (
            GgmlType::F16,
            false,
            "08468964f09dc11089211d3d2c30f9a7f930bfe9d085353202048e2af5cd76e8",
        ),
        (
            GgmlType::F16,
            true,
            "0abb9b94a61d83301321db9ec567a811c17ad72b0e3523bf8927cf57f33c15a6",
        ),
        (
            GgmlType::Q8_0,
            false,
            "fde8dec3aa9f30be934565f93feb0e2ceebdc72e03693f1b25687127f034e62e",
        ),
        (
            GgmlType::Q8_0,
            true,
            "6bf7b2334a91cc75ff03897f5dd56083e52c6b0a86bfda25715def1dfc5a3c0f",
        ),
        (
            GgmlType::Q4_1,
            false,
            "1c5fff32b45097fc8cef1e80b1fbe160a05ed5767e4eea1dec0d122c0795b805",
        ),
        (
            GgmlType::Q4_1,
            true,
            "99bb4bf1821374798d5e4e2242e9b0ab8dadb7e5c42a86950ef8de4cc51c0537",
        ),
    ];
    for (ty, tied_output, hash) in want {
        let model = SyntheticLlama {
            weight_type: ty,
            tied_output,
            ..SyntheticLlama::tiny()
        };
        let got: String = Sha256::digest(model.build())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(got, hash, "{ty}, tied {tied_output}");
    }
}
