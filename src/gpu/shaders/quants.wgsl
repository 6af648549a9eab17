// The GGUF block formats, read from a weight buffer of 32-bit words:
// each `dequant_*` expands chunk `c` (32 consecutive elements) of the row
// starting at byte `base` into `w`. Chunks are the unit every matrix
// kernel sums in, so every format, K-quants included, is read 32 at a time.
// Blocks sit at any even byte offset (Q4_0 blocks are 18 bytes), so
// multi-byte fields are assembled from the words around them.

@group(0) @binding(1) var<storage, read> weights: array<u32>;

fn byte_at(off: u32) -> u32 {
    return (weights[off >> 2u] >> ((off & 3u) * 8u)) & 0xffu;
}

// Four bytes from any byte offset, little-endian.
fn word_at(off: u32) -> u32 {
    let shift = (off & 3u) * 8u;
    let lo = weights[off >> 2u];
    if (shift == 0u) {
        return lo;
    }
    return (lo >> shift) | (weights[(off >> 2u) + 1u] << (32u - shift));
}

// An IEEE half at an even byte offset, decoded exactly (subnormals kept,
// which unpack2x16float may flush).
fn f16_at(off: u32) -> f32 {
    let bits = (weights[off >> 2u] >> ((off & 2u) * 8u)) & 0xffffu;
    return half_to_f32(bits);
}

fn half_to_f32(bits: u32) -> f32 {
    let sign = (bits & 0x8000u) << 16u;
    let exponent = (bits >> 10u) & 0x1fu;
    let mantissa = bits & 0x3ffu;
    if (exponent == 0u) {
        // Zero or subnormal: mantissa * 2^-24, exact in f32.
        let magnitude = f32(mantissa) * 5.9604644775390625e-8;
        return select(magnitude, -magnitude, sign != 0u);
    }
    if (exponent == 31u) {
        return bitcast<f32>(sign | 0x7f800000u | (mantissa << 13u));
    }
    return bitcast<f32>(sign | ((exponent + 112u) << 23u) | (mantissa << 13u));
}

fn signed_byte(word: u32, k: u32) -> f32 {
    return f32(bitcast<i32>(word << (24u - 8u * k)) >> 24u);
}

const KVALUES_IQ4NL = array<f32, 16>(
    -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
    1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0,
);

fn dequant_f32(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let first = (base >> 2u) + c * 32u;
    for (var i = 0u; i < 32u; i++) {
        (*w)[i] = bitcast<f32>(weights[first + i]);
    }
}

fn dequant_f16(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let first = (base >> 2u) + c * 16u;
    for (var i = 0u; i < 16u; i++) {
        let pair = weights[first + i];
        (*w)[2u * i] = half_to_f32(pair & 0xffffu);
        (*w)[2u * i + 1u] = half_to_f32(pair >> 16u);
    }
}

fn dequant_bf16(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let first = (base >> 2u) + c * 16u;
    for (var i = 0u; i < 16u; i++) {
        let pair = weights[first + i];
        (*w)[2u * i] = bitcast<f32>(pair << 16u);
        (*w)[2u * i + 1u] = bitcast<f32>(pair & 0xffff0000u);
    }
}

// Q4_0, 18 bytes: f16 d, 16 bytes of nibbles (low: elements 0..16).
fn dequant_q4_0(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + c * 18u;
    let d = f16_at(b);
    for (var i = 0u; i < 4u; i++) {
        let q = word_at(b + 2u + 4u * i);
        for (var k = 0u; k < 4u; k++) {
            let byte = (q >> (8u * k)) & 0xffu;
            (*w)[4u * i + k] = d * f32(i32(byte & 15u) - 8);
            (*w)[16u + 4u * i + k] = d * f32(i32(byte >> 4u) - 8);
        }
    }
}

// Q4_1, 20 bytes: f16 d, f16 m, nibbles as Q4_0; x = d * q + m.
fn dequant_q4_1(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + c * 20u;
    let d = f16_at(b);
    let m = f16_at(b + 2u);
    for (var i = 0u; i < 4u; i++) {
        let q = word_at(b + 4u + 4u * i);
        for (var k = 0u; k < 4u; k++) {
            let byte = (q >> (8u * k)) & 0xffu;
            (*w)[4u * i + k] = fma(d, f32(byte & 15u), m);
            (*w)[16u + 4u * i + k] = fma(d, f32(byte >> 4u), m);
        }
    }
}

// Q5_0, 22 bytes: f16 d, 32 fifth bits, nibbles; x = d * (q - 16).
fn dequant_q5_0(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + c * 22u;
    let d = f16_at(b);
    let qh = word_at(b + 2u);
    for (var i = 0u; i < 4u; i++) {
        let q = word_at(b + 6u + 4u * i);
        for (var k = 0u; k < 4u; k++) {
            let j = 4u * i + k;
            let byte = (q >> (8u * k)) & 0xffu;
            let lo = (byte & 15u) | (((qh >> j) & 1u) << 4u);
            let hi = (byte >> 4u) | (((qh >> (j + 16u)) & 1u) << 4u);
            (*w)[j] = d * f32(i32(lo) - 16);
            (*w)[16u + j] = d * f32(i32(hi) - 16);
        }
    }
}

// Q5_1, 24 bytes: f16 d, f16 m, fifth bits, nibbles; x = d * q + m.
fn dequant_q5_1(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + c * 24u;
    let d = f16_at(b);
    let m = f16_at(b + 2u);
    let qh = word_at(b + 4u);
    for (var i = 0u; i < 4u; i++) {
        let q = word_at(b + 8u + 4u * i);
        for (var k = 0u; k < 4u; k++) {
            let j = 4u * i + k;
            let byte = (q >> (8u * k)) & 0xffu;
            let lo = (byte & 15u) | (((qh >> j) & 1u) << 4u);
            let hi = (byte >> 4u) | (((qh >> (j + 16u)) & 1u) << 4u);
            (*w)[j] = fma(d, f32(lo), m);
            (*w)[16u + j] = fma(d, f32(hi), m);
        }
    }
}

// Q8_0, 34 bytes: f16 d, 32 signed bytes.
fn dequant_q8_0(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + c * 34u;
    let d = f16_at(b);
    for (var i = 0u; i < 8u; i++) {
        let q = word_at(b + 2u + 4u * i);
        for (var k = 0u; k < 4u; k++) {
            (*w)[4u * i + k] = d * signed_byte(q, k);
        }
    }
}

// IQ4_NL, 18 bytes: f16 d, nibbles indexing the non-linear grid.
fn dequant_iq4_nl(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + c * 18u;
    let d = f16_at(b);
    for (var i = 0u; i < 4u; i++) {
        let q = word_at(b + 2u + 4u * i);
        for (var k = 0u; k < 4u; k++) {
            let byte = (q >> (8u * k)) & 0xffu;
            (*w)[4u * i + k] = d * KVALUES_IQ4NL[byte & 15u];
            (*w)[16u + 4u * i + k] = d * KVALUES_IQ4NL[byte >> 4u];
        }
    }
}

// Q2_K, 84 bytes: 16 scale/min bytes, 64 bytes of 2-bit quants, f16 d,
// f16 dmin. Chunk j of a super-block is quant shift 2 (j % 4) of bytes
// 32 (j / 4) .. +32; its halves have sub-block scales 2j and 2j + 1.
fn dequant_q2_k(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + (c / 8u) * 84u;
    let j = c % 8u;
    let d = f16_at(b + 80u);
    let dmin = f16_at(b + 82u);
    let shift = 2u * (j % 4u);
    for (var h = 0u; h < 2u; h++) {
        let sc = byte_at(b + 2u * j + h);
        let dl = d * f32(sc & 15u);
        let ml = dmin * f32(sc >> 4u);
        for (var i = 0u; i < 4u; i++) {
            let q = word_at(b + 16u + 32u * (j / 4u) + 16u * h + 4u * i);
            for (var k = 0u; k < 4u; k++) {
                let v = f32((q >> (8u * k + shift)) & 3u);
                (*w)[16u * h + 4u * i + k] = fma(dl, v, -ml);
            }
        }
    }
}

// The 6-bit scale `k` (0..16) of a Q3_K super-block at `b`, minus 32.
fn q3k_scale(b: u32, k: u32) -> f32 {
    let group = k / 4u;
    let lane = k % 4u;
    let low_word = word_at(b + 96u + 4u * (group % 2u)) >> (4u * (group / 2u));
    let high_word = word_at(b + 104u) >> (2u * group);
    let low = (low_word >> (8u * lane)) & 15u;
    let high = (high_word >> (8u * lane)) & 3u;
    return f32(i32(low | (high << 4u)) - 32);
}

// Q3_K, 110 bytes: 32 bytes of high bits, 64 of low 2-bit quants, 12 of
// packed scales, f16 d. A clear high bit subtracts 4.
fn dequant_q3_k(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + (c / 8u) * 110u;
    let j = c % 8u;
    let d = f16_at(b + 108u);
    let shift = 2u * (j % 4u);
    for (var h = 0u; h < 2u; h++) {
        let dl = d * q3k_scale(b, 2u * j + h);
        for (var i = 0u; i < 4u; i++) {
            let l = 16u * h + 4u * i;
            let q = word_at(b + 32u + 32u * (j / 4u) + l);
            let hm = word_at(b + l);
            for (var k = 0u; k < 4u; k++) {
                let low = i32((q >> (8u * k + shift)) & 3u);
                let high = (hm >> (8u * k + j)) & 1u;
                (*w)[l + k] = dl * f32(low - select(4, 0, high != 0u));
            }
        }
    }
}

// Scale and minimum `j` (0..8) of a Q4_K / Q5_K super-block at `b`.
fn k4_scale_min(b: u32, j: u32) -> vec2<f32> {
    let s = b + 4u;
    if (j < 4u) {
        return vec2<f32>(f32(byte_at(s + j) & 63u), f32(byte_at(s + j + 4u) & 63u));
    }
    let sc = (byte_at(s + j + 4u) & 15u) | ((byte_at(s + j - 4u) >> 6u) << 4u);
    let mn = (byte_at(s + j + 4u) >> 4u) | ((byte_at(s + j) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(mn));
}

// Q4_K, 144 bytes: f16 d, f16 dmin, 12 scale bytes, 128 nibble bytes;
// chunk j is the low (even j) or high nibbles of bytes 32 (j / 2) .. +32.
fn dequant_q4_k(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + (c / 8u) * 144u;
    let j = c % 8u;
    let sm = k4_scale_min(b, j);
    let dl = f16_at(b) * sm.x;
    let ml = f16_at(b + 2u) * sm.y;
    let shift = 4u * (j % 2u);
    for (var i = 0u; i < 8u; i++) {
        let q = word_at(b + 16u + 32u * (j / 2u) + 4u * i);
        for (var k = 0u; k < 4u; k++) {
            (*w)[4u * i + k] = fma(dl, f32((q >> (8u * k + shift)) & 15u), -ml);
        }
    }
}

// Q5_K, 176 bytes: as Q4_K with 32 bytes of fifth bits (bit j of byte l
// for element l of chunk j) before the nibbles.
fn dequant_q5_k(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + (c / 8u) * 176u;
    let j = c % 8u;
    let sm = k4_scale_min(b, j);
    let dl = f16_at(b) * sm.x;
    let ml = f16_at(b + 2u) * sm.y;
    let shift = 4u * (j % 2u);
    for (var i = 0u; i < 8u; i++) {
        let q = word_at(b + 48u + 32u * (j / 2u) + 4u * i);
        let qh = word_at(b + 16u + 4u * i);
        for (var k = 0u; k < 4u; k++) {
            let v = ((q >> (8u * k + shift)) & 15u) | (((qh >> (8u * k + j)) & 1u) << 4u);
            (*w)[4u * i + k] = fma(dl, f32(v), -ml);
        }
    }
}

// Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16
// signed scales, f16 d. Chunk j: half j / 4, quarter r = j % 4 takes low
// bits from bytes 64 (j / 4) + 32 (r % 2) .. +32 (high nibble when r >= 2)
// and high bits from bytes 128 + 32 (j / 4) .. +32 at shift 2r.
fn dequant_q6_k(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + (c / 8u) * 210u;
    let j = c % 8u;
    let half = j / 4u;
    let r = j % 4u;
    let d = f16_at(b + 208u);
    let lo_shift = 4u * (r / 2u);
    let hi_shift = 2u * r;
    let scales = word_at(b + 192u + 8u * half + 2u * r);
    for (var h = 0u; h < 2u; h++) {
        let dl = d * signed_byte(scales, h);
        for (var i = 0u; i < 4u; i++) {
            let l = 16u * h + 4u * i;
            let ql = word_at(b + 64u * half + 32u * (r % 2u) + l);
            let qh = word_at(b + 128u + 32u * half + l);
            for (var k = 0u; k < 4u; k++) {
                let v = ((ql >> (8u * k + lo_shift)) & 15u) | (((qh >> (8u * k + hi_shift)) & 3u) << 4u);
                (*w)[l + k] = dl * f32(i32(v) - 32);
            }
        }
    }
}

// IQ4_XS, 136 bytes: f16 d, 16 bits of high scale bits, 4 bytes of low
// scale nibbles, 128 bytes of grid indices (16 per chunk).
fn dequant_iq4_xs(base: u32, c: u32, w: ptr<function, array<f32, 32>>) {
    let b = base + (c / 8u) * 136u;
    let j = c % 8u;
    let scale_low = (byte_at(b + 4u + j / 2u) >> (4u * (j % 2u))) & 15u;
    let scale_high = ((byte_at(b + 2u) | (byte_at(b + 3u) << 8u)) >> (2u * j)) & 3u;
    let dl = f16_at(b) * f32(i32(scale_low | (scale_high << 4u)) - 32);
    for (var i = 0u; i < 4u; i++) {
        let q = word_at(b + 8u + 16u * j + 4u * i);
        for (var k = 0u; k < 4u; k++) {
            let byte = (q >> (8u * k)) & 0xffu;
            (*w)[4u * i + k] = dl * KVALUES_IQ4NL[byte & 15u];
            (*w)[16u + 4u * i + k] = dl * KVALUES_IQ4NL[byte >> 4u];
        }
    }
}
