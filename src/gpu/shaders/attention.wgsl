// Paged KV and causal grouped-query attention. K and V live as f16 in
// device buffers of pages laid out as the host pool's pages are:
// page = [K, V][slot][kv_dim]; a page is `page_words` 32-bit words, and page
// p is page p % pages_per_buffer of buffer p / pages_per_buffer (so the
// cache is not bounded by one binding). The host prepends `kv_load` and
// `kv_store`, which pick the buffer, for as many buffers as the adapter
// lets one kernel bind (`KV_BINDINGS`).
// Per step the host uploads each token's (id, position, sequence) and each
// sequence's page table (per layer, per block of positions).
//
// Attention is three kernels so that every sum has one order: scores
// (one thread per key, a sequential dot over the head), softmax (a
// workgroup per query head, lanes in a fixed tree), and the weighted sum
// of values (one thread per output value, keys in order).

struct Attn {
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    kv_dim: u32,
    page_positions: u32,
    page_words: u32,
    layer: u32,
    // 0: every earlier position; else the last `window` positions.
    window: u32,
    scale: f32,
    pages_per_buffer: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> prm: Attn;
// x: tokens, y: logit rows, z: floats per (token, head) row of `scores`.
@group(0) @binding(1) var<uniform> step: vec4<u32>;
// Per token: (id, position, sequence, 0).
@group(0) @binding(2) var<storage, read> tokens: array<vec4<u32>>;
// Per sequence: (first entry in `pages`, blocks per layer, 0, 0).
@group(0) @binding(3) var<storage, read> seqs: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> pages: array<u32>;
// kv_write: the new K and V rows; scores and values: the queries.
@group(0) @binding(6) var<storage, read> k_new: array<f32>;
@group(0) @binding(7) var<storage, read> v_new: array<f32>;
@group(0) @binding(8) var<storage, read> q: array<f32>;
@group(0) @binding(9) var<storage, read_write> scores: array<f32>;
@group(0) @binding(10) var<storage, read_write> att: array<f32>;

// f32 to f16 bits, rounding to nearest even (as the host's conversion).
fn f16_bits(v: f32) -> u32 {
    let bits = bitcast<u32>(v);
    let sign = (bits >> 16u) & 0x8000u;
    let exponent = i32((bits >> 23u) & 0xffu);
    var mantissa = bits & 0x7fffffu;
    if (exponent == 255) {
        return sign | 0x7c00u | select(0u, 0x200u, mantissa != 0u);
    }
    let e = exponent - 127 + 15;
    if (e >= 31) {
        return sign | 0x7c00u;
    }
    if (e <= 0) {
        if (e < -10) {
            return sign;
        }
        mantissa = mantissa | 0x800000u;
        let shift = u32(14 - e);
        let half_mantissa = mantissa >> shift;
        let rest = mantissa & ((1u << shift) - 1u);
        let halfway = 1u << (shift - 1u);
        var rounded = half_mantissa;
        if (rest > halfway || (rest == halfway && (half_mantissa & 1u) == 1u)) {
            rounded = rounded + 1u;
        }
        return sign | rounded;
    }
    var out = (u32(e) << 10u) | (mantissa >> 13u);
    let rest = mantissa & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (out & 1u) == 1u)) {
        out = out + 1u;
    }
    return sign | out;
}

// The (buffer, word) holding values `2 * pair` and `2 * pair + 1` of K
// (kind 0) or V (kind 1) at position `pos` of sequence `s`.
fn kv_word(s: u32, pos: u32, kind: u32, pair: u32) -> vec2<u32> {
    let info = seqs[s];
    let block = pos / prm.page_positions;
    let slot = pos % prm.page_positions;
    let page = pages[info.x + prm.layer * info.y + block];
    let within = page % prm.pages_per_buffer;
    let word = within * prm.page_words + ((kind * prm.page_positions + slot) * prm.kv_dim) / 2u + pair;
    return vec2<u32>(page / prm.pages_per_buffer, word);
}

// Dispatch: (ceil(kv_dim / 2 / 64), tokens, 1).
@compute @workgroup_size(64)
fn kv_write(@builtin(global_invocation_id) gid: vec3<u32>) {
    let pair = gid.x;
    let t = gid.y;
    if (pair >= prm.kv_dim / 2u || t >= step.x) {
        return;
    }
    let info = tokens[t];
    let at = t * prm.kv_dim + 2u * pair;
    kv_store(kv_word(info.z, info.y, 0u, pair), f16_bits(k_new[at]) | (f16_bits(k_new[at + 1u]) << 16u));
    kv_store(kv_word(info.z, info.y, 1u, pair), f16_bits(v_new[at]) | (f16_bits(v_new[at + 1u]) << 16u));
}

// The first position token `t` attends to, and how many.
fn keys_of(t: u32) -> vec2<u32> {
    let pos = tokens[t].y;
    var first = 0u;
    if (prm.window != 0u && pos + 1u > prm.window) {
        first = pos + 1u - prm.window;
    }
    return vec2<u32>(first, pos + 1u - first);
}

// Dispatch: (ceil(step.z / 64), heads, tokens).
@compute @workgroup_size(64)
fn attn_scores(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    let h = gid.y;
    let t = gid.z;
    if (t >= step.x) {
        return;
    }
    let keys = keys_of(t);
    if (j >= keys.y) {
        return;
    }
    let s = tokens[t].z;
    let kvh = h / (prm.heads / prm.kv_heads);
    let qo = (t * prm.heads + h) * prm.head_dim;
    let first_pair = (kvh * prm.head_dim) / 2u;
    var dot = 0.0;
    for (var p = 0u; p < prm.head_dim / 2u; p++) {
        let pair = unpack2x16float(kv_load(kv_word(s, keys.x + j, 0u, first_pair + p)));
        dot = fma(q[qo + 2u * p], pair.x, dot);
        dot = fma(q[qo + 2u * p + 1u], pair.y, dot);
    }
    scores[(t * prm.heads + h) * step.z + j] = dot * prm.scale;
}

var<workgroup> lanes: array<f32, 64>;

fn tree_max(lane: u32, v: f32) -> f32 {
    lanes[lane] = v;
    workgroupBarrier();
    for (var stride = 32u; stride > 0u; stride >>= 1u) {
        if (lane < stride) {
            lanes[lane] = max(lanes[lane], lanes[lane + stride]);
        }
        workgroupBarrier();
    }
    let out = lanes[0];
    workgroupBarrier();
    return out;
}

fn tree_sum(lane: u32, v: f32) -> f32 {
    lanes[lane] = v;
    workgroupBarrier();
    for (var stride = 32u; stride > 0u; stride >>= 1u) {
        if (lane < stride) {
            lanes[lane] = lanes[lane] + lanes[lane + stride];
        }
        workgroupBarrier();
    }
    let out = lanes[0];
    workgroupBarrier();
    return out;
}

// Dispatch: (heads, tokens, 1).
@compute @workgroup_size(64)
fn attn_softmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let h = wid.x;
    let t = wid.y;
    let n = keys_of(t).y;
    let row = (t * prm.heads + h) * step.z;
    var m = -3.4028235e38;
    for (var j = lane; j < n; j += 64u) {
        m = max(m, scores[row + j]);
    }
    m = tree_max(lane, m);
    var partial = 0.0;
    for (var j = lane; j < n; j += 64u) {
        let e = exp(scores[row + j] - m);
        scores[row + j] = e;
        partial = partial + e;
    }
    let inv = 1.0 / tree_sum(lane, partial);
    for (var j = lane; j < n; j += 64u) {
        scores[row + j] = scores[row + j] * inv;
    }
}

// Dispatch: (ceil(head_dim / 2 / 64), heads, tokens).
@compute @workgroup_size(64)
fn attn_values(@builtin(global_invocation_id) gid: vec3<u32>) {
    let p = gid.x;
    let h = gid.y;
    let t = gid.z;
    if (p >= prm.head_dim / 2u || t >= step.x) {
        return;
    }
    let keys = keys_of(t);
    let s = tokens[t].z;
    let kvh = h / (prm.heads / prm.kv_heads);
    let pair = (kvh * prm.head_dim) / 2u + p;
    let row = (t * prm.heads + h) * step.z;
    var a = 0.0;
    var b = 0.0;
    for (var j = 0u; j < keys.y; j++) {
        let w = scores[row + j];
        let v = unpack2x16float(kv_load(kv_word(s, keys.x + j, 1u, pair)));
        a = fma(w, v.x, a);
        b = fma(w, v.y, b);
    }
    let o = (t * prm.heads + h) * prm.head_dim + 2u * p;
    att[o] = a;
    att[o + 1u] = b;
}
