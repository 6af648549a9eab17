//! The GGUF reader against hostile files: every malformation gets its own
//! `GgufError` variant and a message naming the culprit, and random damage
//! never makes the reader panic.
//!
//! Inputs are built with `GgufWriter` and then corrupted in place; fields are
//! found by searching for the unique key or tensor name that precedes them.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use inferd::gguf::{GgufError, GgufFile, GgufWriter, MetaArray, MetaValue, MAX_ARRAY_DEPTH};
use inferd::quant::GgmlType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TENSOR_COUNT_AT: usize = 8;
const KV_COUNT_AT: usize = 16;

fn text(s: &str) -> MetaValue {
    MetaValue::String(s.into())
}

/// A small valid file: a few kinds of metadata and three tensors, the last
/// ending exactly on the alignment so the file has no trailing padding.
fn base_writer() -> GgufWriter {
    let mut w = GgufWriter::new(3);
    w.add_meta("general.architecture", text("llama"))
        .add_meta("test.count", MetaValue::U32(7))
        .add_meta(
            "test.words",
            MetaValue::Array(MetaArray::String(vec!["a".into(), "bc".into(), "".into()])),
        )
        .add_meta(
            "test.nested",
            MetaValue::Array(MetaArray::Array(vec![
                MetaArray::U8(vec![1, 2]),
                MetaArray::F32(vec![0.5]),
            ])),
        )
        .add_meta("test.label", text("value"))
        .add_tensor("tensor.first", &[8], GgmlType::F32, vec![1; 32])
        .add_tensor("tensor.second", &[32, 2], GgmlType::Q8_0, vec![2; 68])
        .add_tensor("tensor.third", &[4, 4], GgmlType::F16, vec![3; 32]);
    w
}

fn base() -> Vec<u8> {
    base_writer().to_bytes()
}

fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(bytes)
}

/// The error of a file that must be refused.
fn refuse(bytes: Vec<u8>) -> GgufError {
    match parse(bytes) {
        Ok(file) => panic!("a malformed file was accepted: {file:?}"),
        Err(e) => e,
    }
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{:?} not in the image", String::from_utf8_lossy(needle)))
}

/// Offset of the first byte after a key or tensor name.
fn after(image: &[u8], name: &str) -> usize {
    find(image, name.as_bytes()) + name.len()
}

fn put_u32(image: &mut [u8], at: usize, v: u32) {
    image[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(image: &mut [u8], at: usize, v: u64) {
    image[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Offset of a tensor's `offset` field (name, n_dims, dims, type, offset).
fn tensor_offset_field(image: &[u8], name: &str, n_dims: usize) -> usize {
    after(image, name) + 4 + 8 * n_dims + 4
}

fn assert_names(e: &GgufError, words: &[&str]) {
    let message = e.to_string();
    for w in words {
        assert!(
            message.contains(w),
            "message {message:?} does not mention {w:?}"
        );
    }
}

#[test]
fn the_base_file_is_valid() {
    let file = parse(base()).unwrap();
    assert_eq!(file.tensors().len(), 3);
    let third = file.tensor("tensor.third").unwrap();
    assert_eq!(third.file_offset + third.byte_len, file.file_len());
}

#[test]
fn every_truncation_is_an_error() {
    let image = base();
    for len in 0..image.len() {
        let e = refuse(image[..len].to_vec());
        assert!(
            matches!(
                e,
                GgufError::Truncated { .. }
                    | GgufError::TooLarge { .. }
                    | GgufError::TensorOutOfFile { .. }
            ),
            "prefix of {len} bytes: {e}"
        );
    }
}

#[test]
fn wrong_magic() {
    let mut image = base();
    image[..4].copy_from_slice(b"GGML");
    let e = refuse(image);
    assert!(matches!(e, GgufError::BadMagic { found } if &found == b"GGML"));
    assert_names(&e, &["not a GGUF file", "magic"]);
}

#[test]
fn unsupported_versions() {
    for version in [0, 1, 4, 3u32.swap_bytes(), u32::MAX] {
        let mut image = base();
        put_u32(&mut image, 4, version);
        let e = refuse(image);
        assert!(matches!(e, GgufError::UnsupportedVersion { version: v } if v == version));
        assert_names(&e, &[&version.to_string()]);
    }
    let mut swapped = base();
    put_u32(&mut swapped, 4, 2u32.swap_bytes());
    assert_names(&refuse(swapped), &["big-endian"]);
}

#[test]
fn absurd_tensor_and_metadata_counts() {
    let image = base();
    let after_header = (image.len() - 24) as u64;
    for (at, what, min_bytes) in [
        (TENSOR_COUNT_AT, "tensor count", 32),
        (KV_COUNT_AT, "metadata entry count", 13),
    ] {
        for count in [u64::MAX, 1 << 40, after_header / min_bytes + 1] {
            let mut bad = image.clone();
            put_u64(&mut bad, at, count);
            let e = refuse(bad);
            assert!(
                matches!(e, GgufError::TooLarge { what: w, value, .. } if w == what && value == count),
                "{e}"
            );
            assert_names(&e, &[what, &count.to_string()]);
        }
    }
    // Fewer entries than claimed: the reader runs into the next section.
    let mut extra_kv = image.clone();
    put_u64(&mut extra_kv, KV_COUNT_AT, 6);
    assert!(parse(extra_kv).is_err());
}

#[test]
fn absurd_array_lengths() {
    let image = base();
    let len_at = after(&image, "test.words") + 4 + 4;
    let left = (image.len() - len_at - 8) as u64;
    // Each string needs at least its 8-byte length, so 2^40 empty strings
    // cannot fit and are refused before anything is allocated.
    for count in [u64::MAX, 1 << 40, left / 8 + 1] {
        let mut bad = image.clone();
        put_u64(&mut bad, len_at, count);
        let e = refuse(bad);
        assert!(
            matches!(e, GgufError::TooLarge { what: "metadata array length", value, limit } if value == count && limit <= left / 8),
            "{e}"
        );
        assert_names(&e, &["metadata array length", &count.to_string()]);
    }
    // An array of arrays: each element needs at least 12 bytes.
    let nested_len_at = after(&image, "test.nested") + 4 + 4;
    let mut bad = image.clone();
    put_u64(&mut bad, nested_len_at, 1 << 50);
    assert!(matches!(
        refuse(bad),
        GgufError::TooLarge {
            what: "metadata array length",
            ..
        }
    ));
}

#[test]
fn absurd_string_lengths() {
    let image = base();
    let value_len_at = after(&image, "test.label") + 4;
    let mut bad = image.clone();
    put_u64(&mut bad, value_len_at, u64::MAX);
    let e = refuse(bad);
    assert!(
        matches!(
            e,
            GgufError::TooLarge {
                what: "metadata string",
                value: u64::MAX,
                ..
            }
        ),
        "{e}"
    );

    let just_over = (image.len() - value_len_at - 8 + 1) as u64;
    let mut bad = image.clone();
    put_u64(&mut bad, value_len_at, just_over);
    let e = refuse(bad);
    assert!(
        matches!(e, GgufError::Truncated { what: "metadata string", needed, .. } if needed == just_over),
        "{e}"
    );
    assert_names(
        &e,
        &["truncated", "metadata string", &just_over.to_string()],
    );

    // A key length: the first key's length field is right after the header.
    let mut bad = image.clone();
    put_u64(&mut bad, 24, u64::MAX);
    assert!(matches!(
        refuse(bad),
        GgufError::TooLarge {
            what: "metadata key",
            ..
        }
    ));

    let name_len_at = find(&image, b"tensor.first") - 8;
    let mut bad = image.clone();
    put_u64(&mut bad, name_len_at, (image.len() - name_len_at) as u64);
    assert!(matches!(
        refuse(bad),
        GgufError::Truncated {
            what: "tensor name",
            ..
        }
    ));
}

#[test]
fn unknown_metadata_value_types() {
    let image = base();
    for type_id in [13, 255, u32::MAX] {
        let mut bad = image.clone();
        put_u32(&mut bad, after(&image, "test.count"), type_id);
        let e = refuse(bad);
        assert!(
            matches!(&e, GgufError::UnknownValueType { key, type_id: t } if key == "test.count" && *t == type_id)
        );
        assert_names(&e, &["test.count", &type_id.to_string()]);
    }
    // The element type of an array.
    let mut bad = image.clone();
    put_u32(&mut bad, after(&image, "test.words") + 4, 99);
    let e = refuse(bad);
    assert!(matches!(&e, GgufError::UnknownValueType { key, type_id: 99 } if key == "test.words"));
}

#[test]
fn unknown_tensor_type_ids() {
    let image = base();
    for type_id in [4, 5, 16, 31, 1000, u32::MAX] {
        let mut bad = image.clone();
        put_u32(&mut bad, after(&image, "tensor.second") + 4 + 16, type_id);
        let e = refuse(bad);
        assert!(
            matches!(&e, GgufError::UnknownTensorType { name, type_id: t } if name == "tensor.second" && *t == type_id)
        );
        assert_names(&e, &["tensor.second", &type_id.to_string()]);
    }
}

#[test]
fn dimension_counts_outside_one_to_four() {
    let image = base();
    for n_dims in [0, 5, u32::MAX] {
        let mut bad = image.clone();
        put_u32(&mut bad, after(&image, "tensor.third"), n_dims);
        let e = refuse(bad);
        assert!(
            matches!(&e, GgufError::BadShape { name, .. } if name == "tensor.third"),
            "{e}"
        );
        assert_names(&e, &["tensor.third", "number of dimensions"]);
    }
}

fn one_tensor(dims: &[u64], ty: GgmlType, bytes: usize) -> Vec<u8> {
    let mut w = GgufWriter::new(3);
    w.add_tensor("shape.test", dims, ty, vec![0; bytes]);
    w.to_bytes()
}

#[test]
fn invalid_shapes() {
    let cases: [(&[u64], GgmlType, &str); 6] = [
        (&[0], GgmlType::F32, "zero"),
        (&[4, 0, 2], GgmlType::F32, "zero"),
        (
            &[1 << 32, 1 << 32],
            GgmlType::F32,
            "element count overflows",
        ),
        (&[u64::MAX, 2], GgmlType::F16, "element count overflows"),
        (&[1 << 62], GgmlType::F32, "byte size overflows"),
        (&[33], GgmlType::Q8_0, "whole number of blocks"),
    ];
    for (dims, ty, why) in cases {
        let e = refuse(one_tensor(dims, ty, 64));
        assert!(
            matches!(&e, GgufError::BadShape { name, dims: d, .. } if name == "shape.test" && d == dims),
            "{e}"
        );
        assert_names(&e, &["shape.test", why]);
    }
    // A row of 256 is whole for Q8_0 but not for a 256-element K-quant block
    // when the row is 128.
    assert!(parse(one_tensor(&[256], GgmlType::Q8_0, 8 * 34)).is_ok());
    assert!(matches!(
        refuse(one_tensor(&[128], GgmlType::Q4_K, 144)),
        GgufError::BadShape { .. }
    ));
}

#[test]
fn misaligned_offsets() {
    let image = base();
    for offset in [1, 4, 31, 33] {
        let mut bad = image.clone();
        put_u64(
            &mut bad,
            tensor_offset_field(&image, "tensor.third", 2),
            offset,
        );
        let e = refuse(bad);
        assert!(
            matches!(&e, GgufError::MisalignedTensor { name, offset: o, alignment: 32 } if name == "tensor.third" && *o == offset)
        );
        assert_names(&e, &["tensor.third", &offset.to_string(), "32"]);
    }
}

#[test]
fn tensors_past_the_end() {
    let image = base();
    let at = tensor_offset_field(&image, "tensor.third", 2);
    let data_len = (image.len() - parse(image.clone()).unwrap().data_start()) as u64;
    for offset in [data_len, data_len + 32, 1 << 40, u64::MAX - 31] {
        let mut bad = image.clone();
        put_u64(&mut bad, at, offset);
        let e = refuse(bad);
        assert!(
            matches!(&e, GgufError::TensorOutOfFile { name, start, data_len: d, .. } if name == "tensor.third" && *start == offset && *d == data_len),
            "{e}"
        );
        assert_names(&e, &["tensor.third", &data_len.to_string()]);
    }
    // A shape larger than the data it claims.
    let e = refuse(one_tensor(&[1 << 40], GgmlType::F32, 64));
    assert!(matches!(&e, GgufError::TensorOutOfFile { name, .. } if name == "shape.test"));
    // A tensor directory whose padding runs past the end of the file.
    let mut w = GgufWriter::new(3);
    w.add_tensor("t", &[1], GgmlType::F32, vec![0; 4]);
    let full = w.to_bytes();
    let dir_end = full.len() - 32;
    let e = refuse(full[..dir_end - 1].to_vec());
    assert!(
        matches!(e, GgufError::Truncated { .. } | GgufError::TooLarge { .. }),
        "{e}"
    );
}

#[test]
fn overlapping_tensors() {
    let image = base();
    for (name, n_dims, offset) in [
        ("tensor.second", 2, 0),
        ("tensor.third", 2, 64),
        ("tensor.first", 1, 32),
    ] {
        let mut bad = image.clone();
        put_u64(&mut bad, tensor_offset_field(&image, name, n_dims), offset);
        let e = refuse(bad);
        assert!(
            matches!(e, GgufError::OverlappingTensors { .. }),
            "{name}: {e}"
        );
        assert_names(&e, &[name, "overlap"]);
    }
}

#[test]
fn duplicate_keys_and_tensor_names() {
    let mut w = base_writer();
    w.add_meta("test.count", MetaValue::U64(8));
    let e = refuse(w.to_bytes());
    assert!(matches!(&e, GgufError::DuplicateKey { key } if key == "test.count"));
    assert_names(&e, &["test.count"]);

    let mut w = base_writer();
    w.add_tensor("tensor.first", &[8], GgmlType::F32, vec![0; 32]);
    let e = refuse(w.to_bytes());
    assert!(matches!(&e, GgufError::DuplicateTensor { name } if name == "tensor.first"));
    assert_names(&e, &["tensor.first"]);
}

#[test]
fn bad_alignment() {
    for alignment in [0, 3, 48, 1 << 20] {
        let mut w = base_writer();
        w.alignment(alignment);
        let e = refuse(w.to_bytes());
        assert!(
            matches!(e, GgufError::BadAlignment { alignment: a } if a == alignment),
            "{e}"
        );
        assert_names(&e, &["general.alignment", &alignment.to_string()]);
    }
    for value in [text("32"), MetaValue::F32(32.0), MetaValue::I32(-32)] {
        let mut w = base_writer();
        w.add_meta("general.alignment", value);
        let e = refuse(w.to_bytes());
        assert!(
            matches!(&e, GgufError::WrongType { key, .. } if key == "general.alignment"),
            "{e}"
        );
        assert_names(&e, &["general.alignment"]);
    }
    // Any integer width holding a good value is accepted.
    let mut w = base_writer();
    w.add_meta("general.alignment", MetaValue::U8(32));
    assert_eq!(parse(w.to_bytes()).unwrap().alignment(), 32);
}

#[test]
fn invalid_utf8() {
    let mut w = base_writer();
    w.add_meta("bad#key", MetaValue::U8(1))
        .add_meta("good.key", text("bad#value"));
    let image = w.to_bytes();

    let mut bad = image.clone();
    let at = find(&image, b"bad#key") + 3;
    bad[at] = 0xFF;
    let e = refuse(bad);
    assert!(
        matches!(e, GgufError::InvalidUtf8 { what: "metadata key", offset } if offset as usize == at - 3),
        "{e}"
    );
    assert_names(&e, &["metadata key", "UTF-8", &(at - 3).to_string()]);

    let mut bad = image.clone();
    let at = find(&image, b"bad#value") + 3;
    bad[at..at + 2].copy_from_slice(&[0xC3, 0x28]);
    let e = refuse(bad);
    assert!(
        matches!(
            e,
            GgufError::InvalidUtf8 {
                what: "metadata string",
                ..
            }
        ),
        "{e}"
    );

    let mut bad = image.clone();
    let at = find(&image, b"tensor.second") + 6;
    bad[at] = 0x80;
    assert!(matches!(
        refuse(bad),
        GgufError::InvalidUtf8 {
            what: "tensor name",
            ..
        }
    ));

    let mut bad = image;
    let at = find(&bad, b"bc") + 1;
    bad[at] = 0xFE;
    assert!(matches!(
        refuse(bad),
        GgufError::InvalidUtf8 {
            what: "metadata array string",
            ..
        }
    ));
}

fn nested(depth: usize) -> MetaArray {
    (1..depth).fold(MetaArray::U8(vec![7]), |inner, _| {
        MetaArray::Array(vec![inner])
    })
}

#[test]
fn nesting_too_deep() {
    let mut ok = base_writer();
    ok.add_meta("deep.ok", MetaValue::Array(nested(MAX_ARRAY_DEPTH)));
    let file = parse(ok.to_bytes()).unwrap();
    assert_eq!(
        file.get("deep.ok"),
        Some(&MetaValue::Array(nested(MAX_ARRAY_DEPTH)))
    );

    for depth in [MAX_ARRAY_DEPTH + 1, 64] {
        let mut w = base_writer();
        w.add_meta("deep.bad", MetaValue::Array(nested(depth)));
        let e = refuse(w.to_bytes());
        assert!(
            matches!(&e, GgufError::NestingTooDeep { key, limit } if key == "deep.bad" && *limit == MAX_ARRAY_DEPTH)
        );
        assert_names(&e, &["deep.bad", &MAX_ARRAY_DEPTH.to_string()]);
    }
}

/// Remembers, per thread, the largest single allocation, so a test can see
/// whether the reader reserved memory for what a file merely claims.
struct LargestAllocation;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the
// bookkeeping touches only a const-initialised thread-local cell, which
// never allocates.
unsafe impl GlobalAlloc for LargestAllocation {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(layout.size())));
        // SAFETY: same contract as this function's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

/// A file whose nested arrays each claim as many elements as the remaining
/// bytes could hold, and whose first innermost element is absurd: the
/// claims must not be reserved before elements are really read.
#[test]
fn nested_claims_do_not_allocate_up_front() {
    const PAYLOAD: usize = 64 << 20;
    let mut image = Vec::new();
    image.extend_from_slice(b"GGUF");
    image.extend_from_slice(&3u32.to_le_bytes());
    image.extend_from_slice(&0u64.to_le_bytes());
    image.extend_from_slice(&1u64.to_le_bytes());
    image.extend_from_slice(&1u64.to_le_bytes());
    image.push(b'k');
    image.extend_from_slice(&9u32.to_le_bytes());
    for _ in 0..MAX_ARRAY_DEPTH - 1 {
        image.extend_from_slice(&9u32.to_le_bytes());
        image.extend_from_slice(&((PAYLOAD / 12) as u64).to_le_bytes());
    }
    image.extend_from_slice(&8u32.to_le_bytes());
    image.extend_from_slice(&((PAYLOAD / 8) as u64).to_le_bytes());
    image.extend_from_slice(&u64::MAX.to_le_bytes());
    image.resize(image.len() + PAYLOAD, 0);

    LARGEST.with(|l| l.set(0));
    let e = refuse(image);
    let largest = LARGEST.with(Cell::get);
    assert!(
        matches!(
            e,
            GgufError::TooLarge {
                what: "metadata array string",
                ..
            }
        ),
        "{e}"
    );
    // Reserving the claims would take hundreds of MiB per level.
    assert!(
        largest < 4 << 20,
        "largest allocation while parsing: {largest} bytes"
    );
}

/// Looks at everything a parsed file offers, so lazily checked data would
/// be caught too.
fn touch_everything(file: &GgufFile) -> u64 {
    let mut sum = 0u64;
    for info in file.tensors() {
        sum = sum.wrapping_add(
            file.tensor_bytes(info)
                .iter()
                .map(|&b| u64::from(b))
                .sum::<u64>(),
        );
        sum = sum
            .wrapping_add(info.element_count() ^ info.row_len() as u64 ^ info.row_count() as u64);
    }
    for (key, value) in file.metadata() {
        sum = sum.wrapping_add(key.len() as u64);
        if let MetaValue::Array(a) = value {
            sum = sum.wrapping_add(a.len() as u64);
        }
        let _ = file.get_u64(key);
        let _ = file.get_str(key);
    }
    sum
}

fn mutate(rng: &mut StdRng, image: &mut Vec<u8>) {
    const INTERESTING: [u64; 10] = [0, 1, 2, 3, 5, 31, 32, 1 << 31, u64::MAX, u64::MAX / 2];
    for _ in 0..rng.gen_range(1..=4) {
        let at = rng.gen_range(0..image.len());
        match rng.gen_range(0..5) {
            0 => image[at] ^= 1 << rng.gen_range(0..8),
            1 => image[at] = rng.gen(),
            2 if at + 8 <= image.len() => {
                let v = INTERESTING[rng.gen_range(0..INTERESTING.len())];
                image[at..at + 8].copy_from_slice(&v.to_le_bytes());
            }
            3 if at + 4 <= image.len() => {
                let v = rng.gen_range(0u32..40);
                image[at..at + 4].copy_from_slice(&v.to_le_bytes());
            }
            4 => image.truncate(at.max(1)),
            _ => image[at] = 0,
        }
    }
}

#[test]
fn random_damage_never_panics() {
    let mut seeds = vec![base()];
    let mut w = base_writer();
    w.alignment(8)
        .add_meta("deep", MetaValue::Array(nested(MAX_ARRAY_DEPTH)));
    seeds.push(w.to_bytes());
    let small_model = inferd::gguf::synthetic::SyntheticLlama {
        n_layers: 1,
        vocab: 260,
        weight_type: GgmlType::Q4_1,
        ..inferd::gguf::synthetic::SyntheticLlama::tiny()
    };
    seeds.push(small_model.build());

    let mut rng = StdRng::seed_from_u64(0x6767_7566);
    let mut accepted = 0;
    for round in 0..4000 {
        let mut image = seeds[round % seeds.len()].clone();
        mutate(&mut rng, &mut image);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            parse(image).map(|f| touch_everything(&f))
        }));
        match outcome {
            Err(_) => panic!("mutation round {round} made the reader panic"),
            Ok(Ok(_)) => accepted += 1,
            Ok(Err(e)) => assert!(!e.to_string().is_empty()),
        }
    }
    // Flips inside tensor data leave a valid file, so some must pass.
    assert!(accepted > 0);
}
