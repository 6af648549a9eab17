//! Inputs for the quant kernel benchmarks: deterministic random weight
//! rows with small finite scales, and quantized activation rows.

use inferd::quant::{activation_type, quantize_row, GgmlType};

/// A deterministic pseudo-random byte stream (xorshift), enough for kernel timing.
fn bytes(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

/// Weight rows with random quants and small, finite f16 scales.
pub fn weights(ty: GgmlType, rows: usize, n: usize) -> Vec<u8> {
    let mut w = bytes(rows * ty.row_bytes(n).expect("whole blocks"), 42);
    let scale = half::f16::from_f32(0.01).to_le_bytes();
    let bb = ty.block_bytes();
    for b in w.chunks_exact_mut(bb) {
        let at: &[usize] = match ty {
            GgmlType::Q6_K => &[208],
            GgmlType::Q3_K => &[108],
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
            _ => &[0],
        };
        for &o in at {
            b[o..o + 2].copy_from_slice(&scale);
        }
    }
    w
}

pub fn activations(ty: GgmlType, n: usize, tokens: usize) -> Vec<u8> {
    let act = activation_type(ty).expect("supported weight type");
    let row = act.row_bytes(n).expect("whole blocks");
    let mut out = vec![0u8; row * tokens];
    for (t, chunk) in out.chunks_exact_mut(row).enumerate() {
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 31 + t * 7) % 97) as f32 / 48.0 - 1.0)
            .collect();
        quantize_row(act, &x, chunk).expect("quantize");
    }
    out
}
