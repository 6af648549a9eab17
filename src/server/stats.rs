//! Server-level counters the runtime cannot see: calls by method and final
//! status, and Generate streams open right now. Updated with relaxed atomics
//! from the completion-queue threads; read by the metrics endpoint.

use std::sync::atomic::{AtomicU64, Ordering};

use grpcio::RpcStatusCode;

/// The RPCs counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    CreateSession,
    AppendTokens,
    Generate,
    CloseSession,
    GetSessionInfo,
    /// `inferd.session.v1.SessionService/ForkSession`.
    ForkSession,
}

impl Method {
    pub const ALL: [Method; 6] = [
        Method::CreateSession,
        Method::AppendTokens,
        Method::Generate,
        Method::CloseSession,
        Method::GetSessionInfo,
        Method::ForkSession,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Method::CreateSession => "CreateSession",
            Method::AppendTokens => "AppendTokens",
            Method::Generate => "Generate",
            Method::CloseSession => "CloseSession",
            Method::GetSessionInfo => "GetSessionInfo",
            Method::ForkSession => "ForkSession",
        }
    }
}

/// gRPC defines status codes 0 to 16.
const CODES: usize = 17;

/// The canonical upper-case name of a gRPC status code (as metrics label
/// it and the CLI client prints it); `UNRECOGNISED_STATUS` outside 0-16.
pub fn code_name(code: i32) -> &'static str {
    const NAMES: [&str; CODES] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i))
        .copied()
        .unwrap_or("UNRECOGNISED_STATUS")
}

/// Counters of the gRPC and HTTP front ends.
#[derive(Debug, Default)]
pub struct ServerStats {
    calls: [[AtomicU64; CODES]; Method::ALL.len()],
    unauthenticated: AtomicU64,
    active_streams: AtomicU64,
    /// HTTP requests answered, by route and status (a lock is fine at the
    /// HTTP front door's rate: one per request).
    http: std::sync::Mutex<std::collections::BTreeMap<(&'static str, u16), u64>>,
    /// The HTTP front door's connections: open, timed out, limit reached.
    pub http_connections: std::sync::Arc<super::http::ConnStats>,
    /// Failed accepts of the metrics endpoint.
    pub metrics_accept_errors: std::sync::Arc<AtomicU64>,
}

/// Decrements the open-stream gauge when the stream's task ends.
pub struct StreamGuard<'a>(&'a AtomicU64);

impl Drop for StreamGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ServerStats {
    pub fn count(&self, method: Method, code: RpcStatusCode) {
        let code = usize::try_from(i32::from(code)).unwrap_or(2).min(CODES - 1);
        self.calls[method as usize][code].fetch_add(1, Ordering::Relaxed);
    }

    pub fn count_unauthenticated(&self) {
        self.unauthenticated.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stream_started(&self) -> StreamGuard<'_> {
        self.active_streams.fetch_add(1, Ordering::Relaxed);
        StreamGuard(&self.active_streams)
    }

    /// Every (method, status code, count) with a non-zero count.
    pub fn calls(&self) -> Vec<(&'static str, &'static str, u64)> {
        let mut out = Vec::new();
        for method in Method::ALL {
            for (code, counter) in self.calls[method as usize].iter().enumerate() {
                let n = counter.load(Ordering::Relaxed);
                if n > 0 {
                    out.push((method.name(), code_name(code as i32), n));
                }
            }
        }
        out
    }

    /// Counts an HTTP request answered with `status` on `route`.
    pub fn record_http(&self, route: &'static str, status: u16) {
        let mut http = self.http.lock().unwrap_or_else(|p| p.into_inner());
        *http.entry((route, status)).or_default() += 1;
    }

    /// HTTP requests answered so far: (route, status, count).
    pub fn http_calls(&self) -> Vec<(&'static str, u16, u64)> {
        let http = self.http.lock().unwrap_or_else(|p| p.into_inner());
        http.iter().map(|(&(r, s), &n)| (r, s, n)).collect()
    }

    /// Calls refused for a missing or wrong bearer token.
    pub fn unauthenticated(&self) -> u64 {
        self.unauthenticated.load(Ordering::Relaxed)
    }

    /// Generate streams open now.
    pub fn active_streams(&self) -> u64 {
        self.active_streams.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_counted_by_method_and_code() {
        let stats = ServerStats::default();
        stats.count(Method::Generate, RpcStatusCode::OK);
        stats.count(Method::Generate, RpcStatusCode::OK);
        stats.count(Method::AppendTokens, RpcStatusCode::NOT_FOUND);
        assert_eq!(
            stats.calls(),
            vec![("AppendTokens", "NOT_FOUND", 1), ("Generate", "OK", 2)]
        );
        {
            let _open = stats.stream_started();
            assert_eq!(stats.active_streams(), 1);
        }
        assert_eq!(stats.active_streams(), 0);
    }
}
