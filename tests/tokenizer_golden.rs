//! The tokenizer against llama.cpp on the reference model: exact token ids
//! for every string in `tests/vectors/tokenizer_smollm2.json` (made by
//! `scripts/golden-llamacpp`), decode round-trips, and the special-token
//! facts (EOG and control ids) llama.cpp derives from the vocabulary.
//!
//! Needs the reference model (`scripts/fetch-model`); without it the tests
//! say so loudly and pass, so that a checkout without the model still
//! builds and tests.

use std::path::PathBuf;
use std::time::Instant;

use inferd::gguf::GgufFile;
use inferd::tokenizer::{StreamDecoder, Tokenizer};
use serde_json::Value;

fn model_path() -> PathBuf {
    match std::env::var_os("INFERD_MODEL") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("models")
            .join("SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

fn load() -> Option<Tokenizer> {
    let path = model_path();
    if !path.exists() {
        eprintln!(
            "\n*** SKIPPED: reference model not found at {} (run scripts/fetch-model) ***\n",
            path.display()
        );
        return None;
    }
    let file = GgufFile::open(&path).expect("reference model opens");
    Some(Tokenizer::from_gguf(&file).expect("reference tokenizer loads"))
}

fn vectors() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/tokenizer_smollm2.json");
    let text = std::fs::read_to_string(&path).expect("golden vectors are checked in");
    serde_json::from_str(&text).expect("golden vectors are valid JSON")
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn cases(doc: &Value) -> Vec<(String, bool, Vec<u32>)> {
    doc["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            (
                c["text"].as_str().expect("text").to_owned(),
                c["parse_special"].as_bool().expect("parse_special"),
                ids_of(&c["ids"]),
            )
        })
        .collect()
}

#[test]
fn encodes_exactly_like_llama_cpp() {
    let Some(tok) = load() else { return };
    let doc = vectors();
    let cases = cases(&doc);
    assert!(
        cases.len() >= 40,
        "expected at least 40 cases, found {}",
        cases.len()
    );
    let mut failures = Vec::new();
    for (text, parse_special, want) in &cases {
        let got = tok.encode(text, false, *parse_special).expect("encodes");
        if &got != want {
            failures.push(format!(
                "text {text:?} (parse_special {parse_special}):\n   want {want:?}\n    got {got:?}"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from llama.cpp:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn decode_round_trips() {
    let Some(tok) = load() else { return };
    for (text, parse_special, ids) in cases(&vectors()) {
        assert_eq!(
            tok.decode(&ids).expect("decodes"),
            text,
            "golden ids of {text:?}"
        );
        let ours = tok.encode(&text, false, parse_special).expect("encodes");
        assert_eq!(tok.decode(&ours).expect("decodes"), text);

        let mut stream = StreamDecoder::new();
        let mut streamed = String::new();
        for &id in &ours {
            streamed.push_str(&stream.push(&tok, id).expect("known id"));
        }
        streamed.push_str(&stream.finish());
        assert_eq!(streamed, text, "streamed decode of {text:?}");
    }
}

#[test]
fn special_tokens_match_llama_cpp() {
    let Some(tok) = load() else { return };
    let doc = vectors();
    let vocab = &doc["vocab"];
    assert_eq!(
        tok.vocab_size() as u64,
        vocab["n_tokens"].as_u64().expect("n_tokens")
    );
    assert_eq!(tok.bos().map(u64::from), vocab["bos"].as_u64());
    assert_eq!(tok.eos().map(u64::from), vocab["eos"].as_u64());
    assert_eq!(tok.adds_bos(), vocab["add_bos"].as_bool().expect("add_bos"));
    assert_eq!(tok.eog_tokens(), ids_of(&vocab["eog"]).as_slice());
    let control: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&id| tok.is_control(id))
        .collect();
    assert_eq!(control, ids_of(&vocab["control"]));
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert_eq!(tok.token_bytes(2), Some(&b"<|im_end|>"[..]));
}

#[test]
fn loads_and_encodes_quickly() {
    let path = model_path();
    if !path.exists() {
        eprintln!(
            "\n*** SKIPPED: reference model not found at {} ***\n",
            path.display()
        );
        return;
    }
    let file = GgufFile::open(&path).expect("reference model opens");
    let start = Instant::now();
    let tok = Tokenizer::from_gguf(&file).expect("loads");
    let load = start.elapsed();

    let text: String = vectors()["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| c["text"].as_str().expect("text"))
        .collect::<Vec<_>>()
        .join(" ");
    let start = Instant::now();
    let ids = tok.encode(&text, false, true).expect("encodes");
    let encode = start.elapsed();
    eprintln!(
        "tokenizer load {load:?}; encode {} bytes -> {} tokens in {encode:?}",
        text.len(),
        ids.len()
    );
    // Generous bounds: this runs unoptimised-ish under the test profile on
    // shared machines; the point is to catch accidental quadratic work.
    assert!(load.as_millis() < 1500, "load took {load:?}");
    assert!(encode.as_millis() < 500, "encode took {encode:?}");
}
