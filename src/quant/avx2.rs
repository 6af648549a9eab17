//! AVX2 + FMA + F16C kernels (x86_64). Also the K-quant kernels (except
//! IQ4_XS) and the activation quantizers of the AVX-512 level, whose 512-bit
//! versions would gain little.
//!
//! Every dot kernel is generic over `NT`, the number of activation rows it
//! multiplies one weight row with. Each weight block is unpacked once and
//! used for all `NT` tokens; every token keeps its own accumulators and sees
//! exactly the operation sequence of the `NT = 1` kernel, so a tile gives the
//! same bits as single dots.
//!
//! Every quantized dot keeps the 8 float lanes of the scalar reference
//! (llama.cpp's lanes): the integer lane sums are exact, and the float steps
//! on them (the scale products, the fused multiply-adds, the final
//! horizontal sums) are the reference's, so each kernel agrees with it bit
//! for bit. The activation quantizers also reproduce the scalar reference
//! exactly.

#![allow(clippy::missing_safety_doc)] // each `# Safety` is stated once below

use std::arch::x86_64::*;
use std::ptr::{addr_of, read_unaligned};

use half::f16;

use super::blocks::{
    scales_mins_k4, scales_q3k, BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0,
    BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1,
    KVALUES_IQ4NL, QK32,
};
use super::scalar;
use super::types::QK_K;

// Safety of every `unsafe fn` in this file: the CPU must support AVX2, FMA
// and F16C, and each pointer must be valid for reading `nb` blocks of its
// format (the dispatch table in `dispatch.rs` is built only after detecting
// the features, and the public entry points check the lengths).

/// Horizontal sum of 8 lanes in a fixed order.
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Horizontal sum of 8 i32 lanes (exact).
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01));
    _mm_cvtsi128_si32(s)
}

/// Two f16 values stored next to each other (a block's `d` and `m`/`s`),
/// widened to f32 lanes 0 and 1.
///
/// # Safety
/// F16C must be available; `p` must be readable for 4 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f16_pair(p: *const u8) -> __m128 {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128(read_unaligned(p as *const i32))) }
}

/// One f16 (given as bytes) widened to f32 lane 0.
///
/// # Safety
/// F16C must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f16_one(bytes: [u8; 2]) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes(bytes) as i32))
}

/// 16 packed nibbles to 32 bytes: low nibbles first, then high nibbles.
///
/// # Safety
/// AVX2 must be available; `p` readable for 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack_nibbles(p: *const u8) -> __m256i {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let q = _mm_loadu_si128(p as *const __m128i);
        _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(q, 4), q),
            _mm256_set1_epi8(0x0F),
        )
    }
}

/// Dot of unsigned bytes `u` with signed bytes `s`, as 8 i32 lanes.
///
/// # Safety
/// AVX2 must be available; pair sums must stay in i16 range.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_u8_i8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// The 32 bits of a Q5 block's `qh` as 32 bytes: 0xFF where bit `i` is
/// set, 0 elsewhere (byte `i` for element `i`).
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn bits_to_bytes(qh: [u8; 4]) -> __m256i {
    // Byte `i` takes byte `i / 8` of the word, then tests bit `i % 8`.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(i32::from_le_bytes(qh)),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let bit = _mm256_set1_epi64x(i64::from_le_bytes([1, 2, 4, 8, 16, 32, 64, 128]));
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit)
}

/// The 32 quants (0..32) of a Q5_0 / Q5_1 block in element order.
///
/// # Safety
/// AVX2 must be available; `qs` readable for 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q5_quants(qs: *const u8, qh: [u8; 4]) -> __m256i {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let high = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
        _mm256_or_si256(unpack_nibbles(qs), high)
    }
}

/// 16 packed IQ4 indices as their 32 grid values (i8) in element order.
///
/// # Safety
/// AVX2 must be available; `qs` readable for 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn iq4_values(qs: *const u8) -> __m256i {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let table = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
        let q = _mm_loadu_si128(qs as *const __m128i);
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, mask));
        let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), mask));
        _mm256_set_m128i(hi, lo)
    }
}

/// One block step of the signed 8-lane kernels (Q8_0, Q5_0, IQ4_NL):
/// `acc + (wd * ad) * lanes(wq · aq)`, with the sign of `wq` moved onto
/// the activations so the byte products go through `maddubs`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `ab` readable for one block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
        let sumi = dot_u8_i8(wabs, _mm256_sign_epi8(aq, wq));
        let scale = _mm_mul_ps(wd, f16_one((*ab).d));
        _mm256_fmadd_ps(_mm256_broadcastss_ps(scale), _mm256_cvtepi32_ps(sumi), acc)
    }
}

/// Q5_0 × Q8_0 tile (the scalar reference's lane order).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
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
            let wq = _mm256_sub_epi8(q5_quants(wb.qs.as_ptr(), wb.qh), _mm256_set1_epi8(16));
            let wabs = _mm256_sign_epi8(wq, wq);
            let wd = f16_one(wb.d);
            for t in 0..NT {
                acc[t] = signed_block_step(acc[t], wq, wabs, wd, a[t].add(b));
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = hsum_ps(acc[t]);
        }
        out
    }
}

/// Q5_1 × Q8_1 tile (the scalar reference's order, as Q4_1).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
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
        // Lane 1 accumulates m * s; lane 0 carries unused d * d products.
        let mut acc_min = [_mm_setzero_ps(); NT];
        for b in 0..nb {
            let wb = w.add(b);
            let wq = q5_quants(addr_of!((*wb).qs) as *const u8, (*wb).qh);
            let wdm = f16_pair(wb as *const u8);
            for t in 0..NT {
                let ab = a[t].add(b);
                let aq = _mm256_loadu_si256(addr_of!((*ab).qs) as *const __m256i);
                let adm = f16_pair(ab as *const u8);
                let prod = _mm_mul_ps(wdm, adm);
                acc[t] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(prod),
                    _mm256_cvtepi32_ps(dot_u8_i8(wq, aq)),
                    acc[t],
                );
                acc_min[t] = _mm_fmadd_ps(wdm, adm, acc_min[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = hsum_ps(acc[t]) + _mm_cvtss_f32(_mm_movehdup_ps(acc_min[t]));
        }
        out
    }
}

/// IQ4_NL × Q8_0 tile (the scalar reference's lane order).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
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
            let wq = iq4_values(wb.qs.as_ptr());
            let wabs = _mm256_sign_epi8(wq, wq);
            let wd = f16_one(wb.d);
            for t in 0..NT {
                acc[t] = signed_block_step(acc[t], wq, wabs, wd, a[t].add(b));
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = hsum_ps(acc[t]);
        }
        out
    }
}

/// Q4_1 × Q8_1 tile.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
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
        // Lane 1 accumulates m * s; lane 0 carries unused d * d products.
        let mut acc_min = [_mm_setzero_ps(); NT];
        for b in 0..nb {
            let wb = w.add(b);
            let wq = unpack_nibbles(addr_of!((*wb).qs) as *const u8);
            let wdm = f16_pair(wb as *const u8);
            for t in 0..NT {
                let ab = a[t].add(b);
                let aq = _mm256_loadu_si256(addr_of!((*ab).qs) as *const __m256i);
                let adm = f16_pair(ab as *const u8);
                let prod = _mm_mul_ps(wdm, adm);
                let sumi = dot_u8_i8(wq, aq);
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
            out[t] = hsum_ps(acc[t]) + _mm_cvtss_f32(_mm_movehdup_ps(acc_min[t]));
        }
        out
    }
}

/// Q4_0 × Q8_0 tile.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
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
        let mut acc = [_mm256_setzero_ps(); NT];
        for b in 0..nb {
            let wb = w.add(b);
            let wq = _mm256_sub_epi8(
                unpack_nibbles(addr_of!((*wb).qs) as *const u8),
                _mm256_set1_epi8(8),
            );
            let wabs = _mm256_sign_epi8(wq, wq);
            let wd = f16_one((*wb).d);
            for t in 0..NT {
                let ab = a[t].add(b);
                let aq = _mm256_loadu_si256(addr_of!((*ab).qs) as *const __m256i);
                let sumi = dot_u8_i8(wabs, _mm256_sign_epi8(aq, wq));
                let scale = _mm_mul_ps(wd, f16_one((*ab).d));
                acc[t] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(scale),
                    _mm256_cvtepi32_ps(sumi),
                    acc[t],
                );
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = hsum_ps(acc[t]);
        }
        out
    }
}

/// Q8_0 × Q8_0 tile.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
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
        let mut acc = [_mm256_setzero_ps(); NT];
        for b in 0..nb {
            let wb = w.add(b);
            let wq = _mm256_loadu_si256(addr_of!((*wb).qs) as *const __m256i);
            let wabs = _mm256_sign_epi8(wq, wq);
            let wd = f16_one((*wb).d);
            for t in 0..NT {
                let ab = a[t].add(b);
                let aq = _mm256_loadu_si256(addr_of!((*ab).qs) as *const __m256i);
                let sumi = dot_u8_i8(wabs, _mm256_sign_epi8(aq, wq));
                let scale = _mm_mul_ps(wd, f16_one((*ab).d));
                acc[t] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(scale),
                    _mm256_cvtepi32_ps(sumi),
                    acc[t],
                );
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = hsum_ps(acc[t]);
        }
        out
    }
}

/// Horizontal sum of 4 lanes: `(v0 + v2) + (v1 + v3)` ([`scalar::hsum4`]).
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum4_ps(v: __m128) -> f32 {
    let s = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// Horizontal sum of 4 i32 lanes (exact).
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum4_epi32(v: __m128i) -> i32 {
    let s = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01)))
}

/// The 8 integer lanes of a K-quant super-block product
/// ([`scalar::k_lanes`]): `q[r]` holds run `r` (elements `32r..32r+32`) as
/// unsigned bytes, `sc[r]` the 16-bit multipliers of its pair sums (its
/// sub-block scales), `yq` the 256 activation quants.
///
/// # Safety
/// AVX2 must be available; `yq` readable for 256 bytes; every pair sum
/// `q * y` must stay in i16 range.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_run_lanes(q: &[__m256i; 8], sc: &[__m256i; 8], yq: *const i8) -> __m256i {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let mut sumi = _mm256_setzero_si256();
        for r in 0..8 {
            let y = _mm256_loadu_si256(yq.add(32 * r) as *const __m256i);
            let p = _mm256_maddubs_epi16(q[r], y);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sc[r]));
        }
        sumi
    }
}

/// The 4 minimum lanes of a Q4_K / Q5_K super-block
/// ([`scalar::k4_min_lanes`]): the 16 activation sums added in pairs to the
/// 8 sub-block sums, times the mins (`mins`: 8 i16), as llama.cpp's
/// `hadd` + `madd` form them.
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn k4_min_lanes(mins: __m128i, y: &BlockQ8K) -> __m128i {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe { _mm_madd_epi16(mins, sub_block_sums(y)) }
}

/// The 8 sub-block sums of a K-quant super-block's activations: its 16
/// group sums added in pairs (i16, exact: at most 32 * 128).
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sub_block_sums(y: &BlockQ8K) -> __m128i {
    // SAFETY: `bsums` holds 32 bytes; the caller promises AVX2.
    let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i) };
    _mm_hadd_epi16(
        _mm256_castsi256_si128(bsums),
        _mm256_extracti128_si256(bsums, 1),
    )
}

/// A Q4_K / Q5_K super-block's 8 sub-block scales as run multipliers, and
/// its 8 mins as i16 lanes.
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_scales_mins(scales: &[u8; 12]) -> ([__m256i; 8], __m128i) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let (sc, mn) = scales_mins_k4(scales);
        let runs = sc.map(|s| _mm256_set1_epi16(s as i16));
        let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(mn.as_ptr() as *const __m128i));
        (runs, mins)
    }
}

/// Q4_K × Q8_K tile (the scalar reference's order: 8 quant lanes and 4
/// minimum lanes, each fused per super-block).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
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
        let mask = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut acc_min = [_mm_setzero_ps(); NT];
        for b in 0..nb {
            let x = &*w.add(b);
            let (sc, mins) = k4_scales_mins(&x.scales);
            let mut q = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let bits = _mm256_loadu_si256(x.qs.as_ptr().add(32 * c) as *const __m256i);
                q[2 * c] = _mm256_and_si256(bits, mask);
                q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), mask);
            }
            let (xd, xdmin) = (x.d(), x.dmin());
            for t in 0..NT {
                let y = &*a[t].add(b);
                let m = _mm_cvtepi32_ps(k4_min_lanes(mins, y));
                acc_min[t] = _mm_fmadd_ps(_mm_set1_ps(-y.d() * xdmin), m, acc_min[t]);
                let sumi = k_run_lanes(&q, &sc, y.qs.as_ptr() as *const i8);
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(y.d() * xd), _mm256_cvtepi32_ps(sumi), acc[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = hsum_ps(acc[t]) + hsum4_ps(acc_min[t]);
        }
        out
    }
}

/// Q5_K × Q8_K tile (the scalar reference's order: 8 quant lanes fused per
/// super-block, the exact minimum sum fused into one scalar).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
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
        let mask = _mm256_set1_epi8(0x0F);
        let sixteen = _mm256_set1_epi8(16);
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut acc_min = [0.0f32; NT];
        for b in 0..nb {
            let x = &*w.add(b);
            let (sc, mins) = k4_scales_mins(&x.scales);
            let hbits = _mm256_loadu_si256(x.qh.as_ptr() as *const __m256i);
            let mut q = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let bits = _mm256_loadu_si256(x.qs.as_ptr().add(32 * c) as *const __m256i);
                let bit_lo = _mm256_set1_epi8((1u8 << (2 * c)) as i8);
                let bit_hi = _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8);
                let h_lo = _mm256_and_si256(
                    _mm256_cmpeq_epi8(_mm256_and_si256(hbits, bit_lo), bit_lo),
                    sixteen,
                );
                let h_hi = _mm256_and_si256(
                    _mm256_cmpeq_epi8(_mm256_and_si256(hbits, bit_hi), bit_hi),
                    sixteen,
                );
                q[2 * c] = _mm256_or_si256(_mm256_and_si256(bits, mask), h_lo);
                q[2 * c + 1] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), mask), h_hi);
            }
            let (xd, xdmin) = (x.d(), x.dmin());
            for t in 0..NT {
                let y = &*a[t].add(b);
                let summ = hsum4_epi32(k4_min_lanes(mins, y));
                acc_min[t] = (-y.d() * xdmin).mul_add(summ as f32, acc_min[t]);
                let sumi = k_run_lanes(&q, &sc, y.qs.as_ptr() as *const i8);
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(y.d() * xd), _mm256_cvtepi32_ps(sumi), acc[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = hsum_ps(acc[t]) + acc_min[t];
        }
        out
    }
}

/// A Q4_K super-block's (`qh` none) or a Q5_K one's (its fifth bits in
/// `qh`) 8 runs of 32 unsigned quants in element order: run `r` is chunk
/// `r / 2` of `qs`, its low (even `r`) or high nibbles, plus 16 where bit
/// `r` of `qh[l]` is set for element `l`.
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn k4_runs(qs: &[u8; 128], qh: Option<&[u8; 32]>) -> [__m256i; 8] {
    let mask = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    // SAFETY: `qh` holds 32 bytes.
    let qh = qh.map(|qh| unsafe { _mm256_loadu_si256(qh.as_ptr() as *const __m256i) });
    std::array::from_fn(|r| {
        // SAFETY: `qs` holds 128 bytes, 32 per chunk.
        let bits = unsafe { _mm256_loadu_si256(qs.as_ptr().add(32 * (r / 2)) as *const __m256i) };
        let low = if r % 2 == 0 {
            _mm256_and_si256(bits, mask)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(bits), mask)
        };
        // Shifted down within each 16-bit word, each byte's own bit `r`
        // lands in its bit 0, then moves to bit 4.
        qh.map_or(low, |qh| {
            let bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(r as i32)), one);
            _mm256_or_si256(low, _mm256_slli_epi16::<4>(bit))
        })
    })
}

/// A Q6_K super-block as the 8 runs of 32 quants in element order without
/// the -32 offset (0..64), each run's pair of 16-element scales as i16
/// lanes, and the 16 scales as i16 (for the offset term).
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q6k_runs(x: &BlockQ6K) -> ([__m256i; 8], [__m256i; 8], __m256i) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let mask4 = _mm256_set1_epi8(0x0F);
        let mask2 = _mm256_set1_epi8(0x03);
        let mut q = [_mm256_setzero_si256(); 8];
        for h in 0..2 {
            let ql0 = _mm256_loadu_si256(x.ql.as_ptr().add(64 * h) as *const __m256i);
            let ql1 = _mm256_loadu_si256(x.ql.as_ptr().add(64 * h + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(x.qh.as_ptr().add(32 * h) as *const __m256i);
            let h0 = _mm256_slli_epi16(_mm256_and_si256(qh, mask2), 4);
            let h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), mask2), 4);
            let h4 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), mask2), 4);
            let h6 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), mask2), 4);
            q[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, mask4), h0);
            q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, mask4), h2);
            q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), mask4), h4);
            q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), mask4), h6);
        }
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.scales.as_ptr() as *const __m128i));
        let mut sc = [_mm256_setzero_si256(); 8];
        for (r, s) in sc.iter_mut().enumerate() {
            *s = scale_pair(
                x.scales[2 * r] as i8 as i16,
                x.scales[2 * r + 1] as i8 as i16,
            );
        }
        (q, sc, sc16)
    }
}

/// Q6_K × Q8_K tile (the scalar reference's lanes, [`scalar::q6k_lanes`]:
/// unsigned quants, the `-32` offset subtracted per lane from the scaled
/// 16-element activation sums).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
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
        let mut acc = [_mm256_setzero_ps(); NT];
        for b in 0..nb {
            let x = &*w.add(b);
            let (q, sc, sc16) = q6k_runs(x);
            let xd = x.d();
            for t in 0..NT {
                let y = &*a[t].add(b);
                let bsums = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
                let offset = _mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16), 5);
                let sumi =
                    _mm256_sub_epi32(k_run_lanes(&q, &sc, y.qs.as_ptr() as *const i8), offset);
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(y.d() * xd), _mm256_cvtepi32_ps(sumi), acc[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = hsum_ps(acc[t]);
        }
        out
    }
}

/// Two sub-block scales as the multiplier of one 32-element run's 16-bit
/// pair sums: the low 128 bits (elements 0..16) take `lo`, the high ones
/// `hi`.
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_pair(lo: i16, hi: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
}

/// The 2-bit fields of a K-quant super-block (Q2_K, Q3_K low bits) as 8
/// runs of 32 bytes in element order.
///
/// # Safety
/// AVX2 must be available; `qs` readable for 64 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn two_bit_runs(qs: *const u8) -> [__m256i; 8] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let mask = _mm256_set1_epi8(3);
        let mut q = [_mm256_setzero_si256(); 8];
        for h in 0..2 {
            let bits = _mm256_loadu_si256(qs.add(32 * h) as *const __m256i);
            q[4 * h] = _mm256_and_si256(bits, mask);
            q[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 2), mask);
            q[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), mask);
            q[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(bits, 6), mask);
        }
        q
    }
}

/// Q2_K × Q8_K tile (bit-identical to the scalar reference: the 8 integer
/// lanes are exact, the float steps the same fused multiply-adds).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q2_k_q8_k<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockQ2K;
        let a = a.map(|p| p as *const BlockQ8K);
        let mut acc = [_mm256_setzero_ps(); NT];
        for b in 0..nb {
            let x = &*w.add(b);
            let q = two_bit_runs(x.qs.as_ptr());
            let mut sc = [_mm256_setzero_si256(); 8];
            for (c, s) in sc.iter_mut().enumerate() {
                *s = scale_pair(
                    (x.scales[2 * c] & 0x0F) as i16,
                    (x.scales[2 * c + 1] & 0x0F) as i16,
                );
            }
            let packed = _mm_loadu_si128(x.scales.as_ptr() as *const __m128i);
            let mins = _mm256_cvtepu8_epi16(_mm_and_si128(
                _mm_srli_epi16(packed, 4),
                _mm_set1_epi8(0x0F),
            ));
            let (xd, xdmin) = (x.d(), x.dmin());
            for t in 0..NT {
                let y = &*a[t].add(b);
                let bsums = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
                let min_lanes = _mm256_madd_epi16(mins, bsums);
                let dmin = -(y.d() * xdmin);
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(min_lanes), acc[t]);
                let mut sumi = _mm256_setzero_si256();
                for c in 0..8 {
                    let yq = _mm256_loadu_si256(y.qs.as_ptr().add(32 * c) as *const __m256i);
                    let p = _mm256_maddubs_epi16(q[c], yq);
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sc[c]));
                }
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(y.d() * xd), _mm256_cvtepi32_ps(sumi), acc[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = hsum_ps(acc[t]);
        }
        out
    }
}

/// Q3_K × Q8_K tile (bit-identical to the scalar reference).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q3_k_q8_k<const NT: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; NT],
) -> [f32; NT] {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let w = w as *const BlockQ3K;
        let a = a.map(|p| p as *const BlockQ8K);
        let mut acc = [_mm256_setzero_ps(); NT];
        for b in 0..nb {
            let x = &*w.add(b);
            let low = two_bit_runs(x.qs.as_ptr());
            let hmask = _mm256_loadu_si256(x.hmask.as_ptr() as *const __m256i);
            // Quants in -4..4: the low bits, minus 4 where the high bit is clear.
            let scales = scales_q3k(&x.scales);
            let mut q = [_mm256_setzero_si256(); 8];
            let mut qabs = [_mm256_setzero_si256(); 8];
            let mut sc = [_mm256_setzero_si256(); 8];
            for c in 0..8 {
                let bit = _mm256_set1_epi8((1u8 << c) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), bit);
                let plus4 = _mm256_and_si256(set, _mm256_set1_epi8(4));
                q[c] = _mm256_sub_epi8(_mm256_or_si256(low[c], plus4), _mm256_set1_epi8(4));
                qabs[c] = _mm256_sign_epi8(q[c], q[c]);
                sc[c] = scale_pair(scales[2 * c] as i16, scales[2 * c + 1] as i16);
            }
            let xd = x.d();
            for t in 0..NT {
                let y = &*a[t].add(b);
                let mut sumi = _mm256_setzero_si256();
                for c in 0..8 {
                    let yq = _mm256_loadu_si256(y.qs.as_ptr().add(32 * c) as *const __m256i);
                    let p = _mm256_maddubs_epi16(qabs[c], _mm256_sign_epi8(yq, q[c]));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sc[c]));
                }
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(y.d() * xd), _mm256_cvtepi32_ps(sumi), acc[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = hsum_ps(acc[t]);
        }
        out
    }
}

/// IQ4_XS × Q8_K tile (bit-identical to the scalar reference).
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx2,fma,f16c")]
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
                v[j] = iq4_values(x.qs.as_ptr().add(16 * j));
                vabs[j] = _mm256_sign_epi8(v[j], v[j]);
                sc[j] = _mm256_set1_epi16(x.scale(j) as i16);
            }
            let xd = x.d();
            for t in 0..NT {
                let y = &*a[t].add(b);
                let mut sumi = _mm256_setzero_si256();
                for j in 0..8 {
                    let yq = _mm256_loadu_si256(y.qs.as_ptr().add(32 * j) as *const __m256i);
                    let p = _mm256_maddubs_epi16(vabs[j], _mm256_sign_epi8(yq, v[j]));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sc[j]));
                }
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(xd * y.d()), _mm256_cvtepi32_ps(sumi), acc[t]);
            }
        }
        let mut out = [0.0f32; NT];
        for t in 0..NT {
            out[t] = hsum_ps(acc[t]);
        }
        out
    }
}

/// f16 × f16 over `n` elements at byte pointers.
///
/// # Safety
/// See the file header; both pointers readable for `n` f16 values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_f16_ptr(n: usize, x: *const u8, y: *const u8) -> f32 {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        // Lanes 0..8 and 8..16 of the 16-lane reference order.
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        let load = |p: *const u8| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
        while i + 16 <= n {
            lo = _mm256_fmadd_ps(load(x.add(2 * i)), load(y.add(2 * i)), lo);
            hi = _mm256_fmadd_ps(load(x.add(2 * i + 16)), load(y.add(2 * i + 16)), hi);
            i += 16;
        }
        if i < n {
            // The tail goes through the same lanes, zero-padded.
            let (mut xt, mut yt) = ([0u8; 32], [0u8; 32]);
            std::ptr::copy_nonoverlapping(x.add(2 * i), xt.as_mut_ptr(), 2 * (n - i));
            std::ptr::copy_nonoverlapping(y.add(2 * i), yt.as_mut_ptr(), 2 * (n - i));
            lo = _mm256_fmadd_ps(load(xt.as_ptr()), load(yt.as_ptr()), lo);
            hi = _mm256_fmadd_ps(load(xt.as_ptr().add(16)), load(yt.as_ptr().add(16)), hi);
        }
        hsum_ps(_mm256_add_ps(lo, hi))
    }
}

/// 8 bf16 values at `p` widened to f32.
///
/// # Safety
/// AVX2; `p` readable for 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_bf16x8(p: *const u8) -> __m256 {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
    }
}

/// bf16 × bf16 over `n` elements at byte pointers.
///
/// # Safety
/// See the file header; both pointers readable for `n` bf16 values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_bf16_ptr(n: usize, x: *const u8, y: *const u8) -> f32 {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            acc = _mm256_fmadd_ps(load_bf16x8(x.add(2 * i)), load_bf16x8(y.add(2 * i)), acc);
            i += 8;
        }
        let mut s = hsum_ps(acc);
        while i < n {
            let xv = half::bf16::from_le_bytes(read_unaligned(x.add(2 * i) as *const [u8; 2]));
            let yv = half::bf16::from_le_bytes(read_unaligned(y.add(2 * i) as *const [u8; 2]));
            s += xv.to_f32() * yv.to_f32();
            i += 1;
        }
        s
    }
}

/// f32 × f32 over `n` elements at byte pointers.
///
/// # Safety
/// See the file header; both pointers readable for `n` f32 values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_f32_ptr(n: usize, x: *const u8, y: *const u8) -> f32 {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let (x, y) = (x as *const f32, y as *const f32);
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut i = 0;
        while i + 16 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(i)), _mm256_loadu_ps(y.add(i)), acc[0]);
            acc[1] = _mm256_fmadd_ps(
                _mm256_loadu_ps(x.add(i + 8)),
                _mm256_loadu_ps(y.add(i + 8)),
                acc[1],
            );
            i += 16;
        }
        let mut s = hsum_ps(_mm256_add_ps(acc[0], acc[1]));
        while i < n {
            s += read_unaligned(x.add(i)) * read_unaligned(y.add(i));
            i += 1;
        }
        s
    }
}

/// `y += a * x` with f16 `x`.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let n = x.len().min(y.len());
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            let xv = _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().add(i) as *const __m128i));
            let yp = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(yp, _mm256_fmadd_ps(av, xv, _mm256_loadu_ps(yp)));
            i += 8;
        }
        for j in i..n {
            y[j] = a.mul_add(x[j].to_f32(), y[j]);
        }
    }
}

/// `x = f32(f16(x * scale))` in place ([`scalar::scale_round_f16`]): F16C
/// rounds to nearest-even, as the scalar conversion does.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn scale_round_f16(x: &mut [f32], scale: f32) {
    let s = _mm256_set1_ps(scale);
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` holds 8 floats.
        unsafe {
            let v = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), s);
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm256_storeu_ps(c.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    }
    scalar::scale_round_f16(chunks.into_remainder(), scale);
}

/// ggml's `expf` on 8 lanes: `(j, n)` of [`scalar::exp_parts`].
///
/// # Safety
/// AVX2 and FMA must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn exp_parts8(x: __m256) -> (__m256, __m256) {
    use scalar::exp_consts::*;
    let c = |b: u32| _mm256_set1_ps(f32::from_bits(b));
    let z = _mm256_fmadd_ps(x, c(LOG2E), c(SHIFTER));
    let n = _mm256_sub_ps(z, c(SHIFTER));
    let b = _mm256_fnmadd_ps(n, c(LN2_LO), _mm256_fnmadd_ps(n, c(LN2_HI), x));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(c(C5), b, c(C4)),
            u,
            _mm256_fmadd_ps(c(C3), b, c(C2)),
        ),
        u,
        _mm256_fmadd_ps(c(C1), b, _mm256_set1_ps(1.0)),
    );
    (j, n)
}

/// ggml's `expf` on 8 values at `p`, in place: `j * 2^n` through the
/// exponent bits when every result is normal, else lane by lane.
///
/// # Safety
/// AVX2 and FMA must be available; `p` valid for 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp8_in_place(p: *mut f32) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let (j, n) = exp_parts8(_mm256_loadu_ps(p));
        // j lies in (0.5, 2), so n in [-125, 127] keeps j * 2^n normal and exact.
        let in_range = _mm256_and_ps(
            _mm256_cmp_ps(n, _mm256_set1_ps(-125.0), _CMP_GE_OQ),
            _mm256_cmp_ps(n, _mm256_set1_ps(127.0), _CMP_LE_OQ),
        );
        if _mm256_movemask_ps(in_range) == 0xFF {
            let bits = _mm256_slli_epi32(
                _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                23,
            );
            _mm256_storeu_ps(p, _mm256_mul_ps(j, _mm256_castsi256_ps(bits)));
            return;
        }
        let (mut js, mut ns) = ([0.0f32; 8], [0.0f32; 8]);
        _mm256_storeu_ps(js.as_mut_ptr(), j);
        _mm256_storeu_ps(ns.as_mut_ptr(), n);
        for k in 0..8 {
            *p.add(k) = if ns[k].abs() > 192.0 {
                if ns[k] <= 0.0 {
                    0.0
                } else {
                    f32::INFINITY
                }
            } else {
                scalar::scale_pow2(js[k], ns[k])
            };
        }
    }
}

/// ggml's `expf` in place (same bits as [`scalar::exp_ggml_in_place`]).
///
/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn exp_ggml(x: &mut [f32]) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            exp8_in_place(c.as_mut_ptr());
        }
        let rest = chunks.into_remainder();
        let mut tail = [0.0f32; 8];
        tail[..rest.len()].copy_from_slice(rest);
        exp8_in_place(tail.as_mut_ptr());
        let n = rest.len();
        rest.copy_from_slice(&tail[..n]);
    }
}

/// `gate = silu(gate) * up` (same bits as [`scalar::swiglu_ggml`]).
///
/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn swiglu_ggml(gate: &mut [f32], up: &[f32]) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let n = gate.len().min(up.len());
        let mut e = [0.0f32; 8];
        let mut i = 0;
        while i < n {
            let m = (n - i).min(8);
            let (mut g, mut u) = ([0.0f32; 8], [0.0f32; 8]);
            g[..m].copy_from_slice(&gate[i..i + m]);
            u[..m].copy_from_slice(&up[i..i + m]);
            let gv = _mm256_loadu_ps(g.as_ptr());
            _mm256_storeu_ps(e.as_mut_ptr(), _mm256_sub_ps(_mm256_setzero_ps(), gv));
            exp8_in_place(e.as_mut_ptr());
            let silu = _mm256_div_ps(
                gv,
                _mm256_add_ps(_mm256_set1_ps(1.0), _mm256_loadu_ps(e.as_ptr())),
            );
            _mm256_storeu_ps(
                g.as_mut_ptr(),
                _mm256_mul_ps(silu, _mm256_loadu_ps(u.as_ptr())),
            );
            gate[i..i + m].copy_from_slice(&g[..m]);
            i += m;
        }
    }
}

/// Largest magnitude of 32 floats.
///
/// # Safety
/// AVX2; `x` readable for 32 floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn absmax32(x: *const f32) -> f32 {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for k in 0..4 {
            // Operand order makes a NaN element lose, as in the scalar fold.
            m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x.add(8 * k))), m);
        }
        let s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_max_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

/// Packs 4 x 8 i32 (each in i8 range) into 32 bytes in element order.
///
/// # Safety
/// AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_i32x32_to_i8(v: [__m256i; 4]) -> __m256i {
    let p01 = _mm256_packs_epi32(v[0], v[1]);
    let p23 = _mm256_packs_epi32(v[2], v[3]);
    let p = _mm256_packs_epi16(p01, p23);
    _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Quantizes one 32-element block with scale inverse `id`; returns the
/// packed quants and their sum.
///
/// # Safety
/// AVX2; `x` readable for 32 floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_block32(x: *const f32, id: f32) -> (__m256i, i32) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        let idv = _mm256_set1_ps(id);
        let mut q = [_mm256_setzero_si256(); 4];
        let mut sum = _mm256_setzero_si256();
        for (k, qk) in q.iter_mut().enumerate() {
            let v = _mm256_mul_ps(_mm256_loadu_ps(x.add(8 * k)), idv);
            *qk = _mm256_cvtps_epi32(_mm256_round_ps::<_MM_FROUND_TO_NEAREST_INT>(v));
            sum = _mm256_add_epi32(sum, *qk);
        }
        (pack_i32x32_to_i8(q), hsum_epi32(sum))
    }
}

/// Q8_0 activation quantization (same bits as the scalar reference).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        for (xb, yb) in x.chunks_exact(QK32).zip(out.iter_mut()) {
            let (d, id) = scalar::q8_scale(absmax32(xb.as_ptr()));
            let (q, _) = quantize_block32(xb.as_ptr(), id);
            _mm256_storeu_si256(yb.qs.as_mut_ptr() as *mut __m256i, q);
            yb.d = f16::from_f32(d).to_le_bytes();
        }
    }
}

/// Q8_1 activation quantization (same bits as the scalar reference).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        for (xb, yb) in x.chunks_exact(QK32).zip(out.iter_mut()) {
            let (d, id) = scalar::q8_scale(absmax32(xb.as_ptr()));
            let (q, sum) = quantize_block32(xb.as_ptr(), id);
            _mm256_storeu_si256(yb.qs.as_mut_ptr() as *mut __m256i, q);
            yb.d = f16::from_f32(d).to_le_bytes();
            yb.s = f16::from_f32(sum as f32 * d).to_le_bytes();
        }
    }
}

/// Q8_K activation quantization (same bits as the scalar reference).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    // SAFETY: the body needs only what callers of this `unsafe fn` promise
    // (the file's rule above, and its `# Safety` section if it has one).
    unsafe {
        for (xb, yb) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
            let mut amax = 0.0f32;
            for k in 0..QK_K / 32 {
                amax = amax.max(absmax32(xb.as_ptr().add(32 * k)));
            }
            if amax == 0.0 {
                *yb = bytemuck::Zeroable::zeroed();
                continue;
            }
            // The first element whose magnitude is the maximum gives the sign.
            let max = xb.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax);
            let iscale = -127.0 / max;
            let isv = _mm256_set1_ps(iscale);
            let cap = _mm256_set1_epi32(127);
            for k in 0..QK_K / 32 {
                let mut q = [_mm256_setzero_si256(); 4];
                for (j, qj) in q.iter_mut().enumerate() {
                    let v = _mm256_mul_ps(isv, _mm256_loadu_ps(xb.as_ptr().add(32 * k + 8 * j)));
                    let r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    *qj = _mm256_min_epi32(_mm256_cvtps_epi32(r), cap);
                }
                _mm256_storeu_si256(
                    yb.qs.as_mut_ptr().add(32 * k) as *mut __m256i,
                    pack_i32x32_to_i8(q),
                );
            }
            scalar::fill_q8k_bsums(yb);
            yb.d = (1.0 / iscale).to_le_bytes();
        }
    }
}
