//! Philox4x32-10, the counter-based random generator of Salmon et al.
//! ("Parallel random numbers: as easy as 1, 2, 3", SC 2011), and the one
//! uniform number per sampled token that the sampler draws from it.
//!
//! A counter-based generator is a pure function of (counter, key): the draw
//! for a token depends only on the request's seed and the token's absolute
//! position, never on batching, threads or the order of calls. Everything
//! here is 32-bit integer arithmetic, so a shader reproduces it bit for bit.
//!
//! The recipe for the sampler's uniform number `u` (see [`uniform`]):
//!
//! ```text
//! key     = [seed as u32, (seed >> 32) as u32]
//! counter = [position as u32, (position >> 32) as u32, 0, 0]
//! word    = philox4x32_10(counter, key)[0]
//! u       = (word >> 8) as f32 * 2^-24        // exact: 24 bits fit an f32 mantissa
//! ```
//!
//! so `u` is one of the 2^24 values `k / 2^24`, `0 <= u < 1`.

/// Multiplier applied to counter word 0 in each round.
pub(crate) const PHILOX_M0: u32 = 0xD251_1F53;
/// Multiplier applied to counter word 2 in each round.
pub(crate) const PHILOX_M1: u32 = 0xCD9E_8D57;
/// Weyl increment added to key word 0 between rounds (golden ratio).
pub(crate) const PHILOX_W0: u32 = 0x9E37_79B9;
/// Weyl increment added to key word 1 between rounds (sqrt(3) - 1).
pub(crate) const PHILOX_W1: u32 = 0xBB67_AE85;
/// Rounds in the standard, Crush-resistant variant.
const PHILOX_ROUNDS: usize = 10;
/// 2^-24: scales a 24-bit integer into [0, 1).
pub(crate) const UNIT_24_BITS: f32 = 1.0 / 16_777_216.0;

/// High and low 32-bit halves of the 64-bit product `a * b`.
#[inline]
fn mul_hi_lo(a: u32, b: u32) -> (u32, u32) {
    let product = u64::from(a) * u64::from(b);
    ((product >> 32) as u32, product as u32)
}

/// One Philox round: two multiplies, a word shuffle and the key mix.
#[inline]
fn round(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (hi0, lo0) = mul_hi_lo(PHILOX_M0, counter[0]);
    let (hi1, lo1) = mul_hi_lo(PHILOX_M1, counter[2]);
    [
        hi1 ^ counter[1] ^ key[0],
        lo1,
        hi0 ^ counter[3] ^ key[1],
        lo0,
    ]
}

/// The Philox4x32 block function with 10 rounds: four 32-bit random words
/// for one (counter, key) pair. The key is bumped by the Weyl constants
/// between rounds (nine bumps for ten rounds), as in Random123.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut state = counter;
    let mut round_key = key;
    for round_index in 0..PHILOX_ROUNDS {
        if round_index > 0 {
            round_key = [
                round_key[0].wrapping_add(PHILOX_W0),
                round_key[1].wrapping_add(PHILOX_W1),
            ];
        }
        state = round(state, round_key);
    }
    state
}

/// The uniform number in [0, 1) that decides the token sampled at absolute
/// `position` under `seed` (recipe in the module docs).
pub fn uniform(seed: u64, position: u64) -> f32 {
    let key = [seed as u32, (seed >> 32) as u32];
    let counter = [position as u32, (position >> 32) as u32, 0, 0];
    let word = philox4x32_10(counter, key)[0];
    (word >> 8) as f32 * UNIT_24_BITS
}

#[cfg(test)]
mod tests {
    use super::*;

    // Known-answer vectors published with Random123 (kat_vectors, philox4x32 10).
    #[test]
    fn zero_counter_and_key_match_the_published_vector() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
    }

    #[test]
    fn all_ones_counter_and_key_match_the_published_vector() {
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
    }

    #[test]
    fn pi_digits_vector_matches_the_published_vector() {
        let counter = [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344];
        let key = [0xa409_3822, 0x299f_31d0];
        assert_eq!(
            philox4x32_10(counter, key),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn uniform_follows_the_documented_bit_recipe() {
        let seed = 0x0123_4567_89ab_cdef_u64;
        let position = 0x0000_0001_0000_0007_u64;
        let word = philox4x32_10([7, 1, 0, 0], [0x89ab_cdef, 0x0123_4567])[0];
        let expected = (word >> 8) as f32 / 16_777_216.0;
        assert_eq!(uniform(seed, position).to_bits(), expected.to_bits());
        // Seed 0, position 0 is the zero known-answer vector's first word.
        assert_eq!(uniform(0, 0), (0x6627_e8d5_u32 >> 8) as f32 / 16_777_216.0);
    }

    #[test]
    fn uniform_is_a_pure_function_of_seed_and_position() {
        let forward: Vec<f32> = (0..100).map(|p| uniform(42, p)).collect();
        let backward: Vec<f32> = (0..100).rev().map(|p| uniform(42, p)).collect();
        let backward: Vec<f32> = backward.into_iter().rev().collect();
        assert_eq!(forward, backward);
        assert_ne!(uniform(42, 5), uniform(43, 5));
        assert_ne!(uniform(42, 5), uniform(42, 6));
        // The high position word takes part in the counter.
        assert_ne!(uniform(42, 5), uniform(42, 5 + (1 << 32)));
    }

    #[test]
    fn uniforms_over_positions_look_independent_and_uniform() {
        const DRAWS: usize = 64_000;
        const BINS: usize = 16;
        let values: Vec<f64> = (0..DRAWS as u64)
            .map(|p| f64::from(uniform(7, p)))
            .collect();
        assert!(values.iter().all(|&u| (0.0..1.0).contains(&u)));

        let mut counts = [0usize; BINS];
        for &u in &values {
            counts[(u * BINS as f64) as usize] += 1;
        }
        let expected = DRAWS as f64 / BINS as f64;
        let chi_square: f64 = counts
            .iter()
            .map(|&c| (c as f64 - expected).powi(2) / expected)
            .sum();
        // 15 degrees of freedom, significance 0.001.
        assert!(
            chi_square < 37.697,
            "chi-square {chi_square} over bins {counts:?}"
        );

        // Neighbouring positions must not be correlated.
        let mean = values.iter().sum::<f64>() / DRAWS as f64;
        let variance = values.iter().map(|u| (u - mean).powi(2)).sum::<f64>() / DRAWS as f64;
        let lag_one = values
            .windows(2)
            .map(|w| (w[0] - mean) * (w[1] - mean))
            .sum::<f64>()
            / (DRAWS - 1) as f64;
        let correlation = lag_one / variance;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
        assert!(correlation.abs() < 0.02, "lag-1 correlation {correlation}");
    }
}
