// The sampler as one compute pass: one workgroup turns one row of logits into
// one token id, following the CPU reference step for step (the pipeline,
// the rank order and the blocked sums are specified in src/sampler/mod.rs).
//
// The host prepends the shared constants (WORKGROUP_SIZE, SUM_BLOCK_LEN, the
// exp recipe's coefficients as exact hexadecimal floats, the request layout),
// so host and shader cannot drift apart.
//
// Bit-exactness rules, because a shader compiler may fuse a multiply into a
// following add, or reassociate `(a + b) - b`, where the CPU rounds every
// step: every rounded intermediate that feeds further arithmetic passes
// through `exact`, an integer XOR with a zero the compiler cannot see.
// Comparisons, maxima and the rank order work on integer keys, so NaN,
// infinities and signed zeros behave exactly as on the CPU whatever the
// driver's float mode. No division and no built-in exp: the host hands over
// reciprocals, and `weight_exp` is the reference's polynomial.
//
// Loop budget: Mesa's llvmpipe (lavapipe) ends every loop of an invocation
// once the invocation has run 65,535 loop iterations in all, silently. So
// per-token passes visit four ids per iteration, serial walks sixteen, the
// sort eight pairs, and top-p tries one short prefix before sorting every
// candidate: the worst case at 262,144 tokens stays near half the budget.

struct Globals {
    vocab_size: u32,
    // Always 0; read at run time so `exact` is opaque to the compiler.
    opaque_zero: u32,
    // Element offset of the weights region inside `work`.
    weights_base: u32,
    // Entries per row in `scratch` (a power of two >= vocab_size).
    scratch_stride: u32,
}

// The window [lo, hi) of rank order a cut keeps: a token is in when its
// masked composite key is >= the masked prefix (lexicographic on hi, lo).
struct Cut {
    hi: u32,
    lo: u32,
    mask_hi: u32,
    mask_lo: u32,
}

@group(0) @binding(0) var<uniform> globals: Globals;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> requests: array<u32>;
@group(0) @binding(3) var<storage, read_write> work: array<f32>;
@group(0) @binding(4) var<storage, read_write> counts: array<atomic<u32>>;
@group(0) @binding(5) var<storage, read_write> scratch: array<vec2<u32>>;
@group(0) @binding(6) var<storage, read_write> results: array<u32>;

var<workgroup> histogram: array<atomic<u32>, 256>;
var<workgroup> block_sums: array<f32, MAX_BLOCKS>;
var<workgroup> reduce_hi: array<u32, WORKGROUP_SIZE>;
var<workgroup> reduce_lo: array<u32, WORKGROUP_SIZE>;
var<workgroup> tally: atomic<u32>;
var<workgroup> broadcast_a: u32;
var<workgroup> broadcast_b: u32;
var<workgroup> broadcast_c: u32;

const NEG_INF_BITS: u32 = 0xff800000u;
const POS_INF_BITS: u32 = 0x7f800000u;
// order_key(-inf) and order_key(+inf).
const NEG_INF_KEY: u32 = 0x007fffffu;
const POS_INF_KEY: u32 = 0xff800000u;
// order_key(+0.0): the effective logit of a +inf token.
const ZERO_KEY: u32 = 0x80000000u;
const NO_TOKEN: u32 = 0xffffffffu;
// Ids a thread covers per iteration of a pass over the row (four).
const PASS_STRIDE: u32 = 4u * WORKGROUP_SIZE;

// Everything one workgroup knows about its row; identical in every thread.
struct Row {
    index: u32,
    // Where the row's logits start in `logits` (the request names the row,
    // which need not be the workgroup's: kept logits sit in session slots).
    logits_base: u32,
    base: u32,
    weights: u32,
    scratch: u32,
    params: u32,
    flags: u32,
    // Whether the row reads `work` (penalties or bias applied) or `logits`.
    adjusted: bool,
    // Whether the maximum is +inf: then only +inf tokens count, as logit 0.
    inf_mode: bool,
}

fn exact(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) ^ globals.opaque_zero);
}

fn param_f32(row: Row, word: u32) -> f32 {
    return bitcast<f32>(requests[row.params + word]);
}

fn param_u32(row: Row, word: u32) -> u32 {
    return requests[row.params + word];
}

fn is_nan_bits(bits: u32) -> bool {
    return (bits & 0x7fffffffu) > POS_INF_BITS;
}

// The logit the pipeline sees at `id`: NaN reads as -inf (never chosen).
fn load(row: Row, id: u32) -> f32 {
    var x: f32;
    if row.adjusted {
        x = work[row.base + id];
    } else {
        x = logits[row.logits_base + id];
    }
    if is_nan_bits(bitcast<u32>(x)) {
        return bitcast<f32>(NEG_INF_BITS);
    }
    return x;
}

// An unsigned key with the order of the floats; -0.0 and +0.0 share one.
fn order_key(x: f32) -> u32 {
    var bits = bitcast<u32>(x);
    if bits == 0x80000000u {
        bits = 0u;
    }
    if (bits & 0x80000000u) != 0u {
        return ~bits;
    }
    return bits | 0x80000000u;
}

fn key_value(key: u32) -> f32 {
    if (key & 0x80000000u) != 0u {
        return bitcast<f32>(key & 0x7fffffffu);
    }
    return bitcast<f32>(~key);
}

// Rank key of a token: (effective logit key, ID_MASK - id), so a larger
// composite ranks first and equal logits fall to the lower id. Ineligible
// tokens (NaN, -inf, or finite while the maximum is +inf) get (0, 0), below
// every eligible token.
fn composite(row: Row, id: u32) -> vec2<u32> {
    let key = order_key(load(row, id));
    if row.inf_mode {
        if key == POS_INF_KEY {
            return vec2<u32>(ZERO_KEY, ID_MASK - id);
        }
        return vec2<u32>(0u, 0u);
    }
    if key > NEG_INF_KEY {
        return vec2<u32>(key, ID_MASK - id);
    }
    return vec2<u32>(0u, 0u);
}

fn no_cut() -> Cut {
    return Cut(0u, 0u, 0u, 0u);
}

fn keeps(cut: Cut, c: vec2<u32>) -> bool {
    let hi = c.x & cut.mask_hi;
    let lo = c.y & cut.mask_lo;
    return hi > cut.hi || (hi == cut.hi && lo >= cut.lo);
}

fn eligible(c: vec2<u32>) -> bool {
    return c.x != 0u;
}

// Largest-first order on composites.
fn ranks_before(a: vec2<u32>, b: vec2<u32>) -> bool {
    return a.x > b.x || (a.x == b.x && a.y > b.y);
}

// Sum over the workgroup of one u32 per thread.
fn workgroup_sum(lid: u32, value: u32) -> u32 {
    if lid == 0u {
        atomicStore(&tally, 0u);
    }
    workgroupBarrier();
    atomicAdd(&tally, value);
    workgroupBarrier();
    if lid == 0u {
        broadcast_a = atomicLoad(&tally);
    }
    return workgroupUniformLoad(&broadcast_a);
}

// Workgroup-wide best (hi, lo) pair: the larger hi, then the smaller lo.
// Used for argmax (key, id), where a smaller id wins a tie.
fn reduce_best(lid: u32, hi: u32, lo: u32) -> vec2<u32> {
    reduce_hi[lid] = hi;
    reduce_lo[lid] = lo;
    workgroupBarrier();
    for (var stride = WORKGROUP_SIZE / 2u; stride > 0u; stride = stride / 2u) {
        if lid < stride {
            let other_hi = reduce_hi[lid + stride];
            let other_lo = reduce_lo[lid + stride];
            let mine_hi = reduce_hi[lid];
            let mine_lo = reduce_lo[lid];
            if other_hi > mine_hi || (other_hi == mine_hi && other_lo < mine_lo) {
                reduce_hi[lid] = other_hi;
                reduce_lo[lid] = other_lo;
            }
        }
        workgroupBarrier();
    }
    if lid == 0u {
        broadcast_a = reduce_hi[0];
        broadcast_b = reduce_lo[0];
    }
    let best_hi = workgroupUniformLoad(&broadcast_a);
    let best_lo = workgroupUniformLoad(&broadcast_b);
    return vec2<u32>(best_hi, best_lo);
}

// --- Per-id steps of the passes (each guards the vocabulary bound) -------

fn copy_logit(row: Row, id: u32) {
    if id < globals.vocab_size {
        work[row.base + id] = logits[row.logits_base + id];
    }
}

// Folds id into a thread's (best key, best id); ids come in ascending order
// per thread, so `>` keeps the lowest id among equal maxima.
fn argmax_step(row: Row, id: u32, best: vec2<u32>) -> vec2<u32> {
    if id < globals.vocab_size {
        let key = order_key(load(row, id));
        if key > best.x {
            return vec2<u32>(key, id);
        }
    }
    return best;
}

fn eligible_at(row: Row, id: u32) -> u32 {
    if id < globals.vocab_size && eligible(composite(row, id)) {
        return 1u;
    }
    return 0u;
}

fn histogram_step(row: Row, id: u32, within: Cut, cut: Cut, digit: u32, shift: u32) {
    if id >= globals.vocab_size {
        return;
    }
    let c = composite(row, id);
    if eligible(c) && keeps(within, c)
        && (c.x & cut.mask_hi) == cut.hi && (c.y & cut.mask_lo) == cut.lo {
        var byte: u32;
        if digit < 4u {
            byte = (c.x >> shift) & 0xffu;
        } else {
            byte = (c.y >> shift) & 0xffu;
        }
        atomicAdd(&histogram[byte], 1u);
    }
}

fn weight_step(row: Row, id: u32, within: Cut, max_logit: f32, inverse_temperature: f32) {
    if id >= globals.vocab_size {
        return;
    }
    let c = composite(row, id);
    var weight = 0.0;
    if eligible(c) && keeps(within, c) {
        var x = load(row, id);
        if row.inf_mode {
            x = 0.0;
        }
        weight = weight_exp(exact(exact(x - max_logit) * inverse_temperature));
    }
    work[row.weights + id] = weight;
}

fn compact_step(row: Row, id: u32, within: Cut, prefix_cut: Cut) {
    if id >= globals.vocab_size {
        return;
    }
    let c = composite(row, id);
    if eligible(c) && keeps(within, c) && keeps(prefix_cut, c) {
        let slot = atomicAdd(&tally, 1u);
        scratch[row.scratch + slot] = c;
    }
}

fn filter_step(row: Row, id: u32, nucleus: Cut, min_p: f32) {
    if id >= globals.vocab_size {
        return;
    }
    let weight = work[row.weights + id];
    if weight > 0.0 {
        let c = composite(row, id);
        if !keeps(nucleus, c) || !(weight >= min_p) {
            work[row.weights + id] = 0.0;
        }
    }
}

// Tokens still in the running (not NaN or -inf; only +inf ones when the
// maximum is +inf), counted by the whole workgroup.
fn count_eligible(row: Row, lid: u32) -> u32 {
    let vocab = globals.vocab_size;
    var mine = 0u;
    for (var id = lid; id < vocab; id += PASS_STRIDE) {
        mine += eligible_at(row, id) + eligible_at(row, id + WORKGROUP_SIZE)
            + eligible_at(row, id + 2u * WORKGROUP_SIZE) + eligible_at(row, id + 3u * WORKGROUP_SIZE);
    }
    return workgroup_sum(lid, mine);
}

// --- Blocked sums ---------------------------------------------------------

fn add_weight(row: Row, id: u32, end: u32, sum: f32) -> f32 {
    if id < end {
        return exact(sum + work[row.weights + id]);
    }
    return sum;
}

fn add_block(block: u32, blocks: u32, sum: f32) -> f32 {
    if block < blocks {
        return exact(sum + block_sums[block]);
    }
    return sum;
}

// Blocked sum of the row's weights (module docs of the CPU sampler): one
// thread per block of SUM_BLOCK_LEN ids in ascending order, then one thread
// over the block sums. Leaves the block sums in `block_sums` for the draw.
fn blocked_total(row: Row, lid: u32) -> f32 {
    let vocab = globals.vocab_size;
    let blocks = (vocab + SUM_BLOCK_LEN - 1u) / SUM_BLOCK_LEN;
    storageBarrier();
    for (var block = lid; block < blocks; block += WORKGROUP_SIZE) {
        let start = block * SUM_BLOCK_LEN;
        let end = min(start + SUM_BLOCK_LEN, vocab);
        var sum = 0.0;
        for (var id = start; id < end; id += 8u) {
            sum = add_weight(row, id, end, sum);
            sum = add_weight(row, id + 1u, end, sum);
            sum = add_weight(row, id + 2u, end, sum);
            sum = add_weight(row, id + 3u, end, sum);
            sum = add_weight(row, id + 4u, end, sum);
            sum = add_weight(row, id + 5u, end, sum);
            sum = add_weight(row, id + 6u, end, sum);
            sum = add_weight(row, id + 7u, end, sum);
        }
        block_sums[block] = sum;
    }
    workgroupBarrier();
    if lid == 0u {
        var total = 0.0;
        for (var block = 0u; block < blocks; block += 8u) {
            total = add_block(block, blocks, total);
            total = add_block(block + 1u, blocks, total);
            total = add_block(block + 2u, blocks, total);
            total = add_block(block + 3u, blocks, total);
            total = add_block(block + 4u, blocks, total);
            total = add_block(block + 5u, blocks, total);
            total = add_block(block + 6u, blocks, total);
            total = add_block(block + 7u, blocks, total);
        }
        broadcast_c = bitcast<u32>(total);
    }
    return bitcast<f32>(workgroupUniformLoad(&broadcast_c));
}

// --- Selection and sorting ------------------------------------------------

// The cut that keeps exactly the first `rank` tokens (1 <= rank <= the
// number of tokens `within` keeps) in rank order: a radix select over the
// 56 significant bits of the composite key, one byte per pass, most
// significant first, stopping as soon as the chosen byte holds exactly the
// tokens still needed.
fn select_rank(row: Row, lid: u32, within: Cut, rank: u32) -> Cut {
    let vocab = globals.vocab_size;
    var cut = no_cut();
    var need = rank;
    for (var digit = 0u; digit < 7u; digit++) {
        atomicStore(&histogram[lid], 0u);
        workgroupBarrier();
        var shift: u32;
        if digit < 4u {
            shift = 24u - 8u * digit;
        } else {
            shift = 16u - 8u * (digit - 4u);
        }
        for (var id = lid; id < vocab; id += PASS_STRIDE) {
            histogram_step(row, id, within, cut, digit, shift);
            histogram_step(row, id + WORKGROUP_SIZE, within, cut, digit, shift);
            histogram_step(row, id + 2u * WORKGROUP_SIZE, within, cut, digit, shift);
            histogram_step(row, id + 3u * WORKGROUP_SIZE, within, cut, digit, shift);
        }
        workgroupBarrier();
        // Suffix sums of the bins (Hillis-Steele): reduce_lo[b] = tokens in
        // bins >= b. The chosen bin is the one where the count crosses `need`.
        let in_bin = atomicLoad(&histogram[lid]);
        reduce_lo[lid] = in_bin;
        workgroupBarrier();
        for (var offset = 1u; offset < 256u; offset = offset * 2u) {
            var add = 0u;
            if lid + offset < 256u {
                add = reduce_lo[lid + offset];
            }
            workgroupBarrier();
            reduce_lo[lid] += add;
            workgroupBarrier();
        }
        let at_or_above = reduce_lo[lid];
        let above = at_or_above - in_bin;
        if above < need && need <= at_or_above {
            broadcast_a = lid;
            broadcast_b = need - above;
            broadcast_c = select(0u, 1u, in_bin == need - above);
        }
        let chosen = workgroupUniformLoad(&broadcast_a);
        need = workgroupUniformLoad(&broadcast_b);
        let done = workgroupUniformLoad(&broadcast_c);
        if digit < 4u {
            cut.hi = cut.hi | (chosen << shift);
            cut.mask_hi = cut.mask_hi | (0xffu << shift);
        } else {
            cut.lo = cut.lo | (chosen << shift);
            cut.mask_lo = cut.mask_lo | (0xffu << shift);
        }
        if done == 1u {
            break;
        }
    }
    return cut;
}

fn compare_exchange(row: Row, pair: u32, half: u32, stride: u32, size: u32) {
    if pair >= half {
        return;
    }
    // Insert a 0 bit at `stride`'s position: the lower index of the pair.
    let i = ((pair & ~(stride - 1u)) << 1u) | (pair & (stride - 1u));
    let partner = i | stride;
    let a = scratch[row.scratch + i];
    let b = scratch[row.scratch + partner];
    let largest_first = (i & size) == 0u;
    if largest_first == ranks_before(b, a) {
        scratch[row.scratch + i] = b;
        scratch[row.scratch + partner] = a;
    }
}

// Sorts scratch[row.scratch .. + len) largest first (len a power of two).
fn bitonic_sort(row: Row, lid: u32, len: u32) {
    let half = len / 2u;
    for (var size = 2u; size <= len; size = size * 2u) {
        for (var stride = size / 2u; stride > 0u; stride = stride / 2u) {
            for (var pair = lid; pair < half; pair += 8u * WORKGROUP_SIZE) {
                compare_exchange(row, pair, half, stride, size);
                compare_exchange(row, pair + WORKGROUP_SIZE, half, stride, size);
                compare_exchange(row, pair + 2u * WORKGROUP_SIZE, half, stride, size);
                compare_exchange(row, pair + 3u * WORKGROUP_SIZE, half, stride, size);
                compare_exchange(row, pair + 4u * WORKGROUP_SIZE, half, stride, size);
                compare_exchange(row, pair + 5u * WORKGROUP_SIZE, half, stride, size);
                compare_exchange(row, pair + 6u * WORKGROUP_SIZE, half, stride, size);
                compare_exchange(row, pair + 7u * WORKGROUP_SIZE, half, stride, size);
            }
            storageBarrier();
        }
    }
}

fn next_power_of_two(n: u32) -> u32 {
    var p = 1u;
    while p < n {
        p = p * 2u;
    }
    return p;
}

// One step of the nucleus walk: adds entry i's weight to the running sum
// and records the first entry whose running sum reaches the threshold.
fn nucleus_step(
    row: Row,
    i: u32,
    len: u32,
    threshold: f32,
    running: ptr<function, f32>,
    found: ptr<function, u32>,
) {
    if *found != NO_TOKEN || i >= len {
        return;
    }
    let id = ID_MASK - scratch[row.scratch + i].y;
    *running = exact(*running + work[row.weights + id]);
    if *running >= threshold {
        *found = i;
    }
}

// Step 10: the cut that keeps the nucleus, the shortest rank-order prefix of
// the candidates whose running weight sum reaches `threshold`. Tries the
// first TOP_P_FIRST_PREFIX candidates, then sorts them all.
fn nucleus_cut(row: Row, lid: u32, within: Cut, candidates: u32, threshold: f32) -> Cut {
    let vocab = globals.vocab_size;
    var prefix = min(TOP_P_FIRST_PREFIX, candidates);
    loop {
        var prefix_cut = within;
        if prefix < candidates {
            prefix_cut = select_rank(row, lid, within, prefix);
        }
        if lid == 0u {
            atomicStore(&tally, 0u);
        }
        workgroupBarrier();
        for (var id = lid; id < vocab; id += PASS_STRIDE) {
            compact_step(row, id, within, prefix_cut);
            compact_step(row, id + WORKGROUP_SIZE, within, prefix_cut);
            compact_step(row, id + 2u * WORKGROUP_SIZE, within, prefix_cut);
            compact_step(row, id + 3u * WORKGROUP_SIZE, within, prefix_cut);
        }
        let padded = next_power_of_two(prefix);
        for (var i = prefix + lid; i < padded; i += WORKGROUP_SIZE) {
            scratch[row.scratch + i] = vec2<u32>(0u, 0u);
        }
        storageBarrier();
        bitonic_sort(row, lid, padded);
        if lid == 0u {
            var running = 0.0;
            var found = NO_TOKEN;
            for (var i = 0u; i < prefix && found == NO_TOKEN; i += 16u) {
                nucleus_step(row, i + 0u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 1u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 2u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 3u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 4u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 5u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 6u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 7u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 8u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 9u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 10u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 11u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 12u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 13u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 14u, prefix, threshold, &running, &found);
                nucleus_step(row, i + 15u, prefix, threshold, &running, &found);
            }
            broadcast_a = found;
            if found != NO_TOKEN {
                let c = scratch[row.scratch + found];
                broadcast_b = c.x;
                broadcast_c = c.y;
            }
        }
        let found = workgroupUniformLoad(&broadcast_a);
        if found != NO_TOKEN {
            let hi = workgroupUniformLoad(&broadcast_b);
            let lo = workgroupUniformLoad(&broadcast_c);
            return Cut(hi, lo, 0xffffffffu, 0xffffffffu);
        }
        if prefix >= candidates {
            // Rounding kept the running sum below the bound: keep them all.
            return within;
        }
        prefix = candidates;
    }
    return within;
}

// --- Arithmetic shared with the CPU reference -------------------------------

// exp(t) by the CPU reference's recipe (`weight_exp` in src/sampler/mod.rs).
fn weight_exp(t: f32) -> f32 {
    let low = select(EXP_MIN_ARG, t, t > EXP_MIN_ARG);
    let clamped = select(EXP_MAX_ARG, low, low < EXP_MAX_ARG);
    let shifted = exact(exact(clamped * LOG2_E) + ROUND_MAGIC);
    let n = exact(shifted - ROUND_MAGIC);
    let r = exact(exact(clamped - exact(n * LN2_HI)) - exact(n * LN2_LO));
    var p = exact(EXP_C6 + exact(r * EXP_C7));
    p = exact(EXP_C5 + exact(r * p));
    p = exact(EXP_C4 + exact(r * p));
    p = exact(EXP_C3 + exact(r * p));
    p = exact(EXP_C2 + exact(r * p));
    p = exact(EXP_C1 + exact(r * p));
    p = exact(EXP_C0 + exact(r * p));
    let biased = bitcast<u32>(shifted) - bitcast<u32>(ROUND_MAGIC) + 127u;
    let value = exact(p * bitcast<f32>(biased << 23u));
    if t >= EXP_MIN_ARG {
        if t <= EXP_MAX_ARG {
            return value;
        }
        return bitcast<f32>(POS_INF_BITS);
    }
    return 0.0;
}

// High and low halves of the 64-bit product a * b, from 16-bit pieces.
fn mul_hi_lo(a: u32, b: u32) -> vec2<u32> {
    let a_lo = a & 0xffffu;
    let a_hi = a >> 16u;
    let b_lo = b & 0xffffu;
    let b_hi = b >> 16u;
    let lo_lo = a_lo * b_lo;
    let lo_hi = a_lo * b_hi;
    let hi_lo = a_hi * b_lo;
    let hi_hi = a_hi * b_hi;
    let middle = (lo_lo >> 16u) + (lo_hi & 0xffffu) + (hi_lo & 0xffffu);
    let high = hi_hi + (lo_hi >> 16u) + (hi_lo >> 16u) + (middle >> 16u);
    return vec2<u32>(high, a * b);
}

// Philox4x32-10 word 0 for (counter, key), as src/sampler/philox.rs.
fn philox_word0(counter_in: vec4<u32>, key_in: vec2<u32>) -> u32 {
    var counter = counter_in;
    var key = key_in;
    for (var round = 0u; round < 10u; round++) {
        if round > 0u {
            key = vec2<u32>(key.x + PHILOX_W0, key.y + PHILOX_W1);
        }
        let p0 = mul_hi_lo(PHILOX_M0, counter.x);
        let p1 = mul_hi_lo(PHILOX_M1, counter.z);
        counter = vec4<u32>(p1.x ^ counter.y ^ key.x, p1.y, p0.x ^ counter.w ^ key.y, p0.y);
    }
    return counter.x;
}

fn uniform_draw(row: Row) -> f32 {
    let key = vec2<u32>(param_u32(row, P_SEED_LO), param_u32(row, P_SEED_HI));
    let counter = vec4<u32>(param_u32(row, P_POSITION_LO), param_u32(row, P_POSITION_HI), 0u, 0u);
    let word = philox_word0(counter, key);
    return f32(word >> 8u) * UNIT_24_BITS;
}

// --- The pipeline -----------------------------------------------------------

fn finish(row: Row, lid: u32, token: u32, status: u32) {
    if lid == 0u {
        results[row.index * RESULT_WORDS] = token;
        results[row.index * RESULT_WORDS + 1u] = status;
    }
}

fn add_bias(row: Row, entry: u32, len: u32) {
    if entry < len {
        let start = param_u32(row, P_BIAS_OFFSET);
        let token = requests[start + 2u * entry];
        let bias = bitcast<f32>(requests[start + 2u * entry + 1u]);
        work[row.base + token] = exact(work[row.base + token] + bias);
    }
}

// Steps 2-4: the row's logits with penalties and bias, into `work`.
fn adjust_logits(row: Row, lid: u32) {
    let vocab = globals.vocab_size;
    for (var id = lid; id < vocab; id += PASS_STRIDE) {
        copy_logit(row, id);
        copy_logit(row, id + WORKGROUP_SIZE);
        copy_logit(row, id + 2u * WORKGROUP_SIZE);
        copy_logit(row, id + 3u * WORKGROUP_SIZE);
    }
    storageBarrier();
    if (row.flags & FLAG_PENALTIES) != 0u {
        let start = param_u32(row, P_HISTORY_OFFSET);
        let len = param_u32(row, P_HISTORY_LEN);
        for (var i = lid; i < len; i += WORKGROUP_SIZE) {
            atomicAdd(&counts[row.base + requests[start + i]], 1u);
        }
        storageBarrier();
        let repetition = param_f32(row, P_REPETITION);
        let inverse_repetition = param_f32(row, P_INVERSE_REPETITION);
        let presence = param_f32(row, P_PRESENCE);
        let frequency = param_f32(row, P_FREQUENCY);
        for (var i = lid; i < len; i += WORKGROUP_SIZE) {
            let token = requests[start + i];
            // The first thread to take a token's count penalises it, once.
            let count = atomicExchange(&counts[row.base + token], 0u);
            if count > 0u {
                var x = work[row.base + token];
                if x > 0.0 {
                    x = exact(x * inverse_repetition);
                } else {
                    x = exact(x * repetition);
                }
                let penalty = exact(exact(f32(count) * frequency) + presence);
                work[row.base + token] = exact(x - penalty);
            }
        }
        storageBarrier();
    }
    // In list order, by one thread: a token listed twice adds both biases
    // in the CPU's order.
    if lid == 0u {
        let len = param_u32(row, P_BIAS_LEN);
        for (var entry = 0u; entry < len; entry += 8u) {
            add_bias(row, entry, len);
            add_bias(row, entry + 1u, len);
            add_bias(row, entry + 2u, len);
            add_bias(row, entry + 3u, len);
            add_bias(row, entry + 4u, len);
            add_bias(row, entry + 5u, len);
            add_bias(row, entry + 6u, len);
            add_bias(row, entry + 7u, len);
        }
    }
    storageBarrier();
    // A constraint's mask: every token it does not allow is -inf, after
    // penalties and bias (the CPU's order).
    if (row.flags & FLAG_MASK) != 0u {
        let mask_at = param_u32(row, P_MASK_OFFSET);
        for (var id = lid; id < vocab; id += WORKGROUP_SIZE) {
            if ((requests[mask_at + id / 32u] >> (id % 32u)) & 1u) == 0u {
                work[row.base + id] = bitcast<f32>(NEG_INF_BITS);
            }
        }
        storageBarrier();
    }
}

// One token of the in-block draw walk.
fn draw_step(
    row: Row,
    id: u32,
    end: u32,
    complete: f32,
    draw_point: f32,
    running: ptr<function, f32>,
    token: ptr<function, u32>,
) {
    if *token != NO_TOKEN || id >= end {
        return;
    }
    let weight = work[row.weights + id];
    *running = exact(*running + weight);
    if weight > 0.0 && exact(complete + *running) > draw_point {
        *token = id;
    }
}

// One block of the draw's walk over the block sums.
fn draw_block(
    row: Row,
    block: u32,
    blocks: u32,
    draw_point: f32,
    complete: ptr<function, f32>,
    token: ptr<function, u32>,
) {
    if *token != NO_TOKEN || block >= blocks {
        return;
    }
    let block_sum = block_sums[block];
    if exact(*complete + block_sum) > draw_point {
        let start = block * SUM_BLOCK_LEN;
        let end = min(start + SUM_BLOCK_LEN, globals.vocab_size);
        var running = 0.0;
        for (var id = start; id < end && *token == NO_TOKEN; id += 8u) {
            draw_step(row, id, end, *complete, draw_point, &running, token);
            draw_step(row, id + 1u, end, *complete, draw_point, &running, token);
            draw_step(row, id + 2u, end, *complete, draw_point, &running, token);
            draw_step(row, id + 3u, end, *complete, draw_point, &running, token);
            draw_step(row, id + 4u, end, *complete, draw_point, &running, token);
            draw_step(row, id + 5u, end, *complete, draw_point, &running, token);
            draw_step(row, id + 6u, end, *complete, draw_point, &running, token);
            draw_step(row, id + 7u, end, *complete, draw_point, &running, token);
        }
    }
    *complete = exact(*complete + block_sum);
}

// Steps 12-13 on thread 0, after `blocked_total` filled `block_sums`: the
// first token in ascending id order whose blocked running sum passes u * Z.
fn draw(row: Row, total: f32) -> u32 {
    let vocab = globals.vocab_size;
    let draw_point = exact(uniform_draw(row) * total);
    let blocks = (vocab + SUM_BLOCK_LEN - 1u) / SUM_BLOCK_LEN;
    var complete = 0.0;
    var token = NO_TOKEN;
    for (var block = 0u; block < blocks && token == NO_TOKEN; block += 4u) {
        draw_block(row, block, blocks, draw_point, &complete, &token);
        draw_block(row, block + 1u, blocks, draw_point, &complete, &token);
        draw_block(row, block + 2u, blocks, draw_point, &complete, &token);
        draw_block(row, block + 3u, blocks, draw_point, &complete, &token);
    }
    if token == NO_TOKEN {
        // Rounding left no crossing: the last token with weight, found from
        // the last block with any.
        var last_block = NO_TOKEN;
        for (var block = blocks; block > 0u && last_block == NO_TOKEN; block--) {
            if block_sums[block - 1u] > 0.0 {
                last_block = block - 1u;
            }
        }
        if last_block != NO_TOKEN {
            let start = last_block * SUM_BLOCK_LEN;
            for (var id = min(start + SUM_BLOCK_LEN, vocab); id > start && token == NO_TOKEN; id--) {
                if work[row.weights + id - 1u] > 0.0 {
                    token = id - 1u;
                }
            }
        }
    }
    return token;
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn sample_rows(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let vocab = globals.vocab_size;
    var row: Row;
    row.index = workgroup.x;
    row.base = workgroup.x * vocab;
    row.weights = globals.weights_base + workgroup.x * vocab;
    row.scratch = workgroup.x * globals.scratch_stride;
    row.params = workgroup.x * PARAM_WORDS;
    row.flags = requests[row.params + P_FLAGS];
    row.logits_base = requests[row.params + P_LOGITS_ROW] * vocab;
    row.adjusted = (row.flags & FLAG_ADJUSTS) != 0u;
    row.inf_mode = false;

    if row.adjusted {
        adjust_logits(row, lid);
    }

    // Step 5, and the maximum for step 6: the best (key, id) in the row.
    var best = vec2<u32>(NEG_INF_KEY, NO_TOKEN);
    for (var id = lid; id < vocab; id += PASS_STRIDE) {
        best = argmax_step(row, id, best);
        best = argmax_step(row, id + WORKGROUP_SIZE, best);
        best = argmax_step(row, id + 2u * WORKGROUP_SIZE, best);
        best = argmax_step(row, id + 3u * WORKGROUP_SIZE, best);
    }
    best = reduce_best(lid, best.x, best.y);
    if best.x == NEG_INF_KEY {
        finish(row, lid, NO_TOKEN, STATUS_NO_CANDIDATE);
        return;
    }
    // Step 6: with a +inf maximum only the +inf tokens count, as logit 0.
    row.inf_mode = best.x == POS_INF_KEY;
    var max_logit = key_value(best.x);
    if row.inf_mode {
        max_logit = 0.0;
    }
    var token = best.y;
    if (row.flags & FLAG_GREEDY) == 0u {
        token = draw_token(row, lid, max_logit);
    }
    if token == NO_TOKEN {
        finish(row, lid, NO_TOKEN, STATUS_NO_CANDIDATE);
        return;
    }
    let top_n = param_u32(row, P_TOP_LOGPROBS);
    if top_n > 0u {
        report_logprobs(row, lid, max_logit, token, top_n);
    }
    finish(row, lid, token, STATUS_OK);
}

// Steps 7-13 for a non-greedy row: the drawn token, or NO_TOKEN.
fn draw_token(row: Row, lid: u32, max_logit: f32) -> u32 {
    let vocab = globals.vocab_size;
    // Step 7: the candidates.
    let eligible_count = count_eligible(row, lid);

    // Step 8: top-k.
    let top_k = param_u32(row, P_TOP_K);
    var within = no_cut();
    var candidates = eligible_count;
    if top_k > 0u && top_k < vocab && top_k < eligible_count {
        within = select_rank(row, lid, no_cut(), top_k);
        candidates = top_k;
    }

    // Step 9: weights, 0 for every token outside the candidates.
    let inverse_temperature = param_f32(row, P_INVERSE_TEMPERATURE);
    for (var id = lid; id < vocab; id += PASS_STRIDE) {
        weight_step(row, id, within, max_logit, inverse_temperature);
        weight_step(row, id + WORKGROUP_SIZE, within, max_logit, inverse_temperature);
        weight_step(row, id + 2u * WORKGROUP_SIZE, within, max_logit, inverse_temperature);
        weight_step(row, id + 3u * WORKGROUP_SIZE, within, max_logit, inverse_temperature);
    }

    // Steps 10-11: top-p, then min-p, by zeroing weights.
    let top_p = param_f32(row, P_TOP_P);
    let min_p = param_f32(row, P_MIN_P);
    var nucleus = no_cut();
    if top_p < 1.0 {
        let total = blocked_total(row, lid);
        nucleus = nucleus_cut(row, lid, within, candidates, exact(top_p * total));
    }
    storageBarrier();
    for (var id = lid; id < vocab; id += PASS_STRIDE) {
        filter_step(row, id, nucleus, min_p);
        filter_step(row, id + WORKGROUP_SIZE, nucleus, min_p);
        filter_step(row, id + 2u * WORKGROUP_SIZE, nucleus, min_p);
        filter_step(row, id + 3u * WORKGROUP_SIZE, nucleus, min_p);
    }

    // Steps 12-13: renormalise and draw in ascending id order.
    let total = blocked_total(row, lid);
    if lid == 0u {
        broadcast_a = draw(row, total);
    }
    return workgroupUniformLoad(&broadcast_a);
}

// The log-probability report (CPU: `token_logprobs`): the chosen token's
// and the top `top_n` tokens' logits minus the maximum, in rank order, and
// the normaliser (blocked sum of weight_exp(x - max)) whose log the host
// subtracts; with +inf logits, their count instead.
fn report_logprobs(row: Row, lid: u32, max_logit: f32, token: u32, top_n: u32) {
    let vocab = globals.vocab_size;
    let count = count_eligible(row, lid);
    let n = min(top_n, count);
    var normaliser = 0.0;
    if !row.inf_mode {
        for (var id = lid; id < vocab; id += PASS_STRIDE) {
            weight_step(row, id, no_cut(), max_logit, 1.0);
            weight_step(row, id + WORKGROUP_SIZE, no_cut(), max_logit, 1.0);
            weight_step(row, id + 2u * WORKGROUP_SIZE, no_cut(), max_logit, 1.0);
            weight_step(row, id + 3u * WORKGROUP_SIZE, no_cut(), max_logit, 1.0);
        }
        normaliser = blocked_total(row, lid);
    }
    var cut = no_cut();
    if n < count {
        cut = select_rank(row, lid, no_cut(), n);
    }
    if lid == 0u {
        atomicStore(&tally, 0u);
    }
    workgroupBarrier();
    for (var id = lid; id < vocab; id += PASS_STRIDE) {
        compact_step(row, id, no_cut(), cut);
        compact_step(row, id + WORKGROUP_SIZE, no_cut(), cut);
        compact_step(row, id + 2u * WORKGROUP_SIZE, no_cut(), cut);
        compact_step(row, id + 3u * WORKGROUP_SIZE, no_cut(), cut);
    }
    let padded = next_power_of_two(n);
    for (var i = n + lid; i < padded; i += WORKGROUP_SIZE) {
        scratch[row.scratch + i] = vec2<u32>(0u, 0u);
    }
    storageBarrier();
    bitonic_sort(row, lid, padded);
    if lid == 0u {
        let base = row.index * RESULT_WORDS;
        results[base + R_CHOSEN] = bitcast<u32>(exact(load(row, token) - max_logit));
        results[base + R_NORMALISER] = bitcast<u32>(normaliser);
        results[base + R_INFINITIES] = select(0u, count, row.inf_mode);
        results[base + R_TOP_COUNT] = n;
        for (var i = 0u; i < n; i++) {
            let id = ID_MASK - scratch[row.scratch + i].y;
            results[base + R_TOP + 2u * i] = id;
            results[base + R_TOP + 2u * i + 1u] = bitcast<u32>(exact(load(row, id) - max_logit));
        }
    }
}
