//! The store's tables, made and upgraded by numbered migrations that every
//! replica applies at start, one replica at a time (an advisory lock held
//! for the transaction). A database whose schema is newer than this build
//! knows is refused: an older replica must not write rows it cannot read.

use postgres::Client;

use super::store::StoreError;

/// The newest schema this build reads and writes.
pub const SCHEMA_VERSION: i32 = 3;

/// The advisory lock the migrations take (an arbitrary constant: "inferd").
const MIGRATION_LOCK: i64 = 0x696e_6665_7264;

/// Migration `n` brings a database at version `n - 1` to `n`.
const MIGRATIONS: [(i32, &str); 3] = [
    (
        1,
        "CREATE TABLE inferd_sessions (
         id text PRIMARY KEY,
         label text NOT NULL,
         eos bytea NOT NULL,
         history bytea NOT NULL,
         changes bigint NOT NULL,
         owner text NOT NULL,
         epoch bigint NOT NULL,
         lease_until timestamptz NOT NULL,
         created_at timestamptz NOT NULL DEFAULT now(),
         updated_at timestamptz NOT NULL DEFAULT now()
     );
     CREATE INDEX inferd_sessions_owner ON inferd_sessions (owner);",
    ),
    // Who a session belongs to (NULL: anyone's), so that a session that
    // moves keeps its owner; and what the idle-session sweep looks at.
    (
        2,
        "ALTER TABLE inferd_sessions ADD COLUMN tenant text;
         CREATE INDEX inferd_sessions_idle ON inferd_sessions (updated_at);",
    ),
    // The SHA-256 of the model file a session was made with (NULL: rows
    // from before), so that replicas of another model (a rolling upgrade
    // on one store) do not continue it with other bits.
    (3, "ALTER TABLE inferd_sessions ADD COLUMN model bytea;"),
];

/// Brings the database to [`SCHEMA_VERSION`], or refuses one that is newer.
pub(crate) fn migrate(client: &mut Client) -> Result<(), StoreError> {
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS inferd_schema (
             version integer PRIMARY KEY,
             applied_at timestamptz NOT NULL DEFAULT now()
         )",
    )?;
    let found: i32 = tx
        .query_one("SELECT COALESCE(MAX(version), 0) FROM inferd_schema", &[])?
        .get(0);
    if found > SCHEMA_VERSION {
        return Err(StoreError::SchemaTooNew {
            found,
            known: SCHEMA_VERSION,
        });
    }
    for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > found) {
        tx.batch_execute(sql)?;
        tx.execute(
            "INSERT INTO inferd_schema (version) VALUES ($1)",
            &[version],
        )?;
    }
    tx.commit()?;
    Ok(())
}
