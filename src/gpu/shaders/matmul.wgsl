// out[t][first_row + r] = row r of a weight matrix part · x[t], for a tile
// of TILE_ROWS rows and TILE_TOKENS tokens per workgroup.
//
// One arithmetic for one token and for a thousand, so that a row's value
// never depends on how many tokens were fed with it: lane l sums chunks l,
// l + LANES, ... of the row in order (each chunk a sequential dot of 32),
// and the LANES partial sums meet in a fixed tree. A tile's other rows and
// tokens only change which lanes are busy, never an output's arithmetic;
// so the host compiles the kernel twice, with 8 tokens a tile for decode
// steps and 32 for prompt chunks (each weight chunk dequantized once for 32
// tokens), and both give the same bits. The host prepends TILE_TOKENS, and
// replaces DEQUANT with the weight format's `dequant_*` function.
//
// Where the device has subgroups, the host sets SHUFFLE_BELOW to its
// smallest subgroup size, numbers the lanes subgroup by subgroup
// (LANE_BUILTINS, LANE) and makes SHUFFLE a shuffle down: the tree's
// levels below SHUFFLE_BELOW then pair the same lanes inside subgroup 0
// without a barrier, so the sums are the tree's bits either way. Without,
// SHUFFLE_BELOW is 1 and SHUFFLE never runs.

struct Part {
    rows: u32,
    cols: u32,
    row_bytes: u32,
    x_stride: u32,
    out_stride: u32,
    first_row: u32,
    groups_x: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> part: Part;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
// x = tokens in the step.
@group(0) @binding(4) var<uniform> step: vec4<u32>;

const LANES: u32 = 64u;
const TILE_ROWS: u32 = 2u;
const OUTPUTS: u32 = TILE_ROWS * TILE_TOKENS;

var<workgroup> sums: array<f32, OUTPUTS * LANES>;

@compute @workgroup_size(64)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, LANE_BUILTINS) {
    let lane = LANE;
    let row0 = (wid.x + wid.y * part.groups_x) * TILE_ROWS;
    let t0 = wid.z * TILE_TOKENS;
    let n_tokens = step.x;
    let rows = select(0u, min(TILE_ROWS, part.rows - row0), row0 < part.rows);
    let tokens = select(0u, min(TILE_TOKENS, n_tokens - t0), t0 < n_tokens);
    var acc: array<f32, OUTPUTS>;
    var w: array<f32, 32>;
    let chunks = part.cols / 32u;
    for (var c = lane; c < chunks; c += LANES) {
        for (var r = 0u; r < rows; r++) {
            DEQUANT((row0 + r) * part.row_bytes, c, &w);
            for (var t = 0u; t < tokens; t++) {
                let xo = (t0 + t) * part.x_stride + c * 32u;
                var s = 0.0;
                for (var i = 0u; i < 32u; i++) {
                    s = fma(w[i], x[xo + i], s);
                }
                acc[r * TILE_TOKENS + t] += s;
            }
        }
    }
    // Only the tile's live outputs meet in the tree (a decode step has one
    // token): each one's tree is the same whichever others are live.
    for (var r = 0u; r < rows; r++) {
        for (var t = 0u; t < tokens; t++) {
            let o = r * TILE_TOKENS + t;
            sums[o * LANES + lane] = acc[o];
        }
    }
    workgroupBarrier();
    var stride = LANES / 2u;
    for (; stride >= SHUFFLE_BELOW; stride >>= 1u) {
        if (lane < stride) {
            for (var r = 0u; r < rows; r++) {
                for (var t = 0u; t < tokens; t++) {
                    let o = r * TILE_TOKENS + t;
                    sums[o * LANES + lane] = sums[o * LANES + lane] + sums[o * LANES + lane + stride];
                }
            }
        }
        workgroupBarrier();
    }
    if (stride > 0u) {
        // Lane l < s adds lane l + s, as the tree does; both are below
        // 2s <= SHUFFLE_BELOW, in subgroup 0. Every lane shuffles (the
        // call must be uniform); only subgroup 0's results are kept.
        for (var r = 0u; r < rows; r++) {
            for (var t = 0u; t < tokens; t++) {
                let o = r * TILE_TOKENS + t;
                var v = sums[o * LANES + lane];
                for (var s = stride; s > 0u; s >>= 1u) {
                    v = v + SHUFFLE(v, s);
                }
                if (lane == 0u) {
                    sums[o * LANES] = v;
                }
            }
        }
        workgroupBarrier();
    }
    if (lane < OUTPUTS) {
        let r = lane / TILE_TOKENS;
        let t = lane % TILE_TOKENS;
        if (r < rows && t < tokens) {
            out[(t0 + t) * part.out_stride + part.first_row + row0 + r] = sums[lane * LANES];
        }
    }
}
