//! Q4_K × Q8_K prefill with two weight rows per 512-bit vector (AVX-512
//! VNNI), in the one-row kernels' (llama.cpp's `vec_dot`) order.
//!
//! The one-row kernel unpacks a row's nibbles and scales for every tile of
//! tokens and spends, per token and super-block, a dozen instructions on
//! the minimum term and the float steps besides its multiply-adds. Here a
//! group of 8 rows is unpacked once per call, two rows side by side, so each
//! run of 32 quants is one `vpmaddubsw` (byte pairs of both rows) and one
//! `vpdpwssd` (the pairs times each row's run scale, summed into the 8
//! four-element lanes of both rows), and the float steps, minimum terms
//! included, serve two rows per instruction. (`vpdpbusd` for the lanes and
//! then a scaling `vpdpwssd` measured slower on Zen 4.)
//!
//! Lane `j` of a row is `Σ_run scale · (4-element sum j of the run)`, the
//! exact integer of the scalar reference (`scalar::k_lanes`); the minimum
//! lanes are `scalar::k4_min_lanes`; the float steps and the final
//! `hsum8 + hsum4` are `scalar::dot_q4_k_q8_k`'s. So every output has the
//! bits `vec_dot` returns for its pair.

#![allow(clippy::missing_safety_doc)] // the `# Safety` of each function is stated below

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::blocks::{scales_mins_k4, BlockQ4K, BlockQ8K};
use super::dispatch::TILE;
use super::scalar::{hsum4, hsum8};

/// Rows unpacked together (4 pairs).
pub(crate) const GROUP: usize = 8;
const PAIRS: usize = GROUP / 2;
/// Pairs and tokens per register tile: 1 pair x 8 tokens of quant, float
/// and minimum accumulators (measured against 4 x 2 and 2 x 4: each tile
/// streams its pairs' unpacked super-blocks from L2, so more tokens per
/// tile means less of that, and fewer live vectors less spilling).
const TILE_PAIRS: usize = 1;
const TOKENS: usize = 8;
const _: () = assert!(TILE.is_multiple_of(TOKENS));

/// One super-block of a pair of rows: the first row in bytes and lanes
/// 0..8 of each vector (0..4 of the minimum ones), the second above.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct PairBlock {
    /// `q[r]`: run `r` (quants `32r..32r + 32`) of each row, 0..16.
    q: [[u8; 64]; 8],
    /// `scale[r]`: run `r`'s scale in every i16 (each byte-pair sum is
    /// scaled, then two of them summed into a lane).
    scale: [[i16; 32]; 8],
    /// Each row's super-block scale, on its 8 lanes (64-byte aligned, as
    /// the fields before it).
    d: [f32; 16],
    /// Each row's minimum scale, on its 4 minimum lanes (32-byte aligned).
    dmin: [f32; 8],
    /// The 8 sub-block minimums of each row.
    min: [i16; 16],
}

// The kernel's aligned loads rely on these offsets.
const _: () = assert!(std::mem::offset_of!(PairBlock, scale) % 64 == 0);
const _: () = assert!(std::mem::offset_of!(PairBlock, d) % 64 == 0);
const _: () = assert!(std::mem::offset_of!(PairBlock, dmin) % 32 == 0);

const EMPTY: PairBlock = PairBlock {
    q: [[0; 64]; 8],
    scale: [[0; 32]; 8],
    d: [0.0; 16],
    dmin: [0.0; 8],
    min: [0; 16],
};

thread_local! {
    /// The unpacked group (`[super-block][pair]`), reused across calls so
    /// that prefill does not allocate per matrix.
    static SCRATCH: RefCell<Vec<PairBlock>> = const { RefCell::new(Vec::new()) };
}

/// Unpacks rows `w[0..8]` (each `nb` super-blocks) into `pairs`.
///
/// # Safety
/// The CPU must support AVX-512 F and BW.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn unpack_group(w: &[BlockQ4K], nb: usize, pairs: &mut [PairBlock]) {
    let mask = _mm256_set1_epi8(0x0F);
    for b in 0..nb {
        for row in 0..GROUP {
            let x = &w[row * nb + b];
            let pb = &mut pairs[b * PAIRS + row / 2];
            let half = row % 2;
            for c in 0..4 {
                // SAFETY: `x.qs` holds 128 bytes and `pb.q[r]` 64, so each
                // 32-byte access stays inside its array.
                unsafe {
                    let bits = _mm256_loadu_si256(x.qs.as_ptr().add(32 * c) as *const __m256i);
                    let lo = _mm256_and_si256(bits, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), mask);
                    let at = 32 * half;
                    _mm256_storeu_si256(pb.q[2 * c][at..].as_mut_ptr() as *mut __m256i, lo);
                    _mm256_storeu_si256(pb.q[2 * c + 1][at..].as_mut_ptr() as *mut __m256i, hi);
                }
            }
            let (sc, mn) = scales_mins_k4(&x.scales);
            for (r, &s) in sc.iter().enumerate() {
                for lane in 0..8 {
                    pb.scale[r][2 * (8 * half + lane)] = s as i16;
                    pb.scale[r][2 * (8 * half + lane) + 1] = s as i16;
                }
            }
            for (j, &m) in mn.iter().enumerate() {
                pb.min[8 * half + j] = m as i16;
            }
            pb.d[8 * half..8 * half + 8].fill(x.d());
            pb.dmin[4 * half..4 * half + 4].fill(x.dmin());
        }
    }
}

/// The 8 sub-block sums of a super-block's activations (its 16 group sums
/// added in pairs), in both 128-bit halves.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn sub_block_sums(y: &BlockQ8K) -> __m256i {
    // SAFETY: `bsums` holds 32 bytes.
    let bsums = unsafe { _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i) };
    let sums = _mm_hadd_epi16(
        _mm256_castsi256_si128(bsums),
        _mm256_extracti128_si256::<1>(bsums),
    );
    _mm256_broadcastsi128_si256(sums)
}

/// Pairs `first..first + TILE_PAIRS` of the group times [`TOKENS`] tokens
/// (`y[t]`: each token's super-blocks): `out[t][row]` for those pairs'
/// rows.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2 and FMA; each
/// `y[t]` must be readable for `pairs.len() / PAIRS` super-blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma")]
unsafe fn pairs_tile(
    pairs: &[PairBlock],
    first: usize,
    y: [*const BlockQ8K; TOKENS],
) -> [[f32; 2 * TILE_PAIRS]; TOKENS] {
    // SAFETY: the caller promises the CPU features and that every token's
    // pointer covers the group's super-blocks; all other reads go through
    // references.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); TILE_PAIRS]; TOKENS];
        let mut acc_min = [[_mm256_setzero_ps(); TILE_PAIRS]; TOKENS];
        for (b, group) in pairs.chunks_exact(PAIRS).enumerate() {
            let group = &group[first..first + TILE_PAIRS];
            let yb = y.map(|p| &*p.add(b));
            let mut quant = [[_mm512_setzero_si512(); TILE_PAIRS]; TOKENS];
            for r in 0..8 {
                let act = yb.map(|y| {
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        y.qs.as_ptr().add(32 * r) as *const __m256i
                    ))
                });
                for (p, pair) in group.iter().enumerate() {
                    let w = _mm512_load_si512(pair.q[r].as_ptr() as *const __m512i);
                    let scale = _mm512_load_si512(pair.scale[r].as_ptr() as *const __m512i);
                    for t in 0..TOKENS {
                        let pairs = _mm512_maddubs_epi16(w, act[t]);
                        quant[t][p] = _mm512_dpwssd_epi32(quant[t][p], pairs, scale);
                    }
                }
            }
            for t in 0..TOKENS {
                let dy = yb[t].d();
                let sums = sub_block_sums(yb[t]);
                for (p, pair) in group.iter().enumerate() {
                    let d = _mm512_mul_ps(_mm512_load_ps(pair.d.as_ptr()), _mm512_set1_ps(dy));
                    acc[t][p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(quant[t][p]), acc[t][p]);
                    let min = _mm256_loadu_si256(pair.min.as_ptr() as *const __m256i);
                    let m = _mm256_cvtepi32_ps(_mm256_madd_epi16(min, sums));
                    let dmin =
                        _mm256_mul_ps(_mm256_set1_ps(-dy), _mm256_load_ps(pair.dmin.as_ptr()));
                    acc_min[t][p] = _mm256_fmadd_ps(dmin, m, acc_min[t][p]);
                }
            }
        }
        let mut out = [[0.0f32; 2 * TILE_PAIRS]; TOKENS];
        for ((out, acc), acc_min) in out.iter_mut().zip(&acc).zip(&acc_min) {
            for (p, (lanes, mins)) in acc.iter().zip(acc_min).enumerate() {
                let mut l = [0.0f32; 16];
                let mut m = [0.0f32; 8];
                _mm512_storeu_ps(l.as_mut_ptr(), *lanes);
                _mm256_storeu_ps(m.as_mut_ptr(), *mins);
                for half in 0..2 {
                    let l: &[f32; 8] = l[8 * half..][..8].try_into().expect("8 lanes");
                    let m: &[f32; 4] = m[4 * half..][..4].try_into().expect("4 lanes");
                    out[2 * p + half] = hsum8(l) + hsum4(m);
                }
            }
        }
        out
    }
}

/// Rows `0..groups * 8` of `w` (`nb` super-blocks each) times tokens
/// `0..tiles * TILE` of `acts` (rows of `nb` Q8_K blocks): writes
/// `out[t * out_stride + r]`, the bits of `vec_dot` for each pair.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2 and FMA.
/// `w` must hold `groups * 8 * nb` blocks, `acts` `tiles * TILE * nb`, and
/// `out` at least `(tiles * TILE - 1) * out_stride + groups * 8` values.
pub(crate) unsafe fn matmul(
    nb: usize,
    w: &[u8],
    groups: usize,
    acts: &[u8],
    tiles: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let w: &[BlockQ4K] = bytemuck::cast_slice(w);
    let acts: &[BlockQ8K] = bytemuck::cast_slice(acts);
    SCRATCH.with_borrow_mut(|pairs| {
        pairs.resize(nb * PAIRS, EMPTY);
        for gi in 0..groups {
            // SAFETY: the caller promises the features.
            unsafe { unpack_group(&w[gi * GROUP * nb..(gi + 1) * GROUP * nb], nb, pairs) };
            for t0 in (0..tiles * TILE).step_by(TOKENS) {
                let y = std::array::from_fn(|t| acts[(t0 + t) * nb..].as_ptr());
                for first in (0..PAIRS).step_by(TILE_PAIRS) {
                    // SAFETY: the caller promises the features; each `y[t]`
                    // points at the `nb` super-blocks of one token.
                    let res = unsafe { pairs_tile(pairs, first, y) };
                    for (t, rows) in res.iter().enumerate() {
                        let at = (t0 + t) * out_stride + gi * GROUP + 2 * first;
                        out[at..at + rows.len()].copy_from_slice(rows);
                    }
                }
            }
        }
    });
}
