//! Tenants: who a session belongs to and who is calling (CONTRACT §2.10).
//!
//! A server given several access tokens serves several tenants: each
//! session belongs to the tenant whose token created it, and a caller of
//! another tenant is told the session does not exist, exactly as for an id
//! the server never issued, so an id reveals nothing to someone it was not
//! given to. The runtime checks this itself, on every call that names a
//! session: each such call of [`super::Runtime`] takes the caller's tenant,
//! and the worker finds a session for a command only through the one lookup
//! that compares it with the session's owner.
//!
//! A tenant is a non-secret identity (the token's name, or a digest of an
//! unnamed token; see `server::tokens`), never a token: it is written to
//! the session's journal so ownership outlives a restart.

use std::fmt;
use std::sync::Arc;

use thiserror::Error;

/// A caller's or a session's tenant; [`Tenant::NONE`] where there is none
/// (a server with one unnamed token or none, or a session journaled before
/// sessions had owners).
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Tenant(Option<Arc<str>>);

/// Why text cannot be a tenant's identity.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error(
    "a tenant identity is 1 to {} printable ASCII characters without spaces",
    Tenant::MAX_LEN
)]
pub struct BadTenant;

impl Tenant {
    /// No tenant: such a session is anyone's, and such a caller may use
    /// any session.
    pub const NONE: Tenant = Tenant(None);
    /// Longest identity, in bytes (a journal header holds it).
    pub const MAX_LEN: usize = 128;

    /// The tenant named `identity`: 1 to [`Tenant::MAX_LEN`] printable
    /// ASCII characters, no spaces (it is logged and journaled as is).
    pub fn new(identity: &str) -> Result<Tenant, BadTenant> {
        let ok = (1..=Self::MAX_LEN).contains(&identity.len())
            && identity.bytes().all(|b| b.is_ascii_graphic());
        ok.then(|| Tenant(Some(identity.into()))).ok_or(BadTenant)
    }

    /// The identity, or `None` for [`Tenant::NONE`].
    pub fn identity(&self) -> Option<&str> {
        self.0.as_deref()
    }

    /// Whether a caller of this tenant may use a session that `owner`
    /// owns: always where either has no tenant (a server without tenants
    /// does not check, and a session without an owner is anyone's), else
    /// only the owner.
    pub fn may_use(&self, owner: &Tenant) -> bool {
        match (&self.0, &owner.0) {
            (Some(caller), Some(owner)) => caller == owner,
            _ => true,
        }
    }
}

impl fmt::Debug for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Some(identity) => write!(f, "Tenant({identity})"),
            None => f.write_str("Tenant::NONE"),
        }
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.identity().unwrap_or("-"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_owner_may_use_an_owned_session() {
        let alice = Tenant::new("alice").unwrap();
        let bob = Tenant::new("bob").unwrap();
        assert!(alice.may_use(&alice));
        assert!(!bob.may_use(&alice));
        assert!(bob.may_use(&Tenant::NONE), "a session without owner");
        assert!(Tenant::NONE.may_use(&alice), "a server without tenants");
        assert!(Tenant::NONE.may_use(&Tenant::NONE));
    }

    #[test]
    fn identities_are_short_printable_and_without_spaces() {
        assert!(Tenant::new("sha256:0123abcd").is_ok());
        assert!(Tenant::new(&"a".repeat(Tenant::MAX_LEN)).is_ok());
        for bad in ["", "a b", "tab\there", "é", "nl\n"] {
            assert_eq!(Tenant::new(bad), Err(BadTenant), "{bad:?}");
        }
        assert_eq!(
            Tenant::new(&"a".repeat(Tenant::MAX_LEN + 1)),
            Err(BadTenant)
        );
    }
}
