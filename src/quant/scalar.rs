//! The scalar reference kernels: the specification every SIMD kernel is
//! tested against, and the fallback on machines without one.
//!
//! Integer parts of a dot product are exact, so only the float steps fix the
//! result; they are written out one block at a time, in block order. The
//! K-quant kernels do all per-super-block work in integers and then apply
//! exactly the float steps written here, so the SIMD K-quant kernels agree
//! with these bit for bit.
//!
//! Activation quantization follows llama.cpp's x86 SIMD quantizers (what it
//! runs on the machines inferd is compared on): Q8_0/Q8_1 multiply by
//! `127 / amax` and round half to even; Q8_K rounds half to even
//! (`nearest_int`) with the scale chosen from the signed maximum.
//!
//! Every quantized dot and the f16 dot fix the float summation order of
//! llama.cpp's x86 kernels: its batched path where its one-token and
//! batched kernels differ (IQ4_NL), and for the K-quants its `vec_dot`
//! kernels (from 8 tokens in a batch on, llama.cpp multiplies K-quants with
//! a tiled kernel in another order; see `docs/ARCHITECTURE.md`). The
//! 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) use 8 lanes,
//! lane `j` holding the integer sum of elements `4j..4j+4` of each block,
//! accumulated across blocks with fused multiply-adds and reduced as
//! `hsum8` does (the f16 dot: 16 lanes by element index, fused
//! multiply-adds, reduced as `reduce16` does). The K-quant dots keep the
//! same 8 lanes across super-blocks, as llama.cpp's AVX2 kernels for them
//! do: lane `m` sums elements `4m..4m+4` of every 32-element run, each
//! scaled by its sub-block scale, and one fused multiply-add per
//! super-block adds it to the lane's float accumulator. Their minimum or
//! offset terms follow each kernel's own arrangement: Q2_K fuses its
//! minimum lanes into the same accumulator first, Q4_K keeps 4 minimum
//! lanes in a second accumulator, Q5_K one fused scalar, and Q6_K subtracts
//! its `-32` offset from the integer lanes before the float step.
//! The exponential is ggml's vectorised `expf` approximation, element by
//! element.

use bytemuck::Zeroable;
use half::{bf16, f16};

use super::blocks::{
    scales_mins_k4, scales_q3k, BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0,
    BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1, QK32,
};
use super::types::QK_K;

// ---------------------------------------------------------------------------
// Activation quantization
// ---------------------------------------------------------------------------

/// Scale of a Q8_0/Q8_1 block with largest magnitude `amax`, and its inverse
/// (0 for an all-zero block).
#[inline(always)]
pub(crate) fn q8_scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    (d, id)
}

/// Quantizes `x` (32 elements per block) to Q8_0.
pub fn quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    for (xb, yb) in x.chunks_exact(QK32).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (d, id) = q8_scale(amax);
        yb.d = f16::from_f32(d).to_le_bytes();
        for (q, v) in yb.qs.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8 as u8;
        }
    }
}

/// Quantizes `x` (32 elements per block) to Q8_1, storing `s = d * sum(q)`.
pub fn quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    for (xb, yb) in x.chunks_exact(QK32).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (d, id) = q8_scale(amax);
        let mut sum = 0i32;
        for (q, v) in yb.qs.iter_mut().zip(xb) {
            let r = (v * id).round_ties_even() as i8;
            sum += r as i32;
            *q = r as u8;
        }
        yb.d = f16::from_f32(d).to_le_bytes();
        yb.s = f16::from_f32(sum as f32 * d).to_le_bytes();
    }
}

/// The value with the largest magnitude in `x` (the first one on ties), as
/// llama.cpp's Q8_K quantizer picks it.
#[inline(always)]
pub(crate) fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Fills a Q8_K block's 16-element sums from its quants.
#[inline(always)]
pub(crate) fn fill_q8k_bsums(b: &mut BlockQ8K) {
    for g in 0..QK_K / 16 {
        let s: i32 = b.qs[16 * g..16 * g + 16]
            .iter()
            .map(|&q| q as i8 as i32)
            .sum();
        b.bsums[g] = (s as i16).to_le_bytes();
    }
}

/// Quantizes `x` (256 elements per block) to Q8_K.
pub fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    for (xb, yb) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let max = signed_absmax(xb);
        if max == 0.0 {
            *yb = BlockQ8K::zeroed();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, v) in yb.qs.iter_mut().zip(xb) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8 as u8;
        }
        fill_q8k_bsums(yb);
        yb.d = (1.0 / iscale).to_le_bytes();
    }
}

// ---------------------------------------------------------------------------
// Dequantization
// ---------------------------------------------------------------------------

/// Q4_0 to f32.
pub fn dequantize_q4_0(src: &[BlockQ4_0], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK32)) {
        let d = b.d();
        for j in 0..16 {
            y[j] = ((b.qs[j] & 0x0F) as i32 - 8) as f32 * d;
            y[j + 16] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// Q4_1 to f32.
pub fn dequantize_q4_1(src: &[BlockQ4_1], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK32)) {
        let (d, m) = (b.d(), b.m());
        for j in 0..16 {
            y[j] = (b.qs[j] & 0x0F) as f32 * d + m;
            y[j + 16] = (b.qs[j] >> 4) as f32 * d + m;
        }
    }
}

/// Q5_0 to f32.
pub fn dequantize_q5_0(src: &[BlockQ5_0], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK32)) {
        let d = b.d();
        for (i, v) in y.iter_mut().enumerate() {
            *v = (b.q(i) as i32 - 16) as f32 * d;
        }
    }
}

/// Q5_1 to f32 (multiply, then add: ggml's dequantizer is not fused).
pub fn dequantize_q5_1(src: &[BlockQ5_1], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK32)) {
        let (d, m) = (b.d(), b.m());
        for (i, v) in y.iter_mut().enumerate() {
            *v = b.q(i) as f32 * d + m;
        }
    }
}

/// IQ4_NL to f32.
pub fn dequantize_iq4_nl(src: &[BlockIQ4NL], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK32)) {
        let d = b.d();
        for (i, v) in y.iter_mut().enumerate() {
            *v = d * b.value(i) as f32;
        }
    }
}

/// Q8_0 to f32.
pub fn dequantize_q8_0(src: &[BlockQ8_0], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK32)) {
        let d = b.d();
        for (j, v) in y.iter_mut().enumerate() {
            *v = b.q(j) as f32 * d;
        }
    }
}

/// Q8_1 to f32.
pub fn dequantize_q8_1(src: &[BlockQ8_1], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK32)) {
        let d = b.d();
        for (j, v) in y.iter_mut().enumerate() {
            *v = b.q(j) as f32 * d;
        }
    }
}

/// Q2_K to f32: per sub-block `d * sc` and `dmin * m` first, as ggml does.
pub fn dequantize_q2_k(src: &[BlockQ2K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d(), b.dmin());
        for (j, ys) in y.chunks_exact_mut(16).enumerate() {
            let dl = d * (b.scales[j] & 0x0F) as f32;
            let ml = dmin * (b.scales[j] >> 4) as f32;
            for (l, v) in ys.iter_mut().enumerate() {
                *v = dl * b.q(16 * j + l) as f32 - ml;
            }
        }
    }
}

/// Q3_K to f32.
pub fn dequantize_q3_k(src: &[BlockQ3K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = b.d();
        let sc = scales_q3k(&b.scales);
        for (j, ys) in y.chunks_exact_mut(16).enumerate() {
            let dl = d * sc[j] as f32;
            for (l, v) in ys.iter_mut().enumerate() {
                *v = dl * b.q(16 * j + l) as f32;
            }
        }
    }
}

/// IQ4_XS to f32.
pub fn dequantize_iq4_xs(src: &[BlockIQ4XS], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = b.d();
        for (j, ys) in y.chunks_exact_mut(32).enumerate() {
            let dl = d * b.scale(j) as f32;
            for (l, v) in ys.iter_mut().enumerate() {
                *v = dl * b.value(32 * j + l) as f32;
            }
        }
    }
}

/// Q4_K to f32.
pub fn dequantize_q4_k(src: &[BlockQ4K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d(), b.dmin());
        let (sc, mn) = scales_mins_k4(&b.scales);
        for c in 0..4 {
            let (d1, m1) = (d * sc[2 * c] as f32, dmin * mn[2 * c] as f32);
            let (d2, m2) = (d * sc[2 * c + 1] as f32, dmin * mn[2 * c + 1] as f32);
            for l in 0..32 {
                let q = b.qs[32 * c + l];
                y[64 * c + l] = d1 * (q & 0x0F) as f32 - m1;
                y[64 * c + 32 + l] = d2 * (q >> 4) as f32 - m2;
            }
        }
    }
}

/// Q5_K to f32.
pub fn dequantize_q5_k(src: &[BlockQ5K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d(), b.dmin());
        let (sc, mn) = scales_mins_k4(&b.scales);
        for c in 0..4 {
            let (d1, m1) = (d * sc[2 * c] as f32, dmin * mn[2 * c] as f32);
            let (d2, m2) = (d * sc[2 * c + 1] as f32, dmin * mn[2 * c + 1] as f32);
            for l in 0..32 {
                let q = b.qs[32 * c + l];
                let h = b.qh[l];
                let lo = (q & 0x0F) | (((h >> (2 * c)) & 1) << 4);
                let hi = (q >> 4) | (((h >> (2 * c + 1)) & 1) << 4);
                y[64 * c + l] = d1 * lo as f32 - m1;
                y[64 * c + 32 + l] = d2 * hi as f32 - m2;
            }
        }
    }
}

/// The 256 six-bit quants of a Q6_K super-block, offset to -32..32.
#[inline(always)]
pub(crate) fn q6k_quants(b: &BlockQ6K) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for h in 0..2 {
        let ql = &b.ql[64 * h..64 * h + 64];
        let qh = &b.qh[32 * h..32 * h + 32];
        let y = &mut q[128 * h..128 * h + 128];
        for l in 0..32 {
            y[l] = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
            y[l + 32] = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            y[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            y[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    q
}

/// Q6_K to f32.
pub fn dequantize_q6_k(src: &[BlockQ6K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = b.d();
        let q = q6k_quants(b);
        for (i, v) in y.iter_mut().enumerate() {
            *v = d * (b.scales[i / 16] as i8) as f32 * q[i] as f32;
        }
    }
}

/// Q8_K to f32.
pub fn dequantize_q8_k(src: &[BlockQ8K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = b.d();
        for (j, v) in y.iter_mut().enumerate() {
            *v = d * b.q(j) as f32;
        }
    }
}

// ---------------------------------------------------------------------------
// Dot products
// ---------------------------------------------------------------------------

/// Q4_0 weights × Q8_0 activations, in the lane order of Q8_0 (llama.cpp's
/// x86 `vec_dot` and its batched tinyBLAS path both sum Q4_0 that way).
pub fn dot_q4_0_q8_0(w: &[BlockQ4_0], a: &[BlockQ8_0]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in w.iter().zip(a) {
        let q = |k: usize| {
            let b = x.qs[k % 16];
            (if k < 16 { b & 0x0F } else { b >> 4 }) as i32 - 8
        };
        accumulate_lanes(&mut acc, x.d() * y.d(), lane_sums(q, |k| y.q(k)));
    }
    hsum8(&acc)
}

/// Horizontal sum of 8 lanes: `(l0+l4)+(l2+l6)` plus `(l1+l5)+(l3+l7)`,
/// the order of llama.cpp's `hsum_float_8`.
#[inline(always)]
pub(crate) fn hsum8(l: &[f32; 8]) -> f32 {
    let r = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// Horizontal sum of 16 lanes in the order of GCC's `_mm512_reduce_add_ps`
/// (upper half onto lower, then as [`hsum8`]).
#[inline(always)]
pub fn reduce16(l: &[f32; 16]) -> f32 {
    let mut h = [0.0f32; 8];
    for (i, v) in h.iter_mut().enumerate() {
        *v = l[i] + l[i + 8];
    }
    hsum8(&h)
}

/// Integer dot of lane `j` of a 32-element block: elements `4j..4j+4`.
#[inline(always)]
fn lane_sums(w: impl Fn(usize) -> i32, a: impl Fn(usize) -> i32) -> [f32; 8] {
    let mut out = [0.0f32; 8];
    for (j, o) in out.iter_mut().enumerate() {
        *o = (4 * j..4 * j + 4).map(|k| w(k) * a(k)).sum::<i32>() as f32;
    }
    out
}

/// Q4_1 weights × Q8_1 activations.
pub fn dot_q4_1_q8_1(w: &[BlockQ4_1], a: &[BlockQ8_1]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut mins = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let q = |k: usize| {
            let b = x.qs[k % 16];
            (if k < 16 { b & 0x0F } else { b >> 4 }) as i32
        };
        let xy = lane_sums(q, |k| y.q(k));
        let dd = x.d() * y.d();
        for (acc, xy) in acc.iter_mut().zip(xy) {
            *acc = dd.mul_add(xy, *acc);
        }
        mins = x.m().mul_add(y.s(), mins);
    }
    hsum8(&acc) + mins
}

/// Q8_0 weights × Q8_0 activations.
pub fn dot_q8_0_q8_0(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in w.iter().zip(a) {
        let xy = lane_sums(|k| x.q(k), |k| y.q(k));
        let dd = x.d() * y.d();
        for (acc, xy) in acc.iter_mut().zip(xy) {
            *acc = dd.mul_add(xy, *acc);
        }
    }
    hsum8(&acc)
}

/// `acc[j] = fma(dd, xy[j], acc[j])`: one block's step in the 8-lane order.
#[inline(always)]
fn accumulate_lanes(acc: &mut [f32; 8], dd: f32, xy: [f32; 8]) {
    for (acc, xy) in acc.iter_mut().zip(xy) {
        *acc = dd.mul_add(xy, *acc);
    }
}

/// Q5_0 weights × Q8_0 activations, in the lane order of Q8_0 (llama.cpp's
/// x86 kernels and its batched tinyBLAS path sum Q5_0 that way too).
pub fn dot_q5_0_q8_0(w: &[BlockQ5_0], a: &[BlockQ8_0]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in w.iter().zip(a) {
        let xy = lane_sums(|k| x.q(k) as i32 - 16, |k| y.q(k));
        accumulate_lanes(&mut acc, x.d() * y.d(), xy);
    }
    hsum8(&acc)
}

/// Q5_1 weights × Q8_1 activations, in the order of Q4_1: the lanes plus
/// the fused sum of `m * s` over the blocks.
pub fn dot_q5_1_q8_1(w: &[BlockQ5_1], a: &[BlockQ8_1]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut mins = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let xy = lane_sums(|k| x.q(k) as i32, |k| y.q(k));
        accumulate_lanes(&mut acc, x.d() * y.d(), xy);
        mins = x.m().mul_add(y.s(), mins);
    }
    hsum8(&acc) + mins
}

/// IQ4_NL weights × Q8_0 activations, in the lane order of Q8_0: the order
/// of llama.cpp's batched (tinyBLAS) path. Its one-token `vec_dot` splits
/// even and odd blocks over two accumulators instead; a batch-invariant
/// kernel can follow only one, and the batched path is the one inferd
/// matches elsewhere.
pub fn dot_iq4_nl_q8_0(w: &[BlockIQ4NL], a: &[BlockQ8_0]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in w.iter().zip(a) {
        let xy = lane_sums(|k| x.value(k), |k| y.q(k));
        accumulate_lanes(&mut acc, x.d() * y.d(), xy);
    }
    hsum8(&acc)
}

/// The 8 integer lanes of one super-block product in the order llama.cpp's
/// AVX2 K-quant kernels build them: lane `m` sums, over the 8 runs of 32
/// elements, elements `4m..4m+4` of each run, each product times its
/// sub-block scale. `q` holds the weight quants of the 256 elements, `sc`
/// the scale of each 16-element group (a 32-element sub-block's scale
/// twice).
#[inline(always)]
pub(crate) fn k_lanes(q: &[i8; QK_K], sc: &[i32; 16], y: &BlockQ8K) -> [i32; 8] {
    // Integer sums are exact in any order: gather each element position of
    // the runs first (a form compilers vectorise), then the lanes. Each
    // quant-activation product, and each scale, fits in i16.
    let mut by_pos = [0i32; 32];
    for (r, (qr, yr)) in q.chunks_exact(32).zip(y.qs.chunks_exact(32)).enumerate() {
        let s = [sc[2 * r] as i16, sc[2 * r + 1] as i16];
        for (i, p) in by_pos.iter_mut().enumerate() {
            let prod = qr[i] as i16 * yr[i] as i8 as i16;
            *p += prod as i32 * s[i / 16] as i32;
        }
    }
    std::array::from_fn(|m| by_pos[4 * m..4 * m + 4].iter().sum())
}

/// The scales of the 16-element groups when each 32-element sub-block `j`
/// has scale `sc(j)`.
#[inline(always)]
fn group_scales_32(sc: impl Fn(usize) -> i32) -> [i32; 16] {
    std::array::from_fn(|g| sc(g / 2))
}

/// `acc[m] = fma(d, lanes[m], acc[m])`: one super-block's float step in
/// the 8-lane order shared by the Q2_K, Q3_K and IQ4_XS dots.
#[inline(always)]
pub(crate) fn k_lanes_accumulate(acc: &mut [f32; 8], d: f32, lanes: [i32; 8]) {
    for (acc, l) in acc.iter_mut().zip(lanes) {
        *acc = d.mul_add(l as f32, *acc);
    }
}

/// Lane `m` of a Q2_K super-block's minimum term: the minimums of
/// sub-blocks `2m` and `2m + 1` times their activation sums.
#[inline(always)]
pub(crate) fn q2k_min_lanes(x: &BlockQ2K, y: &BlockQ8K) -> [i32; 8] {
    std::array::from_fn(|m| {
        (x.scales[2 * m] >> 4) as i32 * y.bsum(2 * m)
            + (x.scales[2 * m + 1] >> 4) as i32 * y.bsum(2 * m + 1)
    })
}

/// Q2_K weights × Q8_K activations, in the float order of llama.cpp's AVX2
/// kernel: per super-block, the minimum lanes are fused into the
/// accumulator with `-(da * dmin)`, then the quant lanes with `da * d`;
/// the 8 lanes are reduced by [`hsum8`] at the end.
pub fn dot_q2_k_q8_k(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in w.iter().zip(a) {
        let q = std::array::from_fn(|e| x.q(e) as i8);
        let sc = std::array::from_fn(|g| (x.scales[g] & 0x0F) as i32);
        let sumi = k_lanes(&q, &sc, y);
        k_lanes_accumulate(&mut acc, -(y.d() * x.dmin()), q2k_min_lanes(x, y));
        k_lanes_accumulate(&mut acc, y.d() * x.d(), sumi);
    }
    hsum8(&acc)
}

/// Q3_K weights × Q8_K activations, in the float order of llama.cpp's AVX2
/// kernel (one fused step of the 8 lanes per super-block, then [`hsum8`]).
pub fn dot_q3_k_q8_k(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in w.iter().zip(a) {
        let q = std::array::from_fn(|e| x.q(e) as i8);
        let sc = scales_q3k(&x.scales).map(i32::from);
        let sumi = k_lanes(&q, &sc, y);
        k_lanes_accumulate(&mut acc, y.d() * x.d(), sumi);
    }
    hsum8(&acc)
}

/// IQ4_XS weights × Q8_K activations, in the float order of llama.cpp's
/// AVX2 kernel (one fused step of the 8 lanes per super-block, then
/// [`hsum8`]).
pub fn dot_iq4_xs_q8_k(w: &[BlockIQ4XS], a: &[BlockQ8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in w.iter().zip(a) {
        let q = std::array::from_fn(|e| x.value(e) as i8);
        let sumi = k_lanes(&q, &group_scales_32(|j| x.scale(j)), y);
        k_lanes_accumulate(&mut acc, x.d() * y.d(), sumi);
    }
    hsum8(&acc)
}

/// Horizontal sum of 4 lanes: `(l0+l2)+(l1+l3)`, the order in which
/// llama.cpp's Q4_K kernel reduces its minimum accumulator.
#[inline(always)]
pub(crate) fn hsum4(l: &[f32; 4]) -> f32 {
    (l[0] + l[2]) + (l[1] + l[3])
}

/// The 4 integer lanes of a Q4_K super-block's minimum term, as llama.cpp's
/// AVX2 kernel forms them (`madd` of the mins with the 32-element activation
/// sums): lane `k` is `mins[2k] * S(2k) + mins[2k+1] * S(2k+1)`, where `S(j)`
/// sums the activation quants of sub-block `j`.
#[inline(always)]
pub(crate) fn k4_min_lanes(mins: &[u8; 8], y: &BlockQ8K) -> [i32; 4] {
    let s = |j: usize| y.bsum(2 * j) + y.bsum(2 * j + 1);
    std::array::from_fn(|k| mins[2 * k] as i32 * s(2 * k) + mins[2 * k + 1] as i32 * s(2 * k + 1))
}

/// Sum over the 8 sub-blocks of `min * (sum of the 32 activation quants)`.
#[inline(always)]
fn k4_min_sum(mins: &[u8; 8], y: &BlockQ8K) -> i32 {
    k4_min_lanes(mins, y).iter().sum()
}

/// The 256 quants of a Q4_K or Q5_K super-block: the nibbles of `qs`
/// (chunk `c` holds elements `64c..64c+32` in its low nibbles, the next 32
/// in its high ones) plus 16 where bit `2c` (`2c + 1` for the high
/// nibbles) of `qh[l]` is set, when given.
#[inline(always)]
fn k4_quants(qs: &[u8; QK_K / 2], qh: Option<&[u8; QK_K / 8]>) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for c in 0..4 {
        for l in 0..32 {
            let b = qs[32 * c + l];
            let h = qh.map_or(0, |qh| qh[l] >> (2 * c));
            q[64 * c + l] = ((b & 0x0F) | ((h & 1) << 4)) as i8;
            q[64 * c + 32 + l] = ((b >> 4) | (((h >> 1) & 1) << 4)) as i8;
        }
    }
    q
}

/// Q4_K weights × Q8_K activations, in the float order of llama.cpp's AVX2
/// kernel: per super-block, the 8 quant lanes are fused into the
/// accumulator with `da * d`, and the 4 minimum lanes ([`k4_min_lanes`])
/// into a second accumulator with `-da * dmin`; at the end
/// `hsum8(acc) + hsum4(acc_min)`.
pub fn dot_q4_k_q8_k(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut acc_min = [0.0f32; 4];
    for (x, y) in w.iter().zip(a) {
        let (sc, mn) = scales_mins_k4(&x.scales);
        let d = y.d() * x.d();
        let dmin = -y.d() * x.dmin();
        for (acc, m) in acc_min.iter_mut().zip(k4_min_lanes(&mn, y)) {
            *acc = dmin.mul_add(m as f32, *acc);
        }
        let sc = group_scales_32(|j| sc[j] as i32);
        k_lanes_accumulate(&mut acc, d, k_lanes(&k4_quants(&x.qs, None), &sc, y));
    }
    hsum8(&acc) + hsum4(&acc_min)
}

/// Q5_K weights × Q8_K activations, in the float order of llama.cpp's AVX2
/// kernel: the 8 quant lanes as in Q4_K; the minimum term of each
/// super-block summed exactly and fused into one scalar with `-da * dmin`;
/// at the end `hsum8(acc) + mins`.
pub fn dot_q5_k_q8_k(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut mins = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let (sc, mn) = scales_mins_k4(&x.scales);
        let d = y.d() * x.d();
        let dmin = -y.d() * x.dmin();
        mins = dmin.mul_add(k4_min_sum(&mn, y) as f32, mins);
        let sc = group_scales_32(|j| sc[j] as i32);
        k_lanes_accumulate(&mut acc, d, k_lanes(&k4_quants(&x.qs, Some(&x.qh)), &sc, y));
    }
    hsum8(&acc) + mins
}

/// The 8 integer lanes of a Q6_K super-block product as llama.cpp's AVX2
/// kernel forms them: the [`k_lanes`] of the unsigned quants (0..64) times
/// their scales, minus, in lane `m`, `32 * (scale * activation sum)` of the
/// 16-element groups `2m` and `2m + 1` (the `-32` offset, applied per
/// group pair rather than per element, so the lanes differ from those of
/// the signed quants; only their total agrees).
#[inline(always)]
pub(crate) fn q6k_lanes(x: &BlockQ6K, y: &BlockQ8K) -> [i32; 8] {
    let q = q6k_quants(x).map(|v| v + 32);
    let sc = x.scales.map(|s| s as i8 as i32);
    let mut lanes = k_lanes(&q, &sc, y);
    for (m, l) in lanes.iter_mut().enumerate() {
        *l -= 32 * (y.bsum(2 * m) * sc[2 * m] + y.bsum(2 * m + 1) * sc[2 * m + 1]);
    }
    lanes
}

/// Q6_K weights × Q8_K activations, in the float order of llama.cpp's AVX2
/// kernel: one fused step of the 8 lanes ([`q6k_lanes`]) per super-block,
/// then [`hsum8`]. A lane can exceed 2^24, so its conversion to f32 may
/// round: the lanes themselves, not only their sum, must be llama.cpp's.
pub fn dot_q6_k_q8_k(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in w.iter().zip(a) {
        k_lanes_accumulate(&mut acc, y.d() * x.d(), q6k_lanes(x, y));
    }
    hsum8(&acc)
}

// The table runs the byte-pointer twin of this in `dispatch.rs`; this
// typed form states the order and is what the tests compare against.
#[cfg_attr(not(test), allow(dead_code))]
/// f16 × f16: element `i` is fused-multiply-added into lane `i % 16`, the
/// lanes reduced by [`reduce16`] (the order of llama.cpp's tinyBLAS f16
/// kernel on AVX-512, which its prefill attention runs).
pub fn dot_f16(a: &[f16], b: &[f16]) -> f32 {
    let mut acc = [0.0f32; 16];
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        acc[i % 16] = x.to_f32().mul_add(y.to_f32(), acc[i % 16]);
    }
    reduce16(&acc)
}

// The table runs the byte-pointer twin of this in `dispatch.rs`; this
// typed form states the order and is what the tests compare against.
#[cfg_attr(not(test), allow(dead_code))]
/// bf16 × bf16, accumulated in f32 in element order.
pub fn dot_bf16(a: &[bf16], b: &[bf16]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |s, (x, y)| s + x.to_f32() * y.to_f32())
}

// The table runs the byte-pointer twin of this in `dispatch.rs`; this
// typed form states the order and is what the tests compare against.
#[cfg_attr(not(test), allow(dead_code))]
/// f32 × f32 in element order.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |s, (x, y)| s + x * y)
}

/// `x = f32(f16(x * scale))` in place: attention weights rounded as the
/// f16 values ggml multiplies the V cache by.
pub fn scale_round_f16(x: &mut [f32], scale: f32) {
    for v in x {
        *v = f16::from_f32(*v * scale).to_f32();
    }
}

/// `y = fma(a, x, y)` element-wise.
pub fn axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
    for (yv, xv) in y.iter_mut().zip(x) {
        *yv = a.mul_add(xv.to_f32(), *yv);
    }
}

// ---------------------------------------------------------------------------
// ggml's exponential
// ---------------------------------------------------------------------------

/// Constants of ggml's vectorised `expf` (a minimax polynomial after
/// reduction by `ln 2`), as f32 bit patterns.
pub(crate) mod exp_consts {
    /// 1.5 * 2^23: adding it rounds to an integer.
    pub const SHIFTER: u32 = 0x4b40_0000;
    /// log2(e).
    pub const LOG2E: u32 = 0x3fb8_aa3b;
    /// ln 2, high part.
    pub const LN2_HI: u32 = 0x3f31_7200;
    /// ln 2, low part.
    pub const LN2_LO: u32 = 0x35bf_be8e;
    /// Polynomial coefficients, degree 5 down to 1.
    pub const C5: u32 = 0x3c07_2010;
    pub const C4: u32 = 0x3d2b_9f17;
    pub const C3: u32 = 0x3e2a_af33;
    pub const C2: u32 = 0x3eff_fedb;
    pub const C1: u32 = 0x3f7f_fff6;
}

/// The mantissa part `j` and the power of two `n` of ggml's `expf(x)`:
/// the result is `j * 2^n` unless `|n| > 192`.
#[inline(always)]
pub(crate) fn exp_parts(x: f32) -> (f32, f32) {
    use exp_consts::*;
    let c = f32::from_bits;
    let z = x.mul_add(c(LOG2E), c(SHIFTER));
    let n = z - c(SHIFTER);
    let b = (-n).mul_add(c(LN2_LO), (-n).mul_add(c(LN2_HI), x));
    let u = b * b;
    let j = c(C5).mul_add(b, c(C4)).mul_add(u, c(C3).mul_add(b, c(C2)));
    let j = j.mul_add(u, c(C1).mul_add(b, 1.0));
    (j, n)
}

/// `j * 2^n` rounded once, as `vscalefps` does (`n` is an integer with
/// `|n| <= 192`, so the f64 product is exact).
#[inline(always)]
pub(crate) fn scale_pow2(j: f32, n: f32) -> f32 {
    let p = f64::from_bits(((n as i64 + 1023) as u64) << 52);
    (j as f64 * p) as f32
}

/// ggml's `expf` approximation (AVX-512 form) of one value.
pub fn exp_ggml(x: f32) -> f32 {
    let (j, n) = exp_parts(x);
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    scale_pow2(j, n)
}

/// `x = exp_ggml(x)` element-wise.
pub fn exp_ggml_in_place(x: &mut [f32]) {
    for v in x {
        *v = exp_ggml(*v);
    }
}

/// `gate = silu(gate) * up` with ggml's `silu(x) = x / (1 + exp(-x))`.
pub fn swiglu_ggml(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp_ggml(0.0 - *g)) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn q8_1_rounds_half_to_even_and_stores_sum() {
        // amax 127 gives id = 1, so x * id is x itself: 2.5 -> 2, -3.5 -> -4.
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 0.49;
        let mut out = [BlockQ8_1::zeroed()];
        quantize_q8_1(&x, &mut out);
        assert_eq!(out[0].d(), 1.0);
        assert_eq!(
            (out[0].q(0), out[0].q(1), out[0].q(2), out[0].q(3)),
            (127, 2, -4, 0)
        );
        assert_eq!(out[0].s(), 125.0);
    }

    #[test]
    fn q8_scale_inverse_is_127_over_amax() {
        // 1 / (amax / 127) and 127 / amax differ in the last bit for 0.3.
        let (d, id) = q8_scale(0.3);
        assert_eq!(id, 127.0f32 / 0.3);
        assert_ne!(id, 1.0 / d);
    }

    #[test]
    fn lane_order_sums_match_hand_values() {
        let l: [f32; 16] = std::array::from_fn(|i| (i + 1) as f32);
        assert_eq!(reduce16(&l), 136.0);
        // 1e8 + 1 - 1e8: the grouping decides whether the 1 survives.
        let mut h = [0.0f32; 8];
        h[0] = 1e8;
        h[4] = 1.0;
        h[2] = -1e8;
        assert_eq!(hsum8(&h), 0.0); // (1e8 + 1) rounds to 1e8 first
        h[4] = 0.0;
        h[1] = 1.0;
        assert_eq!(hsum8(&h), 1.0);
    }

    #[test]
    fn ggml_exp_is_close_to_exp_and_saturates() {
        for &x in &[-20.0f32, -1.5, -0.1, 0.0, 0.7, 3.0, 60.0] {
            let rel = (exp_ggml(x) as f64 / (x as f64).exp() - 1.0).abs();
            assert!(rel < 4e-7, "exp_ggml({x}) off by {rel}");
        }
        assert_eq!(exp_ggml(0.0), 1.0);
        assert_eq!(exp_ggml(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_ggml(-200.0), 0.0);
        assert_eq!(exp_ggml(200.0), f32::INFINITY);
        // Subnormal results round once.
        let tiny = exp_ggml(-100.0);
        assert!(tiny > 0.0 && tiny < f32::MIN_POSITIVE);
        let mut g = [1.0f32, -2.0];
        swiglu_ggml(&mut g, &[2.0, 1.0]);
        assert!((g[0] - 2.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn q8_k_uses_signed_max_and_ties_to_even() {
        // A signed maximum of -127 gives iscale = -127 / -127 = 1 and d = 1.
        let mut x = [0.0f32; 256];
        x[0] = -127.0;
        x[1] = 2.5;
        x[2] = 3.5;
        x[17] = 1.0;
        let mut out = [BlockQ8K::zeroed()];
        quantize_q8_k(&x, &mut out);
        assert_eq!(out[0].d(), 1.0);
        assert_eq!((out[0].q(0), out[0].q(1), out[0].q(2)), (-127, 2, 4));
        assert_eq!(out[0].bsum(0), -127 + 2 + 4);
        assert_eq!(out[0].bsum(1), 1);
        // A positive maximum flips the sign of every quant: d = -1.
        let mut y = [0.0f32; 256];
        y[5] = 127.0;
        y[6] = 1.0;
        quantize_q8_k(&y, &mut out);
        assert_eq!(out[0].d(), -1.0);
        assert_eq!((out[0].q(5), out[0].q(6)), (-127, -1));
    }

    #[test]
    fn q4_0_and_q4_1_dequantize_hand_values() {
        let mut b0 = BlockQ4_0::zeroed();
        b0.d = h(0.5);
        b0.qs[0] = 0x3A; // element 0: 10 -> (10-8)*0.5 = 1; element 16: 3 -> -2.5
        let mut y = [0.0f32; 32];
        dequantize_q4_0(&[b0], &mut y);
        assert_eq!((y[0], y[16], y[1]), (1.0, -2.5, -4.0));

        let mut b1 = BlockQ4_1::zeroed();
        b1.d = h(2.0);
        b1.m = h(-1.0);
        b1.qs[2] = 0xF1; // element 2: 1*2-1 = 1; element 18: 15*2-1 = 29
        dequantize_q4_1(&[b1], &mut y);
        assert_eq!((y[2], y[18], y[0]), (1.0, 29.0, -1.0));
    }

    #[test]
    fn q4_1_dot_matches_hand_sum() {
        let mut w = BlockQ4_1::zeroed();
        w.d = h(2.0);
        w.m = h(1.0);
        w.qs[0] = 0x21; // elements 0 -> 1, 16 -> 2
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[16] = -1.0;
        x[5] = 3.0;
        // Dequantized weights: w0 = 3, w16 = 5, others 1. Dot = 381 - 5 + 3.
        let mut a = [BlockQ8_1::zeroed()];
        quantize_q8_1(&x, &mut a);
        assert_eq!(dot_q4_1_q8_1(&[w], &a), 379.0);
    }

    #[test]
    fn q8_0_and_q4_0_dot_hand_values() {
        let mut w = BlockQ8_0::zeroed();
        w.d = h(0.5);
        w.qs[0] = 4;
        w.qs[31] = (-6i8) as u8;
        let mut a = BlockQ8_0::zeroed();
        a.d = h(2.0);
        a.qs[0] = 3;
        a.qs[31] = 1;
        // (4*3 - 6*1) * 0.5 * 2 = 6
        assert_eq!(dot_q8_0_q8_0(&[w], &[a]), 6.0);
        let mut w4 = BlockQ4_0::zeroed();
        w4.d = h(1.0);
        w4.qs = [0x88; 16]; // all zero after the -8 offset
        w4.qs[0] = 0x89; // element 0 -> 1
        assert_eq!(dot_q4_0_q8_0(&[w4], &[a]), 6.0);
    }

    #[test]
    fn q4_k_dequantize_and_dot_hand_values() {
        let mut b = BlockQ4K::zeroed();
        b.d = h(0.5);
        b.dmin = h(0.25);
        b.scales[0] = 4; // sub-block 0 scale 4
        b.scales[4] = 8; // sub-block 0 min 8
        b.scales[1] = 2; // sub-block 1 scale 2, min 0
        b.qs[0] = 0x73; // element 0: q 3; element 32 (sub-block 1): q 7
        let mut y = [0.0f32; 256];
        dequantize_q4_k(&[b], &mut y);
        assert_eq!(y[0], 0.5 * 4.0 * 3.0 - 0.25 * 8.0);
        assert_eq!(y[1], -2.0);
        assert_eq!(y[32], 0.5 * 2.0 * 7.0);
        assert_eq!(y[64], 0.0);
        let mut a = BlockQ8K::zeroed();
        a.d = 1.0f32.to_le_bytes();
        a.qs[0] = 10;
        a.qs[32] = 1;
        fill_q8k_bsums(&mut a);
        // 10 * 4 + 1 * 7 = 7.0 + ... : 10*y0 + 1*y32 = 40 + 7
        assert_eq!(dot_q4_k_q8_k(&[b], &[a]), 10.0 * y[0] + y[32]);
    }

    #[test]
    fn k_quant_offset_and_minimum_lanes_pair_sub_blocks() {
        // Q6_K: every quant 0 (so -32 after the offset), group g has scale
        // g + 1, every activation 1 (16 per group sum). The unsigned part is
        // zero, so lane m holds only the offset of groups 2m and 2m + 1:
        // -32 * 16 * ((2m + 1) + (2m + 2)).
        let mut b = BlockQ6K::zeroed();
        b.d = h(1.0);
        for (g, s) in b.scales.iter_mut().enumerate() {
            *s = g as u8 + 1;
        }
        let mut a = BlockQ8K::zeroed();
        a.d = 1.0f32.to_le_bytes();
        a.qs = [1; QK_K];
        fill_q8k_bsums(&mut a);
        let lanes = q6k_lanes(&b, &a);
        for (m, &l) in lanes.iter().enumerate() {
            assert_eq!(l, -512 * (4 * m as i32 + 3), "lane {m}");
        }
        // Their total is the dot of the signed quants.
        assert_eq!(lanes.iter().sum::<i32>(), -32 * 16 * 136);
        // Q4_K / Q5_K minimums: lane k pairs sub-blocks 2k and 2k + 1, each
        // min times its 32-element activation sum (here 32).
        let mins = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(k4_min_lanes(&mins, &a), [96, 224, 352, 480]);
        assert_eq!(k4_min_sum(&mins, &a), 1152);
        assert_eq!(hsum4(&[1e8, 1.0, -1e8, 0.0]), 1.0);
    }

    #[test]
    fn q5_k_high_bit_adds_sixteen() {
        let mut b = BlockQ5K::zeroed();
        b.d = h(1.0);
        b.scales[2] = 1; // sub-block 2 (chunk 1, low nibbles) scale 1
        b.scales[3] = 1; // sub-block 3 scale 1
        b.qs[32 + 4] = 0x21; // element 68: 1, element 100: 2
        b.qh[4] = 0b0000_1100; // bits 2 and 3: +16 on both
        let mut y = [0.0f32; 256];
        dequantize_q5_k(&[b], &mut y);
        assert_eq!((y[68], y[100], y[4]), (17.0, 18.0, 0.0));
    }

    #[test]
    fn q6_k_dequantize_and_dot_hand_values() {
        let mut b = BlockQ6K::zeroed();
        b.d = h(0.5);
        b.scales[0] = 2;
        b.scales[2] = (-1i8) as u8;
        b.ql[0] = 0x05; // element 0 low 5, element 64 low 0
        b.qh[0] = 0b10; // element 0 high bits 2 -> q = 32 + 5 - 32 = 5
        b.ql[32] = 0x0F; // element 32: low 15, high 0 -> -17
        let mut y = [0.0f32; 256];
        dequantize_q6_k(&[b], &mut y);
        assert_eq!(y[0], 0.5 * 2.0 * 5.0);
        assert_eq!(y[32], 0.5 * 17.0); // scale -1 times q -17
        assert_eq!(y[1], 0.5 * 2.0 * -32.0);
        let mut a = BlockQ8K::zeroed();
        a.d = 2.0f32.to_le_bytes();
        a.qs[0] = 1;
        a.qs[32] = 2;
        fill_q8k_bsums(&mut a);
        assert_eq!(dot_q6_k_q8_k(&[b], &[a]), 2.0 * (y[0] + 2.0 * y[32]));
    }

    #[test]
    fn q5_0_and_q5_1_take_the_fifth_bit_from_qh() {
        let mut b = BlockQ5_0::zeroed();
        b.d = h(0.5);
        b.qs[0] = 0x3A; // element 0: nibble 10; element 16: nibble 3
        b.qh = (1u32 | 1 << 16).to_le_bytes(); // fifth bit of elements 0 and 16
        let mut y = [0.0f32; 32];
        dequantize_q5_0(&[b], &mut y);
        // (26 - 16) * 0.5, (19 - 16) * 0.5, (0 - 16) * 0.5
        assert_eq!((y[0], y[16], y[1]), (5.0, 1.5, -8.0));
        let mut a = BlockQ8_0::zeroed();
        a.d = h(2.0);
        a.qs[0] = 3;
        a.qs[16] = 1;
        a.qs[31] = (-1i8) as u8; // element 31: q 0, so -16
                                 // (10 * 3 + 3 * 1 - 16 * -1) * 0.5 * 2
        assert_eq!(dot_q5_0_q8_0(&[b], &[a]), 49.0);

        let mut b1 = BlockQ5_1::zeroed();
        b1.d = h(2.0);
        b1.m = h(-1.0);
        b1.qs[2] = 0xF1; // element 2: 1; element 18: 15
        b1.qh = (1u32 << 18).to_le_bytes(); // element 18: 15 + 16
        dequantize_q5_1(&[b1], &mut y);
        assert_eq!((y[2], y[18], y[0]), (1.0, 61.0, -1.0));
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[18] = 2.0;
        // Every weight is 2q - 1: 127 * -1 + 2 * 61.
        let mut a1 = [BlockQ8_1::zeroed()];
        quantize_q8_1(&x, &mut a1);
        assert_eq!(dot_q5_1_q8_1(&[b1], &a1), -5.0);
    }

    #[test]
    fn iq4_nl_indexes_the_non_linear_grid() {
        let mut b = BlockIQ4NL::zeroed();
        b.d = h(0.5);
        b.qs[0] = 0x0F; // element 0: index 15 (113); element 16: index 0 (-127)
        b.qs[1] = 0x78; // element 1: index 8 (1); element 17: index 7 (-10)
        let mut y = [0.0f32; 32];
        dequantize_iq4_nl(&[b], &mut y);
        assert_eq!((y[0], y[16], y[1], y[17]), (56.5, -63.5, 0.5, -5.0));
        assert_eq!(y[2], -63.5);
        let mut a = BlockQ8_0::zeroed();
        a.d = h(1.0);
        a.qs[0] = 1;
        a.qs[16] = 2;
        a.qs[17] = (-3i8) as u8;
        // (113 - 254 + 30) * 0.5
        assert_eq!(dot_iq4_nl_q8_0(&[b], &[a]), -55.5);
    }

    #[test]
    fn q2_k_dequantize_and_dot_hand_values() {
        let mut b = BlockQ2K::zeroed();
        b.d = h(0.5);
        b.dmin = h(0.25);
        b.scales[0] = 0x31; // sub-block 0: scale 1, min 3
        b.scales[3] = 0x02; // sub-block 3 (elements 48..64): scale 2, min 0
        b.qs[0] = 0b11; // element 0: q 3
        b.qs[16] = 0b10 << 2; // element 48 (run 1, l = 16): q 2
        b.qs[32] = 0b01 << 6; // element 128 + 96: q 1, sub-block 14 (scale 0)
        let mut y = [0.0f32; 256];
        dequantize_q2_k(&[b], &mut y);
        assert_eq!(y[0], 0.5 * 3.0 - 0.25 * 3.0);
        assert_eq!(y[1], -0.75);
        assert_eq!(y[48], 2.0);
        assert_eq!((y[16], y[224]), (0.0, 0.0));
        let mut a = BlockQ8K::zeroed();
        a.d = 1.0f32.to_le_bytes();
        a.qs[0] = 10;
        a.qs[5] = 2; // meets the minimum of sub-block 0 only
        a.qs[48] = 1;
        fill_q8k_bsums(&mut a);
        assert_eq!(dot_q2_k_q8_k(&[b], &[a]), 10.0 * 0.75 + 2.0 * -0.75 + 2.0);
    }

    #[test]
    fn q3_k_dequantize_and_dot_hand_values() {
        let mut b = BlockQ3K::zeroed();
        b.d = h(0.5);
        // All scales 0 - 32, except scale 0 = 33 (+1) and scale 5 = 63 (+31).
        b.scales[0] = 0x01;
        b.scales[8] = 0x02;
        b.scales[5] = 0x0F;
        b.scales[9] = 0x0C;
        b.qs[0] = 0b11; // element 0: low bits 3
        b.hmask[0] = 0b1; // ... and its high bit: q 3
        b.qs[16] = 0b01 << 4; // element 80 (run 2, l = 16): low 1, no high bit: -3
        let mut y = [0.0f32; 256];
        dequantize_q3_k(&[b], &mut y);
        assert_eq!(y[0], 1.5);
        assert_eq!(y[1], 0.5 * 1.0 * -4.0); // same sub-block, no high bit
        assert_eq!(y[16], 0.5 * -32.0 * -4.0); // sub-block 1
        assert_eq!(y[80], 0.5 * 31.0 * -3.0);
        let mut a = BlockQ8K::zeroed();
        a.d = 0.5f32.to_le_bytes();
        a.qs[0] = 2;
        a.qs[80] = (-1i8) as u8;
        fill_q8k_bsums(&mut a);
        assert_eq!(dot_q3_k_q8_k(&[b], &[a]), 0.5 * (2.0 * 1.5 + 46.5));
    }

    #[test]
    fn iq4_xs_dequantize_and_dot_hand_values() {
        let mut b = BlockIQ4XS::zeroed();
        b.d = h(0.25);
        // Sub-block 0: low nibble 1, high bits 2 -> 33 - 32 = 1; sub-block 3:
        // 0xF and 3 -> 63 - 32 = 31; the rest 0 - 32.
        b.scales_l = [0x01, 0xF0, 0, 0];
        b.scales_h = (2u16 | 3 << 6).to_le_bytes();
        b.qs[0] = 0x08; // element 0: index 8 (1); element 16: index 0 (-127)
        b.qs[48 + 5] = 0x0F; // element 101: index 15 (113)
        let mut y = [0.0f32; 256];
        dequantize_iq4_xs(&[b], &mut y);
        assert_eq!((y[0], y[16]), (0.25, -31.75));
        assert_eq!(y[101], 0.25 * 31.0 * 113.0);
        assert_eq!(y[32], 0.25 * -32.0 * -127.0);
        let mut a = BlockQ8K::zeroed();
        a.d = 1.0f32.to_le_bytes();
        a.qs[0] = 4;
        a.qs[101] = (-2i8) as u8;
        fill_q8k_bsums(&mut a);
        assert_eq!(dot_iq4_xs_q8_k(&[b], &[a]), 4.0 * 0.25 - 2.0 * 875.75);
    }

    #[test]
    fn float_dots_and_axpy() {
        let a: Vec<f16> = [1.0f32, 2.0, -3.0]
            .iter()
            .map(|&v| f16::from_f32(v))
            .collect();
        let b: Vec<f16> = [0.5f32, 4.0, 1.0]
            .iter()
            .map(|&v| f16::from_f32(v))
            .collect();
        assert_eq!(dot_f16(&a, &b), 5.5);
        let c: Vec<bf16> = [1.0f32, 2.0].iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(dot_bf16(&c, &c), 5.0);
        assert_eq!(dot_f32(&[1.0, 2.0], &[3.0, 4.0]), 11.0);
        let mut y = [1.0f32, 1.0, 1.0];
        axpy_f16(2.0, &a, &mut y);
        assert_eq!(y, [3.0, 5.0, -5.0]);
    }
}
