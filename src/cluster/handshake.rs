//! The handshake's rules: both sides speak protocol version 1, the shard
//! serves exactly the model and layer range the coordinator expects, and
//! the limits that apply are the smaller of each side's.

use super::fingerprint::Fingerprint;
use super::frame::Epochs;
use super::payload::Encoding;
use crate::proto::inferd_shard_v1::shard_runtime as pb;

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: pb::ProtocolVersion = pb::ProtocolVersion::PROTOCOL_VERSION_1;

/// Why a handshake is refused (gRPC FAILED_PRECONDITION, or INVALID_ARGUMENT
/// for a request that does not parse into one).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    #[error("protocol version {got:?}, this shard speaks {PROTOCOL_VERSION:?}")]
    Version { got: pb::ProtocolVersion },
    #[error("the request names no valid model fingerprint")]
    NoFingerprint,
    #[error("fingerprint mismatch: expected {expected}, this shard serves {served}")]
    Fingerprint { expected: String, served: String },
    #[error("no payload encoding both sides accept")]
    NoCommonEncoding,
    #[error(
        "limits must be positive: max_frame_bytes {max_frame_bytes}, credit_window {credit_window}"
    )]
    Limits {
        max_frame_bytes: u32,
        credit_window: u32,
    },
}

/// What both sides agreed on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Agreed {
    pub epochs: Epochs,
    pub fingerprint: Fingerprint,
    pub max_frame_bytes: u32,
    pub credit_window: u32,
    pub max_sessions: u32,
    /// Rows one hidden-state frame may carry; 0: neither side set a bound.
    pub max_frame_rows: u32,
    pub encodings: Vec<Encoding>,
}

fn describe(f: &Fingerprint) -> String {
    format!(
        "{} layers {}..{} of {}, hidden {}",
        f.hash_hex(),
        f.layer_begin,
        f.layer_end,
        f.layer_count,
        f.hidden_size
    )
}

/// Limits in wire form.
pub fn limits_to_wire(
    max_frame_bytes: u32,
    credit_window: u32,
    max_sessions: u32,
    encodings: &[Encoding],
) -> pb::Limits {
    let mut l = pb::Limits::new();
    l.set_max_frame_bytes(max_frame_bytes);
    l.set_credit_window(credit_window);
    l.set_max_sessions(max_sessions);
    l.set_encodings(encodings.iter().map(|e| e.to_wire()).collect());
    l
}

/// The shard's side: checks a request against what it serves and its own
/// limits, and settles the terms.
pub fn agree(
    request: &pb::HandshakeRequest,
    served: &Fingerprint,
    shard_limits: &pb::Limits,
    shard_epoch: u64,
) -> Result<Agreed, HandshakeError> {
    if request.get_protocol_version() != PROTOCOL_VERSION {
        return Err(HandshakeError::Version {
            got: request.get_protocol_version(),
        });
    }
    let expected =
        Fingerprint::from_wire(request.get_expected()).ok_or(HandshakeError::NoFingerprint)?;
    if &expected != served {
        return Err(HandshakeError::Fingerprint {
            expected: describe(&expected),
            served: describe(served),
        });
    }
    let theirs = request.get_limits();
    let min_positive = |a: u32, b: u32| match (a, b) {
        (0, b) => b,
        (a, 0) => a,
        (a, b) => a.min(b),
    };
    let max_frame_bytes = min_positive(
        theirs.get_max_frame_bytes(),
        shard_limits.get_max_frame_bytes(),
    );
    let credit_window = min_positive(theirs.get_credit_window(), shard_limits.get_credit_window());
    let max_sessions = min_positive(theirs.get_max_sessions(), shard_limits.get_max_sessions());
    let max_frame_rows = min_positive(
        theirs.get_max_frame_rows(),
        shard_limits.get_max_frame_rows(),
    );
    if max_frame_bytes == 0 || credit_window == 0 {
        return Err(HandshakeError::Limits {
            max_frame_bytes,
            credit_window,
        });
    }
    let mine: Vec<Encoding> = shard_limits
        .get_encodings()
        .iter()
        .filter_map(|e| Encoding::from_wire(*e).ok())
        .collect();
    let encodings: Vec<Encoding> = theirs
        .get_encodings()
        .iter()
        .filter_map(|e| Encoding::from_wire(*e).ok())
        .filter(|e| mine.contains(e))
        .collect();
    if encodings.is_empty() {
        return Err(HandshakeError::NoCommonEncoding);
    }
    Ok(Agreed {
        epochs: Epochs {
            shard: shard_epoch,
            coordinator: request.get_coordinator_epoch(),
        },
        fingerprint: served.clone(),
        max_frame_bytes,
        credit_window,
        max_sessions,
        max_frame_rows,
        encodings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served() -> Fingerprint {
        Fingerprint {
            gguf_sha256: [3; 32],
            layer_begin: 0,
            layer_end: 15,
            layer_count: 30,
            hidden_size: 576,
        }
    }

    fn request() -> pb::HandshakeRequest {
        let mut r = pb::HandshakeRequest::new();
        r.set_protocol_version(PROTOCOL_VERSION);
        r.set_expected(served().to_wire());
        r.set_coordinator_epoch(42);
        r.set_limits(limits_to_wire(
            1 << 20,
            8,
            0,
            &[Encoding::F32, Encoding::F16],
        ));
        r
    }

    fn shard_limits() -> pb::Limits {
        let mut limits = limits_to_wire(4 << 20, 4, 64, &[Encoding::F32, Encoding::Q8_0]);
        limits.set_max_frame_rows(2048);
        limits
    }

    #[test]
    fn matching_sides_agree_on_the_smaller_limits() {
        let agreed = agree(&request(), &served(), &shard_limits(), 7).unwrap();
        assert_eq!(
            agreed.epochs,
            Epochs {
                shard: 7,
                coordinator: 42
            }
        );
        assert_eq!(agreed.max_frame_bytes, 1 << 20);
        assert_eq!(agreed.credit_window, 4);
        assert_eq!(agreed.max_sessions, 64);
        assert_eq!(
            agreed.max_frame_rows, 2048,
            "a side without a bound takes the other's"
        );
        assert_eq!(agreed.encodings, vec![Encoding::F32]);
        let mut fewer_rows = request();
        fewer_rows.mut_limits().set_max_frame_rows(100);
        let agreed = agree(&fewer_rows, &served(), &shard_limits(), 7).unwrap();
        assert_eq!(agreed.max_frame_rows, 100);
    }

    #[test]
    fn a_version_fingerprint_or_encoding_mismatch_is_refused() {
        let mut old = request();
        old.set_protocol_version(pb::ProtocolVersion::PROTOCOL_VERSION_UNSPECIFIED);
        assert!(matches!(
            agree(&old, &served(), &shard_limits(), 7),
            Err(HandshakeError::Version { .. })
        ));
        let mut other_range = request();
        let mut f = served();
        f.layer_end = 16;
        other_range.set_expected(f.to_wire());
        assert!(matches!(
            agree(&other_range, &served(), &shard_limits(), 7),
            Err(HandshakeError::Fingerprint { .. })
        ));
        let mut other_model = request();
        let mut g = served();
        g.gguf_sha256[0] ^= 1;
        other_model.set_expected(g.to_wire());
        assert!(matches!(
            agree(&other_model, &served(), &shard_limits(), 7),
            Err(HandshakeError::Fingerprint { .. })
        ));
        let mut f16_only = request();
        f16_only.set_limits(limits_to_wire(1 << 20, 8, 0, &[Encoding::F16]));
        assert_eq!(
            agree(&f16_only, &served(), &shard_limits(), 7),
            Err(HandshakeError::NoCommonEncoding)
        );
        let mut none = request();
        none.clear_expected();
        assert_eq!(
            agree(&none, &served(), &shard_limits(), 7),
            Err(HandshakeError::NoFingerprint)
        );
    }
}
