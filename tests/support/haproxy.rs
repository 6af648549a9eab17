//! HAProxy in front of a test's replicas, run from the shipped
//! `deploy/replicas/haproxy.cfg` with the addresses in its environment,
//! killed when dropped. Every wait is bounded.

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const CONFIG: &str = "deploy/replicas/haproxy.cfg";

/// The HAProxy binary: on PATH, or where Debian puts it (/usr/sbin, which
/// a user's PATH may lack).
pub fn binary() -> &'static str {
    if Command::new("haproxy").arg("-v").output().is_ok() {
        "haproxy"
    } else {
        "/usr/sbin/haproxy"
    }
}

/// Whether HAProxy is installed; where the tests require PostgreSQL
/// (`scripts/test`, whose setup installs both) a missing one fails them.
pub fn installed() -> bool {
    let found = Command::new(binary())
        .arg("-v")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            !super::postgres::required(),
            "HAProxy is required but not installed (scripts/setup installs it)"
        );
        eprintln!("skipped: HAProxy is not installed (scripts/setup installs it)");
    }
    found
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The environment the shipped configuration reads: the proxy's two
/// listeners on free loopback ports and the replicas' (gRPC, HTTP)
/// addresses.
pub fn environment(replicas: &[(String, String)]) -> Vec<(String, String)> {
    assert_eq!(replicas.len(), 3, "the configuration names three replicas");
    let mut env = vec![
        (
            "INFERD_PROXY_GRPC".to_owned(),
            format!("127.0.0.1:{}", free_port()),
        ),
        (
            "INFERD_PROXY_HTTP".to_owned(),
            format!("127.0.0.1:{}", free_port()),
        ),
    ];
    for (n, (grpc, http)) in replicas.iter().enumerate() {
        env.push((format!("INFERD_REPLICA_{}_GRPC", n + 1), grpc.clone()));
        env.push((format!("INFERD_REPLICA_{}_HTTP", n + 1), http.clone()));
    }
    env
}

/// A running HAProxy.
pub struct HaProxy {
    child: Child,
    /// Where gRPC clients connect.
    pub grpc: String,
    /// Where HTTP (OpenAI API) clients connect.
    pub http: String,
}

impl HaProxy {
    /// Starts HAProxy on the shipped configuration in front of `replicas`
    /// and waits until it accepts connections.
    pub fn start(replicas: &[(String, String)]) -> HaProxy {
        let env = environment(replicas);
        let child = Command::new(binary())
            .args(["-f", CONFIG, "-db"])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start haproxy");
        let (grpc, http) = (env[0].1.clone(), env[1].1.clone());
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(&grpc).is_err() {
            assert!(
                Instant::now() < deadline,
                "haproxy never listened on {grpc}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        HaProxy { child, grpc, http }
    }
}

impl Drop for HaProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
