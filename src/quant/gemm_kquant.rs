//! Q4_K, Q5_K and Q6_K × Q8_K prefill on AVX-512 VNNI, in the one-row kernels'
//! (llama.cpp's `vec_dot`) order, with three integer multiplies per 128
//! quants of a row and token.
//!
//! `vec_dot`'s lane `j` is `Σ_r scale(r, j) · P(r, j)`, `P(r, j)` the exact
//! sum of quants `4j..4j + 4` of 32-quant run `r` times their activations,
//! `scale(r, j)` the sub-block scale of those quants. Here one `vpdpbusd`
//! forms the 16 `P` of two runs of one row (their four-quant groups
//! interleaved, so `P(r, j)` and `P(r + 1, j)` are neighbours),
//! `vpackssdw` narrows the vectors of two rows to 16 bits, where every `P`
//! fits (at most 4 · 63 · 128), and one `vpdpwssd` scales each neighbour
//! pair and sums it into a lane: per 128-bit lane `k`, lanes `2k, 2k + 1`
//! of the first row and then of the second, the layout the float step
//! wants, so the integer lanes of two rows need no shuffling before it.
//! Activations are interleaved the same way, 512 tokens at a time. The
//! float steps, the minimum terms (two tokens per instruction; Q5_K's
//! lanes summed exactly first) and Q6_K's `-32` offset (the lanes'
//! starting value) included, are `scalar::dot_q4_k_q8_k`'s,
//! `scalar::dot_q5_k_q8_k`'s and `scalar::dot_q6_k_q8_k`'s, two rows per
//! instruction; their scale products for a pair of rows and a tile of
//! tokens come from one multiply. Integer sums are exact in any order,
//! so every output has the bits `vec_dot` returns for its pair.

#![allow(clippy::missing_safety_doc)] // the `# Safety` of each function is stated below

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

use super::avx2::{k4_runs, q6k_runs, sub_block_sums};
use super::avx512::dpwssd;
use super::blocks::{scales_mins_k4, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};
use super::dispatch::TILE;
use super::PreparedChunk;

/// Rows unpacked together (4 pairs).
pub(crate) const GROUP: usize = 8;
const PAIRS: usize = GROUP / 2;
/// Tokens per register tile of one pair: each token needs an integer and a
/// float accumulator (and every two tokens a minimum-term one) besides the
/// pair's 12 registers of weights and scales (measured with the layout
/// before this one: 2 tokens ran as fast, 8 spilled and ran 20% slower).
const TOKENS: usize = 4;
const _: () = assert!(TILE.is_multiple_of(TOKENS));
/// Groups unpacked together: each tile of tokens, read from L2 once, serves
/// all their rows (the interleaved activations of a long batch do not fit
/// in L2).
const BLOCK_GROUPS: usize = 4;
/// Super-blocks (of 256 columns) a pair of rows and a tile of tokens take
/// at a time before the next pair: their rows, scales and activations
/// (about 2.7 KiB per super-block) stay in L1 for all pairs of the block.
/// Taking a whole row at once, a 2048 x 8192 (FFN down) product ran at
/// 1.83 ns per output and 256 weights against 1.33 for 8192 x 2048, whose
/// 8 super-blocks per row fit. The float accumulators carry over from
/// slice to slice, so each output's steps stay in super-block order.
const SLICE_BLOCKS: usize = 8;

/// One row's super-block: quants interleaved as the kernel reads them.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct RowBlock {
    /// Chunk `c` holds runs `2c` and `2c + 1` (unsigned quants), four of
    /// each in turn: bytes `8m..8m + 4` are quants `4m..4m + 4` of run
    /// `2c`, bytes `8m + 4..8m + 8` the same of run `2c + 1`.
    q: [[u8; 64]; 4],
}

/// The scales, float and minimum data of a pair of rows in one
/// super-block, laid out as the lanes the kernel forms: lanes `4k, 4k + 1`
/// are the first row's, `4k + 2, 4k + 3` the second's.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct PairScales {
    /// For chunk `c`, the scale of each 16-bit value after narrowing both
    /// rows: in 128-bit lane `k`, runs `2c, 2c + 1, 2c, 2c + 1` of the
    /// first row, then the same of the second (lanes `2k, 2k, 2k + 1,
    /// 2k + 1` of each).
    scale: [[i16; 32]; 4],
    /// In every 128-bit lane: the first row's `d`, the second's, then
    /// (Q4_K and Q5_K) their `dmin`, so that one multiply by
    /// [`TokenQuad::d`] forms every scale product of the pair and a
    /// tile's tokens.
    d_dmin: [f32; 16],
    /// Q6_K: the negated scales of the 16-quant groups `4k..4k + 4` of the
    /// first row, then of the second, in 128-bit lane `k` (against
    /// [`TokenBlock::group_sums`], for the offset term).
    neg_group_scales: [i16; 32],
    /// Q4_K and Q5_K: each row's 8 sub-block minimums.
    mins: [i16; 16],
}

/// One token's super-block: activations interleaved as [`RowBlock::q`] and
/// the 16-quant sums (its scale is in the tile's [`TokenQuad`]).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct TokenBlock {
    q: [[u8; 64]; 4],
    /// The 16 activation sums of 16 quants, groups `4k..4k + 4` twice in
    /// 128-bit lane `k`.
    group_sums: [i16; 32],
}

/// The scales of a tile's [`TOKENS`] tokens, one super-block: token `t`'s
/// on 128-bit lane `t`, so that one multiply by [`PairScales::d_dmin`]
/// forms every scale product of a pair of rows for the whole tile (laid
/// out as [`SCALE_LANES`] and [`MIN_SCALE_LANES`] read them).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct TokenQuad {
    d: [f32; 4 * TOKENS],
}

/// Two neighbouring tokens' data for the minimum term, one super-block.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct TokenPair {
    /// The first token's 8 sums of 32 quants (one per sub-block) twice,
    /// then the second's.
    sums: [i16; 32],
}

// The kernel's aligned loads rely on these offsets.
const _: () = assert!(std::mem::offset_of!(PairScales, d_dmin) % 64 == 0);
const _: () = assert!(std::mem::offset_of!(PairScales, mins) % 32 == 0);
const _: () = assert!(std::mem::offset_of!(PairScales, neg_group_scales) % 64 == 0);
const _: () = assert!(std::mem::offset_of!(TokenBlock, group_sums) % 64 == 0);

/// Where the float step of token `t` finds its scale products in the
/// product of [`PairScales::d_dmin`] and [`TokenQuad::d`] (token `t`'s
/// `d_w * d_a` on lanes `4t`, `4t + 1`, its `dmin * d_a` on `4t + 2`,
/// `4t + 3`): the pattern `[d0, d0, d1, d1]` of its lanes, in every 128-bit
/// lane.
const SCALE_LANES: [[i32; 16]; TOKENS] = {
    let mut idx = [[0; 16]; TOKENS];
    let mut t = 0;
    while t < TOKENS {
        let mut lane = 0;
        while lane < 16 {
            idx[t][lane] = (4 * t + lane % 4 / 2) as i32;
            lane += 1;
        }
        t += 1;
    }
    idx
};

/// The same for the minimum term of tokens `2i` and `2i + 1`: each row and
/// token's `dmin * d_a` on its 4 minimum lanes (the first token's rows,
/// then the second's).
const MIN_SCALE_LANES: [[i32; 16]; TOKENS / 2] = {
    let mut idx = [[0; 16]; TOKENS / 2];
    let mut i = 0;
    while i < TOKENS / 2 {
        let mut lane = 0;
        while lane < 16 {
            let (token, row) = (2 * i + lane / 8, lane / 4 % 2);
            idx[i][lane] = (4 * token + 2 + row) as i32;
            lane += 1;
        }
        i += 1;
    }
    idx
};

const EMPTY_ROW: RowBlock = RowBlock { q: [[0; 64]; 4] };
const EMPTY_PAIR: PairScales = PairScales {
    scale: [[0; 32]; 4],
    d_dmin: [0.0; 16],
    mins: [0; 16],
    neg_group_scales: [0; 32],
};
const EMPTY_TOKEN: TokenBlock = TokenBlock {
    q: [[0; 64]; 4],
    group_sums: [0; 32],
};
const EMPTY_TOKEN_QUAD: TokenQuad = TokenQuad {
    d: [0.0; 4 * TOKENS],
};
const EMPTY_TOKEN_PAIR: TokenPair = TokenPair { sums: [0; 32] };

/// Some tokens' activations interleaved for the kernel: made once per
/// matrix product and shared by its row tasks ([`prepare_chunk`],
/// [`matmul_prepared`]), or per thread by [`matmul`].
#[derive(Default)]
pub struct TokenChunk {
    /// `[token][super-block]`.
    tokens: Vec<TokenBlock>,
    /// `[token / 2][super-block]`.
    pairs: Vec<TokenPair>,
    /// `[token / TOKENS][super-block]`.
    quads: Vec<TokenQuad>,
}

impl TokenChunk {
    /// Forgets the tokens (keeping the memory).
    pub(crate) fn clear(&mut self) {
        self.tokens.clear();
        self.pairs.clear();
        self.quads.clear();
    }

    /// Whether it holds `tokens` tokens (a multiple of [`TOKENS`]) of `nb`
    /// super-blocks, as [`prepare_chunk`] leaves it.
    pub(crate) fn holds(&self, tokens: usize, nb: usize) -> bool {
        tokens.is_multiple_of(TOKENS)
            && self.tokens.len() == tokens * nb
            && self.pairs.len() == tokens / 2 * nb
            && self.quads.len() == tokens / TOKENS * nb
    }
}

/// Tokens per shared [`TokenChunk`]: a multiple of the kernel's tile of
/// tokens, small enough that a product's chunks are filled in parallel in
/// even shares.
pub(crate) const CHUNK_TOKENS: usize = 16;
const _: () = assert!(CHUNK_TOKENS.is_multiple_of(TILE));

/// Per-thread scratch, reused across calls so that prefill does not
/// allocate per matrix.
#[derive(Default)]
struct Scratch {
    /// The unpacked groups of a block: `[group][pair][super-block][row
    /// of the pair]`, so that one pair's super-blocks are read in order.
    rows: Vec<RowBlock>,
    /// `[group][pair][super-block]`.
    pairs: Vec<PairScales>,
    /// The tokens of [`matmul`], [`TOKEN_CHUNK`] at a time.
    tokens: PreparedChunk,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Interleaves two 32-byte runs four bytes at a time (the layout of
/// [`RowBlock::q`]) into `out`.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn interleave_runs(first: __m256i, second: __m256i, out: &mut [u8; 64]) {
    let lo = _mm256_unpacklo_epi32(first, second);
    let hi = _mm256_unpackhi_epi32(first, second);
    // SAFETY: `out` holds 64 bytes.
    unsafe {
        _mm256_storeu_si256(
            out.as_mut_ptr() as *mut __m256i,
            _mm256_permute2x128_si256::<0x20>(lo, hi),
        );
        _mm256_storeu_si256(
            out.as_mut_ptr().add(32) as *mut __m256i,
            _mm256_permute2x128_si256::<0x31>(lo, hi),
        );
    }
}

/// How a format's `vec_dot` adds the part of each quant's value that is
/// not its scaled quant (shared with the AMX kernel).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum MinTerm {
    /// IQ4_XS: nothing (its grid values are signed).
    None,
    /// Q6_K: the `-32` offset, inside the lanes (their starting value
    /// here).
    Offset,
    /// Q4_K: the minimums, in 4 float lanes of their own (`hsum4` at the
    /// end).
    Lanes,
    /// Q5_K: the minimums summed exactly per super-block and fused into
    /// one float.
    Scalar,
}

/// A K-quant super-block format the kernel handles.
pub(crate) trait KRuns: bytemuck::Pod {
    /// How its `vec_dot` adds the minimums or the offset.
    const MIN: MinTerm;
    /// Writes this super-block as row `rb` and as row `half` (0 or 1) of
    /// its pair's `ps`.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    unsafe fn unpack(&self, rb: &mut RowBlock, ps: &mut PairScales, half: usize);
}

/// Row `half`'s part of `ps.scale` from `scale[h][r]`, the scale of run
/// `r`'s first (`h` = 0) and second 16 quants (the same for Q4_K's
/// 32-quant sub-blocks).
#[inline(always)]
fn run_scales(ps: &mut PairScales, half: usize, scale: &[[i16; 8]; 2]) {
    for (c, out) in ps.scale.iter_mut().enumerate() {
        for (k, lane) in out.chunks_exact_mut(8).enumerate() {
            let s = &scale[k / 2][2 * c..2 * c + 2];
            lane[4 * half..4 * half + 4].copy_from_slice(&[s[0], s[1], s[0], s[1]]);
        }
    }
}

impl KRuns for BlockQ4K {
    const MIN: MinTerm = MinTerm::Lanes;
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(&self, rb: &mut RowBlock, ps: &mut PairScales, half: usize) {
        // SAFETY: the caller promises AVX2, FMA and F16C.
        unsafe {
            unpack_k4(
                &self.qs,
                None,
                &self.scales,
                (self.d(), self.dmin()),
                rb,
                ps,
                half,
            )
        }
    }
}

impl KRuns for BlockQ5K {
    const MIN: MinTerm = MinTerm::Scalar;
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(&self, rb: &mut RowBlock, ps: &mut PairScales, half: usize) {
        // SAFETY: the caller promises AVX2, FMA and F16C.
        unsafe {
            unpack_k4(
                &self.qs,
                Some(&self.qh),
                &self.scales,
                (self.d(), self.dmin()),
                rb,
                ps,
                half,
            )
        }
    }
}

/// A Q4_K super-block (`qh` none) or a Q5_K one (its fifth bits in `qh`)
/// as row `rb` and row `half` of its pair's `ps`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_k4(
    qs: &[u8; 128],
    qh: Option<&[u8; 32]>,
    scales: &[u8; 12],
    (d, dmin): (f32, f32),
    rb: &mut RowBlock,
    ps: &mut PairScales,
    half: usize,
) {
    // SAFETY: the caller promises AVX2, FMA and F16C.
    let runs = unsafe { k4_runs(qs, qh) };
    for c in 0..4 {
        // SAFETY: the caller promises AVX2.
        unsafe { interleave_runs(runs[2 * c], runs[2 * c + 1], &mut rb.q[c]) };
    }
    let (sc, mn) = scales_mins_k4(scales);
    let sc = sc.map(|s| s as i16);
    run_scales(ps, half, &[sc, sc]);
    for lane in ps.d_dmin.chunks_exact_mut(4) {
        lane[half] = d;
        lane[2 + half] = dmin;
    }
    for (j, &m) in mn.iter().enumerate() {
        ps.mins[8 * half + j] = m as i16;
    }
}

impl KRuns for BlockQ6K {
    const MIN: MinTerm = MinTerm::Offset;
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(&self, rb: &mut RowBlock, ps: &mut PairScales, half: usize) {
        // SAFETY: the caller promises AVX2, FMA and F16C.
        let (q, _, _) = unsafe { q6k_runs(self) };
        for c in 0..4 {
            // SAFETY: the caller promises AVX2.
            unsafe { interleave_runs(q[2 * c], q[2 * c + 1], &mut rb.q[c]) };
        }
        let sc = self.scales.map(|s| s as i8 as i16);
        run_scales(
            ps,
            half,
            &[
                std::array::from_fn(|r| sc[2 * r]),
                std::array::from_fn(|r| sc[2 * r + 1]),
            ],
        );
        for k in 0..4 {
            ps.d_dmin[4 * k + half] = self.d();
            for (g, &s) in ps.neg_group_scales[8 * k + 4 * half..][..4]
                .iter_mut()
                .zip(&sc[4 * k..4 * k + 4])
            {
                *g = -s;
            }
        }
    }
}

/// Unpacks rows `w[0..8]` (each `nb` super-blocks) into `rows` and `pairs`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_group<K: KRuns>(
    w: &[K],
    nb: usize,
    rows: &mut [RowBlock],
    pairs: &mut [PairScales],
) {
    for b in 0..nb {
        for row in 0..GROUP {
            let pair = row / 2;
            let (rb, ps) = (
                &mut rows[(pair * nb + b) * 2 + row % 2],
                &mut pairs[pair * nb + b],
            );
            // SAFETY: the caller promises AVX2, FMA and F16C.
            unsafe { w[row * nb + b].unpack(rb, ps, row % 2) };
        }
    }
}

/// Interleaves `acts` (tokens of `nb` super-blocks) into `tokens`, and
/// writes each neighbouring pair's minimum-term data into `pairs` and each
/// tile's scales into `quads`.
///
/// # Safety
/// The CPU must support AVX-512 F, AVX2, FMA and F16C. `acts` must hold
/// a multiple of [`TOKENS`] tokens.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn prepare_tokens(
    nb: usize,
    acts: &[BlockQ8K],
    tokens: &mut [TokenBlock],
    pairs: &mut [TokenPair],
    quads: &mut [TokenQuad],
) {
    let twice = _mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3);
    for (i, (y, tb)) in acts.iter().zip(tokens.iter_mut()).enumerate() {
        let pair = &mut pairs[(i / (2 * nb)) * nb + i % nb];
        let half = (i / nb) % 2;
        // SAFETY: `qs` holds 256 bytes and `bsums` 32, `tb`'s fields are
        // aligned (see the offset checks), the pair's `sums` hold 32 values
        // (this token's from `16 * half`); the caller promises the
        // features.
        unsafe {
            for c in 0..4 {
                let first = _mm256_loadu_si256(y.qs.as_ptr().add(64 * c) as *const __m256i);
                let second = _mm256_loadu_si256(y.qs.as_ptr().add(64 * c + 32) as *const __m256i);
                interleave_runs(first, second, &mut tb.q[c]);
            }
            let bsums = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
            _mm512_store_si512(
                tb.group_sums.as_mut_ptr() as *mut __m512i,
                _mm512_permutexvar_epi64(twice, _mm512_castsi256_si512(bsums)),
            );
            _mm256_storeu_si256(
                pair.sums.as_mut_ptr().add(16 * half) as *mut __m256i,
                _mm256_broadcastsi128_si256(sub_block_sums(y)),
            );
        }
        let lane = (i / nb) % TOKENS;
        quads[(i / (TOKENS * nb)) * nb + i % nb].d[4 * lane..4 * lane + 4].fill(y.d());
    }
}

/// Interleaves `acts` (whole rows of `nb` Q8_K blocks, a multiple of
/// [`TOKENS`] of them) into `chunk`.
///
/// # Safety
/// The CPU must support AVX-512 F, AVX2, FMA and F16C.
pub(crate) unsafe fn prepare_chunk(nb: usize, acts: &[u8], chunk: &mut PreparedChunk) {
    let chunk = &mut chunk.vnni;
    let acts: &[BlockQ8K] = bytemuck::cast_slice(acts);
    let n = acts.len() / nb;
    debug_assert!(n.is_multiple_of(TOKENS) && acts.len() == n * nb);
    chunk.tokens.resize(n * nb, EMPTY_TOKEN);
    chunk.pairs.resize(n / 2 * nb, EMPTY_TOKEN_PAIR);
    chunk.quads.resize(n / TOKENS * nb, EMPTY_TOKEN_QUAD);
    // SAFETY: the caller promises the features; the chunk holds `n`
    // tokens, `n / 2` pairs and `n / TOKENS` tiles.
    unsafe {
        prepare_tokens(
            nb,
            acts,
            &mut chunk.tokens,
            &mut chunk.pairs,
            &mut chunk.quads,
        )
    };
}

/// Loads 64 aligned bytes.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load(bytes: &[u8; 64]) -> __m512i {
    // SAFETY: 64 readable bytes, 64-byte aligned by the containing types.
    unsafe { _mm512_load_si512(bytes.as_ptr() as *const __m512i) }
}

/// The float accumulators of one pair of rows and [`TOKENS`] tokens,
/// carried from one slice of super-blocks to the next.
#[derive(Clone, Copy)]
struct PairAcc {
    acc: [__m512; TOKENS],
    acc_min: [__m512; TOKENS / 2],
}

impl PairAcc {
    /// Nothing summed yet.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn zero() -> PairAcc {
        PairAcc {
            acc: [_mm512_setzero_ps(); TOKENS],
            acc_min: [_mm512_setzero_ps(); TOKENS / 2],
        }
    }
}

/// A pair of unpacked rows (`rows[2 * b + half]`, `pairs[b]`: super-block
/// `b` of a slice) times [`TOKENS`] tokens (`y[t]`: each token's
/// super-blocks of the slice; `y_pairs[i]`: those of tokens `2i` and
/// `2i + 1`; `y_quad`: the tile's scales), summed into `sums` super-block
/// by super-block, in order.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn pair_tile<K: KRuns>(
    rows: &[RowBlock],
    pairs: &[PairScales],
    y: [&[TokenBlock]; TOKENS],
    y_pairs: [&[TokenPair]; TOKENS / 2],
    y_quad: &[TokenQuad],
    sums: &mut PairAcc,
) {
    // SAFETY: the caller promises the CPU features; every read goes
    // through a reference.
    unsafe {
        let zero = _mm512_setzero_si512();
        // Local copies, so that the accumulators stay in registers.
        let PairAcc {
            mut acc,
            mut acc_min,
        } = *sums;
        for (b, (ps, r)) in pairs.iter().zip(rows.chunks_exact(2)).enumerate() {
            let (r0, r1) = (&r[0], &r[1]);
            let yb = y.map(|t| &t[b]);
            let mut lanes = [zero; TOKENS];
            if K::MIN == MinTerm::Offset {
                // The -32 of every quant, per lane: 32 times the scaled
                // 16-quant activation sums of the lane's two groups, the
                // lanes' starting value.
                let neg_scales = _mm512_load_si512(ps.neg_group_scales.as_ptr() as *const __m512i);
                for (lanes, yb) in lanes.iter_mut().zip(&yb) {
                    let sums = _mm512_load_si512(yb.group_sums.as_ptr() as *const __m512i);
                    *lanes = _mm512_slli_epi32::<5>(_mm512_madd_epi16(sums, neg_scales));
                }
            }
            // The pair's weights and scales stay in 12 registers while each
            // token passes over them.
            let w0: [__m512i; 4] = std::array::from_fn(|c| load(&r0.q[c]));
            let w1: [__m512i; 4] = std::array::from_fn(|c| load(&r1.q[c]));
            let scale: [__m512i; 4] =
                std::array::from_fn(|c| _mm512_load_si512(ps.scale[c].as_ptr() as *const __m512i));
            for (lanes, yb) in lanes.iter_mut().zip(&yb) {
                for c in 0..4 {
                    let a = load(&yb.q[c]);
                    let p0 = _mm512_dpbusd_epi32(zero, w0[c], a);
                    let p1 = _mm512_dpbusd_epi32(zero, w1[c], a);
                    *lanes = dpwssd(*lanes, _mm512_packs_epi32(p0, p1), scale[c]);
                }
            }
            // Every scale product of both rows and the tile's tokens in
            // one multiply: token t's d_w * d_a on lanes 4t, 4t + 1, its
            // dmin * d_a on 4t + 2, 4t + 3; each step's pattern permuted
            // out of it.
            let products = _mm512_mul_ps(
                _mm512_load_ps(ps.d_dmin.as_ptr()),
                _mm512_load_ps(y_quad[b].d.as_ptr()),
            );
            for ((acc, lanes), pattern) in acc.iter_mut().zip(&lanes).zip(&SCALE_LANES) {
                let pattern = _mm512_loadu_si512(pattern.as_ptr() as *const __m512i);
                let dd = _mm512_permutexvar_ps(pattern, products);
                *acc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(*lanes), *acc);
            }
            if matches!(K::MIN, MinTerm::Lanes | MinTerm::Scalar) {
                let mins =
                    _mm512_broadcast_i64x4(_mm256_load_si256(ps.mins.as_ptr() as *const __m256i));
                // Each neighbouring pair's dmin * d_a spread over its
                // minimum lanes. vec_dot adds (-d_a * dmin) * m, which is
                // -((d_a * dmin) * m) to the bit.
                for ((acc_min, yp), spread) in
                    acc_min.iter_mut().zip(&y_pairs).zip(&MIN_SCALE_LANES)
                {
                    let yp = &yp[b];
                    let sums = _mm512_load_si512(yp.sums.as_ptr() as *const __m512i);
                    let mut m = _mm512_madd_epi16(mins, sums);
                    if K::MIN == MinTerm::Scalar {
                        // Each 128-bit lane holds one row and token's 4
                        // minimum lanes: their exact sum on all 4.
                        m = _mm512_add_epi32(m, _mm512_shuffle_epi32::<0b10_11_00_01>(m));
                        m = _mm512_add_epi32(m, _mm512_shuffle_epi32::<0b01_00_11_10>(m));
                    }
                    let m = _mm512_cvtepi32_ps(m);
                    let spread = _mm512_loadu_si512(spread.as_ptr() as *const __m512i);
                    let dm = _mm512_permutexvar_ps(spread, products);
                    *acc_min = _mm512_fnmadd_ps(dm, m, *acc_min);
                }
            }
        }
        *sums = PairAcc { acc, acc_min };
    }
}

/// The two rows' results for each token from a pair's accumulators after
/// its last super-block: `out[t]` holds the two rows.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn pair_results<K: KRuns>(sums: &PairAcc) -> [[f32; 2]; TOKENS] {
    let PairAcc { acc, acc_min } = sums;
    // SAFETY: the caller promises the CPU features; the stores go to
    // arrays of the right size.
    unsafe {
        let mut out = [[0.0f32; 2]; TOKENS];
        // `hsum8` of each row's 8 lanes, the same additions of the same
        // pairs: lane j + lane j + 4 (the 256-bit halves), then those of
        // lanes 0 + 2 and 1 + 3 (the 128-bit halves), then the two
        // neighbours, which leaves the first row on lane 0 and the second
        // on lane 2.
        for (out, acc) in out.iter_mut().zip(acc) {
            let v = _mm256_add_ps(
                _mm512_castps512_ps256(*acc),
                _mm512_extractf32x8_ps::<1>(*acc),
            );
            let v = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let v = _mm_add_ps(v, _mm_shuffle_ps::<0b10_11_00_01>(v, v));
            let mut l = [0.0f32; 4];
            _mm_storeu_ps(l.as_mut_ptr(), v);
            *out = [l[0], l[2]];
        }
        if matches!(K::MIN, MinTerm::Lanes | MinTerm::Scalar) {
            // Each 128-bit lane holds one row and token's minimum lanes:
            // `hsum4` of them (Q4_K; the same additions), or their exact
            // sum, already on every lane (Q5_K), onto its first lane.
            for (i, acc_min) in acc_min.iter().enumerate() {
                let mut m = *acc_min;
                if K::MIN == MinTerm::Lanes {
                    m = _mm512_add_ps(m, _mm512_permute_ps::<0b01_00_11_10>(m));
                    m = _mm512_add_ps(m, _mm512_permute_ps::<0b10_11_00_01>(m));
                }
                let mut l = [0.0f32; 16];
                _mm512_storeu_ps(l.as_mut_ptr(), m);
                for (j, o) in out[2 * i..2 * i + 2].iter_mut().flatten().enumerate() {
                    *o += l[4 * j];
                }
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
pub(crate) unsafe fn matmul<K: KRuns>(
    nb: usize,
    w: &[u8],
    groups: usize,
    acts: &[u8],
    tiles: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe { matmul_in_chunks::<K>(nb, w, groups, acts, tiles, out, out_stride, TOKEN_CHUNK) }
}

/// Tokens whose interleaved activations are held at once (at most 12 KiB
/// per token per 1,024 columns): a long prompt's would otherwise stay
/// allocated per thread (hundreds of MB for 8,192 tokens), and unpacking
/// the rows once per 512 tokens costs what a 512-token batch pays anyway.
const TOKEN_CHUNK: usize = 512;
const _: () = assert!(TOKEN_CHUNK.is_multiple_of(TILE));

/// [`matmul`], the tokens taken `chunk` at a time (a multiple of
/// [`TILE`]).
///
/// # Safety
/// As [`matmul`].
#[allow(clippy::too_many_arguments)] // `matmul`'s arguments and the chunk
pub(crate) unsafe fn matmul_in_chunks<K: KRuns>(
    nb: usize,
    w: &[u8],
    groups: usize,
    acts: &[u8],
    tiles: usize,
    out: &mut [f32],
    out_stride: usize,
    chunk: usize,
) {
    debug_assert!(chunk > 0 && chunk.is_multiple_of(TILE));
    let row_bytes = nb * std::mem::size_of::<BlockQ8K>();
    let n_tokens = tiles * TILE;
    SCRATCH.with_borrow_mut(|s| {
        let Scratch {
            rows,
            pairs,
            tokens,
        } = s;
        for c0 in (0..n_tokens).step_by(chunk) {
            let c1 = (c0 + chunk).min(n_tokens);
            // SAFETY: the caller promises the features; `acts` holds whole
            // Q8_K rows of `nb` blocks, `c1 - c0` of them (a multiple of
            // `TILE`, so even).
            unsafe {
                prepare_chunk(nb, &acts[c0 * row_bytes..c1 * row_bytes], tokens);
                groups_times_chunks::<K>(
                    nb,
                    w,
                    groups,
                    std::slice::from_ref(tokens),
                    c0,
                    rows,
                    pairs,
                    out,
                    out_stride,
                );
            }
        }
    });
}

/// Rows `0..groups * 8` of `w` (`nb` super-blocks of `K` each) times the
/// tokens of `chunks` (from [`prepare_chunk`], each [`CHUNK_TOKENS`]
/// tokens but the last, which may hold fewer, a multiple of [`TILE`]):
/// writes `out[t * out_stride + r]`, the bits of `vec_dot` for each pair.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2, FMA and F16C.
/// `w` must hold `groups * 8 * nb` blocks, every chunk be made with `nb`,
/// and `out` hold at least `(tokens - 1) * out_stride + groups * 8`
/// values.
pub(crate) unsafe fn matmul_prepared<K: KRuns>(
    nb: usize,
    w: &[u8],
    groups: usize,
    chunks: &[PreparedChunk],
    out: &mut [f32],
    out_stride: usize,
) {
    SCRATCH.with_borrow_mut(|s| {
        let Scratch { rows, pairs, .. } = s;
        // SAFETY: forwarded from the caller.
        unsafe { groups_times_chunks::<K>(nb, w, groups, chunks, 0, rows, pairs, out, out_stride) };
    });
}

/// The rows of `w` in blocks of [`BLOCK_GROUPS`] groups, each unpacked
/// once into `rows` and `pairs`, times every token of `chunks` (token
/// `first_token` onwards, in order).
///
/// # Safety
/// As [`matmul_prepared`], for tokens counted from `first_token`.
#[allow(clippy::too_many_arguments)] // the product's and the scratch's parts
unsafe fn groups_times_chunks<K: KRuns>(
    nb: usize,
    w: &[u8],
    groups: usize,
    chunks: &[PreparedChunk],
    first_token: usize,
    rows: &mut Vec<RowBlock>,
    pairs: &mut Vec<PairScales>,
    out: &mut [f32],
    out_stride: usize,
) {
    let w: &[K] = bytemuck::cast_slice(w);
    rows.resize(BLOCK_GROUPS * nb * GROUP, EMPTY_ROW);
    pairs.resize(BLOCK_GROUPS * nb * PAIRS, EMPTY_PAIR);
    for g0 in (0..groups).step_by(BLOCK_GROUPS) {
        let block = BLOCK_GROUPS.min(groups - g0);
        for g in 0..block {
            let group = &w[(g0 + g) * GROUP * nb..][..GROUP * nb];
            let rows = &mut rows[g * nb * GROUP..][..nb * GROUP];
            let pairs = &mut pairs[g * nb * PAIRS..][..nb * PAIRS];
            // SAFETY: the caller promises the features.
            unsafe { unpack_group(group, nb, rows, pairs) };
        }
        let mut t0 = first_token;
        for chunk in chunks.iter().map(|c| &c.vnni) {
            // SAFETY: the caller promises the features; `rows` and `pairs`
            // hold `block` unpacked groups.
            unsafe {
                if nb <= SLICE_BLOCKS {
                    block_tiles::<K, false>(rows, pairs, chunk, nb, block, t0, g0, out, out_stride)
                } else {
                    block_tiles::<K, true>(rows, pairs, chunk, nb, block, t0, g0, out, out_stride)
                }
            };
            t0 += chunk.tokens.len() / nb;
        }
    }
}

/// The tokens of `chunk` (a multiple of [`TOKENS`]; the first is token
/// `t0` of the product) times the `block` unpacked groups in `rows` and
/// `pairs`, groups `g0..` of the matrix, into `out`. One function with the
/// kernel's features, so that [`pair_tile`] is inlined into the loop over
/// its tiles; `SLICED` (rows longer than [`SLICE_BLOCKS`]) takes the
/// super-blocks a slice at a time for every pair, a function of its own so
/// that the one-slice loop's code stays as it was.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)] // the tile's operands and place
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn block_tiles<K: KRuns, const SLICED: bool>(
    rows: &[RowBlock],
    pairs: &[PairScales],
    chunk: &TokenChunk,
    nb: usize,
    block: usize,
    t0: usize,
    g0: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let n = chunk.tokens.len() / nb;
    let mut write = |c: usize, g: usize, pair: usize, sums: &PairAcc| {
        // SAFETY: the caller promises the features.
        let res = unsafe { pair_results::<K>(sums) };
        for (t, two) in res.iter().enumerate() {
            let at = (t0 + c + t) * out_stride + (g0 + g) * GROUP + 2 * pair;
            out[at..at + 2].copy_from_slice(two);
        }
    };
    for c in (0..n).step_by(TOKENS) {
        let y: [&[TokenBlock]; TOKENS] =
            std::array::from_fn(|t| &chunk.tokens[(c + t) * nb..][..nb]);
        let y_pairs: [&[TokenPair]; TOKENS / 2] =
            std::array::from_fn(|i| &chunk.pairs[(c / 2 + i) * nb..][..nb]);
        let y_quad = &chunk.quads[(c / TOKENS) * nb..][..nb];
        let pair_rows = |g: usize, pair: usize, slice: Range<usize>| {
            let rows = &rows[(g * PAIRS + pair) * nb * 2..][..nb * 2];
            let pairs = &pairs[(g * PAIRS + pair) * nb..][..nb];
            (&rows[2 * slice.start..2 * slice.end], &pairs[slice])
        };
        if !SLICED {
            // One slice: each pair's sums stay in registers to its results.
            for g in 0..block {
                for pair in 0..PAIRS {
                    let (rows, pairs) = pair_rows(g, pair, 0..nb);
                    let mut sums = PairAcc::zero();
                    // SAFETY: the caller promises the features.
                    unsafe { pair_tile::<K>(rows, pairs, y, y_pairs, y_quad, &mut sums) };
                    write(c, g, pair, &sums);
                }
            }
            continue;
        }
        let mut sums = [PairAcc::zero(); BLOCK_GROUPS * PAIRS];
        for b0 in (0..nb).step_by(SLICE_BLOCKS) {
            let slice = b0..(b0 + SLICE_BLOCKS).min(nb);
            let y = y.map(|y| &y[slice.clone()]);
            let y_pairs = y_pairs.map(|y| &y[slice.clone()]);
            let y_quad = &y_quad[slice.clone()];
            for g in 0..block {
                for pair in 0..PAIRS {
                    let (rows, pairs) = pair_rows(g, pair, slice.clone());
                    // SAFETY: the caller promises the features.
                    unsafe {
                        pair_tile::<K>(rows, pairs, y, y_pairs, y_quad, &mut sums[g * PAIRS + pair])
                    };
                }
            }
        }
        for g in 0..block {
            for pair in 0..PAIRS {
                write(c, g, pair, &sums[g * PAIRS + pair]);
            }
        }
    }
}
