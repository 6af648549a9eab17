//! Hidden-state payloads: rows of `hidden_size` values written as f32
//! (bit-exact), f16 or GGML Q8_0 blocks (lossy, for slow links), and the
//! CRC32C every frame carries over its payload.

use half::f16;

use crate::proto::inferd_shard_v1::shard_runtime as pb;
use crate::quant::{dequantize_row, quantize_row, GgmlType};

/// A payload encoding the protocol knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Encoding {
    F32,
    F16,
    Q8_0,
}

/// Why a payload cannot be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    #[error("encoding {0} is not one the protocol defines")]
    UnknownEncoding(i32),
    #[error("payload of {got} bytes, but {rows} rows of {hidden_size} values in {encoding:?} take {want}")]
    WrongLength {
        encoding: Encoding,
        rows: usize,
        hidden_size: usize,
        want: usize,
        got: usize,
    },
    #[error("Q8_0 needs a hidden size that is a multiple of 32, not {0}")]
    BlockMisfit(usize),
    #[error("{got} values are not whole rows of {hidden_size}")]
    Ragged { hidden_size: usize, got: usize },
}

impl Encoding {
    /// The wire enum value.
    pub fn to_wire(self) -> pb::Encoding {
        match self {
            Encoding::F32 => pb::Encoding::ENCODING_F32,
            Encoding::F16 => pb::Encoding::ENCODING_F16,
            Encoding::Q8_0 => pb::Encoding::ENCODING_Q8_0,
        }
    }

    /// From the wire enum; `UNSPECIFIED` and unknown values are refused.
    pub fn from_wire(value: pb::Encoding) -> Result<Self, PayloadError> {
        match value {
            pb::Encoding::ENCODING_F32 => Ok(Encoding::F32),
            pb::Encoding::ENCODING_F16 => Ok(Encoding::F16),
            pb::Encoding::ENCODING_Q8_0 => Ok(Encoding::Q8_0),
            pb::Encoding::ENCODING_UNSPECIFIED => Err(PayloadError::UnknownEncoding(0)),
        }
    }

    /// Bytes of one row of `hidden_size` values.
    pub fn row_bytes(self, hidden_size: usize) -> Result<usize, PayloadError> {
        match self {
            Encoding::F32 => Ok(hidden_size * 4),
            Encoding::F16 => Ok(hidden_size * 2),
            Encoding::Q8_0 => {
                if !hidden_size.is_multiple_of(32) {
                    return Err(PayloadError::BlockMisfit(hidden_size));
                }
                GgmlType::Q8_0
                    .row_bytes(hidden_size)
                    .ok_or(PayloadError::BlockMisfit(hidden_size))
            }
        }
    }
}

/// CRC32C (Castagnoli) of a payload.
pub fn checksum(payload: &[u8]) -> u32 {
    crc32c::crc32c(payload)
}

/// Writes `values` (whole rows of `hidden_size`) in `encoding`.
pub fn encode_rows(
    encoding: Encoding,
    hidden_size: usize,
    values: &[f32],
) -> Result<Vec<u8>, PayloadError> {
    if hidden_size == 0 || !values.len().is_multiple_of(hidden_size) {
        return Err(PayloadError::Ragged {
            hidden_size,
            got: values.len(),
        });
    }
    let rows = values.len() / hidden_size;
    let row_bytes = encoding.row_bytes(hidden_size)?;
    let mut out = vec![0u8; rows * row_bytes];
    match encoding {
        Encoding::F32 => {
            for (chunk, v) in out.chunks_exact_mut(4).zip(values) {
                chunk.copy_from_slice(&v.to_le_bytes());
            }
        }
        Encoding::F16 => {
            for (chunk, v) in out.chunks_exact_mut(2).zip(values) {
                chunk.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        Encoding::Q8_0 => {
            for (row, dst) in values
                .chunks_exact(hidden_size)
                .zip(out.chunks_exact_mut(row_bytes))
            {
                quantize_row(GgmlType::Q8_0, row, dst)
                    .map_err(|_| PayloadError::BlockMisfit(hidden_size))?;
            }
        }
    }
    Ok(out)
}

/// Reads `rows` rows of `hidden_size` values written in `encoding`; the
/// length must be exact.
pub fn decode_rows(
    encoding: Encoding,
    hidden_size: usize,
    rows: usize,
    payload: &[u8],
) -> Result<Vec<f32>, PayloadError> {
    let row_bytes = encoding.row_bytes(hidden_size)?;
    let want = rows.checked_mul(row_bytes).ok_or(PayloadError::Ragged {
        hidden_size,
        got: payload.len(),
    })?;
    if payload.len() != want {
        return Err(PayloadError::WrongLength {
            encoding,
            rows,
            hidden_size,
            want,
            got: payload.len(),
        });
    }
    let mut out = vec![0f32; rows * hidden_size];
    match encoding {
        Encoding::F32 => {
            for (v, chunk) in out.iter_mut().zip(payload.chunks_exact(4)) {
                *v = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            }
        }
        Encoding::F16 => {
            for (v, chunk) in out.iter_mut().zip(payload.chunks_exact(2)) {
                *v = f16::from_le_bytes([chunk[0], chunk[1]]).to_f32();
            }
        }
        Encoding::Q8_0 => {
            for (src, dst) in payload
                .chunks_exact(row_bytes)
                .zip(out.chunks_exact_mut(hidden_size))
            {
                dequantize_row(GgmlType::Q8_0, src, dst)
                    .map_err(|_| PayloadError::BlockMisfit(hidden_size))?;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> Vec<f32> {
        (0..128)
            .map(|i| ((i * 37) % 101) as f32 / 7.0 - 6.0)
            .collect()
    }

    #[test]
    fn f32_round_trips_bit_for_bit() {
        let values = rows();
        let bytes = encode_rows(Encoding::F32, 64, &values).unwrap();
        assert_eq!(bytes.len(), 512);
        let back = decode_rows(Encoding::F32, 64, 2, &bytes).unwrap();
        assert!(values
            .iter()
            .zip(&back)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn f16_and_q8_0_are_close_and_smaller() {
        let values = rows();
        for (encoding, bytes, tolerance) in
            [(Encoding::F16, 256, 0.01f32), (Encoding::Q8_0, 136, 0.05)]
        {
            let payload = encode_rows(encoding, 64, &values).unwrap();
            assert_eq!(payload.len(), bytes, "{encoding:?}");
            let back = decode_rows(encoding, 64, 2, &payload).unwrap();
            let worst = values
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < tolerance, "{encoding:?}: {worst}");
        }
    }

    #[test]
    fn a_wrong_length_or_shape_is_refused() {
        let payload = encode_rows(Encoding::F32, 64, &rows()).unwrap();
        assert!(matches!(
            decode_rows(Encoding::F32, 64, 3, &payload),
            Err(PayloadError::WrongLength {
                want: 768,
                got: 512,
                ..
            })
        ));
        assert!(matches!(
            encode_rows(Encoding::F32, 60, &rows()),
            Err(PayloadError::Ragged { .. })
        ));
        assert_eq!(
            encode_rows(Encoding::Q8_0, 48, &rows()[..96]),
            Err(PayloadError::BlockMisfit(48))
        );
        assert!(matches!(
            decode_rows(Encoding::F32, 64, usize::MAX, &payload),
            Err(PayloadError::Ragged { .. })
        ));
    }

    #[test]
    fn the_checksum_is_crc32c() {
        // The check value of CRC-32C for "123456789".
        assert_eq!(checksum(b"123456789"), 0xE306_9283);
    }
}
