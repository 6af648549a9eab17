//! A TCP relay in front of a test's PostgreSQL that can cut a connection
//! just after it forwarded a chosen statement, before the answer comes
//! back: a write the database committed whose acknowledgement never
//! reaches the replica (the ambiguous failure every client of a remote
//! database must survive).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::postgres::Postgres;

/// The relay; connections made through it live as long as their ends.
pub struct Cutter {
    port: u16,
    armed: Arc<Mutex<Option<Vec<u8>>>>,
    cuts: Arc<AtomicUsize>,
}

impl Cutter {
    /// Starts relaying a free loopback port to `pg`.
    pub fn start(pg: &Postgres) -> Cutter {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("address").port();
        let upstream = pg.port();
        let armed: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
        let cuts = Arc::new(AtomicUsize::new(0));
        let (a, c) = (Arc::clone(&armed), Arc::clone(&cuts));
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                relay(client, server, Arc::clone(&a), Arc::clone(&c));
            }
        });
        Cutter { port, armed, cuts }
    }

    /// `pg`'s URL, through the relay.
    pub fn url(&self, pg: &Postgres) -> String {
        pg.url
            .replace(&format!(":{}/", pg.port()), &format!(":{}/", self.port))
    }

    /// Cuts the next connection that sends bytes containing `pattern`
    /// (a statement's text, which goes with its preparation), once: that
    /// and its answer pass, and the connection is cut after forwarding
    /// what it sends next (the statement's execution), whose answer is
    /// dropped.
    pub fn arm(&self, pattern: &str) {
        *self.armed.lock().expect("lock") = Some(pattern.as_bytes().to_vec());
    }

    /// How many connections were cut.
    pub fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }
}

fn relay(
    client: TcpStream,
    server: TcpStream,
    armed: Arc<Mutex<Option<Vec<u8>>>>,
    cuts: Arc<AtomicUsize>,
) {
    let cut = Arc::new(AtomicBool::new(false));
    let (mut from_client, mut to_server) = (
        client.try_clone().expect("clone"),
        server.try_clone().expect("clone"),
    );
    let forward_cut = Arc::clone(&cut);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        let mut prepared = false;
        while let Ok(n) = from_client.read(&mut buf) {
            if n == 0 {
                break;
            }
            let chunk = &buf[..n];
            if prepared {
                // No answer passes from here on: the execution goes to the
                // database, which commits it, and the connection dies.
                forward_cut.store(true, Ordering::SeqCst);
                cuts.fetch_add(1, Ordering::SeqCst);
                let _ = to_server.write_all(chunk);
                std::thread::sleep(Duration::from_millis(300));
                let _ = to_server.shutdown(Shutdown::Both);
                let _ = from_client.shutdown(Shutdown::Both);
                break;
            }
            let mut armed = armed.lock().expect("lock");
            if armed
                .as_ref()
                .is_some_and(|p| chunk.windows(p.len()).any(|w| w == p.as_slice()))
            {
                *armed = None;
                prepared = true;
            }
            drop(armed);
            if to_server.write_all(chunk).is_err() {
                break;
            }
        }
        let _ = to_server.shutdown(Shutdown::Both);
    });
    let (mut from_server, mut to_client) = (server, client);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = from_server.read(&mut buf) {
            if n == 0 || cut.load(Ordering::SeqCst) {
                break;
            }
            if to_client.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to_client.shutdown(Shutdown::Both);
    });
}
