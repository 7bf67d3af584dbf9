//! Run a scheduled job on one instance at a time: a Postgres session-level
//! advisory lock, held on a connection of its own for the job's whole life.
//!
//! A timer inside the app (a cron crate, `tokio::time::interval`) fires on every
//! replica: with three instances the weekly report goes out three times.
//! [`run_exclusive`] opens a dedicated connection, tries the lock without
//! waiting, runs the job only if it got it, and releases it when the job ends,
//! fails or panics:
//!
//! ```no_run
//! # async fn send_weekly_reports() -> Result<(), std::io::Error> { Ok(()) }
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::job_lock::{run_exclusive, Exclusive};
//!
//! let config: tokio_postgres::Config = "postgres://app@db/app".parse()?;
//! match run_exclusive(&config, "weekly-report", |_lease| send_weekly_reports()).await? {
//!     Exclusive::Ran(result) => result?,
//!     // The lock's session ended mid-job: another instance may have run it too.
//!     Exclusive::LostLock(result) => result?,
//!     Exclusive::Busy => {} // another instance is running it right now
//! }
//! # Ok(()) }
//! ```
//!
//! # Why a session lock on its own connection
//!
//! - **Not a transaction-level lock** (`pg_try_advisory_xact_lock`): it is released
//!   at the first `COMMIT`, so a job that commits as it goes loses the lock after
//!   its first batch; keeping one transaction open for the whole job instead holds
//!   back vacuum and keeps every row it touched locked until the end.
//! - **Not a pooled connection**: the lock belongs to the session. This
//!   includes a transaction- or statement-mode pooler such as PgBouncer in
//!   front of Postgres: [`run_exclusive`] checks for one and fails with
//!   [`JobLockError::NoSession`] rather than take a lock that would stay
//!   behind on a server connection. Returned to
//!   the pool while held, it stays locked by a connection that now serves other
//!   requests, and nobody runs the job until that connection closes. And session
//!   locks are re-entrant: a second job that borrows the same connection "gets" a
//!   lock its own process already holds, and runs concurrently.
//! - **A connection of its own** ties the lock to the job: when the job ends the
//!   lock is released explicitly, and if the process dies (or the future is
//!   dropped) the connection closes and the server releases the lock itself.
//!
//! The lock only prevents *simultaneous* runs. A job that failed halfway and runs
//! again later must still be idempotent: combine it with a record of what was
//! done ([`crate::checkpoint`], [`crate::send_once`]).
//!
//! The key is `hashtextextended(name, 0)`, so a job written in another language
//! takes the same lock with `SELECT pg_try_advisory_lock(hashtextextended('weekly-report', 0))`.
//!
//! If the lock's connection breaks while the job runs, the server has released
//! the lock and another instance may start. A job that must not overlap even then
//! checks [`Lease::is_held`] between steps. The job's output still comes back,
//! as [`Exclusive::LostLock`]: the job did its work, and the caller decides what
//! a run that was not exclusive throughout means.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Weak};

use futures::FutureExt;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Config, NoTls, Socket};

/// What went wrong around the job (the job's own result is returned in
/// [`Exclusive::Ran`] or [`Exclusive::LostLock`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobLockError {
    /// The job name is empty.
    #[error("job name is empty")]
    EmptyName,
    /// The job name holds a NUL character, which Postgres text cannot
    /// store.
    #[error("job name contains a NUL character")]
    NameContainsNul,
    /// Connecting to Postgres failed, or the lock query did.
    #[error("could not take the job lock")]
    Lock(#[source] tokio_postgres::Error),
    /// The connection string leads to a transaction- or statement-mode pooler
    /// (PgBouncer, RDS Proxy...): a session advisory lock would stay behind on
    /// a pooled server connection. Connect to Postgres directly, or through a
    /// session-mode pool.
    #[error(
        "the job lock needs a session of its own, but this connection goes through a \
         transaction- or statement-mode pooler; connect to Postgres directly or through \
         a session-mode pool"
    )]
    NoSession,
}

/// The result of [`run_exclusive`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Exclusive<T> {
    /// This instance held the lock and ran the job; the job's output.
    Ran(T),
    /// This instance took the lock and ran the job, but the lock's session
    /// ended before the job did (a failover, `pg_terminate_backend`, a
    /// network cut): the server released the lock then, and another
    /// instance may have run the job at the same time. The job's output.
    LostLock(T),
    /// Another session holds the lock: the job was not run.
    Busy,
}

/// A handle on the lock, passed to the job.
#[derive(Debug, Clone)]
pub struct Lease {
    // Weak, so a lease kept past the job does not keep the connection open.
    client: Weak<Client>,
}

impl Lease {
    /// False once the lock's connection has closed, which means the server has
    /// released the lock and another instance may take it, or once the job has
    /// ended.
    pub fn is_held(&self) -> bool {
        self.client.upgrade().is_some_and(|c| !c.is_closed())
    }
}

/// Runs `job` if, and only while, this process holds the advisory lock `name`;
/// returns [`Exclusive::Busy`] without waiting when another session holds it.
///
/// Opens a dedicated connection without TLS; see [`run_exclusive_with_tls`].
/// Needs a Tokio runtime (the connection is driven by a spawned task).
///
/// The lock is released when the job completes or returns an error. If the job
/// panics, the lock is released and the panic resumes. If this future is
/// dropped mid-job, the connection closes and the server releases the lock.
pub async fn run_exclusive<F, Fut, T>(
    config: &Config,
    name: &str,
    job: F,
) -> Result<Exclusive<T>, JobLockError>
where
    F: FnOnce(Lease) -> Fut,
    Fut: Future<Output = T>,
{
    run_exclusive_with_tls(config, NoTls, name, job).await
}

/// [`run_exclusive`] over a connection made with `tls`.
pub async fn run_exclusive_with_tls<M, F, Fut, T>(
    config: &Config,
    tls: M,
    name: &str,
    job: F,
) -> Result<Exclusive<T>, JobLockError>
where
    M: MakeTlsConnect<Socket> + Clone,
    M::Stream: Send + 'static,
    F: FnOnce(Lease) -> Fut,
    Fut: Future<Output = T>,
{
    if name.is_empty() {
        return Err(JobLockError::EmptyName);
    }
    if name.contains('\0') {
        return Err(JobLockError::NameContainsNul);
    }
    let (client, connection) = config
        .connect(tls.clone())
        .await
        .map_err(JobLockError::Lock)?;
    // The task ends when the client is dropped (or the server goes away), so it
    // cannot outlive this call by more than the close handshake.
    let driver = tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "job lock connection ended");
        }
    });
    // A second connection made the same way, only to tell a real session
    // from a pooled one.
    let (mut probe, probe_connection) = config.connect(tls).await.map_err(JobLockError::Lock)?;
    let probe_driver = tokio::spawn(probe_connection);
    let session = crate::session::keeps_session(&client, &mut probe)
        .await
        .map_err(JobLockError::Lock);
    drop(probe);
    let _ = probe_driver.await;
    if !session? {
        return Err(JobLockError::NoSession);
    }
    let client = Arc::new(client);
    let result = locked(&client, name, job).await;
    // Leases hold weak references, so this is the last strong one: dropping it
    // closes the session, which releases anything still held.
    drop(client);
    let _ = driver.await;
    match result {
        Ok(Locked::Busy) => Ok(Exclusive::Busy),
        Ok(Locked::Ran(Ok(out), Ok(()))) => Ok(Exclusive::Ran(out)),
        // The unlock failed only because the session had ended (closing it
        // released the lock, whatever the cause): the job's work is done,
        // and its output is the caller's.
        Ok(Locked::Ran(Ok(out), Err(e))) => {
            tracing::warn!(job = name, error = %e, "the job lock's session ended while the job ran");
            Ok(Exclusive::LostLock(out))
        }
        Ok(Locked::Ran(Err(panic), _)) => std::panic::resume_unwind(panic),
        Err(e) => Err(JobLockError::Lock(e)),
    }
}

enum Locked<T> {
    Busy,
    Ran(std::thread::Result<T>, Result<(), tokio_postgres::Error>),
}

async fn locked<F, Fut, T>(
    client: &Arc<Client>,
    name: &str,
    job: F,
) -> Result<Locked<T>, tokio_postgres::Error>
where
    F: FnOnce(Lease) -> Fut,
    Fut: Future<Output = T>,
{
    // The session sends nothing while the job runs: a server that ends idle
    // sessions (`idle_session_timeout` set for the database or role) would
    // end it mid-job and free the lock for another instance.
    client.batch_execute("SET idle_session_timeout = 0").await?;
    let got: bool = client
        .query_one(
            "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
            &[&name],
        )
        .await?
        .get(0);
    if !got {
        tracing::debug!(job = name, "job lock busy");
        return Ok(Locked::Busy);
    }
    tracing::debug!(job = name, "job lock taken");
    let lease = Lease {
        client: Arc::downgrade(client),
    };
    // A panicking job must not leave the lock held for as long as this process
    // (and its connection) lives: catch it, unlock, then let it continue.
    let outcome = AssertUnwindSafe(job(lease)).catch_unwind().await;
    let unlock = client
        .query_one(
            "SELECT pg_advisory_unlock(hashtextextended($1, 0))",
            &[&name],
        )
        .await
        .map(|_| ());
    tracing::debug!(job = name, "job lock released");
    Ok(Locked::Ran(outcome, unlock))
}
