//! Prefill for the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//! IQ4_NL) with two weight rows per 512-bit vector (AVX-512 VNNI).
//!
//! The one-row kernels rebuild a block's signed quants for every tile of
//! tokens and form each 4-element lane with a sign trick and two
//! multiply-adds. Here a group of 8 rows is unpacked once per call into
//! biased unsigned bytes (`quant + bias`), two rows side by side, so one
//! `vpdpbusd` against the token's 32 activation bytes (in both halves)
//! gives the 8 lanes of two rows at once; its accumulator starts at
//! `-bias * (the lane's activation sum)`, which one more `vpdpbusd` per
//! token and block forms for all 8 rows.
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

/// Rows unpacked together (4 pairs).
pub(crate) const GROUP: usize = 8;
const PAIRS: usize = GROUP / 2;
/// Tokens per register tile: 4 pairs x 4 tokens of 16-lane accumulators.
const TOKENS: usize = 4;
const _: () = assert!(TILE.is_multiple_of(TOKENS));

/// A 32-element weight block the pair kernel can unpack.
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

/// One block of a pair of rows: row `2p` in bytes and lanes 0..8, row
/// `2p + 1` in the upper half.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct PairBlock {
    q: [u8; 64],
    d: [f32; 16],
}

// The kernel's aligned loads rely on this offset.
const _: () = assert!(std::mem::offset_of!(PairBlock, d) % 64 == 0);

const EMPTY: PairBlock = PairBlock {
    q: [0; 64],
    d: [0.0; 16],
};

thread_local! {
    /// The unpacked group (`[block][pair]`) and its minimums (`[block]`),
    /// reused across calls so that prefill does not allocate per matrix.
    static SCRATCH: RefCell<(Vec<PairBlock>, Vec<[f32; GROUP]>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Unpacks rows `w[0..8]` (each `nb` blocks) into `pairs` and `mins`.
fn unpack_group<W: Weights32>(
    w: &[W],
    nb: usize,
    pairs: &mut [PairBlock],
    mins: &mut [[f32; GROUP]],
) {
    let mut q = [0u8; 32];
    for b in 0..nb {
        for row in 0..GROUP {
            let (d, m) = w[row * nb + b].unpack(&mut q);
            let pb = &mut pairs[b * PAIRS + row / 2];
            let half = row % 2;
            pb.q[32 * half..32 * half + 32].copy_from_slice(&q);
            pb.d[8 * half..8 * half + 8].fill(d);
            mins[b][row] = m;
        }
    }
}

/// Four pairs of rows times [`TOKENS`] tokens (`y[t]`: each token's
/// blocks): `out[t][row]`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2, FMA and F16C; each
/// `y[t]` must be readable for `mins.len()` blocks, and `pairs` must hold
/// [`PAIRS`] entries per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn group_tile<W: Weights32>(
    pairs: &[PairBlock],
    mins: &[[f32; GROUP]],
    y: [*const W::Act; TOKENS],
) -> [[f32; GROUP]; TOKENS] {
    // SAFETY: the caller promises the CPU features and that every token's
    // pointer covers `mins.len()` blocks; all other reads go through
    // references.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); PAIRS]; TOKENS];
        let mut min_acc = [_mm256_setzero_ps(); TOKENS];
        for (b, (group, m)) in pairs.chunks_exact(PAIRS).zip(mins).enumerate() {
            let w = [0, 1, 2, 3].map(|p| _mm512_load_si512(group[p].q.as_ptr() as *const __m512i));
            let m = _mm256_loadu_ps(m.as_ptr());
            let d = [0, 1, 2, 3].map(|p| _mm512_load_ps(group[p].d.as_ptr()));
            for t in 0..TOKENS {
                block_step::<W>(&mut acc[t], &mut min_acc[t], (&w, &d, m), &*y[t].add(b));
            }
        }
        let mut out = [[0.0f32; GROUP]; TOKENS];
        for ((out, acc), min_acc) in out.iter_mut().zip(&acc).zip(&min_acc) {
            *out = finish_rows::<W>(acc, *min_acc);
        }
        out
    }
}

/// One block of one token against a group's 8 rows: the pairs' biased
/// quants, scales (each row's on its 8 lanes) and the rows' minimums,
/// into the token's lane and minimum accumulators.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL, VNNI, DQ, AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn block_step<W: Weights32>(
    acc: &mut [__m512; PAIRS],
    min_acc: &mut __m256,
    (w, d, m): (&[__m512i; PAIRS], &[__m512; PAIRS], __m256),
    yb: &W::Act,
) {
    // SAFETY: the caller promises the features; every read goes through
    // a reference.
    unsafe {
        let act = _mm512_broadcast_i64x4(_mm256_loadu_si256(yb.qs().as_ptr() as *const __m256i));
        // Each lane starts at -bias times its 4 activation bytes.
        let start = if W::BIAS == 0 {
            _mm512_setzero_si512()
        } else {
            let bias = _mm512_set1_epi8(W::BIAS as i8);
            let biased = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, act);
            _mm512_sub_epi32(_mm512_setzero_si512(), biased)
        };
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
pub(crate) unsafe fn finish_rows<W: Weights32>(
    acc: &[__m512; PAIRS],
    min_acc: __m256,
) -> [f32; GROUP] {
    let mut mins = [0.0f32; GROUP];
    let mut lanes = [0.0f32; GROUP * 8];
    // SAFETY: both arrays hold what is stored; the caller promises the
    // features.
    unsafe {
        _mm256_storeu_ps(mins.as_mut_ptr(), min_acc);
        for (p, pair) in acc.iter().enumerate() {
            _mm512_storeu_ps(lanes[16 * p..].as_mut_ptr(), *pair);
        }
    }
    let mut out = [0.0f32; GROUP];
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

/// Rows `0..groups * 8` of `w` (`nb` blocks of `W` each) times tokens
/// `0..tiles * TILE` of `acts` (rows of `nb` activation blocks): writes
/// `out[t * out_stride + r]`, the bits of `vec_dot` for each pair.
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
    let w: &[W] = bytemuck::cast_slice(w);
    let acts: &[W::Act] = bytemuck::cast_slice(acts);
    SCRATCH.with_borrow_mut(|(pairs, mins)| {
        pairs.resize(nb * PAIRS, EMPTY);
        mins.resize(nb, [0.0; GROUP]);
        for gi in 0..groups {
            unpack_group(&w[gi * GROUP * nb..(gi + 1) * GROUP * nb], nb, pairs, mins);
            for t0 in (0..tiles * TILE).step_by(TOKENS) {
                let y = std::array::from_fn(|t| acts[(t0 + t) * nb..].as_ptr());
                // SAFETY: the caller promises the features; each `y[t]`
                // points at the `nb` blocks of one token of the tile.
                let res = unsafe { group_tile::<W>(pairs, mins, y) };
                for (t, rows) in res.iter().enumerate() {
                    let at = (t0 + t) * out_stride + gi * GROUP;
                    out[at..at + GROUP].copy_from_slice(rows);
                }
            }
        }
    });
}
