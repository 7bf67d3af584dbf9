//! How committed outbox rows are found and claimed.
//!
//! - [`listener`] turns NOTIFYs into wake-ups; polling covers anything it misses.
//! - [`claim`] holds the SQL that claims a batch and settles it afterwards.
//! - [`ownership`] shares the 64 virtual partitions between replicas.
//! - [`database`] holds the connection settings and the TLS policy.
//! - [`retention`] clears published rows past `--retention`.

pub mod claim;
pub mod database;
pub mod listener;
pub mod ownership;
pub mod retention;

use std::time::Duration;

use tokio_postgres::Client;

pub use database::Database;

/// Opens a connection for the relay's own use and drives it in the background.
///
/// `synchronous_commit = off`: the relay's transactions only delete or annotate
/// rows the broker already answered for. If a crash loses such a commit, the
/// rows come back and are published again: a duplicate, never a loss. Waiting
/// for the WAL flush on every batch would buy nothing.
///
/// `idle_in_transaction_session_timeout` bounds how long a relay that stopped
/// mid-batch (paused, partitioned away) can keep its claimed rows locked: the
/// server ends the session, releases the rows, and the relay's own late delete
/// fails with it, so it can never settle rows someone else has since claimed.
///
/// Every other step of a batch fits in the same bound: `statement_timeout`
/// (half the hold limit) stops a claim or settle that hangs on the server,
/// and TCP keepalives with `tcp_user_timeout` (also half) end a connection
/// whose peer vanished, which the kernel would otherwise keep for two hours.
pub async fn connect(db: &Database, hold_limit: Duration) -> Result<Client, tokio_postgres::Error> {
    let half = hold_limit / 2;
    let client = db.with_dead_peer_bound(half).connect_spawned().await?;
    client
        .batch_execute(&format!(
            "SET application_name = 'outbox-relay'; \
             SET synchronous_commit = off; \
             SET idle_in_transaction_session_timeout = {}; \
             SET statement_timeout = {}",
            hold_limit.as_millis().max(1),
            half.as_millis().max(1)
        ))
        .await?;
    Ok(client)
}
