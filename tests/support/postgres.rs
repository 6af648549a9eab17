//! A PostgreSQL server of a test's own: a new cluster in a temporary
//! directory (`initdb`), listening on a free loopback port and on a socket
//! in that directory, run as an unprivileged user (PostgreSQL refuses root:
//! run as root, the tests use the `postgres` user of Debian's package),
//! stopped and removed when dropped. Every wait is bounded.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running server; `url` reaches it as the `inferd` superuser.
pub struct Postgres {
    pub url: String,
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    user: Option<(u32, u32)>,
    child: Option<Child>,
}

/// Whether the tests must have PostgreSQL (`scripts/test` installs it and
/// says so); otherwise a machine without it skips them, loudly.
pub fn required() -> bool {
    std::env::var_os("INFERD_REQUIRE_POSTGRES").is_some_and(|v| v == "1")
}

/// The newest installed server's binaries (Debian keeps them per version).
fn binaries() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|bin| bin.join("initdb").is_file() && bin.join("postgres").is_file())
        .collect();
    found.sort_by_key(|p| {
        p.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    found.pop()
}

/// The uid and gid to run the server as when this process is root.
fn server_user() -> Option<(u32, u32)> {
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").args([flag, "postgres"]).output().ok()?;
        String::from_utf8(out.stdout).ok()?.trim().parse().ok()
    };
    let root = Command::new("id")
        .arg("-u")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .is_some_and(|s| s.trim() == "0");
    if root {
        Some((id("-u")?, id("-g")?))
    } else {
        None
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

impl Postgres {
    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A new server, or `None` (said on stderr) where PostgreSQL is not
    /// installed and the tests do not require it.
    pub fn start() -> Option<Postgres> {
        let Some(bin) = binaries() else {
            assert!(!required(), "PostgreSQL is required but not installed");
            eprintln!("skipped: no PostgreSQL server installed (scripts/setup installs it)");
            return None;
        };
        let user = server_user();
        let dir =
            std::env::temp_dir().join(format!("inferd-pg-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).expect("data directory");
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown data directory");
        }
        let status = as_user(Command::new(bin.join("initdb")), user)
            .args(["-D", &path_str(&dir.join("data")), "-U", "inferd"])
            .args(["--auth=trust", "-E", "UTF8", "--no-sync"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .expect("runs initdb");
        assert!(
            status.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&status.stderr)
        );
        let port = free_port();
        let mut pg = Postgres {
            url: format!("postgres://inferd@127.0.0.1:{port}/postgres?sslmode=disable"),
            bin,
            dir,
            port,
            user,
            child: None,
        };
        pg.start_again();
        Some(pg)
    }

    /// Starts the server on its directory and port again (after
    /// [`Postgres::stop`]); returns once it accepts connections.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "already running");
        let log = std::fs::File::create(self.dir.join("server.log")).expect("log");
        let child = as_user(Command::new(self.bin.join("postgres")), self.user)
            .args(["-D", &path_str(&self.dir.join("data"))])
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args([
                "-c",
                &format!("unix_socket_directories={}", path_str(&self.dir)),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starts postgres");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if postgres::Client::connect(&self.url, postgres::NoTls).is_ok() {
                return;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("postgres exited ({status}): {}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "postgres did not start: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops the server (a fast shutdown: open connections are cut).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait().ok().flatten().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// A client of the server, as its superuser.
    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.url, postgres::NoTls).expect("connects")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn as_user(mut command: Command, user: Option<(u32, u32)>) -> Command {
    if let Some((uid, gid)) = user {
        command.uid(uid).gid(gid);
    }
    command
}

fn path_str(p: &Path) -> String {
    p.to_str().expect("a UTF-8 temporary path").to_owned()
}
