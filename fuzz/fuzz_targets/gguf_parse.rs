//! Fuzz target: any byte string given to the GGUF reader is either refused
//! with an error or yields a file whose every tensor and metadata value can
//! be read without a panic or an out-of-bounds access.

#![no_main]

use inferd::gguf::{GgufFile, MetaArray, MetaValue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let mut checksum = 0u64;
    for info in file.tensors() {
        let bytes = file.tensor_bytes(info);
        assert_eq!(bytes.len(), info.byte_len);
        checksum = bytes
            .iter()
            .fold(checksum, |h, &b| h.rotate_left(5) ^ u64::from(b));
        checksum ^= info.element_count() ^ info.row_len() as u64 ^ info.row_count() as u64;
        assert!(file.tensor(&info.name).is_some());
    }
    for (key, value) in file.metadata() {
        assert!(file.get(key).is_some());
        checksum ^= value_weight(value);
        let _ = (
            file.get_u64(key),
            file.get_f32(key),
            file.get_str(key),
            file.get_array(key),
        );
    }
    std::hint::black_box(checksum);
});

fn value_weight(value: &MetaValue) -> u64 {
    match value {
        MetaValue::String(s) => s.len() as u64,
        MetaValue::Array(a) => array_weight(a),
        other => other.as_u64().unwrap_or(1),
    }
}

fn array_weight(array: &MetaArray) -> u64 {
    match array {
        MetaArray::String(v) => v.iter().map(|s| s.len() as u64).sum(),
        MetaArray::Array(v) => v.iter().map(array_weight).sum(),
        other => other.len() as u64,
    }
}
