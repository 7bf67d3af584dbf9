//! Apply each delivered message once: the inbox of processed message ids.
//!
//! At-least-once delivery moves duplicates to the consumer. The defense is to
//! record the message id **in the same transaction as the effect**, with a unique
//! key doing the work:
//!
//! ```no_run
//! # async fn example(client: &mut tokio_postgres::Client, id: &str) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::inbox::{self, Arrival};
//!
//! let tx = client.transaction().await?;
//! if inbox::process_once(&tx, "billing", id).await? == Arrival::New {
//!     tx.execute("UPDATE accounts SET credits = credits + 100 WHERE id = $1", &[&7i64]).await?;
//! }
//! tx.commit().await?;
//! // Only now ack the delivery (or commit the Kafka offset). A duplicate is a
//! // success too: ack it, or the broker delivers it again and again.
//! # Ok(()) }
//! ```
//!
//! Why this shape and no other:
//!
//! - **`INSERT ... ON CONFLICT DO NOTHING`, never `SELECT` then `INSERT`.** Two
//!   consumers can both `SELECT`, both see nothing and both apply the effect. With
//!   the insert, the second one blocks on the first one's uncommitted key; if the
//!   first commits, the second sees a duplicate; if it rolls back, the second
//!   goes ahead.
//! - **The record and the effect commit together.** Recorded first and committed
//!   apart, a crash before the effect loses the message; applied first, a crash
//!   before the record repeats it.
//! - **Ack after commit.** A crash between the commit and the ack redelivers the
//!   message, and the redelivery finds its id and is acked without effect.
//!
//! The helpers in [`crate::consumer`] wire this to RabbitMQ and Kafka.
//!
//! # Retention
//!
//! [`Inbox::purge`] deletes entries older than a window, in batches. The window
//! must be longer than the latest a duplicate can arrive: broker redelivery after
//! a consumer outage, a webhook provider's retry schedule (days for some), a
//! replay of a Kafka topic from an old offset. An id purged too early is applied
//! again.
//!
//! # From other languages
//!
//! The migration also creates two SQL functions, so a consumer written in any
//! language gets the same check (schema `outbox` here):
//!
//! ```sql
//! BEGIN;
//! SELECT outbox.inbox_process_once('billing', '0190f3c2-7a4e-7cc1-9f5e-2b1d0c9a8e77');
//! -- true: apply the effect here, in this transaction; false: a duplicate, skip it
//! COMMIT;
//! -- then ack the message
//!
//! -- retention, e.g. from cron: repeat until it returns 0
//! SELECT outbox.inbox_purge(interval '14 days', 1000);
//! ```

use std::time::Duration;

use tokio_postgres::{GenericClient, Transaction};

use crate::{Error, SchemaName, MAX_KEY_BYTES};

/// Whether a delivery arrives for the first time or again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "a duplicate must skip the effect"]
pub enum Arrival {
    /// First time: apply the effect in the same transaction, then commit.
    New,
    /// Already applied (committed by an earlier or concurrent delivery). Skip the
    /// effect, and treat the delivery as a success: ack it, answer 200.
    Duplicate,
}

/// The old name of [`Arrival`].
#[deprecated(since = "0.1.0", note = "renamed to `Arrival`")]
pub type Outcome = Arrival;

impl Arrival {
    /// True for [`Arrival::New`].
    pub fn is_new(self) -> bool {
        self == Arrival::New
    }
}

/// The inbox of one schema. Cheap to clone; build one at start-up.
#[derive(Debug, Clone)]
pub struct Inbox {
    schema: SchemaName,
    insert_sql: String,
    purge_sql: String,
}

impl Default for Inbox {
    fn default() -> Self {
        Inbox::with_schema(SchemaName::default())
    }
}

impl Inbox {
    /// The inbox in schema `schema`, validated as an identifier.
    pub fn new(schema: &str) -> Result<Self, Error> {
        Ok(Inbox::with_schema(SchemaName::new(schema)?))
    }

    /// The inbox in an already validated schema.
    pub fn with_schema(schema: SchemaName) -> Self {
        let q = schema.quoted();
        Inbox {
            insert_sql: format!(
                "INSERT INTO {q}.inbox (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING"
            ),
            purge_sql: format!("SELECT {q}.inbox_purge(make_interval(secs => $1), $2)"),
            schema,
        }
    }

    /// The schema this inbox lives in.
    pub fn schema(&self) -> &SchemaName {
        &self.schema
    }

    /// Records `message_id` for `consumer` in the caller's transaction and says
    /// whether it is new.
    ///
    /// Takes a [`Transaction`], not any client: on an autocommit connection the
    /// record would commit on its own, apart from the effect, which is exactly
    /// the bug this prevents. When another transaction has recorded the same id
    /// and not yet finished, this waits for it (the unique key's lock) and then
    /// answers `Duplicate` if it committed, `New` if it rolled back. Under
    /// `REPEATABLE READ` or `SERIALIZABLE`, a commit that lands after this
    /// transaction's snapshot is a serialization failure instead
    /// ([`Error::is_retryable`]): roll back and run the message again.
    pub async fn process_once(
        &self,
        tx: &Transaction<'_>,
        consumer: &str,
        message_id: &str,
    ) -> Result<Arrival, Error> {
        check_key("consumer name", consumer)?;
        check_key("message id", message_id)?;
        let inserted = tx
            .execute(self.insert_sql.as_str(), &[&consumer, &message_id])
            .await
            .map_err(|e| Error::from_db_no_conflict(&self.schema, e))?;
        Ok(if inserted == 1 {
            Arrival::New
        } else {
            Arrival::Duplicate
        })
    }

    /// Deletes entries processed more than `older_than` ago, `batch_size` rows per
    /// statement, until none is left; returns how many it deleted.
    ///
    /// Pass a [`tokio_postgres::Client`] so each batch commits on its own and
    /// holds its locks briefly. Entries being deleted concurrently by another
    /// purge are skipped, so several instances may run it at once.
    pub async fn purge(
        &self,
        client: &impl GenericClient,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, Error> {
        let secs = older_than.as_secs_f64();
        let batch = i32::try_from(batch_size.max(1)).unwrap_or(i32::MAX);
        let mut total = 0u64;
        loop {
            let deleted: i64 = client
                .query_one(self.purge_sql.as_str(), &[&secs, &batch])
                .await
                .map_err(|e| Error::from_db_no_conflict(&self.schema, e))?
                .get(0);
            total += u64::try_from(deleted).unwrap_or(0);
            if deleted < i64::from(batch) {
                return Ok(total);
            }
        }
    }
}

/// [`Inbox::process_once`] on the default schema (`outbox`).
pub async fn process_once(
    tx: &Transaction<'_>,
    consumer: &str,
    message_id: &str,
) -> Result<Arrival, Error> {
    Inbox::default()
        .process_once(tx, consumer, message_id)
        .await
}

/// A key must be non-empty, storable as Postgres text (no NUL), and within
/// [`MAX_KEY_BYTES`] so that its table's index can hold it.
pub(crate) fn check_key(what: &'static str, value: &str) -> Result<(), Error> {
    if value.is_empty() {
        Err(Error::EmptyKey { what })
    } else if value.contains('\0') {
        Err(Error::ContainsNul { what })
    } else if value.len() > MAX_KEY_BYTES {
        Err(Error::KeyTooLong {
            what,
            size: value.len(),
            limit: MAX_KEY_BYTES,
        })
    } else {
        Ok(())
    }
}
