//! Proves the generated gRPC code is what `protos/` says and what CONTRACT §2
//! fixes: the field names, numbers and kinds of the base `kakeya.v1`
//! messages, the five methods and their streaming kinds, the `inferd.session.v1`
//! extension service (CONTRACT §2.11), and golden
//! serialized bytes per message type (committed under
//! `tests/vectors/proto/`), which must also decode back to equal messages.
//!
//! Regenerate the golden bytes after an intended schema change with
//! `INFERD_REGEN=1 cargo test --test proto_schema`; the run then rewrites the
//! vectors instead of comparing them.

#![cfg(not(loom))]

use std::path::PathBuf;

use grpcio::MethodType;
use inferd::proto::grpc_health_v1::{health, health_grpc};
use inferd::proto::inferd_session_v1::{session_service, session_service_grpc};
use inferd::proto::kakeya_v1::{runtime, runtime_grpc};
use protobuf::descriptor::{
    DescriptorProto, FieldDescriptorProto, FieldDescriptorProto_Label, FieldDescriptorProto_Type,
    FileDescriptorProto,
};
use protobuf::Message;
use runtime::GenerateDone_StopReason as StopReason;

// ---------------------------------------------------------------- descriptors

/// The base fields of CONTRACT §2, one line per field, as `describe_fields`
/// renders them. Every field numbered below 16 must be listed here, exactly.
const CONTRACT_BASE_FIELDS: &[&str] = &[
    "CreateSessionRequest.client_label = 1: string",
    "CreateSessionRequest.eos_token_ids = 2: repeated uint32",
    "CreateSessionResponse.session_id = 1: string",
    "AppendTokensRequest.session_id = 1: string",
    "AppendTokensRequest.token_ids = 2: repeated uint32",
    "AppendTokensResponse.history_length = 1: uint64",
    "CloseSessionRequest.session_id = 1: string",
    "CloseSessionResponse.final_history_length = 1: uint64",
    "GenerateRequest.session_id = 1: string",
    "GenerateRequest.max_tokens = 2: uint32",
    "GenerateRequest.seed = 3: optional uint64",
    "GenerateRequest.temperature = 4: optional float",
    "GenerateRequest.top_p = 5: optional float",
    "GenerateRequest.top_k = 6: optional uint32",
    "GenerateResponse.token_id = 1: oneof payload uint32",
    "GenerateResponse.done = 2: oneof payload .kakeya.v1.GenerateDone",
    "GenerateResponse.truncated = 3: oneof payload .kakeya.v1.HistoryTruncated",
    "GenerateDone.stop_reason = 1: .kakeya.v1.GenerateDone.StopReason",
    "GenerateDone.generated_token_count = 2: uint32",
    "GenerateDone.prefill_duration_seconds = 3: double",
    "GenerateDone.total_duration_seconds = 4: double",
    "HistoryTruncated.dropped_token_count = 1: uint64",
    "GetSessionInfoRequest.session_id = 1: string",
    "GetSessionInfoResponse.history_length = 1: uint64",
    "GetSessionInfoResponse.kv_live_bytes = 2: uint64",
    "GetSessionInfoResponse.cache_invariant_inv1_violations = 3: uint64",
    "GetSessionInfoResponse.cache_invariant_inv2_violations = 4: uint64",
    "GetSessionInfoResponse.idle_seconds = 5: double",
];

/// The extensions this project adds; numbered 16 and up, never below.
const EXTENSION_FIELDS: &[&str] = &[
    "CreateSessionResponse.vocab_size = 16: uint32",
    "AppendTokensResponse.dropped_token_count = 16: uint64",
    "CreateSessionResponse.context_length = 17: uint64",
    "CreateSessionResponse.worker = 18: uint32",
    "GenerateRequest.min_p = 16: optional float",
    "GenerateRequest.repetition_penalty = 17: optional float",
    "GenerateRequest.presence_penalty = 18: optional float",
    "GenerateRequest.frequency_penalty = 19: optional float",
    "GenerateRequest.penalty_last_n = 20: optional uint32",
    "GenerateRequest.logit_bias = 21: repeated .kakeya.v1.LogitBias",
    "GenerateRequest.stop_sequences = 22: repeated .kakeya.v1.StopSequence",
    "GenerateRequest.top_logprobs = 23: optional uint32",
    "GenerateRequest.constraint = 24: .kakeya.v1.OutputConstraint",
    "GenerateRequest.speculate = 25: optional bool",
    "GenerateResponse.logprobs = 16: oneof payload .kakeya.v1.TokenLogprobs",
    "GenerateDone.seed_used = 16: uint64",
    "GenerateDone.history_length = 17: uint64",
    "GenerateDone.prefill_token_count = 18: uint64",
    "GenerateDone.stop_sequence_index = 19: optional uint32",
    "GenerateDone.speculation_proposed_token_count = 20: uint64",
    "GenerateDone.speculation_accepted_token_count = 21: uint64",
    "GetSessionInfoResponse.kv_pages_held = 16: uint64",
    "GetSessionInfoResponse.kv_page_bytes = 17: uint64",
    "GetSessionInfoResponse.client_label = 18: string",
    "GetSessionInfoResponse.eos_token_ids = 19: repeated uint32",
    "GetSessionInfoResponse.worker = 20: uint32",
    "GetSessionInfoResponse.truncated_token_count = 21: uint64",
    "GetSessionInfoResponse.logits_digest = 22: fixed64",
    "GetSessionInfoResponse.busy = 23: bool",
    "GetSessionInfoResponse.durable = 24: bool",
    "GetSessionInfoResponse.backend = 25: string",
    "GetSessionInfoResponse.speculation_proposed_token_count = 26: uint64",
    "GetSessionInfoResponse.speculation_accepted_token_count = 27: uint64",
];

/// Messages this project adds (any field numbers).
const NEW_MESSAGE_FIELDS: &[&str] = &[
    "LogitBias.token_id = 1: uint32",
    "LogitBias.bias = 2: float",
    "StopSequence.token_ids = 1: repeated uint32",
    "TokenLogprob.token_id = 1: uint32",
    "TokenLogprob.logprob = 2: float",
    "TokenLogprobs.chosen = 1: .kakeya.v1.TokenLogprob",
    "TokenLogprobs.top = 2: repeated .kakeya.v1.TokenLogprob",
    "OutputConstraint.json_schema = 1: oneof kind string",
    "OutputConstraint.json_object = 2: oneof kind bool",
    "OutputConstraint.regex = 3: oneof kind string",
    "OutputConstraint.lark_grammar = 4: oneof kind string",
    "OutputConstraint.gbnf_grammar = 5: oneof kind string",
];

fn scalar_name(kind: FieldDescriptorProto_Type) -> &'static str {
    use FieldDescriptorProto_Type::*;
    match kind {
        TYPE_DOUBLE => "double",
        TYPE_FLOAT => "float",
        TYPE_INT64 => "int64",
        TYPE_UINT64 => "uint64",
        TYPE_INT32 => "int32",
        TYPE_FIXED64 => "fixed64",
        TYPE_FIXED32 => "fixed32",
        TYPE_BOOL => "bool",
        TYPE_STRING => "string",
        TYPE_BYTES => "bytes",
        TYPE_UINT32 => "uint32",
        TYPE_SFIXED32 => "sfixed32",
        TYPE_SFIXED64 => "sfixed64",
        TYPE_SINT32 => "sint32",
        TYPE_SINT64 => "sint64",
        TYPE_GROUP => "group",
        TYPE_MESSAGE | TYPE_ENUM => "named",
    }
}

/// Renders one field as `Message.field = N: [repeated|optional|oneof X] type`.
fn describe_field(message: &DescriptorProto, field: &FieldDescriptorProto) -> String {
    let mut kind = String::new();
    if field.get_label() == FieldDescriptorProto_Label::LABEL_REPEATED {
        kind.push_str("repeated ");
    } else if field.get_proto3_optional() {
        kind.push_str("optional ");
    } else if field.has_oneof_index() {
        let oneof = &message.get_oneof_decl()[field.get_oneof_index() as usize];
        kind.push_str(&format!("oneof {} ", oneof.get_name()));
    }
    match field.get_field_type() {
        FieldDescriptorProto_Type::TYPE_MESSAGE | FieldDescriptorProto_Type::TYPE_ENUM => {
            kind.push_str(field.get_type_name())
        }
        scalar => kind.push_str(scalar_name(scalar)),
    }
    format!(
        "{}.{} = {}: {}",
        message.get_name(),
        field.get_name(),
        field.get_number(),
        kind
    )
}

fn describe_fields(file: &FileDescriptorProto) -> Vec<String> {
    file.get_message_type()
        .iter()
        .flat_map(|message| {
            message
                .get_field()
                .iter()
                .map(move |field| describe_field(message, field))
        })
        .collect()
}

fn sorted(lines: impl IntoIterator<Item = impl ToString>) -> Vec<String> {
    let mut lines: Vec<String> = lines.into_iter().map(|l| l.to_string()).collect();
    lines.sort();
    lines
}

#[test]
fn runtime_schema_has_exactly_the_contract_fields_plus_numbered_extensions() {
    let file = runtime::file_descriptor_proto();
    assert_eq!(file.get_package(), "kakeya.v1");
    assert_eq!(file.get_syntax(), "proto3");
    let expected = sorted(
        CONTRACT_BASE_FIELDS
            .iter()
            .chain(EXTENSION_FIELDS)
            .chain(NEW_MESSAGE_FIELDS),
    );
    assert_eq!(sorted(describe_fields(file)), expected);
}

#[test]
fn base_messages_use_numbers_below_16_only_for_contract_fields() {
    let base_messages: Vec<&str> = CONTRACT_BASE_FIELDS
        .iter()
        .filter_map(|line| line.split('.').next())
        .collect();
    let file = runtime::file_descriptor_proto();
    let below_16: Vec<String> = file
        .get_message_type()
        .iter()
        .filter(|message| base_messages.contains(&message.get_name()))
        .flat_map(|message| {
            message
                .get_field()
                .iter()
                .filter(|field| field.get_number() < 16)
                .map(move |field| describe_field(message, field))
        })
        .collect();
    assert_eq!(sorted(below_16), sorted(CONTRACT_BASE_FIELDS));
    for line in EXTENSION_FIELDS {
        let number: u32 = line
            .split(" = ")
            .nth(1)
            .and_then(|rest| rest.split(':').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(number >= 16, "extension {line} is numbered below 16");
    }
}

#[test]
fn stop_reason_is_nested_in_generate_done_with_contract_values() {
    let file = runtime::file_descriptor_proto();
    let done = file
        .get_message_type()
        .iter()
        .find(|m| m.get_name() == "GenerateDone")
        .expect("GenerateDone is in the schema");
    assert_eq!(done.get_enum_type().len(), 1);
    let stop_reason = &done.get_enum_type()[0];
    assert_eq!(stop_reason.get_name(), "StopReason");
    let values: Vec<(&str, i32)> = stop_reason
        .get_value()
        .iter()
        .map(|v| (v.get_name(), v.get_number()))
        .collect();
    assert_eq!(
        values,
        [
            ("STOP_REASON_UNSPECIFIED", 0),
            ("STOP_REASON_MAX_TOKENS", 1),
            ("STOP_REASON_EOS", 2),
            ("STOP_REASON_CANCELLED", 3),
            ("STOP_REASON_TRUNCATED", 4),
            // inferd's extensions, numbered from 16 as the fields are; only
            // a call that sets GenerateRequest.constraint can see them.
            ("STOP_REASON_CONSTRAINT_DONE", 16),
            ("STOP_REASON_CONSTRAINT_UNFINISHED", 17),
        ]
    );
    assert!(file.get_enum_type().is_empty(), "no top-level enums");
}

/// `(name, input, output, client_streaming, server_streaming)` of each method.
fn methods(file: &FileDescriptorProto, service: &str) -> Vec<(String, String, String, bool, bool)> {
    let service = file
        .get_service()
        .iter()
        .find(|s| s.get_name() == service)
        .expect("service is in the schema");
    service
        .get_method()
        .iter()
        .map(|m| {
            (
                m.get_name().to_string(),
                m.get_input_type().to_string(),
                m.get_output_type().to_string(),
                m.get_client_streaming(),
                m.get_server_streaming(),
            )
        })
        .collect()
}

fn method(
    name: &str,
    input: &str,
    output: &str,
    server_streaming: bool,
) -> (String, String, String, bool, bool) {
    (
        name.to_string(),
        input.to_string(),
        output.to_string(),
        false,
        server_streaming,
    )
}

#[test]
fn runtime_service_descriptor_has_the_five_contract_methods() {
    let file = runtime::file_descriptor_proto();
    assert_eq!(file.get_service().len(), 1);
    let p = ".kakeya.v1.";
    let m = |name: &str, streaming: bool| {
        let (input, output) = if name == "Generate" {
            (
                format!("{p}GenerateRequest"),
                format!("{p}GenerateResponse"),
            )
        } else {
            (format!("{p}{name}Request"), format!("{p}{name}Response"))
        };
        method(name, &input, &output, streaming)
    };
    assert_eq!(
        methods(file, "RuntimeService"),
        [
            m("CreateSession", false),
            m("AppendTokens", false),
            m("Generate", true),
            m("CloseSession", false),
            m("GetSessionInfo", false),
        ]
    );
}

#[test]
fn session_extension_schema_has_exactly_its_fields_and_one_unary_method() {
    let file = session_service::file_descriptor_proto();
    assert_eq!(file.get_package(), "inferd.session.v1");
    assert_eq!(file.get_syntax(), "proto3");
    assert_eq!(
        sorted(describe_fields(file)),
        sorted([
            "ForkSessionRequest.session_id = 1: string",
            "ForkSessionRequest.at_length = 2: optional uint64",
            "ForkSessionRequest.client_label = 3: string",
            "ForkSessionResponse.session_id = 1: string",
            "ForkSessionResponse.history_length = 2: uint64",
            "ForkSessionResponse.worker = 3: uint32",
        ])
    );
    let p = ".inferd.session.v1.";
    assert_eq!(
        methods(file, "SessionService"),
        [method(
            "ForkSession",
            &format!("{p}ForkSessionRequest"),
            &format!("{p}ForkSessionResponse"),
            false
        )]
    );
    let fork = &session_service_grpc::METHOD_SESSION_SERVICE_FORK_SESSION;
    assert_eq!(fork.name, "/inferd.session.v1.SessionService/ForkSession");
    assert!(matches!(fork.ty, MethodType::Unary));
}

/// grpcio's `MethodType` has neither `PartialEq` nor `Debug`.
fn kind_name(kind: MethodType) -> &'static str {
    match kind {
        MethodType::Unary => "unary",
        MethodType::ClientStreaming => "client streaming",
        MethodType::ServerStreaming => "server streaming",
        MethodType::Duplex => "duplex",
    }
}

#[test]
fn grpcio_method_definitions_have_full_names_and_streaming_kinds() {
    let kinds = [
        (
            runtime_grpc::METHOD_RUNTIME_SERVICE_CREATE_SESSION.name,
            runtime_grpc::METHOD_RUNTIME_SERVICE_CREATE_SESSION.ty,
        ),
        (
            runtime_grpc::METHOD_RUNTIME_SERVICE_APPEND_TOKENS.name,
            runtime_grpc::METHOD_RUNTIME_SERVICE_APPEND_TOKENS.ty,
        ),
        (
            runtime_grpc::METHOD_RUNTIME_SERVICE_GENERATE.name,
            runtime_grpc::METHOD_RUNTIME_SERVICE_GENERATE.ty,
        ),
        (
            runtime_grpc::METHOD_RUNTIME_SERVICE_CLOSE_SESSION.name,
            runtime_grpc::METHOD_RUNTIME_SERVICE_CLOSE_SESSION.ty,
        ),
        (
            runtime_grpc::METHOD_RUNTIME_SERVICE_GET_SESSION_INFO.name,
            runtime_grpc::METHOD_RUNTIME_SERVICE_GET_SESSION_INFO.ty,
        ),
        (
            health_grpc::METHOD_HEALTH_CHECK.name,
            health_grpc::METHOD_HEALTH_CHECK.ty,
        ),
        (
            health_grpc::METHOD_HEALTH_WATCH.name,
            health_grpc::METHOD_HEALTH_WATCH.ty,
        ),
    ];
    let kinds: Vec<(&str, &str)> = kinds
        .iter()
        .map(|(name, ty)| (*name, kind_name(*ty)))
        .collect();
    let (unary, server_streaming) = ("unary", "server streaming");
    assert_eq!(
        kinds,
        [
            ("/kakeya.v1.RuntimeService/CreateSession", unary),
            ("/kakeya.v1.RuntimeService/AppendTokens", unary),
            ("/kakeya.v1.RuntimeService/Generate", server_streaming),
            ("/kakeya.v1.RuntimeService/CloseSession", unary),
            ("/kakeya.v1.RuntimeService/GetSessionInfo", unary),
            ("/grpc.health.v1.Health/Check", unary),
            ("/grpc.health.v1.Health/Watch", server_streaming),
        ]
    );
}

#[test]
fn health_schema_matches_the_grpc_health_v1_spec() {
    let file = health::file_descriptor_proto();
    assert_eq!(file.get_package(), "grpc.health.v1");
    assert_eq!(
        sorted(describe_fields(file)),
        sorted([
            "HealthCheckRequest.service = 1: string",
            "HealthCheckResponse.status = 1: .grpc.health.v1.HealthCheckResponse.ServingStatus",
        ])
    );
    let response = &file.get_message_type()[1];
    let values: Vec<(&str, i32)> = response.get_enum_type()[0]
        .get_value()
        .iter()
        .map(|v| (v.get_name(), v.get_number()))
        .collect();
    assert_eq!(
        values,
        [
            ("UNKNOWN", 0),
            ("SERVING", 1),
            ("NOT_SERVING", 2),
            ("SERVICE_UNKNOWN", 3)
        ]
    );
    let p = ".grpc.health.v1.";
    let (input, output) = (
        format!("{p}HealthCheckRequest"),
        format!("{p}HealthCheckResponse"),
    );
    assert_eq!(
        methods(file, "Health"),
        [
            method("Check", &input, &output, false),
            method("Watch", &input, &output, true),
        ]
    );
}

// ------------------------------------------------------------- wire encoding

/// The key bytes (varint of `number << 3 | wire_type`) that start a field.
fn key(number: u32, wire_type: u32) -> Vec<u8> {
    let mut value = (number << 3) | wire_type;
    let mut bytes = Vec::new();
    loop {
        let low = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            bytes.push(low);
            return bytes;
        }
        bytes.push(low | 0x80);
    }
}

const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

fn bytes_of(message: &impl Message) -> Vec<u8> {
    message
        .write_to_bytes()
        .expect("a fully initialised proto3 message serializes")
}

/// One message with a single field set, and the key it must start with.
fn single_field_encodings() -> Vec<(&'static str, Vec<u8>, Vec<u8>)> {
    let mut cases: Vec<(&'static str, Vec<u8>, Vec<u8>)> = Vec::new();
    let mut push = |label: &'static str, message: Vec<u8>, number: u32, wire_type: u32| {
        cases.push((label, message, key(number, wire_type)));
    };

    let mut m = runtime::CreateSessionRequest::new();
    m.set_client_label("x".into());
    push("CreateSessionRequest.client_label", bytes_of(&m), 1, LEN);
    let mut m = runtime::CreateSessionRequest::new();
    m.set_eos_token_ids(vec![2]);
    push("CreateSessionRequest.eos_token_ids", bytes_of(&m), 2, LEN);

    let mut m = runtime::CreateSessionResponse::new();
    m.set_session_id("x".into());
    push("CreateSessionResponse.session_id", bytes_of(&m), 1, LEN);

    let mut m = runtime::AppendTokensRequest::new();
    m.set_session_id("x".into());
    push("AppendTokensRequest.session_id", bytes_of(&m), 1, LEN);
    let mut m = runtime::AppendTokensRequest::new();
    m.set_token_ids(vec![7]);
    push("AppendTokensRequest.token_ids", bytes_of(&m), 2, LEN);

    let mut m = runtime::AppendTokensResponse::new();
    m.set_history_length(9);
    push(
        "AppendTokensResponse.history_length",
        bytes_of(&m),
        1,
        VARINT,
    );

    let mut m = runtime::CloseSessionRequest::new();
    m.set_session_id("x".into());
    push("CloseSessionRequest.session_id", bytes_of(&m), 1, LEN);

    let mut m = runtime::CloseSessionResponse::new();
    m.set_final_history_length(9);
    push(
        "CloseSessionResponse.final_history_length",
        bytes_of(&m),
        1,
        VARINT,
    );

    let mut m = runtime::GenerateRequest::new();
    m.set_session_id("x".into());
    push("GenerateRequest.session_id", bytes_of(&m), 1, LEN);
    let mut m = runtime::GenerateRequest::new();
    m.set_max_tokens(4);
    push("GenerateRequest.max_tokens", bytes_of(&m), 2, VARINT);
    // Optional fields are sent when set, even to zero: that is their point.
    let mut m = runtime::GenerateRequest::new();
    m.set_seed(0);
    push("GenerateRequest.seed", bytes_of(&m), 3, VARINT);
    let mut m = runtime::GenerateRequest::new();
    m.set_temperature(0.0);
    push("GenerateRequest.temperature", bytes_of(&m), 4, FIXED32);
    let mut m = runtime::GenerateRequest::new();
    m.set_top_p(0.0);
    push("GenerateRequest.top_p", bytes_of(&m), 5, FIXED32);
    let mut m = runtime::GenerateRequest::new();
    m.set_top_k(0);
    push("GenerateRequest.top_k", bytes_of(&m), 6, VARINT);

    let mut m = runtime::GenerateResponse::new();
    m.set_token_id(0);
    push("GenerateResponse.token_id", bytes_of(&m), 1, VARINT);
    let mut m = runtime::GenerateResponse::new();
    m.set_done(runtime::GenerateDone::new());
    push("GenerateResponse.done", bytes_of(&m), 2, LEN);
    let mut m = runtime::GenerateResponse::new();
    m.set_truncated(runtime::HistoryTruncated::new());
    push("GenerateResponse.truncated", bytes_of(&m), 3, LEN);

    let mut m = runtime::GenerateDone::new();
    m.set_stop_reason(StopReason::STOP_REASON_EOS);
    push("GenerateDone.stop_reason", bytes_of(&m), 1, VARINT);
    let mut m = runtime::GenerateDone::new();
    m.set_generated_token_count(3);
    push(
        "GenerateDone.generated_token_count",
        bytes_of(&m),
        2,
        VARINT,
    );
    let mut m = runtime::GenerateDone::new();
    m.set_prefill_duration_seconds(0.5);
    push(
        "GenerateDone.prefill_duration_seconds",
        bytes_of(&m),
        3,
        FIXED64,
    );
    let mut m = runtime::GenerateDone::new();
    m.set_total_duration_seconds(0.5);
    push(
        "GenerateDone.total_duration_seconds",
        bytes_of(&m),
        4,
        FIXED64,
    );

    let mut m = runtime::HistoryTruncated::new();
    m.set_dropped_token_count(5);
    push(
        "HistoryTruncated.dropped_token_count",
        bytes_of(&m),
        1,
        VARINT,
    );

    let mut m = runtime::GetSessionInfoRequest::new();
    m.set_session_id("x".into());
    push("GetSessionInfoRequest.session_id", bytes_of(&m), 1, LEN);

    let mut m = runtime::GetSessionInfoResponse::new();
    m.set_history_length(1);
    push(
        "GetSessionInfoResponse.history_length",
        bytes_of(&m),
        1,
        VARINT,
    );
    let mut m = runtime::GetSessionInfoResponse::new();
    m.set_kv_live_bytes(1);
    push(
        "GetSessionInfoResponse.kv_live_bytes",
        bytes_of(&m),
        2,
        VARINT,
    );
    let mut m = runtime::GetSessionInfoResponse::new();
    m.set_cache_invariant_inv1_violations(1);
    push(
        "GetSessionInfoResponse.cache_invariant_inv1_violations",
        bytes_of(&m),
        3,
        VARINT,
    );
    let mut m = runtime::GetSessionInfoResponse::new();
    m.set_cache_invariant_inv2_violations(1);
    push(
        "GetSessionInfoResponse.cache_invariant_inv2_violations",
        bytes_of(&m),
        4,
        VARINT,
    );
    let mut m = runtime::GetSessionInfoResponse::new();
    m.set_idle_seconds(1.0);
    push(
        "GetSessionInfoResponse.idle_seconds",
        bytes_of(&m),
        5,
        FIXED64,
    );
    cases
}

#[test]
fn each_contract_field_is_encoded_under_its_contract_number() {
    let cases = single_field_encodings();
    assert_eq!(cases.len(), CONTRACT_BASE_FIELDS.len());
    for (label, bytes, key) in cases {
        assert!(
            bytes.starts_with(&key),
            "{label}: encoded as {}, expected to start with key {}",
            hex(&bytes),
            hex(&key)
        );
    }
}

#[test]
fn repeated_token_ids_are_packed_as_proto3_requires() {
    let mut m = runtime::AppendTokensRequest::new();
    m.set_token_ids(vec![1, 300]);
    // Field 2, length-delimited, 3 bytes: varint 1, varint 300 (ac 02).
    assert_eq!(hex(&bytes_of(&m)), "120301ac02");
    let decoded = runtime::AppendTokensRequest::parse_from_bytes(&[0x10, 0x01, 0x10, 0xac, 0x02])
        .expect("unpacked encoding is accepted too");
    assert_eq!(decoded.get_token_ids(), [1, 300]);
}

#[test]
fn unset_proto3_optional_is_absent_and_set_zero_is_sent() {
    let mut request = runtime::GenerateRequest::new();
    assert!(!request.has_seed() && !request.has_temperature());
    assert!(bytes_of(&request).is_empty());
    request.set_temperature(0.0);
    assert!(request.has_temperature());
    assert_eq!(bytes_of(&request), [0x25, 0, 0, 0, 0]);
    let decoded = runtime::GenerateRequest::parse_from_bytes(&[0x25, 0, 0, 0, 0])
        .expect("a valid encoding decodes");
    assert!(decoded.has_temperature() && !decoded.has_top_p());
    request.clear_temperature();
    assert!(!request.has_temperature());
}

// ------------------------------------------------------------- golden vectors

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    let text = text.trim();
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

fn vector_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/vectors/proto")
        .join(format!("{name}.hex"))
}

/// Compares `message`'s encoding with the committed vector `name` (or
/// rewrites it under `INFERD_REGEN=1`) and checks the vector decodes back to
/// an equal message.
fn check_golden<M: Message + PartialEq>(name: &str, message: &M) {
    let bytes = bytes_of(message);
    let path = vector_path(name);
    if std::env::var_os("INFERD_REGEN").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("vector path has a parent"))
            .expect("vector directory is writable");
        std::fs::write(&path, hex(&bytes) + "\n").expect("vector file is writable");
    }
    let committed = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (regenerate with INFERD_REGEN=1)", path.display()));
    let golden = unhex(&committed).unwrap_or_else(|| panic!("{}: not hex", path.display()));
    assert_eq!(hex(&bytes), hex(&golden), "{name}: encoding changed");
    let decoded = M::parse_from_bytes(&golden)
        .unwrap_or_else(|e| panic!("{name}: golden bytes do not decode: {e}"));
    assert!(decoded == *message, "{name}: decoded message differs");
    assert!(
        decoded.get_unknown_fields().iter().next().is_none(),
        "{name}: decoding left unknown fields"
    );
}

fn logprob(token_id: u32, logprob: f32) -> runtime::TokenLogprob {
    let mut m = runtime::TokenLogprob::new();
    m.set_token_id(token_id);
    m.set_logprob(logprob);
    m
}

fn token_logprobs() -> runtime::TokenLogprobs {
    let mut m = runtime::TokenLogprobs::new();
    m.set_chosen(logprob(1771, -0.25));
    m.set_top(vec![logprob(1771, -0.25), logprob(28, -1.5)].into());
    m
}

fn generate_done() -> runtime::GenerateDone {
    let mut m = runtime::GenerateDone::new();
    m.set_stop_reason(StopReason::STOP_REASON_TRUNCATED);
    m.set_generated_token_count(77);
    m.set_prefill_duration_seconds(0.125);
    m.set_total_duration_seconds(2.5);
    m.set_seed_used(0x0123_4567_89ab_cdef);
    m.set_history_length(4242);
    m.set_prefill_token_count(300);
    m.set_stop_sequence_index(1);
    m.set_speculation_proposed_token_count(40);
    m.set_speculation_accepted_token_count(31);
    m
}

#[test]
fn every_runtime_message_matches_its_golden_bytes_and_decodes_back() {
    let mut m = runtime::CreateSessionRequest::new();
    m.set_client_label("golden-client/1.0 ünï".into());
    m.set_eos_token_ids(vec![2, 49152, 0xffff_ffff]);
    check_golden("create_session_request", &m);

    let mut m = runtime::CreateSessionResponse::new();
    m.set_session_id("3f2a9c1e-7b44-4d0e-9a61-0c5be2d8f417".into());
    m.set_vocab_size(49152);
    m.set_context_length(8192);
    m.set_worker(3);
    check_golden("create_session_response", &m);

    let mut m = runtime::AppendTokensRequest::new();
    m.set_session_id("session-append".into());
    m.set_token_ids(vec![1, 127, 128, 16383, 16384, 49151]);
    check_golden("append_tokens_request", &m);

    let mut m = runtime::AppendTokensResponse::new();
    m.set_history_length(1 << 40);
    m.set_dropped_token_count(300);
    check_golden("append_tokens_response", &m);

    let mut m = runtime::CloseSessionRequest::new();
    m.set_session_id("session-close".into());
    check_golden("close_session_request", &m);

    let mut m = runtime::CloseSessionResponse::new();
    m.set_final_history_length(u64::MAX);
    check_golden("close_session_response", &m);

    let mut bias = runtime::LogitBias::new();
    bias.set_token_id(42);
    bias.set_bias(-100.0);
    check_golden("logit_bias", &bias);

    let mut stop = runtime::StopSequence::new();
    stop.set_token_ids(vec![198, 198]);
    check_golden("stop_sequence", &stop);

    let mut m = runtime::GenerateRequest::new();
    m.set_session_id("session-generate".into());
    m.set_max_tokens(256);
    m.set_seed(0xdead_beef_cafe_f00d);
    m.set_temperature(0.7);
    m.set_top_p(0.95);
    m.set_top_k(40);
    m.set_min_p(0.05);
    m.set_repetition_penalty(1.1);
    m.set_presence_penalty(0.25);
    m.set_frequency_penalty(-0.5);
    m.set_penalty_last_n(64);
    let mut second_bias = runtime::LogitBias::new();
    second_bias.set_token_id(49151);
    second_bias.set_bias(3.5);
    m.set_logit_bias(vec![bias, second_bias].into());
    let mut second_stop = runtime::StopSequence::new();
    second_stop.set_token_ids(vec![2]);
    m.set_stop_sequences(vec![stop, second_stop].into());
    m.set_top_logprobs(5);
    m.set_speculate(false);
    check_golden("generate_request", &m);

    let mut constraint = runtime::OutputConstraint::new();
    constraint.set_json_schema(r#"{"type": "object"}"#.into());
    check_golden("output_constraint", &constraint);

    let mut m = runtime::GenerateResponse::new();
    m.set_token_id(31337);
    check_golden("generate_response_token_id", &m);
    let mut m = runtime::GenerateResponse::new();
    m.set_done(generate_done());
    check_golden("generate_response_done", &m);
    let mut truncated = runtime::HistoryTruncated::new();
    truncated.set_dropped_token_count(1000);
    let mut m = runtime::GenerateResponse::new();
    m.set_truncated(truncated.clone());
    check_golden("generate_response_truncated", &m);
    let mut m = runtime::GenerateResponse::new();
    m.set_logprobs(token_logprobs());
    check_golden("generate_response_logprobs", &m);

    check_golden("generate_done", &generate_done());
    check_golden("history_truncated", &truncated);
    check_golden("token_logprob", &logprob(9, -3.75));
    check_golden("token_logprobs", &token_logprobs());

    let mut m = runtime::GetSessionInfoRequest::new();
    m.set_session_id("session-info".into());
    check_golden("get_session_info_request", &m);

    let mut m = runtime::GetSessionInfoResponse::new();
    m.set_history_length(4242);
    m.set_kv_live_bytes(3 * 1_179_648);
    m.set_cache_invariant_inv1_violations(1);
    m.set_cache_invariant_inv2_violations(2);
    m.set_idle_seconds(12.75);
    m.set_kv_pages_held(3);
    m.set_kv_page_bytes(1_179_648);
    m.set_client_label("golden-client/1.0 ünï".into());
    m.set_eos_token_ids(vec![2, 0]);
    m.set_worker(1);
    m.set_truncated_token_count(17);
    m.set_logits_digest(0x0123_4567_89ab_cdef);
    m.set_busy(true);
    m.set_speculation_proposed_token_count(40);
    m.set_speculation_accepted_token_count(31);
    check_golden("get_session_info_response", &m);
}

#[test]
fn every_health_message_matches_its_golden_bytes_and_decodes_back() {
    let mut m = health::HealthCheckRequest::new();
    m.set_service("kakeya.v1.RuntimeService".into());
    check_golden("health_check_request", &m);

    let mut m = health::HealthCheckResponse::new();
    m.set_status(health::HealthCheckResponse_ServingStatus::SERVICE_UNKNOWN);
    check_golden("health_check_response", &m);
}

#[test]
fn golden_vectors_exist_for_every_message_type() {
    let runtime_messages = runtime::file_descriptor_proto().get_message_type().len();
    let health_messages = health::file_descriptor_proto().get_message_type().len();
    // GenerateResponse has one vector per payload variant (4) instead of one.
    let expected = runtime_messages + 3 + health_messages;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/proto");
    let committed = std::fs::read_dir(&dir)
        .expect("tests/vectors/proto exists")
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "hex"))
        .count();
    assert_eq!(committed, expected);
}
