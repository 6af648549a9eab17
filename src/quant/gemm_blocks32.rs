//! Prefill for the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//! IQ4_NL) on AVX-512 VNNI, a group of 8 rows at a time.
//!
//! A group's rows are unpacked once per call into biased unsigned bytes
//! (`quant + bias`), so that one `vpdpbusd` of a row's block against a
//! token's 32 activation bytes gives the row's 8 lanes. Each lane starts
//! at `-bias` times its 4 activation bytes' sum, made once per token and
//! block when the activations are prepared (shared by a product's row
//! tasks, [`prepare_chunk`]), not once per group.
//!
//! The float step per lane and block is `fma` with `d_w * d_a`. With two
//! rows per 512-bit vector that product took a multiply per pair of rows,
//! token and block, as many as the `vpdpbusd`s and `fma`s on the same
//! execution ports. Here each row's lanes sit in one 256-bit vector, and
//! the products of a group and a tile of tokens are formed 8 to a
//! multiply beforehand and reach the `fma` as a broadcast memory operand.
//!
//! The lanes are the exact integers of the scalar reference
//! (`scalar::lane_sums`), and the float steps per lane are its own: `fma`
//! with `d_w * d_a` per block, then `hsum8`, then the `m * s` sum for the
//! formats with a minimum. So every output is bit for bit what `vec_dot`
//! returns for its pair, which is llama.cpp's `vec_dot` order.

#![allow(clippy::missing_safety_doc)] // the `# Safety` of each function is stated below

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::avx2::f16_one;
use super::blocks::{
    iq4_value, BlockIQ4NL, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1,
};
use super::dispatch::TILE;
use super::scalar::hsum8;
use super::PreparedChunk;

/// Rows unpacked together.
pub(crate) const GROUP: usize = 8;
/// Tokens per register tile: 8 rows x 2 tokens of 8-lane accumulators.
const TOKENS: usize = 2;
const _: () = assert!(TILE.is_multiple_of(TOKENS));

/// A 32-element weight block the row-group and 8-row kernels can unpack.
pub(crate) trait Weights32: bytemuck::Pod {
    /// Added to every quant so that it is unsigned (`vpdpbusd` multiplies
    /// unsigned weight bytes by signed activation bytes).
    const BIAS: u8;
    /// The activation block this format pairs with.
    type Act: Act32;
    /// The biased quants, the scale and the minimum (0 without one).
    fn unpack(&self, q: &mut [u8; 32]) -> (f32, f32);
}

/// A 32-element 8-bit activation block (Q8_0 or Q8_1).
pub(crate) trait Act32: bytemuck::Pod {
    /// Whether the weight's `m * s` term applies (Q8_1).
    const HAS_MIN: bool;
    /// The f16 bits of the scale.
    fn d_bits(&self) -> [u8; 2];
    /// The f16 bits of `d * sum(q)` (Q8_1), else 0.
    fn s_bits(&self) -> [u8; 2];
    fn qs(&self) -> &[u8; 32];
}

impl Act32 for BlockQ8_0 {
    const HAS_MIN: bool = false;
    #[inline(always)]
    fn d_bits(&self) -> [u8; 2] {
        self.d
    }
    #[inline(always)]
    fn s_bits(&self) -> [u8; 2] {
        [0, 0]
    }
    #[inline(always)]
    fn qs(&self) -> &[u8; 32] {
        &self.qs
    }
}

impl Act32 for BlockQ8_1 {
    const HAS_MIN: bool = true;
    #[inline(always)]
    fn d_bits(&self) -> [u8; 2] {
        self.d
    }
    #[inline(always)]
    fn s_bits(&self) -> [u8; 2] {
        self.s
    }
    #[inline(always)]
    fn qs(&self) -> &[u8; 32] {
        &self.qs
    }
}

/// The 32 nibbles of a 4-bit block: the low ones first, then the high.
fn nibbles(qs: &[u8; 16], q: &mut [u8; 32]) {
    for (i, &b) in qs.iter().enumerate() {
        q[i] = b & 0x0F;
        q[i + 16] = b >> 4;
    }
}

/// The 32 quants of a 5-bit block: [`nibbles`] with bit `i` of `qh` as
/// element `i`'s fifth bit (a loop without branches, which compilers
/// vectorise).
#[inline(always)]
fn nibbles_and_fifth_bits(qs: &[u8; 16], qh: [u8; 4], q: &mut [u8; 32]) {
    nibbles(qs, q);
    let high = u32::from_le_bytes(qh);
    for (i, v) in q.iter_mut().enumerate() {
        *v |= (((high >> i) & 1) as u8) << 4;
    }
}

impl Weights32 for BlockQ4_0 {
    const BIAS: u8 = 8;
    type Act = BlockQ8_0;
    #[inline(always)]
    fn unpack(&self, q: &mut [u8; 32]) -> (f32, f32) {
        nibbles(&self.qs, q);
        (self.d(), 0.0)
    }
}

impl Weights32 for BlockQ4_1 {
    const BIAS: u8 = 0;
    type Act = BlockQ8_1;
    #[inline(always)]
    fn unpack(&self, q: &mut [u8; 32]) -> (f32, f32) {
        nibbles(&self.qs, q);
        (self.d(), self.m())
    }
}

impl Weights32 for BlockQ5_0 {
    const BIAS: u8 = 16;
    type Act = BlockQ8_0;
    #[inline(always)]
    fn unpack(&self, q: &mut [u8; 32]) -> (f32, f32) {
        nibbles_and_fifth_bits(&self.qs, self.qh, q);
        (self.d(), 0.0)
    }
}

impl Weights32 for BlockQ5_1 {
    const BIAS: u8 = 0;
    type Act = BlockQ8_1;
    #[inline(always)]
    fn unpack(&self, q: &mut [u8; 32]) -> (f32, f32) {
        nibbles_and_fifth_bits(&self.qs, self.qh, q);
        (self.d(), self.m())
    }
}

impl Weights32 for BlockQ8_0 {
    const BIAS: u8 = 128;
    type Act = BlockQ8_0;
    #[inline(always)]
    fn unpack(&self, q: &mut [u8; 32]) -> (f32, f32) {
        for (v, &b) in q.iter_mut().zip(&self.qs) {
            *v = b ^ 0x80;
        }
        (self.d(), 0.0)
    }
}

impl Weights32 for BlockIQ4NL {
    const BIAS: u8 = 128;
    type Act = BlockQ8_0;
    #[inline(always)]
    fn unpack(&self, q: &mut [u8; 32]) -> (f32, f32) {
        for (i, v) in q.iter_mut().enumerate() {
            *v = (iq4_value(&self.qs, i) + 128) as u8;
        }
        (self.d(), 0.0)
    }
}

/// One block of a group's 8 rows: each row's biased quants, then the
/// rows' scales and minimums.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct GroupBlock {
    q: [[u8; 32]; GROUP],
    d: [f32; GROUP],
    m: [f32; GROUP],
}

// The kernel's aligned loads rely on these offsets.
const _: () = assert!(std::mem::offset_of!(GroupBlock, d) % 32 == 0);
const _: () = assert!(std::mem::offset_of!(GroupBlock, m) % 32 == 0);

const EMPTY: GroupBlock = GroupBlock {
    q: [[0; 32]; GROUP],
    d: [0.0; GROUP],
    m: [0.0; GROUP],
};

/// One token's block as the kernel reads it: the 32 activation bytes and
/// each 4-byte lane's accumulator start, `-bias` times the lane's sum (what
/// the biased weight quants add), worked out once per token rather than
/// once per group of rows.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct TokenBlock {
    qs: [u8; 32],
    start: [i32; 8],
}

const _: () = assert!(std::mem::offset_of!(TokenBlock, start) % 32 == 0);

const EMPTY_TOKEN: TokenBlock = TokenBlock {
    qs: [0; 32],
    start: [0; 8],
};

/// Some tokens' activations prepared for one weight format's kernel: made
/// once per matrix product and shared by its row tasks ([`prepare_chunk`],
/// [`matmul_prepared`]), or per thread by [`matmul`].
#[derive(Default)]
pub struct TokenChunk {
    tokens: usize,
    /// `[token][block]`.
    blocks: Vec<TokenBlock>,
    /// `[token][block]`: the scale and `d * sum(q)` (0 without a minimum)
    /// as f32.
    scales: Vec<[f32; 2]>,
}

impl TokenChunk {
    /// Forgets the tokens (keeping the memory).
    pub(crate) fn clear(&mut self) {
        self.tokens = 0;
        self.blocks.clear();
        self.scales.clear();
    }

    /// Whether it holds `tokens` tokens of `nb` blocks, as [`prepare_chunk`]
    /// leaves it.
    pub(crate) fn holds(&self, tokens: usize, nb: usize) -> bool {
        self.tokens == tokens
            && self.blocks.len() == tokens * nb
            && self.scales.len() == tokens * nb
    }
}

/// Tokens prepared at once by [`matmul`] (72 bytes per token and block): a
/// long prompt's would otherwise stay allocated per thread, and unpacking
/// the rows once per 512 tokens costs what a 512-token batch pays anyway.
const TOKEN_CHUNK: usize = 512;
const _: () = assert!(TOKEN_CHUNK.is_multiple_of(TILE));

/// Per-thread scratch, reused across calls so that prefill does not
/// allocate per matrix.
#[derive(Default)]
struct Scratch {
    /// The unpacked group: `[block]`.
    group: Vec<GroupBlock>,
    /// A tile's scale products: `[block][token][row]`.
    products: Vec<[[f32; GROUP]; TOKENS]>,
    /// The tokens of [`matmul`], [`TOKEN_CHUNK`] at a time.
    tokens: TokenChunk,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Prepares `acts` (whole rows of `nb` blocks) for `W`'s kernel into `chunk`.
///
/// # Safety
/// The CPU must support AVX-512 F, VL and VNNI, AVX2 and F16C.
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,f16c")]
unsafe fn prepare_tokens<W: Weights32>(nb: usize, acts: &[W::Act], chunk: &mut TokenChunk) {
    let n = acts.len() / nb.max(1);
    chunk.tokens = n;
    chunk.blocks.resize(n * nb, EMPTY_TOKEN);
    chunk.scales.resize(n * nb, [0.0; 2]);
    for ((a, block), scales) in acts.iter().zip(&mut chunk.blocks).zip(&mut chunk.scales) {
        // SAFETY: the caller promises the features; every access goes
        // through a reference.
        unsafe {
            let q = _mm256_loadu_si256(a.qs().as_ptr() as *const __m256i);
            _mm256_store_si256(block.qs.as_mut_ptr() as *mut __m256i, q);
            _mm256_store_si256(
                block.start.as_mut_ptr() as *mut __m256i,
                lane_starts::<W>(q),
            );
            *scales = [
                _mm_cvtss_f32(f16_one(a.d_bits())),
                _mm_cvtss_f32(f16_one(a.s_bits())),
            ];
        }
    }
}

/// Prepares `acts` (whole activation rows of `nb` blocks of `W`'s
/// activation format) into `chunk` for [`matmul_prepared`].
///
/// # Safety
/// The CPU must support AVX-512 F, VL and VNNI, AVX2 and F16C.
pub(crate) unsafe fn prepare_chunk<W: Weights32>(
    nb: usize,
    acts: &[u8],
    chunk: &mut PreparedChunk,
) {
    // SAFETY: forwarded from the caller.
    unsafe { prepare_tokens::<W>(nb, bytemuck::cast_slice(acts), &mut chunk.blocks32) }
}

/// Unpacks rows `w[0..8]` (each `nb` blocks) into `group` (`[block]`).
fn unpack_group<W: Weights32>(w: &[W], nb: usize, group: &mut [GroupBlock]) {
    for (b, g) in group.iter_mut().enumerate().take(nb) {
        for row in 0..GROUP {
            (g.d[row], g.m[row]) = w[row * nb + b].unpack(&mut g.q[row]);
        }
    }
}

/// The scale products `d_w * d_a` of a group's rows with [`TOKENS`]
/// prepared tokens (`ys[t]`: each token's scales), `[block][token][row]`,
/// made before the tile's loop so that the loop reads each from memory
/// straight onto a row's 8 lanes.
///
/// # Safety
/// The CPU must support AVX2; each `ys[t]` must be readable for
/// `group.len()` entries.
#[target_feature(enable = "avx2")]
unsafe fn scale_products(
    group: &[GroupBlock],
    ys: [*const [f32; 2]; TOKENS],
    products: &mut [[[f32; GROUP]; TOKENS]],
) {
    for (b, (g, prod)) in group.iter().zip(products).enumerate() {
        // SAFETY: the caller promises the feature and that each token's
        // scales cover the group's blocks; the rest are references.
        unsafe {
            let d = _mm256_load_ps(g.d.as_ptr());
            for (t, prod) in prod.iter_mut().enumerate() {
                let dy = _mm256_set1_ps((*ys[t].add(b))[0]);
                _mm256_storeu_ps(prod.as_mut_ptr(), _mm256_mul_ps(d, dy));
            }
        }
    }
}

/// A tile's running sums: each row's 8 lanes per token, and the rows'
/// minimum terms per token.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct TileSums {
    lanes: [[[f32; 8]; GROUP]; TOKENS],
    mins: [[f32; GROUP]; TOKENS],
}

const ZERO_SUMS: TileSums = TileSums {
    lanes: [[[0.0; 8]; GROUP]; TOKENS],
    mins: [[0.0; GROUP]; TOKENS],
};

/// A group's 8 rows times [`TOKENS`] prepared tokens over some blocks
/// (`group`; `y[t]`, `ys[t]`: each token's blocks and scales from the
/// same block; `products` from [`scale_products`] for them), added to
/// `sums`. Each row's 8 lanes sit in one 256-bit vector, so that the
/// scale product reaches them from memory rather than through a multiply
/// per row and token. The sums stay in registers over the blocks; a row
/// too long for the first-level cache is taken a part at a time, with the
/// same additions in the same order.
///
/// # Safety
/// The CPU must support AVX-512 F, VL and VNNI, AVX2 and FMA; each `y[t]`
/// and `ys[t]` must be readable for `group.len()` entries, and `products`
/// hold as many.
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma")]
unsafe fn group_tile<W: Weights32>(
    group: &[GroupBlock],
    y: [*const TokenBlock; TOKENS],
    ys: [*const [f32; 2]; TOKENS],
    products: &[[[f32; GROUP]; TOKENS]],
    sums: &mut TileSums,
) {
    // SAFETY: the caller promises the CPU features and that every token's
    // pointers cover the group's blocks; all other reads go through
    // references.
    unsafe {
        let mut acc: [[__m256; GROUP]; TOKENS] = std::array::from_fn(|t| {
            std::array::from_fn(|r| _mm256_load_ps(sums.lanes[t][r].as_ptr()))
        });
        let mut min_acc: [__m256; TOKENS] =
            std::array::from_fn(|t| _mm256_load_ps(sums.mins[t].as_ptr()));
        for (b, (g, prod)) in group.iter().zip(products).enumerate() {
            let w: [__m256i; GROUP] =
                std::array::from_fn(|r| _mm256_load_si256(g.q[r].as_ptr() as *const __m256i));
            for t in 0..TOKENS {
                let yb = &*y[t].add(b);
                let act = _mm256_load_si256(yb.qs.as_ptr() as *const __m256i);
                let start = if W::BIAS == 0 {
                    _mm256_setzero_si256()
                } else {
                    _mm256_load_si256(yb.start.as_ptr() as *const __m256i)
                };
                for r in 0..GROUP {
                    let lanes = _mm256_dpbusd_epi32(start, w[r], act);
                    let dd = _mm256_set1_ps(prod[t][r]);
                    acc[t][r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(lanes), acc[t][r]);
                }
                if <W::Act as Act32>::HAS_MIN {
                    let m = _mm256_load_ps(g.m.as_ptr());
                    min_acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps((*ys[t].add(b))[1]), min_acc[t]);
                }
            }
        }
        for ((lanes, mins), (acc, min_acc)) in sums
            .lanes
            .iter_mut()
            .zip(&mut sums.mins)
            .zip(acc.iter().zip(&min_acc))
        {
            for (lanes, acc) in lanes.iter_mut().zip(acc) {
                _mm256_store_ps(lanes.as_mut_ptr(), *acc);
            }
            _mm256_store_ps(mins.as_mut_ptr(), *min_acc);
        }
    }
}

/// A tile's outputs from its sums: `hsum8` of each row's lanes, then its
/// minimum term for the formats with one (the scalar reference's last
/// steps).
fn finish_tile<W: Weights32>(sums: &TileSums) -> [[f32; GROUP]; TOKENS] {
    std::array::from_fn(|t| {
        std::array::from_fn(|r| {
            if <W::Act as Act32>::HAS_MIN {
                hsum8(&sums.lanes[t][r]) + sums.mins[t][r]
            } else {
                hsum8(&sums.lanes[t][r])
            }
        })
    })
}

/// Each 4-byte lane's accumulator start for a block's activation bytes
/// `act`: `-bias` times the lane's sum (what the biased weights add).
///
/// # Safety
/// The CPU must support AVX-512 VL and VNNI.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2")]
pub(crate) unsafe fn lane_starts<W: Weights32>(act: __m256i) -> __m256i {
    if W::BIAS == 0 {
        return _mm256_setzero_si256();
    }
    let bias = _mm256_set1_epi8(W::BIAS as i8);
    let biased = _mm256_dpbusd_epi32(_mm256_setzero_si256(), bias, act);
    _mm256_sub_epi32(_mm256_setzero_si256(), biased)
}

/// Rows `0..groups * 8` of `w` (`nb` blocks of `W` each) times tokens
/// `0..tiles * TILE` of `acts` (rows of `nb` activation blocks): writes
/// `out[t * out_stride + r]`, the bits of `vec_dot` for each pair. The
/// tokens are prepared [`TOKEN_CHUNK`] at a time in this thread's scratch.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2, FMA and F16C.
/// `w` must hold `groups * 8 * nb` blocks, `acts` `tiles * TILE * nb`, and
/// `out` at least `(tiles * TILE - 1) * out_stride + groups * 8` values.
pub(crate) unsafe fn matmul<W: Weights32>(
    nb: usize,
    w: &[u8],
    groups: usize,
    acts: &[u8],
    tiles: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let acts: &[W::Act] = bytemuck::cast_slice(acts);
    let n_tokens = tiles * TILE;
    SCRATCH.with_borrow_mut(|s| {
        let Scratch {
            group,
            products,
            tokens,
        } = s;
        for c0 in (0..n_tokens).step_by(TOKEN_CHUNK) {
            let c1 = (c0 + TOKEN_CHUNK).min(n_tokens);
            // SAFETY: the caller promises the features and the lengths;
            // the chunk is a multiple of TILE tokens.
            unsafe {
                prepare_tokens::<W>(nb, &acts[c0 * nb..c1 * nb], tokens);
                groups_times_chunks::<W>(
                    nb,
                    w,
                    groups,
                    std::slice::from_ref(tokens),
                    c0,
                    (group, products),
                    out,
                    out_stride,
                );
            }
        }
    });
}

/// [`matmul`] over tokens already prepared by [`prepare_chunk`] (each chunk
/// [`super::gemm_kquant::CHUNK_TOKENS`] tokens but the last, which may hold
/// fewer, a multiple of [`TILE`]).
///
/// # Safety
/// As [`matmul`]; every chunk must be made for `W` with `nb`.
pub(crate) unsafe fn matmul_prepared<W: Weights32>(
    nb: usize,
    w: &[u8],
    groups: usize,
    chunks: &[PreparedChunk],
    out: &mut [f32],
    out_stride: usize,
) {
    SCRATCH.with_borrow_mut(|s| {
        let Scratch {
            group, products, ..
        } = s;
        let chunks = chunks.iter().map(|c| &c.blocks32);
        // SAFETY: forwarded from the caller.
        unsafe {
            groups_times_chunks::<W>(nb, w, groups, chunks, 0, (group, products), out, out_stride)
        };
    });
}

/// Blocks a tile takes at a time: a group's part (320 bytes a block) and
/// its scale products stay near the core while the tiles of a run of
/// tokens pass over them. Measured on a Zen 4 core (`prefill_kernels`,
/// Q8_0, one thread, best of 6 alternating runs): the 2048 x 8192 (FFN
/// down) product at 3.43 ns per output and 256 weights in parts of 64
/// blocks, 3.59 in parts of 32 and 3.75 whole; 8192 x 2048 (64 blocks a
/// row) 3.29, 3.43 and 3.31.
const PART_BLOCKS: usize = 64;

/// Tokens whose tiles take a group's part in turn, their sums kept in
/// between.
const RUN_TOKENS: usize = 16;
const _: () = assert!(RUN_TOKENS.is_multiple_of(TOKENS) && TILE.is_multiple_of(TOKENS));

/// Each group of 8 rows of `w`, unpacked once, times every token of
/// `chunks` (token `first_token` onwards, in order).
///
/// # Safety
/// As [`matmul_prepared`], for tokens counted from `first_token`.
#[allow(clippy::too_many_arguments)] // the product's and the scratch's parts
unsafe fn groups_times_chunks<'a, W: Weights32>(
    nb: usize,
    w: &[u8],
    groups: usize,
    chunks: impl IntoIterator<Item = &'a TokenChunk> + Clone,
    first_token: usize,
    (group, products): (&mut Vec<GroupBlock>, &mut Vec<[[f32; GROUP]; TOKENS]>),
    out: &mut [f32],
    out_stride: usize,
) {
    let w: &[W] = bytemuck::cast_slice(w);
    group.resize(nb, EMPTY);
    products.resize(PART_BLOCKS.min(nb), [[0.0; GROUP]; TOKENS]);
    let mut sums = [ZERO_SUMS; RUN_TOKENS / TOKENS];
    for gi in 0..groups {
        unpack_group(&w[gi * GROUP * nb..(gi + 1) * GROUP * nb], nb, group);
        let mut t0 = first_token;
        for chunk in chunks.clone() {
            for run in (0..chunk.tokens).step_by(RUN_TOKENS) {
                let tiles = (chunk.tokens - run).min(RUN_TOKENS) / TOKENS;
                let sums = &mut sums[..tiles];
                sums.fill(ZERO_SUMS);
                for k0 in (0..nb).step_by(PART_BLOCKS) {
                    let part = &group[k0..(k0 + PART_BLOCKS).min(nb)];
                    for (i, sums) in sums.iter_mut().enumerate() {
                        let t = run + i * TOKENS;
                        let y = std::array::from_fn(|j| chunk.blocks[(t + j) * nb + k0..].as_ptr());
                        let ys =
                            std::array::from_fn(|j| chunk.scales[(t + j) * nb + k0..].as_ptr());
                        // SAFETY: the caller promises the features; each
                        // token of the chunk holds `nb` blocks and scales.
                        unsafe {
                            scale_products(part, ys, products);
                            group_tile::<W>(part, y, ys, products, sums);
                        }
                    }
                }
                for (i, sums) in sums.iter().enumerate() {
                    for (j, rows) in finish_tile::<W>(sums).iter().enumerate() {
                        let at = (t0 + run + i * TOKENS + j) * out_stride + gi * GROUP;
                        out[at..at + GROUP].copy_from_slice(rows);
                    }
                }
            }
            t0 += chunk.tokens;
        }
    }
}
