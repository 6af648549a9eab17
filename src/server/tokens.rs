//! The access-token file (`--auth-token-file`, CONTRACT §2.10): which
//! bearer tokens the server accepts, and the tenant each one calls as.
//!
//! ```text
//! # one token per line; blank lines and lines starting with `#` are skipped
//! alice: 9f2c1e7b4d...        a named token: NAME, a colon, a space, TOKEN
//! 5be0d8a1c3...               an unnamed token
//! ```
//!
//! A name is 1 to 64 ASCII letters, digits, `.`, `_` or `-`; a token is 1
//! to 4096 printable ASCII characters without spaces (what an HTTP
//! `Authorization: Bearer` header can carry). A line holding a colon with
//! no space after it (`user:pass`) is one unnamed token, so a file holding
//! one bare token reads as it always did.
//!
//! Each token calls as a tenant: its name, or for an unnamed token
//! `sha256:` and the first 16 hex digits of the SHA-256 of the token, an
//! identity that is safe to journal and log. The exception is a file of
//! one unnamed token (the format before names existed): it calls as no
//! tenant, so sessions do not depend on the token and survive its
//! rotation, exactly as before. Duplicate tokens or names, and a file with
//! no token at all, are refused at start.

use std::sync::Arc;

use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::runtime::Tenant;

/// Most tokens one file may hold: every call is compared with all of them.
pub const MAX_TOKENS: usize = 1024;
/// Longest token, in bytes.
pub const MAX_TOKEN_BYTES: usize = 4096;
/// Longest name, in bytes.
pub const MAX_NAME_BYTES: usize = 64;

/// Why a token file is refused. Line numbers count from 1; no message
/// repeats a token.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum TokenFileError {
    #[error("the access-token file holds no token")]
    Empty,
    #[error("line {line}: {what}")]
    BadLine { line: usize, what: &'static str },
    #[error("line {line}: the same token as line {first}")]
    DuplicateToken { line: usize, first: usize },
    #[error("line {line}: the name `{name}` is already used on line {first}")]
    DuplicateName {
        line: usize,
        first: usize,
        name: String,
    },
    #[error("line {line}: its token's digest is that of line {first}; replace one of them")]
    DuplicateTenant { line: usize, first: usize },
    #[error("more than {MAX_TOKENS} tokens")]
    TooMany,
}

/// One accepted token.
struct Entry {
    /// The whole header value a caller sends: `Bearer <token>`.
    bearer: Box<[u8]>,
    tenant: Tenant,
}

/// The tokens a server accepts, each with the tenant it calls as.
#[derive(Clone)]
pub struct AccessTokens {
    entries: Arc<[Entry]>,
}

impl std::fmt::Debug for AccessTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Tenants only, never a token.
        f.debug_list()
            .entries(self.entries.iter().map(|e| &e.tenant))
            .finish()
    }
}

/// What one line says: an unnamed token, or a name and its token.
fn parse_line(text: &str, line: usize) -> Result<(Option<&str>, &str), TokenFileError> {
    let bad = |what| TokenFileError::BadLine { line, what };
    let named = text
        .split_once(':')
        .filter(|(_, rest)| rest.starts_with([' ', '\t']));
    let (name, token) = match named {
        Some((name, token)) => (Some(name.trim_end()), token.trim_start()),
        None => (None, text),
    };
    if let Some(name) = name {
        let ok = (1..=MAX_NAME_BYTES).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !ok {
            return Err(bad(
                "a name is 1 to 64 ASCII letters, digits, '.', '_' or '-' (`name: token`)",
            ));
        }
    }
    if token.is_empty() {
        return Err(bad("the name has no token after it"));
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(bad("a token is at most 4096 bytes"));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad(
            "a token is printable ASCII without spaces (to name it, write `name: token`)",
        ));
    }
    Ok((name, token))
}

/// The tenant of an unnamed token among several: a digest that names the
/// token without revealing it.
fn digest_tenant(token: &str) -> Tenant {
    let digest = Sha256::digest(token.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    Tenant::new(&format!("sha256:{hex}")).unwrap_or(Tenant::NONE)
}

/// The one token a client's token file holds, written as a server's is
/// (`TOKEN` or `NAME: TOKEN`, blank lines and `#` comments skipped), so
/// that a tenant can be handed its own line of the server's file.
pub fn client_token(text: &str) -> Result<&str, TokenFileError> {
    let mut found = None;
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        let text = raw.trim();
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        let (_, token) = parse_line(text, line)?;
        if found.is_some() {
            return Err(TokenFileError::BadLine {
                line,
                what: "a client's token file holds one token",
            });
        }
        found = Some(token);
    }
    found.ok_or(TokenFileError::Empty)
}

impl AccessTokens {
    /// Reads a token file's text (format in the module documentation).
    pub fn parse(text: &str) -> Result<AccessTokens, TokenFileError> {
        // (line, name, token)
        let mut read: Vec<(usize, Option<&str>, &str)> = Vec::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            let text = raw.trim();
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            let (name, token) = parse_line(text, line)?;
            if read.len() == MAX_TOKENS {
                return Err(TokenFileError::TooMany);
            }
            if let Some(&(first, ..)) = read.iter().find(|(_, _, t)| *t == token) {
                return Err(TokenFileError::DuplicateToken { line, first });
            }
            if let Some(name) = name {
                if let Some(&(first, ..)) = read.iter().find(|(_, n, _)| *n == Some(name)) {
                    return Err(TokenFileError::DuplicateName {
                        line,
                        first,
                        name: name.to_owned(),
                    });
                }
            }
            read.push((line, name, token));
        }
        let tenants = match read.as_slice() {
            [] => return Err(TokenFileError::Empty),
            // Today's file: one token, no tenants.
            [(_, None, _)] => vec![Tenant::NONE],
            _ => read
                .iter()
                .map(|&(_, name, token)| match name {
                    // Names were checked to be tenant identities.
                    Some(name) => Tenant::new(name).unwrap_or(Tenant::NONE),
                    None => digest_tenant(token),
                })
                .collect(),
        };
        // Two digests alike (or a name spelled like a digest, which the
        // name rules forbid) would merge two tenants: refuse.
        for (i, tenant) in tenants.iter().enumerate() {
            if let Some(j) = tenants[..i]
                .iter()
                .position(|t| t.identity().is_some() && t == tenant)
            {
                return Err(TokenFileError::DuplicateTenant {
                    line: read[i].0,
                    first: read[j].0,
                });
            }
        }
        let entries = read
            .iter()
            .zip(tenants)
            .map(|(&(_, _, token), tenant)| Entry {
                bearer: format!("Bearer {token}").into_bytes().into(),
                tenant,
            })
            .collect();
        Ok(AccessTokens { entries })
    }

    /// How many tokens there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Never true: a file without a token is refused.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether the tokens call as tenants (sessions then have owners).
    pub fn has_tenants(&self) -> bool {
        self.entries.iter().any(|e| e.tenant.identity().is_some())
    }

    /// The tenant of the first of `values` (`Authorization` header values)
    /// that is `Bearer <token>` for an accepted token, or `None`. Every
    /// value is compared with every token in full, so the time taken says
    /// nothing about how much of a guess was right, nor which token it was
    /// closest to.
    pub fn caller<'a>(&self, values: impl IntoIterator<Item = &'a [u8]>) -> Option<Tenant> {
        let mut found: Option<&Entry> = None;
        for value in values {
            for entry in self.entries.iter() {
                let equal = constant_time_eq(value, &entry.bearer);
                found = found.or(equal.then_some(entry));
            }
        }
        found.map(|entry| entry.tenant.clone())
    }
}

/// Compares without an early exit, so the time taken says nothing about
/// how much of a guessed token was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_reads_its_one_token_bare_or_named() {
        assert_eq!(client_token("s3cret\n"), Ok("s3cret"));
        assert_eq!(client_token("# mine\n\nalice: s3cret\n"), Ok("s3cret"));
        assert_eq!(client_token("user:pass"), Ok("user:pass"));
        assert_eq!(client_token(" \n# none\n"), Err(TokenFileError::Empty));
        assert!(matches!(
            client_token("a: one\nb: two\n"),
            Err(TokenFileError::BadLine { line: 2, .. })
        ));
    }

    fn caller(tokens: &AccessTokens, header: &str) -> Option<Tenant> {
        tokens.caller([header.as_bytes()])
    }

    #[test]
    fn one_bare_token_reads_as_it_always_did_and_has_no_tenant() {
        for text in ["s3cret\n", "  s3cret  ", "s3cret", "user:pass\n"] {
            let tokens = AccessTokens::parse(text).expect(text);
            assert_eq!(tokens.len(), 1);
            assert!(!tokens.has_tenants());
            let token = text.trim();
            assert_eq!(
                caller(&tokens, &format!("Bearer {token}")),
                Some(Tenant::NONE),
                "{text:?}"
            );
            assert_eq!(caller(&tokens, "Bearer s3cre"), None);
            assert_eq!(caller(&tokens, token), None, "the scheme is required");
        }
    }

    #[test]
    fn named_and_unnamed_tokens_call_as_their_tenants() {
        let text = "# tenants\n\nalice: tok-a\n  bob:\ttok-b  \r\ntok-c\n# done\n";
        let tokens = AccessTokens::parse(text).expect("parses");
        assert_eq!(tokens.len(), 3);
        assert!(tokens.has_tenants());
        let tenant = |name| Some(Tenant::new(name).unwrap());
        assert_eq!(caller(&tokens, "Bearer tok-a"), tenant("alice"));
        assert_eq!(caller(&tokens, "Bearer tok-b"), tenant("bob"));
        let c = caller(&tokens, "Bearer tok-c").expect("accepted");
        let identity = c.identity().expect("a tenant").to_owned();
        assert!(identity.starts_with("sha256:") && identity.len() == 7 + 16);
        assert!(!identity.contains("tok-c"));
        assert_eq!(caller(&tokens, "Bearer alice"), None);
        assert_eq!(caller(&tokens, "Bearer tok-d"), None);
        // The first accepted value among several headers decides.
        assert_eq!(
            tokens.caller([&b"Bearer nope"[..], b"Bearer tok-b", b"Bearer tok-a"]),
            tenant("bob")
        );
        // One named token alone is a tenant too.
        let one = AccessTokens::parse("ops: t\n").expect("parses");
        assert_eq!(caller(&one, "Bearer t"), tenant("ops"));
        // Debug output names tenants, never tokens.
        let shown = format!("{tokens:?}");
        assert!(
            shown.contains("alice") && !shown.contains("tok-a"),
            "{shown}"
        );
    }

    #[test]
    fn bad_lines_duplicates_and_empty_files_are_refused_with_their_line() {
        let bad = |text: &str| AccessTokens::parse(text).expect_err(text);
        assert_eq!(bad(""), TokenFileError::Empty);
        assert_eq!(bad("  \n# only a comment\n\n"), TokenFileError::Empty);
        for (text, line) in [
            ("a: b c\n", 1),
            ("ok\ntwo words\n", 2),
            ("x\nbad name: t\n", 2),
            ("a b: t\n", 1),
            (": t\n", 1),
            ("tok\u{e9}\n", 1),
            ("tok\u{7}\n", 1),
        ] {
            assert!(
                matches!(bad(text), TokenFileError::BadLine { line: l, .. } if l == line),
                "{text:?}: {:?}",
                bad(text)
            );
        }
        let long = format!("{}: t\n", "n".repeat(MAX_NAME_BYTES + 1));
        assert!(matches!(
            bad(&long),
            TokenFileError::BadLine { line: 1, .. }
        ));
        let huge = "t".repeat(MAX_TOKEN_BYTES + 1);
        assert!(matches!(
            bad(&huge),
            TokenFileError::BadLine { line: 1, .. }
        ));
        assert_eq!(
            bad("a: same\n\nb: same\n"),
            TokenFileError::DuplicateToken { line: 3, first: 1 }
        );
        assert_eq!(
            bad("t1\nt1\n"),
            TokenFileError::DuplicateToken { line: 2, first: 1 }
        );
        assert_eq!(
            bad("a: t1\n# x\na: t2\n"),
            TokenFileError::DuplicateName {
                line: 3,
                first: 1,
                name: "a".into()
            }
        );
        let many: String = (0..=MAX_TOKENS).map(|i| format!("t{i}\n")).collect();
        assert_eq!(bad(&many), TokenFileError::TooMany);
        // No message repeats a token.
        let message = bad("a: s3cret\nb: s3cret\n").to_string();
        assert!(!message.contains("s3cret"), "{message}");
    }

    #[test]
    fn token_comparison_needs_every_byte() {
        assert!(constant_time_eq(b"Bearer abc", b"Bearer abc"));
        assert!(!constant_time_eq(b"Bearer abd", b"Bearer abc"));
        assert!(!constant_time_eq(b"Bearer ab", b"Bearer abc"));
    }
}
