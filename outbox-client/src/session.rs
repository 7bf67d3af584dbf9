//! Whether a connection is a session of its own, or a slot in a
//! transaction- or statement-mode pooler (PgBouncer, RDS Proxy, Supavisor).
//!
//! Everything that runs inside the caller's transaction works through such a
//! pooler: [`crate::Outbox::enqueue`], [`crate::Outbox::enqueue_batch`] and
//! the consumer-side helpers that take a transaction. What holds state
//! between transactions does not: the relay (row locks across its batch,
//! session advisory locks, LISTEN) and [`crate::job_lock`] (a session
//! advisory lock). Those call [`keeps_session`] first and refuse a pooler
//! with a clear error. [`crate::migrate`] runs in one transaction, and works
//! through one.

use tokio_postgres::Client;

/// Probes two connections made the same way: `first` sets a session
/// variable; `second`, inside a transaction, reads it while `first` reads
/// it and its backend pid again. On real sessions (direct, or a session-mode
/// pool) `second` never sees `first`'s variable and `first` keeps both. A
/// pooler that hands server connections to whichever client asks next shows
/// one or the other: PgBouncer gives the most recently used server
/// connection to the next client, so `second` usually gets `first`'s.
///
/// Another client of the same pool can take `first`'s server connection
/// between two of these statements and hide the pooler from one probe, so
/// the probe runs [`PROBES`] times and any one that shows a pooler decides.
/// A real session passes every one.
pub async fn keeps_session(
    first: &Client,
    second: &mut Client,
) -> Result<bool, tokio_postgres::Error> {
    for _ in 0..PROBES {
        if !probe_once(first, second).await? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// How many times [`keeps_session`] probes.
pub const PROBES: usize = 5;

async fn probe_once(first: &Client, second: &mut Client) -> Result<bool, tokio_postgres::Error> {
    let token = uuid::Uuid::new_v4().to_string();
    let before: i32 = first
        .query_typed_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    first
        .query_typed(
            "SELECT set_config('outbox.session_probe', $1, false)",
            &[(
                &token as &(dyn tokio_postgres::types::ToSql + Sync),
                tokio_postgres::types::Type::TEXT,
            )],
        )
        .await?;
    let probe = "SELECT pg_backend_pid(), current_setting('outbox.session_probe', true)";
    let tx = match second.transaction().await {
        Ok(tx) => tx,
        // PgBouncer in statement mode refuses transactions outright.
        Err(e) if is_pooler_refusal(&e) => return Ok(false),
        Err(e) => return Err(e),
    };
    let row = tx.query_typed_one(probe, &[]).await?;
    let (other_pid, other_saw): (i32, Option<String>) = (row.get(0), row.get(1));
    let row = first.query_typed_one(probe, &[]).await?;
    let (after, kept): (i32, Option<String>) = (row.get(0), row.get(1));
    tx.commit().await?;
    Ok(after == before
        && kept.as_deref() == Some(token.as_str())
        && other_pid != before
        && other_saw.as_deref() != Some(token.as_str()))
}

/// A pooler's refusal of something only a session can do ("transaction
/// blocks not allowed in statement pooling mode").
fn is_pooler_refusal(e: &tokio_postgres::Error) -> bool {
    e.as_db_error()
        .is_some_and(|db| db.message().contains("pooling mode"))
}
