//! NEON kernels (aarch64) for the Q4_0, Q4_1 and Q8_0 block formats; every
//! other format runs the scalar reference on aarch64. NEON is part of the
//! aarch64 baseline, so no run-time detection is needed. The byte dot
//! products use widening multiplies (no `dotprod` extension) into the 8
//! exact integer lanes of the scalar reference, and the float steps on them
//! are the reference's, so these kernels agree with it bit for bit.

#![allow(clippy::missing_safety_doc)] // each `# Safety` is stated once below

use std::arch::aarch64::*;

use super::blocks::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1};
use super::scalar;

// Safety of every `unsafe fn` in this file: each pointer must be valid for
// reading `nb` blocks of its format.

/// 16 packed nibbles as 32 bytes in element order (low nibbles first).
///
/// # Safety
/// `p` readable for 16 bytes.
#[inline]
unsafe fn unpack_nibbles(p: *const u8) -> [int8x16_t; 2] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let q = vld1q_u8(p);
        [
            vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F))),
            vreinterpretq_s8_u8(vshrq_n_u8(q, 4)),
        ]
    }
}

/// Integer sums of the 8 lanes of a 32-element block product, lane `j`
/// holding elements `4j..4j+4`: the lanes the scalar reference (and
/// llama.cpp's x86 kernels) accumulate in. Integer sums are exact, so only
/// the float steps that follow fix the result's bits.
///
/// # Safety
/// `a` readable for 32 bytes.
#[inline]
unsafe fn lane_sums(w: [int8x16_t; 2], a: *const u8) -> [i32; 8] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let a = a as *const i8;
        let mut out = [0i32; 8];
        for (half, wv) in w.into_iter().enumerate() {
            let av = vld1q_s8(a.add(16 * half));
            let lo = vpaddlq_s16(vmull_s8(vget_low_s8(wv), vget_low_s8(av)));
            let hi = vpaddlq_s16(vmull_s8(vget_high_s8(wv), vget_high_s8(av)));
            vst1q_s32(out.as_mut_ptr().add(4 * half), vpaddq_s32(lo, hi));
        }
        out
    }
}

/// Q4_1 × Q8_1 tile, in the scalar reference's float order.
///
/// # Safety
/// See the file header.
pub(crate) unsafe fn dot_q4_1_q8_1<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = std::slice::from_raw_parts(w as *const BlockQ4_1, nb);
        let mut out = [0.0f32; NT];
        for (t, o) in out.iter_mut().enumerate() {
            let a = std::slice::from_raw_parts(a[t] as *const BlockQ8_1, nb);
            let mut acc = [0.0f32; 8];
            let mut mins = 0.0f32;
            for (x, y) in w.iter().zip(a) {
                let xy = lane_sums(unpack_nibbles(x.qs.as_ptr()), y.qs.as_ptr());
                let dd = x.d() * y.d();
                for (acc, xy) in acc.iter_mut().zip(xy) {
                    *acc = dd.mul_add(xy as f32, *acc);
                }
                mins = x.m().mul_add(y.s(), mins);
            }
            *o = scalar::hsum8(&acc) + mins;
        }
        out
    }
}

/// Q4_0 × Q8_0 tile, in the scalar reference's float order.
///
/// # Safety
/// See the file header.
pub(crate) unsafe fn dot_q4_0_q8_0<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = std::slice::from_raw_parts(w as *const BlockQ4_0, nb);
        let eight = vdupq_n_s8(8);
        let mut out = [0.0f32; NT];
        for (t, o) in out.iter_mut().enumerate() {
            let a = std::slice::from_raw_parts(a[t] as *const BlockQ8_0, nb);
            let mut acc = [0.0f32; 8];
            for (x, y) in w.iter().zip(a) {
                let [lo, hi] = unpack_nibbles(x.qs.as_ptr());
                let wq = [vsubq_s8(lo, eight), vsubq_s8(hi, eight)];
                let xy = lane_sums(wq, y.qs.as_ptr());
                let dd = x.d() * y.d();
                for (acc, xy) in acc.iter_mut().zip(xy) {
                    *acc = dd.mul_add(xy as f32, *acc);
                }
            }
            *o = scalar::hsum8(&acc);
        }
        out
    }
}

/// Q8_0 × Q8_0 tile, in the scalar reference's float order.
///
/// # Safety
/// See the file header.
pub(crate) unsafe fn dot_q8_0_q8_0<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = std::slice::from_raw_parts(w as *const BlockQ8_0, nb);
        let mut out = [0.0f32; NT];
        for (t, o) in out.iter_mut().enumerate() {
            let a = std::slice::from_raw_parts(a[t] as *const BlockQ8_0, nb);
            let mut acc = [0.0f32; 8];
            for (x, y) in w.iter().zip(a) {
                let p = x.qs.as_ptr() as *const i8;
                let xy = lane_sums([vld1q_s8(p), vld1q_s8(p.add(16))], y.qs.as_ptr());
                let dd = x.d() * y.d();
                for (acc, xy) in acc.iter_mut().zip(xy) {
                    *acc = dd.mul_add(xy as f32, *acc);
                }
            }
            *o = scalar::hsum8(&acc);
        }
        out
    }
}
