//! The `kakeya.v1.RuntimeService` and `inferd.session.v1.SessionService`
//! methods as this server registers them: the generated methods' names and
//! response codec, with a request codec that never fails the call itself.
//!
//! grpcio decodes a request before any handler runs and answers one its
//! codec cannot decode with `INTERNAL: Failed to deserialize ...`. A body
//! that does not parse (garbage, a truncated varint, a wrong wire type,
//! bad UTF-8 in a string) is the client's mistake, not a bug, so the
//! decoder here hands the handler an [`Incoming`]: the message, or why its
//! bytes did not parse; the handler answers the latter INVALID_ARGUMENT
//! (CONTRACT §2.4) through the same reply path as every other refusal.

use grpcio::{GrpcSlice, Marshaller, MessageReader, Method, MethodType};
use protobuf::Message;

use crate::proto::inferd_session_v1::{session_service as ext, session_service_grpc};
use crate::proto::kakeya_v1::runtime as pb;
use crate::proto::kakeya_v1::runtime_grpc as generated;
use crate::runtime::RuntimeError;

/// A request as it came off the wire.
pub struct Incoming<T>(Result<T, String>);

impl<T: Message> Incoming<T> {
    /// The message, or INVALID_ARGUMENT naming its type and the parse error.
    pub fn message(self) -> Result<T, RuntimeError> {
        self.0.map_err(|why| {
            RuntimeError::InvalidArgument(format!(
                "the request body is not a valid {}: {why}",
                T::descriptor_static().full_name()
            ))
        })
    }
}

/// Parses one message from `input` (to its end).
fn parse<T: Message>(mut input: protobuf::CodedInputStream) -> Incoming<T> {
    let mut message = T::new();
    let parsed = message
        .merge_from(&mut input)
        .map(|()| message)
        .map_err(|e| e.to_string());
    Incoming(parsed)
}

/// Decodes a request; a parse failure becomes the handler's to answer.
fn decode<T: Message>(mut reader: MessageReader) -> grpcio::Result<Incoming<T>> {
    Ok(parse(protobuf::CodedInputStream::from_buffered_reader(
        &mut reader,
    )))
}

/// Encodes a request (only a client of these methods would, e.g. a test);
/// one that did not parse has nothing to send.
fn encode<T: Message>(incoming: &Incoming<T>, buf: &mut GrpcSlice) -> grpcio::Result<()> {
    match &incoming.0 {
        Ok(message) => grpcio::pb_ser(message, buf),
        Err(why) => Err(grpcio::Error::Codec(why.clone().into())),
    }
}

const fn lenient<T: Message>() -> Marshaller<Incoming<T>> {
    Marshaller {
        ser: encode::<T>,
        de: decode::<T>,
    }
}

const fn protobuf<T: Message>() -> Marshaller<T> {
    Marshaller {
        ser: grpcio::pb_ser::<T>,
        de: grpcio::pb_de::<T>,
    }
}

pub const CREATE_SESSION: Method<Incoming<pb::CreateSessionRequest>, pb::CreateSessionResponse> =
    Method {
        ty: MethodType::Unary,
        name: generated::METHOD_RUNTIME_SERVICE_CREATE_SESSION.name,
        req_mar: lenient(),
        resp_mar: protobuf(),
    };

pub const APPEND_TOKENS: Method<Incoming<pb::AppendTokensRequest>, pb::AppendTokensResponse> =
    Method {
        ty: MethodType::Unary,
        name: generated::METHOD_RUNTIME_SERVICE_APPEND_TOKENS.name,
        req_mar: lenient(),
        resp_mar: protobuf(),
    };

pub const GENERATE: Method<Incoming<pb::GenerateRequest>, pb::GenerateResponse> = Method {
    ty: MethodType::ServerStreaming,
    name: generated::METHOD_RUNTIME_SERVICE_GENERATE.name,
    req_mar: lenient(),
    resp_mar: protobuf(),
};

pub const CLOSE_SESSION: Method<Incoming<pb::CloseSessionRequest>, pb::CloseSessionResponse> =
    Method {
        ty: MethodType::Unary,
        name: generated::METHOD_RUNTIME_SERVICE_CLOSE_SESSION.name,
        req_mar: lenient(),
        resp_mar: protobuf(),
    };

pub const GET_SESSION_INFO: Method<
    Incoming<pb::GetSessionInfoRequest>,
    pb::GetSessionInfoResponse,
> = Method {
    ty: MethodType::Unary,
    name: generated::METHOD_RUNTIME_SERVICE_GET_SESSION_INFO.name,
    req_mar: lenient(),
    resp_mar: protobuf(),
};

pub const FORK_SESSION: Method<Incoming<ext::ForkSessionRequest>, ext::ForkSessionResponse> =
    Method {
        ty: MethodType::Unary,
        name: session_service_grpc::METHOD_SESSION_SERVICE_FORK_SESSION.name,
        req_mar: lenient(),
        resp_mar: protobuf(),
    };

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_bytes<T: Message>(bytes: &[u8]) -> Result<T, RuntimeError> {
        parse(protobuf::CodedInputStream::from_bytes(bytes)).message()
    }

    #[test]
    fn a_body_that_does_not_parse_is_invalid_argument_naming_the_type() {
        for bytes in [
            &b"\xff\xff\xff"[..],    // garbage: field 0 / a runaway varint
            b"\x12\x03\x80",         // token_ids, truncated
            b"\x0a\x02\xff\xfe",     // session_id, not UTF-8
            b"\x0d\x00\x00\x00\x00", // session_id sent as a fixed32
            b"\x0a\x05ab",           // a length past the end
        ] {
            let err =
                parse_bytes::<pb::AppendTokensRequest>(bytes).expect_err(&format!("{bytes:x?}"));
            assert!(matches!(err, RuntimeError::InvalidArgument(_)), "{err:?}");
            assert!(
                err.to_string().contains("kakeya.v1.AppendTokensRequest"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_good_body_parses() {
        let mut req = pb::AppendTokensRequest::new();
        req.set_session_id("x".into());
        req.set_token_ids(vec![1, 300]);
        let bytes = req.write_to_bytes().expect("encodes");
        assert_eq!(parse_bytes::<pb::AppendTokensRequest>(&bytes), Ok(req));
        assert_eq!(
            parse_bytes::<pb::CloseSessionRequest>(b""),
            Ok(pb::CloseSessionRequest::new())
        );
    }
}
