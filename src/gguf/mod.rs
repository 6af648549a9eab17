//! GGUF model files: a reader that treats the file as hostile input.
//!
//! The file is memory-mapped once ([`GgufFile::open`]); the header, metadata
//! and tensor directory are parsed with every count, length and offset checked
//! against what the file really holds, and tensor data is handed out as
//! zero-copy slices of the map. Versions 2 and 3 (little-endian) are read.
//! Anything malformed is a [`GgufError`] naming what is wrong and the numbers
//! involved; nothing here panics or reads out of bounds on any input.

mod cursor;
mod error;
mod file;
mod value;

pub use error::GgufError;
pub use file::{GgufFile, TensorInfo, MAX_DIMS};
pub use value::{MetaArray, MetaValue, MetaValueType};
