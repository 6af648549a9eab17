//! GeGLU as ggml's CPU backend computes it: GELU (tanh form) is not
//! evaluated per element but read from a table indexed by the input
//! rounded to f16, built once from the f32 formula, with inputs beyond
//! ±10 short-cut. The table is what makes inferd's GELU bits equal
//! llama.cpp's; the formula alone would differ in the last places. The
//! AVX-512 level rounds 16 inputs at once with `vcvtps2ph` and gathers
//! their table entries; the scalar form is the reference.

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

/// `gate = gelu(gate) * up`, element-wise: the reference, and the kernel
/// of the levels without a vector one.
pub(crate) fn geglu_scalar(gate: &mut [f32], up: &[f32]) {
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

/// [`geglu_scalar`] 16 elements at a time: the f16 rounding by `vcvtps2ph`
/// (round to nearest even, as the scalar conversion), the table read by a
/// gather, the cut-offs by masks. Same bits for every input but NaN, whose
/// payload may differ.
///
/// # Safety
/// The CPU must support AVX-512 F and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) unsafe fn geglu_avx512(gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let t = table();
    let n = gate.len().min(up.len());
    let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
    // SAFETY: the caller promises the features; every load and store is
    // masked to the `n` elements both slices hold, and every gathered
    // index is an f16 bit pattern, below the table's 65,536 entries.
    unsafe {
        for (i, mask) in super::avx512::chunks16(n) {
            let x = _mm512_maskz_loadu_ps(mask, g.add(i));
            let uv = _mm512_maskz_loadu_ps(mask, u.add(i));
            let half_bits = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
            let index = _mm512_cvtepu16_epi32(half_bits);
            let gelu = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, index, t.as_ptr());
            let high = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(10.0));
            let low = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(x, _mm512_set1_ps(-10.0));
            let product = _mm512_mul_ps(_mm512_mask_blend_ps(high, gelu, x), uv);
            let out = _mm512_mask_blend_ps(low, product, _mm512_setzero_ps());
            _mm512_mask_storeu_ps(g.add(i), mask, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geglu_follows_the_f16_table_and_its_cut_offs() {
        let mut gate = [-20.0, -10.0, 0.0, 1.0, 2.5, 10.0, 12.0];
        geglu_scalar(&mut gate, &[2.0; 7]);
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
