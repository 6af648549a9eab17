//! Random weights in every format the matrix kernels take, written as valid
//! blocks directly: a random scale per block, sub-block scales within their bits.
//!
//! No quantizer is involved: each block gets an amplitude drawn from
//! `scale * [0.5, 1)`, its scales are set so that the largest value the
//! block can hold is that amplitude, and its quants are random bytes (every
//! bit pattern of a quant field is a valid quant). Sub-block scales are
//! drawn from the upper half of their range (and offsets set to centre each
//! sub-block on zero), so every sub-block carries weight. Values therefore
//! stay within about ±`scale` whatever the format, which is what keeps
//! activations finite through many layers.

use std::io::{self, Write};

use bytemuck::{bytes_of, Zeroable};
use half::{bf16, f16};

use super::rng::SplitMix64;
use crate::quant::{
    BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ5K, BlockQ5_0,
    BlockQ5_1, BlockQ6K, GgmlType, QK_K,
};

/// Every format a matrix can be stored in: those with a matrix kernel.
pub const WEIGHT_TYPES: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

/// Elements made per write: whole blocks of every format, and a buffer of
/// at most 64 KiB elements, so a 1 GB tensor never sits in memory.
const CHUNK: usize = 64 * QK_K;

/// Writes `count` values of about ±`scale` as `ty` to `out`. `count` is a
/// whole number of `ty` blocks (checked by the caller's validation).
pub(super) fn write_random(
    rng: &mut SplitMix64,
    ty: GgmlType,
    count: usize,
    scale: f32,
    out: &mut dyn Write,
) -> io::Result<()> {
    let mut buf = Vec::with_capacity(CHUNK / ty.block_len() * ty.block_bytes());
    let mut left = count;
    while left > 0 {
        let n = left.min(CHUNK);
        buf.clear();
        append_random(rng, ty, n, scale, &mut buf);
        out.write_all(&buf)?;
        left -= n;
    }
    Ok(())
}

/// `count` values as in [`write_random`], in memory.
pub(super) fn random_weights(
    rng: &mut SplitMix64,
    ty: GgmlType,
    count: usize,
    scale: f32,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(count / ty.block_len() * ty.block_bytes());
    append_random(rng, ty, count, scale, &mut out);
    out
}

fn append_random(rng: &mut SplitMix64, ty: GgmlType, count: usize, scale: f32, out: &mut Vec<u8>) {
    // F32, F16, Q8_0 and Q4_1 draw exactly as the first synthetic models
    // did, so files made before the other formats existed keep their bytes.
    match ty {
        GgmlType::F32 => {
            for _ in 0..count {
                out.extend((scale * rng.next_signed_unit()).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for _ in 0..count {
                out.extend(f16::from_f32(scale * rng.next_signed_unit()).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for _ in 0..count {
                out.extend(bf16::from_f32(scale * rng.next_signed_unit()).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            // x = d * q: f16 scale d, then 32 i8 quants.
            for _ in 0..count / 32 {
                let d = scale / 127.0 * (0.5 + 0.5 * rng.next_unit());
                out.extend(f16::from_f32(d).to_le_bytes());
                // -127..=127: ggml never produces -128.
                out.extend((0..32).map(|_| ((rng.next_u64() % 255) as i32 - 127) as i8 as u8));
            }
        }
        GgmlType::Q4_1 => {
            // x = d * q + m: f16 scale, f16 minimum, 16 bytes of nibbles.
            for _ in 0..count / 32 {
                let spread = scale * (0.5 + 0.5 * rng.next_unit());
                out.extend(f16::from_f32(2.0 * spread / 15.0).to_le_bytes());
                out.extend(f16::from_f32(-spread).to_le_bytes());
                out.extend((0..16).map(|_| rng.next_u64() as u8));
            }
        }
        _ => {
            for _ in 0..count / ty.block_len() {
                let amp = scale * (0.5 + 0.5 * rng.next_unit());
                append_block(rng, ty, amp, out);
            }
        }
    }
}

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

/// One block of `ty` whose values lie within ±`amp` (the formats not
/// handled in `append_random`).
fn append_block(rng: &mut SplitMix64, ty: GgmlType, amp: f32, out: &mut Vec<u8>) {
    match ty {
        GgmlType::Q4_0 => {
            // x = d * (q - 8), q in 0..16: the extreme is -8d.
            let mut b = BlockQ4_0::zeroed();
            b.d = h(amp / 8.0);
            rng.fill(&mut b.qs);
            out.extend_from_slice(bytes_of(&b));
        }
        GgmlType::Q5_0 => {
            // x = d * (q - 16), q in 0..32.
            let mut b = BlockQ5_0::zeroed();
            b.d = h(amp / 16.0);
            rng.fill(&mut b.qh);
            rng.fill(&mut b.qs);
            out.extend_from_slice(bytes_of(&b));
        }
        GgmlType::Q5_1 => {
            // x = d * q + m, q in 0..32: from -amp to +amp.
            let mut b = BlockQ5_1::zeroed();
            b.d = h(2.0 * amp / 31.0);
            b.m = h(-amp);
            rng.fill(&mut b.qh);
            rng.fill(&mut b.qs);
            out.extend_from_slice(bytes_of(&b));
        }
        GgmlType::IQ4_NL => {
            // x = d * grid[q], the grid within ±127.
            let mut b = BlockIQ4NL::zeroed();
            b.d = h(amp / 127.0);
            rng.fill(&mut b.qs);
            out.extend_from_slice(bytes_of(&b));
        }
        GgmlType::Q2_K => out.extend_from_slice(bytes_of(&q2_k(rng, amp))),
        GgmlType::Q3_K => out.extend_from_slice(bytes_of(&q3_k(rng, amp))),
        GgmlType::Q4_K => out.extend_from_slice(bytes_of(&q4_k(rng, amp))),
        GgmlType::Q5_K => out.extend_from_slice(bytes_of(&q5_k(rng, amp))),
        GgmlType::Q6_K => out.extend_from_slice(bytes_of(&q6_k(rng, amp))),
        GgmlType::IQ4_XS => out.extend_from_slice(bytes_of(&iq4_xs(rng, amp))),
        // Validation admits only WEIGHT_TYPES, all handled above or in
        // append_random; anything else is written as zeros of its size.
        _ => out.resize(out.len() + ty.block_bytes(), 0),
    }
}

/// Q2_K: x = d * sc * q - dmin * m with 4-bit sc, m and q in 0..4. With
/// dmin = d and m = round(1.5 sc), each sub-block spans about ±1.5 d sc;
/// sc in 6..=10 keeps m within its four bits and |x| within 15 d.
fn q2_k(rng: &mut SplitMix64, amp: f32) -> BlockQ2K {
    let mut b = BlockQ2K::zeroed();
    let d = h(amp / 15.0);
    b.d = d;
    b.dmin = d;
    for s in &mut b.scales {
        let sc = rng.next_in(6, 10);
        let m = (1.5 * f32::from(sc)).round() as u8;
        *s = sc | (m << 4);
    }
    rng.fill(&mut b.qs);
    b
}

/// Q3_K: x = d * s * q with 6-bit s (stored s + 32) and q in -4..4; s of
/// either sign with |s| in 16..=31 keeps |x| within 124 d.
fn q3_k(rng: &mut SplitMix64, amp: f32) -> BlockQ3K {
    let mut b = BlockQ3K::zeroed();
    b.d = h(amp / 124.0);
    let mut stored = [0u8; 16];
    for v in &mut stored {
        *v = signed_six_bit(rng);
    }
    b.scales = pack_q3_k_scales(&stored);
    rng.fill(&mut b.hmask);
    rng.fill(&mut b.qs);
    b
}

/// A 6-bit scale stored with a +32 offset: -31..=-16 or 16..=31.
fn signed_six_bit(rng: &mut SplitMix64) -> u8 {
    let magnitude = rng.next_in(16, 31);
    if rng.next_u64() & 1 == 0 {
        32 + magnitude
    } else {
        32 - magnitude
    }
}

/// Q3_K's 16 stored scales (6 bits each) in its 12 bytes: the low nibble
/// of scale j in byte j % 8 (high nibble for j >= 8), its top two bits in
/// byte 8 + j % 4 at bit 2 (j / 4).
pub(super) fn pack_q3_k_scales(stored: &[u8; 16]) -> [u8; 12] {
    let mut out = [0u8; 12];
    for (j, &v) in stored.iter().enumerate() {
        out[j % 8] |= (v & 0x0F) << (4 * (j / 8));
        out[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
    }
    out
}

/// The 8 scales and 8 minimums (6 bits each) of a Q4_K / Q5_K super-block
/// in its 12 bytes: sub-blocks 0..4 in the low 6 bits of bytes j (scale)
/// and j + 4 (minimum); sub-blocks 4..8 as a nibble each of byte j + 4 and
/// their top two bits in bits 6..8 of bytes j - 4 (scale) and j (minimum).
pub(super) fn pack_k4_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut out = [0u8; 12];
    for j in 0..4 {
        out[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        out[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        out[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    out
}

/// Scales in 32..=63 and minimums that centre each sub-block: with
/// dmin = `ratio` d, m = round(`centre` sc / `ratio`).
fn k_scales(rng: &mut SplitMix64, centre: f32, ratio: f32) -> [u8; 12] {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        sc[j] = rng.next_in(32, 63);
        m[j] = (centre * f32::from(sc[j]) / ratio).round() as u8;
    }
    pack_k4_scales(&sc, &m)
}

/// Q4_K: x = d * sc * q - dmin * m, q in 0..16. With dmin = 8 d and
/// m = round(7.5 sc / 8) (at most 59), a sub-block spans ±7.5 d sc plus
/// the rounding of m (4 d), within 476.5 d.
fn q4_k(rng: &mut SplitMix64, amp: f32) -> BlockQ4K {
    let mut b = BlockQ4K::zeroed();
    let d = f16::from_f32(amp / 476.5);
    b.d = d.to_le_bytes();
    // Eight times an f16 is exact in f16, so dmin / d is exactly 8.
    b.dmin = h(8.0 * d.to_f32());
    b.scales = k_scales(rng, 7.5, 8.0);
    rng.fill(&mut b.qs);
    b
}

/// Q5_K: as Q4_K with q in 0..32: dmin = 16 d, m = round(15.5 sc / 16)
/// (at most 61), within 984.5 d.
fn q5_k(rng: &mut SplitMix64, amp: f32) -> BlockQ5K {
    let mut b = BlockQ5K::zeroed();
    let d = f16::from_f32(amp / 984.5);
    b.d = d.to_le_bytes();
    b.dmin = h(16.0 * d.to_f32());
    b.scales = k_scales(rng, 15.5, 16.0);
    rng.fill(&mut b.qh);
    rng.fill(&mut b.qs);
    b
}

/// Q6_K: x = d * sc * (q - 32) with i8 sc and q in 0..64; |sc| in
/// 64..=127 keeps |x| within 32 * 127 d.
fn q6_k(rng: &mut SplitMix64, amp: f32) -> BlockQ6K {
    let mut b = BlockQ6K::zeroed();
    b.d = h(amp / (32.0 * 127.0));
    for s in &mut b.scales {
        let magnitude = rng.next_in(64, 127) as i8;
        let sc = if rng.next_u64() & 1 == 0 {
            magnitude
        } else {
            -magnitude
        };
        *s = sc as u8;
    }
    rng.fill(&mut b.ql);
    rng.fill(&mut b.qh);
    b
}

/// IQ4_XS: x = d * s * grid[q] with 6-bit s (stored s + 32) and the grid
/// within ±127; |s| in 16..=31 keeps |x| within 127 * 31 d.
fn iq4_xs(rng: &mut SplitMix64, amp: f32) -> BlockIQ4XS {
    let mut b = BlockIQ4XS::zeroed();
    b.d = h(amp / (127.0 * 31.0));
    let mut stored = [0u8; 8];
    for v in &mut stored {
        *v = signed_six_bit(rng);
    }
    (b.scales_h, b.scales_l) = pack_iq4_xs_scales(&stored);
    rng.fill(&mut b.qs);
    b
}

/// IQ4_XS's 8 stored scales (6 bits each): the low nibble of scale j in
/// nibble j % 2 of `scales_l[j / 2]`, its top two bits at bit 2j of the
/// little-endian `scales_h`.
pub(super) fn pack_iq4_xs_scales(stored: &[u8; 8]) -> ([u8; 2], [u8; 4]) {
    let mut low = [0u8; 4];
    let mut high = 0u16;
    for (j, &v) in stored.iter().enumerate() {
        low[j / 2] |= (v & 0x0F) << (4 * (j % 2));
        high |= u16::from(v >> 4) << (2 * j);
    }
    (high.to_le_bytes(), low)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn every_block_type_decodes_within_its_scale() {
        for ty in WEIGHT_TYPES {
            for scale in [0.5f32, 0.05] {
                let mut rng = SplitMix64::new(7);
                let n = 4 * 256;
                let bytes = random_weights(&mut rng, ty, n, scale);
                assert_eq!(bytes.len(), ty.row_bytes(n).unwrap(), "{ty}");
                let mut x = vec![0f32; n];
                crate::quant::dequantize_row(ty, &bytes, &mut x).unwrap();
                let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let mean = x.iter().sum::<f32>() / n as f32;
                assert!(x.iter().all(|v| v.is_finite()), "{ty}");
                // f16 rounding of a block's scale may add a little.
                assert!(max <= scale * 1.02, "{ty} at {scale}: max {max}");
                assert!(max > scale / 4.0, "{ty} at {scale}: max {max}");
                assert!(mean.abs() < scale / 10.0, "{ty} at {scale}: mean {mean}");
                let distinct: HashSet<u32> = x.iter().map(|v| v.to_bits()).collect();
                assert!(
                    distinct.len() > 16,
                    "{ty}: {} distinct values",
                    distinct.len()
                );
            }
        }
    }

    /// Dequantizes one block of `ty`.
    fn decode(ty: GgmlType, block: &[u8]) -> Vec<f32> {
        let mut x = vec![0f32; ty.block_len()];
        crate::quant::dequantize_row(ty, block, &mut x).unwrap();
        x
    }

    #[test]
    fn sub_block_scales_pack_as_the_reader_unpacks_them() {
        use crate::quant::{BlockIQ4XS, BlockQ3K, BlockQ4K};
        use bytemuck::{bytes_of, Zeroable};
        let one = half::f16::ONE.to_le_bytes();

        // Q4_K: every quant 1, so sub-block j reads sc[j] - m[j] (d = dmin = 1).
        let sc = [1, 20, 33, 63, 7, 48, 17, 62];
        let m = [63, 2, 31, 5, 60, 1, 40, 16];
        let mut q4 = BlockQ4K::zeroed();
        (q4.d, q4.dmin) = (one, one);
        q4.scales = pack_k4_scales(&sc, &m);
        q4.qs = [0x11; 128];
        let x = decode(GgmlType::Q4_K, bytes_of(&q4));
        for j in 0..8 {
            let want = f32::from(sc[j]) - f32::from(m[j]);
            assert!(
                x[32 * j..32 * j + 32].iter().all(|&v| v == want),
                "Q4_K sub-block {j}"
            );
        }

        // Q3_K: quants 1 with their high bit set, so sub-block j reads s[j] - 32.
        let stored: [u8; 16] = std::array::from_fn(|j| (j * 13 % 64) as u8);
        let mut q3 = BlockQ3K::zeroed();
        q3.d = one;
        q3.scales = pack_q3_k_scales(&stored);
        q3.hmask = [0xFF; 32];
        q3.qs = [0x55; 64];
        let x = decode(GgmlType::Q3_K, bytes_of(&q3));
        for j in 0..16 {
            let want = f32::from(stored[j]) - 32.0;
            assert!(
                x[16 * j..16 * j + 16].iter().all(|&v| v == want),
                "Q3_K sub-block {j}"
            );
        }

        // IQ4_XS: index 8 is grid value 1, so sub-block j reads s[j] - 32.
        let stored = [0, 63, 31, 32, 5, 47, 16, 60];
        let mut xs = BlockIQ4XS::zeroed();
        xs.d = one;
        (xs.scales_h, xs.scales_l) = pack_iq4_xs_scales(&stored);
        xs.qs = [0x88; 128];
        let x = decode(GgmlType::IQ4_XS, bytes_of(&xs));
        for j in 0..8 {
            let want = f32::from(stored[j]) - 32.0;
            assert!(
                x[32 * j..32 * j + 32].iter().all(|&v| v == want),
                "IQ4_XS sub-block {j}"
            );
        }
    }
}
