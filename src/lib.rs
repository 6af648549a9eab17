//! inferd: a session-bound LLM inference runtime.
//!
//! The crate is split into rooms with one job each (see `docs/ARCHITECTURE.md`):
//!
//! - [`engine`]: model + threads + KV pool + sampler, serving append-only sessions.
//! - [`gguf`]: a bounds-checked, zero-copy reader for GGUF model files.
//! - [`quant`]: tensor block formats and their dot-product kernels (scalar
//!   reference plus SIMD paths chosen at run time).
//! - [`kv`]: the paged KV cache: an mmap-backed slab pool of fixed-size pages
//!   handed out by a lock-free allocator.
//! - [`model`]: the llama-family forward pass over a mapped GGUF.
//! - [`sampler`]: turning logits into a token id: the CPU reference and the
//!   WGSL sampler through wgpu.
//! - [`tokenizer`]: text <-> token ids from the vocabulary stored in the GGUF.
//! - [`threads`]: the fork-join compute pool the forward pass runs on.
//! - [`stop`]: why a generation ended, for the engine and the runtime.
//! - [`speculate`]: prompt lookup: tokens the history proposes for a
//!   decode that verifies several at once.
//! - [`durable`]: session journals in a state directory, so sessions
//!   outlive the process.
//! - [`replica`]: session histories in PostgreSQL for replicas behind a
//!   proxy: leases with fencing epochs, take-over by another replica.
//! - [`runtime`]: the server core: sessions sharded over pinned workers with
//!   continuous batching and the session contract, free of any transport.
//! - [`proto`]: the gRPC wire types generated from `protos/` (client API,
//!   health, shard protocol).
//! - [`server`]: the gRPC front end (grpcio): RuntimeService, health, auth, TLS.
//! - [`metrics`]: Prometheus text rendering of the runtime counters, served over HTTP.
//! - [`cluster`]: the shard protocol: frame checks, `inferd shard`, the
//!   coordinator's link to a shard, and `inferd relay`.
//! - [`sync`]: the one loom switch: atomics, `Arc`, waker and channel that
//!   shared code imports (loom's under `--cfg loom`).
//! - [`listen`]: the socket address a bound listen string names.
//! - [`limits`]: what keeps the listeners alive under pressure: accept
//!   back-off, rate-limited log lines, the file-descriptor budget.
//! - [`gpu`]: the model on a GPU through wgpu: the adapter, weights in
//!   their GGUF block formats on the device, and the WGSL kernels.
//! - [`chat_template`]: a conversation -> prompt text through the model's own
//!   Jinja chat template, rendered as transformers renders it.
//! - [`tools`]: tool calls: the functions a chat offers, their place in the
//!   prompt, the constraint on a call, and the reply read back into calls.
//! - [`cli`]: the command-line front end (`inferd generate`, `chat`,
//!   `bench`, `serve`, `session`, `shard`, `relay`, `tokenize`).

pub mod base;
#[cfg(not(loom))]
pub mod chat_template;
#[cfg(not(loom))]
pub mod cli;
#[cfg(not(loom))]
pub mod cluster;
pub mod constraint;
#[cfg(not(loom))]
pub mod durable;
pub mod engine;
pub mod gguf;
#[cfg(not(loom))]
pub mod gpu;
pub mod kv;
#[cfg(not(loom))]
pub mod limits;
pub mod listen;
#[cfg(not(loom))]
pub mod metrics;
pub mod model;
#[cfg(not(loom))]
pub mod proto;
pub mod quant;
#[cfg(not(loom))]
pub mod replica;
pub mod runtime;
pub mod sampler;
#[cfg(not(loom))]
pub mod server;
pub mod speculate;
pub mod stop;
pub mod sync;
pub mod threads;
pub mod tokenizer;
#[cfg(not(loom))]
pub mod tools;
