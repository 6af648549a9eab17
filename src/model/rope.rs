//! Rotating a token's heads by RoPE's `(cos, sin)` pairs: the one loop,
//! compiled a second time with FMA on x86-64 where the CPU has it.
//!
//! The rotation is `x0·cos − x1·sin` and `x0·sin + x1·cos` with one fused
//! multiply-add each (`f32::mul_add`), so its bits are the same whether the
//! fused step is an instruction or a library call; only the speed differs.
//! Without FMA in the compile target every `mul_add` is a call, and RoPE
//! took 1.4% of a 2-thread 1B prefill.

use super::arch::RopeLayout;

/// Rotates each `head_dim`-wide head of `row` by `cs` (`(cos, sin)` per
/// rotated pair, `rope_dims / 2` pairs) in `layout`'s pairing.
pub(super) fn rotate_heads(
    row: &mut [f32],
    cs: &[f32],
    head_dim: usize,
    rope_dims: usize,
    layout: RopeLayout,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has FMA (checked just above).
        unsafe { rotate_heads_fma(row, cs, head_dim, rope_dims, layout) };
        return;
    }
    rotate(row, cs, head_dim, rope_dims, layout);
}

/// [`rotate`] with fused multiply-adds as instructions.
///
/// # Safety
/// The CPU must support FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn rotate_heads_fma(
    row: &mut [f32],
    cs: &[f32],
    head_dim: usize,
    rope_dims: usize,
    layout: RopeLayout,
) {
    rotate(row, cs, head_dim, rope_dims, layout);
}

#[inline(always)]
fn rotate(row: &mut [f32], cs: &[f32], head_dim: usize, rope_dims: usize, layout: RopeLayout) {
    let half = rope_dims / 2;
    for head in row.chunks_exact_mut(head_dim) {
        match layout {
            RopeLayout::Normal => {
                for (pair, cs) in head[..rope_dims]
                    .chunks_exact_mut(2)
                    .zip(cs.chunks_exact(2))
                {
                    let (x0, x1, cos, sin) = (pair[0], pair[1], cs[0], cs[1]);
                    pair[0] = x0.mul_add(cos, -(x1 * sin));
                    pair[1] = x0.mul_add(sin, x1 * cos);
                }
            }
            RopeLayout::Neox => {
                let (lo, hi) = head[..rope_dims].split_at_mut(half);
                for ((x0, x1), cs) in lo.iter_mut().zip(hi.iter_mut()).zip(cs.chunks_exact(2)) {
                    let (a, b, cos, sin) = (*x0, *x1, cs[0], cs[1]);
                    *x0 = a.mul_add(cos, -(b * sin));
                    *x1 = a.mul_add(sin, b * cos);
                }
            }
        }
    }
}
