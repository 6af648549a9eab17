//! Sessions shared by replicas through PostgreSQL.
//!
//! Several `inferd serve` replicas behind a proxy keep every session's
//! history in one PostgreSQL database. The history is the truth (CONTRACT
//! §2.2: a session's KV is a function of it), so a replica that is asked
//! for a session it does not hold can take it over from the store and
//! rebuild its KV bit for bit. One replica at a time owns a session: a
//! lease row names the owner and a fencing epoch, every write checks the
//! epoch in its own statement, and taking a session over bumps it, so a
//! replica that lost its lease (paused, partitioned, presumed dead) can
//! never write again. [`schema`] makes and upgrades the tables; [`store`]
//! is the one connection a thread writes through.

mod schema;
mod store;

pub use schema::SCHEMA_VERSION;
pub use store::{Lease, NewSession, SessionRow, Store, StoreError, DEFAULT_LEASE, RETRY_CONNECT};
