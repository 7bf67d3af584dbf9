//! Long jobs that resume where they stopped: batches in key order, with the
//! progress saved in the same transaction as each batch's effect.
//!
//! A job that walks 100,000 rows and dies at row 60,000 should neither start over
//! nor apply its effect to the first 60,000 again. Each [`Batch`] is one
//! transaction: it reads the last committed key (locking the job's checkpoint
//! row), the caller selects the next rows after it and applies their effect
//! through the batch's transaction, and [`Batch::commit`] saves the new position
//! in that same transaction. A crash before the commit loses the batch's effect
//! and its progress together; one after it keeps both. So no batch's effect is
//! applied twice, provided the effect is written through [`Batch::transaction`].
//!
//! ```no_run
//! # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::checkpoint::Checkpoint;
//!
//! let job = Checkpoint::new(Default::default(), "recalc-stats")?;
//! loop {
//!     let batch = job.begin(client).await?;
//!     let rows = batch
//!         .transaction()
//!         .query("SELECT id FROM links WHERE id > $1 ORDER BY id LIMIT 1000", &[&batch.after()])
//!         .await?;
//!     let Some(last) = rows.last().map(|r| r.get::<_, i64>(0)) else {
//!         batch.finish().await?; // nothing left
//!         break;
//!     };
//!     let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
//!     batch
//!         .transaction()
//!         .execute("UPDATE links SET clicks_total = clicks_total + 1 WHERE id = ANY($1)", &[&ids])
//!         .await?;
//!     batch.commit(last).await?; // effect and progress, atomically
//! }
//! # Ok(()) }
//! ```
//!
//! Keys are `bigint` and must be unique and ordered (a primary key); rows
//! inserted later with a key below the checkpoint are not visited. Two runners of
//! the same job are safe: the checkpoint row's lock makes them take turns, batch
//! by batch, each starting after the other's last commit. Effects outside the
//! database (HTTP calls) are not covered by the transaction and must be
//! idempotent on their own.

use tokio_postgres::{Client, GenericClient, Transaction};

use crate::inbox::check_key;
use crate::{Error, SchemaName};

/// The position of a job that has not committed a batch yet: below every key.
pub const START: i64 = i64::MIN;

/// The checkpoint of one named job.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    schema: SchemaName,
    job: String,
    table: String,
}

impl Checkpoint {
    /// The checkpoint of `job` in `schema`.
    pub fn new(schema: SchemaName, job: impl Into<String>) -> Result<Self, Error> {
        let job = job.into();
        check_key("job name", &job)?;
        Ok(Checkpoint {
            table: format!("{}.checkpoints", schema.quoted()),
            schema,
            job,
        })
    }

    /// The job's name.
    pub fn job(&self) -> &str {
        &self.job
    }

    /// The last committed key, or `None` before the first batch commits.
    pub async fn position(&self, client: &impl GenericClient) -> Result<Option<i64>, Error> {
        let row = client
            .query_opt(
                &format!("SELECT position FROM {} WHERE job = $1", self.table),
                &[&self.job],
            )
            .await
            .map_err(|e| Error::from_db_no_conflict(&self.schema, e))?;
        Ok(row.map(|r| r.get::<_, i64>(0)).filter(|p| *p != START))
    }

    /// Starts a batch: opens a transaction on `client` and locks the job's
    /// checkpoint row (creating it at [`START`] the first time). Another runner's
    /// `begin` waits until this batch commits or rolls back.
    pub async fn begin<'c>(&self, client: &'c mut Client) -> Result<Batch<'c>, Error> {
        let tx = client.transaction().await?;
        // DO UPDATE rather than DO NOTHING: it locks an existing row and returns
        // its latest committed position, in one round trip.
        let after: i64 = tx
            .query_one(
                &format!(
                    "INSERT INTO {t} (job, position) VALUES ($1, $2) \
                     ON CONFLICT (job) DO UPDATE SET position = {t}.position \
                     RETURNING position",
                    t = self.table
                ),
                &[&self.job, &START],
            )
            .await
            .map_err(|e| Error::from_db_no_conflict(&self.schema, e))?
            .get(0);
        Ok(Batch {
            tx,
            after,
            checkpoint: self.clone(),
        })
    }

    /// Moves the job back to the start, e.g. to run it again from scratch.
    pub async fn reset(&self, client: &impl GenericClient) -> Result<(), Error> {
        client
            .execute(
                &format!("DELETE FROM {} WHERE job = $1", self.table),
                &[&self.job],
            )
            .await
            .map_err(|e| Error::from_db_no_conflict(&self.schema, e))?;
        Ok(())
    }
}

/// One batch of a checkpointed job: a transaction holding the job's checkpoint.
/// Dropping it without [`Batch::commit`] rolls back the effect and the progress.
#[must_use = "a batch does nothing until committed"]
pub struct Batch<'c> {
    tx: Transaction<'c>,
    after: i64,
    checkpoint: Checkpoint,
}

impl std::fmt::Debug for Batch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("job", &self.checkpoint.job)
            .field("after", &self.after)
            .finish_non_exhaustive()
    }
}

impl<'c> Batch<'c> {
    /// The last committed key: select the rows with keys greater than this.
    pub fn after(&self) -> i64 {
        self.after
    }

    /// The batch's transaction: read the rows and write the effect through it.
    pub fn transaction(&self) -> &Transaction<'c> {
        &self.tx
    }

    /// Saves `last_key` (the greatest key in this batch) as the position and
    /// commits it together with the batch's effect.
    pub async fn commit(self, last_key: i64) -> Result<(), Error> {
        if last_key <= self.after {
            return Err(Error::CheckpointNotAdvancing {
                job: self.checkpoint.job.clone(),
                position: self.after,
                last_key,
            });
        }
        self.tx
            .execute(
                &format!(
                    "UPDATE {} SET position = $2, updated_at = now() WHERE job = $1",
                    self.checkpoint.table
                ),
                &[&self.checkpoint.job, &last_key],
            )
            .await
            .map_err(|e| Error::from_db_no_conflict(&self.checkpoint.schema, e))?;
        self.tx.commit().await?;
        Ok(())
    }

    /// Ends a batch that found nothing to do, keeping the position.
    pub async fn finish(self) -> Result<(), Error> {
        self.tx.commit().await?;
        Ok(())
    }
}
