//! Session ids: 128 random bits from the operating system, written as 32
//! lowercase hex digits. The server draws them; clients only echo them.
//!
//! Text that is not 32 lowercase hex digits is not a malformed request but
//! an id the server never issued, so it is `NotFound` like any other id the
//! server does not hold (CONTRACT §2.4: the published SDKs' own tests send
//! `sess-does-not-exist` and expect NOT_FOUND).

use std::fmt;

use thiserror::Error;

/// Text that names no session the server could have issued (the runtime
/// answers it `NotFound`, like any id it does not hold).
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
#[error("no such session")]
pub struct NotAnId;

/// The operating system's random source failed.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("OS random source failed: {0}")]
pub struct NoRandomness(pub String);

/// A server-owned, unguessable session id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId([u8; 16]);

impl SessionId {
    /// The id that stands for text naming no id the server could have
    /// issued (all zero bits: [`SessionId::random`] never draws it). Every
    /// operation on it is `NotFound`, after the request's arguments were
    /// checked like any other's.
    pub const NEVER_ISSUED: SessionId = SessionId([0; 16]);

    /// Draws a fresh id from the operating system's random source.
    pub fn random() -> Result<Self, NoRandomness> {
        loop {
            let mut bytes = [0u8; 16];
            getrandom::getrandom(&mut bytes).map_err(|e| NoRandomness(e.to_string()))?;
            if bytes != Self::NEVER_ISSUED.0 {
                return Ok(SessionId(bytes));
            }
        }
    }

    /// [`SessionId::parse`], with text of any other form read as
    /// [`SessionId::NEVER_ISSUED`]: for a request whose arguments must be
    /// checked before its id says `NotFound`.
    pub fn parse_or_never_issued(text: &str) -> SessionId {
        Self::parse(text).unwrap_or(Self::NEVER_ISSUED)
    }

    /// Parses exactly 32 lowercase hex digits. Anything else (empty, the
    /// wrong length, upper case, other characters) names no session the
    /// server ever issued: `NotFound`, indistinguishable from an unknown,
    /// closed or evicted id.
    pub fn parse(text: &str) -> Result<Self, NotAnId> {
        let digits = text.as_bytes();
        if digits.len() != 32 {
            return Err(NotAnId);
        }
        let mut bytes = [0u8; 16];
        for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
            match (hex_value(pair[0]), hex_value(pair[1])) {
                (Some(hi), Some(lo)) => *byte = hi << 4 | lo,
                _ => return Err(NotAnId),
            }
        }
        Ok(SessionId(bytes))
    }

    /// The raw bits.
    pub fn bytes(&self) -> [u8; 16] {
        self.0
    }

    /// The worker that owns this id among `n_workers` (`n_workers > 0`).
    pub fn worker_index(&self, n_workers: usize) -> usize {
        self.0[0] as usize % n_workers.max(1)
    }
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({self})")
    }
}

impl std::str::FromStr for SessionId {
    type Err = NotAnId;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_their_text() {
        let id = SessionId::random().expect("random");
        let text = id.to_string();
        assert_eq!(text.len(), 32);
        assert!(text
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        assert_eq!(SessionId::parse(&text).expect("parses"), id);
    }

    #[test]
    fn two_draws_differ() {
        let a = SessionId::random().expect("random");
        let b = SessionId::random().expect("random");
        assert_ne!(a, b);
    }

    #[test]
    fn malformed_ids_are_ids_the_server_does_not_hold() {
        let good = "0123456789abcdef0123456789abcdef";
        assert!(SessionId::parse(good).is_ok());
        for bad in [
            "",
            "0123456789abcdef0123456789abcde",
            "0123456789abcdef0123456789abcdef0",
            "0123456789ABCDEF0123456789abcdef",
            "0123456789abcdeg0123456789abcdef",
            "0123456789abcdef0123456789abcd-f",
            "é123456789abcdef0123456789abcde",
            "sess-does-not-exist",
        ] {
            let err = SessionId::parse(bad).expect_err(bad);
            assert_eq!(err, NotAnId, "{bad}");
        }
    }

    #[test]
    fn shard_is_the_first_byte_modulo_workers() {
        let id = SessionId::parse("0700000000000000000000000000000f").expect("parses");
        assert_eq!(id.worker_index(4), 3);
        assert_eq!(id.worker_index(7), 0);
        assert_eq!(id.worker_index(0), 0);
    }
}
