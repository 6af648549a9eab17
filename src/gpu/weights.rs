//! The model's weights on the device: every matrix in its file format (no
//! dequantization at load), norm weights and biases as f32 buffers.

use super::{DeviceMatrix, GpuDevice, GpuError};
use crate::model::{Matrix, Model};

/// One transformer block's weights on the device.
pub struct GpuLayer {
    pub attn_norm: wgpu::Buffer,
    pub wq: DeviceMatrix,
    pub wk: DeviceMatrix,
    pub wv: DeviceMatrix,
    pub bq: Option<wgpu::Buffer>,
    pub bk: Option<wgpu::Buffer>,
    pub bv: Option<wgpu::Buffer>,
    pub q_norm: Option<wgpu::Buffer>,
    pub k_norm: Option<wgpu::Buffer>,
    pub wo: DeviceMatrix,
    pub attn_post_norm: Option<wgpu::Buffer>,
    pub ffn_norm: wgpu::Buffer,
    pub ffn_post_norm: Option<wgpu::Buffer>,
    pub w_gate: DeviceMatrix,
    pub w_up: DeviceMatrix,
    pub w_down: DeviceMatrix,
}

/// The model's weights on the device: every layer of a range, and the
/// embedding and output of a whole model (a shard has only its layers).
pub struct GpuWeights {
    /// The model's first layer here.
    pub first_layer: usize,
    pub layers: Vec<GpuLayer>,
    pub ends: Option<Ends>,
}

/// The embedding table and the output norm and projection.
pub struct Ends {
    pub token_embd: DeviceMatrix,
    pub output_norm: wgpu::Buffer,
    /// `None`: the output projection is the embedding table.
    pub output: Option<DeviceMatrix>,
}

impl Ends {
    /// The output projection.
    pub fn output(&self) -> &DeviceMatrix {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }
}

impl GpuWeights {
    /// Copies the whole model's weights to `device`.
    pub fn upload(device: &GpuDevice, model: &Model) -> Result<Self, GpuError> {
        Self::upload_part(device, model, 0..model.config.n_layers, true)
    }

    /// Copies layers `layers` to `device`, with the embedding and output
    /// when `ends`.
    pub fn upload_part(
        device: &GpuDevice,
        model: &Model,
        layers: std::ops::Range<usize>,
        ends: bool,
    ) -> Result<Self, GpuError> {
        let w = model.weights();
        let file = model.gguf();
        let matrix = |m: &Matrix| {
            DeviceMatrix::upload(
                device,
                &m.name,
                m.ty,
                m.rows,
                m.cols,
                file.tensor_bytes(&m.info),
            )
        };
        let vector = |v: &[f32]| device.storage_with("vector", bytemuck::cast_slice(v));
        let optional = |v: &Option<Vec<f32>>| v.as_deref().map(vector);
        let first_layer = layers.start;
        let range = w.layers.get(layers).ok_or_else(|| GpuError::BadMatrix {
            name: "layers".into(),
            why: format!("the model has {} layers", w.layers.len()),
        })?;
        let mut layers = Vec::with_capacity(range.len());
        for l in range {
            layers.push(GpuLayer {
                attn_norm: vector(&l.attn_norm),
                wq: matrix(&l.wq)?,
                wk: matrix(&l.wk)?,
                wv: matrix(&l.wv)?,
                bq: optional(&l.bq),
                bk: optional(&l.bk),
                bv: optional(&l.bv),
                q_norm: optional(&l.q_norm),
                k_norm: optional(&l.k_norm),
                wo: matrix(&l.wo)?,
                attn_post_norm: optional(&l.attn_post_norm),
                ffn_norm: vector(&l.ffn_norm),
                ffn_post_norm: optional(&l.ffn_post_norm),
                w_gate: matrix(&l.w_gate)?,
                w_up: matrix(&l.w_up)?,
                w_down: matrix(&l.w_down)?,
            });
        }
        let ends = if ends {
            let tied = w.output.info.name == w.token_embd.info.name;
            Some(Ends {
                token_embd: matrix(&w.token_embd)?,
                output_norm: vector(&w.output_norm),
                output: if tied { None } else { Some(matrix(&w.output)?) },
            })
        } else {
            None
        };
        Ok(Self {
            first_layer,
            layers,
            ends,
        })
    }

    /// Every matrix format the kernels must read.
    pub fn matrix_types(&self) -> Vec<crate::quant::GgmlType> {
        let mut types: Vec<_> = self.ends.iter().map(|e| e.output().ty).collect();
        for l in &self.layers {
            for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                types.push(m.ty);
            }
        }
        types.sort_by_key(|t| t.id());
        types.dedup();
        types
    }

    /// Bytes the weights occupy on the device.
    pub fn device_bytes(&self) -> u64 {
        let mut total = 0;
        if let Some(ends) = &self.ends {
            total += ends.token_embd.device_bytes();
            total += ends.output.as_ref().map_or(0, DeviceMatrix::device_bytes);
        }
        for l in &self.layers {
            for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                total += m.device_bytes();
            }
        }
        total
    }
}
