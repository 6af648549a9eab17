//! Q4_K and Q6_K × Q8_K prefill with two weight rows per 512-bit vector
//! (AVX-512), in the one-row kernels' (llama.cpp's `vec_dot`) order.
//!
//! The one-row kernels unpack a row's quants and scales for every tile of
//! tokens and spend, per token and super-block, a dozen instructions on
//! the minimum or offset term and the float steps besides their
//! multiply-adds. Here a group of 8 rows is unpacked once per call, two rows
//! side by side, so each run of 32 quants is one `vpmaddubsw` (byte pairs
//! of both rows) and one `vpdpwssd` (the pairs times each row's scales,
//! summed into the 8 four-element lanes of both rows), and the float steps,
//! minimum and offset terms included, serve two rows per instruction.
//! (`vpdpbusd` for the lanes and then a scaling `vpdpwssd` measured slower
//! on Zen 4.)
//!
//! Lane `j` of a row is the exact integer of the scalar reference
//! (`scalar::k_lanes`, and for Q6_K minus `scalar::q6k_lanes`' offset); the
//! Q4_K minimum lanes are `scalar::k4_min_lanes`; the float steps and the
//! final sums are `scalar::dot_q4_k_q8_k`'s and `scalar::dot_q6_k_q8_k`'s.
//! So every output has the bits `vec_dot` returns for its pair.

#![allow(clippy::missing_safety_doc)] // the `# Safety` of each function is stated below

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::avx2::{q6k_runs, sub_block_sums};
use super::blocks::{scales_mins_k4, BlockQ4K, BlockQ6K, BlockQ8K};
use super::dispatch::TILE;
use super::scalar::{hsum4, hsum8};

/// Rows unpacked together (4 pairs).
pub(crate) const GROUP: usize = 8;
const PAIRS: usize = GROUP / 2;
/// Tokens per register tile of one pair: quant, float and minimum
/// accumulators for 8 tokens (measured against 4 pairs x 2 tokens and
/// 2 x 4: each tile streams its pair's unpacked super-blocks from L2, so
/// more tokens per tile means less of that, and fewer live vectors less
/// spilling).
const TOKENS: usize = 8;
const _: () = assert!(TILE.is_multiple_of(TOKENS));

/// One super-block of a pair of rows: the first row in bytes and lanes
/// 0..8 of each vector (0..4 of the minimum ones), the second above.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct PairBlock {
    /// `q[r]`: run `r` (quants `32r..32r + 32`) of each row, unsigned.
    q: [[u8; 64]; 8],
    /// `scale[r]`: the scale of each byte pair of run `r` (each byte-pair
    /// sum is scaled, then two of them summed into a lane).
    scale: [[i16; 32]; 8],
    /// Each row's super-block scale, on its 8 lanes.
    d: [f32; 16],
    /// Q4_K: the 8 sub-block minimums of each row (16 values). Q6_K: the 16
    /// sub-block scales of each row, for the offset term.
    extra: [i16; 32],
    /// Q4_K: each row's minimum scale, on its 4 minimum lanes.
    dmin: [f32; 8],
}

// The kernel's aligned loads rely on these offsets.
const _: () = assert!(std::mem::offset_of!(PairBlock, scale) % 64 == 0);
const _: () = assert!(std::mem::offset_of!(PairBlock, d) % 64 == 0);
const _: () = assert!(std::mem::offset_of!(PairBlock, extra) % 64 == 0);
const _: () = assert!(std::mem::offset_of!(PairBlock, dmin) % 32 == 0);

const EMPTY: PairBlock = PairBlock {
    q: [[0; 64]; 8],
    scale: [[0; 32]; 8],
    d: [0.0; 16],
    extra: [0; 32],
    dmin: [0.0; 8],
};

thread_local! {
    /// The unpacked group (`[super-block][pair]`), reused across calls so
    /// that prefill does not allocate per matrix.
    static SCRATCH: RefCell<Vec<PairBlock>> = const { RefCell::new(Vec::new()) };
}

/// A K-quant super-block format the pair kernel handles.
pub(crate) trait KPairs: bytemuck::Pod {
    /// Q4_K's minimum term (a second accumulator) rather than Q6_K's
    /// offset (subtracted from the integer lanes).
    const HAS_MIN: bool;
    /// Writes this super-block as row `half` (0 or 1) of `pb`.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    unsafe fn unpack(&self, pb: &mut PairBlock, half: usize);
}

/// `run` (32 unsigned quants) as row `half` of run `r` of `pb`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_run(pb: &mut PairBlock, r: usize, half: usize, run: __m256i) {
    // SAFETY: `pb.q[r]` holds 64 bytes and `32 * half` is 0 or 32.
    unsafe { _mm256_storeu_si256(pb.q[r][32 * half..].as_mut_ptr() as *mut __m256i, run) }
}

impl KPairs for BlockQ4K {
    const HAS_MIN: bool = true;
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(&self, pb: &mut PairBlock, half: usize) {
        let mask = _mm256_set1_epi8(0x0F);
        for c in 0..4 {
            // SAFETY: `qs` holds 128 bytes; the caller promises AVX2.
            unsafe {
                let bits = _mm256_loadu_si256(self.qs.as_ptr().add(32 * c) as *const __m256i);
                store_run(pb, 2 * c, half, _mm256_and_si256(bits, mask));
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), mask);
                store_run(pb, 2 * c + 1, half, hi);
            }
        }
        let (sc, mn) = scales_mins_k4(&self.scales);
        for (r, &s) in sc.iter().enumerate() {
            pb.scale[r][16 * half..16 * half + 16].fill(s as i16);
        }
        for (j, &m) in mn.iter().enumerate() {
            pb.extra[8 * half + j] = m as i16;
        }
        pb.d[8 * half..8 * half + 8].fill(self.d());
        pb.dmin[4 * half..4 * half + 4].fill(self.dmin());
    }
}

impl KPairs for BlockQ6K {
    const HAS_MIN: bool = false;
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(&self, pb: &mut PairBlock, half: usize) {
        // SAFETY: the caller promises AVX2, FMA and F16C.
        let (q, _, _) = unsafe { q6k_runs(self) };
        for (r, run) in q.into_iter().enumerate() {
            // SAFETY: the caller promises AVX2.
            unsafe { store_run(pb, r, half, run) };
        }
        for r in 0..8 {
            let (lo, hi) = (self.scales[2 * r] as i8, self.scales[2 * r + 1] as i8);
            pb.scale[r][16 * half..16 * half + 8].fill(lo as i16);
            pb.scale[r][16 * half + 8..16 * half + 16].fill(hi as i16);
        }
        for (j, &s) in self.scales.iter().enumerate() {
            pb.extra[16 * half + j] = s as i8 as i16;
        }
        pb.d[8 * half..8 * half + 8].fill(self.d());
    }
}

/// Unpacks rows `w[0..8]` (each `nb` super-blocks) into `pairs`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_group<K: KPairs>(w: &[K], nb: usize, pairs: &mut [PairBlock]) {
    for b in 0..nb {
        for row in 0..GROUP {
            // SAFETY: the caller promises AVX2.
            unsafe { w[row * nb + b].unpack(&mut pairs[b * PAIRS + row / 2], row % 2) };
        }
    }
}

/// The pair `pair` times [`TOKENS`] tokens (`y[t]`: each token's
/// super-blocks): `out[t]` holds the pair's two rows.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2, FMA and F16C; each
/// `y[t]` must be readable for `pairs.len() / PAIRS` super-blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn pair_tile<K: KPairs>(
    pairs: &[PairBlock],
    pair: usize,
    y: [*const BlockQ8K; TOKENS],
) -> [[f32; 2]; TOKENS] {
    // SAFETY: the caller promises the CPU features and that every token's
    // pointer covers the group's super-blocks; all other reads go through
    // references.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); TOKENS];
        let mut acc_min = [_mm256_setzero_ps(); TOKENS];
        for (b, pb) in pairs.iter().skip(pair).step_by(PAIRS).enumerate() {
            let yb = y.map(|p| &*p.add(b));
            let mut quant = [_mm512_setzero_si512(); TOKENS];
            for r in 0..8 {
                let w = _mm512_load_si512(pb.q[r].as_ptr() as *const __m512i);
                let scale = _mm512_load_si512(pb.scale[r].as_ptr() as *const __m512i);
                for t in 0..TOKENS {
                    let act = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        yb[t].qs.as_ptr().add(32 * r) as *const __m256i,
                    ));
                    let pairs = _mm512_maddubs_epi16(w, act);
                    quant[t] = _mm512_dpwssd_epi32(quant[t], pairs, scale);
                }
            }
            let d = _mm512_load_ps(pb.d.as_ptr());
            let extra = _mm512_load_si512(pb.extra.as_ptr() as *const __m512i);
            for t in 0..TOKENS {
                let dy = yb[t].d();
                let dd = _mm512_mul_ps(d, _mm512_set1_ps(dy));
                if K::HAS_MIN {
                    acc[t] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(quant[t]), acc[t]);
                    let min = _mm512_castsi512_si256(extra);
                    let m = _mm256_cvtepi32_ps(_mm256_madd_epi16(
                        min,
                        _mm256_broadcastsi128_si256(sub_block_sums(yb[t])),
                    ));
                    let dmin = _mm256_mul_ps(_mm256_set1_ps(-dy), _mm256_load_ps(pb.dmin.as_ptr()));
                    acc_min[t] = _mm256_fmadd_ps(dmin, m, acc_min[t]);
                } else {
                    // The -32 of every quant, per lane: 32 times the scaled
                    // 16-element activation sums of the lane's two groups.
                    let bsums = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        yb[t].bsums.as_ptr() as *const __m256i
                    ));
                    let offset = _mm512_slli_epi32::<5>(_mm512_madd_epi16(bsums, extra));
                    let lanes = _mm512_sub_epi32(quant[t], offset);
                    acc[t] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(lanes), acc[t]);
                }
            }
        }
        let mut out = [[0.0f32; 2]; TOKENS];
        for ((out, acc), acc_min) in out.iter_mut().zip(&acc).zip(&acc_min) {
            let mut l = [0.0f32; 16];
            let mut m = [0.0f32; 8];
            _mm512_storeu_ps(l.as_mut_ptr(), *acc);
            _mm256_storeu_ps(m.as_mut_ptr(), *acc_min);
            for (half, o) in out.iter_mut().enumerate() {
                let l: &[f32; 8] = l[8 * half..][..8].try_into().expect("8 lanes");
                let m: &[f32; 4] = m[4 * half..][..4].try_into().expect("4 lanes");
                *o = if K::HAS_MIN {
                    hsum8(l) + hsum4(m)
                } else {
                    hsum8(l)
                };
            }
        }
        out
    }
}

/// Rows `0..groups * 8` of `w` (`nb` super-blocks of `K` each) times tokens
/// `0..tiles * TILE` of `acts` (rows of `nb` Q8_K blocks): writes
/// `out[t * out_stride + r]`, the bits of `vec_dot` for each pair.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2, FMA and F16C.
/// `w` must hold `groups * 8 * nb` blocks, `acts` `tiles * TILE * nb`, and
/// `out` at least `(tiles * TILE - 1) * out_stride + groups * 8` values.
pub(crate) unsafe fn matmul<K: KPairs>(
    nb: usize,
    w: &[u8],
    groups: usize,
    acts: &[u8],
    tiles: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let w: &[K] = bytemuck::cast_slice(w);
    let acts: &[BlockQ8K] = bytemuck::cast_slice(acts);
    SCRATCH.with_borrow_mut(|pairs| {
        pairs.resize(nb * PAIRS, EMPTY);
        for gi in 0..groups {
            // SAFETY: the caller promises the features.
            unsafe { unpack_group(&w[gi * GROUP * nb..(gi + 1) * GROUP * nb], nb, pairs) };
            for t0 in (0..tiles * TILE).step_by(TOKENS) {
                let y = std::array::from_fn(|t| acts[(t0 + t) * nb..].as_ptr());
                for pair in 0..PAIRS {
                    // SAFETY: the caller promises the features; each `y[t]`
                    // points at the `nb` super-blocks of one token.
                    let res = unsafe { pair_tile::<K>(pairs, pair, y) };
                    for (t, rows) in res.iter().enumerate() {
                        let at = (t0 + t) * out_stride + gi * GROUP + 2 * pair;
                        out[at..at + 2].copy_from_slice(rows);
                    }
                }
            }
        }
    });
}
