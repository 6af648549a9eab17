//! One worker's forward pass on the device: buffers sized once, every
//! kernel bound once, and a step that uploads the tokens, positions, page
//! tables and RoPE tables, records all layers into one compute pass,
//! submits once and reads back only the logit rows asked for.

use std::sync::Arc;

use super::kernels::{Bound, Groups, Kernels};
use super::weights::GpuWeights;
use super::{DeviceMatrix, GpuDevice, GpuError, MatmulCall};
use crate::kv::SessionKv;
use crate::model::{FfnActivation, LogitRows, LogitsWanted, Model, RopeLayout};

/// The model on one device, shared by every worker's [`GpuForward`].
pub struct GpuModel {
    pub device: Arc<GpuDevice>,
    pub model: Arc<Model>,
    pub weights: GpuWeights,
    pub kernels: Kernels,
}

impl GpuModel {
    /// Uploads `model`'s weights to `device` and builds its kernels.
    pub fn new(device: Arc<GpuDevice>, model: Arc<Model>) -> Result<Arc<Self>, GpuError> {
        let cfg = &model.config;
        // K and V are written and read as pairs of halves, and RoPE pairs
        // come from the host's table.
        if !cfg.head_dim.is_multiple_of(2) || !cfg.rope_dims.is_multiple_of(2) {
            return Err(GpuError::BadMatrix {
                name: "attention".into(),
                why: format!(
                    "head dimension {} and RoPE dimensions {} must be even on the GPU",
                    cfg.head_dim, cfg.rope_dims
                ),
            });
        }
        let weights = GpuWeights::upload(&device, &model)?;
        let kernels = Kernels::new(&device, &weights.matrix_types(), weights.token_embd.ty)?;
        Ok(Arc::new(Self {
            device,
            model,
            weights,
            kernels,
        }))
    }
}

/// The KV pages on the device: page `p` is words
/// `p * page_words .. (p + 1) * page_words` of one buffer, laid out as the
/// host pool's page `p`.
pub struct DeviceKv {
    pub buffer: wgpu::Buffer,
    /// K and V bytes of a page, its padding excluded.
    pub page_values_bytes: usize,
    pub page_words: usize,
    pub page_positions: usize,
    pub n_pages: usize,
}

impl DeviceKv {
    /// A zeroed buffer for the pages of `layout`, `n_pages` of `page_bytes`
    /// each (the host pool's page stride).
    pub fn new(
        device: &GpuDevice,
        layout: &crate::kv::KvLayout,
        n_pages: usize,
        page_bytes: usize,
    ) -> Result<Self, GpuError> {
        let bytes = (n_pages as u64) * page_bytes as u64;
        if bytes > device.max_binding_bytes() {
            return Err(GpuError::TooLarge {
                what: format!("a KV cache of {n_pages} pages ({bytes} bytes)"),
                limit: device.max_binding_bytes(),
            });
        }
        Ok(Self {
            buffer: device.storage("kv pages", bytes),
            page_values_bytes: layout.page_values() * 2,
            page_words: page_bytes / 4,
            page_positions: layout.page_positions,
            n_pages,
        })
    }
}

/// What one step may hold at most; a bigger batch runs as several steps.
#[derive(Clone, Copy, Debug)]
pub struct StepCapacity {
    pub tokens: usize,
    pub rows: usize,
    pub sequences: usize,
    /// Floats of the attention score buffer (tokens x heads x keys).
    pub scores: usize,
}

impl Default for StepCapacity {
    fn default() -> Self {
        Self {
            tokens: 512,
            rows: 64,
            sequences: 64,
            scores: 16 << 20,
        }
    }
}

/// Why a step failed.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// Refused before anything ran (a token out of range, no room), or a
    /// KV page table that cannot be trusted.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// The device failed while the step ran.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

impl From<crate::kv::KvError> for ForwardError {
    fn from(e: crate::kv::KvError) -> Self {
        Self::Model(e.into())
    }
}

/// One sequence's share of a step.
pub struct GpuFeed<'a> {
    pub kv: &'a mut SessionKv,
    pub tokens: &'a [u32],
    pub logits: LogitsWanted,
}

/// One recorded operation.
enum Op {
    Kernel(Bound),
    Matmul(MatmulCall),
    /// The output projection: its token count is the step's logit rows.
    Logits(MatmulCall),
}

/// The step's buffers.
struct Buffers {
    step: wgpu::Buffer,
    rows_step: wgpu::Buffer,
    tokens: wgpu::Buffer,
    seqs: wgpu::Buffer,
    pages: wgpu::Buffer,
    rope: wgpu::Buffer,
    rope_sliding: wgpu::Buffer,
    rows: wgpu::Buffer,
    logits: wgpu::Buffer,
    readback: wgpu::Buffer,
}

/// One worker's forward pass; see the module docs.
pub struct GpuForward {
    gpu: Arc<GpuModel>,
    capacity: StepCapacity,
    pages_capacity: usize,
    buffers: Buffers,
    ops: Vec<Op>,
    /// Host copies of the per-step uploads, reused across steps.
    token_words: Vec<u32>,
    seq_words: Vec<u32>,
    page_words: Vec<u32>,
    row_words: Vec<u32>,
    token_seq: Vec<(usize, usize)>,
    rope: Vec<f32>,
    rope_sliding: Vec<f32>,
}

/// A sub-step: tokens `tokens` of the concatenated feeds.
struct Span {
    /// (feed, first token of the feed in this span, tokens in this span).
    parts: Vec<(usize, usize, usize)>,
}

impl GpuForward {
    /// Buffers and bindings for steps of up to `capacity` over `kv`.
    pub fn new(
        gpu: Arc<GpuModel>,
        kv: &DeviceKv,
        capacity: StepCapacity,
    ) -> Result<Self, GpuError> {
        let cfg = &gpu.model.config;
        let device = &gpu.device;
        let t = capacity.tokens;
        let r = capacity.rows;
        let blocks = cfg.context.div_ceil(16).max(1);
        let pages_capacity = (capacity.sequences * cfg.n_layers * blocks).min(1 << 24);
        let f32s = |label: &str, n: usize| device.storage(label, (n * 4) as u64);
        let buffers = Buffers {
            step: device.uniform_words("step", &[0; 4]),
            rows_step: device.uniform_words("rows step", &[0; 4]),
            tokens: f32s("tokens", t * 4),
            seqs: f32s("sequences", capacity.sequences * 4),
            pages: f32s("page tables", pages_capacity),
            rope: f32s("rope", t * cfg.rope_dims),
            rope_sliding: f32s("rope sliding", t * cfg.rope_dims),
            rows: f32s("logit rows", r),
            logits: f32s("logits", r * cfg.vocab),
            readback: device.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("logits readback"),
                size: (r * cfg.vocab * 4) as u64,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
        };
        let ops = Recorder::new(&gpu, &buffers, kv, capacity).ops()?;
        Ok(Self {
            gpu,
            capacity,
            pages_capacity,
            buffers,
            ops,
            token_words: Vec::new(),
            seq_words: Vec::new(),
            page_words: Vec::new(),
            row_words: Vec::new(),
            token_seq: Vec::new(),
            rope: Vec::new(),
            rope_sliding: Vec::new(),
        })
    }

    /// The device this forward pass runs on.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.gpu.device
    }

    /// Runs the model on `feeds`: reserves their KV (all or nothing per
    /// feed), runs every layer on the device, commits the new lengths, and
    /// writes the logit rows asked for into `logits` (`[rows][vocab]`).
    pub fn forward(
        &mut self,
        feeds: &mut [GpuFeed<'_>],
        logits: &mut Vec<f32>,
    ) -> Result<LogitRows, ForwardError> {
        let model = Arc::clone(&self.gpu.model);
        for f in feeds.iter() {
            model.check_append(f.kv.len(), f.tokens)?;
        }
        for f in feeds.iter_mut() {
            let want = f.kv.len() + f.tokens.len();
            f.kv.reserve(want)?;
        }
        let vocab = model.config.vocab;
        logits.clear();
        let mut per_sequence = Vec::with_capacity(feeds.len());
        let mut row = 0;
        for f in feeds.iter() {
            let n = f.logits.rows(f.tokens.len()).len();
            per_sequence.push(row..row + n);
            row += n;
        }
        logits.reserve(row * vocab);
        for span in self.spans(feeds) {
            self.run_span(feeds, &span, logits)?;
        }
        for f in feeds.iter_mut() {
            let new_len = f.kv.len() + f.tokens.len();
            f.kv.commit(new_len)?;
        }
        Ok(LogitRows { per_sequence })
    }

    /// Splits the feeds' tokens into sub-steps that fit the buffers.
    fn spans(&self, feeds: &[GpuFeed<'_>]) -> Vec<Span> {
        let cfg = &self.gpu.model.config;
        let cap = self.capacity;
        let blocks_per_seq = |f: &GpuFeed<'_>| {
            (f.kv.len() + f.tokens.len()).div_ceil(f.kv.pool().layout().page_positions)
        };
        let mut spans = Vec::new();
        let mut current = Span { parts: Vec::new() };
        let (mut tokens, mut rows, mut keys, mut pages) = (0usize, 0usize, 0usize, 0usize);
        for (i, f) in feeds.iter().enumerate() {
            let wanted = f.logits.rows(f.tokens.len());
            let mut start = 0;
            while start < f.tokens.len() {
                let seq_pages = cfg.n_layers * blocks_per_seq(f);
                let fits = |n: usize, tokens: usize, rows: usize, keys: usize, pages: usize| {
                    let end = start + n;
                    let new_rows = wanted.start.max(start)..wanted.end.min(end);
                    let new_keys = keys.max(f.kv.len() + end);
                    tokens + n <= cap.tokens
                        && rows + new_rows.len() <= cap.rows
                        && (tokens + n) * cfg.n_heads * new_keys <= cap.scores
                        && pages + seq_pages <= self.pages_capacity
                        && current.parts.len() < cap.sequences
                };
                let mut n = f.tokens.len() - start;
                while n > 0 && !fits(n, tokens, rows, keys, pages) {
                    n /= 2;
                }
                if n == 0 {
                    if current.parts.is_empty() {
                        // A single token that does not fit an empty step
                        // (a context beyond the score buffer) still runs;
                        // `run_span` refuses it with an error.
                        n = 1;
                    } else {
                        spans.push(std::mem::replace(&mut current, Span { parts: Vec::new() }));
                        (tokens, rows, keys, pages) = (0, 0, 0, 0);
                        continue;
                    }
                }
                let end = start + n;
                rows += (wanted.start.max(start)..wanted.end.min(end)).len();
                keys = keys.max(f.kv.len() + end);
                tokens += n;
                pages += seq_pages;
                current.parts.push((i, start, n));
                start = end;
            }
        }
        if !current.parts.is_empty() {
            spans.push(current);
        }
        spans
    }

    /// Uploads and runs one sub-step, appending its logit rows.
    fn run_span(
        &mut self,
        feeds: &[GpuFeed<'_>],
        span: &Span,
        logits: &mut Vec<f32>,
    ) -> Result<(), GpuError> {
        let model = Arc::clone(&self.gpu.model);
        let cfg = &model.config;
        let n_layers = cfg.n_layers;
        self.token_words.clear();
        self.seq_words.clear();
        self.page_words.clear();
        self.row_words.clear();
        self.token_seq.clear();
        let mut max_keys = 0usize;
        for (s, &(i, start, n)) in span.parts.iter().enumerate() {
            let f = &feeds[i];
            let base = f.kv.len();
            let page_positions = f.kv.pool().layout().page_positions;
            let blocks = (base + start + n).div_ceil(page_positions);
            self.seq_words
                .extend([self.page_words.len() as u32, blocks as u32, 0, 0]);
            for layer in 0..n_layers {
                let (first, ids) = f.kv.page_table(layer).unwrap_or((0, Vec::new()));
                for b in 0..blocks {
                    let id = b
                        .checked_sub(first)
                        .and_then(|k| ids.get(k).copied())
                        .unwrap_or(u32::MAX);
                    self.page_words.push(id);
                }
            }
            let wanted = f.logits.rows(f.tokens.len());
            for j in start..start + n {
                let t = self.token_words.len() / 4;
                let pos = base + j;
                self.token_words
                    .extend([f.tokens[j], pos as u32, s as u32, 0]);
                self.token_seq.push((s, pos));
                if wanted.contains(&j) {
                    self.row_words.push(t as u32);
                }
                max_keys = max_keys.max(pos + 1);
            }
        }
        let n_tokens = self.token_seq.len();
        let n_rows = self.row_words.len();
        // Global layers see every position: the score rows are that wide.
        let keys = max_keys;
        if n_tokens * cfg.n_heads * keys > self.capacity.scores {
            return Err(GpuError::TooLarge {
                what: format!("attention over {keys} positions for {n_tokens} tokens"),
                limit: (self.capacity.scores * 4) as u64,
            });
        }
        model.rope_table(
            cfg.rope_base,
            cfg.rope_freq_scale,
            &self.token_seq,
            &mut self.rope,
        );
        if let Some(sliding) = &cfg.sliding_window {
            model.rope_table(
                sliding.rope_base,
                1.0,
                &self.token_seq,
                &mut self.rope_sliding,
            );
        }
        let device = &self.gpu.device;
        let queue = &device.queue;
        let b = &self.buffers;
        queue.write_buffer(
            &b.step,
            0,
            bytemuck::cast_slice(&[n_tokens as u32, n_rows as u32, keys as u32, 0]),
        );
        queue.write_buffer(
            &b.rows_step,
            0,
            bytemuck::cast_slice(&[n_rows as u32, 0, 0, 0]),
        );
        queue.write_buffer(&b.tokens, 0, bytemuck::cast_slice(&self.token_words));
        queue.write_buffer(&b.seqs, 0, bytemuck::cast_slice(&self.seq_words));
        if !self.page_words.is_empty() {
            queue.write_buffer(&b.pages, 0, bytemuck::cast_slice(&self.page_words));
        }
        queue.write_buffer(&b.rope, 0, bytemuck::cast_slice(&self.rope));
        if cfg.sliding_window.is_some() {
            queue.write_buffer(&b.rope_sliding, 0, bytemuck::cast_slice(&self.rope_sliding));
        }
        if n_rows > 0 {
            queue.write_buffer(&b.rows, 0, bytemuck::cast_slice(&self.row_words));
        }
        let mut encoder = device.encoder("forward step");
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("forward"),
                timestamp_writes: None,
            });
            let (tokens, rows, keys) = (n_tokens as u32, n_rows as u32, keys as u32);
            for op in &self.ops {
                match op {
                    Op::Kernel(k) => k.record(&mut pass, tokens, rows, keys),
                    Op::Matmul(m) => m.record(&mut pass, n_tokens),
                    Op::Logits(m) => m.record(&mut pass, n_rows),
                }
            }
        }
        let bytes = (n_rows * cfg.vocab * 4) as u64;
        if bytes > 0 {
            encoder.copy_buffer_to_buffer(&b.logits, 0, &b.readback, 0, bytes);
        }
        device.submit(encoder)?;
        if bytes > 0 {
            let values = device.map_read(&b.readback, bytes)?;
            logits.extend_from_slice(&values);
        }
        Ok(())
    }
}

/// Builds the list of bound operations of a step.
struct Recorder<'a> {
    gpu: &'a GpuModel,
    b: &'a Buffers,
    kv: &'a DeviceKv,
    ops: Vec<Op>,
    /// Activation buffers, `[tokens][width]`.
    x: wgpu::Buffer,
    xn: wgpu::Buffer,
    q: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    att: wgpu::Buffer,
    proj: wgpu::Buffer,
    gate: wgpu::Buffer,
    up: wgpu::Buffer,
    scores: wgpu::Buffer,
    selected: wgpu::Buffer,
}

impl<'a> Recorder<'a> {
    fn new(gpu: &'a GpuModel, b: &'a Buffers, kv: &'a DeviceKv, capacity: StepCapacity) -> Self {
        let cfg = &gpu.model.config;
        let t = capacity.tokens;
        let d = &gpu.device;
        let f32s = |label: &str, n: usize| d.storage(label, (n * 4) as u64);
        Self {
            gpu,
            b,
            kv,
            ops: Vec::new(),
            x: f32s("x", t * cfg.hidden),
            xn: f32s("xn", t * cfg.hidden),
            q: f32s("q", t * cfg.q_dim()),
            k: f32s("k", t * cfg.kv_dim()),
            v: f32s("v", t * cfg.kv_dim()),
            att: f32s("att", t * cfg.q_dim()),
            proj: f32s("proj", t * cfg.hidden),
            gate: f32s("gate", t * cfg.ffn),
            up: f32s("up", t * cfg.ffn),
            scores: f32s("scores", capacity.scores),
            selected: f32s("selected", capacity.rows * cfg.hidden),
        }
    }

    fn ops(mut self) -> Result<Vec<Op>, GpuError> {
        let gpu = self.gpu;
        let cfg = &gpu.model.config;
        self.embed();
        for (l, w) in gpu.weights.layers.iter().enumerate() {
            self.norm_to(&self.x.clone(), &w.attn_norm, &self.xn.clone(), cfg.hidden);
            let (xn, q, k, v) = (
                self.xn.clone(),
                self.q.clone(),
                self.k.clone(),
                self.v.clone(),
            );
            self.matmul(&w.wq, &xn, &q)?;
            self.matmul(&w.wk, &xn, &k)?;
            self.matmul(&w.wv, &xn, &v)?;
            for (bias, out, width) in [
                (&w.bq, &q, cfg.q_dim()),
                (&w.bk, &k, cfg.kv_dim()),
                (&w.bv, &v, cfg.kv_dim()),
            ] {
                if let Some(bias) = bias {
                    self.elementwise("bias", Kind::Bias, bias, out, width, 0, 0.0);
                }
            }
            if let Some(norm) = &w.q_norm {
                self.norm_heads(&q, norm, cfg.n_heads);
            }
            if let Some(norm) = &w.k_norm {
                self.norm_heads(&k, norm, cfg.n_kv_heads);
            }
            let window = cfg.layer_window(l);
            self.rope(&q, cfg.n_heads, window.is_some());
            self.rope(&k, cfg.n_kv_heads, window.is_some());
            self.attention(l, window);
            let (att, proj, x) = (self.att.clone(), self.proj.clone(), self.x.clone());
            self.matmul(&w.wo, &att, &proj)?;
            if let Some(norm) = &w.attn_post_norm {
                self.norm_in_place(&proj, norm, cfg.hidden, 1, Groups::PerToken(1));
            }
            self.elementwise("add", Kind::Add, &proj, &x, cfg.hidden, 0, 0.0);
            self.norm_to(&x, &w.ffn_norm, &xn, cfg.hidden);
            let (gate, up) = (self.gate.clone(), self.up.clone());
            self.matmul(&w.w_gate, &xn, &gate)?;
            self.matmul(&w.w_up, &xn, &up)?;
            let act = match cfg.spec().ffn_activation {
                FfnActivation::Silu => 0,
                FfnActivation::Gelu => 1,
            };
            self.elementwise("gated", Kind::Gated, &up, &gate, cfg.ffn, act, 0.0);
            self.matmul(&w.w_down, &gate, &proj)?;
            if let Some(norm) = &w.ffn_post_norm {
                self.norm_in_place(&proj, norm, cfg.hidden, 1, Groups::PerToken(1));
            }
            self.elementwise("add", Kind::Add, &proj, &x, cfg.hidden, 0, 0.0);
        }
        self.logits()?;
        Ok(self.ops)
    }

    fn uniform(&self, words: &[u32]) -> wgpu::Buffer {
        self.gpu.device.uniform_words("params", words)
    }

    fn embed(&mut self) {
        let gpu = self.gpu;
        let m = &gpu.weights.token_embd;
        let scale = gpu.model.config.embedding_scale.unwrap_or(1.0);
        let pipeline = &gpu.kernels.embed[&m.ty];
        for part in &m.parts {
            let prm = self.uniform(&[
                part.rows as u32,
                part.first_row as u32,
                m.cols as u32,
                m.row_bytes as u32,
                scale.to_bits(),
                0,
                0,
                0,
            ]);
            let groups = Groups::PerToken((m.cols as u32 / 32).div_ceil(64));
            let bound = Bound::new(
                &gpu.device,
                "embed",
                pipeline,
                &[
                    (0, &prm),
                    (1, &part.buffer),
                    (2, &self.b.tokens),
                    (3, &self.x),
                    (4, &self.b.step),
                ],
                groups,
            );
            self.ops.push(Op::Kernel(bound));
        }
    }

    fn matmul(
        &mut self,
        m: &DeviceMatrix,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) -> Result<(), GpuError> {
        let call = self.gpu.kernels.matmul.bind(
            &self.gpu.device,
            m,
            x,
            m.cols,
            out,
            m.rows,
            0,
            &self.b.step,
        )?;
        self.ops.push(Op::Matmul(call));
        Ok(())
    }

    fn norm_to(
        &mut self,
        src: &wgpu::Buffer,
        weight: &wgpu::Buffer,
        dst: &wgpu::Buffer,
        width: usize,
    ) {
        let eps = self.gpu.model.config.rms_eps;
        let prm = self.uniform(&[width as u32, 1, width as u32, eps.to_bits()]);
        let bound = Bound::new(
            &self.gpu.device,
            "norm",
            &self.gpu.kernels.norm_to,
            &[(0, &prm), (1, src), (2, weight), (3, dst)],
            Groups::PerToken(1),
        );
        self.ops.push(Op::Kernel(bound));
    }

    fn norm_in_place(
        &mut self,
        x: &wgpu::Buffer,
        weight: &wgpu::Buffer,
        width: usize,
        rows_per_token: usize,
        groups: Groups,
    ) {
        let eps = self.gpu.model.config.rms_eps;
        let prm = self.uniform(&[
            width as u32,
            rows_per_token as u32,
            (width * rows_per_token) as u32,
            eps.to_bits(),
        ]);
        let bound = Bound::new(
            &self.gpu.device,
            "norm in place",
            &self.gpu.kernels.norm_in_place,
            &[(0, &prm), (2, weight), (3, x)],
            groups,
        );
        self.ops.push(Op::Kernel(bound));
    }

    fn norm_heads(&mut self, x: &wgpu::Buffer, weight: &wgpu::Buffer, heads: usize) {
        let hd = self.gpu.model.config.head_dim;
        self.norm_in_place(x, weight, hd, heads, Groups::PerToken(heads as u32));
    }

    fn rope(&mut self, x: &wgpu::Buffer, heads: usize, sliding: bool) {
        let cfg = &self.gpu.model.config;
        let neox = matches!(cfg.rope_layout(), RopeLayout::Neox);
        let prm = self.uniform(&[
            heads as u32,
            cfg.head_dim as u32,
            cfg.rope_dims as u32,
            u32::from(neox),
        ]);
        let table = if sliding {
            &self.b.rope_sliding
        } else {
            &self.b.rope
        };
        let pairs = (heads * cfg.rope_dims / 2) as u32;
        let bound = Bound::new(
            &self.gpu.device,
            "rope",
            &self.gpu.kernels.rope,
            &[(0, &prm), (1, table), (2, x), (3, &self.b.step)],
            Groups::PerToken(pairs.div_ceil(64)),
        );
        self.ops.push(Op::Kernel(bound));
    }

    #[allow(clippy::too_many_arguments)]
    fn elementwise(
        &mut self,
        label: &str,
        kind: Kind,
        y: &wgpu::Buffer,
        x: &wgpu::Buffer,
        width: usize,
        flag: u32,
        scalar: f32,
    ) {
        let k = &self.gpu.kernels;
        let prm = self.uniform(&[width as u32, width as u32, flag, scalar.to_bits()]);
        let groups_x = (width as u32).div_ceil(64);
        let d = &self.gpu.device;
        let step = &self.b.step;
        let bound = match kind {
            Kind::Add | Kind::Bias | Kind::Gated => {
                let pipeline = match kind {
                    Kind::Add => &k.add,
                    Kind::Bias => &k.add_bias,
                    _ => &k.gated,
                };
                Bound::new(
                    d,
                    label,
                    pipeline,
                    &[(0, &prm), (1, y), (2, x), (3, step)],
                    Groups::PerToken(groups_x),
                )
            }
            Kind::Softcap => Bound::new(
                d,
                label,
                &k.softcap,
                &[(0, &prm), (2, x), (3, step)],
                Groups::PerRow(groups_x),
            ),
            Kind::Gather => Bound::new(
                d,
                label,
                &k.gather,
                &[(0, &prm), (1, y), (2, x), (3, step), (4, &self.b.rows)],
                Groups::PerRow(groups_x),
            ),
        };
        self.ops.push(Op::Kernel(bound));
    }

    fn attention(&mut self, layer: usize, window: Option<usize>) {
        let cfg = &self.gpu.model.config;
        let k = &self.gpu.kernels;
        let d = &self.gpu.device;
        let scale = match cfg.query_scale {
            Some(s) => s,
            None => 1.0 / (cfg.head_dim as f32).sqrt(),
        };
        let prm = self.uniform(&[
            cfg.n_heads as u32,
            cfg.n_kv_heads as u32,
            cfg.head_dim as u32,
            cfg.kv_dim() as u32,
            self.kv.page_positions as u32,
            self.kv.page_words as u32,
            layer as u32,
            window.unwrap_or(0) as u32,
            scale.to_bits(),
            0,
            0,
            0,
        ]);
        let b = self.b;
        let common = [
            (0, &prm),
            (1, &b.step),
            (2, &b.tokens),
            (3, &b.seqs),
            (4, &b.pages),
            (5, &self.kv.buffer),
        ];
        let heads = cfg.n_heads as u32;
        let mut write = common.to_vec();
        write.extend([(6, &self.k), (7, &self.v)]);
        let kv_pairs = (cfg.kv_dim() as u32 / 2).div_ceil(64);
        self.ops.push(Op::Kernel(Bound::new(
            d,
            "kv write",
            &k.kv_write,
            &write,
            Groups::PerToken(kv_pairs),
        )));
        let mut scores = common.to_vec();
        scores.extend([(8, &self.q), (9, &self.scores)]);
        self.ops.push(Op::Kernel(Bound::new(
            d,
            "attention scores",
            &k.attn_scores,
            &scores,
            Groups::Keys(heads),
        )));
        let softmax = [(0, &prm), (1, &b.step), (2, &b.tokens), (9, &self.scores)];
        self.ops.push(Op::Kernel(Bound::new(
            d,
            "attention softmax",
            &k.attn_softmax,
            &softmax,
            Groups::PerToken(heads),
        )));
        let mut values = common.to_vec();
        values.extend([(9, &self.scores), (10, &self.att)]);
        let dim_pairs = (cfg.head_dim as u32 / 2).div_ceil(64);
        self.ops.push(Op::Kernel(Bound::new(
            d,
            "attention values",
            &k.attn_values,
            &values,
            Groups::PerTokenZ(dim_pairs, heads),
        )));
    }

    fn logits(&mut self) -> Result<(), GpuError> {
        let gpu = self.gpu;
        let cfg = &gpu.model.config;
        let (x, selected) = (self.x.clone(), self.selected.clone());
        self.elementwise("gather", Kind::Gather, &x, &selected, cfg.hidden, 0, 0.0);
        self.norm_in_place(
            &selected,
            &gpu.weights.output_norm,
            cfg.hidden,
            1,
            Groups::PerRow(1),
        );
        let m = gpu.weights.output();
        let call = gpu.kernels.matmul.bind(
            &gpu.device,
            m,
            &selected,
            m.cols,
            &self.b.logits,
            m.rows,
            0,
            &self.b.rows_step,
        )?;
        self.ops.push(Op::Logits(call));
        if let Some(cap) = cfg.logit_softcap {
            let logits = self.b.logits.clone();
            self.elementwise(
                "softcap",
                Kind::Softcap,
                &logits,
                &logits,
                cfg.vocab,
                0,
                cap,
            );
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Add,
    Bias,
    Gated,
    Softcap,
    Gather,
}
