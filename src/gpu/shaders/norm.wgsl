// RMSNorm of rows: a workgroup per row; lane l sums the squares of
// elements l, l + 64, ... in order and the 64 sums meet in a fixed tree,
// so a row's result never depends on the other rows of the step.
// `norm_to` reads `src` and writes `dst`; `norm_in_place` rewrites `dst`.

struct Norm {
    // Values per row, rows per token, floats between tokens.
    width: u32,
    rows_per_token: u32,
    token_stride: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> prm: Norm;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;
@group(0) @binding(4) var<uniform> step: vec4<u32>;

var<workgroup> sums: array<f32, 64>;

fn row_start(wid: vec3<u32>) -> u32 {
    return wid.y * prm.token_stride + wid.x * prm.width;
}

fn reduce(lane: u32, partial: f32) -> f32 {
    sums[lane] = partial;
    workgroupBarrier();
    for (var stride = 32u; stride > 0u; stride >>= 1u) {
        if (lane < stride) {
            sums[lane] = sums[lane] + sums[lane + stride];
        }
        workgroupBarrier();
    }
    return sums[0];
}

// Dispatch: (rows_per_token, tokens, 1).
@compute @workgroup_size(64)
fn norm_to(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let start = row_start(wid);
    var partial = 0.0;
    for (var i = lane; i < prm.width; i += 64u) {
        let v = src[start + i];
        partial = fma(v, v, partial);
    }
    let total = reduce(lane, partial);
    let scale = 1.0 / sqrt(total / f32(prm.width) + prm.eps);
    for (var i = lane; i < prm.width; i += 64u) {
        dst[start + i] = (src[start + i] * scale) * weight[i];
    }
}

@compute @workgroup_size(64)
fn norm_in_place(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let start = row_start(wid);
    var partial = 0.0;
    for (var i = lane; i < prm.width; i += 64u) {
        let v = dst[start + i];
        partial = fma(v, v, partial);
    }
    let total = reduce(lane, partial);
    let scale = 1.0 / sqrt(total / f32(prm.width) + prm.eps);
    for (var i = lane; i < prm.width; i += 64u) {
        dst[start + i] = (dst[start + i] * scale) * weight[i];
    }
}
