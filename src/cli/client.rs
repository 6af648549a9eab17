//! A blocking client for `kakeya.v1.RuntimeService` and inferd's
//! `inferd.session.v1.SessionService`: one channel to one server, the bearer token and deadline attached to every call, and every
//! failure turned into a [`RemoteError`] that names the gRPC status.

use std::sync::Arc;

use grpcio::{
    CallOption, ChannelBuilder, ChannelCredentialsBuilder, Environment, Metadata, MetadataBuilder,
};

use super::remote::{status_name, ConnectArgs, RemoteError};
use crate::proto::inferd_session_v1::session_service::{ForkSessionRequest, ForkSessionResponse};
use crate::proto::inferd_session_v1::session_service_grpc::SessionServiceClient;
use crate::proto::kakeya_v1::runtime::{
    AppendTokensRequest, AppendTokensResponse, CloseSessionRequest, CreateSessionRequest,
    CreateSessionResponse, GenerateDone, GenerateRequest, GenerateResponse_oneof_payload,
    GetSessionInfoRequest, GetSessionInfoResponse, LogitBias,
};
use crate::proto::kakeya_v1::runtime_grpc::RuntimeServiceClient;
use crate::sampler::SamplingParams;

/// A connection to one inferd server.
pub struct RemoteClient {
    client: RuntimeServiceClient,
    extensions: SessionServiceClient,
    server: String,
    headers: Option<Metadata>,
    timeout: Option<std::time::Duration>,
}

/// What a Generate call streamed besides its tokens.
pub enum GenerateEnd {
    /// The server's terminal message.
    Done(GenerateDone),
    /// The caller's token handler asked to stop; the call was cancelled.
    StoppedByCaller,
}

impl RemoteClient {
    /// Opens a channel to the server `args` names (the connection itself
    /// is made lazily, by the first call).
    pub fn connect(args: &ConnectArgs) -> Result<Self, RemoteError> {
        let server = args.address();
        // The C core takes C strings; a NUL could only come from a
        // config value, and would otherwise abort inside grpcio.
        for (what, value) in [
            ("server address", Some(server.as_str())),
            ("TLS server name", args.tls_server_name.as_deref()),
        ] {
            if value.is_some_and(|v| v.contains('\0')) {
                return Err(RemoteError::Transport {
                    server: server.clone(),
                    detail: format!("the {what} contains a NUL byte"),
                });
            }
        }
        let headers = match args.token_file() {
            Some(path) => Some(bearer_metadata(&path)?),
            None => None,
        };
        let env = Arc::new(Environment::new(1));
        let mut builder = ChannelBuilder::new(env);
        let channel = match &args.tls_ca {
            Some(ca) => {
                let root = std::fs::read(ca).map_err(|source| RemoteError::TlsCa {
                    path: ca.display().to_string(),
                    source,
                })?;
                if let Some(name) = &args.tls_server_name {
                    builder = builder.override_ssl_target(name.clone());
                }
                let creds = ChannelCredentialsBuilder::new().root_cert(root).build();
                builder.set_credentials(creds).connect(&server)
            }
            None => builder.connect(&server),
        };
        Ok(Self {
            extensions: SessionServiceClient::new(channel.clone()),
            client: RuntimeServiceClient::new(channel),
            server,
            headers,
            timeout: args.timeout,
        })
    }

    /// Fresh options for one call: the deadline counts from now.
    fn call_option(&self) -> CallOption {
        let mut opt = CallOption::default();
        if let Some(headers) = &self.headers {
            opt = opt.headers(headers.clone());
        }
        if let Some(timeout) = self.timeout {
            opt = opt.timeout(timeout);
        }
        opt
    }

    fn fail(&self, error: grpcio::Error) -> RemoteError {
        rpc_error(&self.server, error)
    }

    /// Creates an empty session; `eos` are the ids that end a Generate.
    pub fn create_session(
        &self,
        label: &str,
        eos: &[u32],
    ) -> Result<CreateSessionResponse, RemoteError> {
        let mut req = CreateSessionRequest::new();
        req.set_client_label(label.to_owned());
        req.set_eos_token_ids(eos.to_vec());
        self.client
            .create_session_opt(&req, self.call_option())
            .map_err(|e| self.fail(e))
    }

    /// Appends `tokens`; the answer holds the history length after the
    /// append and how many old tokens the context-overflow policy dropped.
    pub fn append(
        &self,
        session_id: &str,
        tokens: &[u32],
    ) -> Result<AppendTokensResponse, RemoteError> {
        let mut req = AppendTokensRequest::new();
        req.set_session_id(session_id.to_owned());
        req.set_token_ids(tokens.to_vec());
        self.client
            .append_tokens_opt(&req, self.call_option())
            .map_err(|e| self.fail(e))
    }

    /// Runs a Generate call, handing each token to `on_token` as it
    /// arrives; when `on_token` returns false the call is cancelled.
    /// `on_truncated` hears of tokens the server dropped to fit the context.
    pub fn generate(
        &self,
        req: &GenerateRequest,
        mut on_token: impl FnMut(u32) -> bool,
        mut on_truncated: impl FnMut(u64),
    ) -> Result<GenerateEnd, RemoteError> {
        let receiver = self
            .client
            .generate_opt(req, self.call_option())
            .map_err(|e| self.fail(e))?;
        // The commands are plain blocking programs: the stream is read on
        // this thread, which parks between messages.
        let mut stream = futures_executor::block_on_stream(receiver);
        let mut tokens = 0u64;
        loop {
            let Some(message) = stream.next() else {
                return Err(RemoteError::StreamWithoutDone {
                    server: self.server.clone(),
                    tokens,
                });
            };
            let message = message.map_err(|e| self.fail(e))?;
            match message.payload {
                Some(GenerateResponse_oneof_payload::token_id(id)) => {
                    tokens += 1;
                    if !on_token(id) {
                        stream.into_inner().cancel();
                        return Ok(GenerateEnd::StoppedByCaller);
                    }
                }
                Some(GenerateResponse_oneof_payload::done(done)) => {
                    return Ok(GenerateEnd::Done(done));
                }
                Some(GenerateResponse_oneof_payload::truncated(t)) => {
                    on_truncated(t.get_dropped_token_count());
                }
                // Log-probabilities are only sent when asked for, and a
                // payload from a newer schema is skipped, as proto3 intends.
                Some(GenerateResponse_oneof_payload::logprobs(_)) | None => {}
            }
        }
    }

    /// A session's history length, memory and counters.
    pub fn info(&self, session_id: &str) -> Result<GetSessionInfoResponse, RemoteError> {
        let mut req = GetSessionInfoRequest::new();
        req.set_session_id(session_id.to_owned());
        self.client
            .get_session_info_opt(&req, self.call_option())
            .map_err(|e| self.fail(e))
    }

    /// Forks a session at `at_length` tokens (all of them when `None`); an
    /// empty label keeps the source's.
    pub fn fork(
        &self,
        session_id: &str,
        at_length: Option<u64>,
        label: &str,
    ) -> Result<ForkSessionResponse, RemoteError> {
        let mut req = ForkSessionRequest::new();
        req.set_session_id(session_id.to_owned());
        if let Some(at) = at_length {
            req.set_at_length(at);
        }
        req.set_client_label(label.to_owned());
        self.extensions
            .fork_session_opt(&req, self.call_option())
            .map_err(|e| self.fail(e))
    }

    /// Closes a session and returns its final history length.
    pub fn close(&self, session_id: &str) -> Result<u64, RemoteError> {
        let mut req = CloseSessionRequest::new();
        req.set_session_id(session_id.to_owned());
        self.client
            .close_session_opt(&req, self.call_option())
            .map(|r| r.get_final_history_length())
            .map_err(|e| self.fail(e))
    }
}

/// A Generate request carrying every sampling knob of `params`; `seed` is
/// sent only when given, so the server draws one (and reports it) otherwise.
/// Counts beyond `u32` are clamped: both mean "more than any context".
pub fn generate_request(
    session_id: &str,
    max_tokens: usize,
    params: &SamplingParams,
    seed: Option<u64>,
) -> GenerateRequest {
    let clamp = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    let mut req = GenerateRequest::new();
    req.set_session_id(session_id.to_owned());
    req.set_max_tokens(clamp(max_tokens));
    if let Some(seed) = seed {
        req.set_seed(seed);
    }
    req.set_temperature(params.temperature);
    req.set_top_k(params.top_k);
    req.set_top_p(params.top_p);
    req.set_min_p(params.min_p);
    req.set_repetition_penalty(params.repetition_penalty);
    req.set_presence_penalty(params.presence_penalty);
    req.set_frequency_penalty(params.frequency_penalty);
    req.set_penalty_last_n(clamp(params.penalty_last_n));
    for &(token_id, bias) in &params.logit_bias {
        let mut entry = LogitBias::new();
        entry.set_token_id(token_id);
        entry.set_bias(bias);
        req.mut_logit_bias().push(entry);
    }
    req
}

/// Turns a grpcio failure into a typed error that names the status.
fn rpc_error(server: &str, error: grpcio::Error) -> RemoteError {
    match error {
        grpcio::Error::RpcFailure(status) => {
            let number: i32 = status.code().into();
            RemoteError::Status {
                server: server.to_owned(),
                code: status_name(number),
                number,
                message: status.message().to_owned(),
            }
        }
        other => RemoteError::Transport {
            server: server.to_owned(),
            detail: other.to_string(),
        },
    }
}

/// Reads the token file into the `authorization: Bearer <token>` header.
fn bearer_metadata(path: &std::path::Path) -> Result<Metadata, RemoteError> {
    let shown = || path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| RemoteError::TokenFile {
        path: shown(),
        source,
    })?;
    // The server's format: a tenant may be handed its line of the server's
    // file, name and all.
    let token = crate::server::tokens::client_token(&text).map_err(|e| RemoteError::BadToken {
        path: shown(),
        reason: e.to_string(),
    })?;
    let mut builder = MetadataBuilder::with_capacity(1);
    builder
        .add_str("authorization", &format!("Bearer {token}"))
        .map_err(|e| RemoteError::BadToken {
            path: shown(),
            reason: format!("not sendable as a gRPC header: {e}"),
        })?;
    Ok(builder.build())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_rpc_becomes_a_status_error_naming_the_code() {
        let status = grpcio::RpcStatus::with_message(
            grpcio::RpcStatusCode::NOT_FOUND,
            "session abc is unknown".into(),
        );
        let e = rpc_error("127.0.0.1:1", grpcio::Error::RpcFailure(status));
        match &e {
            RemoteError::Status { code, number, .. } => {
                assert_eq!(*code, "NOT_FOUND");
                assert_eq!(*number, 5);
            }
            other => panic!("expected a status error, got {other:?}"),
        }
        assert!(e.to_string().contains("session abc is unknown"), "{e}");
    }

    #[test]
    fn a_generate_request_carries_every_sampling_knob() {
        let params = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            presence_penalty: 0.2,
            frequency_penalty: 0.3,
            penalty_last_n: usize::MAX,
            logit_bias: vec![(7, -100.0)],
            seed: 9,
        };
        let req = generate_request("s1", 12, &params, Some(5));
        assert_eq!(req.get_session_id(), "s1");
        assert_eq!(req.get_max_tokens(), 12);
        assert_eq!(req.get_seed(), 5);
        assert_eq!(req.get_temperature(), 0.7);
        assert_eq!(req.get_top_k(), 40);
        assert_eq!(req.get_top_p(), 0.9);
        assert_eq!(req.get_min_p(), 0.05);
        assert_eq!(req.get_repetition_penalty(), 1.1);
        assert_eq!(req.get_presence_penalty(), 0.2);
        assert_eq!(req.get_frequency_penalty(), 0.3);
        assert_eq!(req.get_penalty_last_n(), u32::MAX);
        assert_eq!(req.get_logit_bias().len(), 1);
        assert_eq!(req.get_logit_bias()[0].get_token_id(), 7);
        assert_eq!(req.get_logit_bias()[0].get_bias(), -100.0);

        let unseeded = generate_request("s1", 1, &params, None);
        assert!(!unseeded.has_seed());
        assert!(unseeded.has_temperature());
    }

    #[test]
    fn the_token_file_becomes_a_bearer_header() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        std::fs::write(&path, "s3cret\n").expect("write");
        let meta = bearer_metadata(&path).expect("metadata");
        assert_eq!(meta.len(), 1);
        let (key, value) = meta.get(0).expect("one header");
        assert_eq!(key, "authorization");
        assert_eq!(value, b"Bearer s3cret");

        std::fs::write(&path, "  \n").expect("write");
        assert!(matches!(
            bearer_metadata(&path),
            Err(RemoteError::BadToken { .. })
        ));
        assert!(matches!(
            bearer_metadata(&dir.path().join("absent")),
            Err(RemoteError::TokenFile { .. })
        ));
    }
}
