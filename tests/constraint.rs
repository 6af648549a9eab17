//! Constraints compiled against the reference model's vocabulary: a walk
//! through the allowed tokens ends in text the constraint accepts; bad and
//! hostile constraints are refused with the compiler's message, quickly.

mod support;

use std::time::{Duration, Instant};

use inferd::constraint::{Allowed, ConstraintCompiler, ConstraintError, ConstraintSpec};
use inferd::gguf::GgufFile;
use inferd::tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn tokenizer() -> Option<Tokenizer> {
    if !support::have_reference() {
        return None;
    }
    let file = GgufFile::open(support::REFERENCE).expect("reference model opens");
    Some(Tokenizer::from_gguf(&file).expect("tokenizer"))
}

/// Walks the constraint with random allowed tokens until it is complete;
/// returns the text.
fn walk(
    compiler: &ConstraintCompiler,
    tok: &Tokenizer,
    spec: &ConstraintSpec,
    seed: u64,
) -> String {
    let mut c = compiler.compile(spec).expect("compiles");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut mask = Vec::new();
    let mut ids = Vec::new();
    let eos = tok.eos().expect("an EOS");
    for _ in 0..400 {
        match c.allowed(&[eos], &mut mask).expect("mask") {
            Allowed::Complete => return tok.decode(&ids).expect("decodes"),
            Allowed::Stuck => panic!("stuck after {:?}", tok.decode(&ids)),
            Allowed::Tokens => {}
        }
        let allowed: Vec<u32> = (0..compiler.vocab() as u32)
            .filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1)
            .collect();
        assert!(!allowed.is_empty());
        let t = allowed[rng.gen_range(0..allowed.len())];
        if t == eos {
            assert!(c.may_end(), "EOS allowed only where the text may end");
            return tok.decode(&ids).expect("decodes");
        }
        c.accept(t, &[eos]).expect("an allowed token is accepted");
        ids.push(t);
    }
    panic!("no end after 400 tokens: {:?}", tok.decode(&ids));
}

#[test]
fn a_walk_through_allowed_tokens_ends_in_valid_text() {
    let Some(tok) = tokenizer() else { return };
    let compiler = ConstraintCompiler::new(&tok, 49_152).expect("compiler");
    let schema = r#"{"type": "object",
        "properties": {"ok": {"type": "boolean"},
                       "n": {"type": "integer", "minimum": 0, "maximum": 99},
                       "tag": {"enum": ["red", "green", "blue"]}},
        "required": ["ok", "n", "tag"], "additionalProperties": false}"#;
    for seed in 0..8 {
        let text = walk(
            &compiler,
            &tok,
            &ConstraintSpec::JsonSchema(schema.into()),
            seed,
        );
        let value: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        assert!(value["ok"].is_boolean(), "{text}");
        let n = value["n"].as_u64().expect("n");
        assert!(n <= 99, "{text}");
        assert!(
            ["red", "green", "blue"].contains(&value["tag"].as_str().unwrap()),
            "{text}"
        );
        assert_eq!(value.as_object().unwrap().len(), 3, "{text}");
    }
    let rx = ConstraintSpec::Regex(r"(yes|no), [0-9]{2}-[a-c]{3}".into());
    let pattern = regex_lite(r"^(yes|no), [0-9]{2}-[a-c]{3}$");
    for seed in 0..8 {
        let text = walk(&compiler, &tok, &rx, seed);
        assert!(pattern(&text), "{text:?}");
    }
}

/// A tiny matcher for the one pattern above (no regex crate in the tests).
fn regex_lite(_: &str) -> impl Fn(&str) -> bool {
    |s: &str| {
        let (word, rest) = match s.split_once(", ") {
            Some(p) => p,
            None => return false,
        };
        let b = rest.as_bytes();
        (word == "yes" || word == "no")
            && b.len() == 6
            && b[0].is_ascii_digit()
            && b[1].is_ascii_digit()
            && b[2] == b'-'
            && b[3..].iter().all(|c| (b'a'..=b'c').contains(c))
    }
}

#[test]
fn bad_and_hostile_constraints_are_refused_quickly() {
    let Some(tok) = tokenizer() else { return };
    let compiler = ConstraintCompiler::new(&tok, 49_152).expect("compiler");
    let refused = |spec: ConstraintSpec| {
        let started = Instant::now();
        let outcome = compiler.compile(&spec);
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(5),
            "{} took {took:?}",
            spec.kind()
        );
        outcome
    };
    match refused(ConstraintSpec::JsonSchema("{not json".into())) {
        Err(ConstraintError::Invalid { message, .. }) => {
            assert!(message.contains("JSON"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    match refused(ConstraintSpec::JsonSchema(
        r#"{"type": "frobnicate"}"#.into(),
    )) {
        Err(ConstraintError::Invalid { message, .. }) => assert!(!message.is_empty()),
        other => panic!("{other:?}"),
    }
    match refused(ConstraintSpec::Regex("(unclosed".into())) {
        Err(ConstraintError::Invalid { .. }) => {}
        other => panic!("{other:?}"),
    }
    match refused(ConstraintSpec::Lark("start: undefined_rule".into())) {
        Err(ConstraintError::Invalid { .. }) => {}
        other => panic!("{other:?}"),
    }
    match refused(ConstraintSpec::Regex("a".repeat(70_000))) {
        Err(ConstraintError::TooLarge { len, .. }) => assert_eq!(len, 70_000),
        other => panic!("{other:?}"),
    }
    // Hostile but small: each compiles within its bounds or is refused;
    // none may take long.
    let deep = r#"{"type":"object","properties":{"a":"#.repeat(200)
        + r#"{"type":"integer"}"#
        + &"}}".repeat(200);
    let huge_enum = format!(
        r#"{{"enum": [{}]}}"#,
        (0..5000)
            .map(|i| format!("\"value number {i}\""))
            .collect::<Vec<_>>()
            .join(",")
    );
    for spec in [
        ConstraintSpec::JsonSchema(deep),
        ConstraintSpec::JsonSchema(huge_enum),
        ConstraintSpec::Regex("(a*)*b(x+x+)+y{1000}".into()),
        ConstraintSpec::Regex("[a-z]{1,1000}[0-9]{1,1000}[a-z]{1,1000}".into()),
    ] {
        let kind = spec.kind();
        match refused(spec) {
            Ok(mut c) => {
                let mut mask = Vec::new();
                c.allowed(&[], &mut mask).expect("a first mask");
            }
            Err(e) => eprintln!("{kind} refused: {e}"),
        }
    }
}

#[test]
fn a_gbnf_grammar_constrains_as_its_lark_rewrite_does() {
    let Some(tok) = tokenizer() else { return };
    let compiler = ConstraintCompiler::new(&tok, 49_152).expect("compiler");
    let gbnf = r#"
        root ::= answer ", " num "."   # llama.cpp's syntax
        answer ::= "yes" | "no"
        num ::= [1-9] [0-9]{1,2}
    "#;
    let spec = ConstraintSpec::Gbnf(gbnf.into());
    for seed in 0..8 {
        let text = walk(&compiler, &tok, &spec, seed);
        let (word, rest) = text.split_once(", ").expect("a comma");
        assert!(word == "yes" || word == "no", "{text:?}");
        let digits = rest.strip_suffix('.').expect("a full stop");
        assert!((2..=3).contains(&digits.len()), "{text:?}");
        assert!(digits.bytes().all(|b| b.is_ascii_digit()) && !digits.starts_with('0'));
    }
    match compiler.compile(&ConstraintSpec::Gbnf("root ::= missing".into())) {
        Err(ConstraintError::Invalid { kind, message }) => {
            assert_eq!(kind, "gbnf");
            assert!(message.contains("undefined rule"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}
