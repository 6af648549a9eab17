//! The shard protocol's methods as raw bytes over grpcio: method
//! definitions whose marshaller neither decodes nor re-encodes, so a
//! receiver sees (and checks) the exact bytes that were sent, a relay
//! forwards them untouched, and a shard answers a request body that does
//! not parse with its own status (INVALID_ARGUMENT) rather than grpcio's
//! INTERNAL.

use std::io::Read;

use grpcio::{GrpcSlice, Marshaller, MessageReader, Method, MethodType};

/// Full name of the handshake method.
pub const HANDSHAKE_METHOD_NAME: &str = "/inferd.shard.v1.ShardRuntime/Handshake";

/// Full name of the session stream method.
pub const SESSION_METHOD_NAME: &str = "/inferd.shard.v1.ShardRuntime/Session";

fn ser(bytes: &Vec<u8>, buf: &mut GrpcSlice) -> grpcio::Result<()> {
    *buf = GrpcSlice::from(bytes.as_slice());
    Ok(())
}

fn de(mut reader: MessageReader) -> grpcio::Result<Vec<u8>> {
    let mut bytes = Vec::with_capacity(reader.len());
    reader
        .read_to_end(&mut bytes)
        .map_err(|e| grpcio::Error::Codec(Box::new(e)))?;
    Ok(bytes)
}

/// `ShardRuntime/Session` with opaque frames.
pub const SESSION_RAW: Method<Vec<u8>, Vec<u8>> = Method {
    ty: MethodType::Duplex,
    name: SESSION_METHOD_NAME,
    req_mar: Marshaller { ser, de },
    resp_mar: Marshaller { ser, de },
};

/// `ShardRuntime/Handshake` with opaque messages.
pub const HANDSHAKE_RAW: Method<Vec<u8>, Vec<u8>> = Method {
    ty: MethodType::Unary,
    name: HANDSHAKE_METHOD_NAME,
    req_mar: Marshaller { ser, de },
    resp_mar: Marshaller { ser, de },
};
