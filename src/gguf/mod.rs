//! GGUF model files: a reader that treats the file as hostile input.
//!
//! The file is memory-mapped once ([`GgufFile::open`]); the header, metadata
//! and tensor directory are parsed with every count, length and offset checked
//! against what the file really holds, and tensor data is handed out as
//! zero-copy slices of the map. Versions 2 and 3 (little-endian) are read.
//! Anything malformed is a [`GgufError`] naming what is wrong and the numbers
//! involved; nothing here panics or reads out of bounds on any input.
//!
//! [`GgufWriter`] builds images in memory (tests, fuzzing seeds), and
//! [`synthetic`] makes small random llama models in the layout llama.cpp
//! uses, for tests that need a whole model but not a real one.

mod cursor;
mod error;
mod file;
pub mod synthetic;
mod value;
mod writer;

pub use cursor::MAX_STRING_BYTES;
pub use error::GgufError;
pub use file::{GgufFile, TensorInfo, MAX_DIMS, MAX_METADATA_ENTRIES, MAX_TENSORS};
pub use value::{MetaArray, MetaValue, MetaValueType, MAX_ARRAY_DEPTH, MAX_ARRAY_LEN};
pub use writer::GgufWriter;
