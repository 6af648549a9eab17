//! Errors from reading a GGUF file. Each variant names what was wrong and
//! carries the numbers, so a user can tell a truncated download from a file
//! of the wrong kind.

use thiserror::Error;

/// Why a GGUF file could not be read.
#[derive(Debug, Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot open {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    /// A format version this reader does not know (1 is obsolete; a
    /// byte-swapped number means a big-endian file).
    #[error(
        "unsupported GGUF version {version} (this reader handles versions 2 and 3, little-endian){hint}",
        hint = version_hint(*version)
    )]
    UnsupportedVersion { version: u32 },
    /// The file ends before a field that must be there.
    #[error("file truncated while reading {what}: needed {needed} bytes at offset {offset}, file is {file_len} bytes")]
    Truncated {
        what: &'static str,
        offset: u64,
        needed: u64,
        file_len: u64,
    },
    /// A count or length is larger than the file could possibly hold, or
    /// larger than a sane cap.
    #[error("{what} is {value}, more than the limit of {limit}")]
    TooLarge {
        what: &'static str,
        value: u64,
        limit: u64,
    },
    /// A metadata value type id outside the GGUF specification.
    #[error("metadata key '{key}' has unknown value type {type_id}")]
    UnknownValueType { key: String, type_id: u32 },
    /// Arrays nested deeper than the reader accepts.
    #[error("metadata key '{key}' nests arrays deeper than {limit} levels")]
    NestingTooDeep { key: String, limit: usize },
    /// A string that is not UTF-8.
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: &'static str, offset: u64 },
    /// The same metadata key appears twice.
    #[error("metadata key '{key}' appears more than once")]
    DuplicateKey { key: String },
    /// The same tensor name appears twice.
    #[error("tensor '{name}' appears more than once")]
    DuplicateTensor { name: String },
    /// `general.alignment` is zero, not a power of two, or absurd.
    #[error("general.alignment is {alignment}; it must be a power of two between 1 and 65536")]
    BadAlignment { alignment: u64 },
    /// A tensor's element type id is unknown.
    #[error("tensor '{name}' has unknown element type id {type_id}")]
    UnknownTensorType { name: String, type_id: u32 },
    /// A tensor's shape is invalid (too many dimensions, a zero or
    /// overflowing size, or a row that is not a whole number of blocks).
    #[error("tensor '{name}' has an invalid shape {dims:?}: {why}")]
    BadShape {
        name: String,
        dims: Vec<u64>,
        why: &'static str,
    },
    /// A tensor's data offset is not aligned.
    #[error("tensor '{name}' starts at data offset {offset}, which is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },
    /// A tensor's bytes reach past the end of the file.
    #[error("tensor '{name}' needs bytes {start}..{end} of the data section, which holds only {data_len} bytes")]
    TensorOutOfFile {
        name: String,
        start: u64,
        end: u64,
        data_len: u64,
    },
    /// Two tensors claim the same bytes.
    #[error("tensors '{first}' and '{second}' overlap in the data section")]
    OverlappingTensors { first: String, second: String },
    /// A metadata key that a caller asked for is absent.
    #[error("metadata key '{key}' is missing")]
    MissingKey { key: String },
    /// A metadata key holds a value of another type than the caller needs.
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        key: String,
        found: &'static str,
        expected: &'static str,
    },
    /// A tensor that a caller asked for is absent.
    #[error("tensor '{name}' is missing from the file")]
    MissingTensor { name: String },
}

/// Extra words for a version number that reads as 2 or 3 once its bytes are
/// swapped: the file was written big-endian.
fn version_hint(version: u32) -> &'static str {
    match version.swap_bytes() {
        2 | 3 => "; this looks like a big-endian file",
        _ => "",
    }
}
