//! Run-time choice of the SIMD level: one table of kernel pointers per level,
//! picked once per process (`INFERD_SIMD=scalar|avx2|avx512|amx` forces a
//! level when the CPU supports it). All callers, on every thread, use the same
//! table, so results never depend on who calls.

use std::sync::OnceLock;

use half::{bf16, f16};

use super::blocks::{
    BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1,
};
use super::scalar;
use super::types::GgmlType;

/// Tokens per tile in the matrix kernel: each unpacked weight block is used
/// for this many activation rows.
pub(crate) const TILE: usize = 8;

/// A dot-product kernel over `nb` blocks for `NT` activation rows at once.
///
/// # Safety
/// The CPU must support the table's level; the weight pointer must be valid
/// for `nb` weight blocks and each activation pointer for `nb` activation
/// blocks.
pub(crate) type TileFn<const NT: usize> = unsafe fn(usize, *const u8, [*const u8; NT]) -> [f32; NT];

/// A prefill kernel over groups of rows: `(blocks per row, weight rows,
/// groups of rows, activation rows, tiles of [`TILE`] tokens, out, the
/// stride between tokens in out)`; see `gemm_blocks32::matmul`.
pub(crate) type GemmFn = unsafe fn(usize, &[u8], usize, &[u8], usize, &mut [f32], usize);

/// A prefill kernel over groups of rows that reads activations prepared
/// once per matrix product and shared by the product's row tasks:
/// `prepare` fills a chunk from whole activation rows (blocks per row,
/// the rows); `matmul` is `(blocks per row, weight rows, groups of rows,
/// the chunks, out, the stride between tokens in out)`; see
/// `gemm_kquant::matmul_prepared`.
///
/// # Safety
/// As `gemm_kquant::prepare_chunk` and `gemm_kquant::matmul_prepared`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct PreparedGemm {
    pub prepare: unsafe fn(usize, &[u8], &mut PreparedChunk),
    /// Whether a chunk holds this many tokens of this many blocks per
    /// row, as `prepare` leaves it.
    pub holds: fn(&PreparedChunk, usize, usize) -> bool,
    pub matmul: PreparedGemmFn,
}

/// The product of a [`PreparedGemm`].
#[cfg(target_arch = "x86_64")]
pub(crate) type PreparedGemmFn =
    unsafe fn(usize, &[u8], usize, &[PreparedChunk], &mut [f32], usize);

#[cfg(target_arch = "x86_64")]
use super::PreparedChunk;

/// A kernel over 8 weight rows at once (`w`, the row stride in bytes) for
/// `NT` activation rows: `out[t][r]`, the bits of the one-row kernel. The
/// flag asks it to prefetch the 8 rows that follow.
///
/// # Safety
/// The CPU must support the table's level; every row (`w + r * stride`)
/// must be valid for `nb` weight blocks and each activation pointer for
/// `nb` activation blocks.
pub(crate) type Rows8Fn<const NT: usize> =
    unsafe fn(usize, *const u8, usize, [*const u8; NT], bool) -> [[f32; 8]; NT];

/// The token-count forms of a [`Rows8Fn`] kernel.
#[derive(Clone, Copy)]
pub(crate) struct Rows8Kernel {
    pub one: Rows8Fn<1>,
    pub pair: Rows8Fn<2>,
    pub quad: Rows8Fn<4>,
    pub tile: Rows8Fn<TILE>,
}

/// The single-row and tiled forms of one weight × activation dot. All are
/// instances of one generic kernel, so they agree bit for bit. The 2- and
/// 4-token forms serve short chunks (speculative verification passes), which
/// would otherwise load every weight block once per token. `rows8`, where
/// a level has it, does the same for 8 rows at once, with the same bits.
#[derive(Clone, Copy)]
pub(crate) struct DotKernel {
    pub one: TileFn<1>,
    pub pair: TileFn<2>,
    pub quad: TileFn<4>,
    pub tile: TileFn<TILE>,
    pub rows8: Option<Rows8Kernel>,
}

/// A SIMD level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    /// Portable Rust, the reference.
    Scalar,
    /// x86_64 AVX2 + FMA + F16C.
    Avx2,
    /// x86_64 AVX-512 F/BW/DQ/VL + VNNI (with AVX2, FMA, F16C).
    Avx512,
    /// [`SimdLevel::Avx512`] plus AMX-INT8 tiles (Linux, with the tile
    /// data permission granted), for the K-quant prefill.
    Amx,
    /// aarch64 NEON.
    Neon,
}

impl SimdLevel {
    /// Lower-case name, as accepted by `INFERD_SIMD`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
            Self::Amx => "amx",
            Self::Neon => "neon",
        }
    }

    /// Whether this CPU can run the level.
    pub fn is_supported(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                Self::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512dq")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(all(target_arch = "x86_64", not(loom)))]
            Self::Amx => Self::Avx512.is_supported() && super::amx::available().is_ok(),
            #[cfg(target_arch = "aarch64")]
            Self::Neon => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

/// `(queries, rows, hd, n, outputs)`: each query's dot with widened rows
/// `0..n` (`hd` values each, `hd` apart) into its output.
/// # Safety: the CPU must support the level; the rows readable, each query
/// for `hd` values, each output writable for `n` and apart from the others.
pub(crate) type DotRowsShared = unsafe fn(&[*const f32], *const f32, usize, usize, &[*mut f32]);

/// `(weights, rows, hd, n, lanes, first)`: each query's weight `i` times
/// widened row `i` into lane `(first + i) % 16` of its lanes (`[16][hd]`).
/// # Safety: the CPU must support the level; the rows readable, each weight
/// run for `n`, each lane block writable for `16 * hd` and apart from the
/// others.
pub(crate) type AxpyRowsShared =
    unsafe fn(&[*const f32], *const f32, usize, usize, &[*mut f32], usize);

/// A level's attention kernels over rows widened to f32 (see
/// `Kernels::wide_attention`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct WideKernels {
    /// # Safety: the CPU must support the level; rows `0..n` readable for
    /// `hd` f16 values at `stride` apart, the output writable for `n * hd`.
    pub widen: unsafe fn(*const f16, usize, usize, usize, *mut f32),
    /// Dots of 1 to 4 queries with the same rows.
    /// # Safety: see [`DotRowsShared`].
    pub dot_rows_shared: DotRowsShared,
    /// Weighted sums of the same rows for 1 to 4 queries.
    /// # Safety: see [`AxpyRowsShared`].
    pub axpy_rows_shared: AxpyRowsShared,
}

/// Every kernel of one SIMD level.
pub(crate) struct Kernels {
    pub level: SimdLevel,
    pub q4_0: DotKernel,
    pub q4_1: DotKernel,
    pub q5_0: DotKernel,
    pub q5_1: DotKernel,
    pub q8_0: DotKernel,
    pub iq4_nl: DotKernel,
    pub q2_k: DotKernel,
    pub q3_k: DotKernel,
    pub q4_k: DotKernel,
    pub q5_k: DotKernel,
    pub q6_k: DotKernel,
    pub iq4_xs: DotKernel,
    pub f16: DotKernel,
    pub bf16: DotKernel,
    pub f32: DotKernel,
    /// The level's prefill kernel over groups of rows for a weight format,
    /// if it has one.
    pub gemm: fn(GgmlType) -> Option<GemmFn>,
    /// The level's prefill kernel over groups of rows that reads shared
    /// prepared activations, for the formats that have one (it then
    /// stands in for `gemm` where the caller prepared them).
    #[cfg(target_arch = "x86_64")]
    pub prepared_gemm: fn(GgmlType) -> Option<PreparedGemm>,
    /// # Safety: the CPU must support the level.
    pub quantize_q8_0: unsafe fn(&[f32], &mut [BlockQ8_0]),
    /// # Safety: the CPU must support the level.
    pub quantize_q8_1: unsafe fn(&[f32], &mut [BlockQ8_1]),
    /// # Safety: the CPU must support the level.
    pub quantize_q8_k: unsafe fn(&[f32], &mut [BlockQ8K]),
    /// # Safety: the CPU must support the level; `n`, pointers as [`TileFn`].
    pub dot_f16: unsafe fn(usize, *const u8, *const u8) -> f32,
    /// # Safety: the CPU must support the level.
    pub axpy_f16: unsafe fn(f32, &[f16], &mut [f32]),
    /// The level's f16 dot of one query with each of `out.len()` rows.
    /// # Safety: the CPU must support the level; see [`f16_dot_rows!`].
    pub dot_f16_rows: unsafe fn(&[f16], *const f16, usize, &mut [f32]),
    /// `axpy_f16` of `w[i]` times row `i` into lane `(first + i) % 16`.
    /// # Safety: the CPU must support the level; see [`f16_dot_rows!`].
    pub axpy_f16_rows: unsafe fn(&[f32], *const f16, usize, &mut [f32], usize),
    /// Attention over K/V rows widened to f32 once for every query that
    /// reads them, with `dot_f16_rows`' and `axpy_f16_rows`' bits (head
    /// widths that are a multiple of 16), where the level has it.
    pub wide_attention: Option<WideKernels>,
    /// `x = f32(f16(x * scale))` in place.
    /// # Safety: the CPU must support the level.
    pub scale_round_f16: unsafe fn(&mut [f32], f32),
    /// ggml's `expf` in place.
    /// # Safety: the CPU must support the level.
    pub exp_ggml: unsafe fn(&mut [f32]),
    /// `gate = silu(gate) * up` with ggml's `expf`.
    /// # Safety: the CPU must support the level.
    pub swiglu_ggml: unsafe fn(&mut [f32], &[f32]),
    /// `gate = gelu(gate) * up` with ggml's f16 GELU table.
    /// # Safety: the CPU must support the level.
    pub geglu_ggml: unsafe fn(&mut [f32], &[f32]),
}

/// Builds the forms of a generic tile kernel.
macro_rules! dot_kernel {
    ($($f:ident)::+) => {
        DotKernel {
            one: $($f)::+::<1>,
            pair: $($f)::+::<2>,
            quad: $($f)::+::<4>,
            tile: $($f)::+::<TILE>,
            rows8: None,
        }
    };
    ($($f:ident)::+, rows8 $block:ty) => {
        DotKernel {
            rows8: Some(Rows8Kernel {
                one: rows8::rows8::<$block, 1>,
                pair: rows8::rows8::<$block, 2>,
                quad: rows8::rows8::<$block, 4>,
                tile: rows8::rows8::<$block, TILE>,
            }),
            ..dot_kernel!($($f)::+)
        }
    };
}

/// Loops over rows of the attention cache around a level's one-row f16 dot
/// (or axpy, [`f16_axpy_rows!`]), so that a query's whole block of rows
/// costs one dispatched call and the per-row kernel inlines. Each row gets
/// exactly the one-row kernel's operations.
///
/// The generated function reads row `i` at `rows + i * stride` for
/// `head_dim` values (the query's length, or `lanes.len() / 16`): the
/// caller must make those reads valid.
macro_rules! f16_dot_rows {
    ($dot_rows:ident, $dot:path $(, $features:literal)?) => {
        /// Row-loop form of the level's f16 dot.
        ///
        /// # Safety
        /// The CPU must support the level; every row readable (see the
        /// macro).
        $(#[target_feature(enable = $features)])?
        unsafe fn $dot_rows(q: &[f16], rows: *const f16, stride: usize, out: &mut [f32]) {
            for (i, o) in out.iter_mut().enumerate() {
                // SAFETY: the caller makes row `i` readable for `q.len()`.
                *o = unsafe {
                    $dot(q.len(), q.as_ptr() as *const u8, rows.add(i * stride) as *const u8)
                };
            }
        }
    };
}

/// The axpy twin of [`f16_dot_rows!`].
macro_rules! f16_axpy_rows {
    ($axpy_rows:ident, $axpy:path $(, $features:literal)?) => {
        /// Row-loop form of the level's f16 axpy.
        ///
        /// # Safety
        /// The CPU must support the level; every row readable (see
        /// [`f16_dot_rows!`]).
        $(#[target_feature(enable = $features)])?
        unsafe fn $axpy_rows(
            w: &[f32],
            rows: *const f16,
            stride: usize,
            lanes: &mut [f32],
            first: usize,
        ) {
            let hd = lanes.len() / 16;
            for (i, &wi) in w.iter().enumerate() {
                // SAFETY: the caller makes row `i` readable for `hd`.
                let row = unsafe { std::slice::from_raw_parts(rows.add(i * stride), hd) };
                let lane = ((first + i) % 16) * hd;
                // SAFETY: the level is supported (the caller's promise).
                unsafe { $axpy(wi, row, &mut lanes[lane..lane + hd]) };
            }
        }
    };
}

f16_dot_rows!(scalar_dot_f16_rows, scalar_dot_f16_ptr);
f16_axpy_rows!(scalar_axpy_f16_rows, scalar_axpy_f16);

/// Adapts a typed scalar dot to the tile signature: one call per token.
macro_rules! scalar_tile {
    ($name:ident, $wty:ty, $aty:ty, $dot:path) => {
        /// Scalar tile: the reference dot once per activation row.
        ///
        /// # Safety
        /// Pointers as in [`TileFn`].
        unsafe fn $name<const NT: usize>(nb: usize, w: *const u8, a: [*const u8; NT]) -> [f32; NT] {
            // SAFETY: the caller guarantees `nb` readable blocks at every
            // pointer; blocks are alignment-1 plain data.
            let w = unsafe { std::slice::from_raw_parts(w as *const $wty, nb) };
            let mut out = [0.0f32; NT];
            for (o, ap) in out.iter_mut().zip(a) {
                // SAFETY: as above.
                let acts = unsafe { std::slice::from_raw_parts(ap as *const $aty, nb) };
                *o = $dot(w, acts);
            }
            out
        }
    };
}

scalar_tile!(scalar_q4_0, BlockQ4_0, BlockQ8_0, scalar::dot_q4_0_q8_0);
scalar_tile!(scalar_q4_1, BlockQ4_1, BlockQ8_1, scalar::dot_q4_1_q8_1);
scalar_tile!(scalar_q5_0, BlockQ5_0, BlockQ8_0, scalar::dot_q5_0_q8_0);
scalar_tile!(scalar_q5_1, BlockQ5_1, BlockQ8_1, scalar::dot_q5_1_q8_1);
scalar_tile!(scalar_q8_0, BlockQ8_0, BlockQ8_0, scalar::dot_q8_0_q8_0);
scalar_tile!(
    scalar_iq4_nl,
    BlockIQ4NL,
    BlockQ8_0,
    scalar::dot_iq4_nl_q8_0
);
scalar_tile!(scalar_q2_k, BlockQ2K, BlockQ8K, scalar::dot_q2_k_q8_k);
scalar_tile!(scalar_q3_k, BlockQ3K, BlockQ8K, scalar::dot_q3_k_q8_k);
scalar_tile!(scalar_q4_k, BlockQ4K, BlockQ8K, scalar::dot_q4_k_q8_k);
scalar_tile!(scalar_q5_k, BlockQ5K, BlockQ8K, scalar::dot_q5_k_q8_k);
scalar_tile!(scalar_q6_k, BlockQ6K, BlockQ8K, scalar::dot_q6_k_q8_k);
scalar_tile!(scalar_iq4_xs, BlockIQ4XS, BlockQ8K, scalar::dot_iq4_xs_q8_k);

/// Adapts a two-pointer float dot (`n` elements) to the tile signature.
macro_rules! float_tile {
    ($name:ident, $dot:path) => {
        /// Float tile: the two-vector dot once per activation row.
        ///
        /// # Safety
        /// As the wrapped dot; pointers as in [`TileFn`].
        unsafe fn $name<const NT: usize>(n: usize, w: *const u8, a: [*const u8; NT]) -> [f32; NT] {
            let mut out = [0.0f32; NT];
            for (o, ap) in out.iter_mut().zip(a) {
                // SAFETY: forwarded from the caller.
                *o = unsafe { $dot(n, w, ap) };
            }
            out
        }
    };
}

/// Reads element `i` of a little-endian 2-byte array.
///
/// # Safety
/// `p` must be readable for `2 * (i + 1)` bytes.
#[inline(always)]
unsafe fn read2(p: *const u8, i: usize) -> [u8; 2] {
    // SAFETY: forwarded from the caller; unaligned read of plain bytes.
    unsafe { std::ptr::read_unaligned(p.add(2 * i) as *const [u8; 2]) }
}

/// Scalar f16 dot over byte pointers, same order as [`scalar::dot_f16`].
///
/// # Safety
/// Both pointers readable for `n` f16 values.
unsafe fn scalar_dot_f16_ptr(n: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = [0.0f32; 16];
    for i in 0..n {
        // SAFETY: `i < n`, forwarded from the caller.
        let (a, b) = unsafe { (read2(x, i), read2(y, i)) };
        acc[i % 16] = f16::from_le_bytes(a)
            .to_f32()
            .mul_add(f16::from_le_bytes(b).to_f32(), acc[i % 16]);
    }
    scalar::reduce16(&acc)
}

/// Scalar bf16 dot over byte pointers, same order as [`scalar::dot_bf16`].
///
/// # Safety
/// Both pointers readable for `n` bf16 values.
unsafe fn scalar_dot_bf16_ptr(n: usize, x: *const u8, y: *const u8) -> f32 {
    let mut s = 0.0f32;
    for i in 0..n {
        // SAFETY: `i < n`, forwarded from the caller.
        let (a, b) = unsafe { (read2(x, i), read2(y, i)) };
        s += bf16::from_le_bytes(a).to_f32() * bf16::from_le_bytes(b).to_f32();
    }
    s
}

/// Scalar f32 dot over byte pointers, same order as [`scalar::dot_f32`].
///
/// # Safety
/// Both pointers readable for `n` f32 values.
unsafe fn scalar_dot_f32_ptr(n: usize, x: *const u8, y: *const u8) -> f32 {
    let mut s = 0.0f32;
    for i in 0..n {
        // SAFETY: `i < n`, forwarded from the caller; unaligned reads.
        let (a, b) = unsafe {
            (
                std::ptr::read_unaligned((x as *const f32).add(i)),
                std::ptr::read_unaligned((y as *const f32).add(i)),
            )
        };
        s += a * b;
    }
    s
}

float_tile!(scalar_f16, scalar_dot_f16_ptr);
float_tile!(scalar_bf16, scalar_dot_bf16_ptr);
float_tile!(scalar_f32, scalar_dot_f32_ptr);

/// Scalar axpy with the table's signature.
///
/// # Safety
/// None beyond the signature; `unsafe` only to fit the table.
unsafe fn scalar_axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
    scalar::axpy_f16(a, x, y)
}

unsafe fn scalar_scale_round_f16(x: &mut [f32], scale: f32) {
    scalar::scale_round_f16(x, scale)
}

/// Scalar ggml `expf` with the table's signature.
///
/// # Safety
/// None beyond the signature; `unsafe` only to fit the table.
unsafe fn scalar_exp_ggml(x: &mut [f32]) {
    scalar::exp_ggml_in_place(x)
}

/// Scalar SwiGLU with the table's signature.
///
/// # Safety
/// None beyond the signature; `unsafe` only to fit the table.
unsafe fn scalar_swiglu_ggml(gate: &mut [f32], up: &[f32]) {
    scalar::swiglu_ggml(gate, up)
}

/// Scalar GeGLU with the table's signature.
///
/// # Safety
/// None beyond the signature; `unsafe` only to fit the table.
unsafe fn scalar_geglu_ggml(gate: &mut [f32], up: &[f32]) {
    super::gelu::geglu_scalar(gate, up)
}

/// No prefill kernel over groups of rows: the one-row kernels do it all.
fn no_gemm(_: GgmlType) -> Option<GemmFn> {
    None
}

/// No prefill kernel reads prepared activations.
#[cfg(target_arch = "x86_64")]
fn no_prepared_gemm(_: GgmlType) -> Option<PreparedGemm> {
    None
}

/// The portable reference table (a `const` so other tables can start from it).
const SCALAR_TABLE: Kernels = Kernels {
    level: SimdLevel::Scalar,
    q4_0: dot_kernel!(scalar_q4_0),
    q4_1: dot_kernel!(scalar_q4_1),
    q5_0: dot_kernel!(scalar_q5_0),
    q5_1: dot_kernel!(scalar_q5_1),
    q8_0: dot_kernel!(scalar_q8_0),
    iq4_nl: dot_kernel!(scalar_iq4_nl),
    q2_k: dot_kernel!(scalar_q2_k),
    q3_k: dot_kernel!(scalar_q3_k),
    q4_k: dot_kernel!(scalar_q4_k),
    q5_k: dot_kernel!(scalar_q5_k),
    q6_k: dot_kernel!(scalar_q6_k),
    iq4_xs: dot_kernel!(scalar_iq4_xs),
    f16: dot_kernel!(scalar_f16),
    bf16: dot_kernel!(scalar_bf16),
    f32: dot_kernel!(scalar_f32),
    gemm: no_gemm,
    #[cfg(target_arch = "x86_64")]
    prepared_gemm: no_prepared_gemm,
    quantize_q8_0: scalar::quantize_q8_0,
    quantize_q8_1: scalar::quantize_q8_1,
    quantize_q8_k: scalar::quantize_q8_k,
    dot_f16: scalar_dot_f16_ptr,
    axpy_f16: scalar_axpy_f16,
    dot_f16_rows: scalar_dot_f16_rows,
    axpy_f16_rows: scalar_axpy_f16_rows,
    wide_attention: None,
    scale_round_f16: scalar_scale_round_f16,
    exp_ggml: scalar_exp_ggml,
    swiglu_ggml: scalar_swiglu_ggml,
    geglu_ggml: scalar_geglu_ggml,
};

static SCALAR: Kernels = SCALAR_TABLE;

#[cfg(target_arch = "x86_64")]
mod x86_tables {
    #[cfg(not(loom))]
    use super::super::amx_kquant;
    use super::super::{avx2, avx512, avx512_shared_rows, gemm_blocks32, gemm_kquant, rows8};
    use super::*;

    float_tile!(avx2_f16, avx2::dot_f16_ptr);
    float_tile!(avx2_bf16, avx2::dot_bf16_ptr);
    float_tile!(avx2_f32, avx2::dot_f32_ptr);
    float_tile!(avx512_f16, avx512::dot_f16_ptr);
    f16_dot_rows!(avx2_dot_f16_rows, avx2::dot_f16_ptr, "avx2,fma,f16c");
    f16_axpy_rows!(avx2_axpy_f16_rows, avx2::axpy_f16, "avx2,fma,f16c");

    /// The AVX-512 VNNI prefill kernels over groups of 8 rows: the
    /// 32-element block formats, Q4_K and Q6_K.
    fn avx512_gemm(ty: GgmlType) -> Option<GemmFn> {
        use gemm_blocks32::matmul;
        Some(match ty {
            GgmlType::Q4_0 => matmul::<BlockQ4_0>,
            GgmlType::Q4_1 => matmul::<BlockQ4_1>,
            GgmlType::Q5_0 => matmul::<BlockQ5_0>,
            GgmlType::Q5_1 => matmul::<BlockQ5_1>,
            GgmlType::Q8_0 => matmul::<BlockQ8_0>,
            GgmlType::IQ4_NL => matmul::<BlockIQ4NL>,
            GgmlType::Q4_K => gemm_kquant::matmul::<BlockQ4K>,
            GgmlType::Q5_K => gemm_kquant::matmul::<BlockQ5K>,
            GgmlType::Q6_K => gemm_kquant::matmul::<BlockQ6K>,
            _ => return None,
        })
    }

    /// The entry for `ty` among a level's kernels over shared prepared
    /// activations (`kernels`: each format it has one for).
    fn kquant_prepared(
        ty: GgmlType,
        prepare: unsafe fn(usize, &[u8], &mut PreparedChunk),
        holds: fn(&PreparedChunk, usize, usize) -> bool,
        kernels: &[(GgmlType, PreparedGemmFn)],
    ) -> Option<PreparedGemm> {
        let matmul = kernels.iter().find(|(t, _)| *t == ty)?.1;
        Some(PreparedGemm {
            prepare,
            holds,
            matmul,
        })
    }

    /// The AVX-512 VNNI prefill kernels over shared prepared activations:
    /// the 32-element block formats, Q4_K, Q5_K and Q6_K.
    fn avx512_prepared_gemm(ty: GgmlType) -> Option<PreparedGemm> {
        blocks32_prepared(ty).or_else(|| avx512_kquant_prepared(ty))
    }

    /// `gemm_blocks32`'s entry for `ty` over shared prepared activations.
    fn blocks32_prepared(ty: GgmlType) -> Option<PreparedGemm> {
        fn entry<W: gemm_blocks32::Weights32>() -> Option<PreparedGemm> {
            Some(PreparedGemm {
                prepare: gemm_blocks32::prepare_chunk::<W>,
                holds: |c, tokens, nb| c.blocks32.holds(tokens, nb),
                matmul: gemm_blocks32::matmul_prepared::<W>,
            })
        }
        match ty {
            GgmlType::Q4_0 => entry::<BlockQ4_0>(),
            GgmlType::Q4_1 => entry::<BlockQ4_1>(),
            GgmlType::Q5_0 => entry::<BlockQ5_0>(),
            GgmlType::Q5_1 => entry::<BlockQ5_1>(),
            GgmlType::Q8_0 => entry::<BlockQ8_0>(),
            GgmlType::IQ4_NL => entry::<BlockIQ4NL>(),
            _ => None,
        }
    }

    /// The AVX-512 VNNI K-quant prefill kernels over shared prepared
    /// activations.
    fn avx512_kquant_prepared(ty: GgmlType) -> Option<PreparedGemm> {
        kquant_prepared(
            ty,
            gemm_kquant::prepare_chunk,
            |c, tokens, nb| c.vnni.holds(tokens, nb),
            &[
                (GgmlType::Q4_K, gemm_kquant::matmul_prepared::<BlockQ4K>),
                (GgmlType::Q5_K, gemm_kquant::matmul_prepared::<BlockQ5K>),
                (GgmlType::Q6_K, gemm_kquant::matmul_prepared::<BlockQ6K>),
            ],
        )
    }

    pub(crate) static AVX2: Kernels = Kernels {
        level: SimdLevel::Avx2,
        q4_0: dot_kernel!(avx2::dot_q4_0_q8_0),
        q4_1: dot_kernel!(avx2::dot_q4_1_q8_1),
        q5_0: dot_kernel!(avx2::dot_q5_0_q8_0),
        q5_1: dot_kernel!(avx2::dot_q5_1_q8_1),
        q8_0: dot_kernel!(avx2::dot_q8_0_q8_0),
        iq4_nl: dot_kernel!(avx2::dot_iq4_nl_q8_0),
        q2_k: dot_kernel!(avx2::dot_q2_k_q8_k),
        q3_k: dot_kernel!(avx2::dot_q3_k_q8_k),
        q4_k: dot_kernel!(avx2::dot_q4_k_q8_k),
        q5_k: dot_kernel!(avx2::dot_q5_k_q8_k),
        q6_k: dot_kernel!(avx2::dot_q6_k_q8_k),
        iq4_xs: dot_kernel!(avx2::dot_iq4_xs_q8_k),
        f16: dot_kernel!(avx2_f16),
        bf16: dot_kernel!(avx2_bf16),
        f32: dot_kernel!(avx2_f32),
        gemm: no_gemm,
        prepared_gemm: no_prepared_gemm,
        quantize_q8_0: avx2::quantize_q8_0,
        quantize_q8_1: avx2::quantize_q8_1,
        quantize_q8_k: avx2::quantize_q8_k,
        dot_f16: avx2::dot_f16_ptr,
        axpy_f16: avx2::axpy_f16,
        dot_f16_rows: avx2_dot_f16_rows,
        axpy_f16_rows: avx2_axpy_f16_rows,
        wide_attention: None,
        scale_round_f16: avx2::scale_round_f16,
        exp_ggml: avx2::exp_ggml,
        swiglu_ggml: avx2::swiglu_ggml,
        geglu_ggml: scalar_geglu_ggml,
    };

    pub(crate) static AVX512: Kernels = AVX512_TABLE;

    /// The AMX tile prefill kernels for Q4_K, Q5_K, Q6_K and IQ4_XS; the
    /// AVX-512 ones for the rest.
    #[cfg(not(loom))]
    fn amx_gemm(ty: GgmlType) -> Option<GemmFn> {
        match ty {
            GgmlType::Q4_K => Some(amx_kquant::matmul::<BlockQ4K>),
            GgmlType::Q5_K => Some(amx_kquant::matmul::<BlockQ5K>),
            GgmlType::IQ4_XS => Some(amx_kquant::matmul::<BlockIQ4XS>),
            GgmlType::Q6_K => Some(amx_kquant::matmul::<BlockQ6K>),
            _ => avx512_gemm(ty),
        }
    }

    /// The AMX tile prefill kernels over shared prepared activations.
    #[cfg(not(loom))]
    fn amx_prepared_gemm(ty: GgmlType) -> Option<PreparedGemm> {
        amx_kquant_prepared(ty).or_else(|| blocks32_prepared(ty))
    }

    /// The AMX tile K-quant prefill kernels over shared prepared
    /// activations.
    #[cfg(not(loom))]
    fn amx_kquant_prepared(ty: GgmlType) -> Option<PreparedGemm> {
        kquant_prepared(
            ty,
            amx_kquant::prepare_chunk,
            |c, tokens, nb| c.amx.holds(tokens, nb),
            &[
                (GgmlType::Q4_K, amx_kquant::matmul_prepared::<BlockQ4K>),
                (GgmlType::Q5_K, amx_kquant::matmul_prepared::<BlockQ5K>),
                (GgmlType::Q6_K, amx_kquant::matmul_prepared::<BlockQ6K>),
                (GgmlType::IQ4_XS, amx_kquant::matmul_prepared::<BlockIQ4XS>),
            ],
        )
    }

    /// AVX-512 with the AMX tile kernels for the Q4_K, Q5_K, Q6_K and
    /// IQ4_XS prefill.
    #[cfg(not(loom))]
    pub(crate) static AMX: Kernels = Kernels {
        level: SimdLevel::Amx,
        gemm: amx_gemm,
        prepared_gemm: amx_prepared_gemm,
        ..AVX512_TABLE
    };

    const AVX512_TABLE: Kernels = Kernels {
        level: SimdLevel::Avx512,
        q4_0: dot_kernel!(avx512::dot_q4_0_q8_0, rows8 BlockQ4_0),
        q4_1: dot_kernel!(avx512::dot_q4_1_q8_1, rows8 BlockQ4_1),
        q5_0: dot_kernel!(avx512::dot_q5_0_q8_0, rows8 BlockQ5_0),
        q5_1: dot_kernel!(avx512::dot_q5_1_q8_1, rows8 BlockQ5_1),
        q8_0: dot_kernel!(avx512::dot_q8_0_q8_0, rows8 BlockQ8_0),
        iq4_nl: dot_kernel!(avx512::dot_iq4_nl_q8_0, rows8 BlockIQ4NL),
        q2_k: dot_kernel!(avx2::dot_q2_k_q8_k),
        q3_k: dot_kernel!(avx2::dot_q3_k_q8_k),
        q4_k: dot_kernel!(avx512::dot_q4_k_q8_k),
        q5_k: dot_kernel!(avx512::dot_q5_k_q8_k),
        q6_k: dot_kernel!(avx512::dot_q6_k_q8_k),
        iq4_xs: dot_kernel!(avx512::dot_iq4_xs_q8_k),
        f16: dot_kernel!(avx512_f16),
        bf16: dot_kernel!(avx2_bf16),
        f32: dot_kernel!(avx2_f32),
        gemm: avx512_gemm,
        prepared_gemm: avx512_prepared_gemm,
        quantize_q8_0: avx2::quantize_q8_0,
        quantize_q8_1: avx2::quantize_q8_1,
        quantize_q8_k: avx2::quantize_q8_k,
        dot_f16: avx512::dot_f16_ptr,
        axpy_f16: avx512::axpy_f16,
        dot_f16_rows: avx512::dot_f16_rows,
        axpy_f16_rows: avx512::axpy_f16_rows,
        wide_attention: Some(WideKernels {
            widen: avx512::widen_f16_rows,
            dot_rows_shared: avx512_shared_rows::dot_f32_rows_shared,
            axpy_rows_shared: avx512_shared_rows::axpy_f32_rows_shared,
        }),
        scale_round_f16: avx2::scale_round_f16,
        exp_ggml: avx512::exp_ggml,
        swiglu_ggml: avx512::swiglu_ggml,
        geglu_ggml: super::super::gelu::geglu_avx512,
    };
}

#[cfg(target_arch = "aarch64")]
mod arm_tables {
    use super::super::neon;
    use super::*;

    pub(crate) static NEON: Kernels = Kernels {
        q4_0: dot_kernel!(neon::dot_q4_0_q8_0),
        q4_1: dot_kernel!(neon::dot_q4_1_q8_1),
        q8_0: dot_kernel!(neon::dot_q8_0_q8_0),
        level: SimdLevel::Neon,
        ..SCALAR_TABLE
    };
}

/// The table for `level`, or `None` when this CPU cannot run it.
pub(crate) fn kernels_for(level: SimdLevel) -> Option<&'static Kernels> {
    if !level.is_supported() {
        return None;
    }
    match level {
        SimdLevel::Scalar => Some(&SCALAR),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => Some(&x86_tables::AVX2),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => Some(&x86_tables::AVX512),
        #[cfg(all(target_arch = "x86_64", not(loom)))]
        SimdLevel::Amx => Some(&x86_tables::AMX),
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon => Some(&arm_tables::NEON),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// Levels from best to worst.
const PREFERENCE: [SimdLevel; 5] = [
    SimdLevel::Amx,
    SimdLevel::Avx512,
    SimdLevel::Avx2,
    SimdLevel::Neon,
    SimdLevel::Scalar,
];

/// The best level this CPU supports.
fn best() -> &'static Kernels {
    PREFERENCE
        .iter()
        .find_map(|&l| kernels_for(l))
        .unwrap_or(&SCALAR)
}

/// Picks the table: the level named by `INFERD_SIMD` when it is supported,
/// else the best one.
fn choose() -> &'static Kernels {
    let requested = std::env::var("INFERD_SIMD").ok();
    let forced = requested.as_deref().and_then(|name| {
        PREFERENCE
            .iter()
            .find(|l| l.name().eq_ignore_ascii_case(name.trim()))
            .and_then(|&l| kernels_for(l))
    });
    forced.unwrap_or_else(best)
}

/// The process-wide table.
pub(crate) fn active() -> &'static Kernels {
    static ACTIVE: OnceLock<&'static Kernels> = OnceLock::new();
    ACTIVE.get_or_init(choose)
}

/// All levels this CPU supports, best first (for tests and benchmarks).
pub fn supported_levels() -> Vec<SimdLevel> {
    PREFERENCE
        .iter()
        .copied()
        .filter(|l| l.is_supported())
        .collect()
}
