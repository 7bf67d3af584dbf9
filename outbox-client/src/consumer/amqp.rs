//! RabbitMQ (lapin) consumers that apply each delivery once.
//!
//! ```no_run
//! # use outbox_client::consumer::Handler;
//! # struct Credit;
//! # impl Handler<lapin::message::Delivery> for Credit {
//! #     type Error = tokio_postgres::Error;
//! #     async fn handle(&self, tx: &tokio_postgres::Transaction<'_>, d: &lapin::message::Delivery) -> Result<(), Self::Error> { Ok(()) }
//! # }
//! # async fn example(db: &mut tokio_postgres::Client, channel: lapin::Channel) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::consumer::amqp::{AmqpInbox, MissingIdPolicy};
//! use outbox_client::inbox::Inbox;
//!
//! let mut deliveries = channel
//!     .basic_consume("billing".into(), "".into(), Default::default(), Default::default())
//!     .await?;
//! let consumer = AmqpInbox::new(Inbox::default(), "billing")?
//!     .missing_id(MissingIdPolicy::DeadLetter);
//! consumer.run(db, &mut deliveries, &Credit).await?; // until the consumer is cancelled
//! # Ok(()) }
//! ```

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use tokio_postgres::Client;

use super::{apply_once, usable_id, ConsumeError, Handler};
use crate::inbox::{check_key, Arrival, Inbox};
use crate::Error;

/// What to do with a delivery that has no `message_id` property.
///
/// It is never requeued: it would come back without an id every time. Both
/// policies hand it to the queue's dead-letter exchange when one is configured
/// (`x-dead-letter-exchange`) and discard it otherwise; RabbitMQ treats the two
/// methods alike (the `x-death` reason is `rejected` for both), so the choice
/// matters only to tooling that tells them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingIdPolicy {
    /// `basic.reject` without requeue.
    Reject,
    /// `basic.nack` without requeue.
    #[default]
    DeadLetter,
}

/// Applies RabbitMQ deliveries once per `message_id`, for one named consumer.
#[derive(Debug, Clone)]
pub struct AmqpInbox {
    inbox: Inbox,
    consumer: String,
    missing_id: MissingIdPolicy,
}

impl AmqpInbox {
    /// A consumer named `consumer` (the inbox key's first half: use one name per
    /// logical consumer, shared by all its replicas).
    pub fn new(inbox: Inbox, consumer: impl Into<String>) -> Result<Self, Error> {
        let consumer = consumer.into();
        check_key("consumer name", &consumer)?;
        Ok(AmqpInbox {
            inbox,
            consumer,
            missing_id: MissingIdPolicy::default(),
        })
    }

    /// Sets the policy for deliveries without a message id.
    pub fn missing_id(mut self, policy: MissingIdPolicy) -> Self {
        self.missing_id = policy;
        self
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Processes one delivery: inbox check and handler in one transaction, commit,
    /// then ack. A duplicate is acked and returns `Ok(Arrival::Duplicate)`.
    ///
    /// On a handler or database error the transaction is rolled back and the
    /// delivery is nacked with requeue, so it comes again. A message that always
    /// fails comes back forever: bound it with a quorum queue's
    /// `x-delivery-limit` and a dead-letter exchange.
    pub async fn handle<H>(
        &self,
        client: &mut Client,
        delivery: &Delivery,
        handler: &H,
    ) -> Result<Arrival, ConsumeError<H::Error>>
    where
        H: Handler<Delivery>,
    {
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str())
            .filter(|s| usable_id(s));
        let Some(message_id) = message_id else {
            tracing::warn!(
                consumer = %self.consumer,
                routing_key = %delivery.routing_key,
                policy = ?self.missing_id,
                "delivery without a usable message id"
            );
            match self.missing_id {
                MissingIdPolicy::Reject => delivery
                    .reject(BasicRejectOptions { requeue: false })
                    .await
                    .map_err(ConsumeError::Amqp)?,
                MissingIdPolicy::DeadLetter => delivery
                    .nack(BasicNackOptions {
                        requeue: false,
                        multiple: false,
                    })
                    .await
                    .map_err(ConsumeError::Amqp)?,
            };
            return Err(ConsumeError::MissingMessageId);
        };
        match apply_once(
            client,
            &self.inbox,
            &self.consumer,
            message_id,
            delivery,
            handler,
        )
        .await
        {
            Ok(outcome) => {
                delivery
                    .ack(BasicAckOptions::default())
                    .await
                    .map_err(ConsumeError::Amqp)?;
                tracing::debug!(consumer = %self.consumer, message_id, ?outcome, "delivery acked");
                Ok(outcome)
            }
            Err(e) => {
                tracing::warn!(consumer = %self.consumer, message_id, error = %e, "delivery requeued");
                // If the nack itself fails the channel is gone, and RabbitMQ
                // requeues every unacked delivery of a closed channel anyway.
                let _ = delivery
                    .nack(BasicNackOptions {
                        requeue: true,
                        multiple: false,
                    })
                    .await;
                Err(e)
            }
        }
    }

    /// Handles deliveries from `deliveries` one at a time until the consumer is
    /// cancelled (returns `Ok`), the channel fails or the database connection is
    /// lost (returns the error). Handler errors and deliveries without an id are
    /// logged and settled as [`AmqpInbox::handle`] does, and consuming goes on.
    pub async fn run<H>(
        &self,
        client: &mut Client,
        deliveries: &mut lapin::Consumer,
        handler: &H,
    ) -> Result<(), ConsumeError<H::Error>>
    where
        H: Handler<Delivery>,
    {
        while let Some(next) = deliveries.next().await {
            let delivery = next.map_err(ConsumeError::Amqp)?;
            match self.handle(client, &delivery, handler).await {
                Ok(_)
                | Err(ConsumeError::MissingMessageId)
                | Err(ConsumeError::Handler(_))
                | Err(ConsumeError::Aborted(_)) => {}
                Err(e) if e.is_closed() => return Err(e),
                Err(ConsumeError::Inbox(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}
