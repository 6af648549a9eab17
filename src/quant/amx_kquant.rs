//! Q4_K, Q5_K, Q6_K and IQ4_XS × Q8_K prefill on AMX tiles, with the
//! bits of `vec_dot`.
//!
//! `vec_dot`'s lane `j` of a super-block is the exact integer
//! `Σ_r Σ_i w(r, 4j + i) · a(32r + 4j + i)` over the 8 runs `r` of 32
//! quants and the four quants `i` of the lane in each, where `w` is the
//! quant times its sub-block scale (plus Q6_K's `-32` offset, which
//! `vec_dot` applies per run pair, added here as the same integer), and
//! its float step is `fma(d_w · d_a, lane, acc)` per super-block. A lane
//! is thus a dot of 32 products, and one `tdpbusd` with tiles 32 bytes
//! deep forms it for 16 rows and 16 tokens at once: A holds each row's 32
//! scaled quants of the lane (four per run), B each token's 32 activations
//! of it (row `r` of B is run `r`).
//!
//! A scaled quant does not fit a byte (Q4_K up to 63 · 15, Q5_K 63 · 31,
//! Q6_K from -128 · 63 to 127 · 63, IQ4_XS -127 · -32), so it is split: `w = 256 · hi + lo` with `lo`
//! the low byte (unsigned) and `hi` the rest (signed, at most 5 bits and
//! the sign); `tdpbusd` forms `Σ lo · a` and `tdpbssd` `Σ hi · a`, and
//! the lane is `256 · Σ hi · a + Σ lo · a`, exact in 32 bits. The weights
//! are scaled and split once per call (per [`TOKEN_CHUNK`] tokens when the
//! call prepares its own activations), as `gemm_kquant` unpacks them; the
//! tiles and the float steps then run in `vec_dot`'s order, lane by lane,
//! so every output has the bits the one-row kernels give.
//!
//! The tile products go through [`TileProducts`]: AMX itself, and in the
//! tests a plain-Rust model of the two instructions, which checks the
//! layouts and the float steps on any AVX-512 machine.

#![allow(clippy::missing_safety_doc)] // the `# Safety` of each function is stated below

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::amx::{self, TileConfig};
use super::avx2::{iq4_values, k4_runs, q6k_runs};
use super::blocks::{scales_mins_k4, BlockIQ4XS, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};
use super::dispatch::TILE;
use super::gemm_kquant::MinTerm;
use super::PreparedChunk;

/// Rows per tile (the rows of a tile register).
pub(crate) const ROWS: usize = 16;
/// Tokens per tile (the 32-bit columns of a tile register).
pub(crate) const TOKENS: usize = 16;
/// Bytes of one lane's operand in a tile row: four quants of each run.
const DEPTH: usize = 32;

/// One super-block of [`ROWS`] rows as the tiles read it.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct RowTile {
    /// Per lane `j`, row `m`'s 32 low bytes at `32m`: byte `4r + i` is
    /// that of the scaled quant `4j + i` of run `r`.
    lo: [[u8; ROWS * DEPTH]; 8],
    /// The same, the high parts (signed).
    hi: [[u8; ROWS * DEPTH]; 8],
    d: [f32; ROWS],
    /// Q4_K and Q5_K: each row's minimum scale.
    dmin: [f32; ROWS],
    /// Q4_K and Q5_K: per minimum lane `k`, each row's minimums of sub-blocks
    /// `2k` (low half) and `2k + 1` (high half) as 16-bit values.
    mins: [[u32; ROWS]; 4],
    /// Q6_K: per lane `j`, each row's scales of the 16-quant groups `2j`
    /// and `2j + 1` (the two halves of run `j`) as 16-bit values.
    scales: [[u32; ROWS]; 8],
}

/// One super-block of [`TOKENS`] tokens as the tiles read it.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct TokenTile {
    /// Per lane `j`: row `r` (64 bytes) holds token `n`'s activations
    /// `32r + 4j .. 32r + 4j + 4` at `4n`.
    b: [[u8; 8 * 64]; 8],
    d: [f32; TOKENS],
    neg_d: [f32; TOKENS],
    /// Q4_K and Q5_K: per minimum lane `k`, token `n`'s activation sums of
    /// sub-blocks `2k` and `2k + 1` at `2n` and `2n + 1`.
    sub_sums: [[i16; 2 * TOKENS]; 4],
    /// Q6_K: per lane `j`, token `n`'s sums of the 16-quant groups `2j`
    /// and `2j + 1` at `2n` and `2n + 1`.
    group_sums: [[i16; 2 * TOKENS]; 8],
}

const EMPTY_ROWS: RowTile = RowTile {
    lo: [[0; ROWS * DEPTH]; 8],
    hi: [[0; ROWS * DEPTH]; 8],
    d: [0.0; ROWS],
    dmin: [0.0; ROWS],
    mins: [[0; ROWS]; 4],
    scales: [[0; ROWS]; 8],
};
const EMPTY_TOKENS: TokenTile = TokenTile {
    b: [[0; 8 * 64]; 8],
    d: [0.0; TOKENS],
    neg_d: [0.0; TOKENS],
    sub_sums: [[0; 2 * TOKENS]; 4],
    group_sums: [[0; 2 * TOKENS]; 8],
};

/// Some tokens' activations as tiles: `[token tile][super-block]`, the
/// last tile padded with zero tokens.
#[derive(Default)]
pub struct TokenTiles {
    tiles: Vec<TokenTile>,
    /// Real tokens held (the padding excluded).
    tokens: usize,
}

impl TokenTiles {
    /// Forgets the tokens (keeping the memory).
    pub(crate) fn clear(&mut self) {
        self.tiles.clear();
        self.tokens = 0;
    }

    /// Whether it holds `tokens` tokens of `nb` super-blocks.
    pub(crate) fn holds(&self, tokens: usize, nb: usize) -> bool {
        self.tokens == tokens && self.tiles.len() == tokens.div_ceil(TOKENS) * nb
    }
}

/// A K-quant format the kernel handles.
pub(crate) trait KScaled: bytemuck::Pod {
    /// How its `vec_dot` adds the minimums or the offset.
    const MIN: MinTerm;
    /// Writes this super-block as row `m` of `rt`.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and BW, AVX2, FMA and F16C.
    unsafe fn unpack(&self, rt: &mut RowTile, m: usize);
}

/// Writes the 8 runs of row `m` of a super-block (32 quants each,
/// unsigned or, with `signed`, signed) times `scale(r)` (each quant's scale as 16-bit lanes) into `rt`'s
/// lane operands: each run's scaled quants split into low and high bytes,
/// then the four-byte groups transposed so that lane `j` gathers group `j`
/// of every run.
///
/// # Safety
/// The CPU must support AVX-512 F and BW, and AVX2.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn put_runs(
    rt: &mut RowTile,
    m: usize,
    runs: &[__m256i; 8],
    signed: bool,
    scale: impl Fn(usize) -> __m512i,
) {
    let mut lo = [_mm256_setzero_si256(); 8];
    let mut hi = [_mm256_setzero_si256(); 8];
    for r in 0..8 {
        // Exact in 16 bits: at most 63 · 15 (Q4_K), 63 · 31 (Q5_K),
        // 128 · 63 (Q6_K) and 127 · 32 (IQ4_XS).
        let quants = if signed {
            _mm512_cvtepi8_epi16(runs[r])
        } else {
            _mm512_cvtepu8_epi16(runs[r])
        };
        let w = _mm512_mullo_epi16(quants, scale(r));
        lo[r] = _mm512_cvtepi16_epi8(w);
        hi[r] = _mm512_cvtepi16_epi8(_mm512_srai_epi16::<8>(w));
    }
    for (bytes, out) in [(lo, &mut rt.lo), (hi, &mut rt.hi)] {
        let lanes = transpose_dwords(bytes);
        for (j, lane) in lanes.iter().enumerate() {
            // SAFETY: row `m`'s 32 bytes of lane `j` (`m < ROWS`).
            unsafe {
                _mm256_storeu_si256(
                    out[j][DEPTH * m..][..DEPTH].as_mut_ptr() as *mut __m256i,
                    *lane,
                )
            };
        }
    }
}

/// The 8x8 transpose of 32-bit elements: element `j` of output `r` is
/// element `r` of input `j`.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose_dwords(v: [__m256i; 8]) -> [__m256i; 8] {
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * (i / 2)], v[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    // u[4h + k]: from inputs 4h..4h + 4, elements k and k + 4.
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let (h, k) = (i / 4, i % 4);
        let (a, b) = (t[4 * h + k / 2], t[4 * h + k / 2 + 2]);
        if k % 2 == 0 {
            _mm256_unpacklo_epi64(a, b)
        } else {
            _mm256_unpackhi_epi64(a, b)
        }
    });
    std::array::from_fn(|j| {
        let (a, b) = (u[j % 4], u[4 + j % 4]);
        if j < 4 {
            _mm256_permute2x128_si256::<0x20>(a, b)
        } else {
            _mm256_permute2x128_si256::<0x31>(a, b)
        }
    })
}

/// Two 16-bit values in one 32-bit lane, `low` first.
#[inline(always)]
fn pair16(low: i32, high: i32) -> u32 {
    (low as u16 as u32) | ((high as u16 as u32) << 16)
}

impl KScaled for BlockQ4K {
    const MIN: MinTerm = MinTerm::Lanes;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn unpack(&self, rt: &mut RowTile, m: usize) {
        // SAFETY: the caller promises the features.
        unsafe {
            put_k4(
                rt,
                m,
                k4_runs(&self.qs, None),
                &self.scales,
                (self.d(), self.dmin()),
            )
        }
    }
}

impl KScaled for BlockQ5K {
    const MIN: MinTerm = MinTerm::Scalar;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn unpack(&self, rt: &mut RowTile, m: usize) {
        // SAFETY: the caller promises the features.
        unsafe {
            let runs = k4_runs(&self.qs, Some(&self.qh));
            put_k4(rt, m, runs, &self.scales, (self.d(), self.dmin()))
        }
    }
}

/// Row `m` of `rt` from a Q4_K or Q5_K super-block's runs, packed scales
/// and minimums, and `(d, dmin)`.
///
/// # Safety
/// The CPU must support AVX-512 F and BW, and AVX2.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn put_k4(
    rt: &mut RowTile,
    m: usize,
    runs: [__m256i; 8],
    scales: &[u8; 12],
    (d, dmin): (f32, f32),
) {
    let (sc, mn) = scales_mins_k4(scales);
    // SAFETY: the caller promises the features.
    unsafe { put_runs(rt, m, &runs, false, |r| _mm512_set1_epi16(sc[r] as i16)) };
    rt.d[m] = d;
    rt.dmin[m] = dmin;
    for k in 0..4 {
        rt.mins[k][m] = pair16(mn[2 * k] as i32, mn[2 * k + 1] as i32);
    }
}

impl KScaled for BlockQ6K {
    const MIN: MinTerm = MinTerm::Offset;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn unpack(&self, rt: &mut RowTile, m: usize) {
        // The unsigned quants (0..64), as `vec_dot` multiplies them; the
        // `-32` comes in as the per-run offset in the float step's lanes.
        // SAFETY: the caller promises the features.
        let (runs, _, _) = unsafe { q6k_runs(self) };
        let sc = self.scales.map(|s| s as i8 as i16);
        // Run `r`'s first 16 quants take scale `2r`, the others `2r + 1`.
        let scale = |r: usize| {
            _mm512_inserti64x4::<1>(
                _mm512_set1_epi16(sc[2 * r]),
                _mm256_set1_epi16(sc[2 * r + 1]),
            )
        };
        // SAFETY: the caller promises the features.
        unsafe { put_runs(rt, m, &runs, false, scale) };
        rt.d[m] = self.d();
        for j in 0..8 {
            rt.scales[j][m] = pair16(sc[2 * j] as i32, sc[2 * j + 1] as i32);
        }
    }
}

impl KScaled for BlockIQ4XS {
    const MIN: MinTerm = MinTerm::None;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn unpack(&self, rt: &mut RowTile, m: usize) {
        // SAFETY: `qs` holds 128 bytes, 16 per run; the caller promises
        // the features.
        let runs: [__m256i; 8] =
            std::array::from_fn(|r| unsafe { iq4_values(self.qs.as_ptr().add(16 * r)) });
        // SAFETY: the caller promises the features.
        unsafe {
            put_runs(rt, m, &runs, true, |r| {
                _mm512_set1_epi16(self.scale(r) as i16)
            })
        };
        rt.d[m] = self.d();
    }
}

/// Writes `y` as token `n` of `tt`.
fn put_token(y: &BlockQ8K, tt: &mut TokenTile, n: usize) {
    for r in 0..8 {
        for j in 0..8 {
            let from = 32 * r + 4 * j;
            tt.b[j][64 * r + 4 * n..][..4].copy_from_slice(&y.qs[from..from + 4]);
        }
    }
    tt.d[n] = y.d();
    tt.neg_d[n] = -y.d();
    // Sub-block sums as `vec_dot` forms them (16-bit adds of the group
    // sums; every sum fits).
    let s = |j: usize| y.bsum(2 * j).wrapping_add(y.bsum(2 * j + 1)) as i16;
    for k in 0..4 {
        tt.sub_sums[k][2 * n] = s(2 * k);
        tt.sub_sums[k][2 * n + 1] = s(2 * k + 1);
    }
    for j in 0..8 {
        tt.group_sums[j][2 * n] = y.bsum(2 * j) as i16;
        tt.group_sums[j][2 * n + 1] = y.bsum(2 * j + 1) as i16;
    }
}

/// Arranges `acts` (whole rows of `nb` Q8_K blocks) as token tiles.
pub(crate) fn prepare_tokens(nb: usize, acts: &[u8], out: &mut TokenTiles) {
    let acts: &[BlockQ8K] = bytemuck::cast_slice(acts);
    let n = acts.len() / nb;
    out.tiles.clear();
    out.tiles.resize(n.div_ceil(TOKENS) * nb, EMPTY_TOKENS);
    for (t, y) in acts.chunks_exact(nb).enumerate() {
        for (b, y) in y.iter().enumerate() {
            put_token(y, &mut out.tiles[(t / TOKENS) * nb + b], t % TOKENS);
        }
    }
    out.tokens = n;
}

/// The prepared-activation form for the shared path: fills `chunk`.
///
/// # Safety
/// None beyond the signature (`unsafe` to fit the kernel table).
pub(crate) unsafe fn prepare_chunk(nb: usize, acts: &[u8], chunk: &mut PreparedChunk) {
    prepare_tokens(nb, acts, &mut chunk.amx);
}

/// The two tile products of one lane: `c_lo = A_lo · B` (unsigned A) and
/// `c_hi = A_hi · B` (signed A), A of 16 rows of 32 bytes, B of 8 rows of
/// 64, C of 16 rows of 16 sums.
pub(crate) trait TileProducts {
    /// Readies this thread to run [`TileProducts::lane`].
    ///
    /// # Safety
    /// The implementation's CPU requirements must hold.
    unsafe fn begin();
    /// # Safety
    /// [`TileProducts::begin`] must have run on this thread since the
    /// last [`TileProducts::end`].
    unsafe fn lane(
        a_lo: &[u8; ROWS * DEPTH],
        a_hi: &[u8; ROWS * DEPTH],
        b: &[u8; 8 * 64],
        c_lo: &mut [i32; ROWS * TOKENS],
        c_hi: &mut [i32; ROWS * TOKENS],
    );
    /// # Safety
    /// As [`TileProducts::lane`].
    unsafe fn end();
}

/// The tile products on AMX: C in `tmm0` and `tmm1`, A in `tmm2` and
/// `tmm3`, B in `tmm4`.
pub(crate) struct AmxTiles;

const AMX_CONFIG: TileConfig = TileConfig::new()
    .tile(0, ROWS as u8, (TOKENS * 4) as u16)
    .tile(1, ROWS as u8, (TOKENS * 4) as u16)
    .tile(2, ROWS as u8, DEPTH as u16)
    .tile(3, ROWS as u8, DEPTH as u16)
    .tile(4, (DEPTH / 4) as u8, 64);

impl TileProducts for AmxTiles {
    /// # Safety
    /// [`amx::available`] must have returned `Ok`.
    unsafe fn begin() {
        // SAFETY: the caller promises AMX.
        unsafe { AMX_CONFIG.load() };
    }

    unsafe fn lane(
        a_lo: &[u8; ROWS * DEPTH],
        a_hi: &[u8; ROWS * DEPTH],
        b: &[u8; 8 * 64],
        c_lo: &mut [i32; ROWS * TOKENS],
        c_hi: &mut [i32; ROWS * TOKENS],
    ) {
        // SAFETY: the configuration above is loaded (the caller promises
        // `begin`); every load and store stays within its array: A 16
        // rows of 32 bytes, B 8 rows of 64, C 16 rows of 64.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tileloadd tmm2, [{alo} + {s32}*1]",
                "tileloadd tmm3, [{ahi} + {s32}*1]",
                "tileloadd tmm4, [{b} + {s64}*1]",
                "tdpbusd tmm0, tmm2, tmm4",
                "tdpbssd tmm1, tmm3, tmm4",
                "tilestored [{clo} + {s64}*1], tmm0",
                "tilestored [{chi} + {s64}*1], tmm1",
                alo = in(reg) a_lo.as_ptr(),
                ahi = in(reg) a_hi.as_ptr(),
                b = in(reg) b.as_ptr(),
                clo = in(reg) c_lo.as_mut_ptr(),
                chi = in(reg) c_hi.as_mut_ptr(),
                s32 = in(reg) DEPTH,
                s64 = in(reg) 64usize,
                options(nostack),
            )
        };
    }

    unsafe fn end() {
        // SAFETY: the caller promises AMX.
        unsafe { amx::release() };
    }
}

/// Per-thread scratch, reused across calls.
#[derive(Default)]
struct Scratch {
    /// The unpacked tile of rows in use: `[super-block]`.
    rows: Vec<RowTile>,
    /// The call's own tokens when it prepares them.
    tokens: TokenTiles,
    lanes: Lanes,
}

/// One tile pair's sums: the tile products of the current super-block,
/// and the float accumulators over all of them. Aligned to cache lines:
/// a tile store's rows and the vectors read back would otherwise each
/// straddle two lines.
#[repr(C, align(64))]
struct Lanes {
    c_lo: [[i32; ROWS * TOKENS]; 8],
    c_hi: [[i32; ROWS * TOKENS]; 8],
    /// `[row][lane][token]`.
    acc: [[[f32; TOKENS]; 8]; ROWS],
    /// `[row][minimum lane][token]`.
    acc_min: [[[f32; TOKENS]; 4]; ROWS],
    /// The outputs, `[row][token]`.
    sums: [[f32; TOKENS]; ROWS],
}

impl Default for Lanes {
    fn default() -> Self {
        Lanes {
            c_lo: [[0; ROWS * TOKENS]; 8],
            c_hi: [[0; ROWS * TOKENS]; 8],
            acc: [[[0.0; TOKENS]; 8]; ROWS],
            acc_min: [[[0.0; TOKENS]; 4]; ROWS],
            sums: [[0.0; TOKENS]; ROWS],
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Box<Scratch>> = RefCell::new(Box::default());
}

/// Tokens a call that prepares its own activations holds at once.
const TOKEN_CHUNK: usize = 512;

/// Rows `0..groups * 8` of `w` (`nb` super-blocks of `K` each) times tokens
/// `0..tiles * TILE` of `acts` (rows of `nb` Q8_K blocks): writes
/// `out[t * out_stride + r]`, the bits of `vec_dot` for each pair.
///
/// # Safety
/// [`amx::available`] must have returned `Ok` and the CPU must support
/// AVX-512 F, BW and DQ, AVX2, FMA and F16C; `w` must hold
/// `groups * 8 * nb` blocks, `acts` `tiles * TILE * nb`, and `out` at
/// least `(tiles * TILE - 1) * out_stride + groups * 8` values.
pub(crate) unsafe fn matmul<K: KScaled>(
    nb: usize,
    w: &[u8],
    groups: usize,
    acts: &[u8],
    tiles: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe { matmul_with::<K, AmxTiles>(nb, w, groups * 8, acts, tiles * TILE, out, out_stride) }
}

/// [`matmul`] over the tokens of `chunks` (each filled by
/// [`prepare_chunk`]), in order.
///
/// # Safety
/// As [`matmul`], the tokens being the chunks'.
pub(crate) unsafe fn matmul_prepared<K: KScaled>(
    nb: usize,
    w: &[u8],
    groups: usize,
    chunks: &[PreparedChunk],
    out: &mut [f32],
    out_stride: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe { matmul_prepared_with::<K, AmxTiles>(nb, w, groups * 8, chunks, out, out_stride) }
}

/// [`matmul_prepared`] with the tile products of `T`, for `rows` rows.
///
/// # Safety
/// As [`matmul_prepared`], with `T`'s requirements for AMX.
pub(crate) unsafe fn matmul_prepared_with<K: KScaled, T: TileProducts>(
    nb: usize,
    w: &[u8],
    rows: usize,
    chunks: &[PreparedChunk],
    out: &mut [f32],
    out_stride: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe { products::<K, T>(nb, w, rows, chunks_tokens(chunks), out, out_stride) }
}

/// Each chunk's tokens and the product's first token among them.
fn chunks_tokens(chunks: &[PreparedChunk]) -> impl Iterator<Item = (usize, &TokenTiles)> + Clone {
    chunks.iter().scan(0, |t0, c| {
        let first = *t0;
        *t0 += c.amx.tokens;
        Some((first, &c.amx))
    })
}

/// [`matmul`] with the tile products of `T`, for `rows` rows and `tokens`
/// tokens, preparing the tokens [`TOKEN_CHUNK`] at a time.
///
/// # Safety
/// As [`matmul`], with `T`'s requirements for AMX.
pub(crate) unsafe fn matmul_with<K: KScaled, T: TileProducts>(
    nb: usize,
    w: &[u8],
    rows: usize,
    acts: &[u8],
    tokens: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let row_bytes = nb * std::mem::size_of::<BlockQ8K>();
    let mut own = SCRATCH.with_borrow_mut(|s| std::mem::take(&mut s.tokens));
    for c0 in (0..tokens).step_by(TOKEN_CHUNK) {
        let c1 = (c0 + TOKEN_CHUNK).min(tokens);
        prepare_tokens(nb, &acts[c0 * row_bytes..c1 * row_bytes], &mut own);
        // SAFETY: forwarded from the caller; `out` from token `c0` on.
        unsafe {
            products::<K, T>(
                nb,
                w,
                rows,
                std::iter::once((0, &own)),
                &mut out[c0 * out_stride..],
                out_stride,
            )
        };
    }
    SCRATCH.with_borrow_mut(|s| s.tokens = own);
}

/// Rows `0..rows` of `w` (a multiple of 8; a last half tile is padded with
/// zero rows) times the token tiles of `chunks` (each with the first token
/// it holds), into `out`.
///
/// # Safety
/// As [`matmul`].
unsafe fn products<'c, K: KScaled, T: TileProducts>(
    nb: usize,
    w: &[u8],
    rows: usize,
    chunks: impl Iterator<Item = (usize, &'c TokenTiles)> + Clone,
    out: &mut [f32],
    out_stride: usize,
) {
    let w: &[K] = bytemuck::cast_slice(w);
    SCRATCH.with_borrow_mut(|s| {
        let Scratch {
            rows: unpacked,
            lanes,
            ..
        } = &mut **s;
        let row_tiles = rows.div_ceil(ROWS);
        // SAFETY: the caller promises the features `T` needs.
        unsafe { T::begin() };
        for rt in 0..row_tiles {
            let r0 = rt * ROWS;
            let real_rows = ROWS.min(rows - r0);
            // One tile of rows at a time, so that its scaled copy stays in
            // cache while every token tile passes over it. Not cleared
            // between tiles: unpacking rewrites every field the format's
            // steps read, and the rows of a last short tile that keep an
            // earlier tile's values give sums no output takes (a row of
            // a tile product depends on that row of A alone).
            if unpacked.len() != nb {
                unpacked.clear();
                unpacked.resize(nb, EMPTY_ROWS);
            }
            for (m, row) in w[r0 * nb..(r0 + real_rows) * nb]
                .chunks_exact(nb)
                .enumerate()
            {
                for (b, block) in row.iter().enumerate() {
                    // SAFETY: the caller promises AVX-512 F and BW, AVX2,
                    // FMA and F16C.
                    unsafe { block.unpack(&mut unpacked[b], m) };
                }
            }
            for (t_first, chunk) in chunks.clone() {
                for tt in 0..chunk.tokens.div_ceil(TOKENS) {
                    let n0 = tt * TOKENS;
                    let real_tokens = TOKENS.min(chunk.tokens - n0);
                    let row_blocks = &unpacked[..nb];
                    let token_blocks = &chunk.tiles[tt * nb..][..nb];
                    // SAFETY: `begin` ran; the caller promises AVX-512.
                    unsafe { tile::<K, T>(row_blocks, token_blocks, lanes) };
                    // Token by token: a token's outputs are side by side in `out`.
                    for n in 0..real_tokens {
                        let row = &mut out[(t_first + n0 + n) * out_stride + r0..][..real_rows];
                        for (m, o) in row.iter_mut().enumerate() {
                            *o = lanes.sums[m][n];
                        }
                    }
                }
            }
        }
        // SAFETY: as `begin`.
        unsafe { T::end() };
    });
}

/// One tile of rows times one tile of tokens over every super-block: the
/// lanes' float accumulators in `lanes.acc` and `lanes.acc_min`, then
/// each output (`hsum8` of the lanes, plus `hsum4` of the minimum lanes
/// for Q4_K or the one minimum sum for Q5_K, each token's the same
/// operations in one vector) in `lanes.sums`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and DQ; `T::begin` must have run.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2,fma")]
unsafe fn tile<K: KScaled, T: TileProducts>(
    row_blocks: &[RowTile],
    token_blocks: &[TokenTile],
    lanes: &mut Lanes,
) {
    let Lanes {
        c_lo,
        c_hi,
        acc,
        acc_min,
        sums,
    } = lanes;
    // SAFETY: the caller promises the features and `begin`; every access
    // goes through a reference to an array of the loaded width.
    unsafe {
        // The first super-block's steps start from zero rather than from
        // accumulators cleared in memory (`fma(x, y, 0)`, as `vec_dot`'s
        // first step from its zeroed accumulator).
        let mut blocks = row_blocks.iter().zip(token_blocks);
        if let Some((rt, tt)) = blocks.next() {
            super_block::<K, T, true>(rt, tt, c_lo, c_hi, acc, acc_min);
        }
        for (rt, tt) in blocks {
            super_block::<K, T, false>(rt, tt, c_lo, c_hi, acc, acc_min);
        }
        for m in 0..ROWS {
            let l: [__m512; 8] = std::array::from_fn(|j| _mm512_loadu_ps(acc[m][j].as_ptr()));
            // `hsum8`: lanes `j` and `j + 4` first, then `(0 + 2) + (1 + 3)`.
            let r: [__m512; 4] = std::array::from_fn(|j| _mm512_add_ps(l[j], l[j + 4]));
            let mut v = _mm512_add_ps(_mm512_add_ps(r[0], r[2]), _mm512_add_ps(r[1], r[3]));
            match K::MIN {
                MinTerm::None | MinTerm::Offset => {}
                MinTerm::Lanes => {
                    // `hsum4`: `(0 + 2) + (1 + 3)`.
                    let n: [__m512; 4] =
                        std::array::from_fn(|k| _mm512_loadu_ps(acc_min[m][k].as_ptr()));
                    let mins = _mm512_add_ps(_mm512_add_ps(n[0], n[2]), _mm512_add_ps(n[1], n[3]));
                    v = _mm512_add_ps(v, mins);
                }
                MinTerm::Scalar => v = _mm512_add_ps(v, _mm512_loadu_ps(acc_min[m][0].as_ptr())),
            }
            _mm512_storeu_ps(sums[m].as_mut_ptr(), v);
        }
    }
}

/// One super-block of [`tile`]: its tile products, then each lane's and
/// minimum lane's float step into `acc` and `acc_min` (from zero when
/// `FIRST`).
///
/// # Safety
/// As [`tile`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2,fma")]
unsafe fn super_block<K: KScaled, T: TileProducts, const FIRST: bool>(
    rt: &RowTile,
    tt: &TokenTile,
    c_lo: &mut [[i32; ROWS * TOKENS]; 8],
    c_hi: &mut [[i32; ROWS * TOKENS]; 8],
    acc: &mut [[[f32; TOKENS]; 8]; ROWS],
    acc_min: &mut [[[f32; TOKENS]; 4]; ROWS],
) {
    let prev = |a: *const f32| {
        if FIRST {
            _mm512_setzero_ps()
        } else {
            // SAFETY: `a` points at 16 floats of an accumulator.
            unsafe { _mm512_loadu_ps(a) }
        }
    };
    // SAFETY: the caller promises the features and `begin`; every access
    // goes through a reference to an array of the loaded width.
    unsafe {
        for j in 0..8 {
            T::lane(&rt.lo[j], &rt.hi[j], &tt.b[j], &mut c_lo[j], &mut c_hi[j]);
        }
        let dy = _mm512_loadu_ps(tt.d.as_ptr());
        let neg_dy = _mm512_loadu_ps(tt.neg_d.as_ptr());
        for m in 0..ROWS {
            // `y.d() * x.d()`, one product per token.
            let dd = _mm512_mul_ps(dy, _mm512_set1_ps(rt.d[m]));
            for j in 0..8 {
                let lo = _mm512_loadu_si512(c_lo[j][m * TOKENS..].as_ptr() as *const __m512i);
                let hi = _mm512_loadu_si512(c_hi[j][m * TOKENS..].as_ptr() as *const __m512i);
                let mut lane = _mm512_add_epi32(_mm512_slli_epi32::<8>(hi), lo);
                if K::MIN == MinTerm::Offset {
                    let sums = _mm512_loadu_si512(tt.group_sums[j].as_ptr() as *const __m512i);
                    let scaled = _mm512_madd_epi16(sums, _mm512_set1_epi32(rt.scales[j][m] as i32));
                    lane = _mm512_sub_epi32(lane, _mm512_slli_epi32::<5>(scaled));
                }
                let a = acc[m][j].as_mut_ptr();
                _mm512_storeu_ps(a, _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(lane), prev(a)));
            }
            if matches!(K::MIN, MinTerm::Lanes | MinTerm::Scalar) {
                // `-y.d() * x.dmin()`.
                let dm = _mm512_mul_ps(neg_dy, _mm512_set1_ps(rt.dmin[m]));
                let mins: [__m512i; 4] = std::array::from_fn(|k| {
                    let sums = _mm512_loadu_si512(tt.sub_sums[k].as_ptr() as *const __m512i);
                    _mm512_madd_epi16(sums, _mm512_set1_epi32(rt.mins[k][m] as i32))
                });
                if K::MIN == MinTerm::Lanes {
                    for (acc_min, mins) in acc_min[m].iter_mut().zip(mins) {
                        let a = acc_min.as_mut_ptr();
                        _mm512_storeu_ps(a, _mm512_fmadd_ps(dm, _mm512_cvtepi32_ps(mins), prev(a)));
                    }
                } else {
                    // The exact sum of the four, then one step (in
                    // minimum lane 0).
                    let sum = _mm512_add_epi32(
                        _mm512_add_epi32(mins[0], mins[1]),
                        _mm512_add_epi32(mins[2], mins[3]),
                    );
                    let a = acc_min[m][0].as_mut_ptr();
                    _mm512_storeu_ps(a, _mm512_fmadd_ps(dm, _mm512_cvtepi32_ps(sum), prev(a)));
                }
            }
        }
    }
}

/// The two tile instructions in plain Rust, for checking the layouts and
/// the float steps where the CPU has no AMX.
#[cfg(test)]
pub(crate) struct ModelTiles;

#[cfg(test)]
impl TileProducts for ModelTiles {
    unsafe fn begin() {}

    unsafe fn lane(
        a_lo: &[u8; ROWS * DEPTH],
        a_hi: &[u8; ROWS * DEPTH],
        b: &[u8; 8 * 64],
        c_lo: &mut [i32; ROWS * TOKENS],
        c_hi: &mut [i32; ROWS * TOKENS],
    ) {
        for m in 0..ROWS {
            for n in 0..TOKENS {
                let (mut lo, mut hi) = (0i32, 0i32);
                for k in 0..DEPTH {
                    let bv = b[(k / 4) * 64 + 4 * n + k % 4] as i8 as i32;
                    lo += a_lo[m * DEPTH + k] as i32 * bv;
                    hi += a_hi[m * DEPTH + k] as i8 as i32 * bv;
                }
                c_lo[m * TOKENS + n] = lo;
                c_hi[m * TOKENS + n] = hi;
            }
        }
    }

    unsafe fn end() {}
}
