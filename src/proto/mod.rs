//! The gRPC wire types: Rust code generated at build time (by `build.rs`)
//! from the schemas under `protos/`.
//!
//! - [`kakeya_v1`]: the client API, `kakeya.v1.RuntimeService`
//!   (`protos/kakeya/v1/runtime.proto`): messages in `kakeya_v1::runtime`,
//!   the grpcio client, service trait and method descriptors in
//!   `kakeya_v1::runtime_grpc`.
//! - [`grpc_health_v1`]: the standard health service, `grpc.health.v1.Health`
//!   (`protos/grpc/health/v1/health.proto`), laid out the same way.
//!
//! Messages are rust-protobuf 2 types (`protobuf::Message`); proto3
//! `optional` fields have `has_*`/`clear_*` accessors and are sent whenever
//! they are set, zero included.

/// `kakeya.v1`: the runtime protocol clients speak.
#[allow(
    clippy::all,
    clippy::pedantic,
    renamed_and_removed_lints,
    unknown_lints,
    missing_docs,
    unused_qualifications,
    unused_parens,
    mismatched_lifetime_syntaxes,
    deprecated
)]
pub mod kakeya_v1 {
    include!(concat!(env!("OUT_DIR"), "/kakeya_v1.rs"));
}

/// `grpc.health.v1`: the standard gRPC health checking protocol.
#[allow(
    clippy::all,
    clippy::pedantic,
    renamed_and_removed_lints,
    unknown_lints,
    missing_docs,
    unused_qualifications,
    unused_parens,
    mismatched_lifetime_syntaxes,
    deprecated
)]
pub mod grpc_health_v1 {
    include!(concat!(env!("OUT_DIR"), "/grpc_health_v1.rs"));
}
