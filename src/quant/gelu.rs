//! GeGLU as ggml's CPU backend computes it: GELU (tanh form) is not
//! evaluated per element but read from a table indexed by the input
//! rounded to f16, built once from the f32 formula, with inputs beyond
//! ±10 short-cut. The table is what makes inferd's GELU bits equal
//! llama.cpp's; the formula alone would differ in the last places.

use std::sync::OnceLock;

use half::f16;

const GELU_COEF_A: f32 = 0.044715;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// GELU (tanh approximation) in f32, with the multiply-add GCC contracts.
fn gelu_f32(x: f32) -> f32 {
    let inner = (GELU_COEF_A * x).mul_add(x, 1.0);
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * inner).tanh())
}

/// `gelu(f16 value)` rounded to f16, for every f16 bit pattern.
fn table() -> &'static [f32] {
    static TABLE: OnceLock<Vec<f32>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_f32(f16::from_bits(bits).to_f32())).to_f32())
            .collect()
    })
}

/// `gate = gelu(gate) * up`, element-wise.
pub fn geglu_ggml(gate: &mut [f32], up: &[f32]) {
    let t = table();
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            t[f16::from_f32(x).to_bits() as usize] * u
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geglu_follows_the_f16_table_and_its_cut_offs() {
        let mut gate = [-20.0, -10.0, 0.0, 1.0, 2.5, 10.0, 12.0];
        geglu_ggml(&mut gate, &[2.0; 7]);
        assert_eq!(gate[0], 0.0);
        assert_eq!(gate[1], 0.0);
        assert_eq!(gate[2], 0.0);
        // gelu(1) = 0.841192 rounds to the f16 0.84131 (bits 0x3abb).
        assert_eq!(gate[3], f16::from_bits(0x3abb).to_f32() * 2.0);
        assert!((gate[4] / 2.0 - 2.4845).abs() < 2e-3, "{}", gate[4]);
        assert_eq!(gate[5], 20.0);
        assert_eq!(gate[6], 24.0);
    }
}
