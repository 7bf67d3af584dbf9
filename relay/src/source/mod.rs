//! How committed outbox rows are found and claimed.
//!
//! - [`listener`] turns NOTIFYs into wake-ups; polling covers anything it misses.
//! - [`claim`] holds the SQL that claims a batch and settles it afterwards.
//! - [`ownership`] shares the 64 virtual partitions between replicas.
//! - [`database`] holds the connection settings and the TLS policy.
//! - [`retention`] clears published rows past `--retention`.
//! - [`floor`] keeps the claim from walking rows deleted under an old snapshot.
//! - [`durable`] holds each claimed batch back until its rows' commits are durable.
//! - `store` is the boundary the relay loop sees: sessions, batch
//!   transactions, claim and settle; Postgres behind it, or memory in tests.

pub mod claim;
pub mod database;
pub mod durable;
pub mod floor;
pub mod inspect;
pub mod listener;
#[cfg(test)]
pub(crate) mod memory;
pub mod ownership;
pub mod retention;
pub(crate) mod store;

use std::time::Duration;

pub use database::{Database, Session};

/// Why a session of the relay's failed: an error, or no answer at all.
#[derive(Debug, thiserror::Error)]
pub enum PgFault {
    /// The connection, or the server, failed.
    #[error("{}", PgError(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// Nothing came back within the bound; the connection is given up.
    #[error(
        "postgres sent no answer within {0:?}; connection given up (a proxy or load \
         balancer in front of postgres can keep a connection open and silent after \
         losing its backend)"
    )]
    Unanswered(Duration),
    /// A round trip on another session to the same database, sent after
    /// this session was opened, went unanswered: this one is given up with
    /// it (see [`Session::answered`]).
    #[error(
        "given up: a round trip on another session to the same postgres went unanswered, \
         and this session, opened before it was sent, is presumed stranded with it"
    )]
    GivenUpWithOthers,
}

impl PgFault {
    /// The session was given up: it got no answer, or was given up with one
    /// that got none. Its socket is closed, and a transaction on it dangles
    /// until the server notices; the next round trip needs a new session.
    pub fn gave_up(&self) -> bool {
        matches!(self, PgFault::Unanswered(_) | PgFault::GivenUpWithOthers)
    }
}

/// `round_trip` (connecting, say), or [`PgFault::Unanswered`] when it has
/// not come back within `bound`. Statements on an open session use
/// [`Session::answered`], which asks the server before giving up.
///
/// `tcp_user_timeout` and keepalives notice a peer that vanished, but not
/// one whose kernel still answers: a proxy or load balancer (HAProxy in
/// front of a Patroni cluster, PgBouncer, a cloud proxy) whose backend
/// died can keep the relay's connection open, acknowledging every byte and
/// answering nothing, until its own timeouts end it, often half an hour
/// later.
pub async fn answered<T>(
    bound: Duration,
    round_trip: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, PgFault> {
    match tokio::time::timeout(bound, round_trip).await {
        Ok(done) => Ok(done?),
        Err(_) => Err(PgFault::Unanswered(bound)),
    }
}

/// What a "read-only transaction" error means for the relay, whose every
/// session writes (claims, settles, its replica lease).
const READ_ONLY: &str = "the server takes no writes: it is a standby (after a failover, \
     the old primary), or default_transaction_read_only is on for the relay's role or \
     database; point --database-url at the primary (with several hosts in it, add \
     target_session_attrs=read-write)";

/// A Postgres error with what the server said: tokio-postgres shows only
/// "db error" for an error the server reported, and keeps the server's
/// severity, message, detail and hint in its source. One line, for logs.
pub struct PgError<'a>(pub &'a tokio_postgres::Error);

impl std::fmt::Display for PgError<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let e = self.0;
        match e.as_db_error() {
            Some(db) => {
                write!(
                    f,
                    "{}: {} ({})",
                    db.severity(),
                    db.message(),
                    db.code().code()
                )?;
                if let Some(detail) = db.detail() {
                    write!(f, "; detail: {}", detail.replace('\n', " "))?;
                }
                if let Some(hint) = db.hint() {
                    write!(f, "; hint: {}", hint.replace('\n', " "))?;
                }
                if *db.code() == tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION {
                    write!(f, "; {READ_ONLY}")?;
                }
                Ok(())
            }
            None => {
                write!(f, "{e}")?;
                let mut source = std::error::Error::source(e);
                while let Some(s) = source {
                    write!(f, ": {s}")?;
                    source = s.source();
                }
                Ok(())
            }
        }
    }
}

/// Whether a failed connection attempt is worth repeating: no answer or a
/// refused connection (the server is down or restarting), "the database
/// system is starting up", or "too many connections". Anything else the
/// server says (a wrong password, an unknown user or database, a refused
/// host) repeats identically until someone changes the configuration.
pub fn worth_waiting_for(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    match e.code() {
        None => true,
        Some(code) => {
            *code == SqlState::CANNOT_CONNECT_NOW || *code == SqlState::TOO_MANY_CONNECTIONS
        }
    }
}

/// Waits up to `wait` for Postgres at `db` to accept a connection, saying so
/// once. Only errors that a server coming up gives are waited out (no
/// answer, connection refused, "the database system is starting up"); any
/// other (authentication, an unknown database) is returned at once.
pub async fn wait_for_postgres(db: &Database, wait: Duration) -> Result<(), tokio_postgres::Error> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut backoff =
        crate::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(2));
    let mut said = false;
    loop {
        match db.connect_spawned().await {
            Ok(_) => return Ok(()),
            Err(e) => {
                let starting = worth_waiting_for(&e);
                if !starting || tokio::time::Instant::now() >= deadline {
                    return Err(e);
                }
                if !said {
                    tracing::warn!(error = %PgError(&e), ?wait, "waiting for postgres");
                    said = true;
                }
                tokio::time::sleep(
                    backoff
                        .next_delay()
                        .min(deadline - tokio::time::Instant::now()),
                )
                .await;
            }
        }
    }
}

/// Opens a connection for the relay's own use and drives it in the background.
///
/// `synchronous_commit` is left as the server or role sets it (`on` unless
/// changed), so a settle's commit returns once it is on disk. The relay's
/// transactions only delete or annotate rows the broker already answered
/// for, so a commit a crash of the server loses brings its rows back to be
/// published again, never loses them; but with `off`, every settle of the
/// last WAL-writer window (up to three `wal_writer_delay`s, and with no
/// bound on the count: a whole drain at full speed) comes back, where the
/// README promises at most the batches in flight. Waiting costs each batch
/// one flush, which Postgres shares among commits arriving together.
///
/// `idle_in_transaction_session_timeout` bounds how long a relay that stopped
/// mid-batch (paused, partitioned away) can keep its claimed rows locked: the
/// server ends the session, releases the rows, and the relay's own late delete
/// fails with it, so it can never settle rows someone else has since claimed.
///
/// `plan_cache_mode = force_generic_plan`: the claim is prepared once per
/// connection and its plan does not depend on the parameter values (batch
/// size, partitions, byte limit); planning it afresh for every batch, as
/// Postgres does for the first executions and whenever a custom plan looks
/// cheaper, cost most of a millisecond per claim.
///
/// `jit = off`: Postgres JIT-compiles any statement whose estimated cost
/// passes `jit_above_cost`, and the claim's generic plan passes the default
/// once the outbox holds about a million rows. Compiling then took about
/// 42 ms of a 49 ms claim, every claim, and halved the drain of a large
/// backlog. No statement of the relay reads enough for the compile to pay.
///
/// Every other step of a batch fits in the same bound: `statement_timeout`
/// (half the hold limit) stops a claim or settle that hangs on the server,
/// and TCP keepalives with `tcp_user_timeout` (also half) end a connection
/// whose peer vanished, which the kernel would otherwise keep for two hours.
///
/// Those bounds hold on the server. A connection that reaches no server,
/// and still gets every byte acknowledged (see [`answered`]), is bounded
/// here: connecting and setting up within half the hold limit. Statements
/// then wait for their answer for as long as the server is running them
/// ([`Session::answered`]).
pub async fn connect(db: &Database, hold_limit: Duration) -> Result<Session, PgFault> {
    let half = hold_limit / 2;
    let setup = async {
        let session = db.with_dead_peer_bound(half).connect_session().await?;
        session
            .batch_execute(&format!(
                "SET application_name = 'outbox-relay'; \
                 SET idle_in_transaction_session_timeout = {}; \
                 SET statement_timeout = {}; \
                 SET plan_cache_mode = force_generic_plan; \
                 SET jit = off",
                hold_limit.as_millis().max(1),
                half.as_millis().max(1)
            ))
            .await?;
        Ok(session)
    };
    answered(half, setup).await
}

/// Why the relay cannot work through this connection string.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Session state did not stay with this client between two statements:
    /// a transaction- or statement-mode pooler sits in front of Postgres.
    #[error(
        "postgres at {target} does not keep a session between statements, as a \
         transaction- or statement-mode pooler (PgBouncer, RDS Proxy, Supavisor...) does; \
         the relay needs one for its row locks, advisory locks and LISTEN: connect it \
         to Postgres directly, or through a session-mode pool"
    )]
    Pooled {
        /// Host, port and database, without credentials.
        target: String,
    },
    /// The probe itself could not run.
    #[error("cannot check the postgres session: {}", PgError(.0))]
    Postgres(tokio_postgres::Error),
}

impl From<tokio_postgres::Error> for SessionError {
    fn from(e: tokio_postgres::Error) -> Self {
        SessionError::Postgres(e)
    }
}

/// Checks that a connection to `db` is a session of its own, as the relay
/// needs: its claims hold row locks across statements, its ownership holds
/// session advisory locks, and its listener holds LISTEN. Behind a
/// transaction pooler each statement may run on another server connection,
/// so the relay would half work: some batches fail, and partitions stay owned
/// by server connections that no relay holds any more. See
/// [`outbox_client::session::keeps_session`] for how it is told.
pub async fn check_session(db: &Database) -> Result<(), SessionError> {
    let first = db.connect_spawned().await?;
    let mut second = db.connect_spawned().await?;
    if outbox_client::session::keeps_session(&first, &mut second).await? {
        return Ok(());
    }
    let c = db.config();
    let host = c
        .get_hosts()
        .first()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            #[cfg(unix)]
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .unwrap_or_default();
    let port = c.get_ports().first().copied().unwrap_or(5432);
    Err(SessionError::Pooled {
        target: format!("{host}:{port}/{}", c.get_dbname().unwrap_or("")),
    })
}
