//! The GPU matrix kernels held to the CPU's dequantizer on a real wgpu
//! device (Mesa's lavapipe in CI): every weight format, one row, a tile,
//! ragged edges, more chunks than lanes, a matrix split over bindings, and
//! every output bit-identical whatever tokens share its step.
//!
//! Without any wgpu adapter these tests say so loudly and pass, unless
//! `INFERD_REQUIRE_WGPU=1` (set by `scripts/test`), when they fail.

use std::sync::{Arc, OnceLock};

use half::{bf16, f16};
use inferd::gguf::synthetic::WEIGHT_TYPES;
use inferd::gpu::{AdapterKind, DeviceMatrix, GpuDevice, GpuError, MatmulKernels};
use inferd::quant::{self, GgmlType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn device() -> Option<Arc<GpuDevice>> {
    static DEVICE: OnceLock<Option<Arc<GpuDevice>>> = OnceLock::new();
    DEVICE
        .get_or_init(|| match GpuDevice::open(AdapterKind::Any) {
            Ok(device) => {
                eprintln!("GPU kernel tests on {}", device.describe());
                Some(device)
            }
            Err(GpuError::NoAdapter { seen }) => {
                let required = std::env::var("INFERD_REQUIRE_WGPU").is_ok_and(|v| v == "1");
                assert!(!required, "INFERD_REQUIRE_WGPU=1 but no wgpu adapter{seen}");
                eprintln!(
                    "\n!!! SKIPPING the GPU kernel tests: no wgpu adapter{seen}.\n\
                     !!! Install mesa-vulkan-drivers and libvulkan1 (scripts/setup does).\n"
                );
                None
            }
            Err(other) => panic!("wgpu adapter present but unusable: {other}"),
        })
        .clone()
}

/// Byte offsets of a block's f16 scale fields: random bytes elsewhere are
/// valid quants, but a random scale could be infinite or NaN. (Not the
/// synthetic models' generator: that one keeps sub-block scales in the
/// upper half of their range, and these inputs take every bit pattern.)
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => &[0],
        GgmlType::IQ4_XS => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// `rows` random rows of `ty`, `cols` wide, with finite scales.
fn random_matrix(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let row_bytes = ty.row_bytes(cols).expect("whole blocks");
    let mut bytes = vec![0u8; rows * row_bytes];
    match ty {
        GgmlType::F32 => {
            for v in bytes.chunks_exact_mut(4) {
                v.copy_from_slice(&rng.gen_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for v in bytes.chunks_exact_mut(2) {
                v.copy_from_slice(&f16::from_f32(rng.gen_range(-1.0..1.0)).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for v in bytes.chunks_exact_mut(2) {
                v.copy_from_slice(&bf16::from_f32(rng.gen_range(-1.0..1.0)).to_le_bytes());
            }
        }
        _ => {
            rng.fill(&mut bytes[..]);
            let block = ty.block_bytes();
            for b in bytes.chunks_exact_mut(block) {
                for &off in scale_offsets(ty) {
                    // Some tiny scales, subnormal halves included, so the
                    // shader's exact half decoding is exercised.
                    let scale = if rng.gen_bool(0.05) {
                        rng.gen_range(-1e-6f32..1e-6)
                    } else {
                        rng.gen_range(-0.05f32..0.05)
                    };
                    b[off..off + 2].copy_from_slice(&f16::from_f32(scale).to_le_bytes());
                }
            }
        }
    }
    bytes
}

/// `out[t][r]` from the CPU's dequantizer, summed in f64, and the sum of
/// the products' magnitudes (the error scale of an f32 sum).
fn reference(ty: GgmlType, w: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<(f64, f64)> {
    let row_bytes = ty.row_bytes(cols).unwrap();
    let mut dequantized = vec![0f32; cols];
    let mut out = vec![(0.0, 0.0); x.len() / cols * rows];
    let n_tokens = x.len() / cols;
    for r in 0..rows {
        quant::dequantize_row(ty, &w[r * row_bytes..][..row_bytes], &mut dequantized).unwrap();
        for t in 0..n_tokens {
            let xs = &x[t * cols..][..cols];
            let (mut sum, mut magnitude) = (0.0f64, 0.0f64);
            for (a, b) in dequantized.iter().zip(xs) {
                sum += f64::from(*a) * f64::from(*b);
                magnitude += (f64::from(*a) * f64::from(*b)).abs();
            }
            out[t * rows + r] = (sum, magnitude);
        }
    }
    out
}

/// Runs `m` on `x` (`[tokens][cols]`) on the device: `[tokens][rows]`.
fn run(device: &GpuDevice, kernels: &MatmulKernels, m: &DeviceMatrix, x: &[f32]) -> Vec<f32> {
    let n_tokens = x.len() / m.cols;
    let x_buf = device.storage("x", (x.len() * 4) as u64);
    device.write_f32(&x_buf, x);
    let out = device.storage("out", (n_tokens * m.rows * 4) as u64);
    let step = device.uniform_words("step", &[n_tokens as u32, 0, 0, 0]);
    let call = kernels
        .bind(device, m, &x_buf, m.cols, &out, m.rows, 0, &step)
        .expect("bind");
    let mut encoder = device.encoder("test matmul");
    {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        call.record(&mut pass, n_tokens);
    }
    device.submit(encoder).expect("submit");
    device.read_f32(&out, n_tokens * m.rows).expect("read back")
}

fn check_type(ty: GgmlType) {
    let Some(device) = device() else { return };
    let kernels = MatmulKernels::new(&device, &[ty]).expect("kernels");
    let mut rng = StdRng::seed_from_u64(u64::from(ty.id()) * 7919 + 1);
    // The kernels read rows in chunks of 32 (plain float rows too).
    let block = ty.block_len().max(32);
    // One block, three blocks, and more 32-chunks than the kernel's 64
    // lanes (so lanes wrap), with one row, a ragged tile and many rows.
    let widths: Vec<usize> = [block, 3 * block, 80 * 32]
        .into_iter()
        .map(|w| w.div_ceil(block) * block)
        .collect();
    for &cols in &widths {
        for &rows in &[1usize, 3, 67] {
            let w = random_matrix(&mut rng, ty, rows, cols);
            let m = DeviceMatrix::upload(&device, "w", ty, rows, cols, &w).expect("upload");
            for &n_tokens in &[1usize, 5, 9] {
                let x: Vec<f32> = (0..n_tokens * cols)
                    .map(|_| rng.gen_range(-1.0f32..1.0))
                    .collect();
                let got = run(&device, &kernels, &m, &x);
                let want = reference(ty, &w, rows, cols, &x);
                for (i, (g, (sum, magnitude))) in got.iter().zip(&want).enumerate() {
                    let tolerance = 2e-6 * magnitude + 1e-30;
                    assert!(
                        (f64::from(*g) - sum).abs() <= tolerance,
                        "{ty} {rows}x{cols}, {n_tokens} tokens, output {i}: GPU {g}, CPU {sum} \
                         (tolerance {tolerance})"
                    );
                }
            }
        }
    }
}

macro_rules! type_tests {
    ($($name:ident => $ty:expr),* $(,)?) => {
        $(#[test] fn $name() { check_type($ty); })*
    };
}

type_tests! {
    matmul_f32 => GgmlType::F32,
    matmul_f16 => GgmlType::F16,
    matmul_bf16 => GgmlType::BF16,
    matmul_q4_0 => GgmlType::Q4_0,
    matmul_q4_1 => GgmlType::Q4_1,
    matmul_q5_0 => GgmlType::Q5_0,
    matmul_q5_1 => GgmlType::Q5_1,
    matmul_q8_0 => GgmlType::Q8_0,
    matmul_iq4_nl => GgmlType::IQ4_NL,
    matmul_q2_k => GgmlType::Q2_K,
    matmul_q3_k => GgmlType::Q3_K,
    matmul_q4_k => GgmlType::Q4_K,
    matmul_q5_k => GgmlType::Q5_K,
    matmul_q6_k => GgmlType::Q6_K,
    matmul_iq4_xs => GgmlType::IQ4_XS,
}

/// Each token's outputs are the same bits alone, among 19 others at any
/// place in the step, and from a matrix split over several bindings.
#[test]
fn outputs_do_not_depend_on_the_step_or_the_split() {
    let Some(device) = device() else { return };
    let kernels = MatmulKernels::new(&device, &WEIGHT_TYPES).expect("kernels");
    let mut rng = StdRng::seed_from_u64(42);
    for ty in [
        GgmlType::Q4_1,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::F16,
    ] {
        let (rows, cols) = (37, 768);
        let w = random_matrix(&mut rng, ty, rows, cols);
        let whole = DeviceMatrix::upload(&device, "w", ty, rows, cols, &w).unwrap();
        let split = DeviceMatrix::upload_in_parts(&device, "w", ty, rows, cols, &w, 5).unwrap();
        assert_eq!(split.parts.len(), 8);
        // Past 32 tokens the wide tile runs (with a ragged last tile): its
        // outputs must be the decode tile's bits.
        let n_tokens = 45;
        let x: Vec<f32> = (0..n_tokens * cols)
            .map(|_| rng.gen_range(-1.0f32..1.0))
            .collect();
        let batch = run(&device, &kernels, &whole, &x);
        assert_eq!(run(&device, &kernels, &split, &x), batch, "{ty} split");
        for t in [0, 7, 8, 19, 31, 32, 44] {
            let alone = run(&device, &kernels, &whole, &x[t * cols..][..cols]);
            assert_eq!(alone, batch[t * rows..][..rows], "{ty} token {t} alone");
            // The same token at another place in a smaller step.
            let mut shifted = x[..3 * cols].to_vec();
            shifted.extend_from_slice(&x[t * cols..][..cols]);
            let among = run(&device, &kernels, &whole, &shifted);
            assert_eq!(
                among[3 * rows..],
                batch[t * rows..][..rows],
                "{ty} token {t} moved"
            );
        }
    }
}

/// The tree's lowest levels as subgroup shuffles give the bits of the
/// workgroup-memory tree: every format, a decode tile and a wide one.
#[test]
fn subgroup_shuffles_give_the_trees_bits() {
    let Some(device) = device() else { return };
    let Some(min) = device.subgroups() else {
        eprintln!("{} has no subgroups: one path only", device.describe());
        return;
    };
    eprintln!("subgroups of at least {min} lanes");
    let plain = GpuDevice::open_with(AdapterKind::Any, false).expect("the same adapter again");
    assert_eq!(plain.subgroups(), None);
    let shuffled = MatmulKernels::new(&device, &WEIGHT_TYPES).expect("kernels");
    let tree = MatmulKernels::new(&plain, &WEIGHT_TYPES).expect("kernels");
    let mut rng = StdRng::seed_from_u64(7);
    for ty in WEIGHT_TYPES {
        let (rows, cols) = (19, 256 * 9);
        let w = random_matrix(&mut rng, ty, rows, cols);
        for n_tokens in [1, 40] {
            let x: Vec<f32> = (0..n_tokens * cols)
                .map(|_| rng.gen_range(-1.0f32..1.0))
                .collect();
            let on = DeviceMatrix::upload(&device, "w", ty, rows, cols, &w).unwrap();
            let off = DeviceMatrix::upload(&plain, "w", ty, rows, cols, &w).unwrap();
            let a: Vec<u32> = run(&device, &shuffled, &on, &x)
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let b: Vec<u32> = run(&plain, &tree, &off, &x)
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(a, b, "{ty}, {n_tokens} tokens");
        }
    }
}

#[test]
fn a_buffer_the_device_refuses_is_an_error_and_the_device_goes_on() {
    let Some(device) = device() else {
        return;
    };
    let too_big = device.limits().max_buffer_size.saturating_add(1 << 20);
    let refused = device.allocating("an oversized buffer", || {
        device.storage("oversized", too_big)
    });
    match refused {
        Err(GpuError::Allocation { what, .. }) => assert_eq!(what, "an oversized buffer"),
        other => panic!("expected an allocation error, got {:?}", other.map(|_| ())),
    }
    let fine = device
        .allocating("a small buffer", || device.storage("small", 4096))
        .expect("the device still allocates");
    drop(fine);
}
