//! AVX-512 attention kernels for two to four queries that read the same
//! widened K or V rows (the query heads of one KV head, the tokens of one
//! query tile): each row is loaded once for all of them instead of once per
//! query. Every result keeps the bits of the one-query kernels
//! ([`avx512::dot_f32_rows`], [`avx512::axpy_f32_rows`]): a query's
//! accumulators get the same fused steps in the same order, only
//! interleaved with the other queries' steps.
//!
//! Measured reason (Llama-3.2-1B shape, pp512, 2 threads, Zen 5): the
//! one-query V pass did two loads per multiply-add (the row and the
//! broadcast weight) and was 4.7% of the prefill profile.

#![allow(clippy::missing_safety_doc)] // each `# Safety` is stated once below

use std::arch::x86_64::*;

use super::avx512;

// Safety of every `unsafe fn` in this file: the CPU must support AVX-512 F,
// BW, DQ, VL and VNNI plus AVX2, FMA and F16C; `hd` is a multiple of 16;
// rows `0..n` are readable for `hd` values, `hd` apart (widened rows); each query
// pointer is readable for `hd` values (dots) or each weight pointer for `n`
// (axpys); each output is writable for `n` values (dots) or `16 * hd`
// (lanes), and no two outputs overlap.

/// [`avx512::dot_f32_rows`] of each query `qs[j]` with rows `0..n` into
/// `outs[j][0..n]`, for 1 to 4 queries.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn dot_f32_rows_shared(
    qs: &[*const f32],
    rows: *const f32,
    hd: usize,
    n: usize,
    outs: &[*mut f32],
) {
    debug_assert_eq!(qs.len(), outs.len());
    // SAFETY: the caller's promise, passed on.
    unsafe {
        match qs.len() {
            4 => dot_shared::<4>(qs, rows, hd, n, outs),
            3 => dot_shared::<3>(qs, rows, hd, n, outs),
            2 => dot_shared::<2>(qs, rows, hd, n, outs),
            _ => {
                for (&q, &out) in qs.iter().zip(outs) {
                    let q = std::slice::from_raw_parts(q, hd);
                    let out = std::slice::from_raw_parts_mut(out, n);
                    avx512::dot_f32_rows(q, rows, hd, out);
                }
            }
        }
    }
}

/// Rows taken four at a time: `Q` queries times 4 rows of accumulators,
/// reduced together in [`avx512::hsum512`]'s order; the last rows one by
/// one with it.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn dot_shared<const Q: usize>(
    qs: &[*const f32],
    rows: *const f32,
    hd: usize,
    n: usize,
    outs: &[*mut f32],
) {
    let qs: [*const f32; Q] = std::array::from_fn(|j| qs[j]);
    let outs: [*mut f32; Q] = std::array::from_fn(|j| outs[j]);
    let whole = n / 4 * 4;
    // SAFETY: every read is inside rows `0..n` or a query, every write
    // inside an output (the caller's promise).
    unsafe {
        for i0 in (0..whole).step_by(4) {
            let mut acc = [_mm512_setzero_ps(); 16];
            for c in (0..hd).step_by(16) {
                let x: [__m512; 4] =
                    std::array::from_fn(|r| _mm512_loadu_ps(rows.add((i0 + r) * hd + c)));
                for (j, &q) in qs.iter().enumerate() {
                    let qv = _mm512_loadu_ps(q.add(c));
                    for (r, &x) in x.iter().enumerate() {
                        acc[4 * j + r] = _mm512_fmadd_ps(qv, x, acc[4 * j + r]);
                    }
                }
            }
            let mut sums = [0.0f32; 16];
            avx512::reduce_16_rows(&acc, &mut sums);
            for (j, &out) in outs.iter().enumerate() {
                for r in 0..4 {
                    *out.add(i0 + r) = sums[4 * j + r];
                }
            }
        }
        for i in whole..n {
            for (&q, &out) in qs.iter().zip(&outs) {
                let mut acc = _mm512_setzero_ps();
                for c in (0..hd).step_by(16) {
                    let qv = _mm512_loadu_ps(q.add(c));
                    acc = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows.add(i * hd + c)), acc);
                }
                *out.add(i) = avx512::hsum512(acc);
            }
        }
    }
}

/// [`avx512::axpy_f32_rows`] for each query: `ws[j][i]` times row `i` into
/// lane `(first + i) % 16` of `lanes[j]` (`[16][hd]`), for 1 to 4
/// queries.
///
/// # Safety
/// See the file header.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn axpy_f32_rows_shared(
    ws: &[*const f32],
    rows: *const f32,
    hd: usize,
    n: usize,
    lanes: &[*mut f32],
    first: usize,
) {
    debug_assert_eq!(ws.len(), lanes.len());
    // SAFETY: the caller's promise, passed on.
    unsafe {
        match ws.len() {
            4 => axpy_shared::<4>(ws, rows, hd, n, lanes, first),
            3 => axpy_shared::<3>(ws, rows, hd, n, lanes, first),
            2 => axpy_shared::<2>(ws, rows, hd, n, lanes, first),
            _ => {
                for (&w, &lanes) in ws.iter().zip(lanes) {
                    let w = std::slice::from_raw_parts(w, n);
                    let lanes = std::slice::from_raw_parts_mut(lanes, 16 * hd);
                    avx512::axpy_f32_rows(w, rows, hd, lanes, first);
                }
            }
        }
    }
}

/// Lane by lane: the rows that land on one lane, in row order, into the
/// queries' accumulators of that lane, up to 64 columns at a time.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn axpy_shared<const Q: usize>(
    ws: &[*const f32],
    rows: *const f32,
    hd: usize,
    n: usize,
    lanes: &[*mut f32],
    first: usize,
) {
    let ws: [*const f32; Q] = std::array::from_fn(|j| ws[j]);
    for lane in 0..16 {
        let i0 = (lane + 16 - first % 16) % 16;
        if i0 >= n {
            continue;
        }
        let out: [*mut f32; Q] = std::array::from_fn(|j| lanes[j].wrapping_add(lane * hd));
        let mut c = 0;
        // SAFETY: the caller's promise; `c + 16 * C <= hd` in each call.
        unsafe {
            while c + 64 <= hd {
                axpy_lane::<Q, 4>(ws, rows.add(c), hd, n, out.map(|o| o.add(c)), i0);
                c += 64;
            }
            while c < hd {
                axpy_lane::<Q, 1>(ws, rows.add(c), hd, n, out.map(|o| o.add(c)), i0);
                c += 16;
            }
        }
    }
}

/// `C` 16-column steps of one lane for `Q` queries: rows `i0, i0 + 16, ..`
/// below `n`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
unsafe fn axpy_lane<const Q: usize, const C: usize>(
    ws: [*const f32; Q],
    rows: *const f32,
    stride: usize,
    n: usize,
    out: [*mut f32; Q],
    i0: usize,
) {
    // SAFETY: the caller's promise: `C * 16` columns of each row below `n`
    // and of each output are inside their buffers.
    unsafe {
        let mut acc: [[__m512; C]; Q] =
            std::array::from_fn(|j| std::array::from_fn(|c| _mm512_loadu_ps(out[j].add(16 * c))));
        for i in (i0..n).step_by(16) {
            let x: [__m512; C] =
                std::array::from_fn(|c| _mm512_loadu_ps(rows.add(i * stride + 16 * c)));
            for (acc, w) in acc.iter_mut().zip(ws) {
                let w = _mm512_set1_ps(*w.add(i));
                for (acc, &x) in acc.iter_mut().zip(&x) {
                    *acc = _mm512_fmadd_ps(w, x, *acc);
                }
            }
        }
        for (acc, o) in acc.iter().zip(out) {
            for (c, &a) in acc.iter().enumerate() {
                _mm512_storeu_ps(o.add(16 * c), a);
            }
        }
    }
}
