//! Tensor element formats and the kernels that multiply them.

mod types;

pub use types::{GgmlType, QK_K};
