//! `GET /metrics` over HTTP/1.x on one thread, with a bounded number of
//! connections and a deadline on each, whatever the clients do.
//!
//! The thread runs a `poll(2)` loop over the listener, a wake-up socket and
//! at most [`MAX_CONNECTIONS`] non-blocking connections, so the process's
//! thread count never depends on its clients. A connection gets one request
//! and one response (`Connection: close`), in three phases:
//!
//! - **reading**: the request head ([`MAX_HEAD_BYTES`] at most) must be
//!   complete within [`REQUEST_TIMEOUT`] of the accept;
//! - **writing**: the client must take the response within
//!   [`RESPONSE_TIMEOUT`]; one that does not read only holds its own slot,
//!   never the thread;
//! - **lingering**: the write side is shut, and whatever the client still
//!   sends (pipelined requests, which are never answered) is read and
//!   dropped for at most [`LINGER`], so the response is not lost to a reset.
//!
//! A connection past its phase's deadline is closed. When every slot is
//! taken, a new connection takes the slot of the connection accepted
//! longest ago that has not sent a whole request yet (failing that, the
//! oldest), so idle connections cannot lock a scraper out.
//!
//! With an access check ([`Authorize`]), every request must carry an
//! `Authorization` header the check accepts, else `401 Unauthorized`
//! (before the path is even looked at).
//!
//! A failed accept that is not the connection's own (out of descriptors:
//! the connection stays in the backlog and the listener stays readable)
//! takes the listener out of the poll set for a back-off delay
//! ([`AcceptBackoff`]) instead of spinning on it, and is logged at most once
//! a second ([`LogLimit`]).

use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::RenderFn;
use crate::limits::{AcceptBackoff, LogLimit};

/// Connections served at once; a new one beyond this evicts an idle one.
pub const MAX_CONNECTIONS: usize = 64;
/// Longest request head read (request line and headers).
pub const MAX_HEAD_BYTES: usize = 8 * 1024;
/// From the accept to a complete request head.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// From a complete request to the last byte of the response taken.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long what a client sends after its response is read and dropped.
pub const LINGER: Duration = Duration::from_secs(1);

/// Decides whether a request may be answered, given the value of its
/// `Authorization` header (`None`: no such header).
pub type Authorize = Arc<dyn Fn(Option<&[u8]>) -> bool + Send + Sync>;

/// `GET /metrics` over HTTP on its own thread; stopped and joined on drop.
pub struct MetricsEndpoint {
    addr: SocketAddr,
    /// Dropping it wakes the thread, which then returns.
    wake: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsEndpoint {
    /// Binds `addr` (`HOST:PORT`; port 0 picks a free one) and starts
    /// serving. `authorize`: the check every request must pass (`None`:
    /// open).
    pub fn bind(
        addr: &str,
        render: RenderFn,
        authorize: Option<Authorize>,
    ) -> Result<MetricsEndpoint, io::Error> {
        Self::bind_counted(addr, render, authorize, Arc::new(AtomicU64::new(0)))
    }

    /// [`MetricsEndpoint::bind`], counting failed accepts in
    /// `accept_errors`.
    pub fn bind_counted(
        addr: &str,
        render: RenderFn,
        authorize: Option<Authorize>,
        accept_errors: Arc<AtomicU64>,
    ) -> Result<MetricsEndpoint, io::Error> {
        let cannot =
            |e: io::Error| io::Error::new(e.kind(), format!("cannot serve metrics on {addr}: {e}"));
        let listener = TcpListener::bind(addr).map_err(cannot)?;
        listener.set_nonblocking(true).map_err(cannot)?;
        let bound = listener.local_addr().map_err(cannot)?;
        let (wake, woken) = UnixStream::pair().map_err(cannot)?;
        woken.set_nonblocking(true).map_err(cannot)?;
        let mut server = HttpServer {
            listener,
            woken,
            conns: Vec::with_capacity(MAX_CONNECTIONS),
            render,
            authorize,
            backoff: AcceptBackoff::new(),
            accept_paused_until: None,
            accept_errors,
        };
        let thread = std::thread::Builder::new()
            .name("inferd-metrics".into())
            .spawn(move || server.run())?;
        Ok(MetricsEndpoint {
            addr: bound,
            wake: Some(wake),
            thread: Some(thread),
        })
    }

    /// The bound address (with the real port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        // The other end sees the hang-up and the loop returns, closing the
        // listener and every connection.
        self.wake = None;
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("the metrics thread panicked");
            }
        }
    }
}

/// Everything the serving thread owns.
struct HttpServer {
    listener: TcpListener,
    /// Readable (hung up) once the endpoint is dropped.
    woken: UnixStream,
    conns: Vec<Conn>,
    render: RenderFn,
    authorize: Option<Authorize>,
    backoff: AcceptBackoff,
    /// After a failed accept: the listener is left out of the poll set
    /// until then.
    accept_paused_until: Option<Instant>,
    accept_errors: Arc<AtomicU64>,
}

/// Where a connection is in its one exchange.
enum Phase {
    /// Collecting the request head.
    Reading { head: Vec<u8> },
    /// Sending the response; `sent` bytes of `out` are out.
    Writing { out: Vec<u8>, sent: usize },
    /// Response sent and write side shut; dropping what still comes.
    Lingering,
}

struct Conn {
    stream: TcpStream,
    accepted: Instant,
    /// When the current phase must be over.
    deadline: Instant,
    phase: Phase,
}

/// What a turn did with a connection.
enum Next {
    Keep,
    Close,
}

impl HttpServer {
    fn run(&mut self) {
        static POLL_FAILED: LogLimit = LogLimit::per_second();
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(MAX_CONNECTIONS + 2);
        loop {
            let now = Instant::now();
            self.conns.retain(|c| c.deadline > now);
            if self.accept_paused_until.is_some_and(|until| until <= now) {
                self.accept_paused_until = None;
            }
            fds.clear();
            fds.push(poll_fd(self.woken.as_raw_fd(), libc::POLLIN));
            // A negative descriptor is skipped by poll(2): the listener
            // rests while accepting backs off.
            let listening = match self.accept_paused_until {
                Some(_) => -1,
                None => self.listener.as_raw_fd(),
            };
            fds.push(poll_fd(listening, libc::POLLIN));
            for conn in &self.conns {
                fds.push(poll_fd(conn.stream.as_raw_fd(), conn.interest()));
            }
            let timeout = self
                .conns
                .iter()
                .map(|c| c.deadline)
                .chain(self.accept_paused_until)
                .map(|deadline| deadline.saturating_duration_since(now))
                .min()
                .map_or(-1, |left| {
                    // Rounded up, so the deadline has passed on waking.
                    i32::try_from(left.as_millis() + 1).unwrap_or(i32::MAX)
                });
            let nfds = fds.len() as libc::nfds_t;
            // SAFETY: `fds` is a live, initialised array of `nfds` pollfd
            // structs that nothing else touches during the call.
            let ready = unsafe { libc::poll(fds.as_mut_ptr(), nfds, timeout) };
            if ready < 0 {
                let err = io::Error::last_os_error();
                if err.kind() != ErrorKind::Interrupted {
                    if let Some(suppressed) = POLL_FAILED.allow() {
                        tracing::error!(error = %err, suppressed, "metrics endpoint: poll failed");
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                continue;
            }
            if fds[0].revents != 0 {
                return;
            }
            // Backwards, so a removal moves only an entry already served.
            for i in (0..self.conns.len()).rev() {
                if fds[i + 2].revents == 0 {
                    continue;
                }
                let next = self.conns[i].advance(&self.render, self.authorize.as_ref());
                if matches!(next, Next::Close) {
                    self.conns.swap_remove(i);
                }
            }
            if fds[1].revents != 0 {
                self.accept();
            }
        }
    }

    /// Takes every connection waiting (at most a table's worth per turn).
    fn accept(&mut self) {
        static ACCEPT_FAILED: LogLimit = LogLimit::per_second();
        for _ in 0..MAX_CONNECTIONS {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => {
                    self.backoff.succeeded();
                    stream
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.accept_errors.fetch_add(1, Ordering::Relaxed);
                    let wait = self.backoff.failed(&e);
                    if let Some(suppressed) = ACCEPT_FAILED.allow() {
                        tracing::warn!(
                            error = %e,
                            retry_in_ms = wait.as_millis() as u64,
                            suppressed,
                            "metrics endpoint: accept failed"
                        );
                    }
                    if wait.is_zero() {
                        // That connection's own failure: take the next.
                        continue;
                    }
                    // Out of descriptors: the connection stays in the
                    // backlog, and the listener out of the poll set for a
                    // while (the connections served meanwhile may free some).
                    self.accept_paused_until = Some(Instant::now() + wait);
                    return;
                }
            };
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            if self.conns.len() >= MAX_CONNECTIONS {
                self.evict_one();
            }
            let now = Instant::now();
            self.conns.push(Conn {
                stream,
                accepted: now,
                deadline: now + REQUEST_TIMEOUT,
                phase: Phase::Reading { head: Vec::new() },
            });
        }
    }

    /// Frees a slot: the oldest connection still waiting for its request,
    /// else the oldest of all.
    fn evict_one(&mut self) {
        let victim = self
            .conns
            .iter()
            .enumerate()
            .min_by_key(|(_, c)| (!matches!(c.phase, Phase::Reading { .. }), c.accepted))
            .map(|(i, _)| i);
        if let Some(i) = victim {
            tracing::debug!("metrics endpoint full: closing its oldest idle connection");
            self.conns.swap_remove(i);
        }
    }
}

fn poll_fd(fd: RawFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

impl Conn {
    fn interest(&self) -> libc::c_short {
        match self.phase {
            Phase::Reading { .. } | Phase::Lingering => libc::POLLIN,
            Phase::Writing { .. } => libc::POLLOUT,
        }
    }

    /// Moves the exchange on as far as the socket allows without waiting.
    fn advance(&mut self, render: &RenderFn, authorize: Option<&Authorize>) -> Next {
        if let Phase::Reading { head } = &mut self.phase {
            match read_head(&mut self.stream, head) {
                Ok(None) => return Next::Keep,
                Ok(Some(end)) => {
                    let out = respond(&head[..end], render, authorize);
                    self.phase = Phase::Writing { out, sent: 0 };
                    self.deadline = Instant::now() + RESPONSE_TIMEOUT;
                }
                Err(HeadError::TooLong) => {
                    let out = response(431, "Request Header Fields Too Large", &[], "");
                    self.phase = Phase::Writing { out, sent: 0 };
                    self.deadline = Instant::now() + RESPONSE_TIMEOUT;
                }
                Err(HeadError::Gone) => return Next::Close,
            }
        }
        if let Phase::Writing { out, sent } = &mut self.phase {
            while *sent < out.len() {
                match self.stream.write(&out[*sent..]) {
                    Ok(0) => return Next::Close,
                    Ok(n) => *sent += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Next::Keep,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => return Next::Close,
                }
            }
            if self.stream.shutdown(Shutdown::Write).is_err() {
                return Next::Close;
            }
            self.phase = Phase::Lingering;
            self.deadline = Instant::now() + LINGER;
        }
        // Lingering: drop what comes until the client closes its side.
        let mut sink = [0u8; 4096];
        loop {
            match self.stream.read(&mut sink) {
                Ok(0) => return Next::Close,
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Next::Keep,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Next::Close,
            }
        }
    }
}

/// Why no request head could be had.
enum HeadError {
    /// Longer than [`MAX_HEAD_BYTES`].
    TooLong,
    /// The client closed or the socket failed first.
    Gone,
}

/// Reads what is there into `head`; `Some(end)` once `head[..end]` is a
/// whole request head (through its blank line). Reads no further than
/// [`MAX_HEAD_BYTES`]: pipelined requests behind the first stay unread.
fn read_head(stream: &mut TcpStream, head: &mut Vec<u8>) -> Result<Option<usize>, HeadError> {
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(end) = head_end(head) {
            return Ok(Some(end));
        }
        let room = MAX_HEAD_BYTES.saturating_sub(head.len());
        if room == 0 {
            return Err(HeadError::TooLong);
        }
        let want = room.min(chunk.len());
        match stream.read(&mut chunk[..want]) {
            Ok(0) => return Err(HeadError::Gone),
            Ok(n) => head.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Err(HeadError::Gone),
        }
    }
}

/// The length of the head through its terminating blank line (`\r\n\r\n`,
/// or a bare `\n\n` from a lenient client), if it is all there.
fn head_end(bytes: &[u8]) -> Option<usize> {
    let crlf = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4);
    let lf = bytes.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The whole response to one request head.
fn respond(head: &[u8], render: &RenderFn, authorize: Option<&Authorize>) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut lines = text.lines();
    let mut request_line = lines.next().unwrap_or_default().split_whitespace();
    let (Some(method), Some(target), Some(version)) = (
        request_line.next(),
        request_line.next(),
        request_line.next(),
    ) else {
        return response(400, "Bad Request", &[], "bad request line\n");
    };
    if !version.starts_with("HTTP/1.") {
        return response(400, "Bad Request", &[], "HTTP/1.x only\n");
    }
    if let Some(authorize) = authorize {
        let credentials = lines.find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.trim()
                .eq_ignore_ascii_case("authorization")
                .then(|| value.trim().as_bytes())
        });
        if !authorize(credentials) {
            return response(
                401,
                "Unauthorized",
                &[("WWW-Authenticate", "Bearer realm=\"inferd metrics\"")],
                "missing or wrong bearer token (header `Authorization: Bearer <token>`)\n",
            );
        }
    }
    if target.split('?').next() != Some("/metrics") {
        return response(404, "Not Found", &[], "not found\n");
    }
    if method != "GET" {
        return response(405, "Method Not Allowed", &[("Allow", "GET")], "only GET\n");
    }
    match std::panic::catch_unwind(AssertUnwindSafe(|| render())) {
        Ok(body) => response(
            200,
            "OK",
            &[("Content-Type", "text/plain; version=0.0.4; charset=utf-8")],
            &body,
        ),
        Err(_) => {
            tracing::error!("rendering metrics panicked");
            response(500, "Internal Server Error", &[], "internal error\n")
        }
    }
}

/// An HTTP/1.1 response that closes the connection.
fn response(code: u16, reason: &str, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {code} {reason}\r\n");
    for (name, value) in headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    if !headers.iter().any(|(name, _)| *name == "Content-Type") {
        out.push_str("Content-Type: text/plain; charset=utf-8\r\n");
    }
    out.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    out.push_str(body);
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn endpoint(authorize: Option<Authorize>) -> MetricsEndpoint {
        MetricsEndpoint::bind(
            "127.0.0.1:0",
            Arc::new(|| "inferd_up 1\n".to_string()),
            authorize,
        )
        .expect("binds")
    }

    /// Sends `request` and reads the reply to the end (bounded).
    fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).expect("connects");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        stream.write_all(request).expect("sends");
        let mut reply = Vec::new();
        let _ = stream.read_to_end(&mut reply);
        String::from_utf8_lossy(&reply).into_owned()
    }

    #[test]
    fn heads_end_at_the_first_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\nGET"), Some(18));
        assert_eq!(head_end(b"GET / HTTP/1.0\n\n"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
    }

    #[test]
    fn requests_get_their_status() {
        let e = endpoint(None);
        let ok = exchange(e.addr(), b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("Content-Length: 12\r\n"), "{ok}");
        assert!(ok.ends_with("\r\n\r\ninferd_up 1\n"), "{ok}");
        let post = exchange(e.addr(), b"POST /metrics HTTP/1.1\r\n\r\n");
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        let junk = exchange(e.addr(), b"hello\r\n\r\n");
        assert!(junk.starts_with("HTTP/1.1 400"), "{junk}");
        let mut long = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        long.resize(MAX_HEAD_BYTES + 10, b'a');
        let long = exchange(e.addr(), &long);
        assert!(long.starts_with("HTTP/1.1 431"), "{long}");
    }

    #[test]
    fn with_a_check_only_accepted_credentials_are_answered() {
        let check: Authorize =
            Arc::new(|value: Option<&[u8]>| value == Some(&b"Bearer s3cret"[..]));
        let e = endpoint(Some(check));
        for request in [
            &b"GET /metrics HTTP/1.1\r\n\r\n"[..],
            b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer wrong\r\n\r\n",
            b"GET /nothing HTTP/1.1\r\n\r\n",
        ] {
            let reply = exchange(e.addr(), request);
            assert!(reply.starts_with("HTTP/1.1 401"), "{reply}");
            assert!(reply.contains("WWW-Authenticate: Bearer"), "{reply}");
            assert!(!reply.contains("inferd_up"), "{reply}");
        }
        let reply = exchange(
            e.addr(),
            b"GET /metrics HTTP/1.1\r\nauthorization:  Bearer s3cret\r\n\r\n",
        );
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    }

    #[test]
    fn a_full_table_makes_room_and_idle_connections_time_out() {
        let e = endpoint(None);
        // More idle connections than slots: the oldest give way.
        let idle: Vec<TcpStream> = (0..MAX_CONNECTIONS + 20)
            .map(|_| TcpStream::connect(e.addr()).expect("connects"))
            .collect();
        let t0 = Instant::now();
        let reply = exchange(e.addr(), b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        // The first idle connection was closed to make room: it reads EOF.
        let mut first = &idle[0];
        first
            .set_read_timeout(Some(REQUEST_TIMEOUT + Duration::from_secs(5)))
            .expect("timeout");
        let mut byte = [0u8; 1];
        assert!(matches!(first.read(&mut byte), Ok(0) | Err(_)));
    }

    #[test]
    fn a_pipelining_client_that_never_reads_blocks_no_one() {
        let e = endpoint(None);
        let addr = e.addr();
        let hog = std::thread::spawn(move || {
            let mut stream = TcpStream::connect(addr).expect("connects");
            stream
                .set_write_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            let request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(5000);
            // May fail once the server closes; it never reads either way.
            let _ = stream.write_all(&request);
            stream
        });
        std::thread::sleep(Duration::from_millis(100));
        let t0 = Instant::now();
        for _ in 0..5 {
            let reply = exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
            assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        }
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        drop(hog.join());
    }
}
