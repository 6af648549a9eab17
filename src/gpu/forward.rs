//! One worker's forward pass on the device: buffers sized once, every
//! kernel bound once, and a step that uploads the tokens, positions, page
//! tables and RoPE tables, records all layers into one compute pass,
//! submits once and reads back only the logit rows asked for. A feed may
//! keep its last row on the device instead, in a row of the kept-logits
//! buffer that a sampler on the same device reads; such a step is not
//! submitted here but goes out with the sampler's dispatch.

use std::sync::Arc;

use super::kernels::Kernels;
use super::record::{Buffers, Op, Recorder};
use super::weights::GpuWeights;
use super::{GpuDevice, GpuError};
use crate::kv::SessionKv;
use crate::model::{LogitRows, LogitsWanted, Model};

/// The model on one device, shared by every worker's [`GpuForward`].
pub struct GpuModel {
    pub device: Arc<GpuDevice>,
    pub model: Arc<Model>,
    pub weights: GpuWeights,
    pub kernels: Kernels,
    /// Rows of logits read back to the host so far, by every worker.
    pub logit_rows_read: std::sync::atomic::AtomicU64,
}

impl GpuModel {
    /// Uploads `model`'s weights to `device` and builds its kernels.
    pub fn new(device: Arc<GpuDevice>, model: Arc<Model>) -> Result<Arc<Self>, GpuError> {
        let n_layers = model.config.n_layers;
        Self::new_part(device, model, 0..n_layers, true)
    }

    /// Layers `layers` of `model` on `device` (a shard's), with the
    /// embedding and the output when `ends`.
    pub fn new_part(
        device: Arc<GpuDevice>,
        model: Arc<Model>,
        layers: std::ops::Range<usize>,
        ends: bool,
    ) -> Result<Arc<Self>, GpuError> {
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
        let weights = device.allocating("the model's weights", || {
            GpuWeights::upload_part(&device, &model, layers, ends)
        })??;
        let embed_type = weights.ends.as_ref().map(|e| e.token_embd.ty);
        let kernels = Kernels::new(&device, &weights.matrix_types(), embed_type)?;
        Ok(Arc::new(Self {
            device,
            model,
            weights,
            kernels,
            logit_rows_read: Default::default(),
        }))
    }
}

/// The KV pages on the device: page `p` is page `p % pages_per_buffer`
/// of buffer `p / pages_per_buffer`, words `q * page_words .. (q + 1) *
/// page_words` there for page `q` of a buffer, laid out as the host pool's
/// page `p`. Every attention kernel binds all the buffers (those past the
/// pages' are placeholders), so the cache is not bounded by one binding.
pub struct DeviceKv {
    pub buffers: Vec<wgpu::Buffer>,
    pub pages_per_buffer: usize,
    /// K and V bytes of a page, its padding excluded.
    pub page_values_bytes: usize,
    pub page_words: usize,
    pub page_positions: usize,
    pub n_pages: usize,
}

impl DeviceKv {
    /// Zeroed buffers for `n_pages` pages of `layout`, each as long as the
    /// host pool's page stride, as many in each buffer as one binding holds.
    pub fn new(
        device: &GpuDevice,
        layout: &crate::kv::KvLayout,
        n_pages: usize,
    ) -> Result<Self, GpuError> {
        let per_buffer = (device.max_binding_bytes() / layout.page_stride() as u64) as usize;
        Self::with_buffer_pages(device, layout, n_pages, per_buffer)
    }

    /// As [`DeviceKv::new`], with at most `pages_per_buffer` pages in a
    /// buffer (tests spread a small cache over every buffer this way).
    pub fn with_buffer_pages(
        device: &GpuDevice,
        layout: &crate::kv::KvLayout,
        n_pages: usize,
        pages_per_buffer: usize,
    ) -> Result<Self, GpuError> {
        let page_bytes = layout.page_stride();
        let fit = (device.max_binding_bytes() / page_bytes as u64) as usize;
        let per_buffer = pages_per_buffer.min(fit).min(n_pages).max(1);
        let bindings = device.kv_bindings();
        let used = n_pages.div_ceil(per_buffer);
        if used > bindings || fit == 0 {
            return Err(GpuError::TooLarge {
                what: format!(
                    "a KV cache of {n_pages} pages of {page_bytes} bytes in {bindings} bindings"
                ),
                limit: device.max_binding_bytes(),
            });
        }
        let bytes = (n_pages as u64) * page_bytes as u64;
        let what = format!("a KV cache of {n_pages} pages ({} MiB)", bytes >> 20);
        let buffers = device.allocating(&what, || {
            (0..bindings)
                .map(|i| {
                    let pages = n_pages.saturating_sub(i * per_buffer).min(per_buffer);
                    device.storage("kv pages", (pages as u64 * page_bytes as u64).max(16))
                })
                .collect()
        })?;
        Ok(Self {
            buffers,
            pages_per_buffer: per_buffer,
            page_values_bytes: layout.page_values() * 2,
            page_words: page_bytes / 4,
            page_positions: layout.page_positions,
            n_pages,
        })
    }

    /// The buffer holding page `page`, and the page's byte offset there.
    pub fn locate(&self, page: u32) -> (&wgpu::Buffer, u64) {
        let page = page as usize;
        let buffer = &self.buffers[page / self.pages_per_buffer];
        let offset = (page % self.pages_per_buffer) as u64 * self.page_words as u64 * 4;
        (buffer, offset)
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
    /// Rows of logits kept on the device between steps (fewer when the
    /// adapter cannot bind that many).
    pub kept_rows: usize,
}

impl Default for StepCapacity {
    fn default() -> Self {
        Self {
            tokens: 512,
            rows: 64,
            sequences: 64,
            scores: 16 << 20,
            kept_rows: 128,
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

/// One sequence's share of a shard's step: `rows` hidden states after
/// its KV's positions (reserved, not yet committed).
pub struct GpuLayerFeed<'a> {
    pub kv: &'a mut SessionKv,
    pub rows: usize,
}

/// One sequence's share of a step.
pub struct GpuFeed<'a> {
    pub kv: &'a mut SessionKv,
    pub tokens: &'a [u32],
    pub logits: LogitsWanted,
    /// With [`LogitsWanted::Last`]: the row of the kept-logits buffer the
    /// last row goes to, instead of coming back.
    pub keep: Option<u32>,
}

impl GpuFeed<'_> {
    /// The row the step keeps on the device, if any.
    fn kept_row(&self) -> Option<u32> {
        self.keep.filter(|_| self.logits == LogitsWanted::Last)
    }

    /// The rows that come back to the host.
    fn host_rows(&self) -> std::ops::Range<usize> {
        if self.kept_row().is_some() {
            0..0
        } else {
            self.logits.rows(self.tokens.len())
        }
    }
}

/// One worker's forward pass; see the module docs.
pub struct GpuForward {
    gpu: Arc<GpuModel>,
    capacity: StepCapacity,
    pages_capacity: usize,
    buffers: Buffers,
    ops: Vec<Op>,
    /// The residual stream, and (for a shard) the buffer it is read back in.
    x: wgpu::Buffer,
    x_readback: Option<wgpu::Buffer>,
    kept: wgpu::Buffer,
    kept_rows: usize,
    /// Where each row of this span goes: a kept row, or the next host row.
    row_targets: Vec<Option<u32>>,
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
        let kv_layers = gpu.weights.layers.len();
        let pages_capacity = (capacity.sequences * kv_layers * blocks).min(1 << 24);
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
        let (ops, x) = Recorder::new(&gpu, &buffers, kv, capacity).ops()?;
        let x_readback = gpu.weights.ends.is_none().then(|| {
            device.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("hidden readback"),
                size: (t * cfg.hidden * 4) as u64,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        let row_bytes = (cfg.vocab * 4) as u64;
        let kept_rows = capacity
            .kept_rows
            .min((device.max_binding_bytes() / row_bytes) as usize)
            .max(1);
        let kept = device.storage("kept logits", kept_rows as u64 * row_bytes);
        Ok(Self {
            gpu,
            capacity,
            pages_capacity,
            buffers,
            ops,
            x,
            x_readback,
            kept,
            kept_rows,
            row_targets: Vec::new(),
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

    /// Rows of logits read back to the host so far, by every worker.
    pub fn logit_rows_read(&self) -> u64 {
        self.gpu
            .logit_rows_read
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn count_rows_read(&self, rows: u64) {
        self.gpu
            .logit_rows_read
            .fetch_add(rows, std::sync::atomic::Ordering::Relaxed);
    }

    /// The kept-logits buffer and how many rows it holds.
    pub fn kept(&self) -> (&wgpu::Buffer, usize) {
        (&self.kept, self.kept_rows)
    }

    /// A copy of kept row `row`.
    pub fn read_kept(&self, row: u32) -> Result<Vec<f32>, GpuError> {
        let vocab = self.gpu.model.config.vocab;
        if row as usize >= self.kept_rows {
            return Err(GpuError::TooLarge {
                what: format!("kept logits row {row}"),
                limit: (self.kept_rows * vocab * 4) as u64,
            });
        }
        self.count_rows_read(1);
        let bytes =
            self.gpu
                .device
                .read_bytes(&self.kept, row as u64 * (vocab * 4) as u64, vocab * 4)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Runs the model on `feeds`: reserves their KV (all or nothing per
    /// feed), runs every layer on the device, commits the new lengths, and
    /// writes the logit rows asked for into `logits` (`[rows][vocab]`),
    /// but for the rows feeds keep on the device (those have none).
    pub fn forward(
        &mut self,
        feeds: &mut [GpuFeed<'_>],
        logits: &mut Vec<f32>,
    ) -> Result<LogitRows, ForwardError> {
        let model = Arc::clone(&self.gpu.model);
        if self.x_readback.is_some() {
            return Err(GpuError::BadMatrix {
                name: "output".into(),
                why: "a shard's layers have no embedding or output: use forward_layers".into(),
            }
            .into());
        }
        for f in feeds.iter() {
            model.check_append(f.kv.len(), f.tokens)?;
            if let Some(row) = f.kept_row().filter(|&r| r as usize >= self.kept_rows) {
                return Err(GpuError::TooLarge {
                    what: format!("kept logits row {row}"),
                    limit: (self.kept_rows * model.config.vocab * 4) as u64,
                }
                .into());
            }
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
            let n = f.host_rows().len();
            per_sequence.push(row..row + n);
            row += n;
        }
        logits.reserve(row * vocab);
        for span in self.spans(feeds) {
            self.run_span(feeds, &span, logits, None)?;
        }
        for f in feeds.iter_mut() {
            let new_len = f.kv.len() + f.tokens.len();
            f.kv.commit(new_len)?;
        }
        Ok(LogitRows { per_sequence })
    }

    /// A shard's step: runs its layers over `x` (`[rows][hidden]`, every
    /// feed's rows in order), writing the K and V of each feed's rows after
    /// its KV's positions (reserved by the caller, who commits them once
    /// the step is in), and leaves the layers' output in `x`.
    pub fn forward_layers(
        &mut self,
        feeds: &mut [GpuLayerFeed<'_>],
        x: &mut [f32],
    ) -> Result<(), ForwardError> {
        let model = Arc::clone(&self.gpu.model);
        let hidden = model.config.hidden;
        let total: usize = feeds.iter().map(|f| f.rows).sum();
        if self.x_readback.is_none() || x.len() != total * hidden {
            return Err(GpuError::BadMatrix {
                name: "hidden states".into(),
                why: format!(
                    "{} values for {total} rows of {hidden} on {}",
                    x.len(),
                    if self.x_readback.is_none() {
                        "a whole model"
                    } else {
                        "a shard"
                    }
                ),
            }
            .into());
        }
        // The kernels read token ids only to embed them: a shard has none.
        let zeros = vec![0u32; feeds.iter().map(|f| f.rows).max().unwrap_or(0)];
        let as_feeds: Vec<GpuFeed<'_>> = feeds
            .iter_mut()
            .map(|f| GpuFeed {
                kv: &mut *f.kv,
                tokens: &zeros[..f.rows],
                logits: LogitsWanted::None,
                keep: None,
            })
            .collect();
        for f in as_feeds.iter() {
            model.check_append(f.kv.len(), f.tokens)?;
        }
        let mut unused = Vec::new();
        let mut done = 0usize;
        for span in self.spans(&as_feeds) {
            let n: usize = span.parts.iter().map(|&(_, _, n)| n).sum();
            let rows = &mut x[done * hidden..(done + n) * hidden];
            self.run_span(&as_feeds, &span, &mut unused, Some(rows))?;
            done += n;
        }
        Ok(())
    }

    /// Splits the feeds' tokens into sub-steps that fit the buffers.
    fn spans(&self, feeds: &[GpuFeed<'_>]) -> Vec<Span> {
        let cfg = &self.gpu.model.config;
        let kv_layers = self.gpu.weights.layers.len();
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
                let seq_pages = kv_layers * blocks_per_seq(f);
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

    /// Uploads and runs one sub-step, appending its logit rows; a shard's
    /// sub-step reads its rows of hidden states from `hidden` and leaves
    /// its layers' output there.
    fn run_span(
        &mut self,
        feeds: &[GpuFeed<'_>],
        span: &Span,
        logits: &mut Vec<f32>,
        hidden: Option<&mut [f32]>,
    ) -> Result<(), GpuError> {
        let model = Arc::clone(&self.gpu.model);
        let cfg = &model.config;
        let n_layers = self.gpu.weights.layers.len();
        self.token_words.clear();
        self.seq_words.clear();
        self.page_words.clear();
        self.row_words.clear();
        self.row_targets.clear();
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
                // A block a window layer gave back is never read.
                self.page_words
                    .extend((0..blocks).map(|b| f.kv.block_page(b, layer).unwrap_or(u32::MAX)));
            }
            let wanted = f.logits.rows(f.tokens.len());
            let kept = f.kept_row();
            for j in start..start + n {
                let t = self.token_words.len() / 4;
                let pos = base + j;
                self.token_words
                    .extend([f.tokens[j], pos as u32, s as u32, 0]);
                self.token_seq.push((s, pos));
                if wanted.contains(&j) {
                    self.row_words.push(t as u32);
                    self.row_targets.push(kept);
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
        // The last step may still be deferred, reading these buffers.
        device.flush();
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
        if let Some(rows) = &hidden {
            queue.write_buffer(&self.x, 0, bytemuck::cast_slice(rows));
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
        let row_bytes = (cfg.vocab * 4) as u64;
        let mut host_rows = 0u64;
        for (r, target) in self.row_targets.iter().enumerate() {
            let (to, at) = match target {
                Some(kept) => (&self.kept, *kept as u64),
                None => {
                    host_rows += 1;
                    (&b.readback, host_rows - 1)
                }
            };
            encoder.copy_buffer_to_buffer(
                &b.logits,
                r as u64 * row_bytes,
                to,
                at * row_bytes,
                row_bytes,
            );
        }
        let hidden_readback = match (&hidden, &self.x_readback) {
            (Some(rows), Some(readback)) => {
                let bytes = (rows.len() * 4) as u64;
                encoder.copy_buffer_to_buffer(&self.x, 0, readback, 0, bytes);
                Some((readback, bytes))
            }
            _ => None,
        };
        if host_rows == 0 && hidden_readback.is_none() {
            // Nothing to wait for here: kept rows go out with the sampler's
            // dispatch (one submission for the step); a step without rows
            // goes now, and whoever next reads what it wrote waits for it.
            if self.row_targets.iter().any(Option::is_some) {
                device.defer(encoder);
            } else {
                device.submit_after_pending(encoder.finish());
            }
            return Ok(());
        }
        device.submit(encoder)?;
        if let (Some(rows), Some((readback, bytes))) = (hidden, hidden_readback) {
            rows.copy_from_slice(&device.map_read(readback, bytes)?);
        }
        if host_rows > 0 {
            self.count_rows_read(host_rows);
            let values = device.map_read(&b.readback, host_rows * row_bytes)?;
            logits.extend_from_slice(&values);
        }
        Ok(())
    }
}
