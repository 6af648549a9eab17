// RoPE in place on `[tokens][heads][head_dim]`, from a per-token table of
// (cos, sin) pairs the host computes exactly as the CPU backend does.

struct Rope {
    heads: u32,
    head_dim: u32,
    rope_dims: u32,
    // 1: pairs (i, i + rope_dims / 2) (NeoX); 0: pairs (2i, 2i + 1).
    neox: u32,
}

@group(0) @binding(0) var<uniform> prm: Rope;
@group(0) @binding(1) var<storage, read> table: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<uniform> step: vec4<u32>;

// Dispatch: (ceil(heads * rope_dims / 2 / 64), tokens, 1).
@compute @workgroup_size(64)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>) {
    let pairs = prm.rope_dims / 2u;
    let t = gid.y;
    if (gid.x >= prm.heads * pairs || t >= step.x) {
        return;
    }
    let head = gid.x / pairs;
    let i = gid.x % pairs;
    let base = (t * prm.heads + head) * prm.head_dim;
    var a = base + 2u * i;
    var b = a + 1u;
    if (prm.neox == 1u) {
        a = base + i;
        b = base + i + pairs;
    }
    let c = table[t * prm.rope_dims + 2u * i];
    let s = table[t * prm.rope_dims + 2u * i + 1u];
    let x0 = x[a];
    let x1 = x[b];
    x[a] = fma(x0, c, -(x1 * s));
    x[b] = fma(x0, s, x1 * c);
}
