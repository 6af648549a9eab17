//! The HTTP front door's accept loop and connections: a connection limit,
//! a deadline on each request head, an idle timeout between requests, and
//! back-off when accepting fails, for HTTP and HTTPS alike.
//!
//! - **Limit**: at most [`HttpLimits::max_connections`] connections are
//!   open. At the limit the loop stops accepting, so new connections wait
//!   in the kernel's listen backlog ([`BACKLOG`] deep; past it, in the
//!   clients' SYN retries) until a slot frees, as nginx
//!   (`worker_connections`), HAProxy (`maxconn`) and Go's `LimitListener`
//!   do: a waiting client costs no descriptor and is served as soon as one
//!   closes.
//! - **Header timeout**: a connection whose first request head (after the
//!   TLS handshake, on HTTPS) is not whole within
//!   [`HttpLimits::header_timeout`] of the accept is closed: a client
//!   that sends half a request line holds a slot for that long at most.
//! - **Idle timeout**: after a response, a keep-alive connection's next
//!   request head must be whole within [`HttpLimits::idle_timeout`]
//!   (hyper's header-read timer, which starts when the connection goes
//!   idle), else it is closed.
//! - **Back-off**: a failed accept waits ([`AcceptBackoff`]) and is logged
//!   at most once a second ([`LogLimit`]).
//!
//! A request whose head arrived is not timed here: its body is bounded in
//! size, and its response may stream for as long as the generation runs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::limits::{AcceptBackoff, LogLimit};

/// The HTTP front door's limits on connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// Connections open at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// From the accept to the first request head received whole (the TLS
    /// handshake included).
    pub header_timeout: Duration,
    /// From the end of a response to the next request head received whole.
    pub idle_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 512,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Why a connection was closed by the server before the client closed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimedOut {
    /// No whole first request head (or TLS handshake) in time.
    Header,
    /// Idle too long between requests.
    Idle,
}

/// Counters of the HTTP front door's connections, for the metrics.
#[derive(Debug, Default)]
pub struct ConnStats {
    open: AtomicU64,
    limit: AtomicU64,
    header_timeouts: AtomicU64,
    idle_timeouts: AtomicU64,
    limit_reached: AtomicU64,
    accept_errors: AtomicU64,
}

/// A snapshot of [`ConnStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnNumbers {
    pub open: u64,
    pub limit: u64,
    pub header_timeouts: u64,
    pub idle_timeouts: u64,
    /// Times the listener stopped accepting because the limit was reached.
    pub limit_reached: u64,
    pub accept_errors: u64,
}

impl ConnStats {
    pub fn snapshot(&self) -> ConnNumbers {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConnNumbers {
            open: get(&self.open),
            limit: get(&self.limit),
            header_timeouts: get(&self.header_timeouts),
            idle_timeouts: get(&self.idle_timeouts),
            limit_reached: get(&self.limit_reached),
            accept_errors: get(&self.accept_errors),
        }
    }

    fn timed_out(&self, why: TimedOut) {
        let counter = match why {
            TimedOut::Header => &self.header_timeouts,
            TimedOut::Idle => &self.idle_timeouts,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A connection's slot: gives the permit back and lowers the open gauge
/// when the connection's task ends, however it ends.
struct Slot {
    stats: Arc<ConnStats>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Connections the kernel queues for the accept loop (capped by
/// `net.core.somaxconn`): where connections past the limit wait. Past it,
/// the kernel drops new connections' SYNs and the clients retry.
pub const BACKLOG: u32 = 1024;

/// Binds `listen` (`IP:PORT` or `localhost:PORT`) with a [`BACKLOG`]-deep
/// queue (tokio's `bind` asks for 128).
pub(super) async fn bind(listen: &str) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for addr in tokio::net::lookup_host(listen).await? {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        // As std and tokio do: a restart may bind while old connections
        // linger in TIME_WAIT.
        socket.set_reuseaddr(true)?;
        match socket.bind(addr).and_then(|()| socket.listen(BACKLOG)) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{listen} names no address"),
        )
    }))
}

/// Accepts connections on `listener` and serves `app` on each (through
/// TLS when `acceptor` is given) until `stopped` fires, then lets the open
/// connections finish their requests.
pub(super) async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    limits: HttpLimits,
    stats: Arc<ConnStats>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    static ACCEPT_FAILED: LogLimit = LogLimit::per_second();
    let max = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS);
    stats.limit.store(max as u64, Ordering::Relaxed);
    let slots = Arc::new(Semaphore::new(max));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut backoff = AcceptBackoff::new();
    loop {
        // A slot before the accept: at the limit, connections wait in the
        // backlog, not in a descriptor of ours.
        let permit = match Arc::clone(&slots).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                stats.limit_reached.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(max, "HTTP connection limit reached: not accepting");
                tokio::select! {
                    permit = Arc::clone(&slots).acquire_owned() => match permit {
                        Ok(permit) => permit,
                        // Never closed; if it were, nothing more to serve.
                        Err(_) => break,
                    },
                    _ = &mut stopped => break,
                }
            }
        };
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => {
                    backoff.succeeded();
                    tcp
                }
                Err(e) => {
                    stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                    let wait = backoff.failed(&e);
                    if let Some(suppressed) = ACCEPT_FAILED.allow() {
                        tracing::warn!(
                            error = %e,
                            retry_in_ms = wait.as_millis() as u64,
                            suppressed,
                            "accepting an HTTP connection failed"
                        );
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => continue,
                        _ = &mut stopped => break,
                    }
                }
            },
            _ = &mut stopped => break,
        };
        stats.open.fetch_add(1, Ordering::Relaxed);
        let slot = Slot {
            stats: Arc::clone(&stats),
            _permit: permit,
        };
        let app = app.clone();
        let acceptor = acceptor.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let first_head = tokio::time::sleep(limits.header_timeout);
            tokio::pin!(first_head);
            let outcome = match acceptor {
                None => serve_connection(tcp, app, limits, watcher, first_head).await,
                Some(acceptor) => {
                    tokio::select! {
                        tls = acceptor.accept(tcp) => match tls {
                            Ok(tls) => {
                                serve_connection(tls, app, limits, watcher, first_head).await
                            }
                            Err(e) => {
                                tracing::debug!(error = %e, "a TLS handshake failed");
                                None
                            }
                        },
                        _ = &mut first_head => Some(TimedOut::Header),
                    }
                }
            };
            if let Some(why) = outcome {
                slot.stats.timed_out(why);
                tracing::debug!(?why, "closed an HTTP connection that timed out");
            }
            drop(slot);
        });
    }
    // No more accepts; what is open finishes its requests.
    drop(listener);
    graceful.shutdown().await;
}

/// Serves one connection until it ends; says why when the server closed it
/// for a timeout.
async fn serve_connection<I>(
    io: I,
    app: Router,
    limits: HttpLimits,
    watcher: hyper_util::server::graceful::Watcher,
    mut first_head: std::pin::Pin<&mut tokio::time::Sleep>,
) -> Option<TimedOut>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // Set once the first request head has been read whole.
    let headed = Arc::new(AtomicBool::new(false));
    let service = {
        let headed = Arc::clone(&headed);
        let inner = hyper_util::service::TowerToHyperService::new(app);
        hyper::service::service_fn(move |request| {
            headed.store(true, Ordering::Relaxed);
            hyper::service::Service::call(&inner, request)
        })
    };
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        // Hyper starts this timer whenever it waits for a request head:
        // from the accept, and again each time the connection goes idle.
        .header_read_timeout(limits.idle_timeout)
        .serve_connection(TokioIo::new(io), service);
    let connection = watcher.watch(connection);
    tokio::pin!(connection);
    let mut waiting_for_head = true;
    loop {
        tokio::select! {
            ended = &mut connection => {
                return match ended {
                    Err(e) if e.is_timeout() => Some(if headed.load(Ordering::Relaxed) {
                        TimedOut::Idle
                    } else {
                        TimedOut::Header
                    }),
                    Err(e) => {
                        tracing::debug!(error = %e, "an HTTP connection ended");
                        None
                    }
                    Ok(()) => None,
                };
            }
            _ = &mut first_head, if waiting_for_head => {
                if !headed.load(Ordering::Relaxed) {
                    // Dropping the connection closes it.
                    return Some(TimedOut::Header);
                }
                waiting_for_head = false;
            }
        }
    }
}
