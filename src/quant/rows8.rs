//! Short batches (decode steps, speculative verification passes, chunks
//! below the row-group kernels' threshold) for the 32-element block
//! formats on AVX-512 VNNI: 8 rows at a time, unpacked in registers.
//!
//! The one-row kernels spend most of a block on work that does not depend
//! on the token (unpacking the quants, widening the scales) and give each
//! `vpdpbusd` one row. Here a block's 8 rows are unpacked once, two rows
//! per 512-bit vector (biased unsigned quants as in `gemm_blocks32`, the
//! lanes started at `-bias` times the activation sums), and serve up to
//! [`TOKENS`] tokens, so a token costs one `vpdpbusd` per pair of rows.
//! Nothing is written to memory in between, so even one token gains.
//!
//! The lanes are the scalar reference's exact integers and the float steps
//! per lane are its own (`fma` with `d_w * d_a` per block, `hsum8`, then the
//! `m * s` sum for formats with a minimum), so every output has the bits
//! `vec_dot` returns for its pair.

#![allow(clippy::missing_safety_doc)] // the `# Safety` of each function is stated below

use std::arch::x86_64::*;
use std::ptr::{addr_of, read_unaligned};

use super::avx2::f16_one;
use super::avx512::{load_x2, unpack_nibbles_x2};
use super::blocks::{
    BlockIQ4NL, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, KVALUES_IQ4NL,
};
use super::gemm_blocks32::{lane_starts, Act32, Weights32};
use super::scalar::hsum8;
use super::{prefetch_bytes, CacheLevel};

/// Rows per call: as many as a row group of `gemm_blocks32`.
pub(crate) const ROWS: usize = 8;
const _: () = assert!(ROWS == super::gemm_blocks32::GROUP);
/// Pairs of rows, one pair per 512-bit vector.
const PAIRS: usize = ROWS / 2;
/// Tokens per register tile: 4 pairs of rows times 4 tokens of 16-lane
/// accumulators, the unpacked quants and scales of the block beside them.
const TOKENS: usize = 4;
const _: () = assert!(super::dispatch::TILE.is_multiple_of(TOKENS));

/// The most bytes of next rows prefetched into the first-level cache (half
/// of a 32 KiB one: the rows in use need the rest). Beyond it the second
/// level measured faster, more lines than the first holds beside the rows
/// in use being asked for: on a Zen 4 machine the 1B-shape Q8_0
/// (8 rows of 17 or 70 KiB) decoded at 23.6-27.5 tokens/s with its
/// prefetches sent to the second level against 18.1-18.9 to the first,
/// while Gemma 3 270M (8 rows of at most 6 KiB) ran at 114-122 to the
/// first against 95-101 to the second (`inferd bench -t 2 --gen-tokens
/// 128`, alternating).
const L1_PREFETCH_MAX_BYTES: usize = 16 * 1024;

/// A 32-element weight format whose blocks unpack in registers.
pub(crate) trait InRegisters: Weights32 {
    /// The biased quants (see [`Weights32::BIAS`]) of two blocks: the first
    /// in bytes `0..32`, the second in `32..64`, element order.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F, BW, VL, VNNI and DQ; both pointers
    /// must be readable for one block.
    unsafe fn quants_x2(b0: *const Self, b1: *const Self) -> __m512i;

    /// The f16 bits of the scale (low half) and the minimum (high half, 0
    /// without one).
    ///
    /// # Safety
    /// `b` must be readable for one block.
    unsafe fn scale_bits(b: *const Self) -> u32;
}

/// The scale's bits alone: formats whose block opens with `d` and has no
/// minimum.
///
/// # Safety
/// `p` must be readable for 2 bytes.
#[inline(always)]
unsafe fn d_only(p: *const u8) -> u32 {
    // SAFETY: forwarded from the caller.
    u16::from_le_bytes(unsafe { read_unaligned(p as *const [u8; 2]) }) as u32
}

/// `d` and `m` side by side: formats whose block opens with both.
///
/// # Safety
/// `p` must be readable for 4 bytes.
#[inline(always)]
unsafe fn d_and_m(p: *const u8) -> u32 {
    // SAFETY: forwarded from the caller.
    u32::from_le_bytes(unsafe { read_unaligned(p as *const [u8; 4]) })
}

/// Sets element `i`'s fifth bit (bit 4) where bit `i` of the block's `qh`
/// is set, for two blocks (`qh0` for bytes `0..32`).
///
/// # Safety
/// The CPU must support AVX-512 F and BW.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn with_fifth_bits(q: __m512i, qh0: [u8; 4], qh1: [u8; 4]) -> __m512i {
    let bits = u32::from_le_bytes(qh0) as u64 | (u32::from_le_bytes(qh1) as u64) << 32;
    _mm512_mask_add_epi8(q, bits, q, _mm512_set1_epi8(16))
}

/// The packed quants of block pointer `b`.
macro_rules! qs {
    ($b:ident) => {
        addr_of!((*$b).qs) as *const u8
    };
}

/// Implements [`InRegisters`] for `$block`: `$quants` makes the biased
/// quants of blocks `$b0` and `$b1`, `$scales` reads a block's scale bits.
macro_rules! in_registers {
    ($block:ty, $scales:ident, |$b0:ident, $b1:ident| $quants:expr) => {
        impl InRegisters for $block {
            #[inline]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")]
            unsafe fn quants_x2($b0: *const Self, $b1: *const Self) -> __m512i {
                // SAFETY: forwarded from the caller.
                unsafe { $quants }
            }
            #[inline(always)]
            unsafe fn scale_bits(b: *const Self) -> u32 {
                // SAFETY: forwarded from the caller.
                unsafe { $scales(b as *const u8) }
            }
        }
    };
}

in_registers!(BlockQ4_0, d_only, |b0, b1| unpack_nibbles_x2(
    qs!(b0),
    qs!(b1)
));
in_registers!(BlockQ4_1, d_and_m, |b0, b1| unpack_nibbles_x2(
    qs!(b0),
    qs!(b1)
));
in_registers!(BlockQ5_0, d_only, |b0, b1| with_fifth_bits(
    unpack_nibbles_x2(qs!(b0), qs!(b1)),
    (*b0).qh,
    (*b1).qh
));
in_registers!(BlockQ5_1, d_and_m, |b0, b1| with_fifth_bits(
    unpack_nibbles_x2(qs!(b0), qs!(b1)),
    (*b0).qh,
    (*b1).qh
));
in_registers!(BlockQ8_0, d_only, |b0, b1| _mm512_xor_si512(
    load_x2(qs!(b0), qs!(b1)),
    _mm512_set1_epi8(-128)
));

/// IQ4_NL's values plus 128, as the kernel's unsigned quants.
const IQ4NL_BIASED: [u8; 16] = {
    let mut out = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        out[i] = (KVALUES_IQ4NL[i] as i16 + 128) as u8;
        i += 1;
    }
    out
};

in_registers!(BlockIQ4NL, d_only, |b0, b1| _mm512_shuffle_epi8(
    _mm512_broadcast_i32x4(_mm_loadu_si128(IQ4NL_BIASED.as_ptr() as *const __m128i)),
    unpack_nibbles_x2(qs!(b0), qs!(b1))
));

/// Rows `0..8` (row `r` at `w + r * stride`, `nb` blocks of `W`) times the
/// `NT` activation rows `a` (`nb` blocks each): `out[t][r]`, the bits of
/// `vec_dot` for each pair. With `prefetch`, the next 8 rows' bytes are
/// asked for, a few lines per block (see [`tile`]).
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2, FMA and F16C;
/// every row and activation pointer must be readable for `nb` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn rows8<W: InRegisters, const NT: usize>(
    nb: usize,
    w: *const u8,
    stride: usize,
    a: [*const u8; NT],
    prefetch: bool,
) -> [[f32; ROWS]; NT] {
    let a = a.map(|p| p as *const W::Act);
    if NT <= TOKENS {
        // SAFETY: forwarded from the caller.
        return unsafe { tile::<W, NT>(nb, w, stride, a, prefetch) };
    }
    let mut out = [[0.0f32; ROWS]; NT];
    // Tiles of TOKENS tokens (NT is the tiled path's TILE here); only the
    // first finds the rows uncached.
    for (i, (o, t)) in out.chunks_mut(TOKENS).zip(a.chunks(TOKENS)).enumerate() {
        let t: [*const W::Act; TOKENS] = t.try_into().expect("NT is a multiple of TOKENS");
        // SAFETY: forwarded from the caller.
        o.copy_from_slice(&unsafe { tile::<W, TOKENS>(nb, w, stride, t, prefetch && i == 0) });
    }
    out
}

/// [`rows8`] for at most [`TOKENS`] tokens.
///
/// The prefetch spreads the next 8 rows' cache lines evenly over the
/// blocks: the rows are contiguous, and asking for all of them at once
/// stalls on the cache's outstanding-miss limit when 8 rows are read at a
/// time. They go to the first-level cache when they fit beside the rows in
/// use ([`L1_PREFETCH_MAX_BYTES`]), else to the second.
///
/// # Safety
/// As [`rows8`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn tile<W: InRegisters, const T: usize>(
    nb: usize,
    w: *const u8,
    stride: usize,
    a: [*const W::Act; T],
    prefetch: bool,
) -> [[f32; ROWS]; T] {
    let next = w.wrapping_add(ROWS * stride);
    let lines = (ROWS * stride).div_ceil(64);
    let level = if ROWS * stride <= L1_PREFETCH_MAX_BYTES {
        CacheLevel::L1
    } else {
        CacheLevel::L2
    };
    let per_block = if prefetch {
        lines.div_ceil(nb.max(1))
    } else {
        0
    };
    // Lane indices into [d0, m0, d1, m1, ...]: pair p's scales (each row's
    // `d` on its 8 lanes) and the 8 minimums.
    let pair_d: [__m512i; 4] = std::array::from_fn(|p| {
        let (r0, r1) = (4 * p as i32, 4 * p as i32 + 2);
        _mm512_setr_epi32(
            r0, r0, r0, r0, r0, r0, r0, r0, r1, r1, r1, r1, r1, r1, r1, r1,
        )
    });
    let mins = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0);
    let rows: [*const W; ROWS] = std::array::from_fn(|r| w.wrapping_add(r * stride) as *const W);
    let mut acc = [[_mm512_setzero_ps(); 4]; T];
    let mut min_acc = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        for i in b * per_block..((b + 1) * per_block).min(lines) {
            prefetch_bytes(next.wrapping_add(64 * i), 64, level);
        }
        // SAFETY: the caller promises the features and `nb` readable
        // blocks behind every row and activation pointer.
        unsafe {
            let blocks = rows.map(|r| r.add(b));
            let bits = blocks.map(|p| W::scale_bits(p) as i32);
            let scales = _mm512_cvtph_ps(_mm256_setr_epi32(
                bits[0], bits[1], bits[2], bits[3], bits[4], bits[5], bits[6], bits[7],
            ));
            let q: [__m512i; 4] =
                std::array::from_fn(|p| W::quants_x2(blocks[2 * p], blocks[2 * p + 1]));
            let d: [__m512; 4] = std::array::from_fn(|p| _mm512_permutexvar_ps(pair_d[p], scales));
            let m = _mm512_castps512_ps256(_mm512_permutexvar_ps(mins, scales));
            for t in 0..T {
                block_step::<W>(&mut acc[t], &mut min_acc[t], (&q, &d, m), &*a[t].add(b));
            }
        }
    }
    let mut out = [[0.0f32; ROWS]; T];
    for ((out, acc), min_acc) in out.iter_mut().zip(&acc).zip(&min_acc) {
        // SAFETY: the caller promises the features.
        *out = unsafe { finish_rows::<W>(acc, *min_acc) };
    }
    out
}

/// One block of one token against the 8 rows: the pairs' biased quants,
/// scales (each row's on its 8 lanes) and the rows' minimums, into the
/// token's lane and minimum accumulators.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn block_step<W: Weights32>(
    acc: &mut [__m512; PAIRS],
    min_acc: &mut __m256,
    (w, d, m): (&[__m512i; PAIRS], &[__m512; PAIRS], __m256),
    yb: &W::Act,
) {
    // SAFETY: the caller promises the features; every read goes through
    // a reference.
    unsafe {
        let act = _mm256_loadu_si256(yb.qs().as_ptr() as *const __m256i);
        let start = _mm512_broadcast_i64x4(lane_starts::<W>(act));
        let act = _mm512_broadcast_i64x4(act);
        let dy = _mm512_broadcastss_ps(f16_one(yb.d_bits()));
        for p in 0..PAIRS {
            let lanes = _mm512_dpbusd_epi32(start, w[p], act);
            let dd = _mm512_mul_ps(d[p], dy);
            acc[p] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(lanes), acc[p]);
        }
        if <W::Act as Act32>::HAS_MIN {
            *min_acc = _mm256_fmadd_ps(m, _mm256_broadcastss_ps(f16_one(yb.s_bits())), *min_acc);
        }
    }
}

/// The 8 rows' outputs of one token from the pairs' lane accumulators and
/// the rows' minimum sums: `hsum8` of each row's lanes, then its `m * s`
/// sum for the formats with a minimum (the scalar reference's last steps).
///
/// # Safety
/// The CPU must support AVX-512 F and AVX.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn finish_rows<W: Weights32>(acc: &[__m512; PAIRS], min_acc: __m256) -> [f32; ROWS] {
    let mut mins = [0.0f32; ROWS];
    let mut lanes = [0.0f32; ROWS * 8];
    // SAFETY: both arrays hold what is stored; the caller promises the
    // features.
    unsafe {
        _mm256_storeu_ps(mins.as_mut_ptr(), min_acc);
        for (p, pair) in acc.iter().enumerate() {
            _mm512_storeu_ps(lanes[16 * p..].as_mut_ptr(), *pair);
        }
    }
    let mut out = [0.0f32; ROWS];
    for (row, (o, l)) in out.iter_mut().zip(lanes.chunks_exact(8)).enumerate() {
        let l: &[f32; 8] = l.try_into().expect("8 lanes");
        *o = if <W::Act as Act32>::HAS_MIN {
            hsum8(l) + mins[row]
        } else {
            hsum8(l)
        };
    }
    out
}
