//! CONTRACT §2.10 through the wire: bearer tokens, the open-listen guard
//! and TLS.

use super::*;
use inferd::server::tokens::TokenFileError;

// --------------------------------------------------------------- §2.10 --

#[test]
fn a_bearer_token_is_required_except_for_health() {
    let mut cfg = loopback(runtime_config(1));
    cfg.auth_token = Some("s3cret-token".into());
    let served = Served::start(tiny_model(), cfg);
    let mut req = pb::CreateSessionRequest::new();
    req.set_client_label("auth".into());
    let timeout = CallOption::default().timeout(CALL_TIMEOUT);
    let none = served.client.create_session_opt(&req, timeout.clone());
    assert_code(
        none.map_err(status_of),
        RpcStatusCode::UNAUTHENTICATED,
        "no token",
    );
    let wrong = served
        .client
        .create_session_opt(&req, timeout.clone().headers(bearer("s3cret-tokem")));
    assert_code(
        wrong.map_err(status_of),
        RpcStatusCode::UNAUTHENTICATED,
        "wrong",
    );
    let prefix = served
        .client
        .create_session_opt(&req, timeout.clone().headers(bearer("s3cret")));
    assert_code(
        prefix.map_err(status_of),
        RpcStatusCode::UNAUTHENTICATED,
        "prefix",
    );
    let mut info = pb::GetSessionInfoRequest::new();
    info.set_session_id("00112233445566778899aabbccddeeff".into());
    let unauthenticated_info = served.client.get_session_info_opt(&info, timeout.clone());
    assert_code(
        unauthenticated_info.map_err(status_of),
        RpcStatusCode::UNAUTHENTICATED,
        "checked before the handler",
    );
    // The helpers send the right token.
    let id = served.create("auth", &[]);
    assert_eq!(served.append(&id, &[1, 2]).expect("append"), 2);
    let (tokens, _) = served.run(gen_req(&id, 2));
    assert_eq!(tokens.len(), 2);
    let stream = Gen::spawn(served.client.clone(), gen_req(&id, 2), timeout);
    assert_eq!(
        stream.finish(STREAM_TIMEOUT).failure().code,
        RpcStatusCode::UNAUTHENTICATED
    );
    // Health needs no token.
    assert_eq!(served.health_check("").expect("health"), Serving::SERVING);
    served.stop();
}

#[test]
fn an_open_listen_address_needs_a_token_or_an_explicit_opt_out() {
    let open = ServeConfig::new("0.0.0.0:0", runtime_config(1));
    assert!(matches!(
        open.check_security(),
        Err(ServeError::OpenListen(_))
    ));
    assert!(matches!(
        Server::start(tiny_model(), open.clone()),
        Err(ServeError::OpenListen(_))
    ));
    let mut with_token = open.clone();
    with_token.auth_token = Some("t".into());
    assert!(with_token.check_security().is_ok());
    let mut blank = open.clone();
    blank.auth_token = Some("  ".into());
    assert!(matches!(
        blank.check_security(),
        Err(ServeError::TokenFile(TokenFileError::Empty))
    ));
    let mut opted_out = open;
    opted_out.allow_unauthenticated = true;
    assert!(opted_out.check_security().is_ok());
    assert!(loopback(runtime_config(1)).check_security().is_ok());
    assert!(ServeConfig::new("localhost:0", runtime_config(1))
        .check_security()
        .is_ok());
}

#[test]
fn an_open_metrics_address_needs_a_token_or_an_explicit_opt_out() {
    let mut open = loopback(runtime_config(1));
    open.metrics_listen = Some("0.0.0.0:0".into());
    assert!(matches!(
        open.check_security(),
        Err(ServeError::OpenMetricsListen(ref addr)) if addr == "0.0.0.0:0"
    ));
    assert!(matches!(
        Server::start(tiny_model(), open.clone()),
        Err(ServeError::OpenMetricsListen(_))
    ));
    let mut with_token = open.clone();
    with_token.auth_token = Some("t".into());
    assert!(with_token.check_security().is_ok());
    let mut opted_out = open;
    opted_out.allow_unauthenticated = true;
    assert!(opted_out.check_security().is_ok());
    let mut local = loopback(runtime_config(1));
    local.metrics_listen = Some("127.0.0.1:0".into());
    assert!(local.check_security().is_ok());
}

#[test]
fn an_open_http_address_needs_a_token_as_grpc_does() {
    let mut open = loopback(runtime_config(1));
    open.http_listen = Some("0.0.0.0:0".into());
    assert!(matches!(
        open.check_security(),
        Err(ServeError::OpenListen(ref addr)) if addr == "0.0.0.0:0"
    ));
    let mut with_token = open.clone();
    with_token.auth_token = Some("t".into());
    assert!(with_token.check_security().is_ok());
    // A certificate and key that are not PEM fail the start: nothing is
    // served with them, on either listener.
    let mut tls = with_token;
    tls.http_listen = Some("127.0.0.1:0".into());
    tls.tls = Some(inferd::server::TlsIdentity {
        cert_pem: b"cert".to_vec(),
        key_pem: b"key".to_vec(),
    });
    assert!(tls.check_security().is_ok());
    assert!(
        Server::start(tiny_model(), tls).is_err(),
        "a garbage certificate was served"
    );
    let mut local = loopback(runtime_config(1));
    local.http_listen = Some("127.0.0.1:0".into());
    assert!(local.check_security().is_ok());
}

#[test]
fn tls_serves_a_whole_session_and_refuses_plaintext() {
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .expect("self-signed certificate");
    let cert_pem = certified.cert.pem();
    let mut cfg = loopback(runtime_config(1));
    cfg.tls = Some(TlsIdentity {
        cert_pem: cert_pem.clone().into_bytes(),
        key_pem: certified.key_pair.serialize_pem().into_bytes(),
    });
    let server = Server::start(tiny_model(), cfg).expect("TLS server starts");
    let addr = server.addr().to_string();
    let env = client_env();
    let credentials = ChannelCredentialsBuilder::new()
        .root_cert(cert_pem.into_bytes())
        .build();
    let channel = ChannelBuilder::new(Arc::clone(&env))
        .override_ssl_target("localhost")
        .set_credentials(credentials)
        .connect(&addr);
    let secure = Served {
        client: RuntimeServiceClient::new(channel.clone()),
        sessions: SessionServiceClient::new(channel.clone()),
        raw: grpcio::Client::new(channel.clone()),
        health: HealthClient::new(channel),
        server: Some(server),
        token: None,
        _env: Arc::clone(&env),
    };
    let id = secure.create("tls", &[]);
    assert_eq!(secure.append(&id, &[1, 2, 3]).expect("append"), 3);
    let (tokens, done) = secure.run(gen_req(&id, 4));
    assert_eq!(tokens.len(), 4);
    assert_eq!(done.get_history_length(), 7);
    assert_eq!(secure.close(&id).expect("closed"), 7);

    let plain = RuntimeServiceClient::new(ChannelBuilder::new(env).connect(&addr));
    let got = plain.create_session_opt(
        &pb::CreateSessionRequest::new(),
        CallOption::default().timeout(Duration::from_secs(3)),
    );
    let err = got.map_err(status_of).expect_err("plaintext is refused");
    assert_ne!(err.code, RpcStatusCode::OK);
    secure.stop();
}

// ------------------------------------------------------ graceful shutdown --
