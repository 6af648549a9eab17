//! Weight matrices on the device in their GGUF block formats: the file's
//! bytes copied once, split by whole rows where one binding cannot hold them.

use super::{GpuDevice, GpuError};
use crate::quant::GgmlType;

/// Rows `first_row..first_row + rows` of a matrix in a buffer of their own,
/// starting at byte 0.
#[derive(Debug)]
pub struct MatrixPart {
    pub(crate) buffer: wgpu::Buffer,
    pub first_row: usize,
    pub rows: usize,
}

/// A `rows` × `cols` matrix on the device.
#[derive(Debug)]
pub struct DeviceMatrix {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub parts: Vec<MatrixPart>,
}

impl DeviceMatrix {
    /// Copies `bytes` (`rows` rows of `ty`, `cols` wide, as in the file) to
    /// the device, in as many parts as the device's binding size requires.
    pub fn upload(
        device: &GpuDevice,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<Self, GpuError> {
        Self::upload_in_parts(device, name, ty, rows, cols, bytes, usize::MAX)
    }

    /// [`upload`](Self::upload) with at most `max_part_rows` rows per part,
    /// so tests can split a matrix on an adapter whose bindings are large.
    pub fn upload_in_parts(
        device: &GpuDevice,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        max_part_rows: usize,
    ) -> Result<Self, GpuError> {
        if !cols.is_multiple_of(32) {
            return Err(GpuError::BadMatrix {
                name: name.to_string(),
                why: format!("{cols} columns: the GPU kernels read rows 32 values at a time"),
            });
        }
        let row_bytes = ty.row_bytes(cols).ok_or_else(|| GpuError::BadMatrix {
            name: name.to_string(),
            why: format!("{cols} columns are not whole blocks of {ty}"),
        })?;
        if bytes.len() != rows * row_bytes {
            return Err(GpuError::BadMatrix {
                name: name.to_string(),
                why: format!("{} bytes for {rows} rows of {row_bytes} bytes", bytes.len()),
            });
        }
        // The padding word the buffer gets must fit inside the binding too.
        let rows_per_part = ((device.max_binding_bytes() as usize).saturating_sub(8) / row_bytes)
            .min(max_part_rows);
        if rows_per_part == 0 {
            return Err(GpuError::TooLarge {
                what: format!("one row of {name} ({row_bytes} bytes)"),
                limit: device.max_binding_bytes(),
            });
        }
        let mut parts = Vec::new();
        let mut first_row = 0;
        while first_row < rows {
            let n = rows_per_part.min(rows - first_row);
            let part = &bytes[first_row * row_bytes..(first_row + n) * row_bytes];
            parts.push(MatrixPart {
                buffer: device.storage_with(name, part),
                first_row,
                rows: n,
            });
            first_row += n;
        }
        Ok(Self {
            name: name.to_string(),
            ty,
            rows,
            cols,
            row_bytes,
            parts,
        })
    }

    /// Bytes the matrix occupies on the device.
    pub fn device_bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.buffer.size()).sum()
    }
}
