//! Who may call: the listen-address policy (loopback unless the operator
//! configured a token or said out loud that the server is open), the
//! bearer-token check run on every call before its handler, and the same
//! check for the metrics endpoint's scrapes.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use grpcio::{CheckResult, RpcContext, RpcStatus, RpcStatusCode, ServerChecker};

use super::stats::ServerStats;

/// Whether every address `listen` names is a loopback address. Unknown or
/// unresolvable names count as not loopback (fail closed).
pub fn is_loopback(listen: &str) -> bool {
    if let Some(port) = listen.strip_prefix("localhost:") {
        return port.parse::<u16>().is_ok();
    }
    if let Ok(addr) = listen.parse::<SocketAddr>() {
        return addr.ip().is_loopback();
    }
    match listen.to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<IpAddr> = addrs.map(|a| a.ip()).collect();
            !addrs.is_empty() && addrs.iter().all(IpAddr::is_loopback)
        }
        Err(_) => false,
    }
}

/// Checks `authorization: Bearer <token>` on every call. The health service
/// is exempt so that load balancers and probes, which cannot send
/// credentials, can still see whether the server is up; it reveals nothing
/// else.
#[derive(Clone)]
pub struct BearerAuth {
    expected: Arc<[u8]>,
    stats: Arc<ServerStats>,
}

const HEALTH_PREFIX: &[u8] = b"/grpc.health.v1.Health/";

impl BearerAuth {
    pub fn new(token: &str, stats: Arc<ServerStats>) -> Self {
        Self {
            expected: format!("Bearer {token}").into_bytes().into(),
            stats,
        }
    }

    fn authorized(&self, ctx: &RpcContext) -> bool {
        ctx.request_headers()
            .iter()
            .filter(|(key, _)| key.eq_ignore_ascii_case("authorization"))
            .any(|(_, value)| constant_time_eq(value, &self.expected))
    }
}

impl ServerChecker for BearerAuth {
    fn check(&mut self, ctx: &RpcContext) -> CheckResult {
        if ctx.method().starts_with(HEALTH_PREFIX) || self.authorized(ctx) {
            return CheckResult::Continue;
        }
        self.stats.count_unauthenticated();
        tracing::warn!(peer = %ctx.peer(), "call refused: missing or wrong bearer token");
        CheckResult::Abort(RpcStatus::with_message(
            RpcStatusCode::UNAUTHENTICATED,
            "missing or wrong bearer token (metadata `authorization: Bearer <token>`)".into(),
        ))
    }

    fn box_clone(&self) -> Box<dyn ServerChecker> {
        Box::new(self.clone())
    }
}

/// The metrics endpoint's check of a scrape's `Authorization` header: the
/// same token, compared the same way, as on every gRPC call.
pub fn http_bearer_check(token: &str) -> crate::metrics::Authorize {
    let expected: Arc<[u8]> = format!("Bearer {token}").into_bytes().into();
    Arc::new(move |value: Option<&[u8]>| value.is_some_and(|v| constant_time_eq(v, &expected)))
}

/// Compares without an early exit, so the time taken says nothing about how
/// much of a guessed token was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_addresses_are_recognised_and_others_are_not() {
        for addr in [
            "127.0.0.1:50051",
            "[::1]:0",
            "localhost:9000",
            "127.0.0.2:1",
        ] {
            assert!(is_loopback(addr), "{addr}");
        }
        for addr in [
            "0.0.0.0:50051",
            "[::]:1",
            "10.1.2.3:80",
            "no-such-host.invalid:1",
            "junk",
        ] {
            assert!(!is_loopback(addr), "{addr}");
        }
    }

    #[test]
    fn the_http_check_wants_the_whole_bearer_header() {
        let check = http_bearer_check("abc");
        assert!(check(Some(b"Bearer abc")));
        assert!(!check(Some(b"Bearer abd")));
        assert!(!check(Some(b"abc")));
        assert!(!check(None));
    }

    #[test]
    fn token_comparison_needs_every_byte() {
        assert!(constant_time_eq(b"Bearer abc", b"Bearer abc"));
        assert!(!constant_time_eq(b"Bearer abd", b"Bearer abc"));
        assert!(!constant_time_eq(b"Bearer ab", b"Bearer abc"));
    }
}
