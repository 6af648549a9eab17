//! Sessions bound to the token that created them (CONTRACT §2.10), with
//! real `inferd serve` processes on loopback: with a token file of several
//! tokens, another tenant's session is NOT_FOUND on every gRPC call that
//! names it, on ForkSession, and a 404 on the HTTP API's
//! `x-inferd-session`, exactly as an id the server never issued; its owner
//! keeps full use of it, also after a restart on the same state directory;
//! an unknown token is UNAUTHENTICATED. A file of one bare token keeps the
//! server as it was: one tenant, sessions that survive the token's
//! rotation. Nowhere does `session_history_mismatch` tell a history's
//! length.

#![cfg(unix)]

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use grpcio::{CallOption, ChannelBuilder, EnvBuilder, Environment, RpcStatusCode};
use inferd::gguf::synthetic::SyntheticLlama;
use inferd::proto::inferd_session_v1::session_service as ext;
use inferd::proto::inferd_session_v1::session_service_grpc::SessionServiceClient;
use inferd::proto::kakeya_v1::runtime as pb;
use inferd::proto::kakeya_v1::runtime_grpc::RuntimeServiceClient;
use support::Inferd;

const ALICE: &str = "tok-alice-5f1c0e9a";
const BOB: &str = "tok-bob-77d2b4c1";
const CAROL: &str = "tok-carol-0b3e9f62";
/// An id no server issued.
const NEVER: &str = "0123456789abcdef0123456789abcdef";
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// How a call failed.
type Status = (RpcStatusCode, String);

fn status_of(err: grpcio::Error) -> Status {
    match err {
        grpcio::Error::RpcFailure(s) => (s.code(), s.message().to_owned()),
        other => (RpcStatusCode::UNKNOWN, other.to_string()),
    }
}

/// A stock client sending one bearer token.
struct Caller {
    rpc: RuntimeServiceClient,
    sessions: SessionServiceClient,
    token: String,
    _env: Arc<Environment>,
}

impl Caller {
    fn connect(server: &Inferd, token: &str) -> Caller {
        let env = Arc::new(EnvBuilder::new().cq_count(1).build());
        let channel = ChannelBuilder::new(Arc::clone(&env)).connect(&server.addr);
        Caller {
            rpc: RuntimeServiceClient::new(channel.clone()),
            sessions: SessionServiceClient::new(channel),
            token: token.to_owned(),
            _env: env,
        }
    }

    fn opt(&self) -> CallOption {
        let mut headers = grpcio::MetadataBuilder::new();
        headers
            .add_str("authorization", &format!("Bearer {}", self.token))
            .expect("header");
        CallOption::default()
            .timeout(CALL_TIMEOUT)
            .headers(headers.build())
    }

    fn create(&self) -> Result<String, Status> {
        let mut req = pb::CreateSessionRequest::new();
        req.set_client_label("tenant test".into());
        self.rpc
            .create_session_opt(&req, self.opt())
            .map(|mut r| r.take_session_id())
            .map_err(status_of)
    }

    fn append(&self, id: &str, tokens: &[u32]) -> Result<u64, Status> {
        let mut req = pb::AppendTokensRequest::new();
        req.set_session_id(id.into());
        req.set_token_ids(tokens.to_vec());
        self.rpc
            .append_tokens_opt(&req, self.opt())
            .map(|r| r.get_history_length())
            .map_err(status_of)
    }

    /// A greedy Generate of `n` tokens: the tokens, or the first error.
    fn generate(&self, id: &str, n: u32) -> Result<Vec<u32>, Status> {
        let mut req = pb::GenerateRequest::new();
        req.set_session_id(id.into());
        req.set_max_tokens(n);
        let mut stream = self.rpc.generate_opt(&req, self.opt()).map_err(status_of)?;
        let mut tokens = Vec::new();
        while let Some(item) = futures_executor::block_on(stream.next()) {
            let msg = item.map_err(status_of)?;
            if !msg.has_done() && !msg.has_truncated() && !msg.has_logprobs() {
                tokens.push(msg.get_token_id());
            }
        }
        Ok(tokens)
    }

    /// GetSessionInfo: the history length.
    fn info(&self, id: &str) -> Result<u64, Status> {
        let mut req = pb::GetSessionInfoRequest::new();
        req.set_session_id(id.into());
        self.rpc
            .get_session_info_opt(&req, self.opt())
            .map(|r| r.get_history_length())
            .map_err(status_of)
    }

    fn close(&self, id: &str) -> Result<u64, Status> {
        let mut req = pb::CloseSessionRequest::new();
        req.set_session_id(id.into());
        self.rpc
            .close_session_opt(&req, self.opt())
            .map(|r| r.get_final_history_length())
            .map_err(status_of)
    }

    fn fork(&self, id: &str) -> Result<String, Status> {
        let mut req = ext::ForkSessionRequest::new();
        req.set_session_id(id.into());
        self.sessions
            .fork_session_opt(&req, self.opt())
            .map(|mut r| r.take_session_id())
            .map_err(status_of)
    }

    /// Every call that names `id` fails as for an id never issued:
    /// NOT_FOUND with the same message.
    fn finds_nothing_at(&self, id: &str, who: &str) {
        let never = self.info(NEVER).expect_err("never issued");
        assert_eq!(never.0, RpcStatusCode::NOT_FOUND, "{never:?}");
        let calls: [(&str, Result<(), Status>); 5] = [
            ("GetSessionInfo", self.info(id).map(drop)),
            ("AppendTokens", self.append(id, &[1]).map(drop)),
            ("Generate", self.generate(id, 1).map(drop)),
            ("ForkSession", self.fork(id).map(drop)),
            ("CloseSession", self.close(id).map(drop)),
        ];
        for (call, got) in calls {
            let status = got.expect_err(&format!("{who}: {call} on another tenant's session"));
            assert_eq!(status, never, "{who}: {call} must look like an unknown id");
        }
    }
}

/// A small model with a tokenizer, written where the server can load it.
fn write_model(dir: &Path) -> PathBuf {
    let path = dir.join("model.gguf");
    std::fs::write(&path, SyntheticLlama::tiny().build()).expect("write the model");
    path
}

/// Writes a token file only its owner can read, as the server wants.
fn write_tokens(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).expect("token file");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
}

fn serve(model: &Path, tokens: &Path, state: &Path) -> Inferd {
    Inferd::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--workers",
        "1",
        "--kv-mib",
        "16",
        "--sampler",
        "cpu",
        "--model",
        model.to_str().expect("UTF-8 path"),
        "--auth-token-file",
        tokens.to_str().expect("UTF-8 path"),
        "--state-dir",
        state.to_str().expect("UTF-8 path"),
    ])
}

/// A whole HTTP/1.1 exchange: the status and the body.
fn post_completion(
    server: &Inferd,
    token: &str,
    session: Option<&str>,
    prompt: &[u32],
) -> (u16, String) {
    let addr = server.http.as_deref().expect("an http address");
    let body = serde_json::json!({
        "model": "m",
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
    })
    .to_string();
    let session = session.map_or(String::new(), |id| format!("x-inferd-session: {id}\r\n"));
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         {session}Content-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect(addr).expect("connects");
    stream
        .set_read_timeout(Some(CALL_TIMEOUT))
        .expect("read timeout");
    stream.write_all(request.as_bytes()).expect("sends");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("reads");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_owned());
    (status, body)
}

/// The HTTP error's `code` and `message`.
fn error_of(body: &str) -> (String, String) {
    let value: serde_json::Value = serde_json::from_str(body).expect("an error object");
    let error = &value["error"];
    (
        error["code"].as_str().unwrap_or_default().to_owned(),
        error["message"].as_str().unwrap_or_default().to_owned(),
    )
}

/// A request whose prompt does not begin the session's history is a 400
/// `session_history_mismatch` that does not say how long the history is.
fn mismatch_tells_no_length(server: &Inferd, token: &str, id: &str, history: u64) {
    let (status, body) = post_completion(server, token, Some(id), &[9, 9, 9]);
    assert_eq!(status, 400, "{body}");
    let (code, message) = error_of(&body);
    assert_eq!(code, "session_history_mismatch", "{body}");
    assert!(
        !message.contains(&history.to_string()),
        "the message tells the history's length {history}: {message}"
    );
}

#[test]
fn sessions_belong_to_the_token_that_made_them_on_grpc_http_and_after_a_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let tokens = dir.path().join("tokens");
    write_tokens(
        &tokens,
        &format!("# three tenants\nalice: {ALICE}\nbob:\t{BOB}\n\n{CAROL}\n"),
    );
    let mut server = serve(&model, &tokens, &state);
    let alice = Caller::connect(&server, ALICE);
    let bob = Caller::connect(&server, BOB);
    let carol = Caller::connect(&server, CAROL);
    let stranger = Caller::connect(&server, "tok-nobody-00000000");

    let a = alice.create().expect("alice creates");
    assert_eq!(alice.append(&a, &[1, 2, 3, 4, 5]).expect("append"), 5);
    let generated = alice.generate(&a, 2).expect("generate");
    assert_eq!(generated.len(), 2);
    let a_len = 7;
    assert_eq!(alice.info(&a).expect("info"), a_len);
    let b = bob.create().expect("bob creates");
    assert_eq!(bob.append(&b, &[4, 3, 2, 1]).expect("append"), 4);

    bob.finds_nothing_at(&a, "bob");
    carol.finds_nothing_at(&a, "carol (an unnamed token)");
    alice.finds_nothing_at(&b, "alice");
    // None of that touched either session.
    assert_eq!(alice.info(&a).expect("alice's session"), a_len);
    assert_eq!(bob.info(&b).expect("bob's session"), 4);

    // A fork belongs to the caller, who must own the source.
    let fork = alice.fork(&a).expect("alice forks her session");
    assert_eq!(alice.info(&fork).expect("the fork"), a_len);
    bob.finds_nothing_at(&fork, "bob on alice's fork");

    // An unknown token is refused before anything else.
    for got in [
        stranger.create().map(drop),
        stranger.info(&a).map(drop),
        stranger.fork(&a).map(drop),
    ] {
        assert_eq!(
            got.expect_err("unknown token").0,
            RpcStatusCode::UNAUTHENTICATED
        );
    }

    // HTTP: another tenant's session is a 404, as an unknown id.
    let prompt: Vec<u32> = (1..=5).chain(generated.iter().copied()).collect();
    let (never_status, never_body) = post_completion(&server, BOB, Some(NEVER), &prompt);
    assert_eq!(never_status, 404, "{never_body}");
    let (status, body) = post_completion(&server, BOB, Some(&a), &prompt);
    assert_eq!(
        (status, error_of(&body)),
        (404, error_of(&never_body)),
        "bob's request in alice's session"
    );
    assert_eq!(
        post_completion(&server, "tok-nobody-00000000", Some(&a), &prompt).0,
        401
    );
    // The owner runs her request in it; the session keeps the turn.
    let (status, body) = post_completion(&server, ALICE, Some(&a), &prompt);
    assert_eq!(status, 200, "{body}");
    let a_len = alice.info(&a).expect("info");
    assert!(a_len > 7, "the request's turn stays in the session");
    mismatch_tells_no_length(&server, ALICE, &a, a_len);
    // A request in a session of its own runs for anyone with a token.
    let (status, body) = post_completion(&server, CAROL, None, &[1, 2, 3]);
    assert_eq!(status, 200, "{body}");

    // The journals name the tenants, never a token. (An HTTP request's own
    // session is closed, its journal deleted, just after its reply: wait
    // for that.)
    let sessions = state.join("sessions");
    let started = std::time::Instant::now();
    loop {
        let mut journals = 0;
        for entry in std::fs::read_dir(&sessions).expect("sessions dir") {
            let path = entry.expect("entry").path();
            // Files of sessions that end go away as they are read.
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            let text = String::from_utf8_lossy(&bytes);
            for token in [ALICE, BOB, CAROL] {
                assert!(!text.contains(token), "{} holds a token", path.display());
            }
            journals += usize::from(path.extension().is_some_and(|x| x == "journal"));
        }
        if journals == 3 || started.elapsed() > Duration::from_secs(10) {
            assert_eq!(journals, 3, "alice's session, her fork and bob's");
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    // After a restart every session still belongs to its tenant.
    server.kill();
    let server = serve(&model, &tokens, &state);
    let alice = Caller::connect(&server, ALICE);
    let bob = Caller::connect(&server, BOB);
    assert_eq!(alice.info(&a).expect("restored for alice"), a_len);
    assert_eq!(alice.info(&fork).expect("the fork, restored"), 7);
    assert_eq!(bob.info(&b).expect("restored for bob"), 4);
    bob.finds_nothing_at(&a, "bob after the restart");
    bob.finds_nothing_at(&fork, "bob on the fork after the restart");
    alice.finds_nothing_at(&b, "alice after the restart");
    let (status, body) = post_completion(&server, BOB, Some(&a), &[1]);
    assert_eq!(status, 404, "{body}");
    assert_eq!(alice.generate(&a, 1).expect("alice goes on").len(), 1);
    assert_eq!(alice.close(&a).expect("alice closes"), a_len + 1);
}

#[test]
fn one_bare_token_serves_as_before_and_its_sessions_outlive_a_rotation() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let tokens = dir.path().join("token");
    write_tokens(&tokens, "s3cret-token\n");
    let mut server = serve(&model, &tokens, &state);
    let owner = Caller::connect(&server, "s3cret-token");
    let id = owner.create().expect("create");
    assert_eq!(owner.append(&id, &[1, 2, 3, 4]).expect("append"), 4);
    assert_eq!(owner.generate(&id, 2).expect("generate").len(), 2);
    let fork = owner.fork(&id).expect("fork");
    assert_eq!(owner.info(&fork).expect("info"), 6);
    assert_eq!(owner.close(&fork).expect("close"), 6);
    let wrong = Caller::connect(&server, "s3cret-tokem");
    assert_eq!(
        wrong.info(&id).expect_err("wrong token").0,
        RpcStatusCode::UNAUTHENTICATED
    );
    mismatch_tells_no_length(&server, "s3cret-token", &id, 6);

    // The token is rotated: sessions do not depend on it (no tenants).
    server.kill();
    write_tokens(&tokens, "n3w-token\n");
    let mut server = serve(&model, &tokens, &state);
    let rotated = Caller::connect(&server, "n3w-token");
    assert_eq!(rotated.info(&id).expect("after the rotation"), 6);

    // Named tokens added later: a session made without tenants is
    // anyone's, as a journal written before sessions had owners.
    server.kill();
    write_tokens(&tokens, "alice: n3w-token\nbob: other-token\n");
    let server = serve(&model, &tokens, &state);
    for token in ["n3w-token", "other-token"] {
        let caller = Caller::connect(&server, token);
        assert_eq!(caller.info(&id).expect("an ownerless session"), 6);
    }
    let alice = Caller::connect(&server, "n3w-token");
    assert_eq!(alice.close(&id).expect("close"), 6);
}

/// Replicas sharing a store (CONTRACT §2.14) keep sessions bound to their
/// token: another tenant's call for a session held on another replica is
/// NOT_FOUND there, exactly as an id never issued, and moves nothing (the
/// lease and its epoch stay where they were); its owner's call through
/// the other replica moves it, history and all.
#[test]
fn another_tenants_call_on_another_replica_finds_nothing_and_moves_nothing() {
    use support::postgres::Postgres;
    use support::replicas::{replica, row};
    let Some(pg) = Postgres::start() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let model = write_model(dir.path());
    let tokens = dir.path().join("tokens");
    write_tokens(&tokens, &format!("alice: {ALICE}\nbob: {BOB}\n"));
    let auth = ["--auth-token-file", tokens.to_str().expect("UTF-8 path")];
    let first = replica(&model, &pg, "r1", "10", &auth);
    let second = replica(&model, &pg, "r2", "10", &auth);

    let alice_here = Caller::connect(&first, ALICE);
    let id = alice_here.create().expect("create");
    assert_eq!(alice_here.append(&id, &[5, 6, 7, 8]).expect("append"), 4);
    let (history, owner, epoch) = row(&pg, &id).expect("in the store");
    assert_eq!((history.len(), owner.as_str()), (4, "r1"));

    Caller::connect(&second, BOB).finds_nothing_at(&id, "bob on the other replica");
    assert_eq!(row(&pg, &id), Some((history.clone(), owner, epoch)));
    assert_eq!(alice_here.info(&id).expect("still held by r1"), 4);
    for (process, name) in [(&first, "r1"), (&second, "r2")] {
        // The metrics endpoint wants a token too.
        let addr = process.metrics.as_deref().expect("a metrics endpoint");
        let text = support::scrape_as(addr, Some(ALICE));
        for counter in ["handoffs", "takeovers"] {
            let metric = format!("inferd_replica_{counter}_total");
            let n = support::sample(&text, &metric).unwrap_or_else(|| panic!("{text}"));
            assert_eq!(n, 0.0, "{name}: {n} {counter}");
        }
    }

    let alice_there = Caller::connect(&second, ALICE);
    assert_eq!(alice_there.append(&id, &[9]).expect("moved"), 5);
    let (history, owner, moved_epoch) = row(&pg, &id).expect("in the store");
    assert_eq!((history, owner.as_str()), (vec![5, 6, 7, 8, 9], "r2"));
    assert!(moved_epoch > epoch);
    Caller::connect(&first, BOB).finds_nothing_at(&id, "bob on the first replica");
    assert_eq!(alice_there.close(&id).expect("closed"), 5);
    assert!(row(&pg, &id).is_none());
}
