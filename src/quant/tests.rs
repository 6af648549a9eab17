//! Cross-kernel tests of the public quant API: every SIMD level against the
//! scalar reference, batch invariance of `matmul`, quantizer round trips and
//! argument checks. Format-level hand-computed values live in `scalar.rs`.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::dispatch::{kernels_for, supported_levels, Kernels, SimdLevel};
use super::*;

const WEIGHT_TYPES: [GgmlType; 15] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::IQ4_NL,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

fn table(level: SimdLevel) -> &'static Kernels {
    kernels_for(level).unwrap_or_else(|| panic!("level {} not supported", level.name()))
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_le_bytes()
}

/// A random scale with magnitude `scale_mag * [1/1024, 1]` and random sign.
fn random_scale(rng: &mut StdRng, scale_mag: f32) -> f32 {
    let m = scale_mag * 2f32.powf(rng.gen_range(-10.0..0.0));
    if rng.gen_bool(0.5) {
        m
    } else {
        -m
    }
}

/// A random weight row of `n` elements: random quants and sub-block scales
/// (every bit pattern of those is a valid block), sane random f16 scales
/// (random bytes there could be NaN, infinite or huge).
fn random_weights(rng: &mut StdRng, ty: GgmlType, n: usize, scale_mag: f32) -> Vec<u8> {
    let bytes = ty.row_bytes(n).expect("whole blocks");
    let mut row: Vec<u8> = (0..bytes).map(|_| rng.gen()).collect();
    let bb = ty.block_bytes();
    match ty {
        GgmlType::F32 => {
            for c in row.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.gen_range(-2.0f32..2.0).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in row.chunks_exact_mut(2) {
                c.copy_from_slice(&f16_bytes(rng.gen_range(-2.0f32..2.0)));
            }
        }
        GgmlType::BF16 => {
            for c in row.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32(rng.gen_range(-2.0f32..2.0)).to_le_bytes());
            }
        }
        _ => {
            for b in row.chunks_exact_mut(bb) {
                let d = f16_bytes(random_scale(rng, scale_mag));
                let m = f16_bytes(random_scale(rng, scale_mag));
                match ty {
                    GgmlType::Q6_K => b[208..210].copy_from_slice(&d),
                    GgmlType::Q3_K => b[108..110].copy_from_slice(&d),
                    GgmlType::Q2_K => {
                        b[80..82].copy_from_slice(&d);
                        b[82..84].copy_from_slice(&m);
                    }
                    GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => {
                        b[0..2].copy_from_slice(&d);
                        b[2..4].copy_from_slice(&m);
                    }
                    // Q4_0, Q5_0, Q8_0, IQ4_NL, IQ4_XS: `d` first.
                    _ => b[0..2].copy_from_slice(&d),
                }
            }
        }
    }
    row
}

fn random_floats(rng: &mut StdRng, n: usize, mag: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-mag..mag)).collect()
}

fn quantized_acts(k: &Kernels, w_ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let act_ty = activation_type(w_ty).expect("supported");
    let mut out = vec![0u8; act_ty.row_bytes(x.len()).expect("whole blocks")];
    quantize_row_with(k, act_ty, x, &mut out).expect("quantize");
    out
}

/// Sum of |w_i * a_i| over the dequantized rows: the scale a correct
/// floating-point dot can be off by a few ulps of.
fn magnitude(w_ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    let act_ty = activation_type(w_ty).expect("supported");
    let mut wf = vec![0.0f32; n];
    let mut af = vec![0.0f32; n];
    dequantize_row(w_ty, w, &mut wf).expect("dequantize weights");
    dequantize_row(act_ty, a, &mut af).expect("dequantize activations");
    wf.iter().zip(&af).map(|(x, y)| (x * y).abs()).sum()
}

fn lengths_for(ty: GgmlType) -> &'static [usize] {
    match ty.block_len() {
        1 => &[1, 7, 8, 16, 37, 64, 576],
        32 => &[32, 64, 96, 576, 1536],
        _ => &[256, 512, 768],
    }
}

#[test]
fn every_simd_dot_matches_the_scalar_reference() {
    let mut rng = StdRng::seed_from_u64(7);
    let scalar = table(SimdLevel::Scalar);
    for level in supported_levels() {
        let k = table(level);
        for ty in WEIGHT_TYPES {
            for &n in lengths_for(ty) {
                for scale_mag in [1.0f32, 1e-4, 300.0] {
                    let w = random_weights(&mut rng, ty, n, scale_mag);
                    let x = random_floats(&mut rng, n, 3.0);
                    let a = quantized_acts(scalar, ty, &x);
                    let want = vec_dot_with(scalar, ty, n, &w, &a);
                    let got = vec_dot_with(k, ty, n, &w, &a);
                    let tol =
                        2e-6 * magnitude(ty, n, &w, &a) * (n as f32).sqrt() + f32::MIN_POSITIVE;
                    assert!(
                        (got - want).abs() <= tol,
                        "{} {ty} n={n} scale {scale_mag}: got {got}, scalar {want}, tol {tol}",
                        level.name()
                    );
                    // Every quantized format sums in llama.cpp's order on
                    // every level, so all of them are exact.
                    if ty.block_len() > 1 {
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{} {ty} n={n}: must equal the scalar bits",
                            level.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_is_bit_identical_to_vec_dot_for_any_token_count() {
    let mut rng = StdRng::seed_from_u64(11);
    for level in supported_levels() {
        let k = table(level);
        for ty in WEIGHT_TYPES {
            let n = match ty.block_len() {
                1 => 37,
                32 => 96,
                _ => 512,
            };
            // Two groups of 8 rows and 3 more: the row-group kernels (50
            // tokens) or the 8-row register kernels (fewer) take the
            // groups, the one-row kernels the rest and the last tokens.
            let rows = 19;
            let w: Vec<u8> = (0..rows)
                .flat_map(|_| random_weights(&mut rng, ty, n, 1.0))
                .collect();
            for tokens in [1usize, 2, 3, 4, 5, 6, 7, 8, 15, 17, 35, 50] {
                let acts: Vec<u8> = (0..tokens)
                    .flat_map(|_| quantized_acts(k, ty, &random_floats(&mut rng, n, 2.0)))
                    .collect();
                let mut out = vec![0.0f32; rows * tokens];
                matmul_with(k, ty, n, &w, &acts, tokens, None, &mut out);
                let wb = ty.row_bytes(n).expect("whole");
                let ab = activation_type(ty)
                    .expect("ok")
                    .row_bytes(n)
                    .expect("whole");
                for r in 0..rows {
                    for t in 0..tokens {
                        let single = vec_dot_with(
                            k,
                            ty,
                            n,
                            &w[r * wb..(r + 1) * wb],
                            &acts[t * ab..(t + 1) * ab],
                        );
                        assert_eq!(
                            out[t * rows + r].to_bits(),
                            single.to_bits(),
                            "{} {ty} r={r} t={t} of {tokens}",
                            level.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_results_do_not_depend_on_the_calling_thread() {
    let mut rng = StdRng::seed_from_u64(3);
    let (ty, n, rows, tokens) = (GgmlType::Q4_1, 576, 5, 6);
    let w: Vec<u8> = (0..rows)
        .flat_map(|_| random_weights(&mut rng, ty, n, 1.0))
        .collect();
    let mut acts = vec![0u8; tokens * GgmlType::Q8_1.row_bytes(n).expect("whole")];
    for (t, chunk) in acts
        .chunks_exact_mut(GgmlType::Q8_1.row_bytes(n).expect("whole"))
        .enumerate()
    {
        let x: Vec<f32> = (0..n).map(|i| ((i * 7 + t) % 13) as f32 - 6.0).collect();
        quantize_row(GgmlType::Q8_1, &x, chunk).expect("quantize");
    }
    let mut here = vec![0.0f32; rows * tokens];
    matmul(ty, n, &w, &acts, tokens, &mut here);
    let there = std::thread::scope(|s| {
        s.spawn(|| {
            let mut o = vec![0.0f32; rows * tokens];
            matmul(ty, n, &w, &acts, tokens, &mut o);
            o
        })
        .join()
        .expect("thread")
    });
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&here), bits(&there));
}

#[test]
fn simd_quantizers_reproduce_the_scalar_bytes() {
    let mut rng = StdRng::seed_from_u64(5);
    let scalar = table(SimdLevel::Scalar);
    let mut inputs: Vec<Vec<f32>> = (0..20)
        .map(|i| random_floats(&mut rng, 512, 10f32.powi(i % 5 - 2)))
        .collect();
    // Exact halves after scaling (amax 127 makes the scale 1), zeros, and a
    // block whose largest magnitude appears with both signs.
    inputs.push(
        (0..512)
            .map(|i| {
                if i % 32 == 0 {
                    127.0
                } else {
                    (i % 7) as f32 - 3.5
                }
            })
            .collect(),
    );
    inputs.push(vec![0.0; 512]);
    inputs.push((0..512).map(|i| [5.0, -5.0, 1.0, 2.5][i % 4]).collect());
    for level in supported_levels() {
        let k = table(level);
        for x in &inputs {
            for act in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K] {
                let len = act.row_bytes(x.len()).expect("whole");
                let (mut want, mut got) = (vec![0u8; len], vec![0u8; len]);
                quantize_row_with(scalar, act, x, &mut want).expect("scalar");
                quantize_row_with(k, act, x, &mut got).expect("simd");
                assert_eq!(got, want, "{} {act}", level.name());
            }
        }
    }
}

#[test]
fn quantize_then_dequantize_is_close() {
    let mut rng = StdRng::seed_from_u64(9);
    let x = random_floats(&mut rng, 1024, 4.0);
    for act in [
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q8_K,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::F32,
    ] {
        let mut q = vec![0u8; act.row_bytes(x.len()).expect("whole")];
        quantize_row(act, &x, &mut q).expect("quantize");
        let mut back = vec![0.0f32; x.len()];
        dequantize_row(act, &q, &mut back).expect("dequantize");
        let bl = act.block_len().max(32);
        for (xb, yb) in x.chunks(bl).zip(back.chunks(bl)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let tol = match act {
                GgmlType::F32 => 0.0,
                GgmlType::F16 => amax / 1024.0,
                GgmlType::BF16 => amax / 128.0,
                // Half a quantization step plus the f16 rounding of the scale.
                _ => amax / 127.0 * 0.5 + amax / 1000.0,
            };
            for (a, b) in xb.iter().zip(yb) {
                assert!(
                    (a - b).abs() <= tol,
                    "{act}: {a} came back as {b} (tol {tol})"
                );
            }
        }
    }
}

#[test]
fn q8_1_sum_field_is_scale_times_quant_sum() {
    let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) / 7.0).collect();
    let mut q = vec![0u8; GgmlType::Q8_1.row_bytes(64).expect("whole")];
    quantize_row(GgmlType::Q8_1, &x, &mut q).expect("quantize");
    let blocks: &[BlockQ8_1] = bytemuck::cast_slice(&q);
    for b in blocks {
        let sum: i32 = (0..32).map(|i| b.q(i)).sum();
        let d_f32 = b.d();
        // s was computed from the unrounded d, so allow f16 rounding of both.
        assert!((b.s() - sum as f32 * d_f32).abs() <= (sum as f32 * d_f32).abs() * 2e-3 + 1e-6);
    }
}

#[test]
fn f16_attention_helpers_match_scalar_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(13);
    for level in supported_levels() {
        let k = table(level);
        for n in [1usize, 7, 8, 16, 17, 64, 100] {
            let a: Vec<half::f16> = (0..n)
                .map(|_| half::f16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let b: Vec<half::f16> = (0..n)
                .map(|_| half::f16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let want = scalar::dot_f16(&a, &b);
            // SAFETY: the level is supported; both slices hold `n` values.
            let got = unsafe { (k.dot_f16)(n, a.as_ptr() as *const u8, b.as_ptr() as *const u8) };
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{} n={n}: {got} vs {want}",
                level.name()
            );
            let mut y1: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
            let mut y2 = y1.clone();
            // SAFETY: the level is supported.
            unsafe { (k.axpy_f16)(0.7, &a, &mut y1) };
            scalar::axpy_f16(0.7, &a, &mut y2);
            assert_eq!(bits(&y1), bits(&y2), "{} axpy n={n}", level.name());
        }
    }
}

#[test]
fn f16_row_loops_equal_the_one_row_kernels_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(17);
    // A block of a K/V cache: 40 rows of 3 heads of 64, the middle head
    // read; from lane 13, the rows fill 3 lanes, two rounds of 16, then 5.
    let (hd, stride, rows, head) = (64usize, 192usize, 40usize, 1usize);
    let cache: Vec<half::f16> = (0..rows * stride)
        .map(|_| half::f16::from_f32(rng.gen_range(-2.0..2.0)))
        .collect();
    let q: Vec<half::f16> = (0..hd)
        .map(|_| half::f16::from_f32(rng.gen_range(-2.0..2.0)))
        .collect();
    let w: Vec<f32> = (0..rows).map(|_| rng.gen_range(0.0..1.0)).collect();
    for level in supported_levels() {
        let k = table(level);
        let row = |i: usize| &cache[i * stride + head * hd..][..hd];
        let mut got = vec![0.0f32; rows];
        // SAFETY: the level is supported; every row lies inside `cache`.
        unsafe { (k.dot_f16_rows)(&q, cache[head * hd..].as_ptr(), stride, &mut got) };
        let want: Vec<f32> = (0..rows)
            .map(|i| {
                // SAFETY: as above, one row at a time.
                unsafe { (k.dot_f16)(hd, q.as_ptr() as *const u8, row(i).as_ptr() as *const u8) }
            })
            .collect();
        assert_eq!(bits(&got), bits(&want), "{} dot rows", level.name());

        let first = 13;
        let mut got = vec![0.5f32; 16 * hd];
        let mut want = got.clone();
        // SAFETY: as above.
        unsafe { (k.axpy_f16_rows)(&w, cache[head * hd..].as_ptr(), stride, &mut got, first) };
        for (i, &wi) in w.iter().enumerate() {
            let lane = ((first + i) % 16) * hd;
            // SAFETY: as above.
            unsafe { (k.axpy_f16)(wi, row(i), &mut want[lane..lane + hd]) };
        }
        assert_eq!(bits(&got), bits(&want), "{} axpy rows", level.name());
    }
}

/// The widened-row attention kernels give the f16 row loops' bits, for
/// head widths 64, 128, 80 and 256, runs that start on any lane and end anywhere,
/// for one to four queries over the same rows.
#[test]
fn widened_attention_rows_equal_the_f16_row_loops_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(23);
    for level in supported_levels() {
        let k = table(level);
        let Some(wide) = k.wide_attention else {
            continue;
        };
        for (hd, heads) in [(64usize, 3usize), (128, 2), (80, 2), (256, 2)] {
            let (stride, rows, head) = (hd * heads, 75usize, heads - 1);
            let cache: Vec<half::f16> = (0..rows * stride)
                .map(|_| half::f16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let mut widened = vec![0.0f32; rows * hd];
            // SAFETY: the level is supported; every row lies inside `cache`
            // and `widened`.
            unsafe {
                (wide.widen)(
                    cache[head * hd..].as_ptr(),
                    stride,
                    hd,
                    rows,
                    widened.as_mut_ptr(),
                )
            };
            for (start, n) in [(0usize, rows), (3, 17), (16, 32), (5, 1), (40, 35), (0, 0)] {
                let f16_rows = cache[start * stride + head * hd..].as_ptr();
                let f32_rows = widened[start * hd..].as_ptr();
                // One to four queries over the same rows, each run starting
                // on another lane.
                for m in 1..=4usize {
                    let q16: Vec<Vec<half::f16>> = (0..m)
                        .map(|_| {
                            (0..hd)
                                .map(|_| half::f16::from_f32(rng.gen_range(-2.0..2.0)))
                                .collect()
                        })
                        .collect();
                    let queries: Vec<Vec<f32>> = q16
                        .iter()
                        .map(|q| q.iter().map(|v| v.to_f32()).collect())
                        .collect();
                    let weights: Vec<Vec<f32>> = (0..m)
                        .map(|_| (0..n).map(|_| rng.gen_range(0.0f32..1.0)).collect())
                        .collect();
                    let mut got_dots = vec![vec![0.0f32; n]; m];
                    let mut got_lanes = vec![vec![0.25f32; 16 * hd]; m];
                    let qs: Vec<*const f32> = queries.iter().map(|q| q.as_ptr()).collect();
                    let ws: Vec<*const f32> = weights.iter().map(|w| w.as_ptr()).collect();
                    let outs: Vec<*mut f32> = got_dots.iter_mut().map(|o| o.as_mut_ptr()).collect();
                    let lanes: Vec<*mut f32> =
                        got_lanes.iter_mut().map(|l| l.as_mut_ptr()).collect();
                    let first = start + 3 * m;
                    // SAFETY: as above; rows `start..start + n` exist, every
                    // query holds `hd` values, every weight run and output
                    // `n`, every lane block `16 * hd`.
                    unsafe {
                        (wide.dot_rows_shared)(&qs, f32_rows, hd, n, &outs);
                        (wide.axpy_rows_shared)(&ws, f32_rows, hd, n, &lanes, first);
                    }
                    for j in 0..m {
                        let mut want = vec![0.0f32; n];
                        let mut want_lanes = vec![0.25f32; 16 * hd];
                        // SAFETY: as above.
                        unsafe {
                            (k.dot_f16_rows)(&q16[j], f16_rows, stride, &mut want);
                            (k.axpy_f16_rows)(
                                &weights[j],
                                f16_rows,
                                stride,
                                &mut want_lanes,
                                first,
                            );
                        }
                        let what = format!(
                            "{} hd={hd} {start}+{n} from lane {first}, query {j} of {m}",
                            level.name()
                        );
                        assert_eq!(bits(&got_dots[j]), bits(&want), "dot {what}");
                        assert_eq!(bits(&got_lanes[j]), bits(&want_lanes), "axpy {what}");
                    }
                }
            }
        }
    }
}

#[test]
fn f16_rounding_of_scaled_weights_matches_scalar_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(5);
    // Softmax weights and the edges of f16: ties, subnormals, overflow.
    let mut x: Vec<f32> = (0..1000).map(|_| rng.gen_range(0.0f32..1.0)).collect();
    x.extend([
        0.0,
        1.0,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        6.0e-8,
        3.0e-5,
        65504.0,
        65520.0,
        1.0e6,
        -2.5,
    ]);
    for scale in [1.0f32, 0.37, 1.0e-3] {
        let mut want = x.clone();
        scalar::scale_round_f16(&mut want, scale);
        for level in supported_levels() {
            let mut got = x.clone();
            // SAFETY: the level is supported.
            unsafe { (table(level).scale_round_f16)(&mut got, scale) };
            assert_eq!(bits(&got), bits(&want), "{} scale {scale}", level.name());
        }
    }
}

#[test]
fn ggml_exp_and_swiglu_match_scalar_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(17);
    // Ordinary, subnormal-result, saturating and infinite arguments.
    let mut x: Vec<f32> = (0..200).map(|_| rng.gen_range(-30.0f32..10.0)).collect();
    x.extend([
        0.0, -0.0, -87.5, -95.0, -103.0, -110.0, -150.0, 88.0, 88.8, 200.0,
    ]);
    x.extend([f32::NEG_INFINITY, -1e-30, 1e-30]);
    let up: Vec<f32> = (0..x.len()).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
    let mut want_exp = x.clone();
    scalar::exp_ggml_in_place(&mut want_exp);
    let mut want_glu = x.clone();
    scalar::swiglu_ggml(&mut want_glu, &up);
    for level in supported_levels() {
        let k = table(level);
        for len in [x.len(), 13, 5] {
            let mut got = x[..len].to_vec();
            // SAFETY: the level is supported.
            unsafe { (k.exp_ggml)(&mut got) };
            assert_eq!(
                bits(&got),
                bits(&want_exp[..len]),
                "{} exp len {len}",
                level.name()
            );
            let mut got = x[..len].to_vec();
            // SAFETY: the level is supported.
            unsafe { (k.swiglu_ggml)(&mut got, &up[..len]) };
            assert_eq!(
                bits(&got),
                bits(&want_glu[..len]),
                "{} swiglu len {len}",
                level.name()
            );
        }
    }
}

#[test]
fn geglu_matches_scalar_bit_for_bit() {
    // The table's inputs rounded to f16 on every level: ordinary values,
    // the cut-offs and their neighbours, values that round to f16
    // subnormals, zeros and infinities.
    let mut rng = StdRng::seed_from_u64(23);
    let mut x: Vec<f32> = (0..500).map(|_| rng.gen_range(-12.0f32..12.0)).collect();
    x.extend((0..100).map(|_| rng.gen_range(-1e-4f32..1e-4)));
    x.extend([
        -10.0,
        10.0,
        f32::from_bits((-10.0f32).to_bits() - 1),
        f32::from_bits(10.0f32.to_bits() - 1),
        0.0,
        -0.0,
        3e-8,
        -6e-8,
        1e-9,
        f32::INFINITY,
        f32::NEG_INFINITY,
        65504.0,
        -70000.0,
    ]);
    let up: Vec<f32> = (0..x.len()).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
    let mut want = x.clone();
    super::gelu::geglu_scalar(&mut want, &up);
    for level in supported_levels() {
        let k = table(level);
        for len in [x.len(), 17, 3] {
            let mut got = x[..len].to_vec();
            // SAFETY: the level is supported.
            unsafe { (k.geglu_ggml)(&mut got, &up[..len]) };
            assert_eq!(
                bits(&got),
                bits(&want[..len]),
                "{} geglu len {len}",
                level.name()
            );
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn argument_errors_carry_the_numbers() {
    assert_eq!(activation_type(GgmlType::Q4_1), Ok(GgmlType::Q8_1));
    assert_eq!(activation_type(GgmlType::Q6_K), Ok(GgmlType::Q8_K));
    assert_eq!(activation_type(GgmlType::Q5_0), Ok(GgmlType::Q8_0));
    assert_eq!(activation_type(GgmlType::Q5_1), Ok(GgmlType::Q8_1));
    assert_eq!(activation_type(GgmlType::IQ4_NL), Ok(GgmlType::Q8_0));
    assert_eq!(activation_type(GgmlType::IQ4_XS), Ok(GgmlType::Q8_K));
    assert_eq!(activation_type(GgmlType::Q2_K), Ok(GgmlType::Q8_K));
    assert_eq!(activation_type(GgmlType::Q3_K), Ok(GgmlType::Q8_K));
    // Activation-only formats have no weight kernel.
    assert_eq!(
        activation_type(GgmlType::Q8_K),
        Err(QuantError::UnsupportedWeight { ty: GgmlType::Q8_K })
    );
    let mut out = vec![0u8; 10];
    assert_eq!(
        quantize_row(GgmlType::Q8_0, &[0.0; 32], &mut out),
        Err(QuantError::WrongLength {
            what: "quantized activation buffer",
            got: 10,
            expected: 34
        })
    );
    assert!(matches!(
        quantize_row(GgmlType::Q8_0, &[0.0; 33], &mut out),
        Err(QuantError::PartialBlock {
            n: 33,
            block_len: 32,
            ..
        })
    ));
    assert_eq!(
        quantize_row(GgmlType::Q4_1, &[0.0; 32], &mut out),
        Err(QuantError::NotActivation { ty: GgmlType::Q4_1 })
    );
    let mut dst = [0.0f32; 32];
    assert!(matches!(
        dequantize_row(GgmlType::Q5_0, &[0u8; 21], &mut dst),
        Err(QuantError::WrongLength {
            got: 21,
            expected: 22,
            ..
        })
    ));
    assert_eq!(check_matmul(GgmlType::Q4_1, 64, 120, 72, 1, 3), Ok(3));
    assert!(check_matmul(GgmlType::Q4_1, 64, 121, 72, 1, 3).is_err());
    assert!(check_matmul(GgmlType::Q4_1, 64, 120, 72, 1, 4).is_err());
    let msg = QuantError::WrongLength {
        what: "output",
        got: 4,
        expected: 3,
    }
    .to_string();
    assert!(msg.contains('4') && msg.contains('3'), "{msg}");
}

#[test]
fn forced_level_names_are_recognised() {
    assert!(SimdLevel::Scalar.is_supported());
    assert!(["scalar", "avx2", "avx512", "amx", "neon"].contains(&simd_level()));
}

/// The type llama.cpp names `name`.
fn type_named(name: &str) -> GgmlType {
    (0..64)
        .filter_map(GgmlType::from_id)
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("no type named {name}"))
}

fn from_hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn dequantize_matches_gguf_py_vectors() {
    // Blocks and values from llama.cpp's gguf-py (an independent numpy
    // decoder), written by tests/interop/gguf_dequant_vectors.py; its doc
    // has the command that regenerates the file.
    let text = include_str!("../../tests/vectors/gguf_dequant.txt");
    let mut seen = std::collections::BTreeMap::<&str, usize>::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let mut fields = line.split_whitespace();
        let (name, block, want) = match (fields.next(), fields.next(), fields.next()) {
            (Some(n), Some(b), Some(w)) => (n, from_hex(b), w),
            _ => panic!("malformed vector line: {line}"),
        };
        let ty = type_named(name);
        assert_eq!(block.len(), ty.block_bytes(), "{name} block size");
        let mut got = vec![0.0f32; ty.block_len()];
        dequantize_row(ty, &block, &mut got).expect("dequantize");
        let want: Vec<u32> = (0..want.len())
            .step_by(8)
            .map(|i| u32::from_str_radix(&want[i..i + 8], 16).expect("hex"))
            .collect();
        assert_eq!(want.len(), ty.block_len(), "{name} value count");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                *w,
                "{name} element {i}: {g} vs gguf-py {}",
                f32::from_bits(*w)
            );
        }
        *seen.entry(name).or_default() += 1;
    }
    for ty in WEIGHT_TYPES.iter().filter(|t| t.block_len() > 1) {
        assert_eq!(
            seen.get(ty.name()),
            Some(&3),
            "{ty} has three vector blocks"
        );
    }
}

#[test]
fn scalar_dots_equal_the_dot_of_the_dequantized_rows() {
    // The dot kernels and the dequantizers read the same bytes through
    // separate code; dequantization is checked against gguf-py above, so
    // agreement here ties each dot's block layout to llama.cpp's too.
    let mut rng = StdRng::seed_from_u64(19);
    let scalar = table(SimdLevel::Scalar);
    for ty in WEIGHT_TYPES {
        for &n in lengths_for(ty) {
            let w = random_weights(&mut rng, ty, n, 1.0);
            let x = random_floats(&mut rng, n, 3.0);
            let a = quantized_acts(scalar, ty, &x);
            let act_ty = activation_type(ty).expect("supported");
            let mut wf = vec![0.0f32; n];
            let mut af = vec![0.0f32; n];
            dequantize_row(ty, &w, &mut wf).expect("weights");
            dequantize_row(act_ty, &a, &mut af).expect("activations");
            let want: f64 = wf.iter().zip(&af).map(|(p, q)| *p as f64 * *q as f64).sum();
            let got = vec_dot_with(scalar, ty, n, &w, &a) as f64;
            // Float rounding of the sums, plus, for Q8_1 activations, the
            // kernels' use of the block sum `s`, stored as f16 of the sum
            // times the unrounded scale: up to 2^-10 of `m * s` per block.
            let mut tol = 1e-5 * magnitude(ty, n, &w, &a) as f64 + 1e-30;
            if act_ty == GgmlType::Q8_1 {
                let wb = ty.block_bytes();
                let acts: &[BlockQ8_1] = bytemuck::cast_slice(&a);
                for (wblock, ablock) in w.chunks_exact(wb).zip(acts) {
                    let m = half::f16::from_le_bytes([wblock[2], wblock[3]]).to_f32();
                    tol += (m * ablock.s()).abs() as f64 / 1024.0;
                }
            }
            assert!(
                (got - want).abs() <= tol,
                "{ty} n={n}: kernel {got}, dequantized {want}, tol {tol}"
            );
        }
    }
}

/// Parses a string of 8-hex-digit f32 bit patterns.
fn f32_bits_from_hex(s: &str) -> Vec<u32> {
    assert!(s.len().is_multiple_of(8), "f32 hex length");
    (0..s.len())
        .step_by(8)
        .map(|i| u32::from_str_radix(&s[i..i + 8], 16).expect("hex"))
        .collect()
}

#[test]
fn matmul_matches_llamacpp_kernel_vectors() {
    // llama.cpp's own kernels (ggml-cpu of the reference build, through
    // scripts/llamacpp/kernels.c) on fixed rows: written by
    // scripts/golden-kernels, which documents how to regenerate them.
    let text = include_str!("../../tests/vectors/kernels_llamacpp.txt");
    let mut checked = 0;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 9, "malformed vector line");
        let ty = type_named(f[0]);
        let (n, rows, tokens): (usize, usize, usize) = (
            f[1].parse().expect("n"),
            f[2].parse().expect("rows"),
            f[3].parse().expect("tokens"),
        );
        let w = from_hex(f[4]);
        let x: Vec<f32> = from_hex(f[5])
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let want_q = from_hex(f[6]);
        let want_vec_dot = f32_bits_from_hex(f[7]);
        let want_batched = f32_bits_from_hex(f[8]);
        let act_ty = activation_type(ty).expect("supported");
        let act_row = act_ty.row_bytes(n).expect("whole");
        assert_eq!(x.len(), n * tokens);
        for level in supported_levels() {
            let k = table(level);
            let mut q = vec![0u8; act_row * tokens];
            for (xs, qs) in x.chunks_exact(n).zip(q.chunks_exact_mut(act_row)) {
                quantize_row_with(k, act_ty, xs, qs).expect("quantize");
            }
            assert_eq!(q, want_q, "{} {ty}: activation bytes", level.name());
            let mut out = vec![0.0f32; rows * tokens];
            matmul_with(k, ty, n, &w, &q, tokens, None, &mut out);
            // The vectors are row-major ([rows][tokens]); matmul writes
            // token-major.
            for (i, (&batched, &one)) in want_batched.iter().zip(&want_vec_dot).enumerate() {
                let got = out[(i % tokens) * rows + i / tokens];
                let (batched, one) = (f32::from_bits(batched), f32::from_bits(one));
                assert_eq!(
                    got.to_bits(),
                    batched.to_bits(),
                    "{} {ty} output {i}: {got} vs llama.cpp's batched {batched} \
                     (its one-token kernel: {one})",
                    level.name()
                );
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 12, "one vector line per quantized weight format");
}

#[cfg(target_arch = "x86_64")]
#[test]
fn kquant_row_groups_give_the_same_bits_in_any_token_chunks() {
    // Long batches go through the K-quant row-group kernel in chunks of
    // tokens; any chunk size must give every output the same bits.
    if !SimdLevel::Avx512.is_supported() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(23);
    let k = table(SimdLevel::Avx512);
    let (rows, tiles) = (24usize, 5usize);
    let tokens = tiles * dispatch::TILE;
    // 2 super-blocks per row, and 19: rows longer than the kernel's slice
    // of 8, in slices of 8, 8 and 3.
    for (ty, n) in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K]
        .into_iter()
        .flat_map(|ty| [(ty, 2 * QK_K), (ty, 19 * QK_K)])
    {
        let w: Vec<u8> = (0..rows)
            .flat_map(|_| random_weights(&mut rng, ty, n, 1.0))
            .collect();
        let acts: Vec<u8> = (0..tokens)
            .flat_map(|_| quantized_acts(k, ty, &random_floats(&mut rng, n, 2.0)))
            .collect();
        type Chunked = unsafe fn(usize, &[u8], usize, &[u8], usize, &mut [f32], usize, usize);
        let kernel: Chunked = match ty {
            GgmlType::Q4_K => super::gemm_kquant::matmul_in_chunks::<BlockQ4K>,
            GgmlType::Q5_K => super::gemm_kquant::matmul_in_chunks::<BlockQ5K>,
            _ => super::gemm_kquant::matmul_in_chunks::<BlockQ6K>,
        };
        let run = |chunk: usize| {
            let mut out = vec![0.0f32; rows * tokens];
            // SAFETY: AVX-512 is supported (checked above); the buffers hold
            // `rows` rows of `n / 256` blocks and `tokens` activation rows.
            unsafe { kernel(n / QK_K, &w, rows / 8, &acts, tiles, &mut out, rows, chunk) };
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let whole = run(tokens);
        for chunk in [8, 16, 24] {
            assert_eq!(run(chunk), whole, "{ty} n={n}: chunks of {chunk} tokens");
        }
        // And each output is vec_dot's.
        let wb = ty.row_bytes(n).expect("whole");
        let ab = GgmlType::Q8_K.row_bytes(n).expect("whole");
        for r in 0..rows {
            for t in 0..tokens {
                let one = vec_dot_with(k, ty, n, &w[r * wb..][..wb], &acts[t * ab..][..ab]);
                assert_eq!(whole[t * rows + r], one.to_bits(), "{ty} n={n} r={r} t={t}");
            }
        }
    }
}

#[test]
fn prepared_activations_give_matmuls_bits() {
    // Activations prepared once per product and shared by its row tasks
    // (where the active level's kernels read them so) give every output
    // the bits of the plain product; preparations made for another
    // product, or left unfilled, are not used.
    let mut rng = StdRng::seed_from_u64(29);
    let (n, rows) = (512usize, 19usize);
    let k = dispatch::active();
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
    ] {
        let w: Vec<u8> = (0..rows)
            .flat_map(|_| random_weights(&mut rng, ty, n, 1.0))
            .collect();
        let mut prepared = PreparedActs::default();
        for tokens in [3usize, 16, 24, 41, 50] {
            let acts: Vec<u8> = (0..tokens)
                .flat_map(|_| quantized_acts(k, ty, &random_floats(&mut rng, n, 2.0)))
                .collect();
            let plain = {
                let mut out = vec![0.0f32; rows * tokens];
                matmul(ty, n, &w, &acts, tokens, &mut out);
                bits(&out)
            };
            let with = |prepared: &PreparedActs| {
                let mut out = vec![0.0f32; rows * tokens];
                matmul_prepared(ty, n, &w, &acts, tokens, prepared, &mut out);
                bits(&out)
            };
            let wanted = prepared.begin(ty, n, tokens);
            // Unfilled: not used.
            assert_eq!(with(&prepared), plain, "{ty} {tokens} tokens, unfilled");
            let (fill, chunks) = prepared.parts_mut();
            assert_eq!(wanted, !chunks.is_empty(), "{ty} {tokens}");
            for (i, chunk) in chunks.iter_mut().enumerate() {
                fill.fill(i, &acts, chunk);
            }
            // Filled, the chunks are the ones the product reads.
            #[cfg(target_arch = "x86_64")]
            assert_eq!(
                prepared.holds(tokens, n / ty.block_len()),
                wanted,
                "{ty} {tokens}"
            );
            assert_eq!(with(&prepared), plain, "{ty} {tokens} tokens, prepared");
            // Made for another token count or row length: not used.
            if tokens > 16 {
                let mut out = vec![0.0f32; rows * 16];
                let mut plain16 = vec![0.0f32; rows * 16];
                let ab = acts.len() / tokens;
                matmul_prepared(ty, n, &w, &acts[..16 * ab], 16, &prepared, &mut out);
                matmul(ty, n, &w, &acts[..16 * ab], 16, &mut plain16);
                assert_eq!(bits(&out), bits(&plain16), "{ty} 16 of {tokens} tokens");
            }
        }
    }
}

/// K-quant and IQ4_XS blocks at the extremes of the scaled quants the AMX
/// kernel splits into bytes: every quant and scale at its largest (and
/// Q6_K's scales, IQ4_XS's values and scales, at their most negative).
#[cfg(all(target_arch = "x86_64", not(loom)))]
fn saturated_kquant_row(ty: GgmlType, n: usize, negative: bool) -> Vec<u8> {
    let mut row = vec![0xFFu8; ty.row_bytes(n).expect("whole")];
    let block = ty.block_bytes();
    for b in row.chunks_exact_mut(block) {
        match ty {
            // d, dmin, then scales and quants all ones: 63 · 15 (Q4_K),
            // 63 · 31 (Q5_K).
            GgmlType::Q4_K | GgmlType::Q5_K => {
                b[0..2].copy_from_slice(&f16_bytes(0.01));
                b[2..4].copy_from_slice(&f16_bytes(0.02));
            }
            GgmlType::IQ4_XS => {
                // d, scales_h[2], scales_l[4], qs[128]: every grid value
                // 113 with every scale 31, or -127 with -32.
                if negative {
                    b.fill(0);
                }
                b[0..2].copy_from_slice(&f16_bytes(0.01));
            }
            _ => {
                // Q6_K: ql[128], qh[64], scales[16], d.
                let scale = if negative { 0x80 } else { 0x7F };
                b[192..208].fill(scale);
                b[208..210].copy_from_slice(&f16_bytes(0.01));
            }
        }
    }
    row
}

#[cfg(all(target_arch = "x86_64", not(loom)))]
#[test]
fn amx_layouts_and_float_steps_give_vec_dots_bits() {
    // Through a plain-Rust model of `tdpbusd` and `tdpbssd`, on any
    // AVX-512 CPU: the scaled quants split into bytes, the token tiles and
    // the float steps give every output the bits of `vec_dot`, for row
    // and token counts that are not whole tiles, random and saturated
    // blocks, each call preparing its own tokens or reading shared ones.
    // (Where the CPU has AMX, the tests over every level run the real
    // tiles against `vec_dot` too.)
    use super::amx_kquant::{matmul_prepared_with, matmul_with, prepare_chunk, ModelTiles};
    if !SimdLevel::Avx512.is_supported() {
        eprintln!("AMX LAYOUT TEST SKIPPED: no AVX-512 on this CPU");
        return;
    }
    let mut rng = StdRng::seed_from_u64(31);
    let k = table(SimdLevel::Avx512);
    let (n, rows, tokens) = (512usize, 24usize, 40usize);
    let nb = n / QK_K;
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
    ] {
        let mut w: Vec<u8> = (0..rows - 2)
            .flat_map(|_| random_weights(&mut rng, ty, n, 1.0))
            .collect();
        w.extend(saturated_kquant_row(ty, n, false));
        w.extend(saturated_kquant_row(ty, n, true));
        let acts: Vec<u8> = (0..tokens)
            .flat_map(|_| quantized_acts(k, ty, &random_floats(&mut rng, n, 2.0)))
            .collect();
        let ab = GgmlType::Q8_K.row_bytes(n).expect("whole");
        let mut own = vec![0.0f32; rows * tokens];
        let mut shared = vec![0.0f32; rows * tokens];
        let mut chunks: Vec<PreparedChunk> = Vec::new();
        for c in acts.chunks(16 * ab) {
            let mut chunk = PreparedChunk::default();
            // SAFETY: none needed by the AMX layout's preparation.
            unsafe { prepare_chunk(nb, c, &mut chunk) };
            chunks.push(chunk);
        }
        type Own = unsafe fn(usize, &[u8], usize, &[u8], usize, &mut [f32], usize);
        type Shared = unsafe fn(usize, &[u8], usize, &[PreparedChunk], &mut [f32], usize);
        let (with_own, with_shared): (Own, Shared) = match ty {
            GgmlType::Q4_K => (
                matmul_with::<BlockQ4K, ModelTiles>,
                matmul_prepared_with::<BlockQ4K, ModelTiles>,
            ),
            GgmlType::Q5_K => (
                matmul_with::<BlockQ5K, ModelTiles>,
                matmul_prepared_with::<BlockQ5K, ModelTiles>,
            ),
            GgmlType::IQ4_XS => (
                matmul_with::<BlockIQ4XS, ModelTiles>,
                matmul_prepared_with::<BlockIQ4XS, ModelTiles>,
            ),
            _ => (
                matmul_with::<BlockQ6K, ModelTiles>,
                matmul_prepared_with::<BlockQ6K, ModelTiles>,
            ),
        };
        // SAFETY: AVX-512 is supported (checked above) and the model
        // tiles need nothing more; the buffers hold `rows` rows of `nb`
        // blocks and `tokens` activation rows.
        unsafe {
            with_own(nb, &w, rows, &acts, tokens, &mut own, rows);
            with_shared(nb, &w, rows, &chunks, &mut shared, rows);
        }
        let wb = ty.row_bytes(n).expect("whole");
        for r in 0..rows {
            for t in 0..tokens {
                let one = vec_dot_with(k, ty, n, &w[r * wb..][..wb], &acts[t * ab..][..ab]);
                assert_eq!(
                    own[t * rows + r].to_bits(),
                    one.to_bits(),
                    "{ty} r={r} t={t}"
                );
                assert_eq!(
                    shared[t * rows + r].to_bits(),
                    one.to_bits(),
                    "{ty} r={r} t={t}, shared"
                );
            }
        }
    }
}
