//! Consumers that apply each message once: the inbox check, the handler's effect
//! and the commit in one transaction, and the broker acknowledgement only after
//! the commit.
//!
//! [`apply_once`] is the broker-neutral core. With cargo features, `amqp`
//! (lapin) and `kafka` (rdkafka) add helpers that take the message id from the
//! delivery (AMQP `message_id` property, Kafka `message-id` header, both set by
//! `outbox-relay`) and settle it with the broker:
//!
//! | outcome                     | RabbitMQ                        | Kafka                              |
//! |-----------------------------|---------------------------------|------------------------------------|
//! | new, handler ok             | commit, then ack                | commit, then commit the offset     |
//! | duplicate                   | ack (a success, no effect)      | commit the offset                  |
//! | handler or database error   | rollback, nack with requeue     | rollback, seek back to the message |
//! | no message id               | reject or dead-letter (policy)  | skip or halt (policy)              |
//!
//! A crash between the database commit and the acknowledgement redelivers the
//! message; its id is then found and the redelivery is acknowledged without
//! effect. That window is why the order is commit, then ack: the other order
//! loses the message when the crash falls between the ack and the commit.
//!
//! A handler implements [`Handler`]; its effect must go through the transaction
//! it is given (that is what makes it atomic with the record). Effects outside
//! the database (an HTTP call, an email) are not covered: see
//! [`crate::send_once`] for those.
//!
//! ```no_run
//! use outbox_client::consumer::Handler;
//! use tokio_postgres::Transaction;
//!
//! struct Credit;
//!
//! impl Handler<[u8]> for Credit {
//!     type Error = tokio_postgres::Error;
//!     async fn handle(&self, tx: &Transaction<'_>, body: &[u8]) -> Result<(), Self::Error> {
//!         let account = String::from_utf8_lossy(body).into_owned();
//!         tx.execute("UPDATE accounts SET credits = credits + 100 WHERE name = $1", &[&account])
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = outbox_client::inbox::Inbox::default();
//! let outcome = outbox_client::consumer::apply_once(
//!     client, &inbox, "billing", "evt_1", b"acme".as_slice(), &Credit,
//! )
//! .await?;
//! # Ok(()) }
//! ```

use std::future::Future;

use tokio_postgres::{Client, Transaction};

use crate::inbox::{Arrival, Inbox};
use crate::Error;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "kafka")]
pub mod kafka;

/// Applies one message's effect inside the transaction that records its id.
///
/// Implement it with an `async fn`. Everything the effect writes must go through
/// `tx`; return an error to roll the transaction back and have the message
/// delivered again.
pub trait Handler<M: ?Sized>: Sync {
    /// The handler's own error, reported as [`ConsumeError::Handler`].
    type Error: std::error::Error + Send + Sync + 'static;

    /// Applies the effect of `message` in `tx`. Called only for new messages.
    fn handle(
        &self,
        tx: &Transaction<'_>,
        message: &M,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// What went wrong while consuming one message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumeError<E> {
    /// The delivery carries no usable message id (none, an empty one, one
    /// with a NUL character, which Postgres text cannot store, or one over
    /// [`crate::MAX_KEY_BYTES`]; on Kafka also one that is not UTF-8), so it
    /// cannot be deduplicated; it was settled according to the consumer's
    /// missing-id policy.
    #[error("delivery has no usable message id")]
    MissingMessageId,
    /// The inbox check, the transaction or its commit failed; the transaction
    /// was rolled back and the message will be delivered again.
    #[error("inbox transaction failed")]
    Inbox(#[source] Error),
    /// The handler failed; the transaction was rolled back and the message will
    /// be delivered again.
    #[error("message handler failed")]
    Handler(#[source] E),
    /// The handler returned `Ok`, but a statement it ran had failed, which
    /// aborted the transaction: nothing was committed, and the message will be
    /// delivered again. Postgres answers a COMMIT in an aborted transaction by
    /// rolling it back, without an error, so this is checked before the
    /// commit. To go on past a statement that may fail (a unique violation
    /// taken as "already there", say), run it in a savepoint
    /// (`tx.savepoint(..)`) and roll that back.
    #[error(
        "the message handler returned Ok from an aborted transaction (a statement of its \
         failed); nothing was committed"
    )]
    Aborted(#[source] Error),
    /// The broker call that settles the delivery failed. If the transaction had
    /// committed, the redelivery is recognized as a duplicate.
    #[cfg(feature = "amqp")]
    #[error("rabbitmq call failed")]
    Amqp(#[source] lapin::Error),
    /// The Kafka offset commit or seek failed. If the transaction had committed,
    /// the redelivery is recognized as a duplicate.
    #[cfg(feature = "kafka")]
    #[error("kafka call failed")]
    Kafka(#[source] rdkafka::error::KafkaError),
}

/// Whether a delivery's message id can be recorded in the inbox: what
/// [`crate::inbox::check_key`] accepts.
#[cfg(any(feature = "amqp", feature = "kafka"))]
pub(crate) fn usable_id(id: &str) -> bool {
    crate::inbox::check_key("message id", id).is_ok()
}

impl<E> ConsumeError<E> {
    /// True when the Postgres connection is gone: the consumer should reconnect
    /// rather than take the next message.
    pub fn is_closed(&self) -> bool {
        matches!(self, ConsumeError::Inbox(e) if e.is_closed())
    }
}

/// Records `message_id` for `consumer` and, if it is new, runs `handler` in the
/// same transaction, then commits.
///
/// Returns [`Arrival::Duplicate`] without calling the handler when the id was
/// already committed: the caller acknowledges it like any success. On any error
/// nothing is committed. Acknowledge the message to the broker only after this
/// returns `Ok`.
pub async fn apply_once<M, H>(
    client: &mut Client,
    inbox: &Inbox,
    consumer: &str,
    message_id: &str,
    message: &M,
    handler: &H,
) -> Result<Arrival, ConsumeError<H::Error>>
where
    M: ?Sized + Sync,
    H: Handler<M>,
{
    let tx = client
        .transaction()
        .await
        .map_err(|e| ConsumeError::Inbox(e.into()))?;
    let outcome = inbox
        .process_once(&tx, consumer, message_id)
        .await
        .map_err(ConsumeError::Inbox)?;
    if outcome == Arrival::Duplicate {
        // Nothing was written; ending the transaction either way is the same.
        tx.rollback()
            .await
            .map_err(|e| ConsumeError::Inbox(e.into()))?;
        tracing::debug!(consumer, message_id, "duplicate delivery skipped");
        return Ok(outcome);
    }
    // On a handler error `tx` is dropped, which rolls it back.
    handler
        .handle(&tx, message)
        .await
        .map_err(ConsumeError::Handler)?;
    // One statement before the commit tells an aborted transaction: its
    // COMMIT would end in a rollback that tokio-postgres reports as success,
    // and the message would be settled with neither its effect nor its id.
    tx.batch_execute("SELECT 1").await.map_err(|e| {
        if e.code() == Some(&tokio_postgres::error::SqlState::IN_FAILED_SQL_TRANSACTION) {
            ConsumeError::Aborted(e.into())
        } else {
            ConsumeError::Inbox(e.into())
        }
    })?;
    tx.commit()
        .await
        .map_err(|e| ConsumeError::Inbox(e.into()))?;
    Ok(outcome)
}
