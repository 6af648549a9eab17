//! Every compute pipeline of the forward pass, built once per device: the
//! matrix kernels per weight format, the embedding lookup per table
//! format, and the format-free steps (norms, RoPE, KV, attention, ...).

use std::collections::HashMap;

use super::matmul::dequant_function;
use super::{GpuDevice, GpuError, MatmulKernels};
use crate::quant::GgmlType;

const QUANTS: &str = include_str!("shaders/quants.wgsl");
const EMBED: &str = include_str!("shaders/embed.wgsl");
const NORM: &str = include_str!("shaders/norm.wgsl");
const ROPE: &str = include_str!("shaders/rope.wgsl");
const ELEMENTWISE: &str = include_str!("shaders/elementwise.wgsl");
const ATTENTION: &str = include_str!("shaders/attention.wgsl");

/// The pipelines; each bind group is made against its own pipeline's layout.
pub struct Kernels {
    pub matmul: MatmulKernels,
    pub embed: HashMap<GgmlType, wgpu::ComputePipeline>,
    pub norm_to: wgpu::ComputePipeline,
    pub norm_in_place: wgpu::ComputePipeline,
    pub rope: wgpu::ComputePipeline,
    pub add: wgpu::ComputePipeline,
    pub add_bias: wgpu::ComputePipeline,
    pub gated: wgpu::ComputePipeline,
    pub softcap: wgpu::ComputePipeline,
    pub gather: wgpu::ComputePipeline,
    pub kv_write: wgpu::ComputePipeline,
    pub attn_scores: wgpu::ComputePipeline,
    pub attn_softmax: wgpu::ComputePipeline,
    pub attn_values: wgpu::ComputePipeline,
}

impl Kernels {
    /// Builds the kernels for matrices of `matrix_types` and an embedding
    /// table of `embed_type` (none: a shard's layers only).
    pub fn new(
        device: &GpuDevice,
        matrix_types: &[GgmlType],
        embed_type: Option<GgmlType>,
    ) -> Result<Self, GpuError> {
        let mut embed = HashMap::new();
        if let Some(embed_type) = embed_type {
            let function =
                dequant_function(embed_type).ok_or(GpuError::UnsupportedType { ty: embed_type })?;
            let embed_source = format!("{QUANTS}\n{}", EMBED.replace("DEQUANT", function));
            let [embed_pipeline] = device.auto_pipelines("embed", &embed_source, ["embed"])?;
            embed.insert(embed_type, embed_pipeline);
        }
        let [norm_to, norm_in_place] =
            device.auto_pipelines("norm", NORM, ["norm_to", "norm_in_place"])?;
        let [rope] = device.auto_pipelines("rope", ROPE, ["rope"])?;
        let [add, add_bias, gated, softcap, gather] = device.auto_pipelines(
            "elementwise",
            ELEMENTWISE,
            ["add", "add_bias", "gated", "softcap", "gather"],
        )?;
        let [kv_write, attn_scores, attn_softmax, attn_values] = device.auto_pipelines(
            "attention",
            &attention_source(device.kv_bindings()),
            ["kv_write", "attn_scores", "attn_softmax", "attn_values"],
        )?;
        Ok(Self {
            matmul: MatmulKernels::new(device, matrix_types)?,
            embed,
            norm_to,
            norm_in_place,
            rope,
            add,
            add_bias,
            gated,
            softcap,
            gather,
            kv_write,
            attn_scores,
            attn_softmax,
            attn_values,
        })
    }
}

/// A pipeline bound to its buffers, with the workgroups it is dispatched
/// over (a `None` count is filled from the step's tokens at record time).
pub struct Bound {
    pipeline: wgpu::ComputePipeline,
    bind_group: wgpu::BindGroup,
    groups: Groups,
}

/// How a bound kernel's workgroups follow the step.
#[derive(Clone, Copy, Debug)]
pub enum Groups {
    /// (x, tokens, 1).
    PerToken(u32),
    /// (x, y, tokens).
    PerTokenZ(u32, u32),
    /// (x, logit rows, 1).
    PerRow(u32),
    /// (keys / 64, heads, tokens): attention scores.
    Keys(u32),
}

impl Bound {
    /// Binds `buffers` (binding number, buffer) to `pipeline`.
    pub fn new(
        device: &GpuDevice,
        label: &str,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer)],
        groups: Groups,
    ) -> Self {
        let layout = pipeline.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry<'_>> = buffers
            .iter()
            .map(|(binding, buffer)| wgpu::BindGroupEntry {
                binding: *binding,
                resource: buffer.as_entire_binding(),
            })
            .collect();
        let bind_group = device.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout: &layout,
            entries: &entries,
        });
        Self {
            pipeline: pipeline.clone(),
            bind_group,
            groups,
        }
    }

    /// Records the dispatch for a step of `tokens` tokens, `rows` logit
    /// rows and `keys` attention keys at most per token.
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, tokens: u32, rows: u32, keys: u32) {
        let (x, y, z) = match self.groups {
            Groups::PerToken(x) => (x, tokens, 1),
            Groups::PerTokenZ(x, y) => (x, y, tokens),
            Groups::PerRow(x) => (x, rows, 1),
            Groups::Keys(heads) => (keys.div_ceil(64), heads, tokens),
        };
        if x == 0 || y == 0 || z == 0 {
            return;
        }
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind_group, &[]);
        pass.dispatch_workgroups(x, y, z);
    }
}

/// The binding of KV buffer `i` in `shaders/attention.wgsl`.
pub(super) fn kv_binding(i: usize) -> u32 {
    if i == 0 {
        5
    } else {
        10 + i as u32
    }
}

/// The attention shader for `n` KV buffers: their declarations and the
/// `kv_load` / `kv_store` that pick one by a word's buffer index.
fn attention_source(n: usize) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    for i in 0..n {
        let _ = writeln!(
            s,
            "@group(0) @binding({}) var<storage, read_write> kv{i}: array<u32>;",
            kv_binding(i)
        );
    }
    s.push_str("fn kv_load(at: vec2<u32>) -> u32 {\n    switch at.x {\n");
    for i in 1..n {
        let _ = writeln!(s, "        case {i}u: {{ return kv{i}[at.y]; }}");
    }
    s.push_str("        default: { return kv0[at.y]; }\n    }\n}\n");
    s.push_str("fn kv_store(at: vec2<u32>, value: u32) {\n    switch at.x {\n");
    for i in 1..n {
        let _ = writeln!(s, "        case {i}u: {{ kv{i}[at.y] = value; }}");
    }
    s.push_str("        default: { kv0[at.y] = value; }\n    }\n}\n");
    s + ATTENTION
}
