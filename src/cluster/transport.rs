//! gRPC channel settings every peer of the shard protocol shares: message
//! size limits from the agreed frame size, and HTTP/2 keepalive, so a link
//! that goes silent (a cut cable, a host gone without a reset) fails the
//! calls on it within seconds instead of hanging them; and the one way a
//! shard or a relay starts its server with them.

use std::sync::Arc;
use std::time::Duration;

use std::net::SocketAddr;

use grpcio::{ChannelBuilder, Environment, Server, ServerBuilder, ServerCredentials, Service};

/// Keepalive ping period on an idle or waiting connection.
pub const KEEPALIVE_TIME: Duration = Duration::from_secs(1);
/// How long a ping may go unanswered before the connection is dead.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(2);

fn limit(max_message_bytes: u32) -> i32 {
    i32::try_from(max_message_bytes.saturating_add(1024)).unwrap_or(i32::MAX)
}

/// A client channel builder (coordinator to shard, relay to upstream).
pub fn client(env: Arc<Environment>, max_message_bytes: u32) -> ChannelBuilder {
    ChannelBuilder::new(env)
        .max_receive_message_len(limit(max_message_bytes))
        .max_send_message_len(limit(max_message_bytes))
        .keepalive_time(KEEPALIVE_TIME)
        .keepalive_timeout(KEEPALIVE_TIMEOUT)
        .keepalive_permit_without_calls(true)
        .http2_max_pings_without_data(0)
}

/// Server channel settings (shard, relay; `.build_args()` them): the same
/// limits, and pings at the clients' keepalive rate accepted rather than
/// punished.
pub fn server(env: Arc<Environment>, max_message_bytes: u32) -> ChannelBuilder {
    ChannelBuilder::new(env)
        .max_receive_message_len(limit(max_message_bytes))
        .max_send_message_len(limit(max_message_bytes))
        .keepalive_time(KEEPALIVE_TIME)
        .keepalive_timeout(KEEPALIVE_TIMEOUT)
        .http2_min_recv_ping_interval_without_data(KEEPALIVE_TIME / 2)
        .http2_max_ping_strikes(0)
}

/// Builds a server of `service` with [`server`]'s settings, binds `listen`
/// without TLS (as every shard and relay listener is) and starts it: the
/// server and the address it bound, or why not.
pub fn start_server(
    env: Arc<Environment>,
    max_message_bytes: u32,
    service: Service,
    listen: &str,
) -> Result<(Server, SocketAddr), String> {
    let args = server(Arc::clone(&env), max_message_bytes).build_args();
    let mut server = ServerBuilder::new(env)
        .channel_args(args)
        .register_service(service)
        .build()
        .map_err(|e| e.to_string())?;
    let port = server
        .add_listening_port(listen, ServerCredentials::insecure())
        .map_err(|e| e.to_string())?;
    server.start();
    let addr = crate::listen::bound_address(listen, port)?;
    Ok((server, addr))
}
