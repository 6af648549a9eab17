//! Constrained Generate through a real server and a stock client: output
//! that matches a JSON Schema or a regular expression, its own stop reasons,
//! the same tokens every time, and bad constraints refused as
//! INVALID_ARGUMENT with the compiler's message.

mod support;

use inferd::gguf::GgufFile;
use inferd::proto::kakeya_v1::runtime as pb;
use inferd::tokenizer::Tokenizer;
use support::{greedy, seeded, Client, Inferd, REFERENCE};

use pb::GenerateDone_StopReason as Stop;

const SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "colour": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
  },
  "required": ["name", "age", "colour", "tags"],
  "additionalProperties": false
}"#;

struct Setup {
    _server: Inferd,
    client: Client,
    tokenizer: Tokenizer,
}

fn setup() -> Option<Setup> {
    if !support::have_reference() {
        return None;
    }
    let server = Inferd::start(&["serve", "--listen", "127.0.0.1:0", "--model", REFERENCE]);
    let client = Client::connect(&server.addr);
    let file = GgufFile::open(REFERENCE).expect("model");
    let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
    Some(Setup {
        _server: server,
        client,
        tokenizer,
    })
}

impl Setup {
    /// A session holding `prompt` (as the chat's user turn), with the
    /// model's end-of-generation ids as its stop ids.
    fn session(&self, prompt: &str) -> String {
        self.session_in_chunks(prompt, usize::MAX)
    }

    /// [`Setup::session`], the prompt appended in pieces of `chunk` tokens.
    fn session_in_chunks(&self, prompt: &str, chunk: usize) -> String {
        session_on(&self.client, &self.tokenizer, prompt, chunk)
    }

    fn text(&self, tokens: &[u32]) -> String {
        text_of(&self.tokenizer, tokens)
    }
}

fn with(
    mut req: pb::GenerateRequest,
    set: impl FnOnce(&mut pb::OutputConstraint),
) -> pb::GenerateRequest {
    let mut c = pb::OutputConstraint::new();
    set(&mut c);
    req.set_constraint(c);
    req
}

fn check_person(text: &str) {
    let value: serde_json::Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    let object = value.as_object().expect("an object");
    assert_eq!(object.len(), 4, "{text}");
    assert!(
        object["name"].as_str().expect("name").chars().count() <= 12,
        "{text}"
    );
    assert!(object["age"].as_u64().expect("age") <= 120, "{text}");
    assert!(["red", "green", "blue"].contains(&object["colour"].as_str().expect("colour")));
    let tags = object["tags"].as_array().expect("tags");
    assert!(tags.len() <= 3, "{text}");
    for tag in tags {
        assert!(
            tag.as_str().expect("a string tag").chars().count() <= 8,
            "{text}"
        );
    }
}

#[test]
fn schema_constrained_output_validates_and_ends_with_its_own_stop_reason() {
    let Some(s) = setup() else { return };
    let prompt = "Describe a person called Ada as JSON with name, age, colour and tags.";
    for (k, req) in [greedy("", 200, 0), seeded("", 200, 21), seeded("", 200, 22)]
        .into_iter()
        .enumerate()
    {
        let id = s.session(prompt);
        let mut req = with(req, |c| c.set_json_schema(SCHEMA.into()));
        req.set_session_id(id.clone());
        let run = s.client.generate(&req);
        assert!(run.error.is_none(), "{:?}", run.error);
        let (reason, _) = run.done.expect("done");
        assert_eq!(reason, Stop::STOP_REASON_CONSTRAINT_DONE as i32, "run {k}");
        let text = s.text(&run.tokens);
        eprintln!("run {k}: {text}");
        check_person(&text);
        // The same call on a fresh session gives the same tokens, and so
        // does one whose prompt came in pieces.
        let again = s.session(prompt);
        req.set_session_id(again);
        assert_eq!(
            s.client.generate(&req).tokens,
            run.tokens,
            "run {k} repeated"
        );
        let chunked = s.session_in_chunks(prompt, 5 + k);
        req.set_session_id(chunked);
        assert_eq!(
            s.client.generate(&req).tokens,
            run.tokens,
            "run {k}, prompt in pieces"
        );
    }
}

#[test]
fn regex_output_matches_and_a_cut_match_says_so() {
    let Some(s) = setup() else { return };
    let id = s.session("Is the sky blue? Answer yes or no, then a two-digit number.");
    let mut req = with(greedy(&id, 40, 0), |c| {
        c.set_regex("(yes|no), [0-9]{2}\\.".into())
    });
    let run = s.client.generate(&req);
    assert!(run.error.is_none(), "{:?}", run.error);
    assert_eq!(
        run.done.expect("done").0,
        Stop::STOP_REASON_CONSTRAINT_DONE as i32
    );
    let text = s.text(&run.tokens);
    let (word, rest) = text.split_once(", ").expect("a comma");
    assert!(word == "yes" || word == "no", "{text:?}");
    assert!(
        rest.len() == 3 && rest[..2].bytes().all(|b| b.is_ascii_digit()) && rest.ends_with('.'),
        "{text:?}"
    );

    // The same shape as llama.cpp's GBNF.
    let id = s.session("Is the sky blue? Answer yes or no, then a two-digit number.");
    let gbnf = "root ::= (\"yes\" | \"no\") \", \" [0-9] [0-9] \".\"";
    let run = s.client.generate(&with(greedy(&id, 40, 0), |c| {
        c.set_gbnf_grammar(gbnf.into())
    }));
    assert!(run.error.is_none(), "{:?}", run.error);
    assert_eq!(
        run.done.expect("done").0,
        Stop::STOP_REASON_CONSTRAINT_DONE as i32
    );
    assert_eq!(s.text(&run.tokens), text, "GBNF and the regex agree");

    // Two tokens cannot finish a JSON object of this schema.
    let id = s.session("Describe a person as JSON.");
    req = with(greedy(&id, 2, 0), |c| c.set_json_schema(SCHEMA.into()));
    let run = s.client.generate(&req);
    assert_eq!(
        run.done.expect("done").0,
        Stop::STOP_REASON_CONSTRAINT_UNFINISHED as i32
    );
    assert_eq!(run.tokens.len(), 2);

    // Any JSON object.
    let id = s.session("Give me a JSON object describing a cat.");
    let run = s
        .client
        .generate(&with(greedy(&id, 120, 0), |c| c.set_json_object(true)));
    if run.done.expect("done").0 == Stop::STOP_REASON_CONSTRAINT_DONE as i32 {
        let text = s.text(&run.tokens);
        let value: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        assert!(value.is_object(), "{text}");
    } else {
        assert_eq!(
            run.done.expect("done").0,
            Stop::STOP_REASON_CONSTRAINT_UNFINISHED as i32
        );
    }
}

#[test]
fn bad_constraints_are_invalid_argument_and_change_nothing() {
    let Some(s) = setup() else { return };
    let id = s.session("Hello.");
    let before = s.client.info(&id).expect("info").get_history_length();
    for (constraint, words) in [
        (
            with(greedy(&id, 8, 0), |c| c.set_json_schema("{oops".into())),
            "not JSON",
        ),
        (
            with(greedy(&id, 8, 0), |c| c.set_regex("(a".into())),
            "regex",
        ),
        (
            with(greedy(&id, 8, 0), |c| {
                c.set_lark_grammar("start: missing".into())
            }),
            "grammar",
        ),
        (
            with(greedy(&id, 8, 0), |c| {
                c.set_gbnf_grammar("root ::= missing".into())
            }),
            "undefined rule",
        ),
        (
            with(greedy(&id, 8, 0), |c| c.set_regex("a".repeat(70_000))),
            "at most",
        ),
        (with(greedy(&id, 8, 0), |_| {}), "names no kind"),
    ] {
        let run = s.client.generate(&constraint);
        let (code, message) = run.error.expect("refused");
        assert_eq!(
            code,
            i32::from(grpcio::RpcStatusCode::INVALID_ARGUMENT),
            "{message}"
        );
        assert!(message.contains(words), "{message:?} should say {words:?}");
        assert!(run.tokens.is_empty());
    }
    assert_eq!(
        s.client.info(&id).expect("info").get_history_length(),
        before
    );
}

/// A session of `client` holding `prompt` as the chat's user turn,
/// appended in pieces of `chunk` tokens, with the model's end-of-generation
/// ids as its stop ids.
fn session_on(client: &Client, tokenizer: &Tokenizer, prompt: &str, chunk: usize) -> String {
    let mut req = pb::CreateSessionRequest::new();
    req.set_client_label("constraint test".into());
    req.set_eos_token_ids(tokenizer.eog_tokens().to_vec());
    let id = client
        .rpc
        .create_session(&req)
        .expect("created")
        .take_session_id();
    let text = format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n");
    let tokens = tokenizer.encode(&text, false, true).expect("encodes");
    for piece in tokens.chunks(chunk) {
        client.append(&id, piece).expect("append");
    }
    id
}

/// The text of generated `tokens`, end-of-generation ids left out.
fn text_of(tokenizer: &Tokenizer, tokens: &[u32]) -> String {
    let ids: Vec<u32> = tokens
        .iter()
        .copied()
        .filter(|&t| !tokenizer.is_eog(t))
        .collect();
    tokenizer.decode(&ids).expect("decodes")
}

/// The seeded, schema-constrained call every part of the test makes.
fn person_request(id: &str) -> pb::GenerateRequest {
    let mut req = with(seeded(id, 160, 77), |c| c.set_json_schema(SCHEMA.into()));
    req.set_top_logprobs(2);
    req
}

/// A constrained call's tokens and log-probability bits, checked to end
/// with the constraint.
fn person_run(client: &Client, id: &str) -> (Vec<u32>, Vec<(u32, u32)>) {
    let run = client.generate(&person_request(id));
    assert!(run.error.is_none(), "{:?}", run.error);
    let (reason, _) = run.done.expect("done");
    assert_eq!(reason, Stop::STOP_REASON_CONSTRAINT_DONE as i32);
    (run.tokens, run.logprob_bits)
}

#[test]
fn constrained_tokens_do_not_depend_on_batch_neighbours_a_restart_or_shards() {
    if !support::have_reference() {
        return;
    }
    let tokenizer =
        Tokenizer::from_gguf(&GgufFile::open(REFERENCE).expect("model")).expect("tokenizer");
    let prompt = "Describe a person called Ada as JSON with name, age, colour and tags.";
    let dir = tempfile::tempdir().expect("temp dir");
    let state = dir.path().join("state");
    let state = state.to_str().expect("UTF-8 path");
    let serve = |extra: &[&str]| support::serve_model(REFERENCE, extra);

    // Alone, on a server that keeps its sessions.
    let mut server = serve(&["--state-dir", state]);
    let client = Client::connect(&server.addr);
    let kept = session_on(&client, &tokenizer, prompt, usize::MAX);
    let alone = person_run(
        &client,
        &session_on(&client, &tokenizer, prompt, usize::MAX),
    );
    check_person(&text_of(&tokenizer, &alone.0));

    // Beside each other and an unconstrained neighbour, in the same steps.
    std::thread::scope(|scope| {
        let runs: Vec<_> = (0..3)
            .map(|k| {
                let (addr, tokenizer) = (&server.addr, &tokenizer);
                scope.spawn(move || {
                    let client = Client::connect(addr);
                    let id = session_on(&client, tokenizer, prompt, usize::MAX);
                    if k == 2 {
                        let free = client.generate(&greedy(&id, 120, 0));
                        assert!(free.error.is_none(), "{:?}", free.error);
                        return None;
                    }
                    Some(person_run(&client, &id))
                })
            })
            .collect();
        for run in runs {
            if let Some(run) = run.join().expect("a run") {
                assert_eq!(run, alone, "beside neighbours");
            }
        }
    });

    // After a restart, in the session the state directory kept.
    server.signal("TERM");
    server
        .wait_exit(std::time::Duration::from_secs(60))
        .expect("stops");
    let server = serve(&["--state-dir", state]);
    let client = Client::connect(&server.addr);
    let restored = support::retry_unavailable(std::time::Duration::from_secs(60), || {
        client.generate(&person_request(&kept))
    });
    assert!(restored.error.is_none(), "{:?}", restored.error);
    assert_eq!(
        (restored.tokens, restored.logprob_bits),
        alone,
        "after a restart"
    );
    drop(server);

    // The model split over two shards.
    let (_shards, list) = Inferd::shards(&["0..15", "15..30"]);
    let coordinator = serve(&["--shards", &list]);
    let client = Client::connect(&coordinator.addr);
    let split = person_run(
        &client,
        &session_on(&client, &tokenizer, prompt, usize::MAX),
    );
    assert_eq!(split, alone, "over two shards");
}
