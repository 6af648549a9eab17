//! The tokenizer against llama.cpp's own tokenizer test cases: for each
//! vocabulary inferd claims, llama.cpp ships a vocabulary-only GGUF
//! (`ggml-vocab-NAME.gguf`, no tensors) with input texts (`.gguf.inp`) and
//! the token ids llama.cpp's `test-tokenizer-0` expects for them
//! (`.gguf.out`). Every case must encode to exactly those ids (no BOS/EOS,
//! special-token text not parsed, as that test calls it), and decoding the
//! ids must give the input text back. Beyond llama.cpp's cases, every
//! control and user-defined token's text must encode to exactly that token
//! when special tokens are parsed, and a control token's text must not
//! when they are not.
//!
//! The files come from `scripts/fetch-vocabs` (a pinned llama.cpp source
//! distribution on PyPI), cached in `$INFERD_VOCAB_DIR` or
//! `~/.cache/inferd/vocabs`. A missing vocabulary fails the test when `CI`
//! or `INFERD_REQUIRE_VOCABS` is set (scripts/test sets the latter) and is
//! skipped loudly otherwise.

mod support;

use inferd::gguf::GgufFile;
use inferd::tokenizer::{TokenType, Tokenizer};

/// The separator between cases in a `.inp` file, as llama.cpp's
/// `tests/test-tokenizer-0.cpp` splits them.
const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

/// One case: the input text and the ids llama.cpp expects.
struct Case {
    text: String,
    ids: Vec<u32>,
}

/// Reads `.inp` / `.out` the way llama.cpp's test does: the input split at
/// each separator (a final separator ends the last case), one output line
/// of space-separated ids per case.
fn read_cases(name: &str) -> Option<(Tokenizer, Vec<Case>)> {
    let dir = support::vocab_dir();
    let gguf = dir.join(format!("ggml-vocab-{name}.gguf"));
    let inp = dir.join(format!("ggml-vocab-{name}.gguf.inp"));
    let out = dir.join(format!("ggml-vocab-{name}.gguf.out"));
    if !(gguf.exists() && inp.exists() && out.exists()) {
        let msg = format!(
            "vocabulary {name} not found in {} (run scripts/fetch-vocabs)",
            dir.display()
        );
        assert!(!support::vocabs_required(), "{msg}");
        eprintln!("\n*** SKIPPED: {msg} ***\n");
        return None;
    }

    let raw = std::fs::read_to_string(&inp).expect(".inp is UTF-8");
    let mut texts = Vec::new();
    let mut pos = 0;
    while pos < raw.len() {
        match raw[pos..].find(SEPARATOR) {
            Some(at) => {
                texts.push(raw[pos..pos + at].to_owned());
                pos += at + SEPARATOR.len();
            }
            None => {
                texts.push(raw[pos..].to_owned());
                break;
            }
        }
    }
    let expected: Vec<Vec<u32>> = std::fs::read_to_string(&out)
        .expect(".out is UTF-8")
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|t| t.parse().expect("token id"))
                .collect()
        })
        .collect();
    assert_eq!(
        texts.len(),
        expected.len(),
        "{name}: {} inputs but {} outputs",
        texts.len(),
        expected.len()
    );
    assert!(texts.len() >= 40, "{name}: only {} cases", texts.len());

    let file = GgufFile::open(&gguf).expect("vocabulary GGUF opens");
    assert!(file.tensors().is_empty(), "{name}: a vocabulary-only file");
    let tok = Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{name}: loads: {e}"));
    let cases = texts
        .into_iter()
        .zip(expected)
        .map(|(text, ids)| Case { text, ids })
        .collect();
    Some((tok, cases))
}

/// Encodes every case and compares with llama.cpp; decodes and compares
/// with the input. Reports every failing case before failing.
fn check(name: &str) {
    let Some((tok, cases)) = read_cases(name) else {
        return;
    };
    let mut failures = Vec::new();
    for case in &cases {
        let got = match tok.encode(&case.text, false, false) {
            Ok(ids) => ids,
            Err(e) => {
                failures.push(format!("{:?}: error {e}", case.text));
                continue;
            }
        };
        if got != case.ids {
            failures.push(format!(
                "{:?}:\n      want {:?}\n      got  {:?}",
                case.text, case.ids, got
            ));
            continue;
        }
        match tok.decode(&got) {
            Ok(text) if text == case.text => {}
            Ok(text) => failures.push(format!("{:?}: decodes to {text:?}", case.text)),
            Err(e) => failures.push(format!("{:?}: decode error {e}", case.text)),
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases fail:\n  {}",
        failures.len(),
        cases.len(),
        failures.join("\n  ")
    );
    eprintln!("{name}: all {} cases pass", cases.len());
    check_special_tokens(name, &tok);
}

/// Every control and user-defined token's text, parsed as special, is
/// that one token; a control token's text, not parsed, is not.
fn check_special_tokens(name: &str, tok: &Tokenizer) {
    let mut failures = Vec::new();
    let mut count = 0;
    for id in 0..tok.vocab_size() as u32 {
        let ty = tok.token_type(id).expect("id in range");
        if !matches!(ty, TokenType::Control | TokenType::UserDefined) {
            continue;
        }
        let text = tok.token_text(id).expect("id in range");
        // A text stored twice belongs to its last id (as in llama.cpp).
        if text.is_empty() || tok.token_id(text) != Some(id) {
            continue;
        }
        count += 1;
        match tok.encode(text, false, true) {
            Ok(ids) if ids == [id] => {}
            other => failures.push(format!("{id} {text:?} parsed: {other:?}")),
        }
        if ty == TokenType::Control {
            match tok.encode(text, false, false) {
                Ok(ids) if !ids.contains(&id) => {}
                other => failures.push(format!("{id} {text:?} not parsed: {other:?}")),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {count} special tokens fail:\n  {}",
        failures.len(),
        failures.join("\n  ")
    );
    eprintln!("{name}: all {count} special tokens encode whole");
}

#[test]
fn llama_bpe() {
    check("llama-bpe");
}

#[test]
fn llama_spm() {
    check("llama-spm");
}

#[test]
fn qwen2() {
    check("qwen2");
}

#[test]
fn deepseek_llm() {
    check("deepseek-llm");
}

#[test]
fn gpt_2() {
    check("gpt-2");
}

#[test]
fn phi_3() {
    check("phi-3");
}

#[test]
fn starcoder() {
    check("starcoder");
}

#[test]
fn refact() {
    check("refact");
}

#[test]
fn command_r() {
    check("command-r");
}

#[test]
fn mpt() {
    check("mpt");
}

#[test]
fn qwen35() {
    check("qwen35");
}

#[test]
fn deepseek_coder() {
    check("deepseek-coder");
}

#[test]
fn falcon() {
    check("falcon");
}
