//! Constrained decoding: a request's JSON Schema, regular expression or
//! grammar (Lark, or GBNF rewritten into Lark) compiled once against the
//! model's vocabulary (by `llguidance`), then, step by step, the set of
//! tokens allowed next as a bitset the samplers apply before anything else,
//! and how the constraint ends a generation.

pub mod gbnf;
mod vocabulary;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use thiserror::Error;

use crate::stop::StopReason;
use crate::tokenizer::Tokenizer;

/// Longest constraint text taken (a schema, a regex or a grammar).
pub const MAX_CONSTRAINT_BYTES: usize = 64 * 1024;
/// Longest a compilation may take before the constraint is refused.
pub const MAX_COMPILE_TIME: Duration = Duration::from_secs(2);

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConstraintSpec {
    /// A JSON Schema (a JSON document).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// A regular expression the whole output matches.
    Regex(String),
    /// A context-free grammar in llguidance's Lark syntax.
    Lark(String),
    /// A context-free grammar in llama.cpp's GBNF (see [`gbnf`]).
    Gbnf(String),
}

impl ConstraintSpec {
    /// The kind, for errors and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ConstraintSpec::JsonSchema(_) => "json_schema",
            ConstraintSpec::JsonObject => "json_object",
            ConstraintSpec::Regex(_) => "regex",
            ConstraintSpec::Lark(_) => "grammar",
            ConstraintSpec::Gbnf(_) => "gbnf",
        }
    }

    fn text_len(&self) -> usize {
        match self {
            ConstraintSpec::JsonSchema(s)
            | ConstraintSpec::Regex(s)
            | ConstraintSpec::Lark(s)
            | ConstraintSpec::Gbnf(s) => s.len(),
            ConstraintSpec::JsonObject => 0,
        }
    }
}

/// Why a constraint could not be compiled or stepped.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ConstraintError {
    #[error("the {kind} constraint is {len} bytes; at most {MAX_CONSTRAINT_BYTES} are accepted")]
    TooLarge { kind: &'static str, len: usize },
    #[error("the {kind} constraint does not compile: {message}")]
    Invalid { kind: &'static str, message: String },
    #[error(
        "the {kind} constraint took {took:?} to compile; at most {MAX_COMPILE_TIME:?} is allowed"
    )]
    TooSlow { kind: &'static str, took: Duration },
    #[error("the constraint failed while generating: {0}")]
    Step(String),
}

/// Compiles constraints for one model's vocabulary; shared by the threads
/// that take requests.
pub struct ConstraintCompiler {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for ConstraintCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintCompiler")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl ConstraintCompiler {
    /// A compiler over the tokenizer's tokens, for logits rows of `vocab`
    /// entries (rows past the tokenizer's own tokens are never allowed).
    pub fn new(tokenizer: &Tokenizer, vocab: usize) -> Result<Arc<Self>, ConstraintError> {
        let env = vocabulary::token_env(tokenizer, vocab);
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| ConstraintError::Invalid {
                kind: "vocabulary",
                message: e.to_string(),
            })?;
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(Arc::new(Self { factory, vocab }))
    }

    /// The logits row length masks are made for.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Compiles `spec`, within [`MAX_CONSTRAINT_BYTES`] and
    /// [`MAX_COMPILE_TIME`].
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Constraint, ConstraintError> {
        let kind = spec.kind();
        let len = spec.text_len();
        if len > MAX_CONSTRAINT_BYTES {
            return Err(ConstraintError::TooLarge { kind, len });
        }
        let invalid = |message: String| ConstraintError::Invalid { kind, message };
        let grammar = match spec {
            ConstraintSpec::JsonSchema(text) => {
                let schema: serde_json::Value =
                    serde_json::from_str(text).map_err(|e| invalid(format!("not JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(with_separators(schema))
            }
            ConstraintSpec::JsonObject => TopLevelGrammar::from_json_schema(with_separators(
                serde_json::json!({"type": "object"}),
            )),
            ConstraintSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            ConstraintSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            ConstraintSpec::Gbnf(gbnf) => {
                TopLevelGrammar::from_lark(gbnf::to_lark(gbnf).map_err(invalid)?)
            }
        };
        let started = Instant::now();
        let parser = guarded(|| self.factory.create_parser(grammar), invalid)?;
        let mut matcher = Matcher::new(Ok(parser));
        // The first mask is where most grammars do their lazy work: an
        // unusable one fails here, at the request, not mid-generation.
        let first = guarded(|| matcher.compute_mask(), invalid)?;
        let took = started.elapsed();
        if took > MAX_COMPILE_TIME {
            return Err(ConstraintError::TooSlow { kind, took });
        }
        Ok(Constraint {
            matcher,
            vocab: self.vocab,
            first: Some(first),
            eos: self.factory.tok_env().tok_trie().eos_token(),
        })
    }
}

/// The schema with fixed separators (`, ` and `: `, as Python's `json`
/// writes them) unless it sets its own (`x-guidance`): free whitespace
/// lets a small model pad forever.
pub(crate) fn with_separators(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// The limits a constraint compiles and steps within.
fn limits() -> ParserLimits {
    ParserLimits {
        // Enough for real schemas (a few hundred properties, enums of a
        // few thousand values); a hostile one fails on fuel, not time.
        max_grammar_size: 200_000,
        max_lexer_states: 100_000,
        ..ParserLimits::default()
    }
}

/// Runs a call into llguidance: its error, or a panic (input from the
/// wire must not take a thread down), as `error` of its message.
fn guarded<T, E: std::fmt::Display>(
    call: impl FnOnce() -> Result<T, E>,
    error: impl Fn(String) -> ConstraintError,
) -> Result<T, ConstraintError> {
    catch_unwind(AssertUnwindSafe(call))
        .map_err(|_| error("the constraint library failed on it".into()))?
        .map_err(|e| error(one_line(&e.to_string())))
}

/// The compiler's message on one line (its multi-line reports joined),
/// at most 500 characters.
fn one_line(message: &str) -> String {
    let joined = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    joined.chars().take(500).collect()
}

/// What the constraint allows next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allowed {
    /// The tokens set in the mask.
    Tokens,
    /// The text is complete: nothing may follow.
    Complete,
    /// No token can continue it (a grammar the vocabulary cannot finish).
    Stuck,
}

impl Allowed {
    /// How the generation ends here, if it does.
    pub fn end(self) -> Option<StopReason> {
        match self {
            Allowed::Tokens => None,
            Allowed::Complete => Some(StopReason::ConstraintDone),
            Allowed::Stuck => Some(StopReason::ConstraintUnfinished),
        }
    }
}

/// One Generate's constraint: where its output is in the grammar.
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
    /// The mask computed at compilation, used by the first step.
    first: Option<llguidance::toktrie::SimpleVob>,
    /// The vocabulary's end token inside the grammar's masks: set where the
    /// text may end.
    eos: u32,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

/// Words of a mask over `vocab` tokens (bit `t % 32` of word `t / 32`).
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

impl Constraint {
    /// Writes the tokens allowed next into `mask` ([`mask_words`] words):
    /// the grammar's, and `stop_ids` where the text may end.
    pub fn allowed(
        &mut self,
        stop_ids: &[u32],
        mask: &mut Vec<u32>,
    ) -> Result<Allowed, ConstraintError> {
        mask.clear();
        mask.resize(mask_words(self.vocab), 0);
        if self.matcher.is_stopped() {
            return Ok(Allowed::Complete);
        }
        let vob = match self.first.take() {
            Some(vob) => vob,
            None => guarded(|| self.matcher.compute_mask(), ConstraintError::Step)?,
        };
        let words = vob.as_slice();
        let n = words.len().min(mask.len());
        mask[..n].copy_from_slice(&words[..n]);
        let may_end = vob.is_allowed(self.eos);
        // The grammar's end token stands for "may end": the session's own
        // stop ids take its place.
        clear(mask, self.eos);
        if let Some(last) = mask.last_mut() {
            let tail = self.vocab % 32;
            if tail != 0 {
                *last &= (1u32 << tail) - 1;
            }
        }
        let continues = mask.iter().any(|&w| w != 0);
        if may_end {
            for &id in stop_ids {
                if (id as usize) < self.vocab {
                    mask[id as usize / 32] |= 1 << (id % 32);
                }
            }
        }
        Ok(match (continues, may_end) {
            (false, true) => Allowed::Complete,
            (false, false) => Allowed::Stuck,
            (true, _) => Allowed::Tokens,
        })
    }

    /// Moves past a sampled `token` (one the last mask allowed). A stop id
    /// is allowed only where the text may end: it ends the text, and there
    /// is nothing to move past.
    pub fn accept(&mut self, token: u32, stop_ids: &[u32]) -> Result<(), ConstraintError> {
        if stop_ids.contains(&token) {
            return Ok(());
        }
        guarded(|| self.matcher.consume_token(token), ConstraintError::Step)
    }

    /// How the generation ends once a token went out, if it does: `stopped`
    /// says whether that token was a stop id (the text ended where it may);
    /// otherwise it ends when the text is complete (nothing may follow).
    pub fn end_after(&self, stopped: bool) -> Option<StopReason> {
        (stopped || self.matcher.is_stopped()).then_some(StopReason::ConstraintDone)
    }

    /// Whether the text so far is a whole match (it may end here).
    pub fn may_end(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }

    /// A copy at the same point of the grammar, to work out the masks of
    /// proposed tokens (speculative decoding) without moving this one.
    fn probe(&self) -> Constraint {
        Constraint {
            matcher: self.matcher.clone(),
            vocab: self.vocab,
            first: None,
            eos: self.eos,
        }
    }

    /// How many of `tokens` the grammar takes one after another from here,
    /// stopping before a stop id (the text would end there) or anything
    /// out of the vocabulary. Nothing moves.
    pub fn valid_prefix(&self, tokens: &[u32], stop_ids: &[u32]) -> usize {
        let upto = tokens
            .iter()
            .position(|t| stop_ids.contains(t) || *t as usize >= self.vocab || *t == self.eos)
            .unwrap_or(tokens.len());
        if upto == 0 || self.matcher.is_stopped() {
            return 0;
        }
        // On a copy: a refused token may leave a matcher in an error state.
        let mut probe = self.probe();
        guarded(
            || probe.matcher.validate_tokens(&tokens[..upto]),
            ConstraintError::Step,
        )
        .unwrap_or(0)
    }

    /// The masks under which each position of `proposal` (tokens that may
    /// follow the text so far) is sampled, each after the tokens before it,
    /// into `masks[j]`; returns how many positions have one. It stops where
    /// the text would be complete or stuck (nothing is sampled there), and
    /// after a token the grammar refuses (whose own position still gets its
    /// mask). Nothing moves: a copy walks the proposal.
    pub fn proposal_masks(
        &self,
        proposal: &[u32],
        stop_ids: &[u32],
        masks: &mut Vec<Vec<u32>>,
    ) -> usize {
        let mut probe = self.probe();
        masks.resize_with(masks.len().max(proposal.len()), Vec::new);
        for (j, &token) in proposal.iter().enumerate() {
            match probe.allowed(stop_ids, &mut masks[j]) {
                Ok(Allowed::Tokens) => {}
                _ => return j,
            }
            let taken = masks[j]
                .get(token as usize / 32)
                .is_some_and(|w| w & (1 << (token % 32)) != 0);
            if !taken || probe.accept(token, stop_ids).is_err() {
                return j + 1;
            }
        }
        proposal.len()
    }

    /// How a generation that reached `max_tokens` ends: a text cut mid-match
    /// does not meet its constraint, and says so.
    pub fn end_at_limit(&mut self) -> StopReason {
        if self.may_end() {
            StopReason::MaxTokens
        } else {
            StopReason::ConstraintUnfinished
        }
    }
}

fn clear(mask: &mut [u32], id: u32) {
    if let Some(word) = mask.get_mut(id as usize / 32) {
        *word &= !(1 << (id % 32));
    }
}
