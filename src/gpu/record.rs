//! The operations of a step, bound once: for every layer the kernels in
//! order with their buffers, so that a step only records dispatches.

use super::forward::{DeviceKv, GpuModel, StepCapacity};
use super::kernels::{kv_binding, Bound, Groups};
use super::{DeviceMatrix, GpuError, MatmulCall};
use crate::model::{FfnActivation, RopeLayout};

/// One recorded operation.
pub(super) enum Op {
    Kernel(Bound),
    Matmul(MatmulCall),
    /// The output projection: its token count is the step's logit rows.
    Logits(MatmulCall),
}

/// The step's buffers.
pub(super) struct Buffers {
    pub(super) step: wgpu::Buffer,
    pub(super) rows_step: wgpu::Buffer,
    pub(super) tokens: wgpu::Buffer,
    pub(super) seqs: wgpu::Buffer,
    pub(super) pages: wgpu::Buffer,
    pub(super) rope: wgpu::Buffer,
    pub(super) rope_sliding: wgpu::Buffer,
    pub(super) rows: wgpu::Buffer,
    pub(super) logits: wgpu::Buffer,
    pub(super) readback: wgpu::Buffer,
}

/// Builds the list of bound operations of a step.
pub(super) struct Recorder<'a> {
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
    pub(super) fn new(
        gpu: &'a GpuModel,
        b: &'a Buffers,
        kv: &'a DeviceKv,
        capacity: StepCapacity,
    ) -> Self {
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

    /// The operations, and the buffer of the residual stream (`[tokens]
    /// [hidden]`: what a shard's layers read and write).
    pub(super) fn ops(mut self) -> Result<(Vec<Op>, wgpu::Buffer), GpuError> {
        let gpu = self.gpu;
        let cfg = &gpu.model.config;
        if gpu.weights.ends.is_some() {
            self.embed();
        }
        for (kv_layer, w) in gpu.weights.layers.iter().enumerate() {
            let l = gpu.weights.first_layer + kv_layer;
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
            self.attention(kv_layer, window);
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
        if gpu.weights.ends.is_some() {
            self.logits()?;
        }
        Ok((self.ops, self.x))
    }

    fn uniform(&self, words: &[u32]) -> wgpu::Buffer {
        self.gpu.device.uniform_words("params", words)
    }

    fn embed(&mut self) {
        let gpu = self.gpu;
        let Some(ends) = &gpu.weights.ends else {
            return;
        };
        let m = &ends.token_embd;
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

    /// Attention of the layer at `kv_layer` among the KV's (and the page
    /// tables') layers.
    fn attention(&mut self, kv_layer: usize, window: Option<usize>) {
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
            kv_layer as u32,
            window.unwrap_or(0) as u32,
            scale.to_bits(),
            self.kv.pages_per_buffer as u32,
            0,
            0,
        ]);
        let b = self.b;
        let mut common = vec![
            (0, &prm),
            (1, &b.step),
            (2, &b.tokens),
            (3, &b.seqs),
            (4, &b.pages),
        ];
        common.extend(
            self.kv
                .buffers
                .iter()
                .enumerate()
                .map(|(i, buffer)| (kv_binding(i), buffer)),
        );
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
        let Some(ends) = &gpu.weights.ends else {
            return Ok(());
        };
        let (x, selected) = (self.x.clone(), self.selected.clone());
        self.elementwise("gather", Kind::Gather, &x, &selected, cfg.hidden, 0, 0.0);
        self.norm_in_place(
            &selected,
            &ends.output_norm,
            cfg.hidden,
            1,
            Groups::PerRow(1),
        );
        let m = ends.output();
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
