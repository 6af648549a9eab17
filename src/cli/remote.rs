//! What the client commands need to reach an `inferd serve`: the connection
//! flags, the typed error a failed call becomes, and the small parsers and
//! formatters shared by `inferd session`, `generate --server` and
//! `chat --server`. The gRPC calls themselves live in `client.rs`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use thiserror::Error;

/// Where a client command connects when neither `--server` nor
/// `$INFERD_SERVER` says otherwise.
pub const DEFAULT_SERVER: &str = "127.0.0.1:50051";

/// How to reach an inferd server.
#[derive(Debug, Args, Clone, Default)]
pub struct ConnectArgs {
    /// Server address HOST:PORT [default: $INFERD_SERVER, else 127.0.0.1:50051].
    #[arg(long, value_name = "ADDR")]
    pub server: Option<String>,
    /// File holding the bearer token sent on every call [default: $INFERD_AUTH_TOKEN_FILE].
    #[arg(long, value_name = "PATH")]
    pub auth_token_file: Option<PathBuf>,
    /// PEM root certificate to trust; switches the connection to TLS.
    #[arg(long, value_name = "PATH")]
    pub tls_ca: Option<PathBuf>,
    /// Name to check the server's certificate against, instead of the host in --server.
    #[arg(long, value_name = "NAME", requires = "tls_ca")]
    pub tls_server_name: Option<String>,
    /// Deadline for each call, in seconds (a Generate stream as a whole) [default: none].
    #[arg(long, value_name = "SECS", value_parser = parse_timeout)]
    pub timeout: Option<Duration>,
}

impl ConnectArgs {
    /// The address to dial: the flag, else `$INFERD_SERVER`, else the default.
    pub fn address(&self) -> String {
        self.server
            .clone()
            .or_else(|| {
                std::env::var("INFERD_SERVER")
                    .ok()
                    .filter(|s| !s.is_empty())
            })
            .unwrap_or_else(|| DEFAULT_SERVER.to_owned())
    }

    /// The token file: the flag, else `$INFERD_AUTH_TOKEN_FILE`.
    pub fn token_file(&self) -> Option<PathBuf> {
        self.auth_token_file.clone().or_else(|| {
            std::env::var_os("INFERD_AUTH_TOKEN_FILE")
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
        })
    }

    /// The flags that only mean something with `--server`, for commands
    /// that run locally without it (`generate`, `chat`).
    pub fn remote_only_flag_given(&self) -> Option<&'static str> {
        if self.auth_token_file.is_some() {
            Some("--auth-token-file")
        } else if self.tls_ca.is_some() {
            Some("--tls-ca")
        } else if self.timeout.is_some() {
            Some("--timeout")
        } else {
            None
        }
    }
}

fn parse_timeout(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of seconds"))?;
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!(
            "the timeout must be a positive number of seconds, not {s}"
        ));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| format!("timeout {s}: {e}"))
}

/// Why a call to the server failed.
#[derive(Debug, Error)]
pub enum RemoteError {
    /// The server (or the transport on its behalf) answered with a non-OK
    /// gRPC status.
    #[error("{server} answered {code} (status {number}): {message}")]
    Status {
        server: String,
        /// The status name, e.g. `NOT_FOUND`.
        code: &'static str,
        /// The numeric gRPC status code.
        number: i32,
        message: String,
    },
    /// The gRPC library failed before any status came back.
    #[error("call to {server} failed: {detail}")]
    Transport { server: String, detail: String },
    /// A Generate stream ended without its terminal `done` message.
    #[error("{server} ended the Generate stream after {tokens} tokens without a done message")]
    StreamWithoutDone { server: String, tokens: u64 },
    /// The bearer token file could not be read.
    #[error("auth token file {path}: {source}")]
    TokenFile {
        path: String,
        source: std::io::Error,
    },
    /// The bearer token file holds no token, or one that cannot be sent as
    /// gRPC metadata.
    #[error("auth token file {path}: {reason}")]
    BadToken { path: String, reason: String },
    /// The TLS root certificate could not be read.
    #[error("TLS root certificate {path}: {source}")]
    TlsCa {
        path: String,
        source: std::io::Error,
    },
}

/// The canonical name of a gRPC status code (`NOT_FOUND` for 5).
pub fn status_name(code: i32) -> &'static str {
    crate::server::code_name(code)
}

/// Parses token ids separated by whitespace and/or commas, as scripts pipe
/// them in (`1 2 3`, `1,2,3`, one per line). Names the first bad entry.
pub fn parse_token_list(text: &str) -> Result<Vec<u32>, String> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>().map_err(|_| {
                format!("'{s}' is not a token id (expected an integer 0..=4294967295)")
            })
        })
        .collect()
}

/// Quotes `s` as a JSON string (as Python's `json.dumps` does, non-ASCII
/// kept as it is).
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    crate::chat_template::json_string(&mut out, s, false);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists_split_on_commas_and_whitespace() {
        assert_eq!(parse_token_list("1 2,3\n4,, 5\t"), Ok(vec![1, 2, 3, 4, 5]));
        assert_eq!(parse_token_list("  \n"), Ok(vec![]));
        let err = parse_token_list("1 x 3").unwrap_err();
        assert!(err.contains("'x'"), "{err}");
        assert!(parse_token_list("-1").is_err());
        assert!(parse_token_list("4294967296").is_err());
    }

    #[test]
    fn status_names_follow_the_grpc_table() {
        assert_eq!(status_name(5), "NOT_FOUND");
        assert_eq!(status_name(16), "UNAUTHENTICATED");
        assert_eq!(status_name(3), "INVALID_ARGUMENT");
        assert_eq!(status_name(99), "UNRECOGNISED_STATUS");
    }

    #[test]
    fn a_status_error_names_the_code_and_carries_the_message() {
        let e = RemoteError::Status {
            server: "127.0.0.1:9".into(),
            code: status_name(5),
            number: 5,
            message: "no such session".into(),
        };
        assert_eq!(
            e.to_string(),
            "127.0.0.1:9 answered NOT_FOUND (status 5): no such session"
        );
    }

    #[test]
    fn json_strings_escape_quotes_and_controls() {
        assert_eq!(json_string("a\"b\\c\nd\u{1}"), "\"a\\\"b\\\\c\\nd\\u0001\"");
        assert_eq!(json_string("été"), "\"été\"");
    }

    #[test]
    fn timeouts_must_be_positive_seconds() {
        assert_eq!(parse_timeout("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_timeout("0").is_err());
        assert!(parse_timeout("-3").is_err());
        assert!(parse_timeout("nan").is_err());
        assert!(parse_timeout("soon").is_err());
    }

    #[test]
    fn the_server_flag_wins_over_the_default() {
        let args = ConnectArgs {
            server: Some("10.0.0.1:7".into()),
            ..ConnectArgs::default()
        };
        assert_eq!(args.address(), "10.0.0.1:7");
        assert_eq!(args.remote_only_flag_given(), None);
        let args = ConnectArgs {
            timeout: Some(Duration::from_secs(1)),
            ..ConnectArgs::default()
        };
        assert_eq!(args.remote_only_flag_given(), Some("--timeout"));
    }
}
