//! What the host and `shaders/sampler.wgsl` agree on: the constants the
//! shader is compiled with (prepended to its source, so neither side can
//! drift) and the word layout of one row's request.

use std::fmt::Write as _;

use crate::sampler::philox::{PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1, UNIT_24_BITS};
use crate::sampler::{
    penalty_window, RowRequest, SamplingParams, EXP_COEFFICIENTS, EXP_MAX_ARG, EXP_MIN_ARG, LN2_HI,
    LN2_LO, LOG2_E, MAX_TOP_LOGPROBS, ROUND_MAGIC, SUM_BLOCK_LEN, TOP_P_FIRST_PREFIX,
    TOP_P_PREFIX_GROWTH,
};

/// Threads per workgroup; one workgroup samples one row. The shader's
/// 256-bin radix histogram gives every thread exactly one bin.
pub const WORKGROUP_SIZE: u32 = 256;
const _: () = assert!(WORKGROUP_SIZE == 256);

/// Largest vocabulary the shader's workgroup block-sum array covers.
pub const MAX_VOCAB: u32 = 1 << 18;
/// Entries of that array.
const MAX_BLOCKS: u32 = MAX_VOCAB / SUM_BLOCK_LEN;
/// Token ids fit in 24 bits (checked against `MAX_VOCAB`); a composite rank
/// key stores `ID_MASK - id` so lower ids rank first among equal logits.
const ID_MASK: u32 = 0x00ff_ffff;
const _: () = assert!(MAX_VOCAB <= ID_MASK);

/// Words of one row's parameters at the start of the request buffer.
pub const PARAM_WORDS: usize = 20;
/// Words of one row's result: token id, status, the log-probability report
/// (chosen token, normaliser, +inf count, entries) and its top entries as
/// (id, logit - max) pairs.
pub const RESULT_WORDS: usize = R_TOP + 2 * MAX_TOP_LOGPROBS;

/// Word indices inside a row's result.
pub const R_TOKEN: usize = 0;
pub const R_STATUS: usize = 1;
/// The chosen token's logit minus the maximum (f32 bits).
pub const R_CHOSEN: usize = 2;
/// Blocked sum of weight_exp(x - max) over the finite logits (f32 bits).
pub const R_NORMALISER: usize = 3;
/// How many logits are +inf (then they share the mass and the rest is out).
pub const R_INFINITIES: usize = 4;
/// Entries of the top list that follow.
pub const R_TOP_COUNT: usize = 5;
pub const R_TOP: usize = 8;

/// Flag bits of `P_FLAGS`.
const FLAG_GREEDY: u32 = 1;
const FLAG_PENALTIES: u32 = 2;
const FLAG_ADJUSTS: u32 = 4;
const FLAG_MASK: u32 = 8;

/// Result statuses.
pub const STATUS_OK: u32 = 0;
pub const STATUS_NO_CANDIDATE: u32 = 1;

/// Word indices inside a row's parameters.
const P_FLAGS: usize = 0;
const P_TOP_K: usize = 1;
const P_TOP_P: usize = 2;
const P_MIN_P: usize = 3;
const P_INVERSE_TEMPERATURE: usize = 4;
const P_REPETITION: usize = 5;
const P_INVERSE_REPETITION: usize = 6;
const P_PRESENCE: usize = 7;
const P_FREQUENCY: usize = 8;
const P_HISTORY_OFFSET: usize = 9;
const P_HISTORY_LEN: usize = 10;
const P_BIAS_OFFSET: usize = 11;
const P_BIAS_LEN: usize = 12;
const P_SEED_LO: usize = 13;
const P_SEED_HI: usize = 14;
const P_POSITION_LO: usize = 15;
const P_POSITION_HI: usize = 16;
const P_TOP_LOGPROBS: usize = 17;
/// Which row of the bound logits buffer the row samples.
const P_LOGITS_ROW: usize = 18;
/// Where the row's token mask starts (with `FLAG_MASK`): `[vocab / 32]`
/// words, bit `t % 32` of word `t / 32` set where token `t` is allowed.
const P_MASK_OFFSET: usize = 19;
const _: () = assert!(P_MASK_OFFSET < PARAM_WORDS);

/// An f32 as an exact WGSL hexadecimal float literal (normal numbers only,
/// which is all the constants are).
fn wgsl_f32(value: f32) -> String {
    let bits = value.to_bits();
    let sign = if bits >> 31 == 1 { "-" } else { "" };
    let exponent = ((bits >> 23) & 0xff) as i32 - 127;
    let mantissa = (bits & 0x7f_ffff) << 1;
    if value == 0.0 {
        return "0.0f".into();
    }
    format!("{sign}0x1.{mantissa:06x}p{exponent}f")
}

/// The shader source: the shared constants, then `shaders/sampler.wgsl`.
pub fn shader_source() -> String {
    let mut header = String::new();
    let words = [
        ("WORKGROUP_SIZE", WORKGROUP_SIZE),
        ("SUM_BLOCK_LEN", SUM_BLOCK_LEN),
        ("MAX_BLOCKS", MAX_BLOCKS),
        ("ID_MASK", ID_MASK),
        ("TOP_P_FIRST_PREFIX", TOP_P_FIRST_PREFIX as u32),
        ("TOP_P_PREFIX_GROWTH", TOP_P_PREFIX_GROWTH as u32),
        ("PARAM_WORDS", PARAM_WORDS as u32),
        ("RESULT_WORDS", RESULT_WORDS as u32),
        ("FLAG_GREEDY", FLAG_GREEDY),
        ("FLAG_PENALTIES", FLAG_PENALTIES),
        ("FLAG_ADJUSTS", FLAG_ADJUSTS),
        ("FLAG_MASK", FLAG_MASK),
        ("STATUS_OK", STATUS_OK),
        ("STATUS_NO_CANDIDATE", STATUS_NO_CANDIDATE),
        ("P_FLAGS", P_FLAGS as u32),
        ("P_TOP_K", P_TOP_K as u32),
        ("P_TOP_P", P_TOP_P as u32),
        ("P_MIN_P", P_MIN_P as u32),
        ("P_INVERSE_TEMPERATURE", P_INVERSE_TEMPERATURE as u32),
        ("P_REPETITION", P_REPETITION as u32),
        ("P_INVERSE_REPETITION", P_INVERSE_REPETITION as u32),
        ("P_PRESENCE", P_PRESENCE as u32),
        ("P_FREQUENCY", P_FREQUENCY as u32),
        ("P_HISTORY_OFFSET", P_HISTORY_OFFSET as u32),
        ("P_HISTORY_LEN", P_HISTORY_LEN as u32),
        ("P_BIAS_OFFSET", P_BIAS_OFFSET as u32),
        ("P_BIAS_LEN", P_BIAS_LEN as u32),
        ("P_SEED_LO", P_SEED_LO as u32),
        ("P_SEED_HI", P_SEED_HI as u32),
        ("P_POSITION_LO", P_POSITION_LO as u32),
        ("P_POSITION_HI", P_POSITION_HI as u32),
        ("P_TOP_LOGPROBS", P_TOP_LOGPROBS as u32),
        ("P_LOGITS_ROW", P_LOGITS_ROW as u32),
        ("P_MASK_OFFSET", P_MASK_OFFSET as u32),
        ("R_CHOSEN", R_CHOSEN as u32),
        ("R_NORMALISER", R_NORMALISER as u32),
        ("R_INFINITIES", R_INFINITIES as u32),
        ("R_TOP_COUNT", R_TOP_COUNT as u32),
        ("R_TOP", R_TOP as u32),
        ("PHILOX_M0", PHILOX_M0),
        ("PHILOX_M1", PHILOX_M1),
        ("PHILOX_W0", PHILOX_W0),
        ("PHILOX_W1", PHILOX_W1),
    ];
    for (name, value) in words {
        let _ = writeln!(header, "const {name}: u32 = {value}u;");
    }
    let floats = [
        ("EXP_MIN_ARG", EXP_MIN_ARG),
        ("EXP_MAX_ARG", EXP_MAX_ARG),
        ("ROUND_MAGIC", ROUND_MAGIC),
        ("LN2_HI", LN2_HI),
        ("LN2_LO", LN2_LO),
        ("LOG2_E", LOG2_E),
        ("UNIT_24_BITS", UNIT_24_BITS),
    ];
    let coefficients = EXP_COEFFICIENTS
        .iter()
        .enumerate()
        .map(|(i, &c)| (format!("EXP_C{i}"), c));
    for (name, value) in floats
        .into_iter()
        .map(|(n, v)| (n.to_string(), v))
        .chain(coefficients)
    {
        let _ = writeln!(header, "const {name}: f32 = {};", wgsl_f32(value));
    }
    header + include_str!("../../../shaders/sampler.wgsl")
}

/// Words one row adds to the request buffer: its parameters, its penalty
/// window (only when a penalty is on), its bias entries and its token mask.
pub fn request_words(params: &SamplingParams, history: &[u32], mask: Option<&[u32]>) -> usize {
    PARAM_WORDS
        + penalised_history(params, history).len()
        + 2 * params.logit_bias.len()
        + mask.map_or(0, <[u32]>::len)
}

fn penalised_history<'h>(params: &SamplingParams, history: &'h [u32]) -> &'h [u32] {
    if params.has_penalties() {
        penalty_window(history, params.penalty_last_n)
    } else {
        &[]
    }
}

/// Writes row `row`'s parameters at `row * PARAM_WORDS` and its history and
/// bias at `*tail` (advanced past them), to sample row `logits_row` of the
/// bound logits. `words` must hold them.
pub fn pack_row(
    words: &mut [u32],
    row: usize,
    logits_row: u32,
    tail: &mut usize,
    request: &RowRequest<'_>,
) {
    let RowRequest {
        params,
        history,
        position,
        top_logprobs,
        mask,
    } = *request;
    let window = penalised_history(params, history);
    let history_offset = *tail;
    words[history_offset..history_offset + window.len()].copy_from_slice(window);
    let bias_offset = history_offset + window.len();
    for (i, &(token, bias)) in params.logit_bias.iter().enumerate() {
        words[bias_offset + 2 * i] = token;
        words[bias_offset + 2 * i + 1] = bias.to_bits();
    }
    *tail = bias_offset + 2 * params.logit_bias.len();
    let mask_offset = *tail;
    if let Some(mask) = mask {
        words[mask_offset..mask_offset + mask.len()].copy_from_slice(mask);
        *tail += mask.len();
    }

    let mut flags = 0;
    if params.is_greedy() {
        flags |= FLAG_GREEDY;
    }
    if params.has_penalties() {
        flags |= FLAG_PENALTIES;
    }
    if params.adjusts_logits() || mask.is_some() {
        flags |= FLAG_ADJUSTS;
    }
    if mask.is_some() {
        flags |= FLAG_MASK;
    }
    let p = &mut words[row * PARAM_WORDS..(row + 1) * PARAM_WORDS];
    p.fill(0);
    p[P_FLAGS] = flags;
    p[P_TOP_K] = params.top_k;
    p[P_TOP_P] = params.top_p.to_bits();
    p[P_MIN_P] = params.min_p.to_bits();
    p[P_INVERSE_TEMPERATURE] = params.inverse_temperature().to_bits();
    p[P_REPETITION] = params.repetition_penalty.to_bits();
    p[P_INVERSE_REPETITION] = (1.0 / params.repetition_penalty).to_bits();
    p[P_PRESENCE] = params.presence_penalty.to_bits();
    p[P_FREQUENCY] = params.frequency_penalty.to_bits();
    p[P_HISTORY_OFFSET] = history_offset as u32;
    p[P_HISTORY_LEN] = window.len() as u32;
    p[P_BIAS_OFFSET] = bias_offset as u32;
    p[P_BIAS_LEN] = params.logit_bias.len() as u32;
    p[P_SEED_LO] = params.seed as u32;
    p[P_SEED_HI] = (params.seed >> 32) as u32;
    p[P_POSITION_LO] = position as u32;
    p[P_POSITION_HI] = (position >> 32) as u32;
    p[P_TOP_LOGPROBS] = top_logprobs.min(MAX_TOP_LOGPROBS) as u32;
    p[P_LOGITS_ROW] = logits_row;
    p[P_MASK_OFFSET] = if mask.is_some() {
        mask_offset as u32
    } else {
        0
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hexadecimal_floats_are_exact() {
        assert_eq!(wgsl_f32(1.0), "0x1.000000p0f");
        assert_eq!(wgsl_f32(-86.0), "-0x1.580000p6f");
        assert_eq!(wgsl_f32(0.5), "0x1.000000p-1f");
        assert_eq!(wgsl_f32(UNIT_24_BITS), "0x1.000000p-24f");
        assert_eq!(wgsl_f32(0.0), "0.0f");
    }

    #[test]
    fn the_shader_source_names_every_constant_once() {
        let source = shader_source();
        for name in ["WORKGROUP_SIZE", "EXP_C7", "PHILOX_W1", "P_POSITION_HI"] {
            let needle = format!("const {name}:");
            assert_eq!(source.matches(&needle).count(), 1, "{name}");
        }
    }

    #[test]
    fn a_row_packs_its_window_only_when_penalised() {
        let mut params = SamplingParams::greedy();
        params.logit_bias = vec![(3, 1.5)];
        let history = [1, 2, 3];
        assert_eq!(request_words(&params, &history, None), PARAM_WORDS + 2);
        params.presence_penalty = 0.5;
        params.penalty_last_n = 2;
        assert_eq!(request_words(&params, &history, None), PARAM_WORDS + 2 + 2);
        let mut words = vec![0u32; 2 * PARAM_WORDS + 8];
        let mut tail = 2 * PARAM_WORDS;
        let logits = [0.0f32; 8];
        let params = params.checked(logits.len()).expect("valid");
        let request = RowRequest {
            params: &params,
            history: &history,
            position: 7,
            top_logprobs: 50,
            mask: None,
        };
        pack_row(&mut words, 1, 5, &mut tail, &request);
        assert_eq!(words[PARAM_WORDS + P_LOGITS_ROW], 5);
        let p = &words[PARAM_WORDS..2 * PARAM_WORDS];
        assert_eq!(p[P_HISTORY_LEN], 2);
        assert_eq!(&words[p[P_HISTORY_OFFSET] as usize..][..2], &[2, 3]);
        assert_eq!(words[p[P_BIAS_OFFSET] as usize], 3);
        assert_eq!(p[P_POSITION_LO], 7);
        assert_eq!(p[P_TOP_LOGPROBS], MAX_TOP_LOGPROBS as u32);
        assert_eq!(tail, 2 * PARAM_WORDS + 4);
    }
}
