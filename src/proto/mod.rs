//! The gRPC wire types: Rust code generated at build time (by `build.rs`)
//! from the schemas under `protos/`.
//!
//! - [`kakeya_v1`]: the client API, `kakeya.v1.RuntimeService`
//!   (`protos/kakeya/v1/runtime.proto`): messages in `kakeya_v1::runtime`,
//!   the grpcio client, service trait and method descriptors in
//!   `kakeya_v1::runtime_grpc`.
//! - [`grpc_health_v1`]: the standard health service, `grpc.health.v1.Health`
//!   (`protos/grpc/health/v1/health.proto`), laid out the same way.
//! - [`inferd_shard_v1`]: the shard protocol between a coordinator and the
//!   shards that each run a layer range, `inferd.shard.v1.ShardRuntime`
//!   (`protos/inferd/shard/v1/shard_runtime.proto`), laid out the same way.
//! - [`inferd_session_v1`]: inferd's extensions to the client API on the
//!   same server, `inferd.session.v1.SessionService`
//!   (`protos/inferd/session/v1/session_service.proto`): ForkSession.
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

/// `inferd.shard.v1`: the versioned shard protocol (CONTRACT §4).
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
pub mod inferd_shard_v1 {
    include!(concat!(env!("OUT_DIR"), "/inferd_shard_v1.rs"));
}

/// `inferd.session.v1`: calls on kakeya.v1 sessions beyond the published
/// schema (CONTRACT §2.11).
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
pub mod inferd_session_v1 {
    include!(concat!(env!("OUT_DIR"), "/inferd_session_v1.rs"));
}

#[cfg(test)]
mod tests {
    use super::grpc_health_v1::health::{HealthCheckResponse, HealthCheckResponse_ServingStatus};
    use super::kakeya_v1::runtime::{GenerateDone, GenerateDone_StopReason, GenerateResponse};
    use protobuf::Message;

    #[test]
    fn enum_defaults_are_the_zero_values_of_the_schema() {
        assert_eq!(
            GenerateDone::new().get_stop_reason(),
            GenerateDone_StopReason::STOP_REASON_UNSPECIFIED
        );
        assert_eq!(
            HealthCheckResponse::new().get_status(),
            HealthCheckResponse_ServingStatus::UNKNOWN
        );
    }

    #[test]
    fn an_empty_generate_response_has_no_payload_and_encodes_to_nothing() {
        let response = GenerateResponse::new();
        assert!(response.payload.is_none());
        assert_eq!(response.write_to_bytes().map(|b| b.len()).ok(), Some(0));
    }
}
