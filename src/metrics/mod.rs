//! Prometheus metrics: renders a [`RuntimeStats`] snapshot plus a few
//! server-level numbers in the Prometheus text exposition format (version
//! 0.0.4), every name prefixed `inferd_` (CONTRACT §2.9), and serves it as
//! `GET /metrics` ([`http`]: one thread, a bounded number of connections,
//! a deadline on each, and the server's bearer token when it has one).

mod http;

use std::fmt::{Display, Write as _};
use std::sync::Arc;

pub use http::{
    Authorize, MetricsEndpoint, LINGER, MAX_CONNECTIONS, MAX_HEAD_BYTES, REQUEST_TIMEOUT,
    RESPONSE_TIMEOUT,
};

/// The HTTP API's connections (`serve --http-listen` only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HttpConnections {
    pub open: u64,
    /// `--http-max-connections`.
    pub limit: u64,
    /// Closed without a whole first request head in time.
    pub header_timeouts: u64,
    /// Closed idle between requests.
    pub idle_timeouts: u64,
    /// Times the listener stopped accepting at the limit.
    pub limit_reached: u64,
}

use crate::runtime::RuntimeStats;

/// Calls finished by one gRPC method with one status code.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestCount {
    /// The method's name, e.g. `CreateSession`.
    pub method: String,
    /// The status code's name, e.g. `OK`, `NOT_FOUND`.
    pub code: String,
    pub count: u64,
}

/// The numbers only the server knows, rendered next to the runtime's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerNumbers {
    pub requests: Vec<RequestCount>,
    /// HTTP requests (the OpenAI-compatible API) by route and status.
    pub http_requests: Vec<RequestCount>,
    /// The HTTP API's connections, when it is served.
    pub http_connections: Option<HttpConnections>,
    /// Failed accepts by listener (`http`, `metrics`).
    pub accept_errors: Vec<(&'static str, u64)>,
    /// Server-streaming calls (Generate) in progress.
    pub grpc_active_streams: u64,
    /// Whether the health service answers SERVING.
    pub health_serving: bool,
    /// The sampler backend in use: `cpu` or `wgpu`.
    pub sampler_backend: String,
    /// The wgpu adapter the sampler runs on (name, backend, kind, driver);
    /// empty on the CPU.
    pub sampler_adapter: String,
    /// Where the layers are computed: `cpu`, `gpu` or `shards`.
    pub layers_backend: String,
    /// The layers' own description (the GPU adapter, the shards).
    pub layers: String,
}

/// The text exposition being written: one HELP and TYPE per family, then
/// its samples.
struct Exposition {
    out: String,
}

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.out, "# HELP inferd_{name} {help}");
        let _ = writeln!(self.out, "# TYPE inferd_{name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl Display) {
        let _ = write!(self.out, "inferd_{name}");
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (key, value)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{key}=\"{}\"", escape_label(value));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }

    /// A family with one unlabelled sample.
    fn single(&mut self, name: &str, kind: &str, help: &str, value: impl Display) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }
}

/// Escapes a label value: backslash, double quote and newline.
fn escape_label(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped
}

/// A float as the exposition format writes it.
fn float(value: f64) -> String {
    if value.is_nan() {
        "NaN".into()
    } else if value == f64::INFINITY {
        "+Inf".into()
    } else if value == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{value}")
    }
}

/// Renders the snapshot and the server's numbers as Prometheus text.
pub fn render(stats: &RuntimeStats, server: &ServerNumbers) -> String {
    let mut e = Exposition { out: String::new() };
    render_sessions(&mut e, stats);
    render_generation(&mut e, stats);
    render_kv_cache(&mut e, stats);
    render_spill(&mut e, stats);
    render_state_dir(&mut e, stats);
    render_restore(&mut e, stats);
    if let Some(replica) = &stats.replica {
        render_replica(&mut e, replica);
    }
    render_prefix_cache(&mut e, stats);
    render_workers(&mut e, stats);
    if let Some(shards) = &stats.shards {
        render_shards(&mut e, shards);
    }
    if let Some(rows) = stats.logit_rows_read {
        e.family(
            "gpu_logit_rows_read_total",
            "counter",
            "Rows of logits read back from the GPU that computed them: one per call while \
             sessions sample on the device, one per token when they sample on the CPU.",
        );
        e.sample("gpu_logit_rows_read_total", &[], rows);
    }
    if let Some(submissions) = stats.gpu_submissions {
        e.family(
            "gpu_submissions_total",
            "counter",
            "Command submissions to the GPU: one per decode step of a batch while sessions \
             sample on the device (its layers and its sampling go out together).",
        );
        e.sample("gpu_submissions_total", &[], submissions);
    }
    render_requests(&mut e, server);
    render_server_state(&mut e, server);
    e.out
}

/// Sessions: alive, created and ended by outcome, evicted by reason, and
/// what the live ones hold.
fn render_sessions(e: &mut Exposition, stats: &RuntimeStats) {
    e.single(
        "session_active",
        "gauge",
        "Sessions alive now.",
        stats.sessions_active,
    );
    e.family(
        "session_total",
        "counter",
        "Sessions by how they were created or ended.",
    );
    for (outcome, n) in [
        ("created", stats.sessions_created),
        ("forked", stats.sessions_forked),
        ("restored", stats.sessions_restored),
        ("closed", stats.evicted_close),
        ("evicted_ttl", stats.evicted_ttl),
        ("evicted_lru", stats.evicted_lru),
        ("failed", stats.sessions_failed),
    ] {
        e.sample("session_total", &[("outcome", outcome)], n);
    }
    e.family(
        "session_evicted_total",
        "counter",
        "Sessions whose KV was freed, by reason.",
    );
    for (reason, n) in [
        ("ttl", stats.evicted_ttl),
        ("lru", stats.evicted_lru),
        ("close", stats.evicted_close),
    ] {
        e.sample("session_evicted_total", &[("reason", reason)], n);
    }
    e.single(
        "session_kv_live_bytes",
        "gauge",
        "K and V bytes of the committed positions of all live sessions.",
        stats.kv_live_bytes,
    );
    e.single(
        "session_history_tokens",
        "gauge",
        "History tokens of all live sessions.",
        stats.history_tokens,
    );
    e.single(
        "draft_kv_held_bytes",
        "gauge",
        "Bytes of draft-model KV pages the sessions' drafts hold (serve --draft-model).",
        stats.draft_kv_held_bytes,
    );
    e.single(
        "draft_kv_pool_bytes",
        "gauge",
        "Bytes of the draft model's KV pools over all workers (0 without one).",
        stats.draft_kv_pool_bytes,
    );
}

/// Prefill (tokens and the duration histogram) and generated tokens.
fn render_generation(e: &mut Exposition, stats: &RuntimeStats) {
    e.single(
        "generate_prefill_tokens_total",
        "counter",
        "Prompt tokens computed (appends and truncation re-prefills).",
        stats.prefill_tokens,
    );
    let h = &stats.prefill_duration;
    let name = "generate_prefill_duration_seconds";
    e.family(
        name,
        "histogram",
        "Time to compute one append or truncation re-prefill.",
    );
    for (bound, n) in h.cumulative() {
        e.sample(&format!("{name}_bucket"), &[("le", &float(bound))], n);
    }
    e.sample(&format!("{name}_sum"), &[], float(h.sum_seconds));
    e.sample(&format!("{name}_count"), &[], h.count);
    e.single(
        "generate_tokens_total",
        "counter",
        "Tokens generated over all sessions.",
        stats.tokens_generated,
    );
    e.single(
        "speculation_proposed_tokens_total",
        "counter",
        "Tokens speculation proposed and computed in verification passes.",
        stats.speculation_proposed,
    );
    e.single(
        "speculation_accepted_tokens_total",
        "counter",
        "Proposed tokens that were the tokens sampled (emitted without a pass of their own).",
        stats.speculation_accepted,
    );
    e.single(
        "draft_kv_dropped_total",
        "counter",
        "Sessions' draft-model KV dropped to make room for another session's draft.",
        stats.draft_kv_dropped,
    );
}

/// Session invariant violations and the shared KV pool's pages and bytes.
fn render_kv_cache(e: &mut Exposition, stats: &RuntimeStats) {
    e.family(
        "cache_invariant_violations_total",
        "counter",
        "Session invariant violations (each removed its session).",
    );
    e.sample(
        "cache_invariant_violations_total",
        &[("kind", "inv1")],
        stats.inv1_violations,
    );
    e.sample(
        "cache_invariant_violations_total",
        &[("kind", "inv2")],
        stats.inv2_violations,
    );
    e.single(
        "kv_pages_free",
        "gauge",
        "KV pages free in the shared pool.",
        stats.kv_free_pages,
    );
    e.single(
        "kv_pages_total",
        "gauge",
        "KV pages in the shared pool.",
        stats.kv_total_pages,
    );
    e.single(
        "kv_used_bytes",
        "gauge",
        "Bytes of the KV pool's pages in use, each counted once however many sessions share it.",
        stats.kv_used_bytes,
    );
}

/// Spilled sessions: how many were and are spilled, and the bytes and
/// tokens their KV took on disk.
fn render_spill(e: &mut Exposition, stats: &RuntimeStats) {
    e.single(
        "session_spilled_total",
        "counter",
        "LRU evictions that kept the session (its KV given back, its history journaled) instead of ending it.",
        stats.sessions_spilled,
    );
    e.single(
        "session_spilled",
        "gauge",
        "Sessions spilled now: their next call feeds their history again.",
        stats.spilled_now,
    );
    e.single(
        "session_spill_bytes",
        "gauge",
        "Bytes of KV pages spilled sessions hold written out to the state directory.",
        stats.spill_bytes,
    );
    e.single(
        "session_spill_read_tokens_total",
        "counter",
        "Tokens of spilled sessions whose KV was read back from disk instead of computed.",
        stats.spill_read_tokens,
    );
}

/// The replicas' session store: sessions moved here and their tokens,
/// leases lost to other replicas, statements that failed.
fn render_replica(e: &mut Exposition, r: &crate::runtime::ReplicaStats) {
    e.single(
        "replica_takeovers_total",
        "counter",
        "Sessions this replica took over from the session store (each one moved here).",
        r.takeovers,
    );
    e.single(
        "replica_takeover_tokens_total",
        "counter",
        "History tokens of the sessions taken over, fed again unless shared pages held them.",
        r.takeover_tokens,
    );
    e.single(
        "replica_leases_lost_total",
        "counter",
        "Sessions dropped here because another replica took their lease.",
        r.leases_lost,
    );
    e.single(
        "replica_handoffs_total",
        "counter",
        "Sessions let go here because another replica asked for them (a call for them reached it).",
        r.handoffs,
    );
    e.single(
        "replica_store_failures_total",
        "counter",
        "Session store statements that failed; each write's call was undone and failed UNAVAILABLE.",
        r.store_failures,
    );
}

/// The state directory: journal failures, whether it takes writes (when
/// there is one), its bytes, and durable work its limits refused.
fn render_state_dir(e: &mut Exposition, stats: &RuntimeStats) {
    e.single(
        "session_journal_failures_total",
        "counter",
        "Session journal writes that failed; each such call was undone and failed UNAVAILABLE.",
        stats.journal_failures,
    );
    if let Some(writable) = stats.state_dir_writable {
        e.single(
            "state_dir_writable",
            "gauge",
            "1 while the state directory takes writes; 0 while it fails them (durable work refused).",
            u8::from(writable),
        );
        e.single(
            "state_dir_write_failures_total",
            "counter",
            "Writes, syncs and batch flushes to the state directory that failed.",
            stats.state_dir_write_failures,
        );
    }
    e.single(
        "state_bytes",
        "gauge",
        "Bytes of session journals, spill files and refused journals in the state directory (what --max-state-mib bounds; the page file is reserved apart).",
        stats.state_bytes,
    );
    e.family(
        "state_refused_total",
        "counter",
        "New durable work (a session, an append, a Generate, a fork, a spill) refused by the state directory's limits, by reason: its budget (--max-state-mib) or free space below the floor (--min-free-mib).",
    );
    e.sample(
        "state_refused_total",
        &[("reason", "budget")],
        stats.state_refused_budget,
    );
    e.sample(
        "state_refused_total",
        &[("reason", "free_space")],
        stats.state_refused_free_space,
    );
}

/// Restore at start: journals refused, history tokens kept, pages
/// rejected, digests that did not match.
fn render_restore(e: &mut Exposition, stats: &RuntimeStats) {
    e.single(
        "session_restore_refused_total",
        "counter",
        "Session journals not restored at start (untrusted, or no place or KV room).",
        stats.restore_refused,
    );
    e.single(
        "restore_kept_tokens_total",
        "counter",
        "Restored history tokens not fed again: their KV taken back from the state directory's page file, or kept by shards with a state directory.",
        stats.restore_kept_tokens,
    );
    e.single(
        "restore_pages_rejected_total",
        "counter",
        "Kept KV pages that failed their checksum at start and were computed again.",
        stats.restore_pages_rejected,
    );
    e.single(
        "restore_digest_mismatches_total",
        "counter",
        "Restored sessions whose logits did not hash to the digest their journal recorded.",
        stats.restore_digest_mismatches,
    );
}

/// The shared-prefix cache: tokens it saved, its entries and its pages.
fn render_prefix_cache(e: &mut Exposition, stats: &RuntimeStats) {
    e.single(
        "prefix_reused_tokens_total",
        "counter",
        "History tokens whose KV was mapped from shared-prefix pages instead of computed.",
        stats.prefix_reused_tokens,
    );
    e.single(
        "prefix_entries",
        "gauge",
        "Pages of positions the shared-prefix index lists.",
        stats.prefix_entries,
    );
    e.single(
        "prefix_cached_pages",
        "gauge",
        "KV pool pages only the shared-prefix cache holds (freed first when the pool is short).",
        stats.prefix_cached_pages,
    );
}

/// Requests: gRPC calls, HTTP requests and connections (when served),
/// and failed accepts.
fn render_requests(e: &mut Exposition, server: &ServerNumbers) {
    e.family(
        "grpc_requests_total",
        "counter",
        "Finished gRPC calls by method and status code.",
    );
    for r in &server.requests {
        e.sample(
            "grpc_requests_total",
            &[("method", &r.method), ("code", &r.code)],
            r.count,
        );
    }
    if !server.http_requests.is_empty() {
        e.family(
            "http_requests_total",
            "counter",
            "HTTP requests of the OpenAI-compatible API answered, by route and status.",
        );
        for r in &server.http_requests {
            e.sample(
                "http_requests_total",
                &[("route", &r.method), ("code", &r.code)],
                r.count,
            );
        }
    }
    if let Some(c) = &server.http_connections {
        render_http_connections(e, c);
    }
    if !server.accept_errors.is_empty() {
        e.family(
            "accept_errors_total",
            "counter",
            "Failed accepts by listener (each waits before the next: EMFILE and the like).",
        );
        for (listener, n) in &server.accept_errors {
            e.sample("accept_errors_total", &[("listener", listener)], n);
        }
    }
}

/// The server's state: streams in progress, health, and the sampler
/// backend.
fn render_server_state(e: &mut Exposition, server: &ServerNumbers) {
    e.single(
        "grpc_active_streams",
        "gauge",
        "Streaming calls in progress.",
        server.grpc_active_streams,
    );
    e.single(
        "health_serving",
        "gauge",
        "1 when the health service answers SERVING, else 0.",
        u8::from(server.health_serving),
    );
    e.family(
        "sampler_backend_info",
        "gauge",
        "The sampler backend in use and its wgpu adapter (always 1).",
    );
    e.sample(
        "sampler_backend_info",
        &[
            ("backend", &server.sampler_backend),
            ("adapter", &server.sampler_adapter),
        ],
        1,
    );
    e.family(
        "layers_backend_info",
        "gauge",
        "Where the model's layers are computed (cpu, gpu, shards) and on what (always 1).",
    );
    e.sample(
        "layers_backend_info",
        &[
            ("backend", &server.layers_backend),
            ("layers", &server.layers),
        ],
        1,
    );
}

/// The HTTP API's connections: open, the limit, closed for timeouts.
fn render_http_connections(e: &mut Exposition, c: &HttpConnections) {
    e.single(
        "http_connections_open",
        "gauge",
        "HTTP API connections open now.",
        c.open,
    );
    e.single(
        "http_connections_max",
        "gauge",
        "HTTP API connections allowed open at once (--http-max-connections).",
        c.limit,
    );
    e.family(
        "http_connections_timed_out_total",
        "counter",
        "HTTP API connections the server closed: no whole request head in time \
         (phase header) or idle too long between requests (phase idle).",
    );
    e.sample(
        "http_connections_timed_out_total",
        &[("phase", "header")],
        c.header_timeouts,
    );
    e.sample(
        "http_connections_timed_out_total",
        &[("phase", "idle")],
        c.idle_timeouts,
    );
    e.single(
        "http_connection_limit_reached_total",
        "counter",
        "Times the HTTP API stopped accepting at its connection limit (new connections \
         wait in the listen backlog until one closes).",
        c.limit_reached,
    );
}

/// The coordinator's view of its shards (`serve --shards` only).
fn render_shards(e: &mut Exposition, stats: &crate::runtime::ShardStatsSnapshot) {
    e.family(
        "shard_up",
        "gauge",
        "1 when the last contact with the shard succeeded, else 0.",
    );
    for s in &stats.shards {
        e.sample("shard_up", &[("shard", &s.shard)], u8::from(s.up));
    }
    e.family(
        "shard_backend_info",
        "gauge",
        "Where the shard computes its layers (cpu, gpu), from its last handshake (always 1).",
    );
    for s in &stats.shards {
        e.sample(
            "shard_backend_info",
            &[("shard", &s.shard), ("backend", s.backend)],
            1,
        );
    }
    e.family(
        "shard_failures_total",
        "counter",
        "Steps failed by a shard link, by shard and kind (transport, handshake, or the \
         protocol's error kind).",
    );
    for s in &stats.shards {
        for (kind, n) in &s.failures {
            e.sample(
                "shard_failures_total",
                &[("shard", &s.shard), ("kind", kind)],
                n,
            );
        }
    }
    e.family(
        "shard_reconnects_total",
        "counter",
        "Links to a shard connected again after a failure.",
    );
    for s in &stats.shards {
        e.sample(
            "shard_reconnects_total",
            &[("shard", &s.shard)],
            s.reconnects,
        );
    }
    e.family(
        "shard_restarts_total",
        "counter",
        "Times a shard came back with a new epoch (its sessions were lost).",
    );
    for s in &stats.shards {
        e.sample("shard_restarts_total", &[("shard", &s.shard)], s.restarts);
    }
    e.single(
        "shard_session_rebuilds_total",
        "counter",
        "Sessions rebuilt on the shards by feeding their history again.",
        stats.rebuilds,
    );
    e.single(
        "shard_rebuilt_tokens_total",
        "counter",
        "History tokens fed again by those rebuilds.",
        stats.rebuilt_tokens,
    );
    e.single(
        "shard_resumed_positions_total",
        "counter",
        "Positions of rebuilt sessions that every shard kept (pages kept by shards with a state directory), so they were not fed again.",
        stats.resumed_positions,
    );
}

/// One per-worker metric family: name, type, help, and how to read a worker's value.
type WorkerFamily = (
    &'static str,
    &'static str,
    &'static str,
    fn(&crate::runtime::WorkerStats) -> String,
);

/// One family per worker number, one sample per worker.
fn render_workers(e: &mut Exposition, stats: &RuntimeStats) {
    let ids: Vec<String> = (0..stats.workers.len()).map(|i| i.to_string()).collect();
    let families: [WorkerFamily; 7] = [
        (
            "worker_sessions",
            "gauge",
            "Sessions the worker owns.",
            |w| w.sessions.to_string(),
        ),
        (
            "worker_generated_tokens_total",
            "counter",
            "Tokens the worker generated.",
            |w| w.tokens_generated.to_string(),
        ),
        (
            "worker_steps_total",
            "counter",
            "Batched forward steps the worker ran.",
            |w| w.steps.to_string(),
        ),
        (
            "worker_batch_sequences",
            "gauge",
            "Sequences in the worker's last batched step.",
            |w| w.last_batch_sequences.to_string(),
        ),
        (
            "worker_batch_sequences_max",
            "gauge",
            "Most sequences the worker ever ran in one step.",
            |w| w.max_batch_sequences.to_string(),
        ),
        (
            "worker_queue_depth",
            "gauge",
            "Commands waiting for the worker plus operations queued on its sessions.",
            |w| w.queue_depth.to_string(),
        ),
        (
            "worker_decode_tokens_per_second",
            "gauge",
            "Tokens the worker decoded per second over the last 10 seconds.",
            |w| float(w.decode_tokens_per_second),
        ),
    ];
    for (name, kind, help, value) in families {
        e.family(name, kind, help);
        for (w, id) in stats.workers.iter().zip(&ids) {
            e.sample(name, &[("worker", id)], value(w));
        }
    }
}

/// What the endpoint calls for each scrape.
pub type RenderFn = Arc<dyn Fn() -> String + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::{HistogramSnapshot, WorkerStats, PREFILL_BUCKETS};
    use std::collections::{HashMap, HashSet};
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};

    fn stats() -> RuntimeStats {
        let mut counts = vec![0; PREFILL_BUCKETS.len() + 1];
        counts[2] = 3;
        counts[PREFILL_BUCKETS.len()] = 1;
        RuntimeStats {
            sessions_active: 3,
            sessions_created: 7,
            sessions_forked: 2,
            prefix_reused_tokens: 64,
            sessions_restored: 3,
            restore_kept_tokens: 4080,
            restore_pages_rejected: 5,
            restore_digest_mismatches: 1,
            sessions_spilled: 6,
            journal_failures: 1,
            replica: Some(crate::runtime::ReplicaStats {
                takeovers: 3,
                takeover_tokens: 2000,
                leases_lost: 1,
                handoffs: 4,
                store_failures: 2,
            }),
            state_dir_writable: Some(false),
            state_dir_write_failures: 4,
            spilled_now: 2,
            spill_bytes: 1 << 20,
            spill_read_tokens: 992,
            restore_refused: 1,
            state_bytes: 8192,
            state_refused_budget: 2,
            state_refused_free_space: 3,
            prefix_entries: 5,
            prefix_cached_pages: 4,
            kv_used_bytes: 4096,
            sessions_failed: 1,
            evicted_ttl: 1,
            evicted_lru: 1,
            evicted_close: 1,
            inv1_violations: 0,
            inv2_violations: 1,
            tokens_generated: 40,
            speculation_proposed: 30,
            speculation_accepted: 21,
            draft_kv_dropped: 2,
            prefill_tokens: 123,
            prefill_duration: HistogramSnapshot {
                bounds: PREFILL_BUCKETS.to_vec(),
                counts,
                sum_seconds: 12.5,
                count: 4,
            },
            kv_live_bytes: 4096,
            history_tokens: 16,
            draft_kv_held_bytes: 1024,
            draft_kv_pool_bytes: 8192,
            kv_free_pages: 10,
            kv_total_pages: 12,
            workers: vec![
                WorkerStats {
                    sessions: 2,
                    queue_depth: 5,
                    decode_tokens_per_second: 12.5,
                    tokens_generated: 30,
                    ..WorkerStats::default()
                },
                WorkerStats {
                    sessions: 1,
                    tokens_generated: 10,
                    ..WorkerStats::default()
                },
            ],
            shards: Some(crate::runtime::ShardStatsSnapshot {
                shards: vec![crate::runtime::ShardSnapshot {
                    shard: "10.0.0.2:7000".into(),
                    failures: vec![("transport", 2), ("checksum", 1)],
                    reconnects: 1,
                    restarts: 1,
                    up: true,
                    backend: "gpu",
                }],
                rebuilds: 3,
                rebuilt_tokens: 96,
                resumed_positions: 32,
            }),
            logit_rows_read: Some(11),
            gpu_submissions: Some(13),
        }
    }

    fn server() -> ServerNumbers {
        ServerNumbers {
            requests: vec![
                RequestCount {
                    method: "CreateSession".into(),
                    code: "OK".into(),
                    count: 7,
                },
                RequestCount {
                    method: "we\"ird\\name\nx".into(),
                    code: "NOT_FOUND".into(),
                    count: 2,
                },
            ],
            http_requests: vec![RequestCount {
                method: "/v1/chat/completions".into(),
                code: "200".into(),
                count: 4,
            }],
            http_connections: Some(HttpConnections {
                open: 3,
                limit: 512,
                header_timeouts: 2,
                idle_timeouts: 1,
                limit_reached: 4,
            }),
            accept_errors: vec![("http", 5), ("metrics", 0)],
            grpc_active_streams: 1,
            health_serving: true,
            sampler_backend: "wgpu".into(),
            sampler_adapter: "llvmpipe (Vulkan Cpu)".into(),
            layers_backend: "gpu".into(),
            layers: "layers on the GPU llvmpipe (Vulkan Cpu)".into(),
        }
    }

    /// One parsed sample: its full name, its labels and its value.
    type Sample = (String, Vec<(String, String)>, f64);

    /// Parses `name{k="v",...} value`, undoing the label escapes.
    fn parse_sample(line: &str) -> Result<Sample, String> {
        let name_end = line
            .find(['{', ' '])
            .ok_or_else(|| format!("no value: {line}"))?;
        let name = &line[..name_end];
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        {
            return Err(format!("bad name: {line}"));
        }
        let mut rest = &line[name_end..];
        let mut labels = Vec::new();
        if let Some(body) = rest.strip_prefix('{') {
            let mut chars = body.char_indices();
            let mut key = String::new();
            loop {
                let (_, c) = chars.next().ok_or("unterminated labels")?;
                match c {
                    '}' => break,
                    ',' => {}
                    '=' => {
                        if chars.next().map(|(_, c)| c) != Some('"') {
                            return Err(format!("unquoted label: {line}"));
                        }
                        let mut value = String::new();
                        loop {
                            match chars.next().ok_or("unterminated value")?.1 {
                                '"' => break,
                                '\\' => match chars.next().ok_or("dangling escape")?.1 {
                                    'n' => value.push('\n'),
                                    c @ ('\\' | '"') => value.push(c),
                                    c => return Err(format!("bad escape \\{c}")),
                                },
                                '\n' => return Err("raw newline in label".into()),
                                c => value.push(c),
                            }
                        }
                        labels.push((std::mem::take(&mut key), value));
                    }
                    c => key.push(c),
                }
            }
            let consumed = chars.next().map_or(body.len(), |(i, _)| i);
            rest = &body[consumed..];
        }
        let value = rest
            .strip_prefix(' ')
            .ok_or_else(|| format!("no space before the value: {line}"))?;
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().map_err(|_| format!("bad value {v:?}: {line}"))?,
        };
        Ok((name.to_string(), labels, value))
    }

    /// Checks the whole exposition: HELP then TYPE before each family's
    /// samples, every sample belonging to the family declared last, every
    /// value a number. Returns the samples.
    fn parse(text: &str) -> Result<Vec<Sample>, String> {
        let mut declared: HashMap<String, String> = HashMap::new();
        let mut current: Option<(String, String)> = None;
        let mut helped = HashSet::new();
        let mut samples = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap_or_default();
                helped.insert(name.to_string());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split(' ');
                let name = parts.next().unwrap_or_default().to_string();
                let kind = parts.next().unwrap_or_default().to_string();
                if !["counter", "gauge", "histogram"].contains(&kind.as_str()) {
                    return Err(format!("unknown type: {line}"));
                }
                if !helped.contains(&name) {
                    return Err(format!("TYPE without HELP: {line}"));
                }
                if declared.insert(name.clone(), kind.clone()).is_some() {
                    return Err(format!("declared twice: {line}"));
                }
                if kind == "counter" && !name.ends_with("_total") {
                    return Err(format!("counter not ending in _total: {line}"));
                }
                current = Some((name, kind));
            } else if line.starts_with('#') || line.is_empty() {
                return Err(format!("unexpected line: {line:?}"));
            } else {
                let sample = parse_sample(line)?;
                let (family, kind) = current.as_ref().ok_or("sample before any TYPE")?;
                let belongs = if kind == "histogram" {
                    ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|s| sample.0 == format!("{family}{s}"))
                } else {
                    &sample.0 == family
                };
                if !belongs {
                    return Err(format!("{} is not part of {family}", sample.0));
                }
                if !sample.0.starts_with("inferd_") {
                    return Err(format!("unprefixed: {line}"));
                }
                samples.push(sample);
            }
        }
        Ok(samples)
    }

    fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        samples
            .iter()
            .find(|(n, l, _)| {
                n == name
                    && l.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|s| s.2)
    }

    #[test]
    fn every_line_parses_and_belongs_to_a_declared_family() {
        let text = render(&stats(), &server());
        let samples = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let get = |name: &str, labels: &[(&str, &str)]| {
            value(&samples, name, labels).unwrap_or_else(|| panic!("no {name} {labels:?}"))
        };
        assert_eq!(get("inferd_session_active", &[]), 3.0);
        assert_eq!(get("inferd_gpu_logit_rows_read_total", &[]), 11.0);
        assert_eq!(get("inferd_gpu_submissions_total", &[]), 13.0);
        assert_eq!(get("inferd_session_total", &[("outcome", "created")]), 7.0);
        assert_eq!(get("inferd_session_total", &[("outcome", "forked")]), 2.0);
        assert_eq!(get("inferd_prefix_reused_tokens_total", &[]), 64.0);
        assert_eq!(get("inferd_speculation_proposed_tokens_total", &[]), 30.0);
        assert_eq!(get("inferd_speculation_accepted_tokens_total", &[]), 21.0);
        assert_eq!(get("inferd_draft_kv_dropped_total", &[]), 2.0);
        assert_eq!(get("inferd_restore_kept_tokens_total", &[]), 4080.0);
        assert_eq!(get("inferd_session_spill_bytes", &[]), 1048576.0);
        assert_eq!(get("inferd_session_spill_read_tokens_total", &[]), 992.0);
        assert_eq!(get("inferd_restore_pages_rejected_total", &[]), 5.0);
        assert_eq!(get("inferd_restore_digest_mismatches_total", &[]), 1.0);
        assert_eq!(get("inferd_session_total", &[("outcome", "restored")]), 3.0);
        assert_eq!(get("inferd_session_restore_refused_total", &[]), 1.0);
        assert_eq!(get("inferd_session_spilled_total", &[]), 6.0);
        assert_eq!(get("inferd_session_journal_failures_total", &[]), 1.0);
        assert_eq!(get("inferd_replica_takeovers_total", &[]), 3.0);
        assert_eq!(get("inferd_replica_takeover_tokens_total", &[]), 2000.0);
        assert_eq!(get("inferd_replica_leases_lost_total", &[]), 1.0);
        assert_eq!(get("inferd_replica_handoffs_total", &[]), 4.0);
        assert_eq!(get("inferd_replica_store_failures_total", &[]), 2.0);
        assert_eq!(get("inferd_state_dir_writable", &[]), 0.0);
        assert_eq!(get("inferd_state_dir_write_failures_total", &[]), 4.0);
        assert_eq!(get("inferd_state_bytes", &[]), 8192.0);
        assert_eq!(
            get("inferd_state_refused_total", &[("reason", "budget")]),
            2.0
        );
        assert_eq!(
            get("inferd_state_refused_total", &[("reason", "free_space")]),
            3.0
        );
        assert_eq!(get("inferd_session_spilled", &[]), 2.0);
        assert_eq!(get("inferd_prefix_entries", &[]), 5.0);
        assert_eq!(get("inferd_prefix_cached_pages", &[]), 4.0);
        assert_eq!(get("inferd_kv_used_bytes", &[]), 4096.0);
        assert_eq!(get("inferd_session_total", &[("outcome", "failed")]), 1.0);
        assert_eq!(
            get(
                "inferd_cache_invariant_violations_total",
                &[("kind", "inv2")]
            ),
            1.0
        );
        assert_eq!(
            get("inferd_session_evicted_total", &[("reason", "close")]),
            1.0
        );
        assert_eq!(get("inferd_session_kv_live_bytes", &[]), 4096.0);
        assert_eq!(get("inferd_draft_kv_held_bytes", &[]), 1024.0);
        assert_eq!(get("inferd_draft_kv_pool_bytes", &[]), 8192.0);
        assert_eq!(get("inferd_generate_prefill_tokens_total", &[]), 123.0);
        let bucket = "inferd_generate_prefill_duration_seconds_bucket";
        assert_eq!(get(bucket, &[("le", "0.001")]), 0.0);
        assert_eq!(get(bucket, &[("le", "0.005")]), 3.0);
        assert_eq!(get(bucket, &[("le", "10")]), 3.0);
        assert_eq!(get(bucket, &[("le", "+Inf")]), 4.0);
        assert_eq!(
            get("inferd_generate_prefill_duration_seconds_count", &[]),
            4.0
        );
        assert_eq!(
            get("inferd_generate_prefill_duration_seconds_sum", &[]),
            12.5
        );
        assert_eq!(
            get("inferd_worker_decode_tokens_per_second", &[("worker", "0")]),
            12.5
        );
        assert_eq!(get("inferd_worker_queue_depth", &[("worker", "0")]), 5.0);
        assert_eq!(
            get("inferd_worker_generated_tokens_total", &[("worker", "1")]),
            10.0
        );
        assert_eq!(
            get(
                "inferd_grpc_requests_total",
                &[("method", "we\"ird\\name\nx"), ("code", "NOT_FOUND")]
            ),
            2.0
        );
        assert_eq!(get("inferd_health_serving", &[]), 1.0);
        assert_eq!(get("inferd_http_connections_open", &[]), 3.0);
        assert_eq!(get("inferd_http_connections_max", &[]), 512.0);
        assert_eq!(
            get(
                "inferd_http_connections_timed_out_total",
                &[("phase", "header")]
            ),
            2.0
        );
        assert_eq!(get("inferd_http_connection_limit_reached_total", &[]), 4.0);
        assert_eq!(
            get("inferd_accept_errors_total", &[("listener", "http")]),
            5.0
        );
        assert_eq!(
            get(
                "inferd_sampler_backend_info",
                &[("backend", "wgpu"), ("adapter", "llvmpipe (Vulkan Cpu)")]
            ),
            1.0
        );
        let shard = ("shard", "10.0.0.2:7000");
        assert_eq!(get("inferd_shard_up", &[shard]), 1.0);
        assert_eq!(
            get("inferd_shard_backend_info", &[shard, ("backend", "gpu")]),
            1.0
        );
        assert_eq!(
            get(
                "inferd_shard_failures_total",
                &[shard, ("kind", "checksum")]
            ),
            1.0
        );
        assert_eq!(get("inferd_shard_restarts_total", &[shard]), 1.0);
        assert_eq!(get("inferd_shard_session_rebuilds_total", &[]), 3.0);
        assert!(text.contains(r#"method="we\"ird\\name\nx""#), "{text}");
    }

    #[test]
    fn the_checker_rejects_what_the_format_forbids() {
        let ok = "# HELP inferd_x_total x\n# TYPE inferd_x_total counter\ninferd_x_total 1\n";
        assert!(parse(ok).is_ok());
        for bad in [
            "inferd_x 1\n",
            "# HELP inferd_x x\n# TYPE inferd_x counter\ninferd_x 1\n",
            "# HELP inferd_x_total x\n# TYPE inferd_x_total counter\ninferd_y_total 1\n",
            "# HELP inferd_x_total x\n# TYPE inferd_x_total counter\ninferd_x_total one\n",
            "# HELP inferd_x_total x\n# TYPE inferd_x_total counter\ninferd_x_total{a=\"\\q\"} 1\n",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    fn get(addr: SocketAddr, path: &str) -> (String, String) {
        let mut stream = TcpStream::connect(addr).expect("connects");
        write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").expect("sends");
        let mut reply = String::new();
        stream.read_to_string(&mut reply).expect("reads");
        let (head, body) = reply.split_once("\r\n\r\n").expect("a header block");
        (head.to_string(), body.to_string())
    }

    #[test]
    fn the_endpoint_serves_metrics_over_http_and_404_elsewhere() {
        let text = render(&stats(), &server());
        let expected = text.clone();
        let endpoint = MetricsEndpoint::bind("127.0.0.1:0", Arc::new(move || text.clone()), None)
            .expect("binds");
        assert_ne!(endpoint.addr().port(), 0);
        let (head, body) = get(endpoint.addr(), "/metrics");
        assert!(
            head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
            "{head}"
        );
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: text/plain; version=0.0.4"),
            "{head}"
        );
        assert_eq!(body, expected);
        let (head, _) = get(endpoint.addr(), "/");
        assert!(head.contains(" 404"), "{head}");
        let addr = endpoint.addr();
        drop(endpoint);
        // The drop joins the serving thread, which closes the listener.
        let closed = (0..200).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            TcpStream::connect(addr).is_err()
        });
        assert!(closed, "still listening 2 s after drop");
    }

    #[test]
    fn a_taken_address_is_an_io_error() {
        let first =
            MetricsEndpoint::bind("127.0.0.1:0", Arc::new(String::new), None).expect("binds");
        let taken = first.addr().to_string();
        let err = MetricsEndpoint::bind(&taken, Arc::new(String::new), None).err();
        assert!(err.is_some_and(|e| e.to_string().contains(&taken)));
    }
}
