//! One replica thread's connection to the session store, and the
//! statements it writes through.
//!
//! Every write names the lease it writes under (owner and epoch) in its own
//! `WHERE`, so it lands only while that lease holds: a replica whose lease
//! was taken over gets [`StoreError::Fenced`] and nothing is written. A
//! statement that fails for any other reason (the database gone, the
//! connection cut) is [`StoreError::Unavailable`]: the caller must not
//! acknowledge the change it carried, which may or may not have been
//! committed (an answer lost on the way back); the caller makes the store
//! agree with it again by its next write. The next call connects again,
//! but not within [`RETRY_CONNECT`] of a failed try, so that a database
//! out of reach costs the calls meanwhile no wait.

use std::time::Duration;

use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
use postgres::config::SslMode;
use postgres::fallible_iterator::FallibleIterator;
use postgres::types::ToSql;
use postgres::{Client, Config, NoTls};
use postgres_openssl::MakeTlsConnector;
use thiserror::Error;

use super::schema;

/// How long a lease lasts unless renewed.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// How long connecting may take unless the URL says (`connect_timeout`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Idle time before the connection's TCP keepalive probes start.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);

/// How long sent data may stay unacknowledged before the connection is
/// given up.
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// The database's own limits on this connection's statements, lock waits
/// and open transactions (ms): a statement stuck behind a row lock that a
/// cut-off replica's transaction holds fails instead of holding a worker,
/// and such a transaction is ended by the database.
const SERVER_TIMEOUTS: &str =
    "-c statement_timeout=10000 -c lock_timeout=10000 -c idle_in_transaction_session_timeout=10000";

/// After a failed connect, how long calls fail at once before the next try.
pub const RETRY_CONNECT: Duration = Duration::from_secs(1);

/// Why a store call failed.
#[derive(Debug, Error)]
pub enum StoreError {
    /// The URL is not one PostgreSQL takes.
    #[error("session store URL: {0}")]
    Url(String),
    /// The database could not be reached or did not answer: the call's
    /// change was not acknowledged (see the module's header).
    #[error("session store unavailable: {0}")]
    Unavailable(String),
    /// The database's schema is newer than this build.
    #[error("the session store's schema is version {found}; this build knows up to {known}")]
    SchemaTooNew { found: i32, known: i32 },
    /// The lease this write named no longer holds: another replica took the
    /// session over (or closed it) since.
    #[error("session {id}: its lease was taken over (epoch {epoch} no longer holds)")]
    Fenced { id: String, epoch: i64 },
    /// No session has this id.
    #[error("session {0} is not in the store")]
    NotFound(String),
    /// A session with this id exists already.
    #[error("session {0} is in the store already")]
    Exists(String),
    /// The session was made with another model file than this replica's.
    #[error("session {0} was made with another model file (its SHA-256 differs)")]
    OtherModel(String),
    /// Another replica holds the session, for about this long yet unless it
    /// renews.
    #[error("session {id} is held by replica {owner} for {left:?} more")]
    HeldElsewhere {
        id: String,
        owner: String,
        left: Duration,
    },
}

impl From<postgres::Error> for StoreError {
    fn from(e: postgres::Error) -> Self {
        StoreError::Unavailable(match e.as_db_error() {
            Some(db) => format!("{}: {}", db.code().code(), db.message()),
            None => e.to_string(),
        })
    }
}

/// A session's ownership by this replica: writes are fenced by its epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub epoch: i64,
}

/// What the store keeps of a session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionRow {
    pub label: String,
    /// Who the session belongs to (`None`: anyone's).
    pub tenant: Option<String>,
    pub eos: Vec<u32>,
    pub history: Vec<u32>,
    /// How many writes made the row (its first included).
    pub changes: i64,
}

/// A session as it is first written.
#[derive(Clone, Copy, Debug)]
pub struct NewSession<'a> {
    pub label: &'a str,
    pub eos: &'a [u32],
    pub tenant: Option<&'a str>,
    pub history: &'a [u32],
    /// A fork's source and the lease this replica holds on it: the fork is
    /// written only while that lease holds (else [`StoreError::Fenced`]
    /// for the source), so a replica that lost the source cannot fork a
    /// stale copy of it.
    pub source: Option<(&'a str, Lease)>,
}

/// A connection to the store, writing as replica `replica`.
pub struct Store {
    config: Config,
    tls: Option<MakeTlsConnector>,
    client: Option<Client>,
    replica: String,
    lease_secs: f64,
    /// Whether the connection has LISTENed for hand-off requests (it
    /// must again after connecting anew).
    listening: bool,
    /// The SHA-256 of the model file this replica serves: written with its
    /// new sessions, and sessions of another one are not taken.
    model: Option<Vec<u8>>,
    /// After a failed connect: no new try before this.
    retry_at: Option<std::time::Instant>,
}

/// The channel hand-off requests travel on (`NOTIFY`): "OWNER ID".
const HANDOFF_CHANNEL: &str = "inferd_handoff";

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("replica", &self.replica)
            .field("connected", &self.client.is_some())
            .finish()
    }
}

impl Store {
    /// Connects to `url` (`postgres://user:password@host:port/db?...`, TLS
    /// as its `sslmode` asks: `disable`, `prefer`, the default, or
    /// `require`, which encrypt without checking the server's certificate,
    /// as libpq does), brings the schema to [`schema::SCHEMA_VERSION`]
    /// (refusing a newer one) and writes as `replica`, with leases of
    /// `lease`.
    pub fn connect(url: &str, replica: &str, lease: Duration) -> Result<Store, StoreError> {
        let mut store = Store::open(url, replica, lease)?;
        schema::migrate(store.client()?)?;
        Ok(store)
    }

    /// As [`Store::connect`], for a schema another connection of this
    /// process has brought up to date: connects, and migrates nothing.
    pub fn open(url: &str, replica: &str, lease: Duration) -> Result<Store, StoreError> {
        let mut config: Config = url
            .parse()
            .map_err(|e: postgres::Error| StoreError::Url(e.to_string()))?;
        // A database that does not answer fails the call within seconds
        // instead of holding the worker that asked.
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        // A database cut off mid-statement (no reset, no answer) fails the
        // statement within seconds too, not after TCP's minutes.
        config
            .keepalives(true)
            .keepalives_idle(KEEPALIVE_IDLE)
            .keepalives_interval(Duration::from_secs(2))
            .keepalives_retries(3)
            .tcp_user_timeout(TCP_USER_TIMEOUT);
        let options = match config.get_options() {
            Some(own) => format!("{own} {SERVER_TIMEOUTS}"),
            None => SERVER_TIMEOUTS.to_owned(),
        };
        config.options(&options);
        let tls = match config.get_ssl_mode() {
            SslMode::Disable => None,
            _ => {
                let mut builder = SslConnector::builder(SslMethod::tls())
                    .map_err(|e| StoreError::Url(format!("TLS: {e}")))?;
                builder.set_verify(SslVerifyMode::NONE);
                Some(MakeTlsConnector::new(builder.build()))
            }
        };
        let mut store = Store {
            config,
            tls,
            client: None,
            replica: replica.to_owned(),
            lease_secs: lease.as_secs_f64(),
            listening: false,
            model: None,
            retry_at: None,
        };
        store.client()?;
        Ok(store)
    }

    /// The store for a replica serving the model file whose SHA-256 is
    /// `sha256`: its new sessions name it, and it takes no session made
    /// with another.
    pub fn for_model(mut self, sha256: Option<[u8; 32]>) -> Store {
        self.model = sha256.map(|h| h.to_vec());
        self
    }

    /// The replica this store writes as.
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// The connection, made again if the last one failed.
    fn client(&mut self) -> Result<&mut Client, StoreError> {
        if self.client.as_ref().is_some_and(Client::is_closed) {
            self.client = None;
        }
        if self.client.is_none() {
            let now = std::time::Instant::now();
            if let Some(left) = self.retry_at.and_then(|at| at.checked_duration_since(now)) {
                return Err(StoreError::Unavailable(format!(
                    "the database was out of reach a moment ago; next try in {left:.1?}"
                )));
            }
            let connected = match &self.tls {
                Some(tls) => self.config.connect(tls.clone()),
                None => self.config.connect(NoTls),
            };
            let client = connected.inspect_err(|_| self.retry_at = Some(now + RETRY_CONNECT))?;
            self.retry_at = None;
            self.client = Some(client);
            self.listening = false;
        }
        Ok(self.client.as_mut().expect("connected above"))
    }

    /// Runs `call` on the connection with this replica's name and lease
    /// length; a failure that leaves the connection in doubt drops it, so
    /// that the next call connects again.
    fn with<T>(
        &mut self,
        call: impl FnOnce(&mut Client, &str, f64) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.client()?;
        let Store {
            client,
            replica,
            lease_secs,
            ..
        } = self;
        let connection = client.as_mut().expect("connected above");
        let result = call(connection, replica, *lease_secs);
        if matches!(result, Err(StoreError::Unavailable(_))) {
            *client = None;
        }
        result
    }

    /// Adds a session, held by this replica (a fork only while this
    /// replica holds its source: [`NewSession::source`]).
    pub fn create(&mut self, id: &str, session: &NewSession) -> Result<Lease, StoreError> {
        let (source, source_epoch) = match session.source {
            Some((source, lease)) => (Some(source), lease.epoch),
            None => (None, 0),
        };
        let model = self.model.clone();
        self.with(|client, replica, lease| {
            let row = client.query_opt(
                "INSERT INTO inferd_sessions
                     (id, label, eos, history, changes, owner, epoch, lease_until, tenant, model)
                 SELECT $1, $2, $3, $4, 1, $5, 1, now() + $6 * interval '1 second', $7, $10
                 WHERE $8::text IS NULL OR EXISTS (
                     SELECT 1 FROM inferd_sessions WHERE id = $8 AND owner = $5 AND epoch = $9)
                 ON CONFLICT (id) DO NOTHING
                 RETURNING epoch",
                &[
                    &id,
                    &session.label,
                    &to_bytes(session.eos),
                    &to_bytes(session.history),
                    &replica,
                    &lease,
                    &session.tenant,
                    &source,
                    &source_epoch,
                    &model,
                ],
            )?;
            if let Some(row) = row {
                return Ok(Lease { epoch: row.get(0) });
            }
            let Some(source) = source else {
                return Err(StoreError::Exists(id.to_owned()));
            };
            let held = client.query_opt(
                "SELECT 1 FROM inferd_sessions WHERE id = $1 AND owner = $2 AND epoch = $3",
                &[&source, &replica, &source_epoch],
            )?;
            Err(match held {
                Some(_) => StoreError::Exists(id.to_owned()),
                None => StoreError::Fenced {
                    id: source.to_owned(),
                    epoch: source_epoch,
                },
            })
        })
    }

    /// Appends `tokens` to the session's history, under `lease`.
    pub fn append(&mut self, id: &str, lease: Lease, tokens: &[u32]) -> Result<(), StoreError> {
        self.fenced_write(
            id,
            lease,
            "UPDATE inferd_sessions
             SET history = history || $4, changes = changes + 1, updated_at = now()
             WHERE id = $1 AND owner = $2 AND epoch = $3",
            &[&to_bytes(tokens)],
        )
    }

    /// Replaces the session's history (a rewind: a truncation, a turn
    /// taken back), under `lease`.
    pub fn set_history(
        &mut self,
        id: &str,
        lease: Lease,
        history: &[u32],
    ) -> Result<(), StoreError> {
        self.fenced_write(
            id,
            lease,
            "UPDATE inferd_sessions
             SET history = $4, changes = changes + 1, updated_at = now()
             WHERE id = $1 AND owner = $2 AND epoch = $3",
            &[&to_bytes(history)],
        )
    }

    /// Runs a write whose first parameters are the id, this replica and
    /// the lease's epoch, then `more`; no row written means the lease no
    /// longer holds.
    fn fenced_write(
        &mut self,
        id: &str,
        lease: Lease,
        sql: &str,
        more: &[&(dyn ToSql + Sync)],
    ) -> Result<(), StoreError> {
        self.with(|client, replica, _| {
            let mut params: Vec<&(dyn ToSql + Sync)> = vec![&id, &replica, &lease.epoch];
            params.extend_from_slice(more);
            match client.execute(sql, &params)? {
                0 => Err(StoreError::Fenced {
                    id: id.to_owned(),
                    epoch: lease.epoch,
                }),
                _ => Ok(()),
            }
        })
    }

    /// Takes the session over for a caller of tenant `caller` (`None`:
    /// any session): when this replica owns it already, or its owner's
    /// lease ran out. The epoch moves on either way, so writes under any
    /// earlier lease are refused from now on. Returns the new lease and
    /// what the store holds. A session of another tenant is
    /// [`StoreError::NotFound`], like one that does not exist, and is left
    /// as it is.
    pub fn take(
        &mut self,
        id: &str,
        caller: Option<&str>,
    ) -> Result<(Lease, SessionRow), StoreError> {
        let model = self.model.clone();
        self.with(|client, replica, lease| {
            let taken = client.query_opt(
                "UPDATE inferd_sessions
                 SET owner = $2, epoch = epoch + 1, lease_until = now() + $3 * interval '1 second'
                 WHERE id = $1 AND (owner = $2 OR lease_until <= now())
                     AND (tenant IS NULL OR $4::text IS NULL OR tenant = $4)
                     AND (model IS NULL OR $5::bytea IS NULL OR model = $5)
                 RETURNING epoch, label, eos, history, changes, tenant",
                &[&id, &replica, &lease, &caller, &model],
            )?;
            if let Some(row) = taken {
                return Ok((Lease { epoch: row.get(0) }, session_row(&row, 1)));
            }
            let holder = client.query_opt(
                "SELECT owner, GREATEST(EXTRACT(EPOCH FROM lease_until - now()), 0)::float8,
                     model IS NOT NULL AND $3::bytea IS NOT NULL AND model <> $3
                 FROM inferd_sessions
                 WHERE id = $1 AND (tenant IS NULL OR $2::text IS NULL OR tenant = $2)",
                &[&id, &caller, &model],
            )?;
            Err(match holder {
                Some(row) if row.get::<_, bool>(2) => StoreError::OtherModel(id.to_owned()),
                Some(row) => StoreError::HeldElsewhere {
                    id: id.to_owned(),
                    owner: row.get(0),
                    left: Duration::from_secs_f64(row.get::<_, f64>(1)),
                },
                None => StoreError::NotFound(id.to_owned()),
            })
        })
    }

    /// What the store holds of a session, and its owner and epoch; taking
    /// nothing.
    pub fn load(&mut self, id: &str) -> Result<Option<(SessionRow, String, i64)>, StoreError> {
        self.with(|client, _, _| {
            let row = client.query_opt(
                "SELECT label, eos, history, changes, tenant, owner, epoch
                 FROM inferd_sessions WHERE id = $1",
                &[&id],
            )?;
            Ok(row.map(|row| (session_row(&row, 0), row.get(5), row.get(6))))
        })
    }

    /// Renews this replica's leases on `held` (`(id, epoch)`), and returns
    /// the ids among them whose lease no longer holds (taken over or closed
    /// by another replica): their KV must be dropped.
    pub fn renew(&mut self, held: &[(String, i64)]) -> Result<Vec<String>, StoreError> {
        let ids: Vec<&str> = held.iter().map(|(id, _)| id.as_str()).collect();
        let epochs: Vec<i64> = held.iter().map(|&(_, epoch)| epoch).collect();
        // One statement, no transaction: row locks never outlive it.
        self.with(|client, replica, lease| {
            let renewed: std::collections::HashSet<String> = client
                .query(
                    "UPDATE inferd_sessions AS s
                     SET lease_until = now() + $3 * interval '1 second'
                     FROM unnest($1::text[], $2::int8[]) AS h(id, epoch)
                     WHERE s.id = h.id AND s.epoch = h.epoch AND s.owner = $4
                     RETURNING s.id",
                    &[&ids, &epochs, &lease, &replica],
                )?
                .iter()
                .map(|row| row.get(0))
                .collect();
            Ok(held
                .iter()
                .filter(|(id, _)| !renewed.contains(id))
                .map(|(id, _)| id.clone())
                .collect())
        })
    }

    /// Gives the session up but keeps its row (a drain, a spill): another
    /// replica may take it at once.
    pub fn release(&mut self, id: &str, lease: Lease) -> Result<(), StoreError> {
        self.fenced_write(
            id,
            lease,
            "UPDATE inferd_sessions SET lease_until = now()
             WHERE id = $1 AND owner = $2 AND epoch = $3",
            &[],
        )
    }

    /// Deletes the sessions no replica holds that have not changed for
    /// `idle` (their owner died or let them go, and nobody called them
    /// since): the idle TTL of sessions that outlived their replica.
    /// Returns how many went.
    pub fn sweep_idle(&mut self, idle: Duration) -> Result<u64, StoreError> {
        self.with(|client, _, _| {
            Ok(client.execute(
                "DELETE FROM inferd_sessions
                 WHERE lease_until <= now() AND updated_at <= now() - $1 * interval '1 second'",
                &[&idle.as_secs_f64()],
            )?)
        })
    }

    /// Asks replica `owner` to let session `id` go as soon as nothing runs
    /// on it (a call for it reached this replica instead): a notification
    /// its [`Store::handoff_requests`] hears.
    pub fn ask_handoff(&mut self, id: &str, owner: &str) -> Result<(), StoreError> {
        self.with(|client, _, _| {
            client.execute(
                "SELECT pg_notify($1, $2)",
                &[&HANDOFF_CHANNEL, &format!("{owner} {id}")],
            )?;
            Ok(())
        })
    }

    /// Waits up to `wait` for requests to let sessions go addressed to this
    /// replica, and returns their ids (none when `wait` passed). For a
    /// store of its own: the connection listens from the first call on.
    pub fn handoff_requests(&mut self, wait: Duration) -> Result<Vec<String>, StoreError> {
        self.client()?;
        let listen = !self.listening;
        let asked = self.with(|client, replica, _| {
            if listen {
                client.batch_execute(&format!("LISTEN {HANDOFF_CHANNEL}"))?;
            }
            let mine = |payload: &str| {
                payload
                    .split_once(' ')
                    .filter(|(owner, _)| *owner == replica)
                    .map(|(_, id)| id.to_owned())
            };
            let mut notifications = client.notifications();
            let first = notifications.timeout_iter(wait).next()?;
            let mut asked: Vec<String> = first.iter().filter_map(|n| mine(n.payload())).collect();
            let mut pending = notifications.iter();
            while let Some(n) = pending.next()? {
                asked.extend(mine(n.payload()));
            }
            Ok(asked)
        })?;
        self.listening = true;
        Ok(asked)
    }

    /// Deletes the session, under `lease`.
    pub fn close(&mut self, id: &str, lease: Lease) -> Result<(), StoreError> {
        self.fenced_write(
            id,
            lease,
            "DELETE FROM inferd_sessions WHERE id = $1 AND owner = $2 AND epoch = $3",
            &[],
        )
    }
}

/// A session's row from a result row holding label, eos, history,
/// changes and tenant from column `at` on.
fn session_row(row: &postgres::Row, at: usize) -> SessionRow {
    SessionRow {
        label: row.get(at),
        eos: from_bytes(row.get(at + 1)),
        history: from_bytes(row.get(at + 2)),
        changes: row.get(at + 3),
        tenant: row.get(at + 4),
    }
}

/// Token ids as the store keeps them: 4 bytes each, little-endian.
fn to_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// The token ids of [`to_bytes`]' bytes (a torn last id is dropped: the
/// store writes whole ones only).
fn from_bytes(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_round_trip_through_their_bytes() {
        let ids = [0, 1, 49151, u32::MAX];
        assert_eq!(from_bytes(&to_bytes(&ids)), ids);
        assert!(from_bytes(&[]).is_empty());
    }

    #[test]
    fn bad_urls_are_refused_before_connecting() {
        let e = Store::connect("postgres://host:notaport/db", "r", DEFAULT_LEASE).unwrap_err();
        assert!(matches!(e, StoreError::Url(_)), "{e}");
    }
}
