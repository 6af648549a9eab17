//! AVX-512 (F, BW, DQ, VL, VNNI) kernels for the 32-element block formats, the
//! ones decode time is spent in, and for IQ4_XS. They use `vpdpbusd` for the
//! byte dot products and keep one block per 256-bit float step, so their 8
//! float lanes stay in the order of the scalar reference (and of llama.cpp's
//! kernels). Like the AVX2 kernels they are generic over the token count `NT`
//! and give every token the operation sequence of the single-token kernel.

#![allow(clippy::missing_safety_doc)] // each `# Safety` is stated once below

use std::arch::x86_64::*;
use std::ptr::addr_of;

use half::f16;

use super::avx2;
use super::blocks::{
    BlockIQ4NL, BlockIQ4XS, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1,
    BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1,
};

// Safety of every `unsafe fn` in this file: the CPU must support AVX-512 F,
// BW, DQ, VL and VNNI plus AVX2, FMA and F16C, and each pointer must be valid for
// reading `nb` blocks of its format.

/// Horizontal sum of 16 lanes in a fixed, explicit order (the library
/// reduction is free to reassociate, which would break bit-identity between
/// tile sizes).
///
/// # Safety
/// See the file header.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn hsum512(v: __m512) -> f32 {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let half = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
        super::avx2::hsum_ps(half)
    }
}

/// Q4_1 × Q8_1 tile: one block per 256-bit step, in the lane order of
/// the scalar reference (and of llama.cpp's kernel).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_1_q8_1<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockQ4_1;
        let a = a.map(|p| p as *const BlockQ8_1);
        let mut acc = [_mm256_setzero_ps(); NT];
        // Lane 1 accumulates m * s with fused multiply-adds.
        let mut acc_min = [_mm_setzero_ps(); NT];
        for b in 0..nb {
            let wb = w.add(b);
            let wq = avx2::unpack_nibbles(addr_of!((*wb).qs) as *const u8);
            let wdm = avx2::f16_pair(wb as *const u8);
            for t in 0..NT {
                let ab = a[t].add(b);
                let aq = _mm256_loadu_si256(addr_of!((*ab).qs) as *const __m256i);
                let adm = avx2::f16_pair(ab as *const u8);
                let prod = _mm_mul_ps(wdm, adm);
                let sumi = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, aq);
                acc[t] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(prod),
                    _mm256_cvtepi32_ps(sumi),
                    acc[t],
                );
                acc_min[t] = _mm_fmadd_ps(wdm, adm, acc_min[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = avx2::hsum_ps(acc[t]) + _mm_cvtss_f32(_mm_movehdup_ps(acc_min[t]));
        }
        out
    }
}

/// Two blocks' 16 packed nibbles each, as 64 bytes:
/// `[lo(b0), hi(b0), lo(b1), hi(b1)]`, which is element order.
///
/// # Safety
/// See the file header; both pointers readable for 16 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn unpack_nibbles_x2(p0: *const u8, p1: *const u8) -> __m512i {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let q0 = _mm_loadu_si128(p0 as *const __m128i);
        let q1 = _mm_loadu_si128(p1 as *const __m128i);
        let v = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(q0), 0xFF00, q1);
        // Immediate shift plus a blend: variable 16-bit shifts are slow on some
        // AVX-512 cores.
        let shifted = _mm512_srli_epi16(v, 4);
        let nibbles = _mm512_mask_blend_epi64(0b1100_1100, v, shifted);
        _mm512_and_si512(nibbles, _mm512_set1_epi8(0x0F))
    }
}

/// Two 32-byte quant arrays as one 64-byte vector.
///
/// # Safety
/// See the file header; both pointers readable for 32 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn load_x2(p0: *const u8, p1: *const u8) -> __m512i {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(p0 as *const __m256i)),
            _mm256_loadu_si256(p1 as *const __m256i),
            1,
        )
    }
}

/// The f16 scales that open two blocks, as f32 lanes 0 and 1.
///
/// # Safety
/// See the file header; both pointers readable for 4 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn f16_two(p0: *const u8, p1: *const u8) -> __m128i {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        // Each 4-byte load holds the scale and the block's first two quant
        // bytes; the interleave keeps the two scales.
        _mm_unpacklo_epi16(
            _mm_cvtsi32_si128(std::ptr::read_unaligned(p0 as *const i32)),
            _mm_cvtsi32_si128(std::ptr::read_unaligned(p1 as *const i32)),
        )
    }
}

/// Q4_0 × Q8_0 tile, in the lane order of the scalar reference (and of
/// llama.cpp's kernel). The byte products of two blocks go through one
/// 512-bit `vpdpbusd`; their float steps stay one block per 256-bit fused
/// multiply-add, in block order. An odd last block takes the one-block
/// step, which gives the same bits.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_0_q8_0<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockQ4_0;
        let a = a.map(|p| p as *const BlockQ8_0);
        let eights = _mm512_set1_epi8(8);
        let second = _mm256_set1_epi32(1);
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut b = 0;
        while b + 2 <= nb {
            let (w0, w1) = (&*w.add(b), &*w.add(b + 1));
            let wq = unpack_nibbles_x2(w0.qs.as_ptr(), w1.qs.as_ptr());
            let wd = _mm_cvtph_ps(f16_two(
                w0 as *const _ as *const u8,
                w1 as *const _ as *const u8,
            ));
            for t in 0..NT {
                let (a0, a1) = (&*a[t].add(b), &*a[t].add(b + 1));
                let aq = load_x2(a0.qs.as_ptr(), a1.qs.as_ptr());
                // sum((q - 8) * a) = sum(q * a) - sum(8 * a), both exact.
                let raw = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, aq);
                let off = _mm512_dpbusd_epi32(_mm512_setzero_si512(), eights, aq);
                let sumi = _mm512_sub_epi32(raw, off);
                let xy = _mm512_cvtepi32_ps(sumi);
                let ad = _mm_cvtph_ps(f16_two(
                    a0 as *const _ as *const u8,
                    a1 as *const _ as *const u8,
                ));
                // Block b's lanes, then block b + 1's, each with its scale.
                let scale = _mm256_castps128_ps256(_mm_mul_ps(wd, ad));
                acc[t] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(_mm256_castps256_ps128(scale)),
                    _mm512_castps512_ps256(xy),
                    acc[t],
                );
                acc[t] = _mm256_fmadd_ps(
                    _mm256_permutevar8x32_ps(scale, second),
                    _mm512_extractf32x8_ps::<1>(xy),
                    acc[t],
                );
            }
            b += 2;
        }
        if b < nb {
            let wb = &*w.add(b);
            let wq = _mm256_sub_epi8(avx2::unpack_nibbles(wb.qs.as_ptr()), _mm256_set1_epi8(8));
            let wabs = _mm256_abs_epi8(wq);
            let wd = avx2::f16_one(wb.d);
            for t in 0..NT {
                acc[t] = signed_block_step(acc[t], wq, wabs, wd, a[t].add(b));
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = avx2::hsum_ps(acc[t]);
        }
        out
    }
}

/// Q8_0 × Q8_0 tile: one block per 256-bit step, in the lane order of
/// the scalar reference.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0_q8_0<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockQ8_0;
        let a = a.map(|p| p as *const BlockQ8_0);
        let second = _mm256_set1_epi32(1);
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut b = 0;
        // Two blocks per 512-bit step: the integer lanes are each block's own
        // (exact), and each block keeps its own float step, as in Q4_0.
        while b + 2 <= nb {
            let (w0, w1) = (&*w.add(b), &*w.add(b + 1));
            let wq = load_x2(w0.qs.as_ptr(), w1.qs.as_ptr());
            // i8 x i8 through u8 x i8: |w| times a, negated where w is negative
            // (`vpsignb` has no 512-bit form; where w is 0 the product is 0).
            let wabs = _mm512_abs_epi8(wq);
            let negative = _mm512_movepi8_mask(wq);
            let wd = _mm_cvtph_ps(f16_two(
                w0 as *const _ as *const u8,
                w1 as *const _ as *const u8,
            ));
            for t in 0..NT {
                let (a0, a1) = (&*a[t].add(b), &*a[t].add(b + 1));
                let aq = load_x2(a0.qs.as_ptr(), a1.qs.as_ptr());
                let signed = _mm512_mask_sub_epi8(aq, negative, _mm512_setzero_si512(), aq);
                let xy =
                    _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wabs, signed));
                let ad = _mm_cvtph_ps(f16_two(
                    a0 as *const _ as *const u8,
                    a1 as *const _ as *const u8,
                ));
                let scale = _mm256_castps128_ps256(_mm_mul_ps(wd, ad));
                acc[t] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(_mm256_castps256_ps128(scale)),
                    _mm512_castps512_ps256(xy),
                    acc[t],
                );
                acc[t] = _mm256_fmadd_ps(
                    _mm256_permutevar8x32_ps(scale, second),
                    _mm512_extractf32x8_ps::<1>(xy),
                    acc[t],
                );
            }
            b += 2;
        }
        if b < nb {
            let wb = w.add(b);
            let wq = _mm256_loadu_si256(addr_of!((*wb).qs) as *const __m256i);
            let wabs = _mm256_sign_epi8(wq, wq);
            let wd = avx2::f16_one((*wb).d);
            for t in 0..NT {
                let ab = a[t].add(b);
                let aq = _mm256_loadu_si256(addr_of!((*ab).qs) as *const __m256i);
                let sumi =
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(aq, wq));
                let scale = _mm_mul_ps(wd, avx2::f16_one((*ab).d));
                acc[t] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(scale),
                    _mm256_cvtepi32_ps(sumi),
                    acc[t],
                );
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = avx2::hsum_ps(acc[t]);
        }
        out
    }
}

/// One block step of the signed 8-lane kernels (Q5_0, IQ4_NL): as
/// `avx2::signed_block_step`, with `vpdpbusd` for the byte products.
///
/// # Safety
/// See the file header; `ab` readable for one block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn signed_block_step(
    acc: __m256,
    wq: __m256i,
    wabs: __m256i,
    wd: __m128,
    ab: *const BlockQ8_0,
) -> __m256 {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let aq = _mm256_loadu_si256(addr_of!((*ab).qs) as *const __m256i);
        let sumi = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(aq, wq));
        let scale = _mm_mul_ps(wd, avx2::f16_one((*ab).d));
        _mm256_fmadd_ps(_mm256_broadcastss_ps(scale), _mm256_cvtepi32_ps(sumi), acc)
    }
}

/// Q5_0 × Q8_0 tile: one block per 256-bit step, in the lane order of the
/// scalar reference.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q5_0_q8_0<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockQ5_0;
        let a = a.map(|p| p as *const BlockQ8_0);
        let mut acc = [_mm256_setzero_ps(); NT];
        for b in 0..nb {
            let wb = &*w.add(b);
            let wq = _mm256_sub_epi8(avx2::q5_quants(wb.qs.as_ptr(), wb.qh), _mm256_set1_epi8(16));
            let wabs = _mm256_abs_epi8(wq);
            let wd = avx2::f16_one(wb.d);
            for t in 0..NT {
                acc[t] = signed_block_step(acc[t], wq, wabs, wd, a[t].add(b));
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = avx2::hsum_ps(acc[t]);
        }
        out
    }
}

/// Q5_1 × Q8_1 tile: one block per 256-bit step, in the order of the
/// scalar reference (as Q4_1).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q5_1_q8_1<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockQ5_1;
        let a = a.map(|p| p as *const BlockQ8_1);
        let mut acc = [_mm256_setzero_ps(); NT];
        // Lane 1 accumulates m * s with fused multiply-adds.
        let mut acc_min = [_mm_setzero_ps(); NT];
        for b in 0..nb {
            let wb = w.add(b);
            let wq = avx2::q5_quants(addr_of!((*wb).qs) as *const u8, (*wb).qh);
            let wdm = avx2::f16_pair(wb as *const u8);
            for t in 0..NT {
                let ab = a[t].add(b);
                let aq = _mm256_loadu_si256(addr_of!((*ab).qs) as *const __m256i);
                let adm = avx2::f16_pair(ab as *const u8);
                let prod = _mm_mul_ps(wdm, adm);
                let sumi = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, aq);
                acc[t] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(prod),
                    _mm256_cvtepi32_ps(sumi),
                    acc[t],
                );
                acc_min[t] = _mm_fmadd_ps(wdm, adm, acc_min[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = avx2::hsum_ps(acc[t]) + _mm_cvtss_f32(_mm_movehdup_ps(acc_min[t]));
        }
        out
    }
}

/// IQ4_NL × Q8_0 tile: one block per 256-bit step, in the lane order of
/// the scalar reference.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq4_nl_q8_0<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockIQ4NL;
        let a = a.map(|p| p as *const BlockQ8_0);
        let mut acc = [_mm256_setzero_ps(); NT];
        for b in 0..nb {
            let wb = &*w.add(b);
            let wq = avx2::iq4_values(wb.qs.as_ptr());
            let wabs = _mm256_abs_epi8(wq);
            let wd = avx2::f16_one(wb.d);
            for t in 0..NT {
                acc[t] = signed_block_step(acc[t], wq, wabs, wd, a[t].add(b));
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = avx2::hsum_ps(acc[t]);
        }
        out
    }
}

/// IQ4_XS × Q8_K tile: `vpdpbusd` gives each sub-block's 8 lanes of
/// 4-element sums, which are scaled and added exactly; the float step per
/// super-block is the scalar reference's.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq4_xs_q8_k<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockIQ4XS;
        let a = a.map(|p| p as *const BlockQ8K);
        let mut acc = [_mm256_setzero_ps(); NT];
        for b in 0..nb {
            let x = &*w.add(b);
            let mut v = [_mm256_setzero_si256(); 8];
            let mut vabs = [_mm256_setzero_si256(); 8];
            let mut sc = [_mm256_setzero_si256(); 8];
            for j in 0..8 {
                v[j] = avx2::iq4_values(x.qs.as_ptr().add(16 * j));
                vabs[j] = _mm256_abs_epi8(v[j]);
                sc[j] = _mm256_set1_epi32(x.scale(j));
            }
            let xd = x.d();
            for t in 0..NT {
                let y = &*a[t].add(b);
                let mut sumi = _mm256_setzero_si256();
                for j in 0..8 {
                    let yq = _mm256_loadu_si256(y.qs.as_ptr().add(32 * j) as *const __m256i);
                    let dot = _mm256_dpbusd_epi32(
                        _mm256_setzero_si256(),
                        vabs[j],
                        _mm256_sign_epi8(yq, v[j]),
                    );
                    sumi = _mm256_add_epi32(sumi, _mm256_mullo_epi32(dot, sc[j]));
                }
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(xd * y.d()), _mm256_cvtepi32_ps(sumi), acc[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = avx2::hsum_ps(acc[t]);
        }
        out
    }
}

/// Two 256-bit halves as one 512-bit vector, `lo` in the low half.
///
/// # Safety
/// See the file header.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// `acc + Σ a·b` over each 32-bit lane's two 16-bit pairs, as one
/// `vpdpwssd`: LLVM's generic tuning splits the intrinsic into `vpmaddwd`
/// and `vpaddd`, one more micro-op on the two vector ports Intel cores
/// run 512-bit integer multiplies on, which the K-quant kernels keep
/// busy there (one instruction: 6-9% faster prefill products on an Ice
/// Lake Xeon).
///
/// # Safety
/// The CPU must support AVX-512 VNNI.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
pub(crate) unsafe fn dpwssd(mut acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    // SAFETY: register operands only; the caller promises the feature.
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack),
        );
    }
    acc
}

/// The 8 integer lanes of a K-quant super-block's 8 runs of 32 unsigned
/// quants (`q[c]`: runs `2c` and `2c + 1`) against the activation bytes
/// `yq`: llama.cpp's `maddubs` + `madd` lanes (lane `m` of run `r` is the
/// sum of quants `4m..4m + 4` times their activations, times the run's
/// scale for those quants), summed over the runs.
///
/// `vpdpbusd` forms each run's 8 four-quant sums at once (at most
/// 4 * 63 * 128 in magnitude, so each fits 16 bits); the sums of runs `r`
/// and `r + 2` share a 32-bit lane as its low and high word, and one
/// `vpdpwssd` multiplies both by their scales and adds them. `scale[h]`
/// holds those word pairs for runs `4h..4h + 4` (see [`k_pair_picks`]).
/// Integer sums are exact, so the lanes equal the 256-bit form's run by run.
///
/// # Safety
/// See the file header; `yq` readable for 256 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn k_run_lanes(q: &[__m512i; 4], scale: &[__m512i; 2], yq: *const i8) -> __m256i {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let mut runs = _mm512_setzero_si512();
        for h in 0..2 {
            let y0 = _mm512_loadu_si512(yq.add(128 * h) as *const __m512i);
            let y1 = _mm512_loadu_si512(yq.add(128 * h + 64) as *const __m512i);
            let low = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[2 * h], y0);
            let high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[2 * h + 1], y1);
            let both = _mm512_mask_blend_epi16(0xAAAA_AAAA, low, _mm512_slli_epi32(high, 16));
            runs = dpwssd(runs, both, scale[h]);
        }
        _mm256_add_epi32(
            _mm512_castsi512_si256(runs),
            _mm512_extracti64x4_epi64::<1>(runs),
        )
    }
}

/// The word indices [`k_run_lanes`]'s scales are gathered by, from a
/// super-block's scales as i16 words with `per_run` (1 or 2) scales per run
/// of 32 quants: lane `l` (0..16) of pick `h` holds the scale of run
/// `r = 4h + l / 8` for its four-quant sum `m = l % 8` as its low word and
/// that of run `r + 2` as its high word.
const fn k_pair_picks(per_run: usize) -> [[i16; 32]; 2] {
    let mut picks = [[0i16; 32]; 2];
    let mut h = 0;
    while h < 2 {
        let mut l = 0;
        while l < 16 {
            let (r, m) = (4 * h + l / 8, l % 8);
            let within = m * (per_run - 1) / 4;
            picks[h][2 * l] = (per_run * r + within) as i16;
            picks[h][2 * l + 1] = (per_run * (r + 2) + within) as i16;
            l += 1;
        }
        h += 1;
    }
    picks
}

/// [`k_pair_picks`] as vectors.
///
/// # Safety
/// See the file header.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn load_picks(picks: &'static [[i16; 32]; 2]) -> [__m512i; 2] {
    // SAFETY: 64 bytes each, unaligned loads.
    picks
        .each_ref()
        .map(|w| unsafe { _mm512_loadu_si512(w.as_ptr() as *const __m512i) })
}

/// A Q4_K or Q5_K super-block's 8 six-bit scales (bytes 0..8) and 8
/// six-bit minimums (bytes 8..16) from its 12 packed bytes at `scales`,
/// unpacked as [`super::blocks::scales_mins_k4`] does but in one vector:
/// sub-blocks 0..4 keep the low 6 bits of the packed words 0 (scales) and
/// 1 (minimums); sub-blocks 4..8 take word 2's low or high nibbles, with
/// the top two bits of words 0 or 1 above them.
///
/// # Safety
/// See the file header; 16 bytes readable at `scales` (in both formats the
/// block goes on after the 12).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn scales_mins_k4_x(scales: *const u8) -> __m128i {
    // SAFETY: the caller promises 16 readable bytes.
    let words = unsafe { _mm_loadu_si128(scales as *const __m128i) };
    // Words [0, 2, 1, 2]: the low bits of each output, word 2 shifted by 4
    // for the minimums' nibbles; [0, 0, 1, 1]: the top two bits, at bits 4, 5.
    let low = _mm_srlv_epi32(
        _mm_shuffle_epi32::<0b10_01_10_00>(words),
        _mm_set_epi32(4, 0, 0, 0),
    );
    let top = _mm_srli_epi32::<2>(_mm_shuffle_epi32::<0b01_01_00_00>(words));
    let from_low = _mm_set_epi32(0x0f0f_0f0f, 0x3f3f_3f3f, 0x0f0f_0f0f, 0x3f3f_3f3f);
    // Bits of `low` where `from_low` is set, of `top` elsewhere.
    let joined = _mm_ternarylogic_epi32::<0xCA>(from_low, low, top);
    _mm_and_si128(joined, _mm_set1_epi8(0x3f))
}

/// A K-quant super-block's two f16 scales lying side by side at `p`, as
/// the low two f32 lanes.
///
/// # Safety
/// See the file header; `p` readable for 4 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn f16_pair(p: *const u8) -> __m128 {
    // SAFETY: the caller promises 4 readable bytes.
    let bits = unsafe { (p as *const i32).read_unaligned() };
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
}

/// A Q6_K super-block's 8 runs of 32 quants without the -32 offset (0..64),
/// two runs per vector as [`k_run_lanes`] takes them: `out[2h]` holds runs
/// `4h` and `4h + 1`, `out[2h + 1]` runs `4h + 2` and `4h + 3`. Run `4h + k`
/// takes its low nibbles from `ql[64h..64h + 64]` (the low or high nibble
/// of its half) and its top two bits from `qh[32h..32h + 32]` at bit `2k`;
/// both halves of a vector share the `qh` bytes, so one variable shift per
/// word moves each half's two bits to bits 4 and 5.
///
/// # Safety
/// See the file header.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn q6k_runs_x(x: &BlockQ6K) -> [__m512i; 4] {
    // SAFETY: `ql` holds 128 bytes and `qh` 64, read in range below.
    unsafe {
        let nibble = _mm512_set1_epi8(0x0F);
        let top = _mm512_set1_epi8(0x30);
        // Per 16-bit word, low half then high half: runs 4h, 4h + 1 take qh
        // bits 0-1 and 2-3 (shifted left by 4 and 2), runs 4h + 2, 4h + 3 bits
        // 4-5 and 6-7 (right by 0 and 2). Bits a shift carries across the
        // word's two bytes land outside 0x30.
        let left = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
        let right = _mm512_inserti64x4::<1>(_mm512_set1_epi16(0), _mm256_set1_epi16(2));
        let mut out = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let low = _mm512_loadu_si512(x.ql.as_ptr().add(64 * h) as *const __m512i);
            let high = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                x.qh.as_ptr().add(32 * h) as *const __m256i
            ));
            let top_even = _mm512_and_si512(_mm512_sllv_epi16(high, left), top);
            let top_odd = _mm512_and_si512(_mm512_srlv_epi16(high, right), top);
            // 0xCA: bits of the second operand where the first is set, of the
            // third elsewhere.
            out[2 * h] = _mm512_ternarylogic_epi32::<0xCA>(nibble, low, top_even);
            out[2 * h + 1] =
                _mm512_ternarylogic_epi32::<0xCA>(nibble, _mm512_srli_epi16::<4>(low), top_odd);
        }
        out
    }
}

/// Q4_K × Q8_K tile: [`k_run_lanes`] forms the 8 integer lanes of
/// [`avx2::dot_q4_k_q8_k`] (integer sums are exact, whatever the order),
/// and the float steps that follow are that kernel's own: the same bits,
/// with fewer instructions per token. The scales and minimums are unpacked
/// in one vector and the two f16 scales converted together, as one-token
/// decode pays that per row and super-block.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_k_q8_k<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockQ4K;
        let a = a.map(|p| p as *const BlockQ8K);
        let mask = _mm512_set1_epi8(0x0F);
        // One scale per run of 32 quants.
        let pick = load_picks(&const { k_pair_picks(1) });
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut acc_min = [_mm_setzero_ps(); NT];
        for b in 0..nb {
            let x = &*w.add(b);
            let scales_mins = scales_mins_k4_x(x.scales.as_ptr());
            let mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(scales_mins, scales_mins));
            let scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(scales_mins));
            let q = [0, 1, 2, 3].map(|c| {
                let bits = _mm256_loadu_si256(x.qs.as_ptr().add(32 * c) as *const __m256i);
                _mm512_and_si512(join(bits, _mm256_srli_epi16(bits, 4)), mask)
            });
            let scale = pick.map(|p| _mm512_permutexvar_epi16(p, scales));
            // [d, -dmin]: `-(y.d * dmin)` and `y.d * -dmin` are the same bits.
            let d_dmin = _mm_xor_ps(f16_pair(x.d.as_ptr()), _mm_set_ps(0.0, 0.0, -0.0, 0.0));
            for t in 0..NT {
                let y = &*a[t].add(b);
                let scaled = _mm_mul_ps(_mm_set1_ps(y.d()), d_dmin);
                let m = _mm_cvtepi32_ps(avx2::k4_min_lanes(mins, y));
                acc_min[t] = _mm_fmadd_ps(_mm_permute_ps::<0b01_01_01_01>(scaled), m, acc_min[t]);
                let sumi = k_run_lanes(&q, &scale, y.qs.as_ptr() as *const i8);
                acc[t] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(scaled),
                    _mm256_cvtepi32_ps(sumi),
                    acc[t],
                );
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = avx2::hsum_ps(acc[t]) + avx2::hsum4_ps(acc_min[t]);
        }
        out
    }
}

/// Q5_K × Q8_K tile: [`avx2::dot_q5_k_q8_k`]'s lanes and float steps
/// (its minimum term summed in integers and added as one scalar per
/// super-block), the runs two at a time through [`k_run_lanes`]. A run's
/// fifth bits are bit `r` of the 32 `qh` bytes; both halves of a vector
/// read the same `qh` bytes, so one variable shift per 16-bit word brings
/// each half's bit to bit 4 (from `qh` shifted left by 4 for bits 0-3).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q5_k_q8_k<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockQ5K;
        let a = a.map(|p| p as *const BlockQ8K);
        let mask = _mm512_set1_epi8(0x0F);
        let fifth = _mm512_set1_epi8(0x10);
        // Right shifts of runs 2c (low half) and 2c + 1 (high half): bits
        // 0..4 from `qh << 4`, bits 4..8 from `qh`. Bits a shift carries
        // across a word's two bytes land away from bit 4.
        let counts = [0i16, 2]
            .map(|k| _mm512_inserti64x4::<1>(_mm512_set1_epi16(k), _mm256_set1_epi16(k + 1)));
        let pick = load_picks(&const { k_pair_picks(1) });
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut acc_min = [0.0f32; NT];
        for b in 0..nb {
            let x = &*w.add(b);
            let scales_mins = scales_mins_k4_x(x.scales.as_ptr());
            let mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(scales_mins, scales_mins));
            let scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(scales_mins));
            let high = _mm512_broadcast_i64x4(_mm256_loadu_si256(x.qh.as_ptr() as *const __m256i));
            let high_up = _mm512_slli_epi16::<4>(high);
            let q = [0, 1, 2, 3].map(|c| {
                let bits = _mm256_loadu_si256(x.qs.as_ptr().add(32 * c) as *const __m256i);
                let low = _mm512_and_si512(join(bits, _mm256_srli_epi16(bits, 4)), mask);
                let from = if c < 2 { high_up } else { high };
                let top = _mm512_srlv_epi16(from, counts[c % 2]);
                // 0xCA: bits of the second operand where the first is set,
                // of the third elsewhere.
                _mm512_ternarylogic_epi32::<0xCA>(fifth, top, low)
            });
            let scale = pick.map(|p| _mm512_permutexvar_epi16(p, scales));
            let d_dmin = f16_pair(x.d.as_ptr());
            let (xd, xdmin) = (
                _mm_cvtss_f32(d_dmin),
                _mm_cvtss_f32(_mm_movehdup_ps(d_dmin)),
            );
            for t in 0..NT {
                let y = &*a[t].add(b);
                let summ = avx2::hsum4_epi32(avx2::k4_min_lanes(mins, y));
                acc_min[t] = (-y.d() * xdmin).mul_add(summ as f32, acc_min[t]);
                let sumi = k_run_lanes(&q, &scale, y.qs.as_ptr() as *const i8);
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(y.d() * xd), _mm256_cvtepi32_ps(sumi), acc[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = avx2::hsum_ps(acc[t]) + acc_min[t];
        }
        out
    }
}

/// Q6_K × Q8_K tile: [`avx2::dot_q6_k_q8_k`]'s lanes and float steps, its
/// runs two at a time through [`k_run_lanes`].
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q6_k_q8_k<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockQ6K;
        let a = a.map(|p| p as *const BlockQ8K);
        // Two scales per run, one per 16 quants (four lanes).
        let pick = load_picks(&const { k_pair_picks(2) });
        let mut acc = [_mm256_setzero_ps(); NT];
        for b in 0..nb {
            let x = &*w.add(b);
            let q = q6k_runs_x(x);
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.scales.as_ptr() as *const __m128i));
            let scales = _mm512_castsi256_si512(sc16);
            let sc = pick.map(|p| _mm512_permutexvar_epi16(p, scales));
            let xd = x.d();
            for t in 0..NT {
                let y = &*a[t].add(b);
                let bsums = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
                let offset = _mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16), 5);
                let runs = k_run_lanes(&q, &sc, y.qs.as_ptr() as *const i8);
                let sumi = _mm256_sub_epi32(runs, offset);
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(y.d() * xd), _mm256_cvtepi32_ps(sumi), acc[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = avx2::hsum_ps(acc[t]);
        }
        out
    }
}

/// f16 × f16 over `n` elements at byte pointers.
///
/// # Safety
/// See the file header; both pointers readable for `n` f16 values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_f16_ptr(n: usize, x: *const u8, y: *const u8) -> f32 {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            let xv = _mm512_cvtph_ps(_mm256_loadu_si256(x.add(2 * i) as *const __m256i));
            let yv = _mm512_cvtph_ps(_mm256_loadu_si256(y.add(2 * i) as *const __m256i));
            acc = _mm512_fmadd_ps(xv, yv, acc);
            i += 16;
        }
        if i < n {
            // The tail goes through the same lanes, zero-padded.
            let (mut xt, mut yt) = ([0u8; 32], [0u8; 32]);
            std::ptr::copy_nonoverlapping(x.add(2 * i), xt.as_mut_ptr(), 2 * (n - i));
            std::ptr::copy_nonoverlapping(y.add(2 * i), yt.as_mut_ptr(), 2 * (n - i));
            let xv = _mm512_cvtph_ps(_mm256_loadu_si256(xt.as_ptr() as *const __m256i));
            let yv = _mm512_cvtph_ps(_mm256_loadu_si256(yt.as_ptr() as *const __m256i));
            acc = _mm512_fmadd_ps(xv, yv, acc);
        }
        hsum512(acc)
    }
}

/// `y += a * x` with f16 `x`.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let n = x.len().min(y.len());
        let av = _mm512_set1_ps(a);
        let mut i = 0;
        while i + 16 <= n {
            let xv = _mm512_cvtph_ps(_mm256_loadu_si256(x.as_ptr().add(i) as *const __m256i));
            let yp = y.as_mut_ptr().add(i);
            _mm512_storeu_ps(yp, _mm512_fmadd_ps(av, xv, _mm512_loadu_ps(yp)));
            i += 16;
        }
        for j in i..n {
            y[j] = a.mul_add(x[j].to_f32(), y[j]);
        }
    }
}

/// The 16 accumulators of 16 rows' dots, each reduced in [`hsum512`]'s
/// exact pair order (half onto half, then `h[i] + h[i + 4]`, then
/// `(r0 + r2) + (r1 + r3)`), with shuffles that do the 16 together.
///
/// # Safety
/// See the file header.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn reduce_16_rows(acc: &[__m512; 16], out: &mut [f32]) {
    // Halves: row pair (2p, 2p + 1) -> [h(2p) | h(2p + 1)].
    let h: [__m512; 8] = std::array::from_fn(|p| {
        let (a, b) = (acc[2 * p], acc[2 * p + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    });
    // Quarters: rows 4m..4m + 4 -> [r(4m), .., r(4m + 3)].
    let r: [__m512; 4] = std::array::from_fn(|m| {
        let (a, b) = (h[2 * m], h[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    });
    // Within each 128-bit lane k: (r0 + r2), (r1 + r3) of two rows.
    let pairs = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    };
    let (s0, s1) = (pairs(r[0], r[1]), pairs(r[2], r[3]));
    let total = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(s0, s1),
        _mm512_shuffle_ps::<0b11_01_11_01>(s0, s1),
    );
    // Lane k holds rows k, 4 + k, 8 + k, 12 + k.
    let mut t = [0.0f32; 16];
    // SAFETY: `t` holds 16 values.
    unsafe { _mm512_storeu_ps(t.as_mut_ptr(), total) };
    for k in 0..4 {
        for j in 0..4 {
            out[4 * j + k] = t[4 * k + j];
        }
    }
}

/// [`dot_f16_ptr`] of `q` with row `i` (at `rows + i * stride`, `q.len()`
/// values) into `out[i]`. Rows go 16 at a time: their accumulators are built
/// as [`dot_f16_ptr`] builds one, then reduced together by shuffles that add
/// the same lane pairs in the same order as [`hsum512`] (half onto half, then
/// `h[i] + h[i + 4]`, then `(r0 + r2) + (r1 + r3)`), so each result has
/// [`dot_f16_ptr`]'s bits for a fraction of its reduction work.
///
/// # Safety
/// See the file header; every row readable for `q.len()` f16 values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_f16_rows(q: &[f16], rows: *const f16, stride: usize, out: &mut [f32]) {
    let hd = q.len();
    let whole = if hd.is_multiple_of(16) {
        out.len() / 16 * 16
    } else {
        0
    };
    for i0 in (0..whole).step_by(16) {
        // SAFETY: rows `i0..i0 + 16` are readable for `hd` values (the
        // caller's promise) and `q` holds `hd`.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); 16];
            for c in (0..hd).step_by(16) {
                let qv = _mm512_cvtph_ps(_mm256_loadu_si256(q.as_ptr().add(c) as *const __m256i));
                for (j, acc) in acc.iter_mut().enumerate() {
                    let row = rows.add((i0 + j) * stride + c);
                    let kv = _mm512_cvtph_ps(_mm256_loadu_si256(row as *const __m256i));
                    *acc = _mm512_fmadd_ps(qv, kv, *acc);
                }
            }
            reduce_16_rows(&acc, &mut out[i0..i0 + 16]);
        }
    }
    for (i, o) in out.iter_mut().enumerate().skip(whole) {
        // SAFETY: as above, for the one row `i`.
        *o = unsafe {
            dot_f16_ptr(
                hd,
                q.as_ptr() as *const u8,
                rows.add(i * stride) as *const u8,
            )
        };
    }
}

/// [`axpy_f16`] of `w[i]` times row `i` (at `rows + i * stride`, `hd =
/// lanes.len() / 16` values) into lane `(first + i) % 16` of `lanes`
/// (`[16][hd]`). For every 16 rows that fill the 16 lanes once, each
/// 16-value column of the lanes stays in registers while those rows are
/// added, instead of a load and store per row; every lane value still gets
/// the same fused steps in the same (row) order as [`axpy_f16`] gives it.
///
/// # Safety
/// See the file header; every row readable for `hd` f16 values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn axpy_f16_rows(
    w: &[f32],
    rows: *const f16,
    stride: usize,
    lanes: &mut [f32],
    first: usize,
) {
    let hd = lanes.len() / 16;
    // SAFETY: the caller makes every row `i < w.len()` readable for `hd`.
    let row = |i: usize| unsafe { std::slice::from_raw_parts(rows.add(i * stride), hd) };
    let one = |lanes: &mut [f32], i: usize| {
        let lane = ((first + i) % 16) * hd;
        // SAFETY: the features are the caller's promise.
        unsafe { axpy_f16(w[i], row(i), &mut lanes[lane..lane + hd]) };
    };
    // Rows up to the first that lands on lane 0, then whole rounds of 16,
    // then the rest: in row order, so each lane sees its rows in order.
    let head = ((16 - first % 16) % 16).min(w.len());
    let rounds = if hd.is_multiple_of(16) {
        (w.len() - head) / 16
    } else {
        0
    };
    for i in 0..head {
        one(lanes, i);
    }
    for c in (0..hd).step_by(16) {
        // SAFETY: `lanes` holds 16 rows of `hd`, so `l * hd + c .. + 16`
        // is inside it; each row read is inside the caller's rows.
        unsafe {
            let mut acc: [__m512; 16] =
                std::array::from_fn(|l| _mm512_loadu_ps(lanes.as_ptr().add(l * hd + c)));
            for round in 0..rounds {
                let base = head + 16 * round;
                for (l, acc) in acc.iter_mut().enumerate() {
                    let x = _mm512_cvtph_ps(_mm256_loadu_si256(
                        row(base + l).as_ptr().add(c) as *const __m256i
                    ));
                    *acc = _mm512_fmadd_ps(_mm512_set1_ps(w[base + l]), x, *acc);
                }
            }
            for (l, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(lanes.as_mut_ptr().add(l * hd + c), *acc);
            }
        }
        if rounds == 0 {
            break;
        }
    }
    for i in head + 16 * rounds..w.len() {
        one(lanes, i);
    }
}

/// Rows `0..n` (at `rows + i * stride`, `hd` values each, `hd` a multiple
/// of 16) widened to f32, packed `hd` apart at `out` (exact: every f16 is
/// an f32).
///
/// # Safety
/// See the file header; every row readable for `hd` f16 values, `out`
/// writable for `n * hd` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn widen_f16_rows(
    rows: *const f16,
    stride: usize,
    hd: usize,
    n: usize,
    out: *mut f32,
) {
    for i in 0..n {
        for c in (0..hd).step_by(16) {
            // SAFETY: inside row `i` and output row `i` (the caller's promise).
            unsafe {
                let x = _mm512_cvtph_ps(_mm256_loadu_si256(
                    rows.add(i * stride + c) as *const __m256i
                ));
                _mm512_storeu_ps(out.add(i * hd + c), x);
            }
        }
    }
}

/// [`dot_f16_rows`] over rows already widened to f32 (`q` too: the f32
/// values of the f16 query), `hd = q.len()` a multiple of 16: the same
/// fused steps in the same order and the same reduction, so each result
/// has [`dot_f16_rows`]'s bits, without converting a row once per query.
///
/// # Safety
/// See the file header; every row readable for `q.len()` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_f32_rows(q: &[f32], rows: *const f32, stride: usize, out: &mut [f32]) {
    let hd = q.len();
    debug_assert!(hd.is_multiple_of(16));
    let whole = out.len() / 16 * 16;
    for i0 in (0..whole).step_by(16) {
        // SAFETY: rows `i0..i0 + 16` are readable for `hd` values (the
        // caller's promise) and `q` holds `hd`.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); 16];
            for c in (0..hd).step_by(16) {
                let qv = _mm512_loadu_ps(q.as_ptr().add(c));
                for (j, acc) in acc.iter_mut().enumerate() {
                    let kv = _mm512_loadu_ps(rows.add((i0 + j) * stride + c));
                    *acc = _mm512_fmadd_ps(qv, kv, *acc);
                }
            }
            reduce_16_rows(&acc, &mut out[i0..i0 + 16]);
        }
    }
    for (i, o) in out.iter_mut().enumerate().skip(whole) {
        // SAFETY: as above, for the one row `i`.
        unsafe {
            let mut acc = _mm512_setzero_ps();
            for c in (0..hd).step_by(16) {
                let qv = _mm512_loadu_ps(q.as_ptr().add(c));
                let kv = _mm512_loadu_ps(rows.add(i * stride + c));
                acc = _mm512_fmadd_ps(qv, kv, acc);
            }
            *o = hsum512(acc);
        }
    }
}

/// [`axpy_f16_rows`] over rows already widened to f32 (`hd = lanes.len() /
/// 16` a multiple of 16): each lane value gets the same fused steps in the
/// same row order, so the same bits. Each 16-value column of the lanes
/// stays in registers for all the whole rounds of 16 rows the call has,
/// not just one.
///
/// # Safety
/// See the file header; every row readable for `hd` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn axpy_f32_rows(
    w: &[f32],
    rows: *const f32,
    stride: usize,
    lanes: &mut [f32],
    first: usize,
) {
    let hd = lanes.len() / 16;
    debug_assert!(hd.is_multiple_of(16));
    let one = |lanes: &mut [f32], i: usize| {
        let lane = ((first + i) % 16) * hd;
        for c in (0..hd).step_by(16) {
            // SAFETY: row `i` is readable for `hd` (the caller's promise);
            // lane `lane` holds `hd` values.
            unsafe {
                let x = _mm512_loadu_ps(rows.add(i * stride + c));
                let y = lanes.as_mut_ptr().add(lane + c);
                _mm512_storeu_ps(
                    y,
                    _mm512_fmadd_ps(_mm512_set1_ps(w[i]), x, _mm512_loadu_ps(y)),
                );
            }
        }
    };
    // Rows up to the first that lands on lane 0, then whole rounds of 16,
    // then the rest: in row order, so each lane sees its rows in order.
    let head = ((16 - first % 16) % 16).min(w.len());
    let rounds = (w.len() - head) / 16;
    for i in 0..head {
        one(lanes, i);
    }
    if rounds > 0 {
        for c in (0..hd).step_by(16) {
            // SAFETY: `lanes` holds 16 rows of `hd`, so `l * hd + c .. + 16`
            // is inside it; each row read is inside the caller's rows.
            unsafe {
                let mut acc: [__m512; 16] =
                    std::array::from_fn(|l| _mm512_loadu_ps(lanes.as_ptr().add(l * hd + c)));
                for round in 0..rounds {
                    let base = head + 16 * round;
                    for (l, acc) in acc.iter_mut().enumerate() {
                        let x = _mm512_loadu_ps(rows.add((base + l) * stride + c));
                        *acc = _mm512_fmadd_ps(_mm512_set1_ps(w[base + l]), x, *acc);
                    }
                }
                for (l, acc) in acc.iter().enumerate() {
                    _mm512_storeu_ps(lanes.as_mut_ptr().add(l * hd + c), *acc);
                }
            }
        }
    }
    for i in head + 16 * rounds..w.len() {
        one(lanes, i);
    }
}

/// ggml's `expf` on 16 lanes, the AVX-512 form itself (`vscalefps`).
///
/// # Safety
/// See the file header.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn exp16(x: __m512) -> __m512 {
    use super::scalar::exp_consts::*;
    let c = |b: u32| _mm512_set1_ps(f32::from_bits(b));
    let z = _mm512_fmadd_ps(x, c(LOG2E), c(SHIFTER));
    let n = _mm512_sub_ps(z, c(SHIFTER));
    let b = _mm512_fnmadd_ps(n, c(LN2_LO), _mm512_fnmadd_ps(n, c(LN2_HI), x));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(
            _mm512_fmadd_ps(c(C5), b, c(C4)),
            u,
            _mm512_fmadd_ps(c(C3), b, c(C2)),
        ),
        u,
        _mm512_fmadd_ps(c(C1), b, _mm512_set1_ps(1.0)),
    );
    let res = _mm512_scalef_ps(j, n);
    let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
    if big == 0 {
        return res;
    }
    let neg = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
    let alt = _mm512_mask_blend_ps(neg, _mm512_set1_ps(f32::INFINITY), _mm512_setzero_ps());
    _mm512_mask_blend_ps(big, res, alt)
}

/// `n` elements 16 at a time: each chunk's first index and the mask of
/// its elements (the last chunk's covers what is left).
pub(crate) fn chunks16(n: usize) -> impl Iterator<Item = (usize, __mmask16)> {
    (0..n).step_by(16).map(move |i| {
        let mask = if n - i >= 16 {
            0xFFFF
        } else {
            (1u16 << (n - i)) - 1
        };
        (i, mask)
    })
}

/// ggml's `expf` in place (same bits as the scalar reference).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn exp_ggml(x: &mut [f32]) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let n = x.len();
        let p = x.as_mut_ptr();
        for (i, mask) in chunks16(n) {
            let v = _mm512_maskz_loadu_ps(mask, p.add(i));
            _mm512_mask_storeu_ps(p.add(i), mask, exp16(v));
        }
    }
}

/// `gate = silu(gate) * up` (same bits as the scalar reference).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn swiglu_ggml(gate: &mut [f32], up: &[f32]) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let n = gate.len().min(up.len());
        let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
        for (i, mask) in chunks16(n) {
            let gv = _mm512_maskz_loadu_ps(mask, g.add(i));
            let uv = _mm512_maskz_loadu_ps(mask, u.add(i));
            let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            let silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0), e));
            _mm512_mask_storeu_ps(g.add(i), mask, _mm512_mul_ps(silu, uv));
        }
    }
}
