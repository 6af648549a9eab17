//! Writes the seed corpus for the `gguf_parse` target: small valid GGUF
//! images covering every metadata type, several tensor types, both format
//! versions and a whole synthetic llama model.
//!
//! Usage: `cargo run --manifest-path fuzz/Cargo.toml --bin gguf_seed_corpus [DIR]`
//! (default `fuzz/corpus/gguf_parse`).

use std::path::PathBuf;

use inferd::gguf::synthetic::SyntheticLlama;
use inferd::gguf::{GgufWriter, MetaArray, MetaValue};
use inferd::quant::GgmlType;

fn main() -> std::io::Result<()> {
    let dir = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/corpus/gguf_parse"))
        });
    std::fs::create_dir_all(&dir)?;

    let mut seeds: Vec<(&str, Vec<u8>)> = vec![("empty_v3", GgufWriter::new(3).to_bytes())];

    let mut values = GgufWriter::new(2);
    values
        .alignment(8)
        .add_meta("u8", MetaValue::U8(1))
        .add_meta("i8", MetaValue::I8(-1))
        .add_meta("u16", MetaValue::U16(2))
        .add_meta("i16", MetaValue::I16(-2))
        .add_meta("u32", MetaValue::U32(3))
        .add_meta("i32", MetaValue::I32(-3))
        .add_meta("f32", MetaValue::F32(0.5))
        .add_meta("bool", MetaValue::Bool(true))
        .add_meta("string", MetaValue::String("text".into()))
        .add_meta("u64", MetaValue::U64(4))
        .add_meta("i64", MetaValue::I64(-4))
        .add_meta("f64", MetaValue::F64(0.25))
        .add_meta(
            "nested",
            MetaValue::Array(MetaArray::Array(vec![
                MetaArray::String(vec!["a".into(), String::new()]),
                MetaArray::Array(vec![MetaArray::U16(vec![1, 2])]),
            ])),
        );
    seeds.push(("all_value_types_v2", values.to_bytes()));

    let mut tensors = GgufWriter::new(3);
    tensors
        .add_meta("general.architecture", MetaValue::String("llama".into()))
        .add_tensor("f32", &[4], GgmlType::F32, vec![1; 16])
        .add_tensor("f16", &[2, 3], GgmlType::F16, vec![2; 12])
        .add_tensor("q8_0", &[32, 2], GgmlType::Q8_0, vec![3; 68])
        .add_tensor("q4_1", &[32], GgmlType::Q4_1, vec![4; 20])
        .add_tensor("q4_k", &[256, 1, 1, 1], GgmlType::Q4_K, vec![5; 144]);
    seeds.push(("tensor_types_v3", tensors.to_bytes()));

    let model = SyntheticLlama {
        n_layers: 1,
        hidden: 32,
        n_heads: 2,
        n_kv_heads: 1,
        ffn: 64,
        vocab: 260,
        weight_type: GgmlType::Q4_1,
        tied_output: true,
        ..SyntheticLlama::tiny()
    };
    seeds.push(("synthetic_llama_q4_1", model.build()));

    for (name, bytes) in seeds {
        std::fs::write(dir.join(format!("{name}.gguf")), bytes)?;
    }
    println!("wrote seeds to {}", dir.display());
    Ok(())
}
