//! Sampling parameters: the knobs a request sets, with their "off" values and
//! the checks that reject nonsense before any logit is touched.

use super::SamplerError;

/// The smallest temperature other than 0 (greedy). Below it `1 / T` leaves
/// the useful range of f32: at `1e-45` it is +inf and the top token's
/// weight `(x - m) * (1 / T)` is `0 * inf` = NaN, so nothing could be
/// chosen. Any temperature this small samples the argmax (or ties) anyway,
/// so a client wanting that asks for 0; both samplers (CPU and WGSL) only
/// ever see `1 / T <= 1e5`.
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// How to turn logits into a token. Every knob has an "off" value (given in
/// its doc); [`SamplingParams::greedy`] has them all off.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax). Otherwise finite and
    /// at least [`MIN_TEMPERATURE`].
    pub temperature: f32,
    /// Keep only the `top_k` highest logits; `0` = off.
    pub top_k: u32,
    /// Nucleus filter: keep the smallest top prefix holding probability mass
    /// `>= top_p`; `1` = off. Must lie in (0, 1].
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the largest
    /// probability; `0` = off. Must lie in [0, 1].
    pub min_p: f32,
    /// llama.cpp repetition penalty: a seen token's positive logit is multiplied
    /// by its reciprocal, a non-positive one multiplied; `1` = off. Must be finite, `> 0`.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty: subtracted once from a seen token's logit; `0` = off.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted once per occurrence; `0` = off.
    pub frequency_penalty: f32,
    /// How many of the most recent history tokens the penalties look at;
    /// `0` = the whole history.
    pub penalty_last_n: usize,
    /// Additive logit bias `(token, bias)`, applied in list order (a token
    /// listed twice gets both). Biases must be finite.
    pub logit_bias: Vec<(u32, f32)>,
    /// Key of the random stream; with the absolute position it fixes the draw.
    pub seed: u64,
}

impl SamplingParams {
    /// Greedy decoding with every other knob off and seed 0.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }

    /// True when the token is the argmax (temperature 0). Penalties and bias
    /// still apply; top-k, top-p, min-p and the seed are then ignored.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// `1 / temperature` in f32: the sampler multiplies by it rather than
    /// dividing, so the CPU and a shader round the same way.
    pub fn inverse_temperature(&self) -> f32 {
        1.0 / self.temperature
    }

    /// True when any of the three history penalties is on.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// True when penalties or bias may change the logits before selection.
    pub fn adjusts_logits(&self) -> bool {
        self.has_penalties() || !self.logit_bias.is_empty()
    }

    /// Checks every knob against its documented range and every bias token
    /// against the vocabulary size.
    pub fn validate(&self, vocab_size: usize) -> Result<(), SamplerError> {
        if vocab_size == 0 {
            return Err(SamplerError::EmptyLogits);
        }
        if vocab_size > u32::MAX as usize {
            return Err(SamplerError::VocabTooLarge { vocab_size });
        }
        // Written as negated comparisons so NaN fails each check.
        let t = self.temperature;
        if !(t == 0.0 || (t >= MIN_TEMPERATURE && t.is_finite())) {
            return Err(SamplerError::InvalidTemperature {
                value: self.temperature,
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplerError::InvalidTopP { value: self.top_p });
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(SamplerError::InvalidMinP { value: self.min_p });
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(SamplerError::InvalidRepetitionPenalty {
                value: self.repetition_penalty,
            });
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !value.is_finite() {
                return Err(SamplerError::NonFinitePenalty { name, value });
            }
        }
        for &(token, value) in &self.logit_bias {
            if !value.is_finite() {
                return Err(SamplerError::NonFiniteLogitBias { token, value });
            }
            if token as usize >= vocab_size {
                return Err(SamplerError::LogitBiasTokenOutOfRange { token, vocab_size });
            }
        }
        Ok(())
    }

    /// [`SamplingParams::validate`], once: the parameters come back as
    /// [`CheckedParams`], which the samplers take per token without
    /// checking them again.
    pub fn checked(self, vocab_size: usize) -> Result<CheckedParams, SamplerError> {
        self.validate(vocab_size)?;
        Ok(CheckedParams {
            params: self,
            vocab_size,
        })
    }
}

/// Sampling parameters that passed [`SamplingParams::validate`] for a
/// vocabulary of [`CheckedParams::vocab_size`] tokens. Only
/// [`SamplingParams::checked`] makes one, and it cannot be changed after.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedParams {
    params: SamplingParams,
    vocab_size: usize,
}

impl CheckedParams {
    /// The vocabulary the parameters were checked against.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}

impl std::ops::Deref for CheckedParams {
    type Target = SamplingParams;

    fn deref(&self) -> &SamplingParams {
        &self.params
    }
}

impl Default for SamplingParams {
    /// The default is greedy decoding.
    fn default() -> Self {
        Self::greedy()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(edit: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut params = SamplingParams::greedy();
        edit(&mut params);
        params
    }

    #[test]
    fn greedy_params_are_valid_and_greedy() {
        let params = SamplingParams::greedy();
        assert_eq!(params.validate(10), Ok(()));
        assert!(params.is_greedy());
        assert!(!params.adjusts_logits());
        assert!(!with(|p| p.temperature = 0.7).is_greedy());
        assert!(with(|p| p.repetition_penalty = 1.1).has_penalties());
        assert!(with(|p| p.logit_bias = vec![(1, 2.0)]).adjusts_logits());
    }

    #[test]
    fn edge_values_inside_the_ranges_are_accepted() {
        let params = with(|p| {
            p.temperature = 2.0;
            p.top_p = 1.0;
            p.min_p = 1.0;
            p.repetition_penalty = 1e-3;
            p.presence_penalty = -2.0;
            p.frequency_penalty = 2.0;
            p.logit_bias = vec![(9, -100.0)];
        });
        assert_eq!(params.validate(10), Ok(()));
        assert_eq!(with(|p| p.min_p = 0.0).validate(1), Ok(()));
    }

    #[test]
    fn the_smallest_temperature_samples_without_overflow() {
        let params = with(|p| p.temperature = MIN_TEMPERATURE);
        assert_eq!(params.validate(4), Ok(()));
        assert!(params.inverse_temperature().is_finite());
        assert_eq!(with(|p| p.temperature = -0.0).validate(4), Ok(()));
        // Logit gaps from tiny to huge: the top token still wins, no NaN.
        let logits = [3.0e4, -1.0e30, 3.0e4 - 1.0e-3, 1.0];
        let mut sampler = super::super::Sampler::new();
        for position in 0..16 {
            let token = sampler
                .sample(&logits, &params, &[], position)
                .expect("a token");
            assert!(token == 0 || token == 2, "{token}");
        }
    }

    #[test]
    fn a_too_small_temperature_names_the_bound() {
        let message = SamplerError::InvalidTemperature { value: 1e-45 }.to_string();
        assert!(message.contains("0.00001"), "{message}");
    }

    #[test]
    fn bad_vocab_sizes_are_rejected() {
        assert_eq!(
            SamplingParams::greedy().validate(0),
            Err(SamplerError::EmptyLogits)
        );
    }

    #[test]
    fn each_bad_knob_gives_its_own_error() {
        let cases: Vec<(SamplingParams, SamplerError)> = vec![
            (
                with(|p| p.temperature = -0.1),
                SamplerError::InvalidTemperature { value: -0.1 },
            ),
            (
                with(|p| p.temperature = f32::INFINITY),
                SamplerError::InvalidTemperature {
                    value: f32::INFINITY,
                },
            ),
            (
                with(|p| p.temperature = 1e-45),
                SamplerError::InvalidTemperature { value: 1e-45 },
            ),
            (
                with(|p| p.temperature = MIN_TEMPERATURE * 0.99),
                SamplerError::InvalidTemperature {
                    value: MIN_TEMPERATURE * 0.99,
                },
            ),
            (
                with(|p| p.top_p = 0.0),
                SamplerError::InvalidTopP { value: 0.0 },
            ),
            (
                with(|p| p.top_p = 1.5),
                SamplerError::InvalidTopP { value: 1.5 },
            ),
            (
                with(|p| p.min_p = -0.5),
                SamplerError::InvalidMinP { value: -0.5 },
            ),
            (
                with(|p| p.min_p = 1.01),
                SamplerError::InvalidMinP { value: 1.01 },
            ),
            (
                with(|p| p.repetition_penalty = 0.0),
                SamplerError::InvalidRepetitionPenalty { value: 0.0 },
            ),
            (
                with(|p| p.repetition_penalty = -1.0),
                SamplerError::InvalidRepetitionPenalty { value: -1.0 },
            ),
            (
                with(|p| p.presence_penalty = f32::NEG_INFINITY),
                SamplerError::NonFinitePenalty {
                    name: "presence_penalty",
                    value: f32::NEG_INFINITY,
                },
            ),
            (
                with(|p| p.frequency_penalty = f32::INFINITY),
                SamplerError::NonFinitePenalty {
                    name: "frequency_penalty",
                    value: f32::INFINITY,
                },
            ),
            (
                with(|p| p.logit_bias = vec![(2, f32::INFINITY)]),
                SamplerError::NonFiniteLogitBias {
                    token: 2,
                    value: f32::INFINITY,
                },
            ),
            (
                with(|p| p.logit_bias = vec![(0, 1.0), (10, 1.0)]),
                SamplerError::LogitBiasTokenOutOfRange {
                    token: 10,
                    vocab_size: 10,
                },
            ),
        ];
        for (params, expected) in cases {
            assert_eq!(params.validate(10), Err(expected.clone()), "{params:?}");
        }
    }

    #[test]
    fn nan_knobs_are_rejected() {
        // NaN != NaN, so compare the variant, not the payload.
        assert!(matches!(
            with(|p| p.temperature = f32::NAN).validate(4),
            Err(SamplerError::InvalidTemperature { .. })
        ));
        assert!(matches!(
            with(|p| p.top_p = f32::NAN).validate(4),
            Err(SamplerError::InvalidTopP { .. })
        ));
        assert!(matches!(
            with(|p| p.min_p = f32::NAN).validate(4),
            Err(SamplerError::InvalidMinP { .. })
        ));
        assert!(matches!(
            with(|p| p.repetition_penalty = f32::NAN).validate(4),
            Err(SamplerError::InvalidRepetitionPenalty { .. })
        ));
        assert!(matches!(
            with(|p| p.frequency_penalty = f32::NAN).validate(4),
            Err(SamplerError::NonFinitePenalty {
                name: "frequency_penalty",
                ..
            })
        ));
        assert!(matches!(
            with(|p| p.logit_bias = vec![(1, f32::NAN)]).validate(4),
            Err(SamplerError::NonFiniteLogitBias { token: 1, .. })
        ));
    }

    #[test]
    fn error_messages_carry_the_numbers() {
        let message = SamplerError::LogitBiasTokenOutOfRange {
            token: 70000,
            vocab_size: 49152,
        }
        .to_string();
        assert!(
            message.contains("70000") && message.contains("49152"),
            "{message}"
        );
    }
}
