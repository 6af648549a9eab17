//! Listen addresses: the socket address a server reports once grpcio has
//! bound a `HOST:PORT` listen string (port 0 gives any free port).

use std::net::{IpAddr, SocketAddr};

/// The socket address a listen string and the bound port make. The host is
/// an IP address (IPv6 in brackets) or `localhost`.
pub fn bound_address(listen: &str, port: u16) -> Result<SocketAddr, String> {
    let host = listen
        .rsplit_once(':')
        .map(|(host, _)| host)
        .ok_or_else(|| format!("{listen:?} has no port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip = if host == "localhost" {
        IpAddr::from([127, 0, 0, 1])
    } else {
        host.parse()
            .map_err(|e| format!("{host:?} is not an IP address: {e}"))?
    };
    Ok(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_ips_or_localhost() {
        assert_eq!(
            bound_address("127.0.0.1:0", 5),
            Ok("127.0.0.1:5".parse().unwrap())
        );
        assert_eq!(bound_address("[::1]:0", 6), Ok("[::1]:6".parse().unwrap()));
        assert_eq!(
            bound_address("localhost:0", 7),
            Ok("127.0.0.1:7".parse().unwrap())
        );
        assert!(bound_address("example.org:1", 1).is_err());
        assert!(bound_address("nocolon", 1).is_err());
    }
}
