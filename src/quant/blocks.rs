//! The on-disk block layouts of the quantized formats, byte-compatible with
//! ggml. Every multi-byte field is stored as little-endian bytes so each block
//! has alignment 1: a row of blocks can be viewed in place from any byte
//! buffer (a mapped file, an activation scratch vector) without copying.
//!
//! Notation in the formulas: `d`, `m`, `dmin` are per-block scales, `q` the
//! stored integer of one element, `x` the value it stands for.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::types::QK_K;

/// Elements in one Q4_0 / Q4_1 / Q8_0 / Q8_1 block.
pub const QK32: usize = 32;

#[inline(always)]
fn f16_bytes_to_f32(bytes: [u8; 2]) -> f32 {
    f16::from_le_bytes(bytes).to_f32()
}

/// Q4_0: 32 elements, `x = d * (q - 8)` with `q` in 0..16; 4.5 bits/weight.
///
/// `qs[j]` holds element `j` in its low nibble and element `j + 16` in its
/// high nibble.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// f16 scale.
    pub d: [u8; 2],
    /// Packed nibbles.
    pub qs: [u8; QK32 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

/// Q4_1: 32 elements, `x = d * q + m` with `q` in 0..16; 5 bits/weight.
///
/// Nibble order as in Q4_0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// f16 scale.
    pub d: [u8; 2],
    /// f16 offset (the block minimum).
    pub m: [u8; 2],
    /// Packed nibbles.
    pub qs: [u8; QK32 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);

/// Q5_0: 32 elements, `x = d * (q - 16)` with `q` in 0..32; 5.5 bits/weight.
///
/// The low four bits are packed as in Q4_0; the fifth bit of element `j` is
/// bit `j` of the little-endian `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_0 {
    /// f16 scale.
    pub d: [u8; 2],
    /// Fifth bits, one per element (u32, little-endian).
    pub qh: [u8; 4],
    /// Packed low nibbles.
    pub qs: [u8; QK32 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);

/// Q5_1: 32 elements, `x = d * q + m` with `q` in 0..32; 6 bits/weight.
///
/// Quants are packed as in Q5_0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_1 {
    /// f16 scale.
    pub d: [u8; 2],
    /// f16 offset (the block minimum).
    pub m: [u8; 2],
    /// Fifth bits, one per element (u32, little-endian).
    pub qh: [u8; 4],
    /// Packed low nibbles.
    pub qs: [u8; QK32 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);

/// The 16 values an IQ4_NL / IQ4_XS index stands for (ggml's
/// `kvalues_iq4nl`): a non-linear grid, denser near zero, that fits
/// the bell-shaped weight distributions better than 16 even steps.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// IQ4_NL: 32 elements, `x = d * KVALUES_IQ4NL[q]` with 4-bit `q`;
/// 4.5 bits/weight.
///
/// Indices are packed as in Q4_0 (element `j` low nibble of `qs[j]`,
/// element `j + 16` high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ4NL {
    /// f16 scale.
    pub d: [u8; 2],
    /// Packed 4-bit indices into [`KVALUES_IQ4NL`].
    pub qs: [u8; QK32 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIQ4NL>() == 18);

/// Q8_0: 32 elements, `x = d * q` with `q` an i8; 8.5 bits/weight.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// f16 scale.
    pub d: [u8; 2],
    /// The quants (stored as u8 bytes, read as i8).
    pub qs: [u8; QK32],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

/// Q8_1: 32 elements, `x = d * q` with `q` an i8, plus `s = d * sum(q)`
/// so a Q4_1 offset can be applied without touching the quants;
/// 9 bits/weight. Used only for activations.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_1 {
    /// f16 scale.
    pub d: [u8; 2],
    /// f16 `d * sum(qs)`.
    pub s: [u8; 2],
    /// The quants (i8 as bytes).
    pub qs: [u8; QK32],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 36);

/// Q2_K: a super-block of 256 elements in 16 sub-blocks of 16;
/// `x = d * sc[j] * q - dmin * m[j]` with 4-bit `sc`, `m` and 2-bit `q`;
/// 2.625 bits/weight.
///
/// Quants come in 2 halves of 128 elements: in half `h`, byte
/// `qs[32h + l]` holds elements `128h + 32s + l` at bits `2s..2s+2`
/// (`s` in 0..4). Sub-block `j` covers elements `16j..16j+16`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ2K {
    /// Per sub-block: scale in the low nibble, minimum in the high nibble.
    pub scales: [u8; QK_K / 16],
    /// Packed 2-bit quants.
    pub qs: [u8; QK_K / 4],
    /// f16 super-block scale for the sub-block scales.
    pub d: [u8; 2],
    /// f16 super-block scale for the sub-block minimums.
    pub dmin: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);

/// Q3_K: a super-block of 256 elements in 16 sub-blocks of 16;
/// `x = d * (sc[j] - 32) * q` with 6-bit `sc` and `q` in -4..4;
/// 3.4375 bits/weight.
///
/// `q` is the 2-bit value packed as in Q2_K, minus 4 unless the element's
/// bit in `hmask` is set: element `128h + 32s + l` uses bit `4h + s` of
/// `hmask[l]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ3K {
    /// High bits (set: no -4 offset).
    pub hmask: [u8; QK_K / 8],
    /// Low 2 bits of the quants.
    pub qs: [u8; QK_K / 4],
    /// 16 six-bit scales, packed (see [`scales_q3k`]).
    pub scales: [u8; 12],
    /// f16 super-block scale.
    pub d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);

/// IQ4_XS: a super-block of 256 elements in 8 sub-blocks of 32;
/// `x = d * (sc[j] - 32) * KVALUES_IQ4NL[q]` with 6-bit `sc` and 4-bit `q`;
/// 4.25 bits/weight.
///
/// Sub-block `j` packs its indices as an IQ4_NL block in `qs[16j..16j+16]`;
/// its scale is the nibble `j % 2` of `scales_l[j / 2]` with bits
/// `2j..2j+2` of `scales_h` on top.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockIQ4XS {
    /// f16 super-block scale.
    pub d: [u8; 2],
    /// High 2 bits of the 8 sub-block scales (u16, little-endian).
    pub scales_h: [u8; 2],
    /// Low 4 bits of the 8 sub-block scales.
    pub scales_l: [u8; QK_K / 64],
    /// Packed 4-bit indices into [`KVALUES_IQ4NL`].
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIQ4XS>() == 136);

/// Q4_K: a super-block of 256 elements in 8 sub-blocks of 32;
/// `x = d * sc[j] * q - dmin * m[j]` with 6-bit `sc`, `m` and 4-bit `q`;
/// 4.5 bits/weight.
///
/// Quants come in 4 chunks of 64 elements: `qs[32c + l]` holds element
/// `64c + l` (low nibble) and `64c + 32 + l` (high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4K {
    /// f16 super-block scale for the sub-block scales.
    pub d: [u8; 2],
    /// f16 super-block scale for the sub-block minimums.
    pub dmin: [u8; 2],
    /// 8 six-bit scales and 8 six-bit minimums, packed (see [`scale_min_k4`]).
    pub scales: [u8; 12],
    /// Packed nibbles.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);

/// Q5_K: like Q4_K with a fifth quant bit: `x = d * sc[j] * q - dmin * m[j]`,
/// `q` in 0..32; 5.5 bits/weight.
///
/// The fifth bit of element `64c + l` is bit `2c` of `qh[l]`, of element
/// `64c + 32 + l` bit `2c + 1`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5K {
    /// f16 super-block scale for the sub-block scales.
    pub d: [u8; 2],
    /// f16 super-block scale for the sub-block minimums.
    pub dmin: [u8; 2],
    /// Packed six-bit scales and minimums, as in Q4_K.
    pub scales: [u8; 12],
    /// High bits.
    pub qh: [u8; QK_K / 8],
    /// Low nibbles, laid out as in Q4_K.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);

/// Q6_K: a super-block of 256 elements in 16 sub-blocks of 16;
/// `x = d * sc[j] * (q - 32)` with i8 `sc` and 6-bit `q`; 6.5625 bits/weight.
///
/// Two halves of 128 elements; in half `h`, for `l` in 0..32 the elements
/// `l, l+32, l+64, l+96` take low bits from `ql[64h + l] & 15`,
/// `ql[64h + 32 + l] & 15`, `ql[64h + l] >> 4`, `ql[64h + 32 + l] >> 4` and
/// their two high bits from `qh[32h + l]` at shifts 0, 2, 4, 6.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6K {
    /// Low 4 bits of the quants.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits of the quants.
    pub qh: [u8; QK_K / 4],
    /// i8 sub-block scales (as bytes).
    pub scales: [u8; QK_K / 16],
    /// f16 super-block scale.
    pub d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

/// Q8_K: 256 elements, `x = d * q` with f32 `d` and i8 `q`, plus the sums of
/// each 16 quants; 9.125 bits/weight. Used only for activations.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8K {
    /// f32 scale.
    pub d: [u8; 4],
    /// The quants (i8 as bytes).
    pub qs: [u8; QK_K],
    /// i16 sums of each group of 16 quants.
    pub bsums: [[u8; 2]; QK_K / 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);

impl BlockQ4_0 {
    /// The scale as f32.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
}

impl BlockQ4_1 {
    /// The scale as f32.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
    /// The offset as f32.
    #[inline(always)]
    pub fn m(&self) -> f32 {
        f16_bytes_to_f32(self.m)
    }
}

impl BlockQ5_0 {
    /// The scale as f32.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
    /// Quant `i` (0..32), without the -16 offset.
    #[inline(always)]
    pub fn q(&self, i: usize) -> u8 {
        q5_quant(&self.qs, self.qh, i)
    }
}

impl BlockQ5_1 {
    /// The scale as f32.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
    /// The offset as f32.
    #[inline(always)]
    pub fn m(&self) -> f32 {
        f16_bytes_to_f32(self.m)
    }
    /// Quant `i` (0..32).
    #[inline(always)]
    pub fn q(&self, i: usize) -> u8 {
        q5_quant(&self.qs, self.qh, i)
    }
}

/// Element `i` of a Q5_0 / Q5_1 block: its nibble with bit `i` of `qh`
/// as the fifth bit.
#[inline(always)]
fn q5_quant(qs: &[u8; QK32 / 2], qh: [u8; 4], i: usize) -> u8 {
    let nibble = if i < 16 {
        qs[i] & 0x0F
    } else {
        qs[i - 16] >> 4
    };
    let high = (u32::from_le_bytes(qh) >> i) & 1;
    nibble | ((high as u8) << 4)
}

impl BlockIQ4NL {
    /// The scale as f32.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
    /// The grid value of element `i`.
    #[inline(always)]
    pub fn value(&self, i: usize) -> i32 {
        iq4_value(&self.qs, i)
    }
}

/// Element `i` (0..32) of 16 packed IQ4 indices, as its grid value.
#[inline(always)]
pub fn iq4_value(qs: &[u8], i: usize) -> i32 {
    let idx = if i < 16 {
        qs[i] & 0x0F
    } else {
        qs[i - 16] >> 4
    };
    KVALUES_IQ4NL[idx as usize] as i32
}

impl BlockQ2K {
    /// The scale of the sub-block scales.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
    /// The scale of the sub-block minimums.
    #[inline(always)]
    pub fn dmin(&self) -> f32 {
        f16_bytes_to_f32(self.dmin)
    }
    /// The 2-bit quant of element `i` (0..256).
    #[inline(always)]
    pub fn q(&self, i: usize) -> u8 {
        (self.qs[32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3
    }
}

impl BlockQ3K {
    /// The super-block scale.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
    /// The quant of element `i` (0..256), in -4..4.
    #[inline(always)]
    pub fn q(&self, i: usize) -> i32 {
        let low = (self.qs[32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3;
        let high = (self.hmask[i % 32] >> (i / 32)) & 1;
        low as i32 - if high == 0 { 4 } else { 0 }
    }
}

impl BlockIQ4XS {
    /// The super-block scale.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
    /// The scale of sub-block `j` (0..8), offset to -32..32.
    #[inline(always)]
    pub fn scale(&self, j: usize) -> i32 {
        let low = (self.scales_l[j / 2] >> (4 * (j % 2))) & 0x0F;
        let high = (u16::from_le_bytes(self.scales_h) >> (2 * j)) & 3;
        (low as i32 | ((high as i32) << 4)) - 32
    }
    /// The grid value of element `i` (0..256).
    #[inline(always)]
    pub fn value(&self, i: usize) -> i32 {
        iq4_value(&self.qs[16 * (i / 32)..16 * (i / 32) + 16], i % 32)
    }
}

impl BlockQ8_0 {
    /// The scale as f32.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
    /// Quant `i` as a signed integer.
    #[inline(always)]
    pub fn q(&self, i: usize) -> i32 {
        self.qs[i] as i8 as i32
    }
}

impl BlockQ8_1 {
    /// The scale as f32.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
    /// `d * sum(q)` as f32.
    #[inline(always)]
    pub fn s(&self) -> f32 {
        f16_bytes_to_f32(self.s)
    }
    /// Quant `i` as a signed integer.
    #[inline(always)]
    pub fn q(&self, i: usize) -> i32 {
        self.qs[i] as i8 as i32
    }
}

impl BlockQ4K {
    /// The scale of the sub-block scales.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
    /// The scale of the sub-block minimums.
    #[inline(always)]
    pub fn dmin(&self) -> f32 {
        f16_bytes_to_f32(self.dmin)
    }
}

impl BlockQ5K {
    /// The scale of the sub-block scales.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
    /// The scale of the sub-block minimums.
    #[inline(always)]
    pub fn dmin(&self) -> f32 {
        f16_bytes_to_f32(self.dmin)
    }
}

impl BlockQ6K {
    /// The super-block scale.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_bytes_to_f32(self.d)
    }
}

impl BlockQ8K {
    /// The scale.
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f32::from_le_bytes(self.d)
    }
    /// Quant `i` as a signed integer.
    #[inline(always)]
    pub fn q(&self, i: usize) -> i32 {
        self.qs[i] as i8 as i32
    }
    /// Sum of quants `16 g .. 16 g + 16`.
    #[inline(always)]
    pub fn bsum(&self, g: usize) -> i32 {
        i16::from_le_bytes(self.bsums[g]) as i32
    }
}

/// Unpacks the 6-bit scale and minimum of sub-block `j` (0..8) of a Q4_K or
/// Q5_K super-block: sub-blocks 0..4 keep them in the low 6 bits of bytes
/// `j` and `j + 4`; sub-blocks 4..8 split them into a nibble of byte `j + 4`
/// and the top two bits of bytes `j - 4` and `j`.
#[cfg(test)]
pub fn scale_min_k4(j: usize, scales: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// The 12 packed scale bytes of a K-quant super-block as three
/// little-endian 32-bit words, for unpacking four scales at a time.
#[inline(always)]
fn scale_words(scales: &[u8; 12]) -> [u32; 3] {
    std::array::from_fn(|i| {
        u32::from_le_bytes([
            scales[4 * i],
            scales[4 * i + 1],
            scales[4 * i + 2],
            scales[4 * i + 3],
        ])
    })
}

/// All 8 (scale, minimum) pairs of a Q4_K / Q5_K super-block: the same
/// values as [`scale_min_k4`] for each `j`, four at a time in 32-bit words
/// (the kernels call this once per super-block and row, where eight
/// branchy byte extractions cost about as much as the multiplies).
#[inline(always)]
pub fn scales_mins_k4(scales: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let [w0, w1, w2] = scale_words(scales);
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    // Sub-blocks 0..4 keep the low 6 bits of bytes 0..4 (scales) and
    // 4..8 (mins); sub-blocks 4..8 take a nibble of bytes 8..12 and the top
    // two bits of bytes 0..4 (scales) or 4..8 (mins) as bits 4 and 5.
    let scales_hi = (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4);
    let mins_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4);
    let join = |lo: u32, hi: u32| (u64::from(lo) | (u64::from(hi) << 32)).to_le_bytes();
    (join(w0 & LOW6, scales_hi), join(w1 & LOW6, mins_hi))
}

/// The 16 scales of a Q3_K super-block, offset to -32..32: scale `j` has
/// its low nibble in byte `j` (`j < 8`, low nibble) or `j - 8` (high
/// nibble) and its top two bits in byte `8 + j % 4` at bit `2 (j / 4)`.
#[inline(always)]
pub fn scales_q3k(scales: &[u8; 12]) -> [i8; 16] {
    // Four scales per 32-bit word, so the kernels unpack without a loop
    // over single scales: group `g` (scales 4g..4g+4) takes its nibbles
    // from word `g % 2` (shifted by 4 for g >= 2) and its top bits from
    // word 2 at shift 2g.
    let [w0, w1, w2] = scale_words(scales);
    let lows = [w0, w1, w0 >> 4, w1 >> 4];
    let mut out = [0i8; 16];
    for (g, low) in lows.into_iter().enumerate() {
        let packed = (low & 0x0F0F_0F0F) | (((w2 >> (2 * g)) & 0x0303_0303) << 4);
        for (o, b) in out[4 * g..4 * g + 4].iter_mut().zip(packed.to_le_bytes()) {
            *o = b as i8 - 32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_min_unpacking_matches_hand_packed_bytes() {
        // Sub-block 1: scale 5, min 7 in the low 6 bits of bytes 1 and 5.
        // Sub-block 6: scale 0b11_0101 = 53 (nibble 5 of byte 10, top bits 3 of byte 2),
        // min 0b10_1001 = 41 (nibble 9 of byte 10, top bits 2 of byte 6).
        let mut s = [0u8; 12];
        s[1] = 5;
        s[5] = 7;
        s[10] = 0x95;
        s[2] = 0b11 << 6;
        s[6] = 0b10 << 6;
        assert_eq!(scale_min_k4(1, &s), (5, 7));
        assert_eq!(scale_min_k4(6, &s), (53, 41));
        assert_eq!(scale_min_k4(2, &s), (0, 0));
        assert_eq!(scale_min_k4(0, &s), (0, 0));
    }

    #[test]
    fn word_wise_scale_unpacking_equals_the_per_sub_block_definition() {
        // Every bit of every byte set on its own, then pseudo-random
        // patterns: each of the 12 bytes feeds scales and minimums through
        // different shifts.
        let mut cases: Vec<[u8; 12]> = (0..96)
            .map(|bit| {
                let mut s = [0u8; 12];
                s[bit / 8] = 1 << (bit % 8);
                s
            })
            .collect();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1000 {
            let mut s = [0u8; 12];
            for b in &mut s {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = state as u8;
            }
            cases.push(s);
        }
        for s in cases {
            let (sc, mn) = scales_mins_k4(&s);
            for j in 0..8 {
                assert_eq!(
                    (sc[j], mn[j]),
                    scale_min_k4(j, &s),
                    "bytes {s:?}, sub-block {j}"
                );
            }
        }
    }

    #[test]
    fn q3_k_scales_unpack_hand_packed_bytes() {
        let mut s = [0u8; 12];
        s[0] = 0x01; // scale 0: low nibble 1
        s[8] = 0x02; // ... top bits 2 (byte 8, bits 0-1): 33
        s[5] = 0x0F; // scale 5: low nibble 15
        s[9] = 0x0C; // ... top bits 3 (byte 9, bits 2-3): 63
        s[2] = 0x70; // scale 10: high nibble of byte 2 is its low nibble, 7
        s[10] = 0x10; // ... top bits 1 (byte 10, bits 4-5): 23
        s[11] = 0xC0; // scale 15: top bits 3 (byte 11, bits 6-7): 48
        let mut want = [-32i8; 16];
        want[0] = 1;
        want[5] = 31;
        want[10] = -9;
        want[15] = 16;
        assert_eq!(scales_q3k(&s), want);
    }

    #[test]
    fn quant_accessors_of_the_new_formats() {
        let mut q5 = BlockQ5_0::zeroed();
        q5.qs[3] = 0x4C;
        q5.qh = (1u32 << 19).to_le_bytes();
        assert_eq!((q5.q(3), q5.q(19), q5.q(0)), (12, 4 | 16, 0));
        let mut x = BlockIQ4XS::zeroed();
        x.scales_l = [0x21, 0x43, 0x65, 0x87];
        x.scales_h = 0b11_10_01_00_11_10_01_00u16.to_le_bytes();
        let scales: Vec<i32> = (0..8).map(|j| x.scale(j)).collect();
        assert_eq!(
            scales,
            [1 - 32, 2 - 16, 3, 4 + 16, 5 - 32, 6 - 16, 7, 8 + 16]
        );
        let mut q2 = BlockQ2K::zeroed();
        q2.qs[32 + 7] = 0b10_01_00_11;
        assert_eq!((q2.q(135), q2.q(167), q2.q(199), q2.q(231)), (3, 0, 1, 2));
        let mut q3 = BlockQ3K::zeroed();
        q3.hmask[7] = 1 << 5; // element 128 + 32 + 7
        assert_eq!((q3.q(167), q3.q(7)), (0, -4));
    }

    #[test]
    fn accessors_decode_little_endian_fields() {
        let mut b = BlockQ8K::zeroed();
        b.d = 0.5f32.to_le_bytes();
        b.bsums[3] = (-300i16).to_le_bytes();
        b.qs[9] = (-5i8) as u8;
        assert_eq!(b.d(), 0.5);
        assert_eq!(b.bsum(3), -300);
        assert_eq!(b.q(9), -5);
        let mut q = BlockQ4_1::zeroed();
        q.d = f16::from_f32(0.25).to_le_bytes();
        q.m = f16::from_f32(-1.5).to_le_bytes();
        assert_eq!((q.d(), q.m()), (0.25, -1.5));
    }
}
