// Embedding lookup: each token's row of the table, expanded from its block
// format and multiplied by the architecture's embedding scale. The table
// may be split over bindings: each part writes the tokens it holds.
// DEQUANT is replaced by the table format's `dequant_*` function.

struct Embed {
    rows: u32,
    first_row: u32,
    cols: u32,
    row_bytes: u32,
    scale: f32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> prm: Embed;
@group(0) @binding(2) var<storage, read> tokens: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> x: array<f32>;
@group(0) @binding(4) var<uniform> step: vec4<u32>;

// Dispatch: (ceil(cols / 32 / 64), tokens, 1).
@compute @workgroup_size(64)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = gid.y;
    if (c >= prm.cols / 32u || t >= step.x) {
        return;
    }
    let id = tokens[t].x;
    if (id < prm.first_row || id >= prm.first_row + prm.rows) {
        return;
    }
    var w: array<f32, 32>;
    DEQUANT((id - prm.first_row) * prm.row_bytes, c, &w);
    for (var i = 0u; i < 32u; i++) {
        x[t * prm.cols + c * 32u + i] = w[i] * prm.scale;
    }
}
