//! Opening a link: the coordinator's side of the handshake (the shard must
//! serve the expected fingerprint), then the Session stream it runs on.

use std::sync::Arc;

use grpcio::{CallOption, Environment};

use super::{LinkError, LinkOptions, ShardBackend, ShardCapacity, ShardLink};
use crate::cluster::fingerprint::Fingerprint;
use crate::cluster::frame::{Epochs, Inbound, OutboundFrames};
use crate::cluster::handshake::{limits_to_wire, PROTOCOL_VERSION};
use crate::cluster::raw::SESSION_RAW;
use crate::proto::inferd_shard_v1::shard_runtime as pb;
use crate::proto::inferd_shard_v1::shard_runtime_grpc::ShardRuntimeClient;

impl ShardLink {
    /// Connects, handshakes (the shard must serve `expected`), and opens
    /// the session stream.
    pub fn connect(
        addr: &str,
        expected: &Fingerprint,
        coordinator_epoch: u64,
        options: &LinkOptions,
    ) -> Result<ShardLink, LinkError> {
        let env = Arc::new(Environment::new(1));
        ShardLink::connect_in(&env, addr, expected, coordinator_epoch, options)
    }

    /// As [`ShardLink::connect`], on the completion queues of `env` (many
    /// links can share one).
    pub fn connect_in(
        env: &Arc<Environment>,
        addr: &str,
        expected: &Fingerprint,
        coordinator_epoch: u64,
        options: &LinkOptions,
    ) -> Result<ShardLink, LinkError> {
        let channel = crate::cluster::transport::client(Arc::clone(env), options.max_frame_bytes)
            .connect(addr);
        let client = ShardRuntimeClient::new(channel);
        let mut request = pb::HandshakeRequest::new();
        request.set_protocol_version(PROTOCOL_VERSION);
        request.set_expected(expected.to_wire());
        request.set_coordinator_epoch(coordinator_epoch);
        request.set_limits(limits_to_wire(
            options.max_frame_bytes,
            options.credit_window,
            0,
            &[options.encoding],
        ));
        let handshake_error = |message: String| LinkError::Handshake {
            addr: addr.to_owned(),
            message,
        };
        let response = client
            .handshake_opt(
                &request,
                CallOption::default().timeout(options.handshake_timeout),
            )
            .map_err(|e| match &e {
                // Refused terms are the handshake's; anything else never
                // reached a shard that could judge them.
                grpcio::Error::RpcFailure(status)
                    if matches!(
                        status.code(),
                        grpcio::RpcStatusCode::FAILED_PRECONDITION
                            | grpcio::RpcStatusCode::INVALID_ARGUMENT
                    ) =>
                {
                    handshake_error(e.to_string())
                }
                _ => LinkError::Transport {
                    addr: addr.to_owned(),
                    message: format!("handshake: {e}"),
                },
            })?;
        let served = Fingerprint::from_wire(response.get_served())
            .ok_or_else(|| handshake_error("the shard named no valid fingerprint".into()))?;
        if &served != expected {
            return Err(handshake_error(format!(
                "the shard serves layers {}..{} of {}, expected {}..{}",
                served.layer_begin,
                served.layer_end,
                served.hash_hex(),
                expected.layer_begin,
                expected.layer_end
            )));
        }
        let backend = ShardBackend::from_wire(response.get_backend()).ok_or_else(|| {
            handshake_error(format!(
                "the shard computes on {:?}, a backend this coordinator does not know",
                response.get_backend()
            ))
        })?;
        let limits = response.get_limits();
        let epochs = Epochs {
            shard: response.get_shard_epoch(),
            coordinator: coordinator_epoch,
        };
        let (sender, receiver) = client
            .client
            .duplex_streaming(&SESSION_RAW, CallOption::default())
            .map_err(|e| LinkError::Transport {
                addr: addr.to_owned(),
                message: e.to_string(),
            })?;
        let hidden_size = served.hidden_size as usize;
        Ok(ShardLink {
            addr: addr.to_owned(),
            epochs,
            hidden_size,
            encoding: options.encoding,
            sender,
            receiver,
            outbound: OutboundFrames::new(epochs),
            inbound: Inbound::to_coordinator(
                epochs,
                limits.get_max_frame_bytes().max(1) as usize,
                hidden_size,
                vec![options.encoding],
            ),
            credits: u64::from(limits.get_credit_window()),
            served,
            capacity: ShardCapacity {
                kv_pages: response.get_kv_pages(),
                page_positions: response.get_page_positions(),
                max_sessions: limits.get_max_sessions(),
                max_frame_rows: limits.get_max_frame_rows(),
                keeps_pages: response.get_keeps_pages(),
                backend,
            },
            hashes: options.record_hashes.then(|| (Vec::new(), Vec::new())),
            _client: client,
        })
    }
}
