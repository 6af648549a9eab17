//! The matrix kernels' host side: one pipeline per weight format, and a
//! prepared call per (matrix, input, output) whose bind groups are made
//! once, so a step only records dispatches.

use std::collections::HashMap;

use super::{DeviceMatrix, GpuDevice, GpuError};
use crate::quant::GgmlType;

const QUANTS: &str = include_str!("shaders/quants.wgsl");
const MATMUL: &str = include_str!("shaders/matmul.wgsl");
/// Rows one workgroup takes (as in the shader).
const TILE_ROWS: u32 = 2;
/// Tokens one workgroup takes in a decode step, and in a prompt chunk of
/// at least `WIDE_TOKENS` tokens (same bits, see `shaders/matmul.wgsl`).
const TILE_TOKENS: u32 = 8;
const WIDE_TOKENS: u32 = 32;

/// The `dequant_*` function of a weight format, if the kernels read it.
pub(super) fn dequant_function(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "dequant_f32",
        GgmlType::F16 => "dequant_f16",
        GgmlType::BF16 => "dequant_bf16",
        GgmlType::Q4_0 => "dequant_q4_0",
        GgmlType::Q4_1 => "dequant_q4_1",
        GgmlType::Q5_0 => "dequant_q5_0",
        GgmlType::Q5_1 => "dequant_q5_1",
        GgmlType::Q8_0 => "dequant_q8_0",
        GgmlType::IQ4_NL => "dequant_iq4_nl",
        GgmlType::Q2_K => "dequant_q2_k",
        GgmlType::Q3_K => "dequant_q3_k",
        GgmlType::Q4_K => "dequant_q4_k",
        GgmlType::Q5_K => "dequant_q5_k",
        GgmlType::Q6_K => "dequant_q6_k",
        GgmlType::IQ4_XS => "dequant_iq4_xs",
        GgmlType::Q8_1 | GgmlType::Q8_K => return None,
    })
}

/// Whether the GPU kernels multiply weights of this format.
pub fn supports(ty: GgmlType) -> bool {
    dequant_function(ty).is_some()
}

/// The matrix pipelines of one device per weight format asked for: the
/// decode tile, and the wide one when the adapter has the workgroup
/// memory for it.
pub struct MatmulKernels {
    layout: wgpu::BindGroupLayout,
    pipelines: HashMap<GgmlType, (wgpu::ComputePipeline, Option<wgpu::ComputePipeline>)>,
}

/// A lane's number with subgroups: subgroup by subgroup, so that lanes
/// `l` and `l + s` share a subgroup whenever `l + s` is below its size.
const SUBGROUP_LANES: &str = "@builtin(subgroup_id) sg_id: u32, \
     @builtin(subgroup_invocation_id) sg_lane: u32, @builtin(subgroup_size) sg_size: u32";

/// The kernel's source for tiles of `tokens` tokens over `ty` weights,
/// with the tree's lowest levels as shuffles in subgroups of at least
/// `subgroups` lanes where the device has them.
fn source(function: &str, tokens: u32, subgroups: Option<u32>) -> String {
    // wgpu's shader compiler takes subgroup functions on a device opened
    // with the feature, without an `enable` directive (it refuses one).
    let (shuffle_below, builtins, lane, shuffle) = match subgroups {
        Some(min) => (
            min,
            SUBGROUP_LANES,
            "sg_id * sg_size + sg_lane;",
            "subgroupShuffleDown(v, s)",
        ),
        None => (
            1,
            "@builtin(local_invocation_index) local_lane: u32",
            "local_lane;",
            "v",
        ),
    };
    let body = MATMUL
        .replace("DEQUANT", function)
        .replace("LANE_BUILTINS", builtins)
        .replace("LANE;", lane)
        .replace("SHUFFLE(v, s)", shuffle);
    format!(
        "const TILE_TOKENS: u32 = {tokens}u;\nconst SHUFFLE_BELOW: u32 = {shuffle_below}u;\n\
         {QUANTS}\n{body}"
    )
}

impl MatmulKernels {
    /// Compiles the kernel for each of `types`.
    pub fn new(device: &GpuDevice, types: &[GgmlType]) -> Result<Self, GpuError> {
        let layout = device
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("matmul bindings"),
                entries: &[
                    uniform_entry(0),
                    storage_entry(1, true),
                    storage_entry(2, true),
                    storage_entry(3, false),
                    uniform_entry(4),
                ],
            });
        let pipeline_layout =
            device
                .device
                .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some("matmul"),
                    bind_group_layouts: &[Some(&layout)],
                    immediate_size: 0,
                });
        // The tree's partial sums: 2 rows x tokens x 64 lanes of f32.
        let wide_fits = u64::from(device.limits().max_compute_workgroup_storage_size)
            >= u64::from(TILE_ROWS * WIDE_TOKENS * 64 * 4);
        let mut pipelines = HashMap::new();
        for &ty in types {
            if pipelines.contains_key(&ty) {
                continue;
            }
            let function = dequant_function(ty).ok_or(GpuError::UnsupportedType { ty })?;
            let label = format!("matmul {ty}");
            let narrow = device.pipeline(
                &label,
                &source(function, TILE_TOKENS, device.subgroups()),
                "matmul",
                &pipeline_layout,
            )?;
            let wide = if wide_fits {
                let label = format!("wide matmul {ty}");
                let wide = source(function, WIDE_TOKENS, device.subgroups());
                Some(device.pipeline(&label, &wide, "matmul", &pipeline_layout)?)
            } else {
                None
            };
            pipelines.insert(ty, (narrow, wide));
        }
        Ok(Self { layout, pipelines })
    }

    /// Binds `m` to its input and output: `x` holds `[tokens][x_stride]`
    /// f32 activations (the first `m.cols` of each row are read), `out`
    /// receives `[tokens][out_stride]` with row `r` of `m` at column
    /// `out_offset + r`. `step` is the 16-byte uniform whose first word is
    /// the step's token count.
    #[allow(clippy::too_many_arguments)]
    pub fn bind(
        &self,
        device: &GpuDevice,
        m: &DeviceMatrix,
        x: &wgpu::Buffer,
        x_stride: usize,
        out: &wgpu::Buffer,
        out_stride: usize,
        out_offset: usize,
        step: &wgpu::Buffer,
    ) -> Result<MatmulCall, GpuError> {
        let (pipeline, wide) = self
            .pipelines
            .get(&m.ty)
            .ok_or(GpuError::UnsupportedType { ty: m.ty })?
            .clone();
        let max_groups = device.limits().max_compute_workgroups_per_dimension;
        let mut parts = Vec::with_capacity(m.parts.len());
        for part in &m.parts {
            let groups = (part.rows as u32).div_ceil(TILE_ROWS);
            let groups_x = groups.min(max_groups);
            let groups_y = groups.div_ceil(groups_x.max(1));
            let words: [u32; 8] = [
                part.rows as u32,
                m.cols as u32,
                m.row_bytes as u32,
                x_stride as u32,
                out_stride as u32,
                (out_offset + part.first_row) as u32,
                groups_x,
                0,
            ];
            let uniform = device.uniform_words("matmul part", &words);
            let bind_group = device.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(&m.name),
                layout: &self.layout,
                entries: &[
                    buffer_entry(0, &uniform),
                    buffer_entry(1, &part.buffer),
                    buffer_entry(2, x),
                    buffer_entry(3, out),
                    buffer_entry(4, step),
                ],
            });
            parts.push(BoundPart {
                bind_group,
                groups: (groups_x, groups_y),
                _uniform: uniform,
            });
        }
        Ok(MatmulCall {
            pipeline,
            wide,
            parts,
        })
    }
}

/// One matrix bound to its buffers; see [`MatmulKernels::bind`].
pub struct MatmulCall {
    pipeline: wgpu::ComputePipeline,
    wide: Option<wgpu::ComputePipeline>,
    parts: Vec<BoundPart>,
}

struct BoundPart {
    bind_group: wgpu::BindGroup,
    groups: (u32, u32),
    _uniform: wgpu::Buffer,
}

impl MatmulCall {
    /// Records the multiply of `n_tokens` tokens (the number the step
    /// uniform holds) into `pass`.
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>, n_tokens: usize) {
        if n_tokens == 0 {
            return;
        }
        let (pipeline, tile) = match &self.wide {
            Some(wide) if n_tokens as u32 >= WIDE_TOKENS => (wide, WIDE_TOKENS),
            _ => (&self.pipeline, TILE_TOKENS),
        };
        pass.set_pipeline(pipeline);
        let z = (n_tokens as u32).div_ceil(tile);
        for part in &self.parts {
            pass.set_bind_group(0, &part.bind_group, &[]);
            pass.dispatch_workgroups(part.groups.0, part.groups.1, z);
        }
    }
}

fn uniform_entry(binding: u32) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Uniform,
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}

fn storage_entry(binding: u32, read_only: bool) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}

fn buffer_entry(binding: u32, buffer: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: buffer.as_entire_binding(),
    }
}
