//! Tensor element formats and the kernels that multiply them.
//!
//! Weights stay in their GGUF block format; activations are quantized to
//! the 8-bit format llama.cpp pairs with each weight format
//! ([`activation_type`]) and multiplied with integer dot products. A scalar
//! reference exists for every kernel; SIMD versions (AVX-512 VNNI, AVX2,
//! NEON) are chosen once per process ([`simd_level`]).
//!
//! Numerics are batch-invariant: [`matmul`] writes, for every (row, token),
//! exactly the bits [`vec_dot`] returns for that pair, whatever the number of
//! tokens, and every thread uses the same kernels. On AVX-512, batches go
//! through row-group kernels (`gemm_blocks32`, `gemm_kquant`) that unpack
//! 8 rows once per call (per 512 tokens for the K-quants) and keep each
//! row's lanes and float steps; shorter ones (decode, verification passes)
//! of the 32-element formats through `rows8`, which unpacks 8 rows per
//! block in registers.

mod blocks;
mod dispatch;
mod gelu;
mod scalar;
mod types;

#[cfg(all(target_arch = "x86_64", not(loom)))]
pub mod amx;
#[cfg(all(target_arch = "x86_64", not(loom)))]
mod amx_kquant;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_shared_rows;
#[cfg(target_arch = "x86_64")]
mod gemm_blocks32;
#[cfg(target_arch = "x86_64")]
mod gemm_kquant;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod rows8;

use thiserror::Error;

pub use blocks::{
    BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1, KVALUES_IQ4NL,
};
pub use dispatch::{supported_levels, SimdLevel};
pub use types::{GgmlType, QK_K};

use dispatch::{DotKernel, Kernels, Rows8Fn, TileFn, TILE};

/// Why a quantization call was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// No dot-product kernel exists for this weight format.
    #[error("no dot-product kernel for weight type {ty} (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)")]
    UnsupportedWeight { ty: GgmlType },
    /// The type is not one activations can be quantized to.
    #[error("{ty} is not an activation format (expected F32, F16, BF16, Q8_0, Q8_1 or Q8_K)")]
    NotActivation { ty: GgmlType },
    /// The element count is not a whole number of blocks.
    #[error("{n} elements is not a whole number of {ty} blocks of {block_len}")]
    PartialBlock {
        ty: GgmlType,
        n: usize,
        block_len: usize,
    },
    /// A buffer does not have the size the shapes call for.
    #[error("{what} holds {got} elements/bytes, expected {expected}")]
    WrongLength {
        what: &'static str,
        got: usize,
        expected: usize,
    },
}

/// The activation format paired with a weight format (llama.cpp's
/// `vec_dot_type`).
pub fn activation_type(weight: GgmlType) -> Result<GgmlType, QuantError> {
    Ok(match weight {
        GgmlType::F32 => GgmlType::F32,
        GgmlType::F16 => GgmlType::F16,
        GgmlType::BF16 => GgmlType::BF16,
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => GgmlType::Q8_0,
        GgmlType::Q4_1 | GgmlType::Q5_1 => GgmlType::Q8_1,
        GgmlType::Q2_K
        | GgmlType::Q3_K
        | GgmlType::Q4_K
        | GgmlType::Q5_K
        | GgmlType::Q6_K
        | GgmlType::IQ4_XS => GgmlType::Q8_K,
        ty => return Err(QuantError::UnsupportedWeight { ty }),
    })
}

/// Which SIMD level was picked (for a start-up log line).
pub fn simd_level() -> &'static str {
    dispatch::active().level.name()
}

/// Whether the AMX tile kernels run, and if not why (for the log line
/// beside [`simd_level`]).
pub fn amx_status() -> &'static str {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    {
        match amx::available() {
            _ if dispatch::active().level == SimdLevel::Amx => "in use",
            Ok(()) => "available, not chosen (INFERD_SIMD)",
            Err(amx::Unavailable::NoCpuSupport) => "no (the CPU has no AMX-INT8)",
            Err(amx::Unavailable::PermissionRefused) => {
                "no (the kernel refused the tile data permission)"
            }
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    {
        "no (not an x86-64 build)"
    }
}

/// Bytes of a row of `n` elements of `ty`, or a [`QuantError::PartialBlock`].
fn row_bytes(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    ty.row_bytes(n).ok_or(QuantError::PartialBlock {
        ty,
        n,
        block_len: ty.block_len(),
    })
}

/// Checks that `len` equals `expected`.
fn expect_len(what: &'static str, len: usize, expected: usize) -> Result<(), QuantError> {
    if len == expected {
        Ok(())
    } else {
        Err(QuantError::WrongLength {
            what,
            got: len,
            expected,
        })
    }
}

/// Quantizes one activation row `x` into `out`
/// (`out.len() == act_ty.row_bytes(x.len())`).
pub fn quantize_row(act_ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    quantize_row_with(dispatch::active(), act_ty, x, out)
}

fn quantize_row_with(
    k: &Kernels,
    act_ty: GgmlType,
    x: &[f32],
    out: &mut [u8],
) -> Result<(), QuantError> {
    if !matches!(
        act_ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q8_0
            | GgmlType::Q8_1
            | GgmlType::Q8_K
    ) {
        return Err(QuantError::NotActivation { ty: act_ty });
    }
    let bytes = row_bytes(act_ty, x.len())?;
    expect_len("quantized activation buffer", out.len(), bytes)?;
    match act_ty {
        GgmlType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            // SAFETY: the table's level was checked to be supported when the
            // table was handed out; the cast checked whole blocks.
            unsafe { (k.quantize_q8_0)(x, bytemuck::cast_slice_mut(out)) }
        }
        GgmlType::Q8_1 => {
            // SAFETY: as for Q8_0.
            unsafe { (k.quantize_q8_1)(x, bytemuck::cast_slice_mut(out)) }
        }
        GgmlType::Q8_K => {
            // SAFETY: as for Q8_0.
            unsafe { (k.quantize_q8_k)(x, bytemuck::cast_slice_mut(out)) }
        }
        ty => return Err(QuantError::NotActivation { ty }),
    }
    Ok(())
}

/// Dequantizes one row (`dst.len()` elements) of format `ty`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let bytes = row_bytes(ty, dst.len())?;
    expect_len("source row", src.len(), bytes)?;
    match ty {
        GgmlType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        GgmlType::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        GgmlType::Q4_0 => scalar::dequantize_q4_0(bytemuck::cast_slice(src), dst),
        GgmlType::Q4_1 => scalar::dequantize_q4_1(bytemuck::cast_slice(src), dst),
        GgmlType::Q5_0 => scalar::dequantize_q5_0(bytemuck::cast_slice(src), dst),
        GgmlType::Q5_1 => scalar::dequantize_q5_1(bytemuck::cast_slice(src), dst),
        GgmlType::Q8_0 => scalar::dequantize_q8_0(bytemuck::cast_slice(src), dst),
        GgmlType::Q8_1 => scalar::dequantize_q8_1(bytemuck::cast_slice(src), dst),
        GgmlType::IQ4_NL => scalar::dequantize_iq4_nl(bytemuck::cast_slice(src), dst),
        GgmlType::Q2_K => scalar::dequantize_q2_k(bytemuck::cast_slice(src), dst),
        GgmlType::Q3_K => scalar::dequantize_q3_k(bytemuck::cast_slice(src), dst),
        GgmlType::Q4_K => scalar::dequantize_q4_k(bytemuck::cast_slice(src), dst),
        GgmlType::Q5_K => scalar::dequantize_q5_k(bytemuck::cast_slice(src), dst),
        GgmlType::Q6_K => scalar::dequantize_q6_k(bytemuck::cast_slice(src), dst),
        GgmlType::Q8_K => scalar::dequantize_q8_k(bytemuck::cast_slice(src), dst),
        GgmlType::IQ4_XS => scalar::dequantize_iq4_xs(bytemuck::cast_slice(src), dst),
    }
    Ok(())
}

/// The kernel pair of a weight format in table `k`.
fn dot_kernel(k: &Kernels, w_ty: GgmlType) -> Option<DotKernel> {
    Some(match w_ty {
        GgmlType::Q4_0 => k.q4_0,
        GgmlType::Q4_1 => k.q4_1,
        GgmlType::Q5_0 => k.q5_0,
        GgmlType::Q5_1 => k.q5_1,
        GgmlType::Q8_0 => k.q8_0,
        GgmlType::IQ4_NL => k.iq4_nl,
        GgmlType::Q2_K => k.q2_k,
        GgmlType::Q3_K => k.q3_k,
        GgmlType::Q4_K => k.q4_k,
        GgmlType::Q5_K => k.q5_k,
        GgmlType::Q6_K => k.q6_k,
        GgmlType::IQ4_XS => k.iq4_xs,
        GgmlType::F16 => k.f16,
        GgmlType::BF16 => k.bf16,
        GgmlType::F32 => k.f32,
        _ => return None,
    })
}

/// Shapes of one multiplication, validated.
#[derive(Clone, Copy)]
struct DotShape {
    kernel: DotKernel,
    /// Blocks per row (elements for float formats).
    blocks: usize,
    w_row_bytes: usize,
    act_row_bytes: usize,
}

fn dot_shape(k: &Kernels, w_ty: GgmlType, n: usize) -> Result<DotShape, QuantError> {
    let act_ty = activation_type(w_ty)?;
    let kernel = dot_kernel(k, w_ty).ok_or(QuantError::UnsupportedWeight { ty: w_ty })?;
    Ok(DotShape {
        kernel,
        blocks: n / w_ty.block_len(),
        w_row_bytes: row_bytes(w_ty, n)?,
        act_row_bytes: row_bytes(act_ty, n)?,
    })
}

/// One dot product of a weight row (`n` elements of `w_ty`) with an
/// activation row in `activation_type(w_ty)`.
///
/// Mismatched lengths or an unsupported type are caller bugs: they trip a
/// debug assertion, and in release builds return NaN rather than read out
/// of bounds.
pub fn vec_dot(w_ty: GgmlType, n: usize, w_row: &[u8], act_row: &[u8]) -> f32 {
    vec_dot_with(dispatch::active(), w_ty, n, w_row, act_row)
}

fn vec_dot_with(k: &Kernels, w_ty: GgmlType, n: usize, w_row: &[u8], act_row: &[u8]) -> f32 {
    let shape = match dot_shape(k, w_ty, n) {
        Ok(s) if w_row.len() >= s.w_row_bytes && act_row.len() >= s.act_row_bytes => s,
        other => {
            debug_assert!(
                false,
                "vec_dot({w_ty}, n={n}): bad shape or lengths (weight {} bytes, activation {} bytes): {:?}",
                w_row.len(),
                act_row.len(),
                other.err()
            );
            return f32::NAN;
        }
    };
    // SAFETY: the table's level is supported; both rows were checked to hold
    // `shape.blocks` blocks of their formats.
    unsafe { (shape.kernel.one)(shape.blocks, w_row.as_ptr(), [act_row.as_ptr()])[0] }
}

/// Validates the shapes of a [`matmul`] call and returns the number of
/// weight rows.
pub fn check_matmul(
    w_ty: GgmlType,
    n: usize,
    w_rows_len: usize,
    acts_len: usize,
    n_tokens: usize,
    out_len: usize,
) -> Result<usize, QuantError> {
    let act_ty = activation_type(w_ty)?;
    let w_row_bytes = row_bytes(w_ty, n)?;
    let act_row_bytes = row_bytes(act_ty, n)?;
    let rows = w_rows_len.checked_div(w_row_bytes).unwrap_or(0);
    expect_len("weight rows", w_rows_len, rows * w_row_bytes)?;
    expect_len("activation rows", acts_len, n_tokens * act_row_bytes)?;
    expect_len("output", out_len, rows * n_tokens)?;
    Ok(rows)
}

/// Weight bytes processed per row chunk in [`matmul`]: small enough that a
/// chunk stays in L2 while every token tile passes over it.
const ROW_CHUNK_BYTES: usize = 128 * 1024;

/// Matrix kernel: `w_rows` holds R whole rows of `n` elements
/// (R = `w_rows.len() / w_ty.row_bytes(n)`); `acts` holds `n_tokens`
/// activation rows; writes `out[t * R + r] = vec_dot(row r, act t)`, bit
/// for bit (token-major: each token's outputs side by side, as the next
/// layer reads them).
///
/// Bad shapes (see [`check_matmul`]) are caller bugs: they trip a debug
/// assertion and in release builds fill `out` with NaN.
pub fn matmul(
    w_ty: GgmlType,
    n: usize,
    w_rows: &[u8],
    acts: &[u8],
    n_tokens: usize,
    out: &mut [f32],
) {
    matmul_with(
        dispatch::active(),
        w_ty,
        n,
        w_rows,
        acts,
        n_tokens,
        None,
        out,
    )
}

/// [`matmul`] with the activations also in `prepared` (from
/// [`PreparedActs::begin`] for the same format, row length and token
/// count, every chunk filled from `acts`): the same bits, without each
/// call rearranging every token again. A `prepared` made for another
/// product is not used.
pub fn matmul_prepared(
    w_ty: GgmlType,
    n: usize,
    w_rows: &[u8],
    acts: &[u8],
    n_tokens: usize,
    prepared: &PreparedActs,
    out: &mut [f32],
) {
    let prepared = (prepared.made_for == Some((w_ty, n, n_tokens))).then_some(prepared);
    matmul_with(
        dispatch::active(),
        w_ty,
        n,
        w_rows,
        acts,
        n_tokens,
        prepared,
        out,
    )
}

/// Most tokens a [`PreparedActs`] holds: for longer batches (at this
/// bound a 14,336-column matrix's prepared activations take up to 25 MB
/// for the K-quants, 33 MB for the 32-element formats) each call prepares
/// its own, 512 tokens at a time.
#[cfg(target_arch = "x86_64")]
const PREPARED_MAX_TOKENS: usize = 1024;

/// Activations rearranged once per matrix product for a row-group kernel
/// that reads them so (the AVX-512 row-group kernels), shared by the
/// product's row tasks, each of which would otherwise rearrange every
/// token itself: a share of the work that grows with the number of tasks
/// (1.6% of a 2-thread 1B Q4_K_M prefill, eight tasks per matrix, and
/// eight times as many tasks at 16 threads). [`PreparedActs::begin`],
/// then [`ChunkFill::fill`] on every chunk of [`PreparedActs::parts_mut`]
/// (in parallel), then [`matmul_prepared`].
#[derive(Default)]
pub struct PreparedActs {
    /// The weight format, row length and token count of the product the
    /// chunks are for.
    made_for: Option<(GgmlType, usize, usize)>,
    fill: ChunkFill,
    chunks: Vec<PreparedChunk>,
}

/// A few tokens' part of a [`PreparedActs`], in the layout of the kernel
/// that reads it.
#[derive(Default)]
pub struct PreparedChunk {
    #[cfg(target_arch = "x86_64")]
    pub(crate) vnni: gemm_kquant::TokenChunk,
    #[cfg(target_arch = "x86_64")]
    pub(crate) blocks32: gemm_blocks32::TokenChunk,
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    pub(crate) amx: amx_kquant::TokenTiles,
}

impl PreparedChunk {
    /// Forgets the tokens (keeping the memory).
    #[cfg(target_arch = "x86_64")]
    fn clear(&mut self) {
        self.vnni.clear();
        self.blocks32.clear();
        #[cfg(not(loom))]
        self.amx.clear();
    }
}

/// How each chunk of a [`PreparedActs`] is filled.
#[derive(Clone, Copy, Default)]
pub struct ChunkFill {
    #[cfg(target_arch = "x86_64")]
    chunk_tokens: usize,
    /// The product's last prepared token (a multiple of [`TILE`]).
    #[cfg(target_arch = "x86_64")]
    gemm_tokens: usize,
    #[cfg(target_arch = "x86_64")]
    act_row_bytes: usize,
    #[cfg(target_arch = "x86_64")]
    blocks: usize,
    /// The kernel the chunks are prepared for.
    #[cfg(target_arch = "x86_64")]
    kernel: Option<dispatch::PreparedGemm>,
}

impl PreparedActs {
    /// Readies the chunks for a product of `w_ty` rows of `n` columns with
    /// `n_tokens` activation rows, and says whether there is anything to
    /// prepare (false: the active kernels read the activations as they
    /// are, or the batch is too short or too long; [`matmul_prepared`]
    /// then runs as [`matmul`]).
    pub fn begin(&mut self, w_ty: GgmlType, n: usize, n_tokens: usize) -> bool {
        self.made_for = None;
        #[cfg(target_arch = "x86_64")]
        {
            let k = dispatch::active();
            let Some(gemm) = (k.prepared_gemm)(w_ty) else {
                return false;
            };
            if n_tokens < gemm_min_tokens(w_ty) || n_tokens > PREPARED_MAX_TOKENS {
                return false;
            }
            let Ok(shape) = dot_shape(k, w_ty, n) else {
                return false;
            };
            let gemm_tokens = n_tokens / TILE * TILE;
            let chunk_tokens = gemm_kquant::CHUNK_TOKENS;
            self.fill = ChunkFill {
                chunk_tokens,
                gemm_tokens,
                act_row_bytes: shape.act_row_bytes,
                blocks: shape.blocks,
                kernel: Some(gemm),
            };
            self.chunks
                .resize_with(gemm_tokens.div_ceil(chunk_tokens), PreparedChunk::default);
            // A chunk left unfilled then fails `holds` rather than passing
            // for this product with an earlier one's tokens.
            self.chunks.iter_mut().for_each(PreparedChunk::clear);
            self.made_for = Some((w_ty, n, n_tokens));
            true
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (w_ty, n, n_tokens);
            false
        }
    }

    /// Whether every chunk was filled, with rows of `blocks` blocks, for
    /// the first `n_tokens / TILE * TILE` of `n_tokens` tokens.
    #[cfg(target_arch = "x86_64")]
    fn holds(&self, n_tokens: usize, blocks: usize) -> bool {
        let gemm_tokens = n_tokens / TILE * TILE;
        let f = &self.fill;
        let Some(kernel) = f.kernel else {
            return false;
        };
        f.gemm_tokens == gemm_tokens
            && f.blocks == blocks
            && self.chunks.len() == gemm_tokens.div_ceil(f.chunk_tokens)
            && self.chunks.iter().enumerate().all(|(i, c)| {
                let t0 = i * f.chunk_tokens;
                (kernel.holds)(c, (t0 + f.chunk_tokens).min(gemm_tokens) - t0, blocks)
            })
    }

    /// How to fill the chunks, and the chunks (none unless
    /// [`PreparedActs::begin`] said there is something to prepare).
    pub fn parts_mut(&mut self) -> (ChunkFill, &mut [PreparedChunk]) {
        match self.made_for {
            Some(_) => (self.fill, &mut self.chunks),
            None => (self.fill, &mut []),
        }
    }
}

impl ChunkFill {
    /// Rearranges chunk `index`'s rows of `acts` (the product's activation
    /// rows) into `chunk`. If `acts` lacks them nothing is written, and
    /// the product, which checks the lengths again, gives NaN as for any
    /// bad shape.
    pub fn fill(&self, index: usize, acts: &[u8], chunk: &mut PreparedChunk) {
        #[cfg(target_arch = "x86_64")]
        if let Some(kernel) = self.kernel {
            let t0 = index * self.chunk_tokens;
            let t1 = (t0 + self.chunk_tokens).min(self.gemm_tokens);
            if let Some(rows) = acts.get(t0 * self.act_row_bytes..t1 * self.act_row_bytes) {
                // SAFETY: `kernel` is the active level's (supported by
                // this CPU); `rows` are whole rows of `blocks` activation
                // blocks, an even number of them (a multiple of TILE).
                unsafe { (kernel.prepare)(self.blocks, rows, chunk) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (index, acts, chunk);
    }
}

#[allow(clippy::too_many_arguments)] // `matmul_prepared`'s and the table
fn matmul_with(
    k: &Kernels,
    w_ty: GgmlType,
    n: usize,
    w_rows: &[u8],
    acts: &[u8],
    n_tokens: usize,
    prepared: Option<&PreparedActs>,
    out: &mut [f32],
) {
    let checked = check_matmul(w_ty, n, w_rows.len(), acts.len(), n_tokens, out.len())
        .and_then(|rows| Ok((rows, dot_shape(k, w_ty, n)?)));
    let (rows, shape) = match checked {
        Ok(v) => v,
        Err(e) => {
            debug_assert!(false, "matmul({w_ty}, n={n}, tokens={n_tokens}): {e}");
            out.fill(f32::NAN);
            return;
        }
    };
    if rows == 0 || n_tokens == 0 {
        return;
    }
    let shape = &shape;
    // Rows in groups through the level's row-group kernel, when it has one
    // for this format and the batch is wide enough to repay unpacking them.
    let (mut gemm_rows, mut gemm_tokens) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if let Some((prepared, gemm)) = prepared
        .and_then(|p| Some((p, (k.prepared_gemm)(w_ty)?)))
        .filter(|(p, _)| rows >= GEMM_GROUP && p.holds(n_tokens, shape.blocks))
    {
        let groups = rows / GEMM_GROUP;
        (gemm_rows, gemm_tokens) = (groups * GEMM_GROUP, n_tokens / TILE * TILE);
        // SAFETY: the level is supported; the checked buffers hold
        // `rows >= gemm_rows` weight rows, `out` is `n_tokens * rows`, and
        // the chunks hold the first `gemm_tokens` tokens in order, made
        // with `shape.blocks` blocks per row (`holds`).
        unsafe {
            (gemm.matmul)(
                shape.blocks,
                &w_rows[..gemm_rows * shape.w_row_bytes],
                groups,
                &prepared.chunks,
                out,
                rows,
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = prepared;
    let gemm = (k.gemm)(w_ty).filter(|_| gemm_rows == 0);
    if let Some(gemm) = gemm {
        if n_tokens >= gemm_min_tokens(w_ty) && rows >= GEMM_GROUP {
            let groups = rows / GEMM_GROUP;
            let tiles = n_tokens / TILE;
            (gemm_rows, gemm_tokens) = (groups * GEMM_GROUP, tiles * TILE);
            // SAFETY: the level is supported; the checked buffers hold
            // `rows >= gemm_rows` weight rows and `n_tokens >= gemm_tokens`
            // activation rows, and `out` is `n_tokens * rows`.
            unsafe {
                gemm(
                    shape.blocks,
                    &w_rows[..gemm_rows * shape.w_row_bytes],
                    groups,
                    &acts[..gemm_tokens * shape.act_row_bytes],
                    tiles,
                    out,
                    rows,
                )
            };
        }
    }
    // What the row groups left: their last tokens, then the other rows.
    tiled(
        shape,
        w_rows,
        acts,
        n_tokens,
        out,
        rows,
        0..gemm_rows,
        gemm_tokens,
    );
    tiled(shape, w_rows, acts, n_tokens, out, rows, gemm_rows..rows, 0);
}

/// How far ahead of the row being dotted one-token matmuls ask for weight
/// bytes, for rows of at most [`ROW_PREFETCH_MAX_BYTES`]. Decode streams
/// each weight once; with both cores streaming, the hardware prefetchers
/// alone left the one-token kernels waiting on loads of the reference
/// model's 360-byte rows (measured on a Zen 5 machine, `inferd bench -t 2
/// --gen-tokens 128`, eight runs alternating: 221-272 tokens/s without,
/// 225-302 at 4 KiB, 2 KiB and 8 KiB between; at one thread no clear
/// change).
const PREFETCH_AHEAD: usize = 4096;

/// The longest weight row the one-row kernels' caller prefetches. Longer
/// rows are long sequential streams the hardware prefetchers follow on
/// their own, and asking for a whole row's lines at once cost more than it
/// saved (a one-thread profile put 15% of a decode on those prefetch
/// instructions): on a Zen 4 machine the 1B-shape Q4_K_M (rows of 1152 and
/// 4608 bytes) decoded at 36.7-38.1 tokens/s without the prefetch against
/// 31.4-31.6 with it (`inferd bench -t 2 --gen-tokens 128`, alternating),
/// 21.2-24.6 against 16.4-17.9 on one thread; the reference model's
/// 360-byte rows (this path at the AVX2 level) were level either way.
const ROW_PREFETCH_MAX_BYTES: usize = 1024;

/// How far ahead of a longer row (over [`ROW_PREFETCH_MAX_BYTES`]) the
/// one-row kernels' caller asks for its bytes, into the second-level
/// cache, on the CPUs where that was measured to help: Intel's. On a
/// 2-core Sapphire Rapids-class VM the 1B-shape Q4_K_M (rows of 1152 and
/// 4608 bytes) decoded at 15.3-15.8 tokens/s with the hardware
/// prefetchers alone, 18.7 with each row asked into the first level 4 KiB
/// ahead, and 20.9-21.9 into the second level 8 to 32 KiB ahead
/// (`inferd bench -t 2 --gen-tokens 48`); one thread 8.1 against 11.3.
/// On AMD's Zen 4 the first-level form cost more than it saved (above);
/// the second-level form is unmeasured there, so it stays off.
const LONG_ROW_PREFETCH_AHEAD: usize = 16 * 1024;

/// Whether the one-row kernels' caller prefetches rows longer than
/// [`ROW_PREFETCH_MAX_BYTES`] ([`LONG_ROW_PREFETCH_AHEAD`]): on Intel CPUs.
fn prefetch_long_rows() -> bool {
    static INTEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INTEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // CPUID leaf 0: the vendor string in EBX, EDX, ECX.
            let id = std::arch::x86_64::__cpuid(0);
            [id.ebx, id.edx, id.ecx] == [*b"Genu", *b"ineI", *b"ntel"].map(u32::from_le_bytes)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Which cache a prefetch fills.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum CacheLevel {
    /// The first level: bytes needed within a few hundred cycles.
    L1,
    /// The second level: bytes needed later, or too many to hold in the
    /// first level beside the ones in use.
    L2,
}

/// Asks `level` for the `len` bytes at `p` (a hint: nothing is read, and
/// an address past the end of a buffer is harmless).
#[inline(always)]
pub(crate) fn prefetch_bytes(p: *const u8, len: usize, level: CacheLevel) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..len).step_by(64) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let line = p.wrapping_add(off) as *const i8;
        // SAFETY: SSE is part of x86_64; a prefetch never faults, whatever
        // the address.
        unsafe {
            match level {
                CacheLevel::L1 => _mm_prefetch::<_MM_HINT_T0>(line),
                CacheLevel::L2 => _mm_prefetch::<_MM_HINT_T1>(line),
            }
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len, level);
}

/// Rows per group of a row-group kernel.
#[cfg(target_arch = "x86_64")]
const GEMM_GROUP: usize = gemm_blocks32::GROUP;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(gemm_kquant::GROUP == GEMM_GROUP);
#[cfg(not(target_arch = "x86_64"))]
const GEMM_GROUP: usize = 8;

/// Fewest tokens for which unpacking a row group pays off. Measured
/// (`inferd bench -t 2`, AVX-512): at 16 tokens the K-quant kernel already
/// gains (1B Q4_K_M pp16 138-148 against 126-141 tokens/s). The
/// 32-element formats' 8-row register kernel (`rows8`) beats it at 32
/// tokens (SmolLM2 pp32 568-573 against 534-547) and loses at 48 (576-583
/// against 599-618).
fn gemm_min_tokens(w_ty: GgmlType) -> usize {
    if w_ty.block_len() == QK_K {
        16
    } else {
        48
    }
}

/// The one-row kernels over `rows`, for tokens `first_token..n_tokens`,
/// into `out[t * out_rows + r]`: tiles of [`TILE`] tokens over chunks of
/// rows that stay in L2, then what is left in tiles of 4, 2 and 1 (a short
/// chunk, such as a speculative verification pass, still loads each weight
/// block once for several tokens).
#[allow(clippy::too_many_arguments)] // one matmul's shapes, passed through
fn tiled(
    shape: &DotShape,
    w_rows: &[u8],
    acts: &[u8],
    n_tokens: usize,
    out: &mut [f32],
    out_rows: usize,
    rows: std::ops::Range<usize>,
    first_token: usize,
) {
    if rows.is_empty() || first_token >= n_tokens {
        return;
    }
    // Whole groups of 8 rows per chunk, for the kernels that take 8.
    let fit = ROW_CHUNK_BYTES / shape.w_row_bytes.max(1);
    let chunk_rows = if fit >= 8 { fit / 8 * 8 } else { fit.max(1) };
    let kernel = shape.kernel;
    for chunk_start in rows.clone().step_by(chunk_rows) {
        let chunk = chunk_start..(chunk_start + chunk_rows).min(rows.end);
        let pass = TilePass {
            shape,
            w_rows,
            acts,
            out_rows,
            rows: chunk,
            first_token,
        };
        let mut t = first_token;
        // SAFETY: for each call, the level is supported; `pass` holds
        // checked buffers and every tile below ends at or before `n_tokens`.
        unsafe {
            let rows8 = kernel.rows8;
            while t + TILE <= n_tokens {
                pass.run(kernel.tile, rows8.map(|k| k.tile), t, out);
                t += TILE;
            }
            if t + 4 <= n_tokens {
                pass.run(kernel.quad, rows8.map(|k| k.quad), t, out);
                t += 4;
            }
            if t + 2 <= n_tokens {
                pass.run(kernel.pair, rows8.map(|k| k.pair), t, out);
                t += 2;
            }
            if t < n_tokens {
                pass.run(kernel.one, rows8.map(|k| k.one), t, out);
            }
        }
    }
}

/// One chunk of weight rows under [`tiled`], run a tile of tokens at a time.
struct TilePass<'a> {
    shape: &'a DotShape,
    w_rows: &'a [u8],
    acts: &'a [u8],
    out_rows: usize,
    rows: std::ops::Range<usize>,
    /// The chunk's first tile asks for weight rows ahead of use; later
    /// tiles find them cached.
    first_token: usize,
}

impl TilePass<'_> {
    /// Tokens `t..t + NT` against every row of the chunk: 8 rows at a time
    /// through `rows8` where the level has it, the rest one at a time.
    ///
    /// # Safety
    /// `kernel` and `rows8` must be of a supported level and of the shape's
    /// format; the buffers must be the checked ones of the matmul, with
    /// `t + NT` at most its token count.
    #[inline(always)]
    unsafe fn run<const NT: usize>(
        &self,
        kernel: TileFn<NT>,
        rows8: Option<Rows8Fn<NT>>,
        t: usize,
        out: &mut [f32],
    ) {
        let DotShape {
            blocks,
            w_row_bytes,
            act_row_bytes,
            ..
        } = *self.shape;
        let acts: [*const u8; NT] =
            std::array::from_fn(|i| self.acts[(t + i) * act_row_bytes..].as_ptr());
        let prefetch = t == self.first_token || NT == 1;
        let long_rows = prefetch && w_row_bytes > ROW_PREFETCH_MAX_BYTES && prefetch_long_rows();
        let mut r = self.rows.start;
        if let Some(rows8) = rows8 {
            while r + 8 <= self.rows.end {
                let w = self.w_rows[r * w_row_bytes..].as_ptr();
                // SAFETY: the caller's promise; rows `r..r + 8` lie in the
                // checked rows, `w_row_bytes` apart.
                let res = unsafe { rows8(blocks, w, w_row_bytes, acts, prefetch) };
                for (i, rows) in res.iter().enumerate() {
                    let at = (t + i) * self.out_rows + r;
                    out[at..at + 8].copy_from_slice(rows);
                }
                r += 8;
            }
        }
        for r in r..self.rows.end {
            if prefetch && w_row_bytes <= ROW_PREFETCH_MAX_BYTES {
                let ahead = self
                    .w_rows
                    .as_ptr()
                    .wrapping_add(r * w_row_bytes + PREFETCH_AHEAD);
                prefetch_bytes(ahead, w_row_bytes, CacheLevel::L1);
            } else if long_rows {
                let ahead = self
                    .w_rows
                    .as_ptr()
                    .wrapping_add(r * w_row_bytes + LONG_ROW_PREFETCH_AHEAD);
                prefetch_bytes(ahead, w_row_bytes, CacheLevel::L2);
            }
            let w = self.w_rows[r * w_row_bytes..].as_ptr();
            // SAFETY: the caller's promise; row `r` lies in the checked rows.
            let res = unsafe { kernel(blocks, w, acts) };
            for (i, v) in res.into_iter().enumerate() {
                out[(t + i) * self.out_rows + r] = v;
            }
        }
    }
}

/// Dot of two f16 vectors accumulated in f32 (attention scores over the
/// f16 K cache). Uses the shorter length if they differ (a debug assertion
/// flags it).
pub fn dot_f16(a: &[half::f16], b: &[half::f16]) -> f32 {
    debug_assert_eq!(a.len(), b.len(), "dot_f16 length mismatch");
    let n = a.len().min(b.len());
    // SAFETY: the level is supported; both slices hold at least `n` f16
    // values, read as little-endian bytes (all supported targets are
    // little-endian).
    unsafe { (dispatch::active().dot_f16)(n, a.as_ptr() as *const u8, b.as_ptr() as *const u8) }
}

/// `y = fma(a, x, y)` element-wise with `x` f16 and `y` f32 (attention over
/// the f16 V cache). Uses the shorter length if they differ (a debug
/// assertion flags it).
pub fn axpy_f16(a: f32, x: &[half::f16], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len(), "axpy_f16 length mismatch");
    // SAFETY: the level is supported; the kernel bounds itself by both lengths.
    unsafe { (dispatch::active().axpy_f16)(a, x, y) }
}

/// How many rows of `head_dim` values at `stride` fit in `len` values.
fn rows_that_fit(len: usize, head_dim: usize, stride: usize) -> usize {
    match len.checked_sub(head_dim) {
        Some(rest) if stride > 0 => rest / stride + 1,
        Some(_) => usize::MAX,
        None => 0,
    }
}

/// Attention kernels over K/V rows widened to f32 once, for every query
/// that reads them: each result has the bits of [`dot_f16_rows`] /
/// [`axpy_f16_rows`] on the f16 rows (widening is exact), for less work per
/// query. `None` where the SIMD level has none, or when `head_dim` is not a
/// multiple of 16.
pub fn wide_attention(head_dim: usize) -> Option<WideAttention> {
    let kernels = dispatch::active().wide_attention?;
    (head_dim > 0 && head_dim.is_multiple_of(16)).then_some(WideAttention {
        kernels,
        hd: head_dim,
    })
}

/// See [`wide_attention`]; rows of `head_dim` values.
#[derive(Clone, Copy, Debug)]
pub struct WideAttention {
    kernels: dispatch::WideKernels,
    hd: usize,
}

impl WideAttention {
    /// The head width the kernels were chosen for.
    pub fn head_dim(&self) -> usize {
        self.hd
    }

    /// Rows `0..n` of `rows` (row `i` at `rows[i * stride..][..head_dim]`)
    /// widened into `out`, `head_dim` apart. Rows that do not fit either
    /// side are left out (a debug assertion flags them).
    pub fn widen(&self, rows: &[half::f16], stride: usize, n: usize, out: &mut [f32]) {
        let fit = n
            .min(rows_that_fit(rows.len(), self.hd, stride))
            .min(out.len() / self.hd);
        debug_assert_eq!(fit, n, "widen: rows do not fit");
        // SAFETY: the level is supported (its table is the active one);
        // rows `0..fit` lie inside `rows` and `out`.
        unsafe { (self.kernels.widen)(rows.as_ptr(), stride, self.hd, fit, out.as_mut_ptr()) }
    }

    /// [`dot_f16_rows`] of each of the queries `ks` (query `k` at `queries[k *
    /// head_dim..]`, at most [`SHARED_QUERIES`]) over the same rows, each
    /// row read once for all of them: query `ks[j]`'s results go to
    /// `out[at[j]..]`, one per row (query values: the f32 values of the f16
    /// query). Same bits as one call per query.
    ///
    /// # Panics
    /// If a query or an output run lies outside its buffer, or the output
    /// runs overlap or are not in ascending order.
    pub fn dot_rows_shared(
        &self,
        queries: &[f32],
        ks: &[usize],
        rows: &[f32],
        out: &mut [f32],
        at: &[usize],
    ) {
        let (hd, n) = (self.hd, rows.len() / self.hd);
        assert!(ks.len() == at.len() && ks.len() <= SHARED_QUERIES);
        assert!(ks.iter().all(|&k| (k + 1) * hd <= queries.len()));
        assert_disjoint_runs(at, n, out.len());
        let base = out.as_mut_ptr();
        let mut qs = [std::ptr::null(); SHARED_QUERIES];
        let mut outs = [std::ptr::null_mut(); SHARED_QUERIES];
        for (j, (&k, &a)) in ks.iter().zip(at).enumerate() {
            qs[j] = queries[k * hd..].as_ptr();
            outs[j] = base.wrapping_add(a);
        }
        let m = ks.len();
        // SAFETY: the level is supported; rows `0..n` lie inside `rows`,
        // each query inside `queries`, each output run inside `out` and
        // apart from the others (checked above).
        unsafe { (self.kernels.dot_rows_shared)(&qs[..m], rows.as_ptr(), hd, n, &outs[..m]) }
    }

    /// [`axpy_f16_rows`] for several queries over the same widened rows,
    /// each row read once for all of them: query `j`'s weights are
    /// `weights[at[j]..]` (one per row) and its lanes (`[16][head_dim]`)
    /// start at `lanes[ks[j] * 16 * head_dim]`; at most [`SHARED_QUERIES`].
    /// Same bits as one call per query.
    ///
    /// # Panics
    /// If a weight or lane run lies outside its buffer, or `ks` is not
    /// strictly ascending.
    pub fn axpy_rows_shared(
        &self,
        weights: &[f32],
        at: &[usize],
        rows: &[f32],
        lanes: &mut [f32],
        ks: &[usize],
        first: usize,
    ) {
        let (hd, n) = (self.hd, rows.len() / self.hd);
        assert!(ks.len() == at.len() && ks.len() <= SHARED_QUERIES);
        assert!(at.iter().all(|&a| a + n <= weights.len()));
        let m = ks.len();
        let mut lane_starts = [0; SHARED_QUERIES];
        for (s, &k) in lane_starts.iter_mut().zip(ks) {
            *s = k * 16 * hd;
        }
        assert_disjoint_runs(&lane_starts[..m], 16 * hd, lanes.len());
        let base = lanes.as_mut_ptr();
        let mut ws = [std::ptr::null(); SHARED_QUERIES];
        let mut outs = [std::ptr::null_mut(); SHARED_QUERIES];
        for j in 0..m {
            ws[j] = weights[at[j]..].as_ptr();
            outs[j] = base.wrapping_add(lane_starts[j]);
        }
        // SAFETY: the level is supported; rows `0..n` lie inside `rows`,
        // each weight run inside `weights`, each lane block inside `lanes`
        // and apart from the others (checked above).
        unsafe {
            (self.kernels.axpy_rows_shared)(&ws[..m], rows.as_ptr(), hd, n, &outs[..m], first)
        }
    }
}

/// Most queries one [`WideAttention::dot_rows_shared`] or
/// [`WideAttention::axpy_rows_shared`] call takes.
pub const SHARED_QUERIES: usize = 4;

/// Panics unless the runs `starts[j]..starts[j] + len` are ascending, apart
/// and inside `0..total`.
fn assert_disjoint_runs(starts: &[usize], len: usize, total: usize) {
    let mut free = 0;
    for &s in starts {
        assert!(
            s >= free && s + len <= total,
            "shared rows: output runs overlap or overflow"
        );
        free = s + len;
    }
}

/// [`dot_f16`] of `q` with each row of `rows` (row `i` at
/// `rows[i * stride..][..q.len()]`, a block of the K cache), into `out[i]`,
/// with one dispatched call for the block. Rows that do not fit in `rows`
/// are left alone (a debug assertion flags them).
pub fn dot_f16_rows(q: &[half::f16], rows: &[half::f16], stride: usize, out: &mut [f32]) {
    let n = rows_that_fit(rows.len(), q.len(), stride).min(out.len());
    debug_assert_eq!(n, out.len(), "dot_f16_rows: rows do not fit");
    // SAFETY: the level is supported; rows `0..n` lie inside `rows`.
    unsafe { (dispatch::active().dot_f16_rows)(q, rows.as_ptr(), stride, &mut out[..n]) }
}

/// [`axpy_f16`] of `w[i]` times row `i` of `rows` (at
/// `rows[i * stride..][..head_dim]`, a block of the V cache) into lane
/// `(first + i) % 16` of `lanes` (`[16][head_dim]`), with one dispatched
/// call for the block. Rows that do not fit in `rows` are left out (a debug
/// assertion flags them).
pub fn axpy_f16_rows(
    w: &[f32],
    rows: &[half::f16],
    stride: usize,
    lanes: &mut [f32],
    first: usize,
) {
    let hd = lanes.len() / 16;
    let n = rows_that_fit(rows.len(), hd, stride).min(w.len());
    debug_assert_eq!(n, w.len(), "axpy_f16_rows: rows do not fit");
    // SAFETY: the level is supported; rows `0..n` lie inside `rows`.
    unsafe { (dispatch::active().axpy_f16_rows)(&w[..n], rows.as_ptr(), stride, lanes, first) }
}

/// `x = f32(f16(x * scale))` element-wise in place (the softmax weights
/// rounded to the f16 values the V cache is multiplied by).
pub fn scale_round_f16(x: &mut [f32], scale: f32) {
    // SAFETY: the level is supported; the kernel stays inside the slice.
    unsafe { (dispatch::active().scale_round_f16)(x, scale) }
}

/// ggml's vectorised `expf` approximation, element-wise in place (the
/// softmax exponential llama.cpp uses; it is not correctly rounded, and the
/// reference model's outputs depend on its exact bits).
pub fn exp_ggml(x: &mut [f32]) {
    // SAFETY: the level is supported; the kernel stays inside the slice.
    unsafe { (dispatch::active().exp_ggml)(x) }
}

/// `gate = silu(gate) * up` element-wise, with `silu(x) = x / (1 + e^-x)`
/// on ggml's `expf`. Uses the shorter length if they differ.
pub fn swiglu_ggml(gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len(), "swiglu length mismatch");
    // SAFETY: the level is supported; the kernel bounds itself by both lengths.
    unsafe { (dispatch::active().swiglu_ggml)(gate, up) }
}

/// `gate = gelu(gate) * up` with ggml's f16 table (see `gelu.rs`).
pub fn geglu_ggml(gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len(), "geglu length mismatch");
    // SAFETY: the level is supported; the kernel bounds itself by both lengths.
    unsafe { (dispatch::active().geglu_ggml)(gate, up) }
}

/// Horizontal sum of 16 lanes in the fixed order of GCC's
/// `_mm512_reduce_add_ps`: `l[i] + l[i + 8]`, then `+ [i + 4]`, then
/// `(r0 + r2) + (r1 + r3)`.
pub fn reduce16(l: &[f32; 16]) -> f32 {
    scalar::reduce16(l)
}

#[cfg(test)]
mod tests;
