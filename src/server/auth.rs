//! Who may call: the listen-address policy (loopback unless the operator
//! configured a token or said out loud that the server is open), the
//! bearer-token check run on every call before its handler, the same check
//! for the metrics endpoint's scrapes, and the caller's tenant, which a
//! handler reads again from the same header (grpcio's checker cannot pass
//! it on).

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use grpcio::{CheckResult, RpcContext, RpcStatus, RpcStatusCode, ServerChecker};

use super::stats::ServerStats;
use super::tokens::AccessTokens;
use crate::runtime::{RuntimeError, Tenant};

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
    tokens: AccessTokens,
    stats: Arc<ServerStats>,
}

const HEALTH_PREFIX: &[u8] = b"/grpc.health.v1.Health/";

impl BearerAuth {
    pub fn new(tokens: AccessTokens, stats: Arc<ServerStats>) -> Self {
        Self { tokens, stats }
    }

    fn authorized(&self, ctx: &RpcContext) -> bool {
        grpc_caller(Some(&self.tokens), ctx).is_ok()
    }
}

/// The tenant a gRPC call comes from: [`Tenant::NONE`] on a server without
/// tokens, else its token's tenant. The checker has already refused a call
/// without an accepted token; one that gets here without one anyway is
/// refused again rather than served as no tenant.
pub fn grpc_caller(
    tokens: Option<&AccessTokens>,
    ctx: &RpcContext,
) -> Result<Tenant, RuntimeError> {
    let Some(tokens) = tokens else {
        return Ok(Tenant::NONE);
    };
    let headers = ctx.request_headers();
    let values = headers
        .iter()
        .filter(|(key, _)| key.eq_ignore_ascii_case("authorization"))
        .map(|(_, value)| value);
    tokens
        .caller(values)
        .ok_or_else(|| RuntimeError::Internal("the call's bearer token is not accepted".into()))
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

/// The metrics endpoint's check of a scrape's `Authorization` header: any
/// accepted token, compared the same way as on every gRPC call (the
/// metrics are totals over every tenant and name no session).
pub fn http_bearer_check(tokens: AccessTokens) -> crate::metrics::Authorize {
    Arc::new(move |value: Option<&[u8]>| value.is_some_and(|v| tokens.caller([v]).is_some()))
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
    fn the_http_check_wants_the_whole_bearer_header_of_any_token() {
        let check = http_bearer_check(AccessTokens::parse("abc").unwrap());
        assert!(check(Some(b"Bearer abc")));
        assert!(!check(Some(b"Bearer abd")));
        assert!(!check(Some(b"abc")));
        assert!(!check(None));
        let check = http_bearer_check(
            AccessTokens::parse(
                "a: abc
b: xyz",
            )
            .unwrap(),
        );
        assert!(check(Some(b"Bearer abc")));
        assert!(check(Some(b"Bearer xyz")));
        assert!(!check(Some(b"Bearer a")));
    }
}
