//! The llama-family forward pass: token ids in, KV written, logits out.
//!
//! One call advances a batch of sequences (sessions) by any number of tokens
//! each. All tokens of the batch go through every matrix multiply together;
//! attention reads each sequence's own KV pages.
//!
//! Batch invariance (CONTRACT §2.2) holds because every reduction has one
//! fixed order per output element: a matrix element is one `vec_dot` of a
//! weight row with one token's activations (the kernels guarantee tiling
//! does not change it), RMSNorm sums one token's row left to right, and
//! attention for a query at position `p` reads K/V positions `0..=p` in
//! order from the f16 cache, which holds the same bits whether a position
//! was written a moment ago in this batch or by an earlier call. Threads
//! split only independent outputs (rows, heads, tokens).
//!
//! Numerical conventions follow llama.cpp's CPU backend (x86, AVX-512, its
//! prefill path) operation for operation, because the network is chaotic
//! at the rounding level: activations are quantized to the weight's paired
//! 8-bit block format before each matrix multiply; RMSNorm accumulates
//! squares in f64 and applies `1/sqrt(mean + eps)` then the weight; RoPE
//! angles are built by repeated multiplication by `base^(-2/d)` and the
//! rotation uses one fused multiply-add per output, as GCC contracts it;
//! queries and attention weights are rounded to f16 before meeting the f16
//! K and V caches, and both attention products use the 16-lane order of
//! llama.cpp's tinyBLAS f16 kernel (score: [`quant::dot_f16`]; weighted V
//! sum: lane `p % 16` per position, reduced by [`quant::reduce16`]); the
//! softmax exponential is ggml's `expf` approximation, summed per 16
//! positions in f32 and across them in f64; SwiGLU uses the same `expf`.
//! llama.cpp's decode path (one token) scores with a different f16 dot
//! order; a batch-invariant forward pass can follow only one, and the
//! prefill order is the one the prompt's logits come from.

use std::cell::RefCell;
use std::ops::Range;

use half::{f16, slice::HalfFloatSliceExt};

use crate::kv::{KvBlocks, KvError, SessionKv};
use crate::quant;
use crate::threads::ThreadPool;

use super::arch::FfnActivation;
use super::phases::{self, Phase};
use super::rope;
use super::weights::{LayerWeights, Matrix};
use super::{Model, ModelError};

/// Which logits a sequence wants back from a forward call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill whose logits nobody will read).
    None,
    /// Only at the last new token (the usual case: sample the next token).
    Last,
    /// At every new token (tests, scoring).
    All,
}

impl LogitsWanted {
    /// Which of a feed's `n_tokens` new tokens (by index within the feed)
    /// get logits: the one place that says so, for the local forward pass
    /// and for a coordinator computing logits from the shards' output.
    pub fn rows(self, n_tokens: usize) -> std::ops::Range<usize> {
        match self {
            LogitsWanted::None => 0..0,
            LogitsWanted::Last => n_tokens.saturating_sub(1)..n_tokens,
            LogitsWanted::All => 0..n_tokens,
        }
    }
}

/// One sequence's share of a forward call.
pub struct Sequence<'a> {
    /// The session's KV pages; new positions are appended after `kv.len()`.
    pub kv: &'a mut SessionKv,
    /// New token ids to feed.
    pub tokens: &'a [u32],
    pub logits: LogitsWanted,
}

/// One sequence's share of a [`Model::forward_layers`] call: hidden-state
/// rows in, no token ids (a shard never sees them).
pub struct LayerFeed<'a> {
    /// The sequence's KV pages; the rows go to positions `kv.len()..`.
    pub kv: &'a mut SessionKv,
    /// How many rows (new positions) the sequence feeds.
    pub rows: usize,
}

/// Reusable buffers for forward calls, grown on demand and kept between
/// calls so a decode step does not allocate.
#[derive(Default)]
pub struct Scratch {
    /// Residual stream, `[tokens][hidden]`.
    x: Vec<f32>,
    /// Normalised residual, `[tokens][hidden]`.
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Attention output, `[tokens][hidden]`.
    att: Vec<f32>,
    /// Projection output, `[tokens][hidden]`.
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Quantized activations, `[tokens][row bytes]`.
    acts: Vec<u8>,
    /// The matrix products' own buffers.
    matmul: MatmulScratch,
    /// RoPE `(cos, sin)` per token and rotated pair, `[tokens][rope_dims]`.
    rope: Vec<f32>,
    /// The same for sliding-window layers (their own RoPE base).
    rope_sliding: Vec<f32>,
    /// Per-head normed Q or K, before it replaces the projection.
    head_normed: Vec<f32>,
    /// Per token: (sequence index, absolute position).
    token_seq: Vec<(usize, usize)>,
    /// Logits, `[wanted rows][vocab]`.
    pub logits: Vec<f32>,
}

/// Buffers of one matrix product at a time.
#[derive(Default)]
struct MatmulScratch {
    /// The output per chunk of rows, each chunk `[tokens][its rows]`.
    by_row: Vec<f32>,
    /// The activations as the row-group kernel reads them, made once for
    /// all of the product's tasks.
    prepared: quant::PreparedActs,
}

/// Logits produced by a forward call: for each sequence, the rows of
/// `Scratch::logits` that belong to it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogitRows {
    pub per_sequence: Vec<Range<usize>>,
}

/// One attention task's buffers, kept per thread across tasks and layers
/// so that a step does not allocate.
#[derive(Default)]
struct TaskScratch {
    /// The task's queries rounded to f16, `[query][head_dim]`.
    q16: Vec<f16>,
    /// The same queries widened back to f32 (for the widened-row kernels).
    q32: Vec<f32>,
    /// Every query's scores, then softmax weights, one run per query.
    scores: Vec<f32>,
    /// The 16 lane accumulators (`[query][lane][head_dim]`) of the weighted
    /// V sums.
    lanes: Vec<f32>,
    /// One span of K or V rows widened to f32 (see [`for_each_wide_span`]).
    rows: Vec<f32>,
}

thread_local! {
    static TASK_SCRATCH: RefCell<TaskScratch> = RefCell::new(TaskScratch::default());
}

/// Positions per lane group of the attention products (tinyBLAS's AVX-512
/// vector width).
const LANES: usize = 16;

fn resize(buf: &mut Vec<f32>, len: usize) {
    buf.clear();
    buf.resize(len, 0.0);
}

/// Sets `buf`'s length to `len` for a caller that writes every element
/// before it reads any (a matrix product's output, quantized activations):
/// unlike [`resize`], what is kept is not zeroed again. A prefill's matrix
/// outputs are tens of MB per layer, and zeroing them ran on one thread
/// while the others waited.
fn resize_for_overwrite<T: Copy + Default>(buf: &mut Vec<T>, len: usize) {
    if buf.len() >= len {
        buf.truncate(len);
    } else {
        buf.resize(len, T::default());
    }
}

impl Model {
    /// Runs the whole model on a batch: reserves KV for every sequence
    /// (all-or-nothing per sequence; on error no history changed), embeds,
    /// runs every layer, commits the new KV lengths, and computes the logits
    /// each sequence asked for into `scratch.logits`.
    pub fn forward(
        &self,
        seqs: &mut [Sequence<'_>],
        pool: &ThreadPool,
        scratch: &mut Scratch,
    ) -> Result<LogitRows, ModelError> {
        self.prepare(seqs)?;
        let n_tokens: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let mut x = std::mem::take(&mut scratch.x);
        resize(&mut x, n_tokens * self.config.hidden);
        let mut offset = 0;
        let embed_time = phases::time(Phase::Outside);
        for s in seqs.iter() {
            self.embed(
                s.tokens,
                &mut x[offset * self.config.hidden..][..s.tokens.len() * self.config.hidden],
            )?;
            offset += s.tokens.len();
        }
        drop(embed_time);
        let mut feeds: Vec<LayerFeed<'_>> = seqs
            .iter_mut()
            .map(|s| LayerFeed {
                kv: &mut *s.kv,
                rows: s.tokens.len(),
            })
            .collect();
        let result =
            self.forward_layers(0..self.config.n_layers, &mut feeds, &mut x, pool, scratch);
        drop(feeds);
        scratch.x = x;
        result?;
        for s in seqs.iter_mut() {
            let new_len = s.kv.len() + s.tokens.len();
            s.kv.commit(new_len)?;
        }
        self.logits_for(seqs, pool, scratch)
    }

    /// Checks token ids and context room, and reserves KV pages, before
    /// anything is computed.
    fn prepare(&self, seqs: &mut [Sequence<'_>]) -> Result<(), ModelError> {
        for s in seqs.iter() {
            self.check_append(s.kv.len(), s.tokens)?;
        }
        for s in seqs.iter_mut() {
            let want = s.kv.len() + s.tokens.len();
            s.kv.reserve(want)?;
        }
        Ok(())
    }

    /// Checks that `tokens` may be appended to a history of `history_len`:
    /// every id inside the vocabulary and the result within the context.
    pub fn check_append(&self, history_len: usize, tokens: &[u32]) -> Result<(), ModelError> {
        let vocab = self.config.vocab;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::TokenOutOfRange { token: bad, vocab });
        }
        let wanted = history_len + tokens.len();
        if wanted > self.config.context {
            return Err(ModelError::ContextOverflow {
                wanted,
                context: self.config.context,
            });
        }
        Ok(())
    }

    /// Looks up embedding rows: `out` is `[tokens][hidden]`.
    pub fn embed(&self, tokens: &[u32], out: &mut [f32]) -> Result<(), ModelError> {
        let m = &self.weights.token_embd;
        let table = self.file.tensor_bytes(&m.info);
        for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(m.cols)) {
            if t as usize >= m.rows {
                return Err(ModelError::TokenOutOfRange {
                    token: t,
                    vocab: m.rows,
                });
            }
            let bytes = &table[t as usize * m.row_bytes..][..m.row_bytes];
            quant::dequantize_row(m.ty, bytes, row).map_err(|e| ModelError::BadTensor {
                name: m.name.clone(),
                why: e.to_string(),
            })?;
            if let Some(scale) = self.config.embedding_scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        Ok(())
    }

    /// Runs layers `layers` on the hidden states `x` (`[tokens][hidden]`, the
    /// new tokens of every sequence in order), writing their K/V at
    /// positions `kv.len()..` of each sequence's KV (whose layer 0 is
    /// `layers.start`). KV pages must already be reserved and the lengths are
    /// not committed: the caller commits once every layer is done. This is
    /// the unit a shard computes.
    pub fn forward_layers(
        &self,
        layers: Range<usize>,
        seqs: &mut [LayerFeed<'_>],
        x: &mut [f32],
        pool: &ThreadPool,
        scratch: &mut Scratch,
    ) -> Result<(), ModelError> {
        let cfg = &self.config;
        if layers.end > cfg.n_layers || layers.start > layers.end {
            return Err(ModelError::BadLayerRange {
                start: layers.start,
                end: layers.end,
                n_layers: cfg.n_layers,
            });
        }
        self.prepare_positions(seqs, scratch);
        self.rope_tables(scratch);
        for l in layers.clone() {
            let kv_layer = l - layers.start;
            self.attention_block(pool, l, kv_layer, seqs, x, scratch)?;
            self.feed_forward_block(pool, l, x, scratch);
        }
        Ok(())
    }

    /// Layer `layer`'s attention block, its K and V written at the layer
    /// `kv_layer` of each sequence's KV on the way:
    /// x += post(Wo · attention(RoPE(Wq·n(x)), RoPE(Wk·n(x)), Wv·n(x))).
    fn attention_block(
        &self,
        pool: &ThreadPool,
        layer: usize,
        kv_layer: usize,
        seqs: &mut [LayerFeed<'_>],
        x: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<(), ModelError> {
        let cfg = &self.config;
        let w = &self.weights.layers[layer];
        let window = cfg.layer_window(layer);
        let n = scratch.token_seq.len();
        {
            let _t = phases::time(Phase::Norm);
            rms_norm(pool, x, &w.attn_norm, cfg.rms_eps, &mut scratch.xn);
        }
        self.project_qkv(pool, w, scratch);
        {
            let _t = phases::time(Phase::Norm);
            self.norm_qk_heads(pool, w, scratch);
        }
        {
            let _t = phases::time(Phase::Rope);
            self.rotate_qk(pool, window, scratch);
        }
        {
            let _t = phases::time(Phase::WriteKv);
            write_kv(seqs, kv_layer, cfg.kv_dim(), scratch)?;
        }
        resize(&mut scratch.att, n * cfg.q_dim());
        {
            let _t = phases::time(Phase::Attention);
            self.attention(pool, seqs, kv_layer, window, scratch)?;
        }
        self.quantize_acts(pool, &w.wo, &scratch.att, n, &mut scratch.acts);
        resize_for_overwrite(&mut scratch.proj, n * cfg.hidden);
        self.matmul(
            pool,
            &w.wo,
            &scratch.acts,
            n,
            &mut scratch.proj,
            &mut scratch.matmul,
        );
        let _t = phases::time(Phase::Residual);
        add_block_output(
            pool,
            x,
            &scratch.proj,
            w.attn_post_norm.as_deref(),
            cfg.rms_eps,
            &mut scratch.xn,
        );
        Ok(())
    }

    /// Q, K and V from the normed input `scratch.xn`, biases added.
    fn project_qkv(&self, pool: &ThreadPool, w: &LayerWeights, scratch: &mut Scratch) {
        let cfg = &self.config;
        let n = scratch.token_seq.len();
        let (kvd, qd) = (cfg.kv_dim(), cfg.q_dim());
        // Q, K and V share one quantization of the input unless a file
        // mixes types whose activation formats differ (llama-quantize
        // gives attn_v a K-quant next to IQ4_NL or Q5_1 matrices).
        let mut acts = std::mem::take(&mut scratch.acts);
        resize_for_overwrite(&mut scratch.q, n * qd);
        resize_for_overwrite(&mut scratch.k, n * kvd);
        resize_for_overwrite(&mut scratch.v, n * kvd);
        let mut acts_ty = None;
        for (m, out) in [
            (&w.wq, &mut scratch.q),
            (&w.wk, &mut scratch.k),
            (&w.wv, &mut scratch.v),
        ] {
            if acts_ty != Some(m.act_ty) {
                self.quantize_acts(pool, m, &scratch.xn, n, &mut acts);
                acts_ty = Some(m.act_ty);
            }
            self.matmul(pool, m, &acts, n, out, &mut scratch.matmul);
        }
        scratch.acts = acts;
        let _t = phases::time(Phase::Residual);
        add_bias(&mut scratch.q, w.bq.as_deref());
        add_bias(&mut scratch.k, w.bk.as_deref());
        add_bias(&mut scratch.v, w.bv.as_deref());
    }

    /// The per-head RMSNorm of Q, then of K, where the architecture has
    /// them (qwen3, gemma3).
    fn norm_qk_heads(&self, pool: &ThreadPool, w: &LayerWeights, scratch: &mut Scratch) {
        let eps = self.config.rms_eps;
        if let Some(norm) = &w.q_norm {
            rms_norm(pool, &scratch.q, norm, eps, &mut scratch.head_normed);
            std::mem::swap(&mut scratch.q, &mut scratch.head_normed);
        }
        if let Some(norm) = &w.k_norm {
            rms_norm(pool, &scratch.k, norm, eps, &mut scratch.head_normed);
            std::mem::swap(&mut scratch.k, &mut scratch.head_normed);
        }
    }

    /// RoPE on Q and K (a sliding-window layer's own table when `window`
    /// is set), then the architecture's query scale.
    fn rotate_qk(&self, pool: &ThreadPool, window: Option<usize>, scratch: &mut Scratch) {
        let cfg = &self.config;
        let rope = match window {
            Some(_) => &scratch.rope_sliding,
            None => &scratch.rope,
        };
        self.apply_rope(pool, &mut scratch.q, cfg.n_heads, rope, cfg.query_scale);
        self.apply_rope(pool, &mut scratch.k, cfg.n_kv_heads, rope, None);
    }

    /// Layer `layer`'s feed-forward block:
    /// x += post(W_down · (act(W_gate·n(x)) ⊙ W_up·n(x))).
    fn feed_forward_block(
        &self,
        pool: &ThreadPool,
        layer: usize,
        x: &mut [f32],
        scratch: &mut Scratch,
    ) {
        let cfg = &self.config;
        let w = &self.weights.layers[layer];
        let n = scratch.token_seq.len();
        {
            let _t = phases::time(Phase::Norm);
            rms_norm(pool, x, &w.ffn_norm, cfg.rms_eps, &mut scratch.xn);
        }
        self.quantize_acts(pool, &w.w_gate, &scratch.xn, n, &mut scratch.acts);
        resize_for_overwrite(&mut scratch.gate, n * cfg.ffn);
        resize_for_overwrite(&mut scratch.up, n * cfg.ffn);
        self.matmul(
            pool,
            &w.w_gate,
            &scratch.acts,
            n,
            &mut scratch.gate,
            &mut scratch.matmul,
        );
        if w.w_up.act_ty != w.w_gate.act_ty {
            self.quantize_acts(pool, &w.w_up, &scratch.xn, n, &mut scratch.acts);
        }
        self.matmul(
            pool,
            &w.w_up,
            &scratch.acts,
            n,
            &mut scratch.up,
            &mut scratch.matmul,
        );
        {
            let _t = phases::time(Phase::Activation);
            gated_activation(
                pool,
                cfg.spec().ffn_activation,
                &mut scratch.gate,
                &scratch.up,
                cfg.ffn,
            );
        }
        self.quantize_acts(pool, &w.w_down, &scratch.gate, n, &mut scratch.acts);
        self.matmul(
            pool,
            &w.w_down,
            &scratch.acts,
            n,
            &mut scratch.proj,
            &mut scratch.matmul,
        );
        let _t = phases::time(Phase::Residual);
        add_block_output(
            pool,
            x,
            &scratch.proj,
            w.ffn_post_norm.as_deref(),
            cfg.rms_eps,
            &mut scratch.xn,
        );
    }

    fn prepare_positions(&self, seqs: &[LayerFeed<'_>], scratch: &mut Scratch) {
        scratch.token_seq.clear();
        for (i, s) in seqs.iter().enumerate() {
            let start = s.kv.len();
            scratch
                .token_seq
                .extend((0..s.rows).map(|j| (i, start + j)));
        }
    }

    /// Final norm and output projection for the rows each sequence wants.
    fn logits_for(
        &self,
        seqs: &[Sequence<'_>],
        pool: &ThreadPool,
        scratch: &mut Scratch,
    ) -> Result<LogitRows, ModelError> {
        let h = self.config.hidden;
        let mut rows = Vec::new();
        let mut per_sequence = Vec::with_capacity(seqs.len());
        let mut first_token = 0;
        for s in seqs {
            let start = rows.len();
            let n = s.tokens.len();
            rows.extend(s.logits.rows(n).map(|i| first_token + i));
            per_sequence.push(start..rows.len());
            first_token += n;
        }
        let mut hidden = std::mem::take(&mut scratch.xn);
        resize(&mut hidden, rows.len() * h);
        for (dst, &r) in hidden.chunks_exact_mut(h).zip(&rows) {
            dst.copy_from_slice(&scratch.x[r * h..][..h]);
        }
        let mut logits = std::mem::take(&mut scratch.logits);
        self.logits_from_hidden(pool, &hidden, &mut logits, scratch);
        scratch.xn = hidden;
        scratch.logits = logits;
        Ok(LogitRows { per_sequence })
    }

    /// Final RMSNorm and output projection of hidden states (`[rows][hidden]`,
    /// as `forward_layers` leaves them) into `out` (`[rows][vocab]`).
    pub fn logits_from_hidden(
        &self,
        pool: &ThreadPool,
        hidden: &[f32],
        out: &mut Vec<f32>,
        scratch: &mut Scratch,
    ) {
        let n = hidden.len() / self.config.hidden;
        let m = &self.weights.output;
        resize_for_overwrite(out, n * m.rows);
        if n == 0 {
            return;
        }
        let mut normed = std::mem::take(&mut scratch.att);
        rms_norm(
            pool,
            hidden,
            &self.weights.output_norm,
            self.config.rms_eps,
            &mut normed,
        );
        self.quantize_acts(pool, m, &normed, n, &mut scratch.acts);
        self.matmul(pool, m, &scratch.acts, n, out, &mut scratch.matmul);
        scratch.att = normed;
        if let Some(cap) = self.config.logit_softcap {
            // As ggml: scale by the reciprocal, tanh, scale back.
            let inv = 1.0 / cap;
            out.iter_mut().for_each(|v| *v = (*v * inv).tanh() * cap);
        }
    }

    /// Quantizes `n` rows of `x` into `m`'s activation format.
    fn quantize_acts(
        &self,
        pool: &ThreadPool,
        m: &Matrix,
        x: &[f32],
        n: usize,
        acts: &mut Vec<u8>,
    ) {
        let _t = phases::time(Phase::Quantize);
        let act_row = m.act_ty.row_bytes(m.cols).unwrap_or(0);
        resize_for_overwrite(acts, n * act_row);
        let rows_per_task = 16;
        pool.for_each_chunk_mut(acts, act_row * rows_per_task, &|chunk, out| {
            for (i, dst) in out.chunks_exact_mut(act_row).enumerate() {
                let t = chunk * rows_per_task + i;
                // The format and lengths were checked against the weight at
                // load time (`Weights::locate`), so this cannot fail.
                let quantized = quant::quantize_row(m.act_ty, &x[t * m.cols..][..m.cols], dst);
                debug_assert!(quantized.is_ok(), "{quantized:?}");
            }
        });
    }

    /// `out[t][r] = m[r] · acts[t]`, rows split over the pool.
    fn matmul(
        &self,
        pool: &ThreadPool,
        m: &Matrix,
        acts: &[u8],
        n_tokens: usize,
        out: &mut [f32],
        scratch: &mut MatmulScratch,
    ) {
        let MatmulScratch { by_row, prepared } = scratch;
        if n_tokens > 1 && prepared.begin(m.ty, m.cols, n_tokens) {
            let _t = phases::time(Phase::Quantize);
            let (fill, chunks) = prepared.parts_mut();
            pool.for_each_chunk_mut(chunks, 1, &|i, chunk| fill.fill(i, acts, &mut chunk[0]));
        }
        let prepared = &*prepared;
        let w = self.file.tensor_bytes(&m.info);
        let chunk_rows = matmul_chunk_rows(m.rows, pool.threads());
        let kernel = |chunk: usize, dst: &mut [f32]| {
            let _t = phases::time_matmul_task();
            let r0 = chunk * chunk_rows;
            let rows = dst.len() / n_tokens;
            let w_rows = &w[r0 * m.row_bytes..(r0 + rows) * m.row_bytes];
            quant::matmul_prepared(m.ty, m.cols, w_rows, acts, n_tokens, prepared, dst);
        };
        let matmul_time = phases::time(Phase::Matmul);
        if n_tokens == 1 {
            pool.for_each_chunk_mut(&mut out[..m.rows], chunk_rows, &kernel);
            return;
        }
        resize_for_overwrite(by_row, m.rows * n_tokens);
        pool.for_each_chunk_mut(by_row, chunk_rows * n_tokens, &kernel);
        drop(matmul_time);
        let _t = phases::time(Phase::Gather);
        // Each chunk of rows is token-major on its own; gather every token's
        // row from the chunks, a block of tokens per task, in contiguous
        // copies of a chunk's width.
        const TOKENS_PER_TASK: usize = 16;
        let rows = m.rows;
        let src = &by_row[..];
        let block = rows * TOKENS_PER_TASK;
        pool.for_each_chunk_mut(&mut out[..n_tokens * rows], block, &|chunk, dst| {
            let t0 = chunk * TOKENS_PER_TASK;
            for (i, dst_row) in dst.chunks_exact_mut(rows).enumerate() {
                let t = t0 + i;
                for r0 in (0..rows).step_by(chunk_rows) {
                    let width = chunk_rows.min(rows - r0);
                    let from = r0 * n_tokens + t * width;
                    dst_row[r0..r0 + width].copy_from_slice(&src[from..from + width]);
                }
            }
        });
    }

    /// Fills `scratch.rope` (and `scratch.rope_sliding` for a model with
    /// sliding-window layers) with `(cos, sin)` per token and rotated pair.
    fn rope_tables(&self, scratch: &mut Scratch) {
        let cfg = &self.config;
        let mut table = std::mem::take(&mut scratch.rope);
        self.rope_table(
            cfg.rope_base,
            cfg.rope_freq_scale,
            &scratch.token_seq,
            &mut table,
        );
        scratch.rope = table;
        if let Some(sliding) = &cfg.sliding_window {
            let mut table = std::mem::take(&mut scratch.rope_sliding);
            // Sliding layers rotate at their own base and are never scaled
            // (llama.cpp's `rope_freq_scale_train_swa`).
            self.rope_table(sliding.rope_base, 1.0, &scratch.token_seq, &mut table);
            scratch.rope_sliding = table;
        }
    }

    /// `(cos, sin)` per token of `token_seq` and rotated pair, computed as
    /// every backend must see them (the GPU uploads these tables).
    pub fn rope_table(
        &self,
        base: f32,
        freq_scale: f32,
        token_seq: &[(usize, usize)],
        out: &mut Vec<f32>,
    ) {
        let cfg = &self.config;
        let half_dims = cfg.rope_dims / 2;
        resize(out, token_seq.len() * cfg.rope_dims);
        let theta_scale = base.powf(-2.0 / cfg.rope_dims as f32);
        let freqs = self.weights.rope_freqs.as_deref();
        for (t, &(_, pos)) in token_seq.iter().enumerate() {
            let row = &mut out[t * cfg.rope_dims..][..cfg.rope_dims];
            let mut theta = pos as f32;
            for i in 0..half_dims {
                let divisor = freqs.map_or(1.0, |f| f[i]);
                let angle = freq_scale * (theta / divisor);
                row[2 * i] = angle.cos();
                row[2 * i + 1] = angle.sin();
                theta *= theta_scale;
            }
        }
    }

    /// Rotates every head of each token's row of `x` by its position's
    /// `(cos, sin)` pairs in `rope`, then multiplies the row by `scale`,
    /// a few tokens per task (on one thread a long prompt's rotation took
    /// as long as its norms and quantization together).
    fn apply_rope(
        &self,
        pool: &ThreadPool,
        x: &mut [f32],
        heads: usize,
        rope: &[f32],
        scale: Option<f32>,
    ) {
        const TOKENS_PER_TASK: usize = 8;
        let cfg = &self.config;
        let (hd, rd) = (cfg.head_dim, cfg.rope_dims);
        let layout = cfg.rope_layout();
        let row_len = heads * hd;
        pool.for_each_chunk_mut(x, row_len * TOKENS_PER_TASK, &|chunk, rows| {
            for (k, row) in rows.chunks_exact_mut(row_len).enumerate() {
                let t = chunk * TOKENS_PER_TASK + k;
                let cs = &rope[t * rd..][..rd];
                rope::rotate_heads(row, cs, hd, rd, layout);
                if let Some(scale) = scale {
                    row.iter_mut().for_each(|v| *v *= scale);
                }
            }
        });
    }

    /// Causal grouped-query attention of every new token over its own
    /// sequence's cached positions `0..=pos` (the last `window` of them on a
    /// sliding-window layer), into `scratch.att`. Lanes and partial sums
    /// follow absolute positions, so a window's result does not depend on
    /// where it starts relative to a call.
    fn attention(
        &self,
        pool: &ThreadPool,
        seqs: &[LayerFeed<'_>],
        kv_layer: usize,
        window: Option<usize>,
        scratch: &mut Scratch,
    ) -> Result<(), ModelError> {
        let cfg = &self.config;
        let hd = cfg.head_dim;
        // The first KV read error of any task (a broken page table); the
        // positions were reserved before the layer ran, so none is expected.
        let failure: std::sync::Mutex<Option<crate::kv::KvError>> = std::sync::Mutex::new(None);
        let fail = |e| {
            if let Ok(mut slot) = failure.lock() {
                slot.get_or_insert(e);
            }
        };
        let group = cfg.n_heads / cfg.n_kv_heads;
        let scale = match cfg.query_scale {
            Some(_) => 1.0,
            None => 1.0 / (hd as f32).sqrt(),
        };
        let token_seq = &scratch.token_seq;
        let heads_per_task = self.attention_heads_per_task(token_seq.len(), pool.threads());
        let head_groups = cfg.n_heads / heads_per_task;
        // Consecutive tokens of one sequence share a task too (a query
        // tile), so each block of cached rows is read from memory once for
        // all of them, while there are still a few tasks per thread.
        let tile_len = (token_seq.len() * head_groups / (4 * pool.threads())).clamp(1, MAX_TILE);
        let tiles = query_tiles(token_seq, tile_len);
        let layer = AttentionLayer {
            n_heads: cfg.n_heads,
            head_dim: hd,
            kv_dim: cfg.kv_dim(),
            group,
            heads_per_task,
            scale,
            q_all: &scratch.q,
            token_seq,
            kvs: seqs.iter().map(|s| &*s.kv).collect(),
            kv_layer,
            window,
            // Rows widened to f32 once per span for all of a task's queries,
            // where the SIMD level can (the same bits as the f16 row loops);
            // heads wider than WIDE_MAX_HEAD_DIM only when a task takes
            // several tokens (see there).
            wide: quant::wide_attention(hd).filter(|_| hd <= WIDE_MAX_HEAD_DIM || tile_len >= 2),
            att: SharedRows(scratch.att.as_mut_ptr()),
            att_len: scratch.att.len(),
        };
        pool.run(tiles.len() * head_groups, &|task| {
            let tile = tiles[task / head_groups].clone();
            let h0 = (task % head_groups) * heads_per_task;
            let done = TASK_SCRATCH.with_borrow_mut(|ts| layer.task(tile, h0, ts));
            if let Err(e) = done {
                fail(e);
            }
        });
        // A poisoned lock means a task panicked, which `run` re-raised already.
        match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            None => Ok(()),
            Some(e) => Err(e.into()),
        }
    }

    /// How many query heads (sharing one KV head) one attention task takes.
    ///
    /// With at least one (token, KV head) per thread, a task takes the
    /// query heads that share a KV head together, so each cached K and V
    /// row is read once for all of them (measured faster even for one
    /// decoded token at depth 4096, where it leaves fewer tasks than
    /// heads). Every head's arithmetic is the same either way.
    fn attention_heads_per_task(&self, n_tokens: usize, threads: usize) -> usize {
        let cfg = &self.config;
        let group = cfg.n_heads / cfg.n_kv_heads;
        if n_tokens * cfg.n_kv_heads >= threads {
            (1..=group.min(MAX_GROUP))
                .rev()
                .find(|d| group.is_multiple_of(*d))
                .unwrap_or(1)
        } else {
            1
        }
    }
}

/// Largest head dimension the attention kernel handles (stack buffer).
pub const MAX_HEAD_DIM: usize = 256;

/// Most query heads one attention task takes together (stack buffer).
const MAX_GROUP: usize = 8;

/// Most consecutive tokens of one sequence one attention task takes
/// together (stack buffer).
const MAX_TILE: usize = 4;

/// The rows of `scratch.att` that attention tasks write, each row by one
/// task only.
struct SharedRows(*mut f32);
// SAFETY: tasks write disjoint rows through it while the buffer is alive
// (see `AttentionLayer::write_rows`).
unsafe impl Sync for SharedRows {}

impl SharedRows {
    fn ptr(&self) -> *mut f32 {
        self.0
    }
}

/// One layer's attention as every one of its tasks sees it.
struct AttentionLayer<'a> {
    n_heads: usize,
    head_dim: usize,
    kv_dim: usize,
    /// Query heads per KV head.
    group: usize,
    /// Query heads one task takes (a divisor of `group`).
    heads_per_task: usize,
    /// What scores are multiplied by before the softmax.
    scale: f32,
    /// Every token's queries, `[tokens][n_heads][head_dim]`.
    q_all: &'a [f32],
    /// Per token: (sequence index, absolute position).
    token_seq: &'a [(usize, usize)],
    /// Each sequence's KV.
    kvs: Vec<&'a SessionKv>,
    kv_layer: usize,
    window: Option<usize>,
    wide: Option<quant::WideAttention>,
    att: SharedRows,
    att_len: usize,
}

/// The queries one attention task computes: token `tile_start + k /
/// heads_per_task`, head `h0 + k % heads_per_task` for query `k`, each
/// seeing positions `spans[k].0..spans[k].1` of one sequence.
struct TaskQueries {
    tile_start: usize,
    h0: usize,
    heads_per_task: usize,
    /// How many queries.
    count: usize,
    spans: [(usize, usize); MAX_GROUP * MAX_TILE],
    /// Where each query's scores start in the one buffer.
    offsets: [usize; MAX_GROUP * MAX_TILE + 1],
    /// The positions any query sees: `lo..hi`.
    lo: usize,
    hi: usize,
}

impl TaskQueries {
    /// Query `k`'s (token, head).
    #[inline]
    fn token_head(&self, k: usize) -> (usize, usize) {
        (
            self.tile_start + k / self.heads_per_task,
            self.h0 + k % self.heads_per_task,
        )
    }

    #[inline]
    fn spans(&self) -> &[(usize, usize)] {
        &self.spans[..self.count]
    }
}

impl AttentionLayer<'_> {
    /// One task: the queries of the tokens `tile` at heads `h0..h0 +
    /// heads_per_task` (one KV head's), scored against their sequence's
    /// cached K, turned into softmax weights, and summed over its cached V
    /// into their rows of `att`.
    #[inline]
    fn task(&self, tile: Range<usize>, h0: usize, ts: &mut TaskScratch) -> Result<(), KvError> {
        let tq = self.task_queries(tile, h0);
        let kv = self.kvs[self.token_seq[tq.tile_start].0];
        let kv_head = h0 / self.group;
        self.gather_queries(&tq, &mut ts.q16);
        ts.scores.clear();
        ts.scores.resize(tq.offsets[tq.count], 0.0);
        self.key_scores(kv, kv_head, &tq, ts)?;
        for s in ts.scores.iter_mut() {
            *s *= self.scale;
        }
        for (k, &(first, _)) in tq.spans().iter().enumerate() {
            softmax_weights(&mut ts.scores[tq.offsets[k]..tq.offsets[k + 1]], first);
        }
        ts.lanes.clear();
        ts.lanes.resize(tq.count * LANES * self.head_dim, 0.0);
        self.weighted_values(kv, kv_head, &tq, ts)?;
        self.write_rows(&tq, &ts.lanes);
        Ok(())
    }

    /// The task's queries and the positions each sees.
    #[inline]
    fn task_queries(&self, tile: Range<usize>, h0: usize) -> TaskQueries {
        let mut tq = TaskQueries {
            tile_start: tile.start,
            h0,
            heads_per_task: self.heads_per_task,
            count: tile.len() * self.heads_per_task,
            spans: [(0, 0); MAX_GROUP * MAX_TILE],
            offsets: [0; MAX_GROUP * MAX_TILE + 1],
            lo: 0,
            hi: 0,
        };
        for k in 0..tq.count {
            let pos = self.token_seq[tq.token_head(k).0].1;
            let first = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            tq.spans[k] = (first, pos + 1);
        }
        let spans = &tq.spans[..tq.count];
        tq.lo = spans.iter().map(|s| s.0).min().unwrap_or(0);
        tq.hi = spans.iter().map(|s| s.1).max().unwrap_or(0);
        for (k, &(first, end)) in spans.iter().enumerate() {
            tq.offsets[k + 1] = tq.offsets[k] + (end - first);
        }
        tq
    }

    /// The task's queries rounded to f16, one after another.
    #[inline]
    fn gather_queries(&self, tq: &TaskQueries, q16: &mut Vec<f16>) {
        let hd = self.head_dim;
        q16.clear();
        q16.resize(tq.count * hd, f16::ZERO);
        for (k, q16) in q16.chunks_exact_mut(hd).enumerate() {
            let (t, h) = tq.token_head(k);
            q16.convert_from_f32_slice(&self.q_all[(t * self.n_heads + h) * hd..][..hd]);
        }
    }

    /// Every query's f16 dot with each cached K row of its span, in
    /// position order, into its run of `ts.scores`.
    #[inline]
    fn key_scores(
        &self,
        kv: &SessionKv,
        kv_head: usize,
        tq: &TaskQueries,
        ts: &mut TaskScratch,
    ) -> Result<(), KvError> {
        let (hd, kv_dim, kv_layer) = (self.head_dim, self.kv_dim, self.kv_layer);
        let TaskScratch {
            q16,
            q32,
            scores,
            rows: wide_rows,
            ..
        } = ts;
        let (spans, offsets, lo, hi) = (tq.spans(), &tq.offsets, tq.lo, tq.hi);
        let column = (kv_head * hd, kv_dim);
        if let Some(wide) = self.wide {
            q32.clear();
            q32.resize(q16.len(), 0.0);
            q16.convert_to_f32_slice(q32);
            let k_span = |range| kv.k_blocks(kv_layer, range);
            for_each_wide_span(wide, lo..hi, k_span, column, wide_rows, |a0, b0, rows| {
                shared_overlaps(spans, offsets, a0..b0, |ks, at, a, b| {
                    let rows = &rows[(a - a0) * hd..(b - a0) * hd];
                    wide.dot_rows_shared(q32, ks, rows, scores, at);
                })
            })
        } else {
            kv.k_blocks(kv_layer, lo..hi).map(|blocks| {
                for_each_block(
                    blocks,
                    lo..hi,
                    kv_dim,
                    Some((kv_head * hd, hd)),
                    |p, n, block| {
                        for (k, first, a, b) in overlaps(spans, p..p + n) {
                            let keys = &block[(a - p) * kv_dim + kv_head * hd..];
                            let out = &mut scores[offsets[k] + a - first..][..b - a];
                            quant::dot_f16_rows(&q16[k * hd..][..hd], keys, kv_dim, out);
                        }
                    },
                )
            })
        }
    }

    /// Every query's cached V rows weighted by its softmax weights, summed
    /// per lane (`p % 16`) into its 16 accumulators in `ts.lanes`.
    #[inline]
    fn weighted_values(
        &self,
        kv: &SessionKv,
        kv_head: usize,
        tq: &TaskQueries,
        ts: &mut TaskScratch,
    ) -> Result<(), KvError> {
        let (hd, kv_dim, kv_layer) = (self.head_dim, self.kv_dim, self.kv_layer);
        let TaskScratch {
            scores,
            lanes,
            rows: wide_rows,
            ..
        } = ts;
        let (spans, offsets, lo, hi) = (tq.spans(), &tq.offsets, tq.lo, tq.hi);
        let column = (kv_head * hd, kv_dim);
        if let Some(wide) = self.wide {
            let v_span = |range| kv.v_blocks(kv_layer, range);
            for_each_wide_span(wide, lo..hi, v_span, column, wide_rows, |a0, b0, rows| {
                shared_overlaps(spans, offsets, a0..b0, |ks, at, a, b| {
                    let rows = &rows[(a - a0) * hd..(b - a0) * hd];
                    wide.axpy_rows_shared(scores, at, rows, lanes, ks, a);
                })
            })
        } else {
            kv.v_blocks(kv_layer, lo..hi).map(|blocks| {
                for_each_block(
                    blocks,
                    lo..hi,
                    kv_dim,
                    Some((kv_head * hd, hd)),
                    |p, n, block| {
                        for (k, first, a, b) in overlaps(spans, p..p + n) {
                            let values = &block[(a - p) * kv_dim + kv_head * hd..];
                            let w = &scores[offsets[k] + a - first..][..b - a];
                            let acc = &mut lanes[k * LANES * hd..][..LANES * hd];
                            quant::axpy_f16_rows(w, values, kv_dim, acc, a);
                        }
                    },
                )
            })
        }
    }

    /// Each query's 16 lane accumulators reduced into its row of `att`.
    #[inline]
    fn write_rows(&self, tq: &TaskQueries, lanes: &[f32]) {
        let hd = self.head_dim;
        for (k, acc) in lanes.chunks_exact(LANES * hd).enumerate() {
            let (t, h) = tq.token_head(k);
            let at = (t * self.n_heads + h) * hd;
            assert!(at + hd <= self.att_len, "attention row outside its buffer");
            // SAFETY: in bounds (checked above); each (token, head) row
            // belongs to exactly one task, and `scratch.att` outlives the
            // region (see `Model::attention`).
            let out = unsafe { std::slice::from_raw_parts_mut(self.att.ptr().add(at), hd) };
            for (d, o) in out.iter_mut().enumerate() {
                let lane_values: [f32; LANES] = std::array::from_fn(|l| acc[l * hd + d]);
                *o = quant::reduce16(&lane_values);
            }
        }
    }
}

/// Bytes of K or V rows one attention task widens to f32 at a time: a
/// span of positions every query of the task then reads from cache.
const WIDE_SPAN_BYTES: usize = 16 << 10;

/// The widest head attention widens rows for when each task takes one
/// token: a 256-wide head (Gemma 3) leaves only 16 rows per span and ran
/// its decode at depth 4096 about 15% slower widened (86-88 against 100-108
/// tokens/s, alternating runs; with the rows shared by a token's 4 heads,
/// 96-97 against 100-110). Tasks of several tokens widen every head width:
/// Gemma 3 270M pp512 went from 1378-1419 to 1516-1547 tokens/s, and from
/// 638-723 to 721-852 at depth 4096.
const WIDE_MAX_HEAD_DIM: usize = 128;

/// The fewest positions a span holds for heads wider than
/// [`WIDE_MAX_HEAD_DIM`] (widened only in prefill): at 16 KiB a 256-wide
/// head got 16 rows per span, one per accumulator lane, so the V pass
/// loaded and stored its accumulators for every row it added. With 64
/// (64 KiB), Gemma 3 270M pp512 went from 799-804 to 907-924 tokens/s, and
/// from 413-437 to 553-559 at depth 4096 (2 threads, Sapphire
/// Rapids-class VM, alternating; 128 rows no better). The bits do not
/// change: a span's length is a multiple of the lanes, and each lane adds
/// its rows in order whatever the spans.
const WIDE_SPAN_MIN_ROWS: usize = 64;

/// Walks `range` in spans of positions aligned to multiples of the span
/// length: widens each span's rows (`head_dim` values from `column` of each
/// row the blocks `blocks` gives for it) into `buf` and calls `each(start,
/// end, rows)` with them, `head_dim` apart. A KV read error ends the walk.
/// The next span's rows are prefetched first (measured: the reference
/// model's decode at depth 4096, 2 threads, went from 65-68 to 74-82
/// tokens/s, alternating runs).
fn for_each_wide_span<'k>(
    wide: quant::WideAttention,
    range: Range<usize>,
    blocks: impl Fn(Range<usize>) -> Result<KvBlocks<'k>, KvError>,
    (column, kv_dim): (usize, usize),
    buf: &mut Vec<f32>,
    mut each: impl FnMut(usize, usize, &[f32]),
) -> Result<(), KvError> {
    let hd = wide.head_dim();
    let min_rows = if hd > WIDE_MAX_HEAD_DIM {
        WIDE_SPAN_MIN_ROWS
    } else {
        LANES
    };
    let span = (WIDE_SPAN_BYTES / (hd * 4)).max(min_rows) / LANES * LANES;
    buf.resize(span * hd, 0.0);
    let mut a0 = range.start;
    while a0 < range.end {
        let b0 = range.end.min((a0 / span + 1) * span);
        let b1 = range.end.min(b0 + span);
        for block in blocks(b0..b1)? {
            prefetch_rows(block, (column, hd), kv_dim);
        }
        for_each_block(blocks(a0..b0)?, a0..b0, kv_dim, None, |p, n, block| {
            if n > 0 {
                wide.widen(&block[column..], kv_dim, n, &mut buf[(p - a0) * hd..]);
            }
        });
        each(a0, b0, &buf[..(b0 - a0) * hd]);
        a0 = b0;
    }
    Ok(())
}

/// Blocks of cached rows [`for_each_block`] asks the cache for ahead of the
/// one it walks: pages lie anywhere in the pool, so the hardware
/// prefetchers lose the stream at every page boundary.
const PREFETCH_BLOCKS: usize = 2;

/// Walks the cached blocks of `range` in position order: `each(start, n,
/// rows)` with the block's first position and its `n` rows, `kv_dim`
/// apart. With `prefetch` (`(column, values)` of each row) it prefetches
/// those values of the rows [`PREFETCH_BLOCKS`] blocks ahead.
fn for_each_block(
    blocks: KvBlocks<'_>,
    range: Range<usize>,
    kv_dim: usize,
    prefetch: Option<(usize, usize)>,
    mut each: impl FnMut(usize, usize, &[f16]),
) {
    let mut ahead = prefetch.map(|_| blocks.clone().skip(PREFETCH_BLOCKS));
    let mut p = range.start;
    for block in blocks {
        if let (Some(ahead), Some(column)) = (ahead.as_mut(), prefetch) {
            if let Some(next) = ahead.next() {
                prefetch_rows(next, column, kv_dim);
            }
        }
        let n = (block.len() / kv_dim).min(range.end - p);
        each(p, n, block);
        p += n;
    }
}

/// Prefetches `values` f16 values from `column` of each `kv_dim`-wide row
/// of `block`.
fn prefetch_rows(block: &[f16], (column, values): (usize, usize), kv_dim: usize) {
    for row in block.get(column..).unwrap_or_default().chunks(kv_dim) {
        quant::prefetch_bytes(row.as_ptr() as *const u8, values * 2, quant::CacheLevel::L1);
    }
}

/// The queries whose span of positions overlaps `range`: `(query, its
/// first position, overlap start, overlap end)`.
fn overlaps(
    spans: &[(usize, usize)],
    range: Range<usize>,
) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
    spans
        .iter()
        .enumerate()
        .filter_map(move |(k, &(first, end))| {
            let (a, b) = (range.start.max(first), range.end.min(end));
            (a < b).then_some((k, first, a, b))
        })
}

/// [`overlaps`] gathered into runs of up to [`quant::SHARED_QUERIES`]
/// consecutive queries that see the same positions `a..b` of `range` (the
/// heads of one token, and every query of a tile away from the diagonal),
/// so one kernel call reads those rows once for all of them:
/// `each(queries, at, a, b)`, `at[j]` the index in the task's scores of
/// query `queries[j]`'s weight for position `a`.
fn shared_overlaps(
    spans: &[(usize, usize)],
    offsets: &[usize],
    range: Range<usize>,
    mut each: impl FnMut(&[usize], &[usize], usize, usize),
) {
    const MAX: usize = quant::SHARED_QUERIES;
    let (mut ks, mut at, mut len, mut run) = ([0; MAX], [0; MAX], 0, (0, 0));
    for (k, first, a, b) in overlaps(spans, range) {
        if len == MAX || (len > 0 && run != (a, b)) {
            each(&ks[..len], &at[..len], run.0, run.1);
            len = 0;
        }
        (ks[len], at[len], run) = (k, offsets[k] + a - first, (a, b));
        len += 1;
    }
    if len > 0 {
        each(&ks[..len], &at[..len], run.0, run.1);
    }
}

/// `token_seq` cut into runs of at most `tile_len` consecutive entries of
/// one sequence (their positions are consecutive).
fn query_tiles(token_seq: &[(usize, usize)], tile_len: usize) -> Vec<Range<usize>> {
    let mut tiles = Vec::new();
    let mut start = 0;
    while start < token_seq.len() {
        let seq = token_seq[start].0;
        let mut end = start + 1;
        while end < token_seq.len() && end - start < tile_len && token_seq[end].0 == seq {
            end += 1;
        }
        tiles.push(start..end);
        start = end;
    }
    tiles
}

/// One query's scores (positions `first..`) into the softmax weights ggml
/// multiplies the V cache by: minus their maximum, ggml's `expf`, summed in
/// lanes that follow absolute positions (so a window's sum does not depend
/// on where it starts), normalised and rounded to f16.
fn softmax_weights(scores: &mut [f32], first: usize) {
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    for s in scores.iter_mut() {
        *s -= max;
    }
    quant::exp_ggml(scores);
    let mut sum = 0f64;
    let mut rest = &scores[..];
    let mut lane = first % LANES;
    while !rest.is_empty() {
        let take = (LANES - lane).min(rest.len());
        let mut lanes = [0f32; LANES];
        lanes[lane..lane + take].copy_from_slice(&rest[..take]);
        sum += quant::reduce16(&lanes) as f64;
        rest = &rest[take..];
        lane = 0;
    }
    let inv = (1.0 / sum) as f32;
    quant::scale_round_f16(scores, inv);
}

/// Writes every new token's K and V (`scratch.k`, `scratch.v`, `kv_dim`
/// each) at its position in layer `kv_layer` of its sequence's KV.
fn write_kv(
    seqs: &mut [LayerFeed<'_>],
    kv_layer: usize,
    kv_dim: usize,
    scratch: &Scratch,
) -> Result<(), KvError> {
    for (t, &(s, pos)) in scratch.token_seq.iter().enumerate() {
        seqs[s].kv.write(
            kv_layer,
            pos,
            &scratch.k[t * kv_dim..][..kv_dim],
            &scratch.v[t * kv_dim..][..kv_dim],
        )?;
    }
    Ok(())
}

/// Rows per matrix task: enough tasks to balance the threads, each a whole
/// number of 16-row tiles.
fn matmul_chunk_rows(rows: usize, threads: usize) -> usize {
    let tasks = (threads * 4).max(1);
    let per = rows.div_ceil(tasks);
    per.div_ceil(16).max(1) * 16
}

/// Rows per RMSNorm task.
const NORM_ROWS: usize = 8;

/// RMSNorm of each `[hidden]` row of `x` into `out`, then times `weight`.
fn rms_norm(pool: &ThreadPool, x: &[f32], weight: &[f32], eps: f32, out: &mut Vec<f32>) {
    let h = weight.len();
    resize(out, x.len());
    pool.for_each_chunk_mut(out, h * NORM_ROWS, &|chunk, dst| {
        let src = &x[chunk * NORM_ROWS * h..][..dst.len()];
        let sums = sums_of_squares(src, h);
        for ((row, src), sum) in dst.chunks_exact_mut(h).zip(src.chunks_exact(h)).zip(sums) {
            let mean = (sum / h as f64) as f32;
            let scale = 1.0 / (mean + eps).sqrt();
            for ((d, &s), &w) in row.iter_mut().zip(src).zip(weight) {
                *d = (s * scale) * w;
            }
        }
    });
}

/// Each `h`-element row's sum of squares (at most [`NORM_ROWS`] rows), in
/// f64 and element order, as ggml sums it. Each row's additions form one
/// chain, every addition waiting on the one before; the rows' chains run
/// side by side (a whole task's rows element by element), so the core
/// overlaps them rather than running one row's chain after another's.
fn sums_of_squares(src: &[f32], h: usize) -> [f64; NORM_ROWS] {
    let mut sums = [0f64; NORM_ROWS];
    if h > 0 && src.len() == NORM_ROWS * h {
        let rows: [&[f32]; NORM_ROWS] = std::array::from_fn(|r| &src[r * h..][..h]);
        for i in 0..h {
            for (sum, row) in sums.iter_mut().zip(&rows) {
                *sum += (row[i] * row[i]) as f64;
            }
        }
    } else {
        for (sum, row) in sums.iter_mut().zip(src.chunks_exact(h.max(1))) {
            *sum = row.iter().fold(0f64, |s, &v| s + (v * v) as f64);
        }
    }
    sums
}

/// `gate = act(gate) * up`, element-wise, with ggml's arithmetic for each
/// activation (`expf` for SiLU, the f16 table for GELU).
fn gated_activation(
    pool: &ThreadPool,
    activation: FfnActivation,
    gate: &mut [f32],
    up: &[f32],
    ffn: usize,
) {
    pool.for_each_chunk_mut(gate, ffn * 4, &|chunk, g| {
        let up = &up[chunk * ffn * 4..][..g.len()];
        match activation {
            FfnActivation::Silu => quant::swiglu_ggml(g, up),
            FfnActivation::Gelu => quant::geglu_ggml(g, up),
        }
    });
}

/// `x += block_output`, through the block's output RMSNorm when the
/// architecture has one (`scratch` holds the normed output).
fn add_block_output(
    pool: &ThreadPool,
    x: &mut [f32],
    block_output: &[f32],
    post_norm: Option<&[f32]>,
    eps: f32,
    scratch: &mut Vec<f32>,
) {
    match post_norm {
        None => add_in_place(x, block_output),
        Some(weight) => {
            rms_norm(pool, block_output, weight, eps, scratch);
            add_in_place(x, scratch);
        }
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            add_in_place(row, b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{sums_of_squares, NORM_ROWS};

    #[test]
    fn sums_of_squares_side_by_side_are_each_rows_own_sum() {
        // Rows summed side by side give each row the bits of its own
        // element-order f64 sum (ggml's), for whole and partial tasks.
        let h = 37;
        let x: Vec<f32> = (0..NORM_ROWS * h)
            .map(|i| ((i * 7919 % 1009) as f32 - 500.0) * 0.0137)
            .collect();
        for rows in 1..=NORM_ROWS {
            let sums = sums_of_squares(&x[..rows * h], h);
            for (r, sum) in sums.iter().enumerate() {
                let want: f64 = if r < rows {
                    x[r * h..][..h]
                        .iter()
                        .fold(0f64, |s, &v| s + (v * v) as f64)
                } else {
                    0.0
                };
                assert_eq!(sum.to_bits(), want.to_bits(), "{rows} rows, row {r}");
            }
        }
    }
}
