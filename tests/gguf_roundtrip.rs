//! Writer/reader round trips: everything `GgufWriter` writes, `GgufFile`
//! reads back equal, in both format versions and several alignments; and
//! the reference model, when present, parses with the expected directory.

use inferd::gguf::synthetic::SyntheticLlama;
use inferd::gguf::{GgufFile, GgufWriter, MetaArray, MetaValue, MetaValueType};
use inferd::quant::GgmlType;

/// One entry of every scalar type, arrays of every element type (empty ones
/// too), nested arrays of mixed element types, and empty strings.
fn every_kind_of_value() -> Vec<(String, MetaValue)> {
    let scalars = [
        MetaValue::U8(0xFE),
        MetaValue::I8(-7),
        MetaValue::U16(0xBEEF),
        MetaValue::I16(-30_000),
        MetaValue::U32(0xDEAD_BEEF),
        MetaValue::I32(i32::MIN),
        MetaValue::F32(-1.5e-7),
        MetaValue::Bool(true),
        MetaValue::Bool(false),
        MetaValue::String("héllo, GGUF".into()),
        MetaValue::String(String::new()),
        MetaValue::U64(u64::MAX),
        MetaValue::I64(i64::MIN + 1),
        MetaValue::F64(std::f64::consts::PI),
    ];
    let arrays = [
        MetaArray::U8(vec![0, 1, 255]),
        MetaArray::I8(vec![-128, 0, 127]),
        MetaArray::U16(vec![1, 65535]),
        MetaArray::I16(vec![-1, 2]),
        MetaArray::U32(vec![7; 5]),
        MetaArray::I32(vec![-5, 5, 0]),
        MetaArray::F32(vec![0.25, -0.0, f32::INFINITY, f32::MIN_POSITIVE]),
        MetaArray::Bool(vec![true, false, true]),
        MetaArray::String(vec!["".into(), "a".into(), "ĠĊ漢字".into(), "".into()]),
        MetaArray::U64(vec![u64::MAX, 0]),
        MetaArray::I64(vec![i64::MAX, -1]),
        MetaArray::F64(vec![1e300, -2.5]),
        MetaArray::U8(vec![]),
        MetaArray::String(vec![]),
        MetaArray::F64(vec![]),
        MetaArray::Array(vec![]),
        MetaArray::Array(vec![
            MetaArray::U32(vec![1, 2, 3]),
            MetaArray::String(vec!["x".into(), "".into()]),
            MetaArray::Array(vec![MetaArray::Array(vec![MetaArray::Bool(vec![true])])]),
            MetaArray::I8(vec![]),
        ]),
    ];
    let mut out: Vec<(String, MetaValue)> = scalars
        .into_iter()
        .enumerate()
        .map(|(i, v)| (format!("test.scalar.{i}"), v))
        .collect();
    out.extend(
        arrays
            .into_iter()
            .enumerate()
            .map(|(i, a)| (format!("test.array.{i}"), MetaValue::Array(a))),
    );
    out.push((String::new(), MetaValue::String("the empty key".into())));
    out
}

struct Tensor {
    name: &'static str,
    dims: Vec<u64>,
    ty: GgmlType,
    bytes: Vec<u8>,
}

fn some_tensors() -> Vec<Tensor> {
    let ramp = |n: usize| (0..n).map(|i| (i * 7 + 3) as u8).collect::<Vec<u8>>();
    vec![
        Tensor {
            name: "scalar_like",
            dims: vec![1],
            ty: GgmlType::F32,
            bytes: ramp(4),
        },
        Tensor {
            name: "f16.matrix",
            dims: vec![3, 5],
            ty: GgmlType::F16,
            bytes: ramp(30),
        },
        Tensor {
            name: "q8_0.rows",
            dims: vec![64, 3],
            ty: GgmlType::Q8_0,
            bytes: ramp(6 * 34),
        },
        Tensor {
            name: "q4_1.cube",
            dims: vec![32, 2, 2],
            ty: GgmlType::Q4_1,
            bytes: ramp(4 * 20),
        },
        Tensor {
            name: "q4_k.4d",
            dims: vec![256, 1, 2, 1],
            ty: GgmlType::Q4_K,
            bytes: ramp(2 * 144),
        },
        Tensor {
            name: "",
            dims: vec![2],
            ty: GgmlType::BF16,
            bytes: ramp(4),
        },
    ]
}

#[test]
fn every_value_and_tensor_comes_back_equal() {
    for version in [2, 3] {
        for alignment in [1, 8, 32, 4096] {
            let values = every_kind_of_value();
            let tensors = some_tensors();
            let mut w = GgufWriter::new(version);
            w.alignment(alignment);
            for (k, v) in &values {
                w.add_meta(k.clone(), v.clone());
            }
            for t in &tensors {
                w.add_tensor(t.name, &t.dims, t.ty, t.bytes.clone());
            }
            let file = GgufFile::from_bytes(w.to_bytes()).unwrap();

            assert_eq!(file.version(), version);
            assert_eq!(file.alignment(), alignment);
            let read: Vec<(String, MetaValue)> = file
                .metadata()
                .filter(|(k, _)| *k != "general.alignment")
                .map(|(k, v)| (k.to_owned(), v.clone()))
                .collect();
            assert_eq!(read, values);
            for (k, v) in &values {
                assert_eq!(file.get(k), Some(v), "{k}");
            }

            assert_eq!(file.tensors().len(), tensors.len());
            for (t, info) in tensors.iter().zip(file.tensors()) {
                assert_eq!(info.name, t.name);
                assert_eq!(info.dims, t.dims);
                assert_eq!(info.ty, t.ty);
                assert_eq!(info.byte_len, t.bytes.len());
                assert_eq!(info.file_offset as u64 % alignment, 0);
                assert_eq!(file.tensor_bytes(info), t.bytes.as_slice());
                assert_eq!(file.tensor_data(t.name).unwrap(), t.bytes.as_slice());
            }
            let q4 = file.tensor("q4_1.cube").unwrap();
            assert_eq!(
                (q4.row_len(), q4.row_count(), q4.element_count()),
                (32, 4, 128)
            );
        }
    }
}

#[test]
fn typed_getters_read_what_was_written() {
    let mut w = GgufWriter::new(3);
    w.add_meta("u8", MetaValue::U8(9))
        .add_meta("i32.neg", MetaValue::I32(-1))
        .add_meta("f64", MetaValue::F64(0.5))
        .add_meta("flag", MetaValue::Bool(true))
        .add_meta("name", MetaValue::String("x".into()));
    let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(file.get_u64("u8").unwrap(), 9);
    assert_eq!(file.get_u64_opt("absent").unwrap(), None);
    assert_eq!(file.get_f32("f64").unwrap(), 0.5);
    assert_eq!(file.get_f32_opt("absent").unwrap(), None);
    assert_eq!(file.get_bool_opt("flag").unwrap(), Some(true));
    assert_eq!(file.get_str("name").unwrap(), "x");
    assert_eq!(file.get_str_opt("absent").unwrap(), None);
    assert_eq!(file.get("flag").unwrap().value_type(), MetaValueType::Bool);
    // Negative integers are not counts; the wrong type is reported, not ignored.
    assert!(file.get_u64("i32.neg").is_err());
    assert!(file.get_bool_opt("u8").is_err());
    assert!(file.get_array("name").is_err());
    assert!(file.require_tensor("nothing").is_err());
}

#[test]
fn write_to_produces_an_openable_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let model = SyntheticLlama::tiny();
    let mut w = GgufWriter::new(3);
    w.add_meta("general.architecture", MetaValue::String("llama".into()))
        .add_tensor("t", &[4], GgmlType::F32, vec![1; 16]);
    w.write_to(&path).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.tensor_data("t").unwrap(), &[1; 16]);

    std::fs::write(&path, model.build()).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.get_u64("llama.block_count").unwrap(), 2);
}

/// The reference model, when it has been fetched, parses with the directory
/// the rest of the crate relies on.
#[test]
fn reference_model_parses_when_present() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("skipping: {} not present", path.display());
        return;
    }
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(file.get_u64("llama.block_count").unwrap(), 30);
    assert_eq!(file.get_u64("llama.embedding_length").unwrap(), 576);
    let embd = file.require_tensor("token_embd.weight").unwrap();
    assert_eq!(embd.dims, [576, 49152]);
    assert_eq!(embd.ty, GgmlType::Q8_0);
    let k = file.require_tensor("blk.29.attn_k.weight").unwrap();
    assert_eq!(k.dims, [576, 192]);
    assert_eq!(k.ty, GgmlType::Q4_1);
    assert!(file.tensor("output.weight").is_none());
    let tokens = file.get_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
}
