//! What the relay loop needs from where the rows live, as a boundary: a
//! [`Store`] opens sessions, a [`Session`] runs one batch transaction at a
//! time, and a [`BatchTx`] claims rows and settles them before it commits.
//! Dropping a `BatchTx` without committing rolls it back: every row it
//! claimed is released as it was.
//!
//! [`PgStore`] is the real one. The relay crate's own tests drive the loop
//! over an in-memory store with paused tokio time, so its scheduling (the
//! pauses, the hand-offs, the deadlines) is tested without a database.

use std::fmt;
use std::future::Future;
use std::time::{Duration, SystemTime};

use tokio_postgres::{Client, Transaction};

use super::claim::{ClaimLimits, Claimed, Prepared, Queries};
use super::{Database, PgError};
use crate::envelope::{Envelope, Receipt};

/// Where batches come from: one session per worker, reopened after a failure.
pub(crate) trait Store: Send + Sync + 'static {
    /// One worker's connection.
    type Session: Session;

    /// Connects and prepares what every batch runs.
    fn open(&self) -> impl Future<Output = Result<Self::Session, OpenError>> + Send + '_;
}

/// A connection that runs one batch transaction at a time.
pub(crate) trait Session: Send {
    /// A batch's transaction, borrowing the session until it ends.
    type Tx<'a>: BatchTx + 'a
    where
        Self: 'a;

    /// Starts a batch's transaction.
    fn begin(&mut self) -> impl Future<Output = Result<Self::Tx<'_>, StoreError>> + Send + '_;

    /// Whether the connection is gone (a failed statement then means the
    /// session must be reopened, not just the batch retried).
    fn is_closed(&self) -> bool;
}

/// One batch's transaction. Every method's changes become visible only at
/// [`BatchTx::commit`].
pub(crate) trait BatchTx: Send {
    /// Locks and returns the oldest ready rows of `partitions`, up to
    /// `limits`; rows below `floor` are not looked at as fresh rows (see
    /// [`crate::source::floor`]).
    fn claim<'a>(
        &'a mut self,
        limits: &'a ClaimLimits,
        partitions: &'a [i16],
        floor: i64,
    ) -> impl Future<Output = Result<Claimed, StoreError>> + Send + 'a;

    /// Sets rows of blocked keys aside until the given times.
    fn hold<'a>(
        &'a mut self,
        holds: &'a [(i64, SystemTime)],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

    /// Settles a batch the broker answered: the confirmed rows go (or move
    /// to `published` with their receipts), the rejected ones wait out their
    /// retry delay, the dead ones move to the dead letters.
    fn settle<'a>(
        &'a mut self,
        settle: Settle<'a>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// Records a whole-batch failure on the rows, without counting an attempt.
    fn note_batch_error<'a>(
        &'a mut self,
        seqs: &'a [i64],
        error: &'a str,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

    /// Deletes rows unconditionally (only the ack-before-confirm mutant does).
    fn delete<'a>(
        &'a mut self,
        seqs: &'a [i64],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

    /// Commits everything above.
    fn commit(self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// What a settle writes, from [`crate::engine`]'s settle plan.
pub(crate) struct Settle<'a> {
    /// Rows the broker confirmed, with its receipts.
    pub(crate) published: &'a [(&'a Envelope, Receipt)],
    /// Rows it refused: seq, reason, delay until the next attempt.
    pub(crate) failed: &'a [(i64, String, Duration)],
    /// Rows of blocked keys to set aside.
    pub(crate) holds: &'a [(i64, SystemTime)],
    /// Rows that ran out of attempts: seq, final reason.
    pub(crate) dead: &'a [(i64, String)],
}

/// A store that failed, with what the server said.
#[derive(Debug)]
pub(crate) struct StoreError(Cause);

#[derive(Debug)]
enum Cause {
    Postgres(tokio_postgres::Error),
    #[cfg(test)]
    Memory(&'static str),
}

impl StoreError {
    /// A failure of the in-memory store of the loop's tests.
    #[cfg(test)]
    pub(crate) fn memory(what: &'static str) -> Self {
        StoreError(Cause::Memory(what))
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        StoreError(Cause::Postgres(e))
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Cause::Postgres(e) => PgError(e).fmt(f),
            #[cfg(test)]
            Cause::Memory(what) => f.write_str(what),
        }
    }
}

impl std::error::Error for StoreError {}

/// Why a session could not open.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// No connection.
    Connect(StoreError),
    /// Connected, but the batch statements would not prepare.
    Prepare(StoreError),
}

/// The outbox in Postgres: each session is its own connection with the
/// batch statements prepared on it.
pub(crate) struct PgStore {
    pg: Database,
    queries: Queries,
    hold_limit: Duration,
}

impl PgStore {
    /// Sessions to `pg`, set up for `hold_limit` (see [`super::connect`]).
    pub(crate) fn new(pg: Database, queries: Queries, hold_limit: Duration) -> Self {
        PgStore {
            pg,
            queries,
            hold_limit,
        }
    }
}

/// One worker's Postgres connection.
pub(crate) struct PgSession {
    client: Client,
    prepared: Prepared,
    queries: Queries,
}

/// One batch's Postgres transaction.
pub(crate) struct PgTx<'a> {
    tx: Transaction<'a>,
    prepared: &'a Prepared,
    queries: &'a Queries,
}

impl Store for PgStore {
    type Session = PgSession;

    async fn open(&self) -> Result<PgSession, OpenError> {
        let client = super::connect(&self.pg, self.hold_limit)
            .await
            .map_err(|e| OpenError::Connect(e.into()))?;
        let prepared = self
            .queries
            .prepare(&client)
            .await
            .map_err(|e| OpenError::Prepare(e.into()))?;
        Ok(PgSession {
            client,
            prepared,
            queries: self.queries.clone(),
        })
    }
}

impl Session for PgSession {
    type Tx<'a> = PgTx<'a>;

    async fn begin(&mut self) -> Result<PgTx<'_>, StoreError> {
        Ok(PgTx {
            tx: self.client.transaction().await?,
            prepared: &self.prepared,
            queries: &self.queries,
        })
    }

    fn is_closed(&self) -> bool {
        self.client.is_closed()
    }
}

impl BatchTx for PgTx<'_> {
    async fn claim(
        &mut self,
        limits: &ClaimLimits,
        partitions: &[i16],
        floor: i64,
    ) -> Result<Claimed, StoreError> {
        Ok(self
            .queries
            .claim(&self.tx, self.prepared, limits, partitions, floor)
            .await?)
    }

    async fn hold(&mut self, holds: &[(i64, SystemTime)]) -> Result<u64, StoreError> {
        Ok(self.queries.hold(&self.tx, holds).await?)
    }

    async fn settle(&mut self, settle: Settle<'_>) -> Result<(), StoreError> {
        let q = self.queries;
        q.settle_published(&self.tx, self.prepared, settle.published)
            .await?;
        q.fail(&self.tx, settle.failed).await?;
        q.hold(&self.tx, settle.holds).await?;
        q.dead_letter(&self.tx, settle.dead).await?;
        Ok(())
    }

    async fn note_batch_error(&mut self, seqs: &[i64], error: &str) -> Result<u64, StoreError> {
        Ok(self.queries.note_batch_error(&self.tx, seqs, error).await?)
    }

    async fn delete(&mut self, seqs: &[i64]) -> Result<u64, StoreError> {
        Ok(self.queries.delete(&self.tx, seqs).await?)
    }

    async fn commit(self) -> Result<(), StoreError> {
        Ok(self.tx.commit().await?)
    }
}
