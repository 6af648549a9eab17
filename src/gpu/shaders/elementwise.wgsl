// Small per-element steps of the forward pass: residual adds, biases,
// the gated activations, logit soft-capping and row gathers.

struct Shape {
    // Values per token row of `y`/`x`, and a scalar.
    width: u32,
    x_stride: u32,
    kind: u32,
    scalar: f32,
}

@group(0) @binding(0) var<uniform> prm: Shape;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<uniform> step: vec4<u32>;
// Per wanted row: the token row it is taken from.
@group(0) @binding(4) var<storage, read> rows: array<u32>;

// x[t][i] += y[t][i]. Dispatch: (ceil(width / 64), tokens, 1).
@compute @workgroup_size(64)
fn add(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= prm.width || gid.y >= step.x) {
        return;
    }
    let at = gid.y * prm.x_stride + gid.x;
    x[at] = x[at] + y[gid.y * prm.width + gid.x];
}

// x[t][i] += y[i].
@compute @workgroup_size(64)
fn add_bias(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= prm.width || gid.y >= step.x) {
        return;
    }
    let at = gid.y * prm.x_stride + gid.x;
    x[at] = x[at] + y[gid.x];
}

fn gelu(v: f32) -> f32 {
    // The tanh approximation, as ggml's GELU.
    let c = 0.7978845608028654;
    return 0.5 * v * (1.0 + tanh(clamp(c * fma(0.044715 * v, v * v, v), -15.0, 15.0)));
}

// x[t][i] = act(x[t][i]) * y[t][i]; kind 0: SiLU, 1: GELU.
@compute @workgroup_size(64)
fn gated(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= prm.width || gid.y >= step.x) {
        return;
    }
    let at = gid.y * prm.x_stride + gid.x;
    let g = x[at];
    var a = g / (1.0 + exp(-g));
    if (prm.kind == 1u) {
        a = gelu(g);
    }
    x[at] = a * y[gid.y * prm.width + gid.x];
}

// x = cap * tanh(x / cap) over step.y rows.
@compute @workgroup_size(64)
fn softcap(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= prm.width || gid.y >= step.y) {
        return;
    }
    let at = gid.y * prm.x_stride + gid.x;
    x[at] = tanh(clamp(x[at] * (1.0 / prm.scalar), -15.0, 15.0)) * prm.scalar;
}

// x[r] = y[rows[r]] for the step.y wanted rows.
@compute @workgroup_size(64)
fn gather(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= prm.width || gid.y >= step.y) {
        return;
    }
    x[gid.y * prm.x_stride + gid.x] = y[rows[gid.y] * prm.width + gid.x];
}
